"""One compiled RL step: dense scoring, sparse-actor statistics, PPO/GRPO+TIS updates.

Everything a step does runs in a single ``jax.jit`` with the train state donated:

1. old policy (no grad): the params that produced the batch score it once -> ``logp_old``
   (the PPO ratio's denominator for every update of the step); the reference policy too
   when the KL term is on;
2. TIS weights ``min(exp(logp_old - logp_sampler), C)`` and optional ratio masking, once;
3. ``ppo_epochs`` x ``mini_batches`` optimiser updates in one ``lax.scan`` (GRPO/PPO loss
   with clip-higher, dual clip, aggregation modes, KL to the reference, entropy bonus);
   each mini-batch's gradient is accumulated over ``micro_batches`` chunks (memory only:
   the update is the mini-batch's); an update whose loss or gradient is not finite is
   skipped (params and optimiser state unchanged) and counted;
   a single on-policy update (:func:`on_policy`: one epoch, one mini-batch) skips step 1's
   separate pass: its own forward runs under the old params, so ``logp_old`` is that
   forward's log-probs (stop-gradient) and steps 1-3 are one forward + backward;
4. sparse actor (no grad): teacher-forced sparse hidden states with the sampler's page
   selection; exact per-token acceptance rate vs the dense policy that sampled; p5 and mean
   per absolute-position bin of the query that produced the token (as calibration bins).
   With ``shared_prefix`` (:func:`shared_prefix_len`: a prompt prefix of every row, where the
   sampler's prefill was dense) it starts after the prefix, from the dense pass's keys and
   values there, and the dense pass's last layer computes no query of the prefix (no loss or
   statistic reads a prompt position's output).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from jax.experimental.shard_alike import shard_alike

from sparrow_jax.mismatch.scorers import per_token_mismatch
from sparrow_jax.mismatch.tail import binned_histogram_jax, binned_percentile_jax, binned_tail_jax, query_positions
from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.lora import LoraConfig, with_lora
from sparrow_jax.models.forward import PrefixKV, dense_hidden, dense_hidden_and_prefix_kv, sparse_hidden, unembedding
from sparrow_jax.models.scoring import token_logprobs
from sparrow_jax.optim import clipped_adam, scale_matching, zero_matching
from sparrow_jax.rl.losses import agg_loss, grpo_loss, kl_penalty, tis_weights, tis_weights_and_keep


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static settings of the compiled step (hashable)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 0.0  # 0 disables
    loss_agg: str = "token-mean"
    global_rows: bool = False  # seq-mean divisor: all rows of the mini-batch (verl) vs non-empty rows
    tis_cap: float = 3.0  # 0 disables TIS
    tis_level: str = "token"
    # (lo, hi): reject tokens / sequences whose ratio p_old / p_sampler is outside (None: off);
    # the reciprocal of verl's rollout_rs k1 thresholds (see losses.tis_weights_and_keep)
    tis_mask_bounds: Optional[tuple[float, float]] = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # reference-KL coefficient (needs ref_params when > 0)
    kl_kind: str = "k3"  # k1 | k2 | k3 (verl low_var_kl, clamped to [-10, 10])
    temperature: float = 1.0
    ppo_epochs: int = 1  # passes over the rollout batch
    mini_batches: int = 1  # optimiser updates per epoch, each on 1 / mini_batches of the rows
    micro_batches: int = 1  # gradient accumulation chunks of a mini-batch: bounds memory, same update
    remat: bool = False
    num_bins: int = 8  # position bins reported for alpha statistics (the last pools later positions)
    bin_width: int = 128
    seq_chunk: int = 128
    attention_impl: str = "auto"  # whole-sequence attention (sparrow_jax.attention.whole_sequence); "reference" = XLA
    # a single on-policy update takes its old log-probs from its own forward (on_policy); True runs
    # the old policy's separate pass anyway (the reference of that fusion)
    separate_old_pass: bool = False
    # the acceptance statistics (mismatch/*) count the policy loss's tokens (batch.loss_mask: with
    # train.reward_horizon_mask, those up to each completion's reward horizon) instead of every
    # completion token: the tokens past the horizon get no update, whatever their mismatch
    tail_over_loss: bool = False

    @property
    def bin_starts(self) -> list[int]:
        """First position of each reported bin (metric keys ``.../bin_<start>``)."""
        return [i * self.bin_width for i in range(self.num_bins)]


@dataclasses.dataclass(frozen=True)
class DistillOptions:
    """DistillSparse (Sparrow Alg. 1): LoRA on the sparse actor only, trained in the same step."""

    kl_coef: float = 1e-3  # lambda of L_LoRA = L_PPO_sparse + lambda * L_KL
    # exact: full-vocabulary KL(dense || sparse) per token (mass-covering); exact_reverse:
    # KL(sparse || dense), mode-seeking, what the release's k3 estimates; k3: that estimate on
    # the sampled tokens only.
    kl: str = "exact_reverse"
    tis_cap: float = 3.0  # TIS cap of the sparse PPO term (0 disables)
    updates: int = 1  # LoRA optimiser steps per RL step on the same batch (PPO epochs of the LoRA)


class LoraState(NamedTuple):
    lora: Any
    opt_state: Any


class TrainState(NamedTuple):
    step: jax.Array
    params: Any
    opt_state: Any


class Batch(NamedTuple):
    tokens: jax.Array  # int32 [B, T]
    mask: jax.Array  # float32 [B, T] completion tokens (the statistics' tokens)
    logp_sampler: jax.Array  # float32 [B, T]
    advantages: jax.Array  # float32 [B], or [B, T] per token (train.adv_baseline="prefix")
    prompt_lens: jax.Array  # int32 [B] (the sampler's prompt prefill is dense)
    loss_mask: Optional[jax.Array] = None  # float32 [B, T] the policy loss's tokens, a subset of mask; None: mask


class DensePass(NamedTuple):
    """What the sparse scorer reads from the step's dense pass (no gradient)."""

    hidden: jax.Array  # float [B, T - S, H] final hidden states of positions S.. (S = shared_prefix)
    prefix_kv: Optional[PrefixKV]  # per layer (k, v) [B, S, Hkv, D] of the shared prompt prefix; None: S = 0


def shared_prefix_len(prompt_lens, *, opts: StepOptions, distill_lora: bool = False, bucket: int = 256) -> int:
    """The ``shared_prefix`` for :func:`train_step` on a batch with these prompt lengths [B] (host
    values): ``min(prompt_lens) - 1`` rounded down to ``bucket`` (a multiple of 64; a coarse
    bucket keeps the compiled variants few), 0 where the sparse scorer must recompute the prompt:
    with DistillSparse's LoRA (the actor's params differ from the policy's), with
    ``opts.remat``, or with ``opts.attention_impl == "reference"`` (the simple path others are
    tested against). Memory: the step keeps the prefix's keys and values of every layer until the
    scorer runs, ``2 * layers * B * S * kv_heads * head_dim`` values (Qwen3-1.7B, 16 rows of a
    2K-token prompt, bf16: 3.7 GB)."""
    if bucket < 64 or bucket % 64:
        raise ValueError(f"shared_prefix_len: bucket={bucket} must be a positive multiple of 64 (the kernel's tile)")
    if distill_lora or opts.remat or opts.attention_impl == "reference":
        return 0
    return max(0, int(min(prompt_lens)) - 1) // bucket * bucket


def policy_loss_mask(batch: Batch) -> jax.Array:
    """The tokens the policy loss sees: ``batch.loss_mask`` where given (completions cut at their
    reward horizon), else every completion token. Statistics use ``batch.mask`` either way."""
    return batch.mask if batch.loss_mask is None else batch.loss_mask


def tail_mask(batch: Batch, opts: StepOptions) -> jax.Array:
    """float32 [B, T]: the tokens the acceptance statistics count (``opts.tail_over_loss``: the loss's)."""
    return policy_loss_mask(batch) if opts.tail_over_loss else batch.mask


def make_optimizer(learning_rate: float, max_grad_norm: float = 1.0, warmup_steps: int = 0,
                   frozen: str = "", scaled: str = "", scale: float = 1.0) -> optax.GradientTransformation:
    """The RL optimiser: global-norm clipping (off at ``max_grad_norm`` <= 0), then Adam at a constant
    rate; with ``warmup_steps`` > 0 the k-th update (from 1) runs at ``learning_rate * min(1, k /
    warmup_steps)``; with ``frozen`` (a regex) the parameters whose dotted names it matches get no
    update (:func:`sparrow_jax.optim.zero_matching`); with ``scaled`` (a regex) the parameters it
    matches move at ``scale`` times the rate (:func:`sparrow_jax.optim.scale_matching`). Each changes
    the optimiser state's layout: a checkpoint restores only into the same choice."""
    if warmup_steps > 0:
        optimizer = clipped_adam(lambda count: learning_rate * jnp.minimum(1.0, (count + 1) / warmup_steps),
                                 max_grad_norm)
    else:
        optimizer = clipped_adam(learning_rate, max_grad_norm)
    if scaled:
        optimizer = optax.chain(optimizer, scale_matching(scaled, scale))
    return optax.chain(zero_matching(frozen), optimizer) if frozen else optimizer


def init_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))


def _micro_batch_weights(mask: jax.Array, loss_agg: str, global_rows: bool = False) -> jax.Array:
    """[n, b, T] micro-batch masks -> [n] weights that make the accumulated gradient equal the
    mini-batch's: each micro-batch's share of the aggregation's denominator (its tokens for
    token-mean, its non-empty rows for the seq-mean modes, all its rows with ``global_rows``),
    uniform if the mini-batch is empty."""
    if loss_agg == "token-mean":
        units = jnp.sum(mask, axis=(1, 2))
    elif global_rows:
        units = jnp.full(mask.shape[:1], mask.shape[1], jnp.float32)
    else:
        units = jnp.sum(jnp.any(mask > 0, axis=-1), axis=-1).astype(jnp.float32)
    total = jnp.sum(units)
    return jnp.where(total > 0, units / jnp.maximum(total, 1e-9), 1.0 / mask.shape[0])


class _Rows(NamedTuple):
    """What one optimiser update needs per row, fixed for the whole step."""

    tokens: jax.Array  # int32 [B, T]
    mask: jax.Array  # float32 [B, T] tokens in the loss (completion tokens minus rejected ones)
    advantages: jax.Array  # float32 [B], or [B, T] per token (train.adv_baseline="prefix")
    logp_old: jax.Array  # float32 [B, T] the policy that produced the batch (PPO ratio denominator)
    is_weights: Optional[jax.Array]  # float32 [B, T] TIS weights vs that old policy, or None
    logp_ref: Optional[jax.Array]  # float32 [B, T] reference policy (KL term), or None


class _OnPolicyRows(NamedTuple):
    """What the single on-policy update needs per row (its old log-probs are its own forward's)."""

    tokens: jax.Array  # int32 [B, T]
    mask: jax.Array  # float32 [B, T] completion tokens
    logp_sampler: jax.Array  # float32 [B, T]
    advantages: jax.Array  # float32 [B], or [B, T] per token (train.adv_baseline="prefix")
    logp_ref: Optional[jax.Array]  # float32 [B, T] reference policy (KL term), or None


def on_policy(opts: StepOptions) -> bool:
    """Whether the step is one update on the whole batch (``ppo_epochs == mini_batches == 1``),
    whose forward then runs under the params that produced the batch: its own log-probs are the
    old policy's. Not with ratio masking over several micro-batches: the rejected tokens leave
    each micro-batch's share of the denominator, which must be known before the first one runs."""
    return not opts.separate_old_pass and opts.ppo_epochs == 1 and opts.mini_batches == 1 \
        and (opts.micro_batches == 1 or opts.tis_mask_bounds is None)


def _split_rows(x: jax.Array, *parts: int) -> jax.Array:
    """[B, ...] -> [*parts, B / prod(parts), ...] (contiguous rows per part)."""
    return x.reshape(*parts, -1, *x.shape[1:])


def _no_grad_logprobs(config: Qwen3Config, params, tokens: jax.Array, chunks: int, opts: StepOptions,
                      keep_hidden: bool, shared_prefix: int = 0):
    """Log-probs (and what the sparse scorer reads) of ``params`` on ``tokens``, ``chunks`` row
    chunks at a time, without gradient. -> (logp [B, T], DensePass or None)"""
    def one(tok):
        dense, logp, _ = _dense_logprobs(config, params, tok, opts, shared_prefix if keep_hidden else 0)
        return logp, (dense if keep_hidden else None)

    logp, dense = jax.lax.map(one, _split_rows(tokens, chunks))
    return jax.lax.stop_gradient(_merge_rows(logp)), jax.lax.stop_gradient(_merge_rows(dense))


@functools.partial(jax.jit, static_argnames=("config", "opts", "chunks"))
def policy_logprobs(params, tokens: jax.Array, *, config: Qwen3Config, opts: StepOptions, chunks: int = 1) -> jax.Array:
    """float32 [B, T]: the dense policy's log-probs of ``tokens`` [B, T] at ``opts.temperature``, ``chunks``
    row chunks at a time, no gradient (what :func:`train_step` computes as ``logp_old``)."""
    return _no_grad_logprobs(config, params, tokens, chunks, opts, False)[0]


def _merge_rows(tree):
    """Leaves [chunks, b, ...] -> [chunks * b, ...] (None stays None)."""
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), tree)


def _pad_front(x: jax.Array, n: int, value: float = 0.0) -> jax.Array:
    """[B, T - n, ...] -> [B, T, ...], ``value`` in the first n positions."""
    return jnp.pad(x, [(0, 0), (n, 0)] + [(0, 0)] * (x.ndim - 2), constant_values=value) if n else x


def _dense_logprobs(config: Qwen3Config, params, tokens: jax.Array, opts: StepOptions, shared_prefix: int = 0):
    """The dense policy's pass: what the sparse scorer reads, and the log-probs and entropies of
    ``tokens``. With ``shared_prefix`` S the prompt prefix 0..S-1 gets no logits (0 there: no
    loss or statistic reads a prompt position) and its keys and values are kept.
    -> (DensePass, logp [B, T], entropy [B, T])"""
    if shared_prefix:
        hidden, kv = dense_hidden_and_prefix_kv(config, params, tokens, shared_prefix, impl=opts.attention_impl)
    else:
        hidden, kv = dense_hidden(config, params, tokens, remat=opts.remat, impl=opts.attention_impl), None
    logp, entropy = token_logprobs(hidden, unembedding(config, params), tokens[:, shared_prefix:], opts.temperature,
                                   seq_chunk=opts.seq_chunk)
    return DensePass(hidden, kv), _pad_front(logp, shared_prefix), _pad_front(entropy, shared_prefix)


def _tis(logp_old: jax.Array, logp_sampler: jax.Array, mask: jax.Array, opts: StepOptions):
    """TIS weights and ratio masking vs the old policy, all [B, T].
    -> (weights or None, loss mask, ``rollout_corr/`` metrics)"""
    out, weights, loss_mask = {}, None, mask
    if opts.tis_cap > 0 or opts.tis_mask_bounds is not None:
        weights, keep, out = tis_weights_and_keep(logp_old, logp_sampler, mask, cap=opts.tis_cap or None,
                                                  level=opts.tis_level, mask_ratio_bounds=opts.tis_mask_bounds)
        loss_mask = mask * keep  # rejected tokens leave the loss and its denominator (verl rollout_rs)
        weights = weights if opts.tis_cap > 0 else None
    return weights, loss_mask, out


def _rows_loss(logp, entropy, mb: _Rows, opts: StepOptions):
    return grpo_loss(logp, mb.logp_old, mb.advantages, mb.mask, clip_low=opts.clip_low, clip_high=opts.clip_high,
                     dual_clip_c=opts.dual_clip or None, is_weights=mb.is_weights, agg=opts.loss_agg,
                     global_rows=opts.global_rows, logp_ref=mb.logp_ref, kl_coef=opts.kl_coef, kl_kind=opts.kl_kind,
                     entropy=entropy, entropy_coef=opts.entropy_coef)


def _policy_loss(params, config: Qwen3Config, mb: _Rows, opts: StepOptions):
    """-> (loss, (metrics, None))"""
    _, logp, entropy = _dense_logprobs(config, params, mb.tokens, opts)
    loss, metrics = _rows_loss(logp, entropy, mb, opts)
    return loss, (metrics, None)


def _on_policy_loss(params, config: Qwen3Config, mb: _OnPolicyRows, opts: StepOptions, shared_prefix: int = 0):
    """The single on-policy update's loss: the old log-probs are this forward's, stop-gradient
    (ratio 1, gradient that of the ratio), and TIS weights and ratio masking follow from them.
    -> (loss, (metrics, (logp_old [b, T], DensePass) stop-gradient))"""
    dense, logp, entropy = _dense_logprobs(config, params, mb.tokens, opts, shared_prefix)
    logp_old = jax.lax.stop_gradient(logp)
    weights, loss_mask, _ = _tis(logp_old, mb.logp_sampler, mb.mask, opts)
    rows = _Rows(mb.tokens, loss_mask, mb.advantages, logp_old, weights, mb.logp_ref)
    loss, metrics = _rows_loss(logp, entropy, rows, opts)
    return loss, (metrics, (logp_old, jax.lax.stop_gradient(dense)))


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _mini_batches(rows: _Rows, opts: StepOptions) -> _Rows:
    """Rows -> [mini_batches, micro_batches, rows per micro-batch, ...] per field."""
    return jax.tree.map(lambda x: _split_rows(x, opts.mini_batches, opts.micro_batches), rows)


def _accumulated_grads(loss_fn, params, micros, weights: jax.Array, config: Qwen3Config, opts: StepOptions):
    """The gradient of ``sum_i weights[i] * loss_fn(micro-batch i)``, one micro-batch at a time
    (memory only). ``loss_fn(params, config, micro, opts) -> (loss, (metrics, aux))``; ``micros``
    fields [n, b, ...], ``weights`` [n]. -> (grads, loss, weighted metrics, aux stacked [n, ...])"""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulate(grads_acc, micro_and_weight):
        micro, w = micro_and_weight
        (loss, (metrics, aux)), grads = grad_fn(params, config, micro, opts)
        return jax.tree.map(lambda a, g: a + g * w, grads_acc, grads), (loss, metrics, aux)

    # Accumulate in float32 (bf16 params: a sum of micro-batch gradients in bf16 loses bits, and
    # bf16 + f32 * w would change the scan carry's dtype), then back to the params' dtype for
    # the optimiser, whose state has it.
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    grads, (losses, metrics, aux) = jax.lax.scan(accumulate, zeros, (micros, weights))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return grads, jnp.sum(losses * weights), {k: jnp.sum(v * weights) for k, v in metrics.items()}, aux


def _update_grads(params, minis: _Rows, u, config: Qwen3Config, opts: StepOptions):
    """Forward + backward of update ``u``: the gradient of mini-batch ``u % mini_batches``, accumulated
    over its ``micro_batches`` chunks (memory only). -> (grads, loss, weighted loss metrics)"""
    mini = jax.tree.map(lambda x: x[u % opts.mini_batches], minis)
    weights = _micro_batch_weights(mini.mask, opts.loss_agg, opts.global_rows)
    return _accumulated_grads(_policy_loss, params, mini, weights, config, opts)[:3]


def _on_policy_grads(params, batch: Batch, logp_ref, *, config: Qwen3Config, opts: StepOptions, keep_hidden: bool,
                     shared_prefix: int = 0):
    """Forward + backward of the single on-policy update (:func:`on_policy`), its forward also the
    old policy's pass, accumulated over ``micro_batches`` chunks.
    -> (grads, loss, weighted loss metrics, DensePass or None, ``rollout_corr/`` metrics)"""
    micros = jax.tree.map(lambda x: _split_rows(x, opts.micro_batches),
                          _OnPolicyRows(batch.tokens, policy_loss_mask(batch), batch.logp_sampler, batch.advantages,
                                        logp_ref))
    # Shares of the denominator from the completion mask: on_policy() rules out ratio masking over
    # several micro-batches, and for one micro-batch the share is 1 whatever the mask.
    weights = _micro_batch_weights(micros.mask, opts.loss_agg, opts.global_rows)
    loss_fn = functools.partial(_on_policy_loss, shared_prefix=shared_prefix if keep_hidden else 0)
    grads, loss, metrics, (logp_old, dense) = _accumulated_grads(loss_fn, params, micros, weights, config, opts)
    _, _, out = _tis(_merge_rows(logp_old), batch.logp_sampler, batch.mask, opts)  # metrics over the whole batch
    return grads, loss, metrics, (_merge_rows(dense) if keep_hidden else None), out


def _apply_update(params, opt_state, grads, loss, metrics: dict, optimizer: optax.GradientTransformation):
    """The optimiser step, skipped (params and optimiser state unchanged) unless the loss and every
    gradient are finite. -> (params, opt_state, metrics with loss and grad norm, finite)"""
    finite = jnp.isfinite(loss) & _all_finite(grads)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep_if_finite = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    out = dict(metrics, **{"loss": loss, "actor/grad_norm": optax.tree.norm(grads)})
    return keep_if_finite(new_params, params), keep_if_finite(new_opt_state, opt_state), out, finite


def _ppo_updates(params, opt_state, rows: _Rows, config: Qwen3Config, optimizer: optax.GradientTransformation,
                 opts: StepOptions):
    """``ppo_epochs`` x ``mini_batches`` optimiser updates in one ``lax.scan`` (:func:`_update_grads`
    then :func:`_apply_update` each). -> (params, opt_state, per-update metrics {name: [U]}, finite [U] bool)
    """
    minis = _mini_batches(rows, opts)

    def update(carry, u):
        params, opt_state = carry
        grads, loss, metrics = _update_grads(params, minis, u, config, opts)
        params, opt_state, out, finite = _apply_update(params, opt_state, grads, loss, metrics, optimizer)
        return (params, opt_state), (out, finite)

    (params, opt_state), (metrics, finite) = jax.lax.scan(update, (params, opt_state),
                                                          jnp.arange(opts.ppo_epochs * opts.mini_batches))
    return params, opt_state, metrics, finite


def _mean_over_finite_updates(metrics: dict, finite: jax.Array) -> dict:
    """verl logs the mean of each actor metric over a step's mini-batch updates; skipped
    (non-finite) updates are left out (NaN when all were skipped)."""
    count = jnp.sum(finite)
    mean = lambda v: jnp.where(count > 0, jnp.sum(jnp.where(finite, v, 0.0)) / jnp.maximum(count, 1), jnp.nan)
    out = {k: mean(v) for k, v in metrics.items()}
    out["actor/nonfinite_updates"] = jnp.sum(~finite).astype(jnp.float32)
    return out


def _alpha_stats(config, params, sparse_params, tokens, prompt_lens, dense: DensePass, schedule, opts):
    """Exact per-token acceptance rate and KL of the sparse actor vs the dense policy. -> 2 x [B, T]

    With ``dense.prefix_kv`` (the actor is the policy) the shared prompt prefix is not recomputed:
    it is the densely prefilled prompt (alpha 1, KL 0 there; no statistic reads a prompt position)."""
    h_sparse = jax.lax.stop_gradient(sparse_hidden(config, sparse_params, tokens, schedule, prompt_lens=prompt_lens,
                                                   impl=opts.attention_impl, prefix_kv=dense.prefix_kv))
    s = tokens.shape[1] - h_sparse.shape[1]  # the shared prefix (0 without prefix_kv)
    m = per_token_mismatch(dense.hidden, h_sparse, unembedding(config, params), unembedding(config, sparse_params),
                           tokens[:, s:], temperature=opts.temperature, seq_chunk=opts.seq_chunk)
    return _pad_front(m["alpha"], s, 1.0), _pad_front(m["kl"], s)


def _lora_loss(lora, base_params, config: Qwen3Config, lora_cfg: LoraConfig, batch: Batch, hidden_dense,
               schedule, opts: StepOptions, distill: DistillOptions, logp_sparse_old=None):
    """L_LoRA = L_PPO_sparse + lambda * L_KL; base params enter stop-gradient (frozen theta).

    ``logp_sparse_old``: the PPO ratio's denominator for a second or later update on the same
    batch (default: this pass's own log-probs, ratio 1).
    """
    sparse_params = with_lora(jax.lax.stop_gradient(base_params), lora, lora_cfg)
    h_sparse = sparse_hidden(config, sparse_params, batch.tokens, schedule, remat=opts.remat,
                             prompt_lens=batch.prompt_lens, impl=opts.attention_impl)
    w_dense = jax.lax.stop_gradient(unembedding(config, base_params))
    w_sparse = unembedding(config, sparse_params)
    t = opts.temperature
    logp_sparse, _ = token_logprobs(h_sparse, w_sparse, batch.tokens, t, seq_chunk=opts.seq_chunk)
    if logp_sparse_old is None:
        logp_sparse_old = jax.lax.stop_gradient(logp_sparse)
    weights = None
    if distill.tis_cap > 0:
        weights, _ = tis_weights(logp_sparse_old, batch.logp_sampler, batch.mask, cap=distill.tis_cap)
    ppo, _ = grpo_loss(logp_sparse, logp_sparse_old, batch.advantages, policy_loss_mask(batch), clip_low=opts.clip_low,
                       clip_high=opts.clip_high, is_weights=weights, agg=opts.loss_agg)

    m = per_token_mismatch(jax.lax.stop_gradient(hidden_dense), h_sparse, w_dense, w_sparse, batch.tokens,
                           temperature=t, seq_chunk=opts.seq_chunk, reverse_kl=distill.kl == "exact_reverse")
    alpha, kl_exact = m["alpha"], m["kl"]
    if distill.kl == "exact":
        kl_tok = kl_exact
    elif distill.kl == "exact_reverse":
        kl_tok = m["kl_reverse"]
    else:  # k3 on sampled tokens with r = p_dense / p_sparse, as in the paper's release
        kl_tok = kl_penalty(logp_sparse, jax.lax.stop_gradient(m["logp_dense"]), kind="k3")
    kl = agg_loss(kl_tok, batch.mask, opts.loss_agg)
    loss = ppo + distill.kl_coef * kl
    return loss, ({"distill/loss": loss, "distill/pg_loss": ppo, "distill/kl": kl},
                  jax.lax.stop_gradient(alpha), jax.lax.stop_gradient(kl_exact), logp_sparse_old)


def _check_step(batch: Batch, ref_params, opts: StepOptions, sparse_params=None, lora_state=None,
                shared_prefix: int = 0) -> int:
    """Raise on a batch / options mismatch; -> row chunks of the no-grad passes."""
    b = batch.tokens.shape[0]
    chunks = opts.mini_batches * opts.micro_batches
    if b % chunks:
        raise ValueError(f"batch of {b} rows is not divisible by mini_batches * micro_batches = "
                         f"{opts.mini_batches} * {opts.micro_batches}")
    if (opts.kl_coef > 0) != (ref_params is not None):
        raise ValueError(f"train_step: kl_coef={opts.kl_coef} needs ref_params exactly when kl_coef > 0")
    if shared_prefix:
        if sparse_params is not None or lora_state is not None or opts.remat:
            raise ValueError("train_step: shared_prefix needs the sparse actor to be the policy (no sparse_params, "
                             "no LoRA) and remat off; pass shared_prefix=0")
        if shared_prefix % 64 or not 0 < shared_prefix < batch.tokens.shape[1]:
            raise ValueError(f"train_step: shared_prefix={shared_prefix} must be a multiple of 64 below T = "
                             f"{batch.tokens.shape[1]}")
        prefill = None if isinstance(batch.prompt_lens, jax.core.Tracer) else int(jnp.min(batch.prompt_lens)) - 1
        if prefill is not None and shared_prefix > prefill:
            raise ValueError(f"train_step: shared_prefix={shared_prefix} is past a row's dense prompt prefill "
                             f"(min(prompt_lens) - 1 = {prefill})")
    return chunks


def _old_policy(params, batch: Batch, *, config: Qwen3Config, opts: StepOptions, chunks: int, keep_hidden: bool,
                shared_prefix: int = 0):
    """No grad: the policy that produced the batch scores it (logp_old, also the TIS reference),
    then TIS weights and ratio masking. -> (logp_old, DensePass or None, weights or None, loss mask, metrics)"""
    logp_old, dense = _no_grad_logprobs(config, params, batch.tokens, chunks, opts, keep_hidden, shared_prefix)
    # the weights over the loss's tokens (a sequence ratio is their product, as in the on-policy step: the
    # tokens past the reward horizon do not decide the reward), the metrics over every completion token
    weights, loss_mask, _ = _tis(logp_old, batch.logp_sampler, policy_loss_mask(batch), opts)
    out = _tis(logp_old, batch.logp_sampler, batch.mask, opts)[2]
    return logp_old, dense, weights, loss_mask, out


def _ref_logprobs(ref_params, tokens, *, config: Qwen3Config, opts: StepOptions, chunks: int):
    return _no_grad_logprobs(config, ref_params, tokens, chunks, opts, False)[0]


def _sparse_actor(params, batch: Batch, dense: DensePass, sparse_params, lora_state: Optional[LoraState], *, config,
                  schedule, opts: StepOptions, lora_cfg, lora_optimizer, distill: DistillOptions):
    """The sparse scorer: per-token acceptance rate and KL of the sparse actor vs the dense policy
    ``params`` (and, with ``lora_state``, DistillSparse's LoRA updates).
    -> (alpha [B, T], kl [B, T], new LoRA state or None, metrics)"""
    if lora_state is None:
        sp = params if sparse_params is None else sparse_params
        alpha, kl = _alpha_stats(config, params, sp, batch.tokens, batch.prompt_lens, dense, schedule, opts)
        return alpha, kl, None, {}
    hidden = dense.hidden
    lora_grad = jax.value_and_grad(_lora_loss, has_aux=True)

    def apply_lora_grads(lora_st: LoraState, grads) -> LoraState:
        updates, opt = lora_optimizer.update(grads, lora_st.opt_state, lora_st.lora)
        return LoraState(optax.apply_updates(lora_st.lora, updates), opt)

    (_, (dmetrics, alpha, kl, logp_sparse_old)), lora_grads = lora_grad(
        lora_state.lora, params, config, lora_cfg, batch, hidden, schedule, opts, distill)
    new_lora_state = apply_lora_grads(lora_state, lora_grads)

    def another_update(lora_st: LoraState, _):  # PPO epochs of the LoRA on the same batch
        _, grads = lora_grad(lora_st.lora, params, config, lora_cfg, batch, hidden, schedule, opts, distill,
                             logp_sparse_old)
        return apply_lora_grads(lora_st, grads), None

    if distill.updates > 1:
        new_lora_state, _ = jax.lax.scan(another_update, new_lora_state, None, length=distill.updates - 1)
    # mismatch statistics are those of the actor that sampled the batch
    return alpha, kl, new_lora_state, dict(dmetrics, **{"distill/grad_norm": optax.tree.norm(lora_grads)})


def _step_metrics(out: dict, update_metrics: dict, finite, sparse_metrics: dict, alpha, kl, mask,
                  opts: StepOptions) -> dict:
    """The step's metrics: TIS, policy updates (means over finite updates), sparse actor statistics."""
    out = dict(out)
    out.update(_mean_over_finite_updates(update_metrics, finite))
    if alpha is not None:
        out.update(sparse_metrics)
        out.update(_mismatch_metrics(alpha, kl, mask > 0, opts))
    return out


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "opts", "lora_cfg", "lora_optimizer",
                                             "distill", "shared_prefix"), donate_argnums=(0, 3))
def train_step(state: TrainState, batch: Batch, sparse_params=None, lora_state: Optional[LoraState] = None,
               ref_params=None, *, config: Qwen3Config, optimizer: optax.GradientTransformation, schedule=None,
               opts: StepOptions = StepOptions(), lora_cfg: Optional[LoraConfig] = None,
               lora_optimizer: Optional[optax.GradientTransformation] = None,
               distill: DistillOptions = DistillOptions(),
               shared_prefix: int = 0) -> tuple[TrainState, Optional[LoraState], dict]:
    """One RL step on a rollout batch. -> (new_state, new_lora_state or None, metrics)

    ``sparse_params`` are the sparse actor's params (defaults to the policy's); with
    ``schedule=None`` (dense rollouts) no sparse statistics are computed. The schedule is
    data (its top-k table is traced; layout and ``k_max`` bucket static), so a budget
    change within the bucket compiles nothing new. With
    ``lora_state`` (DistillSparse) the sparse actor is ``with_lora(params, lora)``: the
    policy gets gradients only from the dense PPO loss, the LoRA only from L_LoRA.
    ``ref_params``: the reference policy of the KL term (required iff ``opts.kl_coef > 0``).
    Metrics of the policy updates are means over the step's updates (verl).
    ``shared_prefix`` (static; :func:`shared_prefix_len`): positions below it are a prompt prefix
    of every row, which the sparse scorer takes from the dense pass (keys and values) instead of
    recomputing; 0 recomputes every position.
    :func:`timed_train_step` runs the same phases as separate programs and times each.
    """
    chunks = _check_step(batch, ref_params, opts, sparse_params, lora_state, shared_prefix)
    keep_hidden = schedule is not None
    logp_ref = None if ref_params is None else _ref_logprobs(ref_params, batch.tokens, config=config, opts=opts,
                                                             chunks=chunks)
    if on_policy(opts):
        grads, loss, metrics, dense, out = _on_policy_grads(state.params, batch, logp_ref, config=config, opts=opts,
                                                            keep_hidden=keep_hidden, shared_prefix=shared_prefix)
        params, opt_state, update_metrics, finite = _apply_update(state.params, state.opt_state, grads, loss, metrics,
                                                                  optimizer)
        update_metrics, finite = jax.tree.map(lambda x: x[None], (update_metrics, finite))  # one update
    else:
        logp_old, dense, weights, loss_mask, out = _old_policy(state.params, batch, config=config, opts=opts,
                                                               chunks=chunks, keep_hidden=keep_hidden,
                                                               shared_prefix=shared_prefix)
        rows = _Rows(batch.tokens, loss_mask, batch.advantages, logp_old, weights, logp_ref)
        params, opt_state, update_metrics, finite = _ppo_updates(state.params, state.opt_state, rows, config,
                                                                 optimizer, opts)
    # The scan carry's layout is XLA's choice (on a mesh it may split a small norm weight that
    # the input kept whole); pin the new state to the input's so the next step reuses this program.
    params, opt_state = jax.tree.map(lambda new, old: shard_alike(new, old)[0], (params, opt_state),
                                     (state.params, state.opt_state))
    alpha = kl = new_lora_state = None
    sparse_metrics = {}
    if schedule is not None:
        alpha, kl, new_lora_state, sparse_metrics = _sparse_actor(
            state.params, batch, dense, sparse_params, lora_state, config=config, schedule=schedule, opts=opts,
            lora_cfg=lora_cfg, lora_optimizer=lora_optimizer, distill=distill)
    out = _step_metrics(out, update_metrics, finite, sparse_metrics, alpha, kl, tail_mask(batch, opts), opts)
    return TrainState(state.step + 1, params, opt_state), new_lora_state, out


# ---- the same step as separate programs, timed (the trainer's timing_s/* split) ----------------

TIMING_PARTS = ("old_log_prob", "ref", "scoring", "forward_backward", "optimizer", "statistics")

_old_policy_jit = jax.jit(_old_policy, static_argnames=("config", "opts", "chunks", "keep_hidden", "shared_prefix"))
_ref_logprobs_jit = jax.jit(_ref_logprobs, static_argnames=("config", "opts", "chunks"))
_sparse_actor_jit = jax.jit(_sparse_actor, static_argnames=("config", "opts", "lora_cfg", "lora_optimizer",
                                                            "distill"), donate_argnums=(4,))
_update_grads_jit = jax.jit(_update_grads, static_argnames=("config", "opts"))
_on_policy_grads_jit = jax.jit(_on_policy_grads, static_argnames=("config", "opts", "keep_hidden", "shared_prefix"))


@functools.partial(jax.jit, static_argnames=("optimizer",), donate_argnums=(0, 1))
def _apply_update_jit(params, opt_state, grads, loss, metrics, *, optimizer):
    new_params, new_opt_state, out, finite = _apply_update(params, opt_state, grads, loss, metrics, optimizer)
    # pin the new state to the input's layout, as train_step does
    new_params, new_opt_state = jax.tree.map(lambda new, old: shard_alike(new, old)[0],
                                             (new_params, new_opt_state), (params, opt_state))
    return new_params, new_opt_state, out, finite


@functools.partial(jax.jit, static_argnames=("opts",))
def _step_metrics_jit(out, update_metrics, finite, sparse_metrics, alpha, kl, mask, *, opts):
    stack = lambda xs: jax.tree.map(lambda *x: jnp.stack(x), *xs)
    return _step_metrics(out, stack(update_metrics), jnp.stack(finite), sparse_metrics, alpha, kl, mask, opts)


class PhaseTimer:
    """Runs a step's phases as separate programs, each waited for; ``seconds`` sums them per part of
    :data:`TIMING_PARTS`."""

    def __init__(self):
        self.seconds = dict.fromkeys(TIMING_PARTS, 0.0)

    def __call__(self, part: str, fn, *args, **kw):
        t0 = time.perf_counter()
        result = jax.block_until_ready(fn(*args, **kw))
        self.seconds[part] += time.perf_counter() - t0
        return result


def timed_train_step(state: TrainState, batch: Batch, sparse_params=None, lora_state: Optional[LoraState] = None,
                     ref_params=None, *, config: Qwen3Config, optimizer: optax.GradientTransformation,
                     schedule=None, opts: StepOptions = StepOptions(), lora_cfg: Optional[LoraConfig] = None,
                     lora_optimizer: Optional[optax.GradientTransformation] = None,
                     distill: DistillOptions = DistillOptions(), shared_prefix: int = 0):
    """:func:`train_step`, its phases run (and waited for) one after another, each timed, as verl's
    ``timing_s/*``. -> (new_state, new_lora_state or None, metrics fetched to the host as floats,
    {part: seconds} for ``TIMING_PARTS``).

    Parts: ``old_log_prob`` (the batch's policy scores it; TIS weights; 0 for a single
    on-policy update, whose forward is that pass: :func:`on_policy`), ``ref`` (the KL
    reference), ``scoring`` (the sparse actor's teacher-forced scorer vs the dense policy;
    DistillSparse's LoRA updates), ``forward_backward`` and ``optimizer`` (summed over the
    step's updates), ``statistics`` (metric reductions and their fetch). Same computation as
    :func:`train_step`; separate programs may round differently (float32 last bits).
    ``state`` and ``lora_state`` are consumed (donated) as by :func:`train_step`.
    """
    timed = PhaseTimer()

    chunks = _check_step(batch, ref_params, opts, sparse_params, lora_state, shared_prefix)
    keep_hidden = schedule is not None
    logp_ref = None
    if ref_params is not None:
        logp_ref = timed("ref", _ref_logprobs_jit, ref_params, batch.tokens, config=config, opts=opts, chunks=chunks)

    def score(dense):  # before any optimizer update: it reads the step's input params, which updates donate
        if schedule is None:
            return None, None, None, {}
        return timed("scoring", _sparse_actor_jit, state.params, batch, dense, sparse_params, lora_state,
                     config=config, schedule=schedule, opts=opts, lora_cfg=lora_cfg, lora_optimizer=lora_optimizer,
                     distill=distill)

    if on_policy(opts):
        grads, loss, metrics, dense, out = timed("forward_backward", _on_policy_grads_jit, state.params, batch,
                                                 logp_ref, config=config, opts=opts, keep_hidden=keep_hidden,
                                                 shared_prefix=shared_prefix)
        alpha, kl, new_lora_state, sparse_metrics = score(dense)
        params, opt_state, metrics, ok = timed("optimizer", _apply_update_jit, state.params, state.opt_state, grads,
                                               loss, metrics, optimizer=optimizer)
        update_metrics, finite = [metrics], [ok]
    else:
        logp_old, dense, weights, loss_mask, out = timed(
            "old_log_prob", _old_policy_jit, state.params, batch, config=config, opts=opts, chunks=chunks,
            keep_hidden=keep_hidden, shared_prefix=shared_prefix)
        alpha, kl, new_lora_state, sparse_metrics = score(dense)
        minis = _mini_batches(_Rows(batch.tokens, loss_mask, batch.advantages, logp_old, weights, logp_ref), opts)
        params, opt_state, update_metrics, finite = state.params, state.opt_state, [], []
        for u in range(opts.ppo_epochs * opts.mini_batches):
            grads, loss, metrics = timed("forward_backward", _update_grads_jit, params, minis, u, config=config,
                                         opts=opts)
            params, opt_state, metrics, ok = timed("optimizer", _apply_update_jit, params, opt_state, grads, loss,
                                                   metrics, optimizer=optimizer)
            update_metrics.append(metrics)
            finite.append(ok)

    def fetch():
        m = _step_metrics_jit(out, update_metrics, finite, sparse_metrics, alpha, kl, tail_mask(batch, opts),
                              opts=opts)
        return jax.device_get(m)

    host = timed("statistics", fetch)
    return TrainState(state.step + 1, params, opt_state), new_lora_state, host, timed.seconds


def _mismatch_metrics(alpha: jax.Array, kl: jax.Array, mask: jax.Array, opts: StepOptions) -> dict:
    """p5, mean and count of the acceptance rate per position bin (one binning rule for the
    three, shared with calibration: by the producing query's position, the last bin pooling
    later positions), and batch-wide summaries."""
    positions = jnp.broadcast_to(query_positions(alpha.shape[1]), alpha.shape)
    p5, means, counts = binned_tail_jax(alpha, positions, mask, opts.num_bins, opts.bin_width, 5.0)
    out = {}
    for i, start in enumerate(opts.bin_starts):
        out[f"mismatch/alpha_p5/bin_{start}"] = p5[i]
        out[f"mismatch/alpha_mean/bin_{start}"] = means[i]
        out[f"mismatch/count/bin_{start}"] = counts[i]
    denom = jnp.maximum(mask.sum(), 1)
    out["mismatch/alpha_mean"] = jnp.sum(jnp.where(mask, alpha, 0)) / denom
    out["mismatch/alpha_p5"] = binned_percentile_jax(alpha, jnp.zeros_like(positions), mask, 1, 1, 5.0)[0][0]
    out["mismatch/kl_dense_sparse"] = jnp.sum(jnp.where(mask, kl, 0)) / denom
    # [num_bins, 1000] counts: the run's pooled per-bin p5 is read from their sum over steps
    out["mismatch/alpha_hist"] = binned_histogram_jax(alpha, positions, mask, opts.num_bins, opts.bin_width)
    return out
