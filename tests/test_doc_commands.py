"""Every ``python -m ...`` command quoted in README.md and docs/*.md names a module that exists,
and every ``--config.<field>=value`` override quoted with a ``--config`` file parses into a run
spec, and the flags of an entry that parses its own flags parse, so a reader who copies a command
never meets an unknown module, field or flag."""
import importlib
import importlib.util
import pathlib
import re
import shlex

import pytest
from absl import flags
from ml_collections import config_flags

from sparrow_jax.run.cli import parse_flags
from sparrow_jax.run.specs import ConfigError, parse_spec

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_CODE = re.compile(r"```[^\n]*\n(.*?)```|`([^`]+)`", re.DOTALL)
_PLACEHOLDER = re.compile(r"<[^>]*>|\$\{?\w+|\.\.\.")  # <dir>, $VAR, ...: left for the reader to fill


def _commands(text: str) -> list[str]:
    """``python -m`` commands in code spans and fenced blocks (a fenced line ending in ``\\``
    continues on the next; an inline span may wrap across lines of prose)."""
    out = []
    for block, span in _CODE.findall(text):
        code = (block or span).replace("\\\n", " ")
        for line in (code.splitlines() if block else [code.replace("\n", " ")]):
            for part in re.split(r"&&|\|\||;|\|", line):
                m = re.search(r"python3? -m \S.*", part)
                if m:
                    out.append(m.group(0).strip())
    return out


def _quoted() -> list[tuple[str, str]]:
    return [(f"{path.relative_to(ROOT)}", cmd) for path in DOCS for cmd in _commands(path.read_text())]


QUOTED = _quoted()


def _split(command: str) -> list[str]:
    """Shell words, comments dropped; a command quoted inside a larger string (``bash -c "..."``)
    may end in that string's closing quote."""
    try:
        return shlex.split(command, comments=True)
    except ValueError:
        return shlex.split(command.rstrip("\"'"), comments=True)


def test_docs_quote_commands():
    assert len(QUOTED) >= 5, QUOTED  # the extractor still finds the README's commands


@pytest.mark.parametrize("where,command", QUOTED)
def test_quoted_module_exists(where, command):
    module = _split(command)[2]
    if module in ("pytest", "pip"):
        return
    assert importlib.util.find_spec(module) is not None, f"{where}: `{command}` names no module {module!r}"


def _config_args(command: str) -> tuple[str | None, list[str]]:
    args = _split(command)[3:]
    config, overrides = None, []
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            config = args[i + 1]
        elif a.startswith("--config="):
            config = a.split("=", 1)[1]
        elif a.startswith("--config."):
            overrides.append(a)
    return config, overrides


WITH_CONFIG = [(w, c) for w, c in QUOTED if _config_args(c)[0] and not _PLACEHOLDER.search(_config_args(c)[0])]


def test_some_commands_have_configs():
    assert any(_config_args(c)[1] for _, c in WITH_CONFIG)  # overrides are checked, not skipped


@pytest.mark.parametrize("where,command", WITH_CONFIG)
def test_quoted_overrides_parse(where, command):
    config, quoted = _config_args(command)
    assert (ROOT / config).is_file(), f"{where}: `{command}`: no config file {config}"
    overrides = [a for a in quoted if not _PLACEHOLDER.search(a)]
    left_to_fill = {a.split("=", 1)[0][len("--config."):] for a in quoted if _PLACEHOLDER.search(a)}
    argv = ["prog", f"--config={ROOT / config}", *overrides]
    fv = flags.FlagValues()
    flag = config_flags.DEFINE_config_file("config", None, "", flag_values=fv, lock_config=True, sys_argv=argv)
    fv(argv)
    try:
        parse_spec(flag.value)
    except ConfigError as e:  # a path on the reader's machine (a checkpoint, a dataset) may not exist here
        field = re.match(r"--config\.([\w.]+)=", str(e))
        values = {a.split("=", 1)[0][len("--config."):]: a.split("=", 1)[1] for a in overrides}
        path = values.get(field.group(1), "") if field else ""
        assert (field and field.group(1) in left_to_fill) or ("/" in path and not (ROOT / path).exists()), \
            f"{where}: `{command}`: {e}"


POSITIONALS = {"experiments.make_tiny_qwen3": 1}  # entries whose commands carry positional arguments
_VALUE_PLACEHOLDER = re.compile(r"[A-Z]")  # --prompt_len N


def _flag_entry(command: str):
    """The ``define_flags`` of an entry that parses its own flags (``sparrow_jax.run.cli.parse_flags``), or None."""
    module = _split(command)[2]
    if not module.startswith("experiments.") or importlib.util.find_spec(module) is None:
        return None
    return getattr(importlib.import_module(module), "define_flags", None)


# a command that elides arguments (...) may leave out a required flag: not checked
FLAG_COMMANDS = [(w, c) for w, c in QUOTED if _flag_entry(c) is not None and "..." not in _split(c)]


def _given_args(command: str) -> list[str]:
    """The command's arguments, those left for the reader to fill (with their flag) and a
    launcher's arguments after ``--`` dropped."""
    args = _split(command)[3:]
    args = args[:args.index("--")] if "--" in args else args
    kept: list[str] = []
    for a in args:
        if _PLACEHOLDER.search(a) or _VALUE_PLACEHOLDER.fullmatch(a):
            if kept and kept[-1].startswith("--") and "=" not in kept[-1]:
                kept.pop()
            continue
        kept.append(a)
    return kept


def test_some_commands_have_own_flags():
    assert len(FLAG_COMMANDS) >= 5, FLAG_COMMANDS


@pytest.mark.parametrize("where,command", FLAG_COMMANDS)
def test_quoted_flags_parse(where, command, capsys):
    module = _split(command)[2]
    try:
        parse_flags(_flag_entry(command), _given_args(command), "", positionals=POSITIONALS.get(module, 0))
    except SystemExit:
        pytest.fail(f"{where}: `{command}`: {capsys.readouterr().err.strip()}")
