"""docs/configs.md, generated: every run-config field with its default, its comment in
configs/common.py and, for the fields sparrow_jax/run/specs.py validates, the one-line error a
bad value gets (found by parsing the base config with that value); then every file in configs/
in one line.

    python -m experiments.config_reference           # writes docs/configs.md
    python -m experiments.config_reference --check   # exit 1, naming the first difference, when it is stale

Comments are read from the source (``ast`` for the fields, ``tokenize`` for the comments): a
field's comment is the one on its own line, continued on comment lines whose text starts in the
same column, after any comment lines right above the field. No model is built, nothing compiles.
"""
from __future__ import annotations

import ast
import dataclasses
import io
import os
import re
import sys
import tokenize
from typing import Any, Iterator

from absl import flags
from ml_collections import ConfigDict

from configs import common
from sparrow_jax.run import specs
from sparrow_jax.run.cli import parse_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "configs", "common.py")
DOC = os.path.join(ROOT, "docs", "configs.md")
# optional blocks: where each builder's block goes in a run config (added there by the configs using it)
OPTIONAL = {"model.warmup": "warmup_config", "study": "study_config"}


@dataclasses.dataclass(frozen=True)
class Entry:
    """A field (leaf) or block of the config, in source order."""
    path: str  # dotted, e.g. schedule.online.margin
    comment: str  # one line; a block's may be empty
    is_block: bool


# ---- comments from the source ------------------------------------------------------------------

def _comments(source: str) -> dict[int, tuple[int, str, bool]]:
    """line -> (column of the comment's text, text, whether the line holds only the comment)."""
    out, code_lines = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#")
            col = tok.start[1] + 1 + len(text) - len(text.lstrip())
            out[tok.start[0]] = (col, text.strip(), tok.start[0] not in code_lines)
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    return out


def _field_comment(line: int, comments: dict[int, tuple[int, str, bool]], continued: set[int]) -> str:
    """The trailing comment of ``line`` with its continuation lines, after the comment lines above it."""
    above, k = [], line - 1
    while k in comments and comments[k][2] and k not in continued:
        above.insert(0, comments[k][1])
        k -= 1
    own = []
    if line in comments and not comments[line][2]:
        own.append(comments[line][1])
        k = line + 1
        while k in continued and comments[k][0] == comments[line][0]:
            own.append(comments[k][1])
            k += 1
    return " — ".join(" ".join(p) for p in (own, above) if p)


def _continuations(comments: dict[int, tuple[int, str, bool]]) -> set[int]:
    """Comment lines that continue the trailing comment of a line of code above them."""
    out = set()
    for line, (col, _, alone) in sorted(comments.items()):
        if alone:
            continue
        k = line + 1
        while k in comments and comments[k][2] and comments[k][0] == col:
            out.add(k)
            k += 1
    return out


def _builder_fields(func: ast.FunctionDef) -> list[tuple[str, int, ast.expr]]:
    """(name, line, value) of the fields a builder sets: ``ConfigDict(dict(...))`` returned, or
    ``c.<name> = ...`` statements."""
    out = []
    for node in func.body:
        if isinstance(node, ast.Return) and node.value is not None:
            out += _dict_fields(node.value)
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
            out.append((node.targets[0].attr, node.lineno, node.value))
    return out


def _dict_fields(value: ast.expr) -> list[tuple[str, int, ast.expr]]:
    """Fields of ``ConfigDict(dict(name=value, ...))``; [] for any other expression."""
    if (isinstance(value, ast.Call) and getattr(value.func, "id", "") == "ConfigDict" and value.args
            and isinstance(value.args[0], ast.Call) and getattr(value.args[0].func, "id", "") == "dict"):
        return [(kw.arg, kw.lineno, kw.value) for kw in value.args[0].keywords]
    return []


def source_entries(source: str, root: str, prefix: str = "") -> list[Entry]:
    """Entries of builder ``root`` in ``source``, depth first in source order. Raises ValueError
    when two fields share a line (one comment could not tell them apart)."""
    tree = ast.parse(source)
    builders = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    comments = _comments(source)
    continued = _continuations(comments)

    def walk(fields: list[tuple[str, int, ast.expr]], pre: str) -> Iterator[Entry]:
        lines = [line for _, line, _ in fields]
        for name, line, value in fields:
            if lines.count(line) > 1:
                raise ValueError(f"configs/common.py:{line}: fields {[n for n, k, _ in fields if k == line]} share a "
                                 "line; give each field its own line and comment")
            path = pre + name
            called = getattr(getattr(value, "func", None), "id", "")
            sub = _builder_fields(builders[called]) if called in builders else _dict_fields(value)
            yield Entry(path, _field_comment(line, comments, continued), bool(sub))
            yield from walk(sub, path + ".")

    return list(walk(_builder_fields(builders[root]), prefix))


def reference_config() -> ConfigDict:
    """The base config with every optional block added at its default."""
    cfg = common.base_config()
    for path, builder in OPTIONAL.items():
        parent, name = _parent(cfg, path)
        parent[name] = getattr(common, builder)()
    return cfg


def entries() -> list[Entry]:
    """Every field and block of :func:`reference_config`, with its comment. Raises ValueError
    naming a field the source walk misses (or finds but the config lacks)."""
    with open(SOURCE, encoding="utf-8") as f:
        source = f.read()
    out = source_entries(source, "base_config")
    for path, builder in OPTIONAL.items():
        doc = (getattr(common, builder).__doc__ or "").strip().split("\n\n")[0]
        out.append(Entry(path, " ".join(doc.split()), True))
        out += source_entries(source, builder, path + ".")
    leaves = set(_leaves(reference_config(), ""))
    found = {e.path for e in out if not e.is_block}
    for missing in sorted(leaves - found) + sorted(found - leaves):
        raise ValueError(f"config field {missing}: {'not found in' if missing in leaves else 'not built by'} "
                         "configs/common.py's builders")
    return out


def _leaves(node: Any, prefix: str) -> list[str]:
    if isinstance(node, ConfigDict):
        return [p for k in node.keys() for p in _leaves(node[k], f"{prefix}.{k}" if prefix else k)]
    return [prefix]


def _parent(cfg: ConfigDict, path: str) -> tuple[ConfigDict, str]:
    *head, name = path.split(".")
    for part in head:
        cfg = cfg[part]
    return cfg, name


# ---- errors for bad values, from sparrow_jax/run/specs.py -------------------------------------

# (field, bad value, other fields set first): the rules of specs.validate beyond its CHOICES /
# POSITIVE / NON_NEGATIVE tables, which are probed from the tables themselves
RULES: tuple[tuple[str, Any, dict[str, Any]], ...] = (
    ("workdir", "", {}),
    ("tokenizer", "no/such/dir", {}),
    ("model.hf_dir", "", {"model.source": "hf"}),
    ("model.hf_dir", "no/such/dir", {"model.source": "hf"}),
    ("task.num_train", 0, {}),
    ("task.num_train", 8, {"task.dataset": "prompts.jsonl"}),
    ("task.preamble_tokens", 888, {}),
    ("schedule.preset", "", {"schedule.kind": "preset"}),
    ("schedule.path", "", {"schedule.kind": "json"}),
    ("schedule.dense_layers", (0, 9), {}),
    ("schedule.online.margin", 1.0, {}),
    ("schedule.online.smoothing", 1.0, {}),
    ("schedule.online.patience", 1, {}),
    ("schedule.online.retry_after", 0, {}),
    ("schedule.online.max_topk", 2, {"schedule.online.min_topk": 4}),
    ("rollout.group_size", 1, {}),
    ("rollout.temperature", 0.0, {}),
    ("rollout.top_p", 1.5, {}),
    ("rollout.top_p", 0.9, {}),
    ("rollout.top_k", 20, {}),
    ("rollout.engine", "continuous", {"mesh.data": 2}),
    ("calibration.tau", 1.0, {}),
    ("train.clip_low", 1.0, {}),
    ("train.mini_batches", 3, {}),
    ("train.tis_mask_low", 2.0, {}),
    ("train.overlong_buffer", 64, {}),
    ("distill.enabled", True, {"schedule.kind": "dense"}),
    ("distill.switch_every", 5, {}),
    ("distill.switch_topk", 2, {"schedule.kind": "online", "distill.switch_every": 5}),
    ("study.arms", ("dense", "bogus"), {}),
    ("study.seeds", (0, 0), {}),
    ("study.low_tau", 0.9, {"study.arms": ("dense", "calibrated_low")}),
    ("study.high_tau", 0.8, {"study.arms": ("dense", "calibrated_high")}),
)


def probes() -> list[tuple[str, Any, dict[str, Any]]]:
    """Every (field, bad value, context) probed: specs' tables, then :data:`RULES`."""
    cfg = reference_config()
    typed = lambda field, value: type(_get(cfg, field))(value)  # 0 -> 0.0 for a float field
    return ([(f, "bogus", {}) for f in specs.CHOICES] + [(f, typed(f, 0), {}) for f in specs.POSITIVE]
            + [(f, typed(f, -1), {}) for f in specs.NON_NEGATIVE] + list(RULES))


def probe_error(field: str, value: Any, context: dict[str, Any]) -> str:
    """The one-line ConfigError of the base config with ``context`` set, then ``field=value``.
    Raises RuntimeError when the config parses or the error names another field."""
    cfg = common.base_config()
    if field.split(".")[0] == "study":
        cfg.study = common.study_config()
    for path, v in [*context.items(), (field, value)]:
        parent, name = _parent(cfg, path)
        parent[name] = v
    try:
        specs.parse_spec(cfg)
    except specs.ConfigError as e:
        msg = str(e)
        if not msg.startswith((f"--config.{field}=", f"--config.{field} ")):
            raise RuntimeError(f"probe {field}={value!r}: the error names another field: {msg}") from None
        return msg
    raise RuntimeError(f"probe {field}={value!r} with {context}: the config parses (no error to document)")


def _get(cfg: ConfigDict, path: str) -> Any:
    parent, name = _parent(cfg, path)
    return parent[name]


# ---- the document -----------------------------------------------------------------------------

def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return "`" + _cell(text) + "`"


def config_files() -> list[tuple[str, str, str]]:
    """(configs/<file>, its docstring's first paragraph on one line, the command that runs it)
    for every file in configs/; the command is the first ``python -m experiments.run`` one its
    docstring quotes for it, else its first ``python -m`` one, else experiments.run's (a file
    without ``get_config`` runs nothing: "")."""
    out = []
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if not name.endswith(".py") or name == "__init__.py":
            continue
        with open(os.path.join(ROOT, "configs", name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        doc = ast.get_docstring(tree) or ""
        first = " ".join(doc.split("\n\n")[0].split())
        if not first:
            raise ValueError(f"configs/{name} has no module docstring to describe it")
        path = f"configs/{name}"
        quoted = re.findall(rf"python -m [\w.]+ --config {re.escape(path)}", doc)
        command = next((c for c in quoted if " experiments.run " in c), quoted[0] if quoted else
                       f"python -m experiments.run --config {path}")
        runs = any(isinstance(f, ast.FunctionDef) and f.name == "get_config" for f in tree.body)
        out.append((path, first, command if runs else ""))
    return out


HEADER = """# Run config reference

Generated by `python -m experiments.config_reference` from the comments in `configs/common.py` and
the checks in `sparrow_jax/run/specs.py`; do not edit by hand (`--check` tells when it is stale, and
a test compares). A run config file's `get_config()` starts from `configs.common.base_config()`;
any field can be overridden on the command line, e.g.
`python -m experiments.run --config configs/grpo_tiny.py --config.steps=2 --config.schedule.topk=4`.
The config is parsed once into typed specs, before anything runs: a field no code reads is refused
(`--config.<field> is read by no code`), and a bad value gets the one-line error shown in the last
column. Only the errors listed were produced by parsing the base config with that value (after the
fields named in *with*); other fields carry no check of their own at parse time (the free-form
blocks `model.tiny` and `model.warmup` are checked when the model or the warm-up is built).
"""


def render() -> str:
    """The text of docs/configs.md."""
    cfg = reference_config()
    errors: dict[str, list[str]] = {}
    for field, value, context in probes():
        with_ = ", ".join(f"{k}={v!r}" for k, v in context.items())
        errors.setdefault(field, []).append(_code(probe_error(field, value, context))
                                            + (f" (with `{with_}`)" if with_ else ""))
    sections: dict[str, list[Entry]] = {"": []}
    blocks = {"": Entry("", "the run's own fields", True)}
    for e in entries():
        if e.is_block:
            sections[e.path], blocks[e.path] = [], e
        else:
            sections[e.path.rsplit(".", 1)[0] if "." in e.path else ""].append(e)
    lines = [HEADER]
    for block, fields in sections.items():
        if not fields:
            continue
        title = block or "top level"
        optional = " (optional block)" if block in OPTIONAL else ""
        lines += [f"## {title}{optional}", ""]
        if blocks[block].comment:
            lines += [blocks[block].comment, ""]
        lines += ["| field | default | what it does | a bad value's error |", "|---|---|---|---|"]
        for e in fields:
            lines.append(f"| `{e.path}` | {_code(repr(_get(cfg, e.path)))} | {_cell(e.comment)} | "
                         f"{'<br>'.join(errors.get(e.path, []))} |")
        lines.append("")
    lines += ["## Files in configs/", ""]
    lines += [f"- `{path}`" + (f" (`{command}`)" if command else "") + f": {_cell(doc)}"
              for path, doc, command in config_files()]
    return "\n".join(lines) + "\n"


def first_difference(old: str, new: str) -> str:
    """A one-line description of where ``old`` first differs from ``new``."""
    a, b = old.splitlines(), new.splitlines()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"line {i + 1}: the file has {x!r}, the generator gives {y!r}"
    return f"the file has {len(a)} lines, the generator gives {len(b)}"


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_bool("check", False, "exit 1 when docs/configs.md differs from the output", flag_values=fv)
    flags.DEFINE_string("out", DOC, "the file to write or check", flag_values=fv)


def main(argv: list[str] | None = None) -> int:
    args, _ = parse_flags(define_flags, argv, __doc__)
    text = render()
    if args.check:
        old = open(args.out, encoding="utf-8").read() if os.path.exists(args.out) else None
        if old != text:
            why = "is missing" if old is None else f"is stale ({first_difference(old, text)})"
            print(f"{os.path.relpath(args.out, ROOT)} {why}; run python -m experiments.config_reference",
                  file=sys.stderr)
            return 1
        return 0
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(args.out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
