"""The study's per-arm table over seeds: each arm's runs (one per seed, the same seeds for every arm)
folded into one row of the headline figures.

Per arm: the dense held-out reward at the start and the end with their standard errors, the change
and its standard error, the area under the dense validation curve, the sampled training reward,
the per-bin p5 pooled over every seed's tokens and the worst (seed, step) cell per bin, generated
tokens per rollout second, the predicted rollout cost, the median RL step time (and its ratio to
the dense arm's), the share of visible KV pages the rollouts kept and, when the study measured it,
the paired rollout speedup of the arm's final schedule. Pure functions of the arms' logs
(:mod:`sparrow_jax.run.report`); may import the run layer's report and spec modules, never the
study itself (which imports this module).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from sparrow_jax.run.report import (p5_hold_fraction, p5_min_step_by_bin, pooled_p5_by_bin, token_weighted_mean,
                                    training_rows)
from sparrow_jax.run.specs import RunSpec
from sparrow_jax.stats import standard_error

# the phases of one RL step (rollouts; scoring and update; the online controller's probe; train.tis_veto's
# dense pass): not validation
STEP_PARTS = ("timing_s/gen", "timing_s/update_actor", "timing_s/probe", "timing_s/veto")
# what an arm's report.json carries from the paired rollout speed measurement (sparrow_jax.run.speed)
SPEEDUP_KEYS = ("rollout_speedup", "rollout_speedup_paired", "dense_tok_s", "sparse_tok_s")


class SeedRun(NamedTuple):
    """One arm's run at one seed: its logged records, alpha histograms and ``report.json``."""
    records: list
    histograms: list
    report: dict


def combine_seeds(values: list, ses: list) -> tuple[Optional[float], Optional[float]]:
    """Mean over seeds of per-seed figures ``values`` [S] and its standard error from the per-seed
    standard errors over prompts ``ses`` [S] and the between-seed spread.

    Every seed evaluates the same held-out prompts, so their sampling error is shared by the seeds,
    not averaged away: the within part is the mean per-seed variance ``mean_s se_s^2`` (not divided by
    S). The seeds' training runs and samples are independent: the between part is the variance of
    the mean, ``var_s(value_s) / S`` (ddof 1, from 2 seeds). se = sqrt(within + between); the within
    part also holds each seed's sampling noise, which the between part counts again (conservative).
    None-valued seeds are left out; se is None when neither part is known.
    """
    pairs = [(v, s) for v, s in zip(values, ses) if v is not None]
    if not pairs:
        return None, None
    x = np.asarray([v for v, _ in pairs], np.float64)
    known = [s for _, s in pairs if s is not None]
    parts = [float(np.mean(np.square(known)))] if known else []
    if x.size >= 2:
        parts.append(standard_error(x) ** 2)
    return float(x.mean()), (float(np.sqrt(sum(parts))) if parts else None)


def curve_area(steps: list, values: list, total_steps: int) -> Optional[float]:
    """Area under a validation curve (trapezoid over its steps) / ``total_steps``: its mean height
    over the run when the points span step 0 to the last step; None without points."""
    points = [(s, v) for s, v in zip(steps, values) if v is not None]
    if not points:
        return None
    x, y = (np.asarray(p, np.float64) for p in zip(*points))
    if x.size == 1:
        return float(y[0])
    return float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2) / total_steps)


def held_out(series: list[Optional[dict]], total_steps: int) -> Optional[dict]:
    """The dense held-out figures over seeds from each seed's ``val_series(records, "dense", k)``:
    ``start`` / ``end`` and ``change`` (end - start) with their standard errors
    (:func:`combine_seeds`; a seed's change has se sqrt(se_start^2 + se_end^2): its start and end
    share the prompts, whose correlation the logs do not hold), ``auc`` (:func:`curve_area`, mean over
    seeds, ``auc_se`` from the between-seed spread, None under 2 seeds), and ``curve``: per step logged
    by every seed its ``mean`` and ``se`` (for the plot's band). None when no seed validated."""
    series = [s for s in series if s]
    if not series:
        return None
    name = series[0]["metric"]
    out = {"metric": name, "seeds": len(series)}
    for end in ("start", "end"):
        out[end], out[f"{end}_se"] = combine_seeds([s[end] for s in series], [s[f"{end}_se"] for s in series])
    change = [None if None in (s["start"], s["end"]) else s["end"] - s["start"] for s in series]
    change_se = [None if None in (s["start_se"], s["end_se"]) else float(np.hypot(s["start_se"], s["end_se"]))
                 for s in series]
    out["change"], out["change_se"] = combine_seeds(change, change_se)
    areas = [a for a in (curve_area([p["step"] for p in s["steps"]], [p[name] for p in s["steps"]], total_steps)
                         for s in series) if a is not None]
    out["auc"] = float(np.mean(areas)) if areas else None
    out["auc_se"] = standard_error(areas)
    by_step = [{p["step"]: p for p in s["steps"]} for s in series]
    common = [step for step in by_step[0] if all(step in b for b in by_step)]
    out["curve"] = []
    for step in common:
        mean, se = combine_seeds([b[step][name] for b in by_step], [b[step][f"{name}_se"] for b in by_step])
        out["curve"].append({"step": step, "mean": mean, "se": se})
    return out


def step_seconds(rows: list[dict]) -> list[float]:
    """Wall seconds of each RL step after the first (which compiles): the sum of :data:`STEP_PARTS`
    it logged (validation left out: it runs every ``eval_every`` steps, not in every step)."""
    return [sum(r.get(k, 0.0) for k in STEP_PARTS) for r in rows[1:] if "timing_s/gen" in r]


def worst_step_by_bin(rows_by_seed: dict[int, list[dict]], min_count: float) -> list[dict]:
    """Per bin the worst step over seeds: ``{"bin_start", "p5", "step", "seed"}`` of the lowest per-step
    p5 among the steps with >= ``min_count`` tokens in the bin (``p5`` / ``step`` / ``seed`` None if none)."""
    worst: dict[int, dict] = {}
    for seed, rows in rows_by_seed.items():
        for cell in p5_min_step_by_bin(rows, min_count):
            now = worst.get(cell["bin_start"])
            if now is None or (cell["p5"] is not None and (now["p5"] is None or cell["p5"] < now["p5"])):
                worst[cell["bin_start"]] = {**cell, "seed": seed if cell["p5"] is not None else None}
    return [worst[b] for b in sorted(worst)]


def _mean(values: list) -> Optional[float]:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


def arm_summary(spec: RunSpec, seed_rows: dict[int, dict], runs: dict[int, SeedRun]) -> dict:
    """One arm's row over its seeds. ``spec``: the arm's run spec (its tau and min_count);
    ``seed_rows``: each seed's single-run row (``sparrow_jax.run.study.arm_row``); ``runs``: each
    seed's logs. With one seed the row is that seed's row plus the figures below; with several, the
    figures below and ``per_seed`` (every seed's row). The training reward's change se combines the
    seeds like :func:`combine_seeds`. ``step_time_median_s``: the median of :func:`step_seconds` over
    every seed's steps; ``kept_page_share``: the share of visible KV pages the rollouts kept, over
    every seed's generated tokens (None for runs that did not log it); the paired speedup keys are
    the first seed's (measured on it alone)."""
    seeds = list(runs)
    first = seed_rows[seeds[0]]
    rows = {s: training_rows(run.records) for s, run in runs.items()}
    every_row = [r for s in seeds for r in rows[s]]
    tau, min_count = spec.calibration.tau, spec.calibration.min_count
    pooled = pooled_p5_by_bin(every_row, [h for run in runs.values() for h in run.histograms])
    full = [b["p5"] for b in pooled if b["count"] >= min_count and b["p5"] is not None]
    changes = [None if None in (seed_rows[s]["reward_start"], seed_rows[s]["reward_end"])
               else seed_rows[s]["reward_end"] - seed_rows[s]["reward_start"] for s in seeds]
    times = [t for s in seeds for t in step_seconds(rows[s])]
    out = {"seeds": seeds,
           "held_out": held_out([seed_rows[s]["val_dense"] for s in seeds], spec.steps),
           "reward_start": _mean([seed_rows[s]["reward_start"] for s in seeds]),
           "reward_end": _mean([seed_rows[s]["reward_end"] for s in seeds]),
           "reward_window_steps": first["reward_window_steps"],
           "reward_change_se": combine_seeds(changes, [seed_rows[s]["reward_change_se"] for s in seeds])[1],
           "p5_by_bin": pooled, "p5_min_step_by_bin": worst_step_by_bin(rows, min_count),
           **p5_hold_fraction(every_row, tau - 0.02, min_count),
           "min_p5": min(full) if full and spec.schedule.kind != "dense" else None,
           "step_time_median_s": float(np.median(times)) if times else None,
           "kept_page_share": token_weighted_mean(every_row, "rollout/kept_page_share")}
    for key in ("gen_tokens_per_s", "sparse_token_fraction", "response_length_end", "predicted_cost_end",
                "predicted_cost_mean"):
        out[key] = _mean([seed_rows[s].get(key) for s in seeds])
    out.update({k: runs[seeds[0]].report[k] for k in SPEEDUP_KEYS if k in runs[seeds[0]].report})
    if len(seeds) == 1:
        return {**first, **out}
    return {**out, "per_seed": {str(s): seed_rows[s] for s in seeds}}


def relative_step_time(table: dict[str, dict]) -> None:
    """``step_time_vs_dense`` of every arm in ``table`` (in place): the dense arm's median RL step
    time / the arm's (> 1: the arm's steps are faster); None without a dense arm or a time."""
    dense = (table.get("dense") or {}).get("step_time_median_s")
    for row in table.values():
        t = row.get("step_time_median_s")
        row["step_time_vs_dense"] = dense / t if dense and t else None
