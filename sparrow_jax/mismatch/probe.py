"""Safe descent: the p5 a lower budget would read, measured on the step's own rollouts before sampling at it.

The online controller (:mod:`sparrow_jax.rollout.schedule_control`) proposes falls from the p5 it
measured at the current budgets. :func:`candidate_tail` scores the same rollouts teacher-forced
with the sparse actor at the proposed (candidate) table, every falling bin lowered at once, one
pass (:func:`sparrow_jax.mismatch.scorers.score_rollout`), and returns per position bin the
candidate's p5 and a lower confidence bound on it; the controller keeps a fall only where the
bound clears ``tau + probe_margin``.

**The bound.** A bin's tokens are treated as ``n`` independent draws of alpha. The number of them
at or below the true 5th percentile is Binomial(n, 0.05), so the ``r``-th smallest value lies at
or below that percentile with probability ``P(Binomial(n, 0.05) >= r)``. The bound is the
order statistic with the largest ``r`` for which that probability is at least the confidence
``Phi(z)`` (:func:`p5_rank_lower_bound`), no bound (``-inf``) when even ``r = 1`` falls short
(fewer than 59 tokens at 95%). Tokens of one row are not independent and the next rollouts draw
other prompts, so the bound is optimistic about the next step: ``probe_margin`` covers that.

**Off-policy.** The tokens were sampled at the higher budget; at the lower one the actor would
have drawn others (and reached states its errors lead to). The controller logs the candidate's
p5 (``schedule/probe_p5/bin_<start>``) and its table (``schedule/probe_topk/bin_<start>``), and
:func:`probe_report` pairs each accepted fall's prediction with the p5 that sampling at that
budget measured the next step.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.cost_model import dense_rollout_cost
from sparrow_jax.io.metrics import logged_bins
from sparrow_jax.mismatch.scorers import score_rollout
from sparrow_jax.mismatch.tail import binned_percentile_jax, query_positions
from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.rollout.schedule import position_bins

# Percentiles read besides p5, a lower bound rounds down onto them: 0, 0.05, ..., 5 (a rank step of
# one token per 2000 tokens in the bin)
LOWER_PERCENTILES = tuple(round(0.05 * i, 2) for i in range(101))


def p5_rank_lower_bound(counts: jax.Array, z: float, quantile: float = 0.05) -> jax.Array:
    """int32 [bins]: the largest rank ``r`` (1-based; 0: none) whose order statistic of ``n`` iid draws
    lies at or below the population ``quantile`` with probability >= ``Phi(z)``, for ``n`` = counts [bins].

    ``P(X_(r) <= x_q) = P(Binomial(n, q) >= r) = I_q(r, n - r + 1)`` (regularised incomplete beta), which
    falls as ``r`` grows: a binary search over ``r`` in [0, n].
    """
    confidence = 0.5 * (1.0 + math.erf(float(z) / math.sqrt(2.0)))
    n = jnp.asarray(counts).astype(jnp.int32)

    def tail(r):  # P(Binomial(n, q) >= r), 1 for r = 0
        rf = jnp.maximum(r, 1).astype(jnp.float32)
        p = jax.scipy.special.betainc(rf, jnp.maximum(n - r + 1, 1).astype(jnp.float32), jnp.float32(quantile))
        return jnp.where(r >= 1, p, 1.0)

    def halve(_, bounds):  # invariant: tail(lo) >= confidence > tail(hi) (tail(n + 1) = 0)
        lo, hi = bounds
        mid = (lo + hi) // 2
        ok = tail(mid) >= confidence
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (jnp.zeros_like(n), n + 1))
    return lo


@functools.partial(jax.jit, static_argnames=("config", "num_bins", "bin_width", "temperature", "seq_chunk", "z"))
def candidate_tail(config: Qwen3Config, dense_params: Any, sparse_params: Any, tokens: jax.Array, mask: jax.Array,
                   prompt_lens: jax.Array, schedule, *, num_bins: int, bin_width: int, temperature: float = 1.0,
                   seq_chunk: int = 256, z: float = 1.64) -> dict[str, jax.Array]:
    """Per-bin p5 of the sparse actor at ``schedule`` on given rollouts, and its lower confidence bound.

    Args:
      dense_params / sparse_params: the policy and the sparse actor (the params the next rollouts use).
      tokens: int32 [B, T] rollouts; mask: [B, T] tokens that count (nonzero); prompt_lens: int32 [B].
      schedule: the candidate SparsitySchedule (its top-k table is traced: a change within its
        ``k_max`` bucket compiles nothing).
      num_bins, bin_width: the train step's bins (the last pools later positions; tokens binned at
        their producing query, :func:`query_positions`).
      z: one-sided normal quantile of the bound's confidence.
    Returns float32 ``p5`` [num_bins] (NaN in empty bins), ``lower`` [num_bins] (the order statistic
    of :func:`p5_rank_lower_bound`; -inf where the bin has too few tokens, NaN where none), int32
    ``count`` [num_bins].
    """
    alpha = score_rollout(config, dense_params, sparse_params, tokens, prompt_lens, schedule=schedule,
                          temperature=temperature, seq_chunk=seq_chunk, top_k=0)["alpha"]
    bins = position_bins(jnp.broadcast_to(query_positions(tokens.shape[1]), tokens.shape), bin_width, num_bins)
    pct, counts = binned_percentile_jax(alpha, bins, mask, num_bins, 1, (5.0,) + LOWER_PERCENTILES)
    rank = p5_rank_lower_bound(counts, z)
    # X_(r) is the percentile 100 (r - 1) / (n - 1) (numpy's linear rule); round down onto the grid read
    exact = 100.0 * (rank - 1).astype(jnp.float32) / jnp.maximum(counts - 1, 1).astype(jnp.float32)
    grid = jnp.asarray(LOWER_PERCENTILES, jnp.float32)
    index = jnp.clip(jnp.sum(grid[None, :] <= exact[:, None], axis=1) - 1, 0, len(grid) - 1)
    lower = jnp.take_along_axis(pct[:, 1:], index[:, None], axis=1)[:, 0]
    lower = jnp.where(counts == 0, jnp.nan, jnp.where(rank >= 1, lower, -jnp.inf))
    return {"p5": pct[:, 0], "lower": lower, "count": counts}


def probe_cost_vs_dense(config: Qwen3Config, *, num_samples: int, prompt_len: int, gen_len: int,
                        hardware: str = "H200") -> float:
    """Predicted time of one probe relative to a dense rollout of the same batch (cost model).

    The probe runs two teacher-forced passes (dense policy and sparse actor) over ``prompt_len +
    gen_len`` positions of ``num_samples`` rows: priced as two dense prefills of that length (the
    teacher-forced sparse pass masks pages of full attention, it reads no less).
    """
    full = dense_rollout_cost(config, num_samples=num_samples, prompt_len=prompt_len + gen_len, gen_len=1,
                              hardware=hardware).prefill_time_s
    rollout = dense_rollout_cost(config, num_samples=num_samples, prompt_len=prompt_len, gen_len=gen_len,
                                 hardware=hardware).time_s
    return 2.0 * full / rollout


def probe_report(history: list[dict], min_count: int = 1) -> dict:
    """``{"probe_error": ...}`` from a run's per-step metrics ({} when no probe ran).

    Pairs each bin's probe prediction at step ``t`` (``schedule/probe_p5/bin_<start>`` at the table
    ``schedule/probe_topk/bin_<start>``) with the p5 sampling measured at step ``t + 1`` when that
    step's rollouts used that budget (the fall was kept) over >= ``min_count`` tokens. Per bin:
    ``pairs``, ``mean_abs_error``, ``worst_abs_error``, ``mean_error`` (measured - predicted: negative when
    the probe was optimistic), and over all bins the same plus ``probes`` (steps that ran one),
    ``rejected`` (bins whose fall a probe stopped), ``probe_s`` (seconds in all).
    """
    if not logged_bins(history, "schedule/probe_p5"):
        return {}
    errors: dict[int, list[float]] = {}
    for now, after in zip(history, history[1:]):
        for b in logged_bins([now], "schedule/probe_p5"):
            predicted = now[f"schedule/probe_p5/bin_{b}"]
            same_budget = after.get(f"schedule/topk/bin_{b}") == now.get(f"schedule/probe_topk/bin_{b}")
            measured = after.get(f"mismatch/alpha_p5/bin_{b}")
            if same_budget and measured is not None and after.get(f"mismatch/count/bin_{b}", 0) >= min_count:
                errors.setdefault(b, []).append(float(measured) - float(predicted))

    def summary(e: list[float]) -> dict:
        a = np.abs(np.asarray(e, np.float64))
        return {"pairs": len(e), "mean_abs_error": float(a.mean()) if e else None,
                "worst_abs_error": float(a.max()) if e else None, "mean_error": float(np.mean(e)) if e else None}

    every = [x for b in sorted(errors) for x in errors[b]]
    return {"probe_error": {"by_bin": {str(b): summary(errors[b]) for b in sorted(errors)}, **summary(every),
                            "probes": sum(1 for h in history if "timing_s/probe" in h),
                            "rejected": int(sum(h.get("schedule/probe_rejected", 0.0) for h in history)),
                            "probe_s": float(sum(h.get("timing_s/probe", 0.0) for h in history))}}


def probe_metrics(bin_starts: list[int], candidate_topk: np.ndarray, probed: np.ndarray, result: dict,
                  rejected: np.ndarray) -> dict[str, float]:
    """The step's probe metrics: per probed bin its candidate p5, lower bound and top-k; rejections."""
    out: dict[str, float] = {"schedule/probe_rejected": float(np.sum(np.asarray(rejected) >= 0))}
    for i in np.flatnonzero(probed):
        b = bin_starts[i]
        out[f"schedule/probe_p5/bin_{b}"] = float(result["p5"][i])
        if np.isfinite(result["lower"][i]):  # -inf: too few tokens for a bound (the fall was rejected)
            out[f"schedule/probe_lower/bin_{b}"] = float(result["lower"][i])
        out[f"schedule/probe_topk/bin_{b}"] = float(candidate_topk[i])
    return out
