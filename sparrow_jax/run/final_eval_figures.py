"""The study's final evaluation figures (:mod:`sparrow_jax.run.final_eval` evaluates), from its
record alone: paired differences over prompts and seeds, and their report lines. numpy only, so
``experiments.summary`` reads a study without starting jax.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from sparrow_jax.run.headline import combine_seeds
from sparrow_jax.stats import mean_and_se

FINAL_EVAL_FILE = "final_eval.json"
START = "start"  # the policy the arms started from


def run_name(arm: str, seed: int) -> str:
    return f"{arm}/seed_{seed}"


def paired_over_seeds(pairs: list[tuple[np.ndarray, Optional[np.ndarray]]]) -> tuple[Optional[float], Optional[float]]:
    """Over seeds: the mean over prompts of ``a - b`` (``a`` alone when ``b`` is None) and its standard
    error (:func:`~sparrow_jax.run.headline.combine_seeds`: the per-seed error over prompts, plus the
    spread between seeds)."""
    stats = [mean_and_se(a if b is None else a - b) for a, b in pairs]
    return combine_seeds([m for m, _ in stats], [s for _, s in stats])


def start_run_name(runs: dict, seed: int) -> str:
    """The start policy's entry among ``runs`` for ``seed``: one for every seed, or one per seed."""
    return START if START in runs else run_name(START, seed)


def _with_same_runs(data: dict) -> dict[str, dict]:
    """``data["runs"]`` and, for every arm of ``data["same_run_as"]`` (arm -> the arm whose runs it
    reuses, :mod:`sparrow_jax.run.study`), those runs under its name."""
    runs = dict(data["runs"])
    for arm, source in data.get("same_run_as", {}).items():
        for name, values in data["runs"].items():
            owner, _, seed = name.rpartition("/seed_")
            if owner == source:
                runs[run_name(arm, int(seed))] = values
    return runs


def paired_figures(data: dict) -> dict:
    """The final evaluation's figures from :func:`evaluate_final`'s record (the runs evaluated so far;
    the start policy is one entry, or one per seed).

    -> ``{"prompts", "k", "steps", <metric>: {"start", "start_se", "arms": {arm: {"seeds", "end", "end_se",
    "change", "change_se", "vs_dense", "vs_dense_se"}}}}`` for ``reward_mean@k`` and
    ``reward_greedy``: ``change`` is the end minus the start policy's reward on the same prompts,
    ``vs_dense`` the arm's minus the dense arm's at the same seed (absent for the dense arm or without
    it); every error is over prompts and seeds (:func:`paired_over_seeds`). Arms of ``data["same_run_as"]``
    get the figures of the runs they reuse."""
    runs = _with_same_runs(data)
    done: dict[str, list[int]] = {}
    for name in runs:
        arm, _, seed = name.rpartition("/seed_")
        if arm and arm != START:
            done.setdefault(arm, []).append(int(seed))
    out = {"prompts": data["prompts"], "k": data["k"], "steps": data.get("steps"), "offset": setting_value(data, "offset")}
    for metric in (f"reward_mean@{data['k']}", "reward_greedy"):
        values = lambda name: np.asarray(runs[name][metric], np.float64)  # noqa: E731
        starts = [values(n) for n in sorted({start_run_name(runs, s) for ss in done.values() for s in ss}) if n in runs]
        start, start_se = paired_over_seeds([(x, None) for x in starts])
        arms = {}
        for arm, seeds in done.items():
            seeds = [s for s in sorted(seeds) if start_run_name(runs, s) in runs]
            row = {"seeds": seeds}
            end = [values(run_name(arm, s)) for s in seeds]
            row["end"], row["end_se"] = paired_over_seeds([(x, None) for x in end])
            row["change"], row["change_se"] = paired_over_seeds(
                [(x, values(start_run_name(runs, s))) for x, s in zip(end, seeds)])
            dense = [s for s in seeds if run_name("dense", s) in runs]
            if arm != "dense" and dense:
                row["vs_dense"], row["vs_dense_se"] = paired_over_seeds(
                    [(values(run_name(arm, s)), values(run_name("dense", s))) for s in dense])
            arms[arm] = row
        out[metric] = {"start": start, "start_se": start_se, "arms": arms}
    return out


MERGED_SETTINGS = ("prompts", "k", "seed", "steps", "offset")  # what records must share to be merged
SETTING_DEFAULTS = {"offset": 0}  # a setting records made before it existed were all made with


def prompts_from(record: dict) -> str:
    """" (from held-out prompt <offset>)" for a record of prompts past the validation ones, else ""."""
    offset = setting_value(record, "offset")
    return f" (from held-out prompt {offset})" if offset else ""


def setting_value(record: dict, key: str):
    """A final evaluation record's (or report block's) setting ``key``; its default when the record predates it."""
    return record.get(key, SETTING_DEFAULTS.get(key))


def check_same_setting(name: str, record: dict, first_name: str, first: dict) -> None:
    """Raise ValueError, naming both workdirs, unless ``record`` was made with ``first``'s evaluation
    setting (:data:`MERGED_SETTINGS`)."""
    for k in MERGED_SETTINGS:
        if setting_value(record, k) != setting_value(first, k):
            raise ValueError(f"{name}: final evaluation {k}={setting_value(record, k)!r} where {first_name} has "
                             f"{setting_value(first, k)!r}: not the same evaluation")


def merge_records(records: dict[str, dict]) -> dict:
    """Several studies' final evaluations as one, e.g. seeds run in separate workdirs (``records``:
    workdir -> its ``final_eval.json`` content). They must share the evaluation setting
    (:data:`MERGED_SETTINGS`: prompts, samples, sampling key, steps) and agree on every run two of
    them hold, the start policy above all (the same policy on the same prompts with the same key
    scores the same). -> one record over the union of their runs, for :func:`paired_figures`.
    Raises ValueError naming the workdirs that disagree."""
    if not records:
        raise ValueError("merge_records: no final evaluation to merge")
    (first_name, first), *rest = records.items()
    merged = {k: setting_value(first, k) for k in MERGED_SETTINGS}
    runs, origin = dict(first["runs"]), dict.fromkeys(first["runs"], first_name)
    for name, record in rest:
        check_same_setting(name, record, first_name, merged)
        for run, values in record["runs"].items():
            if run in runs and runs[run] != values:
                raise ValueError(f"{name} and {origin[run]} both evaluated {run!r}, with different rewards (compared "
                                 "exactly): not the same policy on the same prompts")
            runs.setdefault(run, values)
            origin.setdefault(run, name)
    same_run: dict[str, str] = {}
    for name, record in records.items():
        for arm, source in record.get("same_run_as", {}).items():
            trained = [run for run in runs if run.rpartition("/seed_")[0] == arm]
            if same_run.setdefault(arm, source) != source or trained:
                raise ValueError(f"{name}: its {arm!r} is the {source!r} arm's run, while another study "
                                 f"{'trained it' if trained else 'reused another arm'}: not the same arm")
    return dict(merged, runs=runs, **({"same_run_as": same_run} if same_run else {}))


def format_final_eval(figures: dict) -> list[str]:
    """The figures of :func:`paired_figures` as one line per arm (the mean@k metric)."""
    metric = f"reward_mean@{figures['k']}"
    f = figures[metric]

    def pm(x, se, sign=""):
        return "-" if x is None else f"{x:{sign}.3f}" + ("" if se is None else f"±{se:.3f}")

    lines = [f"[final eval] dense {metric} on {figures['prompts']} held-out prompts{prompts_from(figures)}, paired "
             f"over prompts and seeds; start {pm(f['start'], f['start_se'])}"]
    for arm, row in f["arms"].items():
        lines.append(f"[final eval] {arm:>17}: end {pm(row['end'], row['end_se'])}, change "
                     f"{pm(row['change'], row['change_se'], '+')}, vs dense "
                     f"{pm(row.get('vs_dense'), row.get('vs_dense_se'), '+')} (seeds {row['seeds']})")
    return lines
