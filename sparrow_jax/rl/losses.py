"""GRPO policy loss with truncated importance sampling (TIS), in pure JAX.

The Sparrow objective (notes §6), per completion token t of a sampled completion x:

    L_t = min(p_ref/p_inf, C) * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A)

with p_inf the sparse sampler's probability of the sampled token, p_ref the dense old
policy's, r_t = pi_theta / pi_old_dense and A the group-normalised advantage.

Conventions follow verl (``trainer/ppo/core_algos.py`` and ``rollout_corr_helper.py``) and
TRL's GRPOTrainer:

* every per-token array is [B, T] (B completions, T completion positions) with a float or
  bool ``mask`` [B, T] that is nonzero on completion tokens; masked-out positions may hold
  anything (even inf/NaN log-probs of padding): they are replaced by zeros *before* any
  arithmetic so they reach neither the loss nor its gradient;
* log-ratios are clamped to [-20, 20] before ``exp`` (verl's SAFETY_BOUND);
* losses are to be *minimised* (the objective above is negated);
* metrics are 0-d JAX arrays (jit-friendly), named as verl logs them (``actor/...``,
  ``rollout_corr/...``); call ``float()`` on them outside jit.

String / float configuration arguments (modes, clip ranges, caps) are Python values: under
``jax.jit`` close over them (``functools.partial``) or mark them static.

TRL GRPOTrainer ``loss_type`` correspondence: "bnpo" = "token-mean", "grpo" =
"seq-mean-token-mean", "dr_grpo" = "seq-mean-token-sum-norm" (with ``loss_scale_factor`` =
max completion length).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

Array = jax.Array
Metrics = dict[str, Array]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm")
IS_LEVELS = ("token", "sequence")
# verl accepts both spellings; the aliases map to the canonical k1/k2/k3.
KL_KINDS = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
SAFETY_BOUND = 20.0  # |log-ratio| clamp before exp, as verl (exp(20) ~ 4.9e8)
K3_CLAMP = 10.0  # verl clamps the k3 penalty to [-10, 10]


# ----------------------------------------------------------------------------- helpers
def _check_2d(fn: str, name: str, x: Array, shape: Optional[tuple[int, ...]] = None) -> Array:
    x = jnp.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{fn}: {name} must be 2-D [B, T], got shape {x.shape}")
    if shape is not None and x.shape != shape:
        raise ValueError(f"{fn}: {name} has shape {x.shape}, expected {shape} (same as the log-probs)")
    return x


def _masks(fn: str, mask: Array, shape: tuple[int, ...]) -> tuple[Array, Array]:
    """Return (float32 mask, bool mask) after checking the shape."""
    mask = _check_2d(fn, "mask", mask, shape)
    maskf = mask.astype(jnp.float32)
    return maskf, maskf != 0


def _safe_div(num: Array, den: Array) -> Array:
    """num / den, and 0 where den == 0 (an empty mask gives 0, not NaN)."""
    ok = den != 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def _masked_sum(x: Array, maskf: Array, axis=None) -> Array:
    # where() first: a NaN/inf at a masked position must not leak through 0 * NaN.
    return jnp.sum(jnp.where(maskf != 0, x, 0.0) * maskf, axis=axis)


def _masked_mean(x: Array, maskf: Array, axis=None) -> Array:
    return _safe_div(_masked_sum(x, maskf, axis), jnp.sum(maskf, axis=axis))


def _masked_max(x: Array, valid: Array) -> Array:
    return jnp.where(jnp.any(valid), jnp.max(jnp.where(valid, x, -jnp.inf)), 0.0)


def _masked_min(x: Array, valid: Array) -> Array:
    return jnp.where(jnp.any(valid), jnp.min(jnp.where(valid, x, jnp.inf)), 0.0)


def _check_mode(fn: str, name: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{fn}: {name} must be one of {tuple(allowed)}, got {value!r}")


# ----------------------------------------------------------------------------- aggregation
def agg_loss(values: Array, mask: Array, mode: str = "token-mean",
             loss_scale_factor: Optional[float] = None, global_rows: bool = False) -> Array:
    """Aggregate a per-token matrix into a scalar, as verl ``agg_loss`` (single data-parallel rank).

    Args:
      values: [B, T] per-token values (loss terms, KL, entropy, ...).
      mask: [B, T] float/bool; nonzero on completion tokens (a float mask weights tokens).
      mode:
        "token-mean": sum over all masked tokens / number of masked tokens (sum of mask).
        "seq-mean-token-mean": mean over sequences of each sequence's token mean.
        "seq-mean-token-sum": mean over sequences of each sequence's token sum.
        "seq-mean-token-sum-norm": "seq-mean-token-sum" / loss_scale_factor (Dr.GRPO;
          default loss_scale_factor = T; pass a constant such as the max completion length).
      loss_scale_factor: only for "seq-mean-token-sum-norm".
      global_rows: the seq-mean modes' divisor. False: the rows with at least one masked
        token (empty rows do not count). True: all B rows, empty (fully masked or rejected)
        rows included, as verl's trainer divides by the mini-batch's global row count.
        The two agree unless a row is empty. An empty mask gives 0 either way.

    Returns:
      0-d float32 array.
    """
    fn = "agg_loss"
    _check_mode(fn, "mode", mode, LOSS_AGG_MODES)
    values = _check_2d(fn, "values", values)
    maskf, _ = _masks(fn, mask, values.shape)
    if mode == "token-mean":
        return _masked_mean(values, maskf)
    tokens_per_seq = jnp.sum(maskf, axis=-1)  # [B]
    seq_sum = _masked_sum(values, maskf, axis=-1)  # [B]
    seq_valid = (tokens_per_seq > 0).astype(jnp.float32)
    if mode == "seq-mean-token-mean":
        seq_val = _safe_div(seq_sum, tokens_per_seq)
    else:
        seq_val = seq_sum
    rows = jnp.float32(values.shape[0]) if global_rows else jnp.sum(seq_valid)
    loss = _safe_div(jnp.sum(seq_val * seq_valid), rows)
    if mode == "seq-mean-token-sum-norm":
        scale = values.shape[-1] if loss_scale_factor is None else loss_scale_factor
        if isinstance(scale, (int, float)) and scale <= 0:
            raise ValueError(f"agg_loss: loss_scale_factor must be > 0, got {scale}")
        loss = loss / scale
    return loss


# ----------------------------------------------------------------------------- KL
def kl_penalty(logp: Array, logp_ref: Array, kind: str = "k3") -> Array:
    """Per-token KL(pi_theta || pi_ref) estimate from sampled-token log-probs, as verl ``kl_penalty``.

    Args:
      logp: [B, T] (or any shape) log-prob of the sampled token under the current policy.
      logp_ref: same shape, under the reference policy.
      kind: "k1" (alias "kl"): logp - logp_ref.
            "k2" (alias "mse"): 0.5 * (logp - logp_ref)^2.
            "k3" (alias "low_var_kl"): exp(d) - d - 1 with d = logp_ref - logp clamped to
            [-20, 20], result clamped to [-10, 10] (verl low_var_kl; TRL's GRPO ``beta`` term).

    Returns:
      Per-token estimate, same shape; gradients flow to both inputs (stop them yourself if
      the reference is fixed; a reference model's log-probs normally carry none).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kl_penalty: kind must be one of {tuple(KL_KINDS)}, got {kind!r}")
    logp = jnp.asarray(logp)
    logp_ref = jnp.asarray(logp_ref)
    if logp.shape != logp_ref.shape:
        raise ValueError(f"kl_penalty: logp shape {logp.shape} != logp_ref shape {logp_ref.shape}")
    kind = KL_KINDS[kind]
    if kind == "k1":
        return logp - logp_ref
    if kind == "k2":
        return 0.5 * jnp.square(logp - logp_ref)
    d = jnp.clip(logp_ref - logp, -SAFETY_BOUND, SAFETY_BOUND)
    return jnp.clip(jnp.exp(d) - d - 1.0, -K3_CLAMP, K3_CLAMP)


# ----------------------------------------------------------------------------- TIS
def _check_tis_args(fn: str, cap: Optional[float], level: str, bounds) -> tuple[float, Optional[tuple[float, float]]]:
    _check_mode(fn, "level", level, IS_LEVELS)
    if cap is None:
        cap_f = math.inf
    else:
        cap_f = float(cap)
        if not cap_f > 0:
            raise ValueError(f"{fn}: cap must be > 0 (or None for no truncation), got {cap}")
    if bounds is not None:
        try:
            lo, hi = (float(b) for b in bounds)
        except (TypeError, ValueError):
            raise ValueError(f"{fn}: mask_ratio_bounds must be a pair (lo, hi) of floats, got {bounds!r}")
        if not (0.0 <= lo < hi):
            raise ValueError(f"{fn}: mask_ratio_bounds must satisfy 0 <= lo < hi, got ({lo}, {hi})")
        bounds = (lo, hi)
    return cap_f, bounds


class _Ratios(NamedTuple):
    """Importance ratios p_ref / p_inf of :func:`tis_weights_and_keep` ("units": tokens or sequences)."""

    log_ratio: Array  # [B, T] logp_old_dense - logp_sampler, 0 at masked positions
    safe: Array  # [B, T] log_ratio clamped to +-SAFETY_BOUND
    seq_valid: Array  # bool [B] rows with a valid token
    raw: Array  # [B, T] each token's raw ratio (its unit's)
    unit_raw: Array  # raw ratio per unit: [B, T] (token level) or [B] (sequence level)
    unit_w: Array  # float32 weight of each unit in the unit metrics (same shape)


def _is_ratios(logp_old_dense: Array, logp_sampler: Array, maskf: Array, maskb: Array, level: str) -> _Ratios:
    """Raw ratios (safety-clamped exp of the log-ratio) at ``level`` "token" or "sequence". Inputs [B, T]."""
    log_ratio = jnp.where(maskb, logp_old_dense - logp_sampler, 0.0)  # [B, T]
    lr_safe = jnp.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    seq_valid = jnp.any(maskb, axis=-1)  # [B]
    if level == "token":
        raw = jnp.exp(lr_safe)  # [B, T]
        return _Ratios(log_ratio, lr_safe, seq_valid, raw, raw, maskf)
    seq_lr = jnp.sum(log_ratio, axis=-1)  # masked positions are already 0
    unit_raw = jnp.exp(jnp.clip(seq_lr, -SAFETY_BOUND, SAFETY_BOUND))  # [B]
    unit_w = seq_valid.astype(jnp.float32)
    raw = jnp.broadcast_to(unit_raw[:, None], log_ratio.shape)
    return _Ratios(log_ratio, lr_safe, seq_valid, raw, unit_raw, unit_w)


def _ratio_bounds(raw: Array, cap: float, bounds: Optional[tuple[float, float]]) -> tuple[Array, float, float]:
    """(bool [B, T] raw ratio within ``bounds`` (all True without), the low and high ratios the
    fraction metrics count against: the bounds, else 1 / cap and cap)."""
    if bounds is None:
        return jnp.ones(raw.shape, dtype=bool), 1.0 / cap, cap
    return (raw >= bounds[0]) & (raw <= bounds[1]), bounds[0], bounds[1]


def _tis_metrics(r: _Ratios, weights: Array, maskf: Array, maskb: Array, in_bounds: Array, lower: float,
                 upper: float) -> Metrics:
    """verl's ``rollout_corr/`` metrics of :func:`tis_weights_and_keep` (see there), stop-gradient."""
    unit_valid = r.unit_w != 0

    def unit_frac(cond: Array) -> Array:
        return _safe_div(jnp.sum(cond.astype(jnp.float32) * r.unit_w), jnp.sum(r.unit_w))

    rejected = maskb & ~in_bounds
    w_mean = _masked_mean(weights, maskf)
    w_norm = _safe_div(weights, w_mean)
    ess = _safe_div(1.0, _masked_mean(jnp.square(w_norm), maskf))
    seq_rejected = jnp.any(rejected, axis=-1)
    m = {
        "rollout_is_mean": w_mean,
        "rollout_is_max": _masked_max(weights, maskb),
        "rollout_is_min": _masked_min(weights, maskb),
        "rollout_is_raw_mean": _safe_div(jnp.sum(jnp.where(unit_valid, r.unit_raw, 0.0) * r.unit_w),
                                         jnp.sum(r.unit_w)),
        "rollout_is_raw_max": _masked_max(r.unit_raw, unit_valid),
        "rollout_is_raw_min": _masked_min(r.unit_raw, unit_valid),
        "rollout_is_ratio_fraction_high": unit_frac(r.unit_raw > upper),
        "rollout_is_ratio_fraction_low": unit_frac(r.unit_raw < lower),
        "rollout_is_oob_ratio": _masked_mean(rejected.astype(jnp.float32), maskf),
        "rollout_is_seq_masked_fraction": _safe_div(
            jnp.sum((seq_rejected & r.seq_valid).astype(jnp.float32)),
            jnp.sum(r.seq_valid.astype(jnp.float32))),
        "rollout_is_eff_sample_size": ess,
        "kl": _masked_mean(-r.log_ratio, maskf),
        "k3_kl": _masked_mean(jnp.exp(r.safe) - r.safe - 1.0, maskf),
    }
    return {f"rollout_corr/{k}": jax.lax.stop_gradient(v) for k, v in m.items()}


def tis_weights_and_keep(logp_old_dense: Array, logp_sampler: Array, mask: Array,
                         cap: Optional[float] = 3.0, level: str = "token",
                         mask_ratio_bounds: Optional[tuple[float, float]] = None,
                         ) -> tuple[Array, Array, Metrics]:
    """Truncated IS weights p_ref/p_inf, the kept-token mask, and verl ``rollout_corr/`` metrics.

    Args:
      logp_old_dense: [B, T] log p_ref(token): dense old policy (the trainer's scorer).
      logp_sampler: [B, T] log p_inf(token): the (sparse) sampler that generated the tokens.
      mask: [B, T] float/bool, nonzero on completion tokens.
      cap: truncation C; weight = min(ratio, C). None: no truncation.
      level: "token": ratio_t = exp(logp_old_dense_t - logp_sampler_t) per token.
             "sequence": ratio = exp(sum_t over masked tokens of the log-ratio), one per row,
             broadcast over the row's tokens (verl ``rollout_is="sequence"``).
      mask_ratio_bounds: optional (lo, hi). Tokens ("token") or whole sequences ("sequence")
        whose raw ratio is outside [lo, hi] get weight 0 and are dropped from ``keep``
        (verl IcePop / rejection sampling). The bounds compare the raw ratio, before the cap.
        Our ratio is p_ref / p_inf; verl's ``rollout_rs`` k1 thresholds bound the inverse
        ratio, so verl's (lo_v, hi_v) are our (1 / hi_v, 1 / lo_v).

    Returns:
      weights: [B, T] float32, min(ratio, cap) on kept tokens, 0 elsewhere; stop-gradient.
      keep: [B, T] bool, mask != 0 and not rejected by mask_ratio_bounds. Passing
        ``mask * keep`` to the loss removes rejected tokens from the aggregation denominator
        (verl ``rollout_rs``); passing ``mask`` keeps them counted with weight 0 (verl IcePop).
      metrics (all 0-d, prefix ``rollout_corr/``; "units" are valid tokens at token level and
        sequences with >= 1 valid token at sequence level):
        rollout_is_mean / _max / _min: applied weights over valid tokens (verl token-level def).
        rollout_is_raw_mean / _raw_max / _raw_min: raw ratio (safety-clamped exp) over units.
        rollout_is_ratio_fraction_high: fraction of units with raw ratio > hi with
          mask_ratio_bounds (rejected above), else > cap (capped).
        rollout_is_ratio_fraction_low: fraction of units with raw ratio < lo (or < 1/cap
          without bounds), verl's definition.
        rollout_is_oob_ratio: fraction of valid tokens rejected by mask_ratio_bounds.
        rollout_is_seq_masked_fraction: fraction of valid sequences with a rejected token.
        rollout_is_eff_sample_size: 1 / mean((w / mean w)^2) over valid tokens (verl ESS).
        kl: k1 estimate of KL(p_inf || p_ref) = mean over valid tokens of logp_sampler - logp_old_dense.
        k3_kl: k3 estimate, mean of exp(d) - d - 1, d = logp_old_dense - logp_sampler (clamped ±20).
    """
    fn = "tis_weights"
    cap_f, bounds = _check_tis_args(fn, cap, level, mask_ratio_bounds)
    logp_old_dense = _check_2d(fn, "logp_old_dense", logp_old_dense)
    logp_sampler = _check_2d(fn, "logp_sampler", logp_sampler, logp_old_dense.shape)
    maskf, maskb = _masks(fn, mask, logp_old_dense.shape)
    # The weights change the sampling measure, not the objective: no gradient through them.
    logp_old_dense = jax.lax.stop_gradient(logp_old_dense).astype(jnp.float32)
    logp_sampler = jax.lax.stop_gradient(logp_sampler).astype(jnp.float32)
    ratios = _is_ratios(logp_old_dense, logp_sampler, maskf, maskb, level)
    in_bounds, lower, upper = _ratio_bounds(ratios.raw, cap_f, bounds)
    keep = maskb & in_bounds
    weights = jax.lax.stop_gradient(jnp.where(keep, jnp.minimum(ratios.raw, cap_f), 0.0))
    return weights, keep, _tis_metrics(ratios, weights, maskf, maskb, in_bounds, lower, upper)


def tis_weights(logp_old_dense: Array, logp_sampler: Array, mask: Array,
                cap: Optional[float] = 3.0, level: str = "token",
                mask_ratio_bounds: Optional[tuple[float, float]] = None) -> tuple[Array, Metrics]:
    """Truncated IS weights min(p_ref/p_inf, cap): [B, T] stop-gradient, and metrics.

    Same arguments and metrics as :func:`tis_weights_and_keep`; use that one when rejected
    tokens should also leave the loss denominator (it returns the kept-token mask).
    """
    weights, _, metrics = tis_weights_and_keep(logp_old_dense, logp_sampler, mask, cap=cap,
                                               level=level, mask_ratio_bounds=mask_ratio_bounds)
    return weights, metrics


def token_veto(logp_old_dense: Array, logp_sampler: Array, mask: Array, threshold: float) -> Array:
    """bool [B]: rows with a masked token whose ratio p_ref / p_inf is below ``threshold``.

    verl's ``rollout_token_veto_threshold``: one token the trained policy rates far less likely
    than the sampler did (with a sparse sampler, mostly a token its sparse attention got wrong)
    rejects the whole row, since everything the reward says about the row may rest on it.
    Inputs [B, T] as :func:`tis_weights_and_keep`'s; ``threshold`` in (0, 1).
    """
    fn = "token_veto"
    if not 0 < threshold < 1:
        raise ValueError(f"{fn}: threshold must be in (0, 1), got {threshold}")
    logp_old_dense = _check_2d(fn, "logp_old_dense", logp_old_dense)
    logp_sampler = _check_2d(fn, "logp_sampler", logp_sampler, logp_old_dense.shape)
    _, maskb = _masks(fn, mask, logp_old_dense.shape)
    log_ratio = logp_old_dense.astype(jnp.float32) - logp_sampler.astype(jnp.float32)
    return jnp.any(maskb & (log_ratio < jnp.log(threshold)), axis=-1)


# ----------------------------------------------------------------------------- policy loss
def _check_advantages(fn: str, advantages: Array, shape: tuple[int, int]) -> Array:
    advantages = jnp.asarray(advantages)
    if advantages.shape == (shape[0],):
        advantages = advantages[:, None]
    elif advantages.shape != shape:
        raise ValueError(f"{fn}: advantages must have shape [B]={(shape[0],)} or [B, T]={shape}, "
                         f"got {advantages.shape}")
    return jnp.broadcast_to(jax.lax.stop_gradient(advantages), shape)


def _check_clips(fn: str, clip_low: float, clip_high: float, dual_clip_c: Optional[float]) -> tuple[float, float]:
    """(clip_low, clip_high) as floats; ValueError naming a clip range out of bounds."""
    clip_low, clip_high = float(clip_low), float(clip_high)
    if not (0.0 <= clip_low < 1.0) or clip_high < 0.0:
        raise ValueError(f"{fn}: need 0 <= clip_low < 1 and clip_high >= 0, got "
                         f"clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip_c is not None and not float(dual_clip_c) > 1.0:
        raise ValueError(f"{fn}: dual_clip_c must be > 1 (or None to disable), got {dual_clip_c}")
    return clip_low, clip_high


def _clipped_pg(ratio: Array, adv: Array, maskf: Array, clip_low: float, clip_high: float,
                dual_clip_c: Optional[float]) -> tuple[Array, Array, Array]:
    """PPO-clip per-token loss of :func:`policy_loss` from ratio, adv [B, T]: (pg [B, T], clipfrac,
    clipfrac_lower), the fractions 0-d over the valid tokens of ``maskf``."""
    pg1 = -adv * ratio
    pg2 = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clip_pg1 = jnp.maximum(pg1, pg2)
    clipfrac = _masked_mean((pg2 > pg1).astype(jnp.float32), maskf)
    if dual_clip_c is None:
        return clip_pg1, clipfrac, jnp.zeros((), jnp.float32)
    pg3 = -adv * float(dual_clip_c)
    clip_pg2 = jnp.minimum(pg3, clip_pg1)
    clipfrac_lower = _masked_mean(((clip_pg1 > pg3) & (adv < 0)).astype(jnp.float32), maskf)
    return jnp.where(adv < 0, clip_pg2, clip_pg1), clipfrac, clipfrac_lower


def policy_loss(logp: Array, logp_old: Array, advantages: Array, mask: Array,
                clip_low: float = 0.2, clip_high: float = 0.28,
                dual_clip_c: Optional[float] = None, is_weights: Optional[Array] = None,
                agg: str = "token-mean", loss_scale_factor: Optional[float] = None,
                global_rows: bool = False) -> tuple[Array, Metrics]:
    """PPO-clip policy loss with clip-higher, optional dual clip and TIS weights (verl "vanilla").

    Per token, with r = exp(clamp(logp - logp_old, -20, 20)):
        pg = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        if dual_clip_c and A < 0: pg = min(pg, -A * dual_clip_c)   (dual-clip PPO)
        pg = pg * is_weights                                       (Sparrow/TIS)
    and the loss is ``agg_loss(pg, mask, agg)``.

    Args:
      logp: [B, T] log pi_theta(token) (differentiable).
      logp_old: [B, T] log pi_old_dense(token) (treated as a constant).
      advantages: [B] (one per completion, broadcast over tokens) or [B, T]; constant.
      mask: [B, T] float/bool completion-token mask.
      clip_low, clip_high: eps_low, eps_high (clip-higher: DAPO/Sparrow 0.2 / 0.28).
      dual_clip_c: None to disable; else c > 1 (verl's clip_ratio_c, usually 3.0).
      is_weights: optional [B, T] TIS weights (from :func:`tis_weights`); stop-gradient.
      agg: aggregation mode, see :func:`agg_loss`.
      loss_scale_factor: only for agg="seq-mean-token-sum-norm".
      global_rows: seq-mean divisor convention, see :func:`agg_loss`.

    Returns:
      loss: 0-d float32 (to minimise).
      metrics: "actor/pg_loss", "actor/pg_clipfrac" (fraction of valid tokens where the clipped
        term is the active one), "actor/ppo_kl" (mean of logp_old - logp), "actor/pg_clipfrac_lower"
        (fraction of valid tokens with A < 0 where the dual clip bound is active; 0 if disabled).
    """
    fn = "policy_loss"
    _check_mode(fn, "agg", agg, LOSS_AGG_MODES)
    clip_low, clip_high = _check_clips(fn, clip_low, clip_high, dual_clip_c)
    logp = _check_2d(fn, "logp", logp)
    shape = logp.shape
    logp_old = _check_2d(fn, "logp_old", logp_old, shape)
    maskf, maskb = _masks(fn, mask, shape)
    adv = _check_advantages(fn, advantages, shape)

    neg_kl = jnp.where(maskb, logp - jax.lax.stop_gradient(logp_old), 0.0)
    neg_kl = jnp.clip(neg_kl, -SAFETY_BOUND, SAFETY_BOUND)
    pg, clipfrac, clipfrac_lower = _clipped_pg(jnp.exp(neg_kl), adv, maskf, clip_low, clip_high, dual_clip_c)
    if is_weights is not None:
        is_weights = _check_2d(fn, "is_weights", is_weights, shape)
        pg = pg * jax.lax.stop_gradient(is_weights)
    loss = agg_loss(pg, maskf, agg, loss_scale_factor, global_rows)
    sg = jax.lax.stop_gradient
    metrics = {
        "actor/pg_loss": sg(loss),
        "actor/pg_clipfrac": sg(clipfrac),
        "actor/ppo_kl": sg(_masked_mean(-neg_kl, maskf)),
        "actor/pg_clipfrac_lower": sg(clipfrac_lower),
    }
    return loss, metrics


def grpo_loss(logp: Array, logp_old: Array, advantages: Array, mask: Array, *,
              clip_low: float = 0.2, clip_high: float = 0.28, dual_clip_c: Optional[float] = None,
              is_weights: Optional[Array] = None, agg: str = "token-mean",
              loss_scale_factor: Optional[float] = None, global_rows: bool = False,
              logp_ref: Optional[Array] = None, kl_coef: Union[float, Array] = 0.0,
              kl_kind: str = "k3", entropy: Optional[Array] = None,
              entropy_coef: Union[float, Array] = 0.0) -> tuple[Array, Metrics]:
    """Full GRPO actor loss: policy_loss + kl_coef * KL - entropy_coef * entropy (verl actor).

    KL and entropy are aggregated with the same ``agg`` mode and mask as the policy term and
    are not multiplied by the IS weights (as verl). ``logp_ref`` is required when kl_coef != 0;
    when given with kl_coef == 0 the KL is still reported. ``entropy`` is the per-token [B, T]
    entropy from the scorer (gradient flows through it if it has one).

    Returns:
      loss: 0-d float32; metrics: policy_loss's plus "actor/kl_loss", "actor/kl_coef" (when
      logp_ref is given) and "actor/entropy" (when entropy is given).
    """
    fn = "grpo_loss"
    if kl_kind not in KL_KINDS:
        raise ValueError(f"{fn}: kl_kind must be one of {tuple(KL_KINDS)}, got {kl_kind!r}")
    if logp_ref is None and not (isinstance(kl_coef, (int, float)) and kl_coef == 0):
        raise ValueError(f"{fn}: kl_coef={kl_coef} needs logp_ref [B, T], got None")
    if entropy is None and not (isinstance(entropy_coef, (int, float)) and entropy_coef == 0):
        raise ValueError(f"{fn}: entropy_coef={entropy_coef} needs entropy [B, T], got None")
    loss, metrics = policy_loss(logp, logp_old, advantages, mask, clip_low=clip_low,
                                clip_high=clip_high, dual_clip_c=dual_clip_c,
                                is_weights=is_weights, agg=agg,
                                loss_scale_factor=loss_scale_factor, global_rows=global_rows)
    shape = jnp.shape(logp)
    maskf, maskb = _masks(fn, mask, shape)
    if logp_ref is not None:
        logp_ref = _check_2d(fn, "logp_ref", logp_ref, shape)
        # Zero masked positions first: padding log-probs may be inf/NaN.
        kld = kl_penalty(jnp.where(maskb, logp, 0.0), jnp.where(maskb, logp_ref, 0.0), kl_kind)
        kl_loss = agg_loss(kld, maskf, agg, loss_scale_factor, global_rows)
        loss = loss + kl_coef * kl_loss
        metrics["actor/kl_loss"] = jax.lax.stop_gradient(kl_loss)
        metrics["actor/kl_coef"] = jnp.asarray(kl_coef, jnp.float32)
    if entropy is not None:
        entropy = _check_2d(fn, "entropy", entropy, shape)
        ent = agg_loss(entropy, maskf, agg, loss_scale_factor, global_rows)
        loss = loss - entropy_coef * ent
        metrics["actor/entropy"] = jax.lax.stop_gradient(ent)
    return loss, metrics
