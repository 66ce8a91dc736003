"""Safe descent: the p5 a lower budget would read, measured on the step's own rollouts before sampling at it.

The online controller (:mod:`sparrow_jax.rollout.schedule_control`) proposes falls from the p5 it
measured at the current budgets. :func:`candidate_tail` scores the same rollouts teacher-forced
with the sparse actor at the proposed (candidate) table, every falling bin lowered at once, one
pass (:func:`sparrow_jax.mismatch.scorers.score_rollout`), and returns per position bin the
candidate's p5 and its tokens' acceptance rates; :func:`grouped_p5_lower_bound` turns those into a
lower confidence bound, and the controller keeps a fall only where the bound clears
``tau + probe_margin``.

**The bound is over prompts, not tokens.** The next step draws other prompts, and a step's p5 moves
with them far more than with its token count: at one fixed budget the calibrated quickstart reads
p5 0.99 one step and 0.24 the next in its last bin, when one of 16 rows goes off its trace (every
later token of that row then has a low rate, and one row is > 5% of a bin). Treating tokens as
independent draws (a binomial order-statistic bound) gives a bound within ~0.01 of the step's own
p5 and cannot see that. The bound here resamples whole prompts (a GRPO group's rows together) with
replacement, recomputes each bin's p5 per resample, and takes the ``1 - confidence`` quantile of
those p5s: what another draw of as many prompts would read, at the confidence asked.

**Off-policy.** The tokens were sampled at the higher budget; at the lower one the actor would
have drawn others (and reached states its errors lead to). The controller logs the candidate's
p5 (``schedule/probe_p5/bin_<start>``), its bound (``schedule/probe_lower/bin_<start>``) and its
table (``schedule/probe_topk/bin_<start>``), and :func:`probe_report` pairs each accepted fall's
prediction with the p5 that sampling at that budget measured the next step.
"""
from __future__ import annotations

import functools
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


@functools.partial(jax.jit, static_argnames=("config", "num_bins", "bin_width", "temperature", "seq_chunk"))
def candidate_tail(config: Qwen3Config, dense_params: Any, sparse_params: Any, tokens: jax.Array, mask: jax.Array,
                   prompt_lens: jax.Array, schedule, *, num_bins: int, bin_width: int, temperature: float = 1.0,
                   seq_chunk: int = 256) -> dict[str, jax.Array]:
    """Per-bin p5 of the sparse actor at ``schedule`` on given rollouts, and the rates it is read from.

    Args:
      dense_params / sparse_params: the policy and the sparse actor (the params the next rollouts use).
      tokens: int32 [B, T] rollouts; mask: [B, T] tokens that count (nonzero); prompt_lens: int32 [B].
      schedule: the candidate SparsitySchedule (its top-k table is traced: a change within its
        ``k_max`` bucket compiles nothing).
      num_bins, bin_width: the train step's bins (the last pools later positions; tokens binned at
        their producing query, :func:`query_positions`).
    Returns float32 ``p5`` [num_bins] (NaN in empty bins), int32 ``count`` [num_bins], float32 ``alpha``
    [B, T] (per-token acceptance rates) and int32 ``bins`` [B, T] (each token's bin), the inputs of
    :func:`grouped_p5_lower_bound`.
    """
    alpha = score_rollout(config, dense_params, sparse_params, tokens, prompt_lens, schedule=schedule,
                          temperature=temperature, seq_chunk=seq_chunk, top_k=0)["alpha"]
    bins = position_bins(jnp.broadcast_to(query_positions(tokens.shape[1]), tokens.shape), bin_width, num_bins)
    pct, counts = binned_percentile_jax(alpha, bins, mask, num_bins, 1, (5.0,))
    return {"p5": pct[:, 0], "count": counts, "alpha": alpha, "bins": bins.astype(jnp.int32)}


def group_draws(num_groups: int, resamples: int, seed: int) -> np.ndarray:
    """int64 [resamples, num_groups]: how many times each group is drawn in each bootstrap resample
    (``num_groups`` draws with replacement per resample)."""
    picks = np.random.default_rng(seed).integers(num_groups, size=(resamples, num_groups))
    return np.stack([np.bincount(p, minlength=num_groups) for p in picks])


def grouped_p5_lower_bound(alpha: np.ndarray, bins: np.ndarray, mask: np.ndarray, groups: np.ndarray,
                           num_bins: int, *, confidence: float = 0.95, resamples: int = 256, seed: int = 0,
                           quantile: float = 0.05, min_tokens: int = 59) -> np.ndarray:
    """Lower confidence bound on each bin's p5 under a new draw of prompts: float64 [num_bins].

    Args:
      alpha: float [B, T] per-token acceptance rates; bins: int [B, T] each token's bin; mask: bool [B, T]
        tokens that count; groups: int [B] each row's prompt (rows of one GRPO group share it).
      confidence: the bound is the ``1 - confidence`` quantile (numpy's "lower" rule) of the bin's p5 over
        ``resamples`` bootstrap resamples of whole groups (:func:`group_draws` with ``seed``).
      quantile: the percentile bounded (0.05: p5); per resample the weighted "inverted CDF" quantile, the
        smallest rate whose resample weight at or below it reaches ``quantile`` of the bin's.
      min_tokens: fewer tokens in a bin give no bound (59: below it even the bin's smallest rate is not a
        95% bound on its p5 for iid tokens, 1 - 0.95^59 >= 0.95).
    Returns NaN where the bin has no tokens, ``-inf`` (no bound) where it has fewer than ``min_tokens``
    or fewer than two groups reach it (no between-prompt spread to measure).
    """
    _, row_group = np.unique(np.asarray(groups), return_inverse=True)
    mask = np.asarray(mask, bool)
    row_weight = group_draws(int(row_group.max()) + 1, resamples, seed)[:, row_group]  # [R, B]
    out = np.full(num_bins, np.nan)
    for b in range(num_bins):
        rows, cols = np.nonzero(mask & (np.asarray(bins) == b))
        if rows.size == 0:
            continue
        if rows.size < min_tokens or np.unique(row_group[rows]).size < 2:
            out[b] = -np.inf
            continue
        order = np.argsort(np.asarray(alpha)[rows, cols], kind="stable")
        values, rows = np.asarray(alpha, np.float64)[rows, cols][order], rows[order]
        cum = np.cumsum(row_weight[:, rows], axis=1)  # [R, n] resample weight at or below each sorted rate
        total = cum[:, -1]
        first = np.minimum(np.sum(cum < quantile * total[:, None], axis=1), values.size - 1)
        p5s = values[first][total > 0]  # a resample that drew none of the bin's groups reads nothing
        out[b] = np.quantile(p5s, 1.0 - confidence, method="lower") if p5s.size else -np.inf
    return out


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
