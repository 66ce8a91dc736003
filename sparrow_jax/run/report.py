"""A run's report figures, rebuilt from what its workdir logged (``metrics.jsonl`` and
``alpha_hist.jsonl``), so a resumed or extended run reports what one uninterrupted run would.

Pure functions of the logged records: the reward windows, the validation series, the pooled
per-bin tail of the acceptance rate, the measured share of sparse tokens and the rollout cost.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from sparrow_jax.io.metrics import logged_bins
from sparrow_jax.stats import difference_se, histogram_percentile, mean_and_se


def training_rows(records: list[dict]) -> list[dict]:
    """The records of RL steps (step 0 holds only the validation before any update)."""
    return [r for r in records if "reward_mean" in r]


def reward_window(num_prompts: int, prompts_per_step: int, steps: int) -> int:
    """Steps averaged into ``reward_start`` / ``reward_end``: one pass over the training prompts
    (rounded up to whole steps) when the run makes at least two, so both windows hold the same
    prompts (exactly when ``prompts_per_step`` divides ``num_prompts``) and their difference is
    the policy's, not that of which prompts a step drew; otherwise 3 steps."""
    per_pass = -(-num_prompts // prompts_per_step)
    return per_pass if 2 * per_pass <= steps else 3


def reward_start_end(rewards: list, window: int) -> dict:
    """``reward_start`` / ``reward_end``: mean reward of the first and last ``window`` steps;
    ``reward_change_se``: the standard error of their difference from the steps' spread (None
    under two steps per window)."""
    first, last = (np.asarray([r for r in part if r is not None][:window], np.float64)
                   for part in (rewards, rewards[::-1]))
    return {"reward_start": mean_and_se(first)[0], "reward_end": mean_and_se(last)[0], "reward_window_steps": window,
            "reward_change_se": difference_se(first, last)}


def _finite(x: float) -> Optional[float]:
    return float(x) if x is not None and np.isfinite(x) else None


def val_series(records: list[dict], side: str, k: int) -> Optional[dict]:
    """``val/<side>/...`` over the run: ``{"metric", "start", "end", "start_se", "end_se", "steps"}``,
    start / end the first and last point of ``reward_mean@k`` (step 0 is before any update), and
    ``steps`` every point's ``{"step", "<figure>": value, "<figure>_se": se}``. None without points."""
    prefix, headline = f"val/{side}/", f"reward_mean@{k}"
    points = [{"step": r["step"], **{name[len(prefix):]: _finite(v) for name, v in r.items()
                                     if name.startswith(prefix)}}
              for r in records if f"{prefix}{headline}" in r]
    if not points:
        return None
    return {"metric": headline, "start": points[0][headline], "end": points[-1][headline],
            "start_se": points[0][f"{headline}_se"], "end_se": points[-1][f"{headline}_se"], "steps": points}


def _bin_cells(rows: list[dict]) -> dict[int, list[tuple[int, float, float, float]]]:
    """``{bin_start: [(step, p5, tokens, mean)]}`` of the steps where the bin received tokens."""
    return {b: [(r["step"], r[f"mismatch/alpha_p5/bin_{b}"], r[f"mismatch/count/bin_{b}"],
                 r[f"mismatch/alpha_mean/bin_{b}"])
                for r in rows if r.get(f"mismatch/count/bin_{b}", 0) > 0 and f"mismatch/alpha_p5/bin_{b}" in r]
            for b in logged_bins(rows, "mismatch/count")}


def pooled_p5_by_bin(rows: list[dict], histograms: list[tuple[int, dict]], q: float = 5.0) -> list[dict]:
    """Per position bin: ``{"bin_start", "p5", "mean", "count"}`` over every RL token of the run,
    ``p5`` the percentile of the tokens pooled from all steps (from the per-step 1e-3 histograms,
    within 5e-4 of the exact one), ``mean`` the token-weighted mean, ``count`` the tokens.
    Only steps present in ``rows`` count (histograms of steps beyond them are ignored)."""
    steps = {r["step"] for r in rows}
    pooled: dict[int, np.ndarray] = {}
    for step, bins in histograms:
        if step in steps:
            for b, counts in bins.items():
                pooled[b] = pooled.get(b, 0) + counts
    out = []
    for b, cells in _bin_cells(rows).items():
        count = sum(n for _, _, n, _ in cells)
        if not count:
            continue
        mean = sum(n * m for _, _, n, m in cells) / count
        p5 = histogram_percentile(pooled[b], q) if b in pooled else None
        out.append({"bin_start": b, "p5": p5, "mean": float(mean), "count": int(count)})
    return out


def p5_min_step_by_bin(rows: list[dict], min_count: float) -> list[dict]:
    """Per bin that received tokens, its worst step: ``{"bin_start", "p5", "step"}`` of the lowest
    per-step p5 among the steps that gave the bin >= ``min_count`` tokens (p5 / step None if no
    step did)."""
    out = []
    for b, cells in _bin_cells(rows).items():
        if not cells:
            continue
        full = [(p5, step) for step, p5, n, _ in cells if n >= min_count]
        p5, step = min(full) if full else (None, None)
        out.append({"bin_start": b, "p5": p5, "step": step})
    return out


def p5_hold_fraction(rows: list[dict], threshold: float, min_count: float) -> dict:
    """``p5_hold_fraction``: share of the (step, bin) cells with >= ``min_count`` tokens whose p5 is
    >= ``threshold`` (None without such cells); ``p5_hold_cells``: how many cells that is."""
    full = [p5 for cells in _bin_cells(rows).values() for _, p5, n, _ in cells if n >= min_count]
    return {"p5_hold_fraction": float(np.mean([p >= threshold for p in full])) if full else None,
            "p5_hold_cells": len(full)}


def p5_dips(rows: list[dict], threshold: float, min_count: float) -> dict:
    """``p5_dips``: the (step, bin) cells with >= ``min_count`` tokens whose p5 is below ``threshold``,
    each with the move of the bin's budget (``schedule/topk/bin_<start>``, the table the step sampled
    at) from the step before: ``fell``, ``held`` (also the first step, and runs without a schedule) or
    ``rose``. Returns ``{"fell", "held", "rose"}`` counts and ``cells``: ``[{"step", "bin_start",
    "p5", "tokens", "topk", "move"}]``. A dip right after a fall is what the online controller's fall
    probe exists to prevent; a dip at a held budget is the step-to-step spread of p5 itself."""
    bins = logged_bins(rows, "mismatch/count")
    budget = {(r["step"], b): r.get(f"schedule/topk/bin_{b}") for r in rows for b in bins}
    previous = {r["step"]: q["step"] for q, r in zip(rows, rows[1:])}
    out: dict = {"fell": 0, "held": 0, "rose": 0, "cells": []}
    for b, cells in _bin_cells(rows).items():
        for step, p5, n, _ in cells:
            if n < min_count or p5 >= threshold:
                continue
            now, before = budget.get((step, b)), budget.get((previous.get(step), b))
            move = "held" if now is None or before is None or now == before else ("fell" if now < before else "rose")
            out[move] += 1
            out["cells"].append({"step": step, "bin_start": b, "p5": p5, "tokens": n, "topk": now, "move": move})
    out["cells"].sort(key=lambda c: (c["step"], c["bin_start"]))
    return out


def token_weighted_mean(rows: list[dict], key: str) -> Optional[float]:
    """The per-step share ``key`` over the whole run, each step weighted by its generated tokens
    (None without a step logging it)."""
    steps = [(r["rollout/generated_tokens"], r[key]) for r in rows if "rollout/generated_tokens" in r and key in r]
    tokens = sum(n for n, _ in steps)
    return float(sum(n * f for n, f in steps) / tokens) if tokens else None


def measured_sparse_token_fraction(rows: list[dict]) -> float:
    """Share of the RL rollouts' (generated token, layer) pairs that attended fewer pages than they
    could see, over the whole run (each step's share weighted by its generated tokens)."""
    return token_weighted_mean(rows, "rollout/sparse_token_fraction") or 0.0


def generated_tokens_per_s(rows: list[dict]) -> Optional[float]:
    """Generated tokens per decode second of the RL rollouts, over the steps after the first
    (which compiles); None without such steps."""
    later = [r for r in rows[1:] if "rollout/decode_s" in r]
    seconds = sum(r["rollout/decode_s"] for r in later)
    return float(sum(r["rollout/generated_tokens"] for r in later) / seconds) if seconds > 0 else None


def training_report(records: list[dict], histograms: list[tuple[int, dict]], *, num_prompts: int,
                    prompts_per_step: int, steps: int, eval_k: int, tau: float, min_count: float) -> dict:
    """The report's figures of the training logged in a workdir (no timing among them):
    reward windows, ``val_dense`` / ``val_sparse``, ``final_eval`` (the last validation point),
    the pooled per-bin tail, the hold fraction at ``tau - 0.02`` over bins of >= ``min_count``
    tokens and the cells below it by the budget's move (:func:`p5_dips`), the measured sparse token
    share and the mean completion length."""
    rows = training_rows(records)
    window = reward_window(num_prompts, prompts_per_step, steps)
    evals = [r for r in records if any(k.startswith("val/") for k in r)]
    return {**reward_start_end([r["reward_mean"] for r in rows], window),
            "val_dense": val_series(records, "dense", eval_k), "val_sparse": val_series(records, "sparse", eval_k),
            "final_eval": {k: _finite(v) for k, v in evals[-1].items() if k.startswith("val/")} if evals else {},
            "p5_by_bin": pooled_p5_by_bin(rows, histograms), "p5_min_step_by_bin": p5_min_step_by_bin(rows, min_count),
            **p5_hold_fraction(rows, tau - 0.02, min_count), "p5_dips": p5_dips(rows, tau - 0.02, min_count),
            "sparse_token_fraction": measured_sparse_token_fraction(rows),
            "completion_tokens_mean": float(np.mean([r["response_length/mean"] for r in rows])) if rows else None,
            "trained_steps": len(rows)}
