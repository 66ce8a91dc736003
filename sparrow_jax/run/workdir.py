"""A run's working directory: the config it was started with, and the refusal to continue it under
another one.

A workdir holds state that the next run with it picks up: the checkpoints (training resumes from
the latest) and ``schedule.json`` (calibration is skipped when it exists). Continued under a
changed config, such a run would silently mix two experiments (a new warm-up's model with the old
schedule, another learning rate from a resumed optimiser). :func:`check_workdir` compares the
config the workdir was started with (``config.json``) with this run's and names what differs;
only the fields that continuing a run may change are exempt (:data:`CONTINUABLE`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import typing
from typing import Any, Optional

from sparrow_jax.io import atomic_write_json
from sparrow_jax.run.specs import ConfigError, RunSpec

CONFIG_FILE = "config.json"
# Fields a continued run may change: where it lives, how long it runs (more steps extend it), how
# often it saves and evaluates, the device mesh it runs on (checkpoints restore resharded), and
# dry_run (a dry run stops before the workdir is touched), a study's arms (each arm's run is set by
# the rest of the config, so arms added later run beside the finished ones, unchanged), and its
# final evaluation and its prompts (it reads the finished arms, trains nothing).
CONTINUABLE = ("workdir", "steps", "checkpoint_every", "keep_checkpoints", "eval_every", "mesh", "dry_run",
               "study.arms", "study.final_eval_prompts", "study.final_eval_offset")


def run_state(workdir: str) -> list[str]:
    """What in ``workdir`` a new run would pick up: ``checkpoints`` (its own or a study arm's) and
    ``schedule.json``; empty for a fresh directory."""
    if not os.path.isdir(workdir):
        return []
    found = [name for name in ("checkpoints", "schedule.json") if os.path.exists(os.path.join(workdir, name))]
    found += sorted(os.path.join(name, "checkpoints") for name in os.listdir(workdir)
                    if os.path.isdir(os.path.join(workdir, name, "checkpoints")))
    return found


def config_differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two JSON trees differ, each as ``path: old -> new``."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in old or key not in new:
                out.append(f"{path}: {old.get(key, '<absent>')!r} -> {new.get(key, '<absent>')!r}")
            else:
                out += config_differences(old[key], new[key], path)
        return out
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def _with_new_defaults(old: dict, spec: RunSpec) -> dict:
    """``old`` (a ``config.json``) with the spec fields added since it was written set to their
    defaults: a field the code gained later, left at its default, changes nothing of the run."""
    def spec_class(hint) -> Optional[type]:  # a dataclass field type, Optional[...] unwrapped
        options = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_args(hint) else [hint]
        return options[0] if len(options) == 1 and dataclasses.is_dataclass(options[0]) else None

    def fill(cls: type, node: dict) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            block = spec_class(hints[f.name])
            if block is not None:
                if isinstance(node.get(f.name), dict):  # an optional block (study) the config left None stays None
                    fill(block, node[f.name])
            elif f.name not in node and f.default is not dataclasses.MISSING:
                node[f.name] = json.loads(json.dumps(f.default))

    filled = json.loads(json.dumps(old))
    fill(type(spec), filled)
    return filled


def spec_json(spec: RunSpec) -> dict:
    """The spec as the JSON ``config.json`` holds (tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(spec)))


def check_workdir(spec: RunSpec) -> None:
    """Raise :class:`ConfigError` (a ``ValueError``) when ``spec.workdir`` holds a run
    (:func:`run_state`) started with a config that differs from ``spec`` outside
    :data:`CONTINUABLE`, fields added to the code since at their defaults aside; nothing in the
    directory is touched."""
    state = run_state(spec.workdir)
    path = os.path.join(spec.workdir, CONFIG_FILE)
    if not state or not os.path.exists(path):
        return
    with open(path) as f:
        old = _with_new_defaults(json.load(f), spec)
    new = spec_json(spec)
    for name in CONTINUABLE:
        for tree in (old, new):
            *parents, leaf = name.split(".")
            for parent in parents:
                tree = tree.get(parent) if isinstance(tree, dict) else None
            if isinstance(tree, dict):
                tree.pop(leaf, None)
    diffs = config_differences(old, new)
    if diffs:
        shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
        raise ConfigError(f"--config.workdir={spec.workdir}: holds a run ({', '.join(state)}) started with another "
                          f"config ({shown}). Continuing it would mix the two; pass a new --config.workdir, or "
                          f"move {spec.workdir} away to start over")


def write_config(spec: RunSpec) -> None:
    """``<workdir>/config.json``: the config this run was started (or continued) with."""
    os.makedirs(spec.workdir, exist_ok=True)
    atomic_write_json(os.path.join(spec.workdir, CONFIG_FILE), spec_json(spec))


REPORT_FILE = "report.json"


def finished_report(spec: RunSpec) -> Optional[dict]:
    """``<workdir>/report.json`` of a run (or a study arm) that has done ``spec.steps`` steps,
    None otherwise: a finished run is reported, not rerun."""
    path = os.path.join(spec.workdir, REPORT_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        report = json.load(f)
    return report if report.get("steps") == spec.steps else None
