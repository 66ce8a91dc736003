"""Calibrate a position-dependent sparsity schedule from measured acceptance-rate tails (Sparrow §4).

For every candidate top-k budget, sparse rollouts are generated with that budget at every
position, scored against the dense policy (exact per-token acceptance rate alpha_t, see
:func:`sparrow_jax.mismatch.score_rollout`), and alpha is pooled per position bin. The
result is a table ``budget x bin -> p5`` (plus mean and token count). The schedule is the
cheapest one with ``p5 >= tau`` in every bin and budgets non-decreasing with position,
found by the cost model's exact dynamic programme (:func:`sparrow_jax.cost_model.optimise_schedule`).

Conventions:
  * A completion token ``t`` is binned by the position of the query that produced it
    (``t - 1``): that is the position whose budget ``schedule.topk_at`` sets in the sampler,
    so a bin's statistic is governed by that bin's budget. Only completion tokens count
    (prompt tokens are prefilled densely and never sampled).
  * alpha is computed on the untruncated distributions at the sampling temperature
    (temperature 1 when sampling greedily); top-k / top-p truncation is ignored.
  * Bins where no budget has ``min_count`` tokens are "unmeasured" and inherit the budget
    of the previous bin (bins before the first measured bin take the first measured bin's
    budget). An entry with fewer than ``min_count`` tokens never counts as meeting tau.
  * A bin where no budget reaches tau gets the largest budget and is reported in
    ``flagged_bins`` (later bins then keep the largest budget too: non-decreasing).
  * With ``min_survival`` > 0, a budget must also keep the sparse traces alive: among the rows
    whose loss (tokens up to the reward horizon, ``horizon_mask``) reaches a bin, the share whose
    loss does not end there before their completion does must be >= ``min_survival`` times the
    largest budget's share. Why: on tasks whose answer breaks at one wrong token, the few tokens
    that end traces are far below any percentile of all tokens (1.8% of the tokens on
    recurrence_trace), so a schedule can hold p5 and still end most traces early. A cell seen by
    fewer than ``MIN_SURVIVAL_ROWS`` rows never meets it; a bin whose largest budget has fewer
    is not constrained (``survival_unmeasured="free"``) or gets the largest budget ("largest").
    The counts come from the tail's sampled rows, or (``survival_prompts``) from one greedy trace
    per prompt: sampled traces break on their own within a few hundred positions, so few reach the
    late bins, while greedy traces (the policy's own best, which RL sharpens it toward) reach them.
    A bin without tail tokens that the survival rows measured keeps the budgets the rule allows.
    Conditioned on reaching the bin, the share depends mostly on the bin's own budget, so a
    schedule's whole-trace survival is roughly the product of its bins' shares. The validation on
    fresh prompts checks p5 only.
  * Every measurement reports ``scorer_logp_max_err``, the largest gap between the sampler's
    log-prob of a sampled token and the sparse scorer's: ~1e-5 when they agree. The scorer
    attends sparsely at prompt positions too, while the sampler prefills the prompt densely,
    so with two or more sparse layers the gap (and the error in alpha) grows with the prompt.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from sparrow_jax.cost_model import optimise_schedule
from sparrow_jax.mismatch.scorers import score_rollout
from sparrow_jax.mismatch.tail import TailAccumulator, query_positions
from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.qwen3 import Params
from sparrow_jax.rollout.sampler import SamplingParams, generate
from sparrow_jax.rollout.schedule import SparsitySchedule

# (rollout, index of its first row) -> [b, T] the tokens a tail counts (run.calibration: the reward horizon's)
TokenMask = Callable[[Any, int], np.ndarray]
DEFAULT_MIN_COUNT = 40  # tokens a bin needs before its 5th percentile is trusted
SURVIVAL_UNMEASURED = ("free", "largest")  # a bin too few rows reach: p5 alone, or the largest budget
MIN_SURVIVAL_ROWS = 16  # rows a (budget, bin) cell needs before its survival share counts: one row is <= 6% of it


def horizon_survival(loss_mask: np.ndarray, completion_mask: np.ndarray, bin_width: int,
                     n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Per position bin, how many rows' loss reaches it and how many end there early.

    Args:
      loss_mask, completion_mask: bool [B, T]; the loss's tokens (a prefix of each completion: up to
        its reward horizon) and the completion's. Token ``t`` belongs to query position ``t - 1``.
      n_bins: bins of ``bin_width`` query positions counted (positions past them are ignored).
    Returns ``(reached, ended)``, int [n_bins]: rows with a loss token in the bin (a row without loss
    tokens reaches its first completion token's bin), and those among them whose last loss token is
    in the bin and comes before their completion's last token (a trace broken there).
    """
    loss, comp = np.asarray(loss_mask, bool), np.asarray(completion_mask, bool)
    if loss.shape != comp.shape or loss.ndim != 2:
        raise ValueError(f"loss_mask and completion_mask: expected one [B, T] shape, got {loss.shape} and {comp.shape}")
    reached, ended = np.zeros(n_bins, np.int64), np.zeros(n_bins, np.int64)
    for row_loss, row_comp in zip(loss, comp):
        completion = np.flatnonzero(row_comp)
        if completion.size == 0:
            continue
        lost = np.flatnonzero(row_loss & row_comp)
        first, last = (lost[0], lost[-1]) if lost.size else (completion[0], completion[0] - 1)
        lo, hi = (first - 1) // bin_width, (max(first, last) - 1) // bin_width
        reached[lo:min(hi, n_bins - 1) + 1] += 1
        if last < completion[-1] and hi < n_bins:
            ended[hi] += 1
    return reached, ended


def _scoring_temperature(sampling: SamplingParams) -> float:
    return sampling.temperature if sampling.temperature > 0 else 1.0


def _position_bins(rows: Sequence[Sequence[int]], max_new_tokens: int, bin_width: int) -> int:
    """Bins of ``bin_width`` positions that cover the longest row and its completion."""
    return -(-(max(map(len, rows)) + max_new_tokens) // bin_width)


def measure_tail(config: Qwen3Config, params: Params, prompts: Sequence[Sequence[int]],
                 schedule: SparsitySchedule, sampling: SamplingParams, samples_per_prompt: int,
                 key: jax.Array, percentile: float = 5.0, pad_id: int = 0, batch_size: int = 64,
                 sparse_params: Params | None = None, token_mask: TokenMask | None = None,
                 horizon_mask: TokenMask | None = None) -> dict[str, Any]:
    """Sparse rollouts under ``schedule`` -> per-bin tail of alpha over completion tokens.

    Args:
      prompts: token-id lists; each is sampled ``samples_per_prompt`` times.
      schedule: the sparse actor's schedule (bins of ``schedule.bin_width`` tokens).
      sparse_params: the sparse actor's params (default: ``params``, no LoRA).
      batch_size: rows per generate/score call.
      token_mask: ``token_mask(rollout, first_row)`` -> [b, T] the tokens of the ``b`` rows from
        ``first_row`` on (rows are ``prompts`` in order, each repeated ``samples_per_prompt``
        times) that the tail counts, within their completions; None counts every completion token.
      horizon_mask: as ``token_mask``, each row's tokens up to its reward horizon, for the
        survival counts (:func:`horizon_survival`); None: not counted.
    Returns dict: ``bin_starts`` int [n], ``p`` (percentile) float [n], ``mean`` float [n],
    ``count`` int [n] over the non-empty bins; ``reached`` and ``ended`` int [bins from 0] (None
    without ``horizon_mask``); ``tokens`` (completion tokens), ``finished``
    (share of rows that stopped), ``scorer_logp_max_err`` (max |sampler log-prob - scorer
    sparse log-prob| over completion tokens; NaN when the sampler truncates or is greedy,
    where the two need not agree), ``seconds``.
    """
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    if not prompts:
        raise ValueError("calibration needs at least one prompt")
    sparse_params = params if sparse_params is None else sparse_params
    rows = [list(p) for p in prompts for _ in range(samples_per_prompt)]
    acc = TailAccumulator(schedule.bin_width, q=(float(percentile),))
    temperature = _scoring_temperature(sampling)
    comparable = sampling.temperature > 0 and sampling.top_k == 0 and sampling.top_p >= 1.0
    err, finished, t0 = 0.0, [], time.perf_counter()
    n_bins = _position_bins(rows, sampling.max_new_tokens, schedule.bin_width)
    reached, ended = np.zeros(n_bins, np.int64), np.zeros(n_bins, np.int64)
    for i in range(0, len(rows), batch_size):
        batch = rows[i:i + batch_size]
        # The same keys for every schedule (common random numbers): budgets differ less by chance.
        out = generate(config, sparse_params, batch, jax.random.fold_in(key, i), sampling,
                       schedule=schedule, pad_id=pad_id)
        stats = score_rollout(config, params, sparse_params, jax.numpy.asarray(out.tokens),
                              jax.numpy.asarray(out.prompt_lens),  # the prompt prefill is dense
                              schedule=schedule, temperature=temperature, top_k=0)
        alpha = np.asarray(stats["alpha"])
        counted = out.completion_mask if token_mask is None else out.completion_mask & (token_mask(out, i) > 0)
        acc.update(alpha, np.broadcast_to(query_positions(alpha.shape[1]), alpha.shape), counted)
        if horizon_mask is not None:
            r, e = horizon_survival(horizon_mask(out, i) > 0, out.completion_mask, schedule.bin_width, n_bins)
            reached, ended = reached + r, ended + e
        if comparable and out.completion_mask.any():
            diff = np.abs(np.asarray(stats["logp_sparse"]) - out.logprobs)[out.completion_mask]
            err = max(err, float(diff.max()))
        finished.append(out.finished)
    res = acc.result()
    return dict(bin_starts=res["bin_starts"], p=res["percentiles"][float(percentile)], mean=res["mean_by_bin"],
                count=res["counts"], tokens=int(acc.num_tokens),
                reached=None if horizon_mask is None else reached, ended=None if horizon_mask is None else ended,
                finished=float(np.mean(np.concatenate(finished))),
                scorer_logp_max_err=err if comparable else math.nan, seconds=time.perf_counter() - t0)


def measure_survival(config: Qwen3Config, params: Params, prompts: Sequence[Sequence[int]],
                     schedule: SparsitySchedule, sampling: SamplingParams, horizon_mask: TokenMask,
                     pad_id: int = 0, batch_size: int = 64) -> dict[str, Any]:
    """One greedy sparse trace per prompt under ``schedule`` -> :func:`horizon_survival` counts.

    Args:
      params: the sparse actor's params.
      sampling: the rollout's sampling (its length and stop ids; decoded greedily).
      horizon_mask: ``horizon_mask(rollout, first_row)`` -> [b, T] each row's tokens up to its
        reward horizon; rows are ``prompts`` in order, once each.
    Returns dict: ``reached``, ``ended`` int [bins from 0], ``seconds``.
    """
    if not prompts:
        raise ValueError("measure_survival needs at least one prompt")
    greedy = dataclasses.replace(sampling, temperature=0.0, top_k=0, top_p=1.0)
    rows, t0 = [list(p) for p in prompts], time.perf_counter()
    n_bins = _position_bins(rows, sampling.max_new_tokens, schedule.bin_width)
    reached, ended = np.zeros(n_bins, np.int64), np.zeros(n_bins, np.int64)
    for i in range(0, len(rows), batch_size):
        # greedy decoding draws no random numbers: the key is a formality
        out = generate(config, params, rows[i:i + batch_size], jax.random.PRNGKey(0), greedy,
                       schedule=schedule, pad_id=pad_id)
        r, e = horizon_survival(horizon_mask(out, i) > 0, out.completion_mask, schedule.bin_width, n_bins)
        reached, ended = reached + r, ended + e
    return dict(reached=reached, ended=ended, seconds=time.perf_counter() - t0)


def fixed_schedule(base: SparsitySchedule, topk: int) -> SparsitySchedule:
    """``base`` (page size, bins, reserved pages, dense layers, selector) with one top-k everywhere."""
    return dataclasses.replace(base, topk=(int(topk),), name=f"fixed-topk{int(topk)}", meta=None)


def _check_budgets(budgets: Sequence[int]) -> list[int]:
    ks = [int(k) for k in budgets]
    if not ks:
        raise ValueError("budgets: expected at least one top-k value, got none")
    if any(k < 0 for k in ks) or len(set(ks)) != len(ks) or ks != sorted(ks):
        raise ValueError(f"budgets: expected distinct non-negative top-k values in increasing order, got {ks}")
    return ks


def derive_topk(config: Qwen3Config, budgets: Sequence[int], p5: np.ndarray, count: np.ndarray, tau: float,
                schedule_base: SparsitySchedule, *, min_count: int = DEFAULT_MIN_COUNT, num_samples: int = 8,
                prompt_len: int = 1, gen_len: int = 1, hardware: str = "cpu", survival: np.ndarray | None = None,
                min_survival: float = 0.0, survival_unmeasured: str = "free") -> dict[str, Any]:
    """Cheapest non-decreasing top-k per bin with ``p5 >= tau`` (see the module docstring).

    Args:
      budgets: K increasing top-k values; p5, count: [K, n_bins] (NaN / 0 where no tokens).
      survival: [K, n_bins] share of the rows reaching a bin whose trace it does not break (NaN
        where too few rows); with ``min_survival`` > 0 a cell must also hold ``survival >=
        min_survival * survival[-1]`` wherever the largest budget's share is measured.
      survival_unmeasured: where it is not (too few rows reach the bin), "free" leaves the bin to
        p5 alone and "largest" gives it the largest budget (its traces' survival is unknown).
      num_samples, prompt_len, gen_len, hardware: the rollout the cost model prices (decode
        steps at positions ``prompt_len .. prompt_len + gen_len - 2``).
    Returns dict: ``topk`` list [n_bins], ``flagged_bins`` (no budget met tau),
    ``inherited_bins`` (unmeasured), ``cost_s`` (cost-model decode time).
    """
    ks = _check_budgets(budgets)
    p5, count = np.asarray(p5, np.float64), np.asarray(count)
    if p5.ndim != 2 or p5.shape[0] != len(ks) or count.shape != p5.shape:
        raise ValueError(f"p5 and count: expected shape [{len(ks)}, n_bins], got {p5.shape} and {count.shape}")
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"tau: expected a value in (0, 1], got {tau}")
    reliable = count >= min_count
    feasible = reliable & (np.nan_to_num(p5, nan=-1.0) >= tau)
    if not 0.0 <= min_survival <= 1.0:
        raise ValueError(f"min_survival: expected a value in [0, 1], got {min_survival}")
    if survival_unmeasured not in SURVIVAL_UNMEASURED:
        raise ValueError(f"survival_unmeasured: expected one of {SURVIVAL_UNMEASURED}, got {survival_unmeasured!r}")
    keeps = np.ones_like(feasible)  # the survival rule's verdict per cell (True where it does not apply)
    survival_measured = np.zeros(p5.shape[1], bool)
    if min_survival > 0:
        if survival is None or np.shape(survival) != p5.shape:
            raise ValueError(f"min_survival > 0 needs survival of shape {p5.shape}, got "
                             f"{None if survival is None else np.shape(survival)}")
        survival = np.asarray(survival, np.float64)
        reference = survival[-1]
        survival_measured = ~np.isnan(reference)
        unknown = np.arange(len(ks))[:, None] == len(ks) - 1 if survival_unmeasured == "largest" else True
        keeps = np.where(survival_measured[None, :], np.nan_to_num(survival, nan=-1.0) >= min_survival * reference,
                         unknown)
        feasible &= keeps
    measured = reliable.any(axis=0)
    flagged = [b for b in range(p5.shape[1]) if measured[b] and not feasible[:, b].any()]
    for b in flagged:
        feasible[-1, b] = True  # nothing reaches tau: the largest budget, flagged
    inherited = [b for b in range(p5.shape[1]) if not measured[b]]
    # no tail there: any budget (the optimiser keeps the previous bin's, cheapest), or, where the
    # survival rows measured the bin (greedy traces reach bins the sampled tail may not), those that keep them
    for b in inherited:
        feasible[:, b] = keeps[:, b] if survival_measured[b] else True
    if not measured.any():
        raise ValueError(f"no bin has >= {min_count} completion tokens for any budget; "
                         f"sample more prompts or lower min_count")
    # The optimiser takes a p5 table and tau; feasibility as 1/0 with tau 0.5 is the same rule.
    sched, cost = optimise_schedule(
        config, {k: feasible[i].astype(np.float64) for i, k in enumerate(ks)}, 0.5,
        num_samples=max(1, int(num_samples)), prompt_len=max(1, int(prompt_len)), gen_len=max(1, int(gen_len)),
        hardware=hardware, bin_width=schedule_base.bin_width, page_size=schedule_base.page_size,
        dense_layers=[d for d in schedule_base.dense_layers if d < config.num_hidden_layers],
        reserved_first=schedule_base.reserved_first, reserved_last=schedule_base.reserved_last,
        selector=schedule_base.selector)
    topk = list(sched.topk)
    first = int(np.argmax(measured))
    topk[:first] = [topk[first]] * first  # no data before the first measured bin: take its budget
    return dict(topk=topk, flagged_bins=flagged, inherited_bins=inherited, cost_s=cost)


def calibrate(config: Qwen3Config, params: Params, prompts: Sequence[Sequence[int]], budgets: Sequence[int],
              tau: float, schedule_base: SparsitySchedule, sampling: SamplingParams, samples_per_prompt: int,
              key: jax.Array, percentile: float = 5.0, *, min_count: int = DEFAULT_MIN_COUNT,
              hardware: str = "cpu", pad_id: int = 0, batch_size: int = 64, progress: bool = False,
              sparse_params: Params | None = None, token_mask: TokenMask | None = None,
              min_survival: float = 0.0, horizon_mask: TokenMask | None = None,
              survival_unmeasured: str = "free",
              survival_prompts: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """Measure the budget x bin tail table and derive the calibrated schedule.

    Args:
      prompts: token-id lists (spread their lengths so completions cover every bin).
      budgets: increasing top-k values (pages) to measure, each as a fixed-budget schedule
        built from ``schedule_base`` (page size, bin width, reserved pages, dense layers,
        selector).
      tau: target percentile acceptance rate per bin (the paper's 0.86 for p5).
      sampling: how the sparse actor samples (``stop_ids`` should hold the EOS).
      percentile: the tail percentile (5 = the paper's p5).
      min_count: completion tokens a (budget, bin) entry needs to count.
      token_mask: the tokens the tail counts (:func:`measure_tail`); None: every completion token.
      min_survival, horizon_mask: the survival rule of the module docstring (0: off) and each row's
        tokens up to its reward horizon (:func:`measure_tail`), needed when ``min_survival`` > 0;
        survival_unmeasured: the rule's bins that too few rows reach (:func:`derive_topk`).
      survival_prompts: count survival on one greedy trace of each of these prompts
        (:func:`measure_survival`; ``horizon_mask`` then indexes them, once each) instead of on
        the tail's sampled rows; None: the sampled rows.
    Returns dict:
      ``schedule``: the SparsitySchedule (``meta``: tau, percentile, min_count, table,
        flagged/inherited bins);
      ``table``: dict(budgets [K], bin_width, bin_starts [n], p5 / mean [K][n] (NaN: no
        tokens), count [K][n], percentile; with ``horizon_mask``, reached [K][n] and survival
        [K][n] (None: under ``MIN_SURVIVAL_ROWS`` rows));
      ``flagged_bins``, ``inherited_bins``, ``cost_s``, ``per_budget`` (tokens, finished,
        scorer_logp_max_err, seconds per budget).
    """
    ks = _check_budgets(budgets)
    if not 0.0 < percentile < 100.0:
        raise ValueError(f"percentile: expected a value in (0, 100), got {percentile}")
    if min_survival > 0 and horizon_mask is None:
        raise ValueError("min_survival > 0 needs horizon_mask (each row's tokens up to its reward horizon)")
    greedy = survival_prompts is not None
    if greedy and horizon_mask is None:
        raise ValueError("survival_prompts needs horizon_mask (each of their rows' tokens up to its reward horizon)")
    measured = {}
    for k in ks:
        schedule_k = fixed_schedule(schedule_base, k)
        measured[k] = measure_tail(config, params, prompts, schedule_k, sampling,
                                   samples_per_prompt, key, percentile, pad_id=pad_id, batch_size=batch_size,
                                   sparse_params=sparse_params, token_mask=token_mask,
                                   horizon_mask=None if greedy else horizon_mask)
        if greedy:
            counts = measure_survival(config, params if sparse_params is None else sparse_params, survival_prompts,
                                      schedule_k, sampling, horizon_mask, pad_id=pad_id, batch_size=batch_size)
            measured[k].update(reached=counts["reached"], ended=counts["ended"],
                               seconds=measured[k]["seconds"] + counts["seconds"])
        if progress:
            m = measured[k]
            print(f"[calibrate] top-k {k}: {m['tokens']} tokens, min p{percentile:g} "
                  f"{np.min(m['p']):.4f}, {m['seconds']:.1f}s", flush=True)
    n_bins = 1 + max(int(m["bin_starts"].max()) // schedule_base.bin_width for m in measured.values()
                     if m["bin_starts"].size)
    if greedy:  # greedy traces may reach bins the tail's sampled rows did not: the table spans those too
        n_bins = max([n_bins] + [int(np.flatnonzero(m["reached"])[-1]) + 1 for m in measured.values()
                                 if m["reached"].any()])
    p5 = np.full((len(ks), n_bins), np.nan)
    mean = np.full((len(ks), n_bins), np.nan)
    count = np.zeros((len(ks), n_bins), np.int64)
    for i, k in enumerate(ks):
        b = measured[k]["bin_starts"] // schedule_base.bin_width
        p5[i, b], mean[i, b], count[i, b] = measured[k]["p"], measured[k]["mean"], measured[k]["count"]
    survival, reached = None, None
    if horizon_mask is not None:
        # the survival rows may span other bins than the tail's: cut or zero-pad to the table's
        fit = lambda a: np.pad(a[:n_bins], (0, max(0, n_bins - len(a))))  # noqa: E731
        reached = np.stack([fit(measured[k]["reached"]) for k in ks])
        ended = np.stack([fit(measured[k]["ended"]) for k in ks])
        survival = np.where(reached >= MIN_SURVIVAL_ROWS, 1.0 - ended / np.maximum(reached, 1), np.nan)
    lens = [len(p) for p in prompts]
    derived = derive_topk(config, ks, p5, count, tau, schedule_base, min_count=min_count,
                          num_samples=len(prompts) * samples_per_prompt, prompt_len=min(lens),
                          gen_len=max(lens) - min(lens) + sampling.max_new_tokens, hardware=hardware,
                          survival=survival, min_survival=min_survival, survival_unmeasured=survival_unmeasured)
    table = dict(budgets=ks, bin_width=schedule_base.bin_width,
                 bin_starts=[b * schedule_base.bin_width for b in range(n_bins)], percentile=float(percentile),
                 p5=_nan_to_none(p5), mean=_nan_to_none(mean), count=count.tolist())
    if survival is not None:
        table.update(reached=reached.tolist(), survival=_nan_to_none(survival))
    meta = dict(tau=float(tau), percentile=float(percentile), min_count=int(min_count), table=table,
                flagged_bins=derived["flagged_bins"], inherited_bins=derived["inherited_bins"])
    if min_survival > 0:
        meta.update(min_survival=float(min_survival), survival_unmeasured=survival_unmeasured,
                    survival_decoding="greedy" if greedy else "sampled")
    schedule = dataclasses.replace(schedule_base, topk=tuple(derived["topk"]), name=f"calibrated-tau{tau:g}",
                                   meta=meta)
    per_budget = {str(k): {f: measured[k][f] for f in ("tokens", "finished", "scorer_logp_max_err", "seconds")}
                  for k in ks}
    return dict(schedule=schedule, table=table, flagged_bins=derived["flagged_bins"],
                inherited_bins=derived["inherited_bins"], cost_s=derived["cost_s"], per_budget=per_budget)


def validate(config: Qwen3Config, params: Params, prompts: Sequence[Sequence[int]], schedule: SparsitySchedule,
             sampling: SamplingParams, samples_per_prompt: int, key: jax.Array, percentile: float = 5.0, *,
             tau: float | None = None, margin: float = 0.02, min_count: int = DEFAULT_MIN_COUNT,
             pad_id: int = 0, batch_size: int = 64, sparse_params: Params | None = None,
             token_mask: TokenMask | None = None) -> dict[str, Any]:
    """Per-bin tail of a (calibrated) schedule on fresh prompts (``token_mask``: as :func:`measure_tail`).

    Returns dict: ``bin_starts``, ``p5``, ``mean``, ``count`` (lists over non-empty bins),
    ``min_p5`` over bins with >= ``min_count`` tokens, and, with ``tau``, ``meets`` per bin
    (``p5 >= tau - margin``, None for bins under ``min_count``) and ``ok`` (all measured bins meet).
    """
    m = measure_tail(config, params, prompts, schedule, sampling, samples_per_prompt, key, percentile,
                     pad_id=pad_id, batch_size=batch_size, sparse_params=sparse_params, token_mask=token_mask)
    reliable = m["count"] >= min_count
    out = dict(bin_starts=m["bin_starts"].tolist(), p5=m["p"].tolist(), mean=m["mean"].tolist(),
               count=m["count"].tolist(), percentile=float(percentile),
               min_p5=float(m["p"][reliable].min()) if reliable.any() else math.nan,
               scorer_logp_max_err=m["scorer_logp_max_err"], seconds=m["seconds"])
    if tau is not None:
        meets = [bool(p >= tau - margin) if r else None for p, r in zip(m["p"], reliable)]
        out.update(tau=float(tau), margin=float(margin), meets=meets,
                   ok=all(x for x in meets if x is not None))
    return out


def _nan_to_none(x: np.ndarray) -> list:
    """[K, n] floats -> nested lists with None for NaN (plain JSON, loadable by json.load)."""
    return [[None if not np.isfinite(v) else float(v) for v in row] for row in np.asarray(x)]


# ---- a whole calibration run from a run config (experiments.calibrate, experiments.run) ------

def spread_context_lengths(context_tokens: int, n: int, min_context: int | None = None) -> list[int]:
    """``n`` context lengths evenly spread over ``[min_context, context_tokens]``.

    Completion tokens sit right after the prompt, so prompts of one length would put every
    completion token in one position bin; spreading the lengths covers every bin up to the
    task's context. Default ``min_context``: ``max(32, context_tokens // 8)``.
    """
    lo = max(32, context_tokens // 8) if min_context is None else int(min_context)
    lo = min(lo, context_tokens)
    if n == 1:
        return [int(context_tokens)]
    return [int(round(lo + (context_tokens - lo) * i / (n - 1))) for i in range(n)]


def _visible_and_kept_pages(schedule: SparsitySchedule, prompt_lens: np.ndarray,
                            lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pages visible to and kept by a sparse layer for every generated token [T] (rows concatenated).

    Row ``b`` generates tokens ``prompt_lens[b] .. lengths[b] - 1``; token ``t`` comes from the
    query at position ``t - 1``, which sees ``t`` tokens in ``ceil(t / page_size)`` pages and
    keeps ``topk_at(t - 1) + reserved`` of them (all when that is more)."""
    t = np.concatenate([np.arange(p, n) for p, n in zip(prompt_lens, lengths)])
    pages = -(-t // schedule.page_size)
    return pages, np.minimum(schedule.topk_at(t - 1) + schedule.reserved, pages)


def _sparse_layer_share(schedule: SparsitySchedule, num_layers: int | None) -> float:
    """Share of the model's layers that attend sparsely (1 when the layer count is not given)."""
    if num_layers is None:
        return 1.0
    return sum(1 for i in range(num_layers) if i not in schedule.dense_layers) / num_layers


def sparse_token_fraction(schedule: SparsitySchedule | None, prompt_lens: np.ndarray,
                          lengths: np.ndarray, num_layers: int | None = None) -> float:
    """Share of generated tokens whose KV budget was below their visible context
    (:func:`_visible_and_kept_pages`). 0 for dense rollouts. With ``num_layers``, the share is over
    (token, layer) pairs: a layer in ``dense_layers`` attends every visible page, so it counts as
    dense for every token.
    """
    prompt_lens, lengths = np.asarray(prompt_lens), np.asarray(lengths)
    if schedule is None or int((lengths - prompt_lens).sum()) == 0:
        return 0.0
    pages, kept = _visible_and_kept_pages(schedule, prompt_lens, lengths)
    return float(np.mean(kept < pages)) * _sparse_layer_share(schedule, num_layers)


def kept_page_share(schedule: SparsitySchedule | None, prompt_lens: np.ndarray, lengths: np.ndarray,
                    num_layers: int | None = None) -> float:
    """Share of the visible KV pages the rollouts' attention kept, averaged over generated tokens
    (:func:`_visible_and_kept_pages`); with ``num_layers`` over (token, layer) pairs, a dense layer
    keeping every page. 1 for dense rollouts or no generated token."""
    prompt_lens, lengths = np.asarray(prompt_lens), np.asarray(lengths)
    if schedule is None or int((lengths - prompt_lens).sum()) == 0:
        return 1.0
    pages, kept = _visible_and_kept_pages(schedule, prompt_lens, lengths)
    sparse = _sparse_layer_share(schedule, num_layers)
    return float(np.mean(kept / pages)) * sparse + (1.0 - sparse)


def format_report(result: dict[str, Any]) -> str:
    """Human-readable table: p5 (and mean) per bin for every budget, the schedule, validation."""
    table, val = result["table"], result["validation"]
    q = f"p{table['percentile']:g}"
    starts = table["bin_starts"]
    fmt = lambda v: "   -  " if v is None else f"{v:.4f}"
    lines = [f"{q} of alpha by position bin (columns: bin start; 'tokens': completion tokens of the first budget)",
             "top-k   " + " ".join(f"{s:>7d}" for s in starts)]
    for i, k in enumerate(table["budgets"]):
        lines.append(f"{k:>5d}   " + " ".join(f"{fmt(v):>7s}" for v in table["p5"][i]))
    lines.append("tokens  " + " ".join(f"{c:>7d}" for c in table["count"][0]))
    lines.append("mean alpha by bin (same budgets)")
    for i, k in enumerate(table["budgets"]):
        lines.append(f"{k:>5d}   " + " ".join(f"{fmt(v):>7s}" for v in table["mean"][i]))
    lines.append(f"schedule topk by bin: {list(result['schedule'].topk)}  flagged bins: {result['flagged_bins']}"
                 f"  inherited bins: {result['inherited_bins']}")
    lines.append(f"validation on fresh prompts (tau {val.get('tau')}, pass if {q} >= tau - {val.get('margin')}):")
    for s, p, c, ok in zip(val["bin_starts"], val["p5"], val["count"], val.get("meets", [None] * len(val["p5"]))):
        verdict = "ok" if ok else ("FAIL" if ok is False else "few tokens")
        lines.append(f"  bin {s:>6d}: {q} {p:.4f}  tokens {c:>5d}  {verdict}")
    return "\n".join(lines)
