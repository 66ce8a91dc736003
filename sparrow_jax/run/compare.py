"""Arms of different studies compared on their paired final evaluations: e.g. the same study's sparse arm
with and without a loss change, each trained in its own workdir with the dense arm copied in.

Each study's ``final_eval.json`` (:mod:`sparrow_jax.run.final_eval`) holds every policy it evaluated,
sampled densely with one key on the same held-out prompts. Two studies' records pair only when they were
made with the same evaluation setting (prompts, samples, key, steps) and score the start policy the same,
prompt by prompt (the same policy on the same prompts with the same key: checked exactly). Then an arm of
one study and an arm of another are compared like the arms of one study: per seed, the per-prompt
difference; over seeds, :func:`~sparrow_jax.run.final_eval_figures.paired_over_seeds` (the per-seed error over
prompts, plus the spread between seeds). Unlike :func:`~sparrow_jax.run.final_eval_figures.merge_records`, which
merges seeds of one study run in several workdirs, the arms compared here may share a name
(``calibrated`` in both) and are told apart by their labels.

numpy only: reads the studies' files, never starts jax.
"""
from __future__ import annotations

import json
import os
from typing import NamedTuple, Optional

import numpy as np

from sparrow_jax.io.metrics import read_metrics
from sparrow_jax.run.final_eval_figures import (FINAL_EVAL_FILE, START, check_same_setting, paired_over_seeds,
                                                prompts_from, run_name, setting_value, start_run_name)
from sparrow_jax.run.headline import step_seconds
from sparrow_jax.run.report import training_rows

EDGE_STEPS = 10  # a training metric's start and end: its mean over the first and the last this many steps
# training metrics read from each run's metrics.jsonl (mean over the first / last EDGE_STEPS steps)
TRAINING_METRICS = ("actor/entropy", "reward_mean", "rollout_corr/rollout_is_veto_fraction",
                    "rollout_corr/rows_with_advantage")


class Entry(NamedTuple):
    """One arm of one study: ``<workdir>:<arm>[=<label>]`` on the command line."""
    label: str
    workdir: str
    arm: str


def parse_entry(text: str) -> Entry:
    """``"<workdir>:<arm>[=<label>]"`` -> :class:`Entry` (label defaults to ``<workdir's name>:<arm>``).
    Raises ValueError on a malformed entry."""
    body, _, label = text.partition("=")
    workdir, sep, arm = body.rpartition(":")
    if not sep or not workdir or not arm or (_ and not label):
        raise ValueError(f"{text!r}: expected <workdir>:<arm>[=<label>], e.g. runs/headline:dense or "
                         "runs/headline_veto:calibrated=veto")
    return Entry(label or f"{os.path.basename(os.path.normpath(workdir))}:{arm}", workdir, arm)


def _load_record(workdir: str) -> dict:
    path = os.path.join(workdir, FINAL_EVAL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{workdir}: no {FINAL_EVAL_FILE} (has the study's final evaluation run?)")
    with open(path) as f:
        return json.load(f)


def _run_dir(workdir: str, arm: str, seed: int) -> Optional[str]:
    """The directory of ``arm``'s run at ``seed``: ``<arm>/seed_<s>``, or ``<arm>`` in a study of that one seed
    (its ``config.json``; :func:`~sparrow_jax.run.study.study_seeds`); None when neither logged a step."""
    logged = lambda d: os.path.exists(os.path.join(d, "metrics.jsonl"))  # noqa: E731
    run = os.path.join(workdir, arm, f"seed_{seed}")
    if logged(run):
        return run
    config_path = os.path.join(workdir, "config.json")
    if not os.path.exists(config_path):
        return None
    with open(config_path) as f:
        config = json.load(f)
    seeds = list((config.get("study") or {}).get("seeds") or [config.get("seed")])
    run = os.path.join(workdir, arm)
    return run if seeds == [seed] and logged(run) else None


def _check_same_evaluation(records: dict[str, dict]) -> None:
    """Raise ValueError unless every record has the first one's evaluation setting and start policy scores."""
    (first_dir, first), *rest = records.items()
    for workdir, record in rest:
        check_same_setting(workdir, record, first_dir, first)
        shared = [name for name in first["runs"] if name.partition("/")[0] == START and name in record["runs"]]
        if not shared:
            raise ValueError(f"{workdir} and {first_dir} share no start policy entry: their pairing is unknown")
        for name in shared:
            if record["runs"][name] != first["runs"][name]:
                raise ValueError(f"{workdir} and {first_dir} score the start policy {name!r} differently: not the "
                                 "same prompts, key or start")


def _training_edges(workdir: str) -> dict[str, list[float]]:
    """Per training metric: [its mean over the first EDGE_STEPS steps, over the last]; the median RL step
    seconds (:func:`~sparrow_jax.run.headline.step_seconds`) as ``step_s``."""
    rows = training_rows(read_metrics(workdir))
    out: dict[str, list[float]] = {}
    for metric in TRAINING_METRICS:
        values = [r[metric] for r in rows if metric in r]
        if values:
            out[metric] = [float(np.mean(values[:EDGE_STEPS])), float(np.mean(values[-EDGE_STEPS:]))]
    seconds = step_seconds(rows)
    if seconds:
        out["step_s"] = [float(np.median(seconds))]
    return out


def compare_arms(entries: list[Entry], metric: Optional[str] = None) -> dict:
    """The entries' final-evaluation figures, each paired with the first entry (the reference) at the seeds
    both evaluated.

    -> ``{"metric", "prompts", "k", "reference": label, "arms": {label: {"workdir", "arm", "seeds", "end",
    "end_se", "change", "change_se", "vs_reference", "vs_reference_se", "vs_reference_by_seed": {seed: diff},
    "training": {seed: {metric: [first, last] or [median]}}}}}``; ``metric`` defaults to ``reward_mean@k``.
    ``change`` is against the start policy on the same prompts; ``vs_reference`` is absent for the reference.
    Raises ValueError when the records are not one evaluation, an arm has no evaluated seed, or an entry
    shares no seed with the reference; FileNotFoundError when a workdir has no final evaluation."""
    if not entries:
        raise ValueError("compare_arms: no entries")
    labels = [e.label for e in entries]
    if len(set(labels)) != len(labels):
        raise ValueError(f"labels must differ, got {labels} (name them: <workdir>:<arm>=<label>)")
    records = {e.workdir: _load_record(e.workdir) for e in entries}
    _check_same_evaluation(records)
    first = next(iter(records.values()))
    metric = metric or f"reward_mean@{first['k']}"

    def seeds_of(e: Entry) -> list[int]:
        runs = records[e.workdir]["runs"]
        seeds = sorted(int(n.rpartition("/seed_")[2]) for n in runs if n.rpartition("/seed_")[0] == e.arm)
        if not seeds:
            raise ValueError(f"{e.workdir}: no final evaluation of arm {e.arm!r} (evaluated: {sorted(runs)})")
        return seeds

    def values(e: Entry, name: str) -> np.ndarray:
        run = records[e.workdir]["runs"][name]
        if metric not in run:
            raise ValueError(f"{e.workdir}: {name!r} has no {metric!r} (has {sorted(run)})")
        return np.asarray(run[metric], np.float64)

    reference = entries[0]
    ref_seeds = seeds_of(reference)
    arms = {}
    for e in entries:
        seeds = seeds_of(e)
        ends = [values(e, run_name(e.arm, s)) for s in seeds]
        row: dict = {"workdir": e.workdir, "arm": e.arm, "seeds": seeds}
        row["end"], row["end_se"] = paired_over_seeds([(x, None) for x in ends])
        row["change"], row["change_se"] = paired_over_seeds(
            [(x, values(e, start_run_name(records[e.workdir]["runs"], s))) for x, s in zip(ends, seeds)])
        if e is not reference:
            common = [s for s in seeds if s in ref_seeds]
            if not common:
                raise ValueError(f"{e.label}: seeds {seeds} share none with the reference {reference.label}'s "
                                 f"{ref_seeds}")
            pairs = [(values(e, run_name(e.arm, s)), values(reference, run_name(reference.arm, s))) for s in common]
            row["vs_reference"], row["vs_reference_se"] = paired_over_seeds(pairs)
            row["vs_reference_by_seed"] = {s: float(np.mean(a - b)) for s, (a, b) in zip(common, pairs)}
        run_dirs = {s: _run_dir(e.workdir, e.arm, s) for s in seeds}
        row["training"] = {s: _training_edges(d) for s, d in run_dirs.items() if d}
        arms[e.label] = row
    return {"metric": metric, "prompts": first["prompts"], "k": first["k"], "offset": setting_value(first, "offset"),
            "reference": reference.label, "arms": arms}


def format_comparison(figures: dict) -> list[str]:
    """:func:`compare_arms`'s figures as one line per arm, then its training metrics per seed."""
    def pm(x, se, sign=""):
        return "-" if x is None else f"{x:{sign}.3f}" + ("" if se is None else f" +- {se:.3f}")

    ref = figures["reference"]
    lines = [f"[compare] dense {figures['metric']} on {figures['prompts']} held-out prompts{prompts_from(figures)}, "
             f"paired over prompts and seeds; reference {ref}"]
    for label, row in figures["arms"].items():
        by_seed = " / ".join(f"{d:+.3f}" for d in row.get("vs_reference_by_seed", {}).values())
        versus = "" if label == ref else (f", vs {ref} {pm(row['vs_reference'], row['vs_reference_se'], '+')} "
                                           f"(per seed {by_seed})")
        lines.append(f"[compare] {label}: end {pm(row['end'], row['end_se'])}, change "
                     f"{pm(row['change'], row['change_se'], '+')}{versus} (seeds {row['seeds']})")
        for seed, edges in row["training"].items():
            parts = [f"{m} {v[0]:.4g} -> {v[1]:.4g}" for m, v in edges.items() if m != "step_s"]
            step = f"; RL step median {edges['step_s'][0]:.2f} s" if "step_s" in edges else ""
            lines.append(f"[compare]   seed {seed}, first -> last {EDGE_STEPS} steps: " + ", ".join(parts) + step)
    return lines
