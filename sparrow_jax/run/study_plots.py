"""The study's figures: ``study.png`` (:func:`plot_study`, every arm's steps) and ``headline.png``
(:func:`plot_headline`, the headline figure from the study's table and the arms' logged steps).

Headline panels: the dense held-out reward per arm over steps (mean over seeds, shaded +-1
standard error: ``held_out.curve`` of :func:`sparrow_jax.run.headline.arm_summary`), generated
tokens per rollout second per arm (mean over seeds per step), then per sparse arm its per-bin p5
over the first seed's steps beside its tau. Draws through :func:`sparrow_jax.io.plots.plot_panels`;
imports io and nothing of the run layer.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from sparrow_jax.io.metrics import bin_series
from sparrow_jax.io.plots import plot_panels


def held_out_panel(table: dict[str, dict]) -> tuple:
    """(title, ylabel, series, bands) of the arms' dense held-out curves; series empty without any."""
    series, bands = {}, {}
    for arm, row in table.items():
        curve = (row.get("held_out") or {}).get("curve") or []
        points = [(p["step"], p["mean"], p["se"]) for p in curve if p["mean"] is not None]
        if not points:
            continue
        steps, means, ses = (list(v) for v in zip(*points))
        series[arm] = (steps, means)
        if all(se is not None for se in ses):
            bands[arm] = (steps, np.subtract(means, ses), np.add(means, ses))
    metric = next((row["held_out"]["metric"] for row in table.values() if row.get("held_out")), "reward")
    return "dense held-out reward (mean over seeds, +-1 se)", metric, series, bands


def tokens_per_s(rows_by_seed: list[list[dict]]) -> tuple[list, list]:
    """(steps, generated tokens per rollout second averaged over the seeds logging the step)."""
    per_step: dict[int, list[float]] = {}
    for rows in rows_by_seed:
        for r in rows:
            if r.get("rollout/decode_s", 0) > 0:
                per_step.setdefault(r["step"], []).append(r["rollout/generated_tokens"] / r["rollout/decode_s"])
    steps = sorted(per_step)
    return steps, [float(np.mean(per_step[s])) for s in steps]


def logged_points(steps: list, values: list) -> tuple[list, list]:
    """The (steps, values) that hold a finite value: a statistic logged on some steps only (every
    ``train.mismatch_every``-th) draws one line through them, not isolated points between gaps."""
    kept = [(s, v) for s, v in zip(steps, values) if np.isfinite(v)]
    return [s for s, _ in kept], [v for _, v in kept]


def p5_by_bin_over_steps(rows: list[dict]) -> dict[str, tuple[list, list]]:
    """``{"bin <start>": (steps, p5)}`` over the steps where the bin got tokens, of the bins that
    received tokens at some step."""
    counts, p5 = bin_series(rows, "mismatch/count"), bin_series(rows, "mismatch/alpha_p5")
    steps = [r["step"] for r in rows]
    return {f"bin {b}": logged_points(steps, [v if n > 0 else np.nan for v, n in zip(p5.get(b, [np.nan] * len(rows)), c)])
            for b, c in counts.items() if np.nansum(c) > 0}


def plot_headline(table: dict[str, dict], rows: dict[str, list[list[dict]]], path: str | os.PathLike,
                  taus: Optional[dict[str, float]] = None) -> bool:
    """Write ``headline.png`` at ``path``. ``table``: the study's per-arm rows; ``rows``: per arm, each
    seed's training rows (first seed first); ``taus``: per arm the tau its p5 panel draws as a line.
    An arm is sparse when it logged a schedule's top-k (``schedule/topk/bin_*``). Panels without data
    are left out; returns False (nothing written) when no panel has any."""
    title, ylabel, series, bands = held_out_panel(table)
    panels = [(title, ylabel, series, bands)]
    speed = {arm: tokens_per_s(seeds) for arm, seeds in rows.items()}
    panels.append(("generated tokens per rollout second", "tok/s", {a: s for a, s in speed.items() if s[0]}))
    for arm, seeds in rows.items():
        first = seeds[0] if seeds else []
        if bin_series(first, "schedule/topk"):
            series = p5_by_bin_over_steps(first)
            if series and taus and arm in taus:
                steps = [r["step"] for r in first]
                series[f"tau {taus[arm]:g}"] = (steps, [taus[arm]] * len(steps))
            panels.append((f"p5 per bin: {arm} (seed {table[arm]['seeds'][0]})", "alpha p5", series))
    panels = [p for p in panels if p[2]]
    if not panels:
        return False
    plot_panels(panels, path, columns=3)
    return True


def plot_study(arms: dict[str, list], path: str) -> None:
    """study.png: reward, mean alpha and generated tokens per rollout second per step for every arm;
    then per sparse arm its p5 per generated-position bin, and per arm whose budgets moved (the
    online controller's) its top-k per bin (bins that received tokens only)."""
    steps = {a: [h["step"] for h in hist] for a, hist in arms.items()}
    series = lambda key: {a: (steps[a], [h.get(key, np.nan) for h in hist]) for a, hist in arms.items()}
    speed = {a: (steps[a], [h.get("rollout/generated_tokens", np.nan) / h.get("rollout/decode_s", np.nan)
                            for h in hist]) for a, hist in arms.items()}
    alpha = {a: logged_points(*v) for a, v in series("mismatch/alpha_mean").items() if a != "dense"}
    panels = [("reward", "reward_mean", series("reward_mean")),
              ("mean alpha (sparse arms)", "alpha mean", {a: v for a, v in alpha.items() if v[0]}),
              ("generated tokens per rollout second", "tok/s", speed)]
    for a, hist in arms.items():
        if a == "dense":
            continue
        counts = bin_series(hist, "mismatch/count")
        used = [b for b, c in counts.items() if np.nansum(c) > 0]
        panels.append((f"p5 per bin: {a}", "alpha p5", p5_by_bin_over_steps(hist)))
        topk = bin_series(hist, "schedule/topk")
        if any(len({v for v in values if np.isfinite(v)}) > 1 for values in topk.values()):
            panels.append((f"top-k per bin: {a}", "pages", {f"bin {b}": (steps[a], topk[b]) for b in used
                                                             if b in topk}))
    plot_panels([p for p in panels if p[2]], path, columns=4)  # an arm without binned tokens has no panel
