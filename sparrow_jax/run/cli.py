"""Entry-point helpers, the one flag system of ``experiments/``: absl flags.

* :func:`config_main`: parse ``--config`` (ml_collections) once into a :class:`RunSpec`; a bad
  config, an unknown override or a missing config file prints one line naming the field (or
  file) and exits with status 2 (no traceback).
* :func:`parse_flags`: an entry without a run config (benchmarks, reports) parses its own flags
  from an argv list, so tests call its ``main(argv)`` as the shell would.

Imports absl, ml_collections (through the config flag) and :mod:`sparrow_jax.run.specs`; never
JAX (``experiments.memory_report`` sets JAX's device count after parsing its flags).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, NoReturn, Optional, Sequence

from absl import app, flags
from ml_collections import config_flags

from sparrow_jax.run.specs import ConfigError, RunSpec, parse_spec

EXIT_BAD_CONFIG = 2
flags.disclaim_key_flags()  # a flag defined here for an entry is the entry's: its --help lists it


def usage_error(message: str) -> NoReturn:
    """Print ``error: message`` to stderr and exit with status 2 (a bad flag or config)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_CONFIG)


def _parse_config_flags(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        usage_error(str(e))
    except OSError as e:  # an override makes ml_collections load the config file while parsing
        usage_error(_load_error(e, "config", _flag_value(argv, "config")))
    except (AttributeError, KeyError) as e:  # ml_collections: an override of a field the config lacks
        # ml_collections wraps a KeyError in the AttributeError and may append "Did you mean ..."
        # after the field's name: unwrap, keep the first line
        arg = e
        while isinstance(arg, BaseException) and arg.args:
            arg = arg.args[0]
        missing = str(arg).splitlines()[0].strip("\"'")
        bad = [a.split("=", 1)[0] for a in argv[1:]
               if a.startswith("--config.") and missing in a.split("=", 1)[0].split(".")]
        usage_error(f"{bad[0] if bad else missing}: unknown config field ('{missing}' is not in the config)")


def _flag_value(argv: list[str], name: str) -> str | None:
    """The value given to ``--name`` (``--name=v`` or ``--name v``) on the command line."""
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _load_error(e: OSError, name: str, path: str | None) -> str:
    # the loader's message ends with the cause, e.g. "[Errno 2] No such file or directory: ..."
    cause = [line.strip() for line in str(e).splitlines() if line.strip()][-1]
    return f"--{name}={path}: cannot load the config file ({cause})"


def _config_value(config_flag: Any) -> Any:
    """The loaded config; a missing or unloadable ``--config`` file is a :class:`ConfigError`."""
    name = getattr(config_flag, "name", "config")
    try:
        value = config_flag.value
        if value is not None:
            value.keys()  # ml_collections reports a file it could not load on first access, not at parse time
    except OSError as e:
        raise ConfigError(_load_error(e, name, flags.FLAGS[name].config_filename)) from None
    if value is None:
        raise ConfigError(f"--{name} is required: a config file, e.g. --{name} configs/quickstart.py")
    return value


def define_config_flag() -> Any:
    """``--config``, the run config file, in absl's global registry; call it from the entry's
    ``_cli()``, not at import: tests import the entries beside each other, and the registry
    refuses a second ``--config`` from another module."""
    return config_flags.DEFINE_config_file("config", None, "run config file (configs/*.py)", lock_config=True)


def config_main(config_flag: Any, main: Callable[[RunSpec], Any]) -> None:
    """``app.run`` with the run config parsed into a spec and handed to ``main(spec)``."""
    def run(argv: list[str]) -> None:
        del argv
        from absl import logging
        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
        try:
            spec = parse_spec(_config_value(config_flag))
        except ConfigError as e:
            usage_error(str(e))
        try:
            main(spec)
        except ConfigError as e:
            usage_error(str(e))

    app.run(run, flags_parser=_parse_config_flags)


HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def parse_flags(define: Callable[[flags.FlagValues], None], argv: Optional[Sequence[str]], doc: str,
                positionals: int = 0) -> tuple[flags.FlagValues, list[str]]:
    """The entry's flags parsed from ``argv`` (``sys.argv[1:]`` when None), and its positional arguments.

    ``define(fv)`` defines the entry's flags in ``fv``, a fresh :class:`absl.flags.FlagValues`
    per call rather than the global ``FLAGS``: tests import several entries (and call one
    ``main`` several times) in one process, where definitions in the global registry would clash
    or keep the values of an earlier call. A multi-valued flag takes space-separated values
    (``--contexts 4096 16384``), as the commands quoted in the docs write them. ``--help`` prints
    ``doc`` and the entry's flags and exits 0; a bad flag, or another count of positional
    arguments than ``positionals``, prints one line and exits with status 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    fv = flags.FlagValues()
    define(fv)
    if any(a in HELP_FLAGS for a in argv):
        print(f"{doc.strip()}\n\nflags:\n{fv.get_help(include_special_flags=False)}")
        sys.exit(0)
    try:
        rest = fv(["prog", *_split_multi_values(fv, argv)])[1:]
    except flags.Error as e:
        usage_error(str(e))
    if len(rest) != positionals:
        usage_error(f"expected {positionals} positional argument(s) (see --help), got {rest or 'none'}")
    return fv, rest


def _split_multi_values(fv: flags.FlagValues, argv: list[str]) -> list[str]:
    """``--name a b`` -> ``--name=a --name=b`` for multi-valued flags (absl takes one value per use);
    a multi-valued flag given no value stays as it is, for absl to name."""
    multi = {name for name in fv if isinstance(fv[name], flags.MultiFlag)}
    out: list[str] = []
    name, given = None, 0
    for i, arg in enumerate(argv):
        if name is not None and not arg.startswith("-"):
            out.append(f"--{name}={arg}")
            given += 1
            continue
        if name is not None and not given:
            out.append(f"--{name}")
        if arg == "--":
            return out + argv[i:]
        name, given = (arg[2:], 0) if arg.startswith("--") and arg[2:] in multi else (None, 0)
        if name is None:
            out.append(arg)
    if name is not None and not given:
        out.append(f"--{name}")
    return out
