"""One compiled RL step: dense scoring, sparse-actor statistics, GRPO+TIS loss, optax update.

Everything a step does runs in a single ``jax.jit`` with the train state donated:

1. dense policy (grad): hidden states -> per-token log-probs and entropy, chunked over the
   sequence, never holding [B, L, V];
2. TIS weights ``min(exp(logp_dense_old - logp_sampler), C)`` (on-policy: the old dense
   policy is the current params, stop-gradient);
3. GRPO/PPO loss (clip-higher, optional dual clip, aggregation modes), gradients
   accumulated over micro-batches with ``lax.scan``, optax update;
4. sparse actor (no grad): teacher-forced sparse hidden states with the sampler's page
   selection; exact per-token acceptance rate vs the dense policy; p5 and mean per
   absolute-position bin of the query that produced the token (as calibration bins).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from sparrow_jax.mismatch.scorers import per_token_mismatch
from sparrow_jax.mismatch.tail import binned_percentile_jax, binned_tail_jax, query_positions
from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.lora import LoraConfig, with_lora
from sparrow_jax.models.forward import dense_hidden, sparse_hidden, unembedding
from sparrow_jax.models.scoring import token_logprobs
from sparrow_jax.rl.losses import agg_loss, grpo_loss, kl_penalty, tis_weights


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static settings of the compiled step (hashable)."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 0.0  # 0 disables
    loss_agg: str = "token-mean"
    tis_cap: float = 3.0  # 0 disables TIS
    tis_level: str = "token"
    entropy_coef: float = 0.0
    temperature: float = 1.0
    micro_batches: int = 1
    remat: bool = False
    num_bins: int = 8  # position bins reported for alpha statistics (the last pools later positions)
    bin_width: int = 128
    seq_chunk: int = 128


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
    mask: jax.Array  # float32 [B, T] completion tokens
    logp_sampler: jax.Array  # float32 [B, T]
    advantages: jax.Array  # float32 [B]
    prompt_lens: jax.Array  # int32 [B] (the sampler's prompt prefill is dense)


def make_optimizer(learning_rate: float, max_grad_norm: float = 1.0) -> optax.GradientTransformation:
    parts = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm > 0 else []
    return optax.chain(*parts, optax.adam(learning_rate))


def init_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))


def _micro_batch_weights(mask: jax.Array, loss_agg: str) -> jax.Array:
    """[n, b, T] micro-batch masks -> [n] weights that make the accumulated gradient equal the
    full batch's: each micro-batch's share of the aggregation's denominator (its tokens for
    token-mean, its non-empty rows for the seq-mean modes), uniform if the batch is empty."""
    if loss_agg == "token-mean":
        units = jnp.sum(mask, axis=(1, 2))
    else:
        units = jnp.sum(jnp.any(mask > 0, axis=-1), axis=-1).astype(jnp.float32)
    total = jnp.sum(units)
    return jnp.where(total > 0, units / jnp.maximum(total, 1e-9), 1.0 / mask.shape[0])


def _policy_loss(params, config: Qwen3Config, mb: Batch, opts: StepOptions):
    hidden = dense_hidden(config, params, mb.tokens, remat=opts.remat)
    logp, entropy = token_logprobs(hidden, unembedding(config, params), mb.tokens, opts.temperature,
                                   seq_chunk=opts.seq_chunk)
    logp_old = jax.lax.stop_gradient(logp)
    metrics = {}
    weights = None
    if opts.tis_cap > 0:
        weights, metrics = tis_weights(logp_old, mb.logp_sampler, mb.mask, cap=opts.tis_cap, level=opts.tis_level)
    loss, loss_metrics = grpo_loss(logp, logp_old, mb.advantages, mb.mask, clip_low=opts.clip_low,
                                   clip_high=opts.clip_high, dual_clip_c=opts.dual_clip or None,
                                   is_weights=weights, agg=opts.loss_agg, entropy=entropy,
                                   entropy_coef=opts.entropy_coef)
    metrics.update(loss_metrics)
    return loss, (metrics, jax.lax.stop_gradient(hidden), logp_old)


def _alpha_stats(config, params, sparse_params, tokens, prompt_lens, hidden_dense, schedule, opts):
    """Exact per-token acceptance rate and KL of the sparse actor vs the dense policy. -> 2 x [B, T]"""
    h_sparse = jax.lax.stop_gradient(sparse_hidden(config, sparse_params, tokens, schedule, prompt_lens=prompt_lens))
    m = per_token_mismatch(hidden_dense, h_sparse, unembedding(config, params), unembedding(config, sparse_params),
                           tokens, temperature=opts.temperature, seq_chunk=opts.seq_chunk)
    return m["alpha"], m["kl"]


def _lora_loss(lora, base_params, config: Qwen3Config, lora_cfg: LoraConfig, batch: Batch, hidden_dense,
               schedule, opts: StepOptions, distill: DistillOptions, logp_sparse_old=None):
    """L_LoRA = L_PPO_sparse + lambda * L_KL; base params enter stop-gradient (frozen theta).

    ``logp_sparse_old``: the PPO ratio's denominator for a second or later update on the same
    batch (default: this pass's own log-probs, ratio 1).
    """
    sparse_params = with_lora(jax.lax.stop_gradient(base_params), lora, lora_cfg)
    h_sparse = sparse_hidden(config, sparse_params, batch.tokens, schedule, remat=opts.remat,
                             prompt_lens=batch.prompt_lens)
    w_dense = jax.lax.stop_gradient(unembedding(config, base_params))
    w_sparse = unembedding(config, sparse_params)
    t = opts.temperature
    logp_sparse, _ = token_logprobs(h_sparse, w_sparse, batch.tokens, t, seq_chunk=opts.seq_chunk)
    if logp_sparse_old is None:
        logp_sparse_old = jax.lax.stop_gradient(logp_sparse)
    weights = None
    if distill.tis_cap > 0:
        weights, _ = tis_weights(logp_sparse_old, batch.logp_sampler, batch.mask, cap=distill.tis_cap)
    ppo, _ = grpo_loss(logp_sparse, logp_sparse_old, batch.advantages, batch.mask, clip_low=opts.clip_low,
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


@functools.partial(jax.jit, static_argnames=("config", "optimizer", "opts", "lora_cfg", "lora_optimizer",
                                             "distill"), donate_argnums=(0, 3))
def train_step(state: TrainState, batch: Batch, sparse_params=None, lora_state: Optional[LoraState] = None, *,
               config: Qwen3Config, optimizer: optax.GradientTransformation, schedule=None,
               opts: StepOptions = StepOptions(), lora_cfg: Optional[LoraConfig] = None,
               lora_optimizer: Optional[optax.GradientTransformation] = None,
               distill: DistillOptions = DistillOptions()):
    """One RL update. Returns (new_state, metrics) or, with ``lora_state``, (new_state, new_lora_state, metrics).

    ``sparse_params`` are the sparse actor's params (defaults to the policy's); with
    ``schedule=None`` (dense rollouts) no sparse statistics are computed. The schedule is
    data (its top-k table is traced; layout and ``k_max`` bucket static), so a budget
    change within the bucket compiles nothing new. With
    ``lora_state`` (DistillSparse) the sparse actor is ``with_lora(params, lora)``: the
    policy gets gradients only from the dense PPO loss, the LoRA only from L_LoRA.
    """
    b = batch.tokens.shape[0]
    n = opts.micro_batches
    if b % n:
        raise ValueError(f"batch of {b} rows is not divisible by micro_batches={n}")
    micro = jax.tree.map(lambda x: x.reshape(n, b // n, *x.shape[1:]), batch)
    weights = _micro_batch_weights(micro.mask, opts.loss_agg)
    grad_fn = jax.value_and_grad(_policy_loss, has_aux=True)

    def accumulate(grads_acc, mb_and_weight):
        mb, w = mb_and_weight
        (loss, (metrics, hidden, logp)), grads = grad_fn(state.params, config, Batch(*mb), opts)
        grads_acc = jax.tree.map(lambda a, g: a + g * w, grads_acc, grads)
        return grads_acc, (loss, metrics, hidden)

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    grads, (losses, metrics, hidden) = jax.lax.scan(accumulate, zeros, (tuple(micro), weights))
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)

    out = {k: jnp.sum(v * weights) for k, v in metrics.items()}
    out["loss"] = jnp.sum(losses * weights)
    out["actor/grad_norm"] = optax.tree.norm(grads)
    new_lora_state = None
    if schedule is not None:
        hidden = hidden.reshape(b, *hidden.shape[2:])
        if lora_state is not None:
            lora_grad = jax.value_and_grad(_lora_loss, has_aux=True)

            def apply_lora_grads(lora_st: LoraState, grads) -> LoraState:
                updates, opt = lora_optimizer.update(grads, lora_st.opt_state, lora_st.lora)
                return LoraState(optax.apply_updates(lora_st.lora, updates), opt)

            (_, (dmetrics, alpha, kl, logp_old)), lora_grads = lora_grad(
                lora_state.lora, state.params, config, lora_cfg, batch, hidden, schedule, opts, distill)
            new_lora_state = apply_lora_grads(lora_state, lora_grads)

            def another_update(lora_st: LoraState, _):  # PPO epochs of the LoRA on the same batch
                _, grads = lora_grad(lora_st.lora, state.params, config, lora_cfg, batch, hidden, schedule, opts,
                                     distill, logp_old)
                return apply_lora_grads(lora_st, grads), None

            if distill.updates > 1:
                new_lora_state, _ = jax.lax.scan(another_update, new_lora_state, None, length=distill.updates - 1)
            out.update(dmetrics)  # mismatch statistics are those of the actor that sampled the batch
            out["distill/grad_norm"] = optax.tree.norm(lora_grads)
        else:
            sp = state.params if sparse_params is None else sparse_params
            alpha, kl = _alpha_stats(config, state.params, sp, batch.tokens, batch.prompt_lens, hidden, schedule, opts)
        positions = jnp.broadcast_to(query_positions(batch.tokens.shape[1]), batch.tokens.shape)
        mask = batch.mask > 0
        p5, means, counts = binned_tail_jax(alpha, positions, mask, opts.num_bins, opts.bin_width, 5.0)
        for i in range(opts.num_bins):
            start = i * opts.bin_width
            out[f"mismatch/alpha_p5/bin_{start}"] = p5[i]
            out[f"mismatch/alpha_mean/bin_{start}"] = means[i]
            out[f"mismatch/count/bin_{start}"] = counts[i]
        denom = jnp.maximum(mask.sum(), 1)
        out["mismatch/alpha_mean"] = jnp.sum(jnp.where(mask, alpha, 0)) / denom
        out["mismatch/alpha_p5"] = binned_percentile_jax(alpha, jnp.zeros_like(positions), mask, 1, 1, 5.0)[0][0]
        out["mismatch/kl_dense_sparse"] = jnp.sum(jnp.where(mask, kl, 0)) / denom
    new_state = TrainState(state.step + 1, params, opt_state)
    if lora_state is not None:
        return new_state, new_lora_state, out
    return new_state, out
