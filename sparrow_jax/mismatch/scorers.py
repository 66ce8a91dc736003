"""Teacher-forced dense and sparse scorers of rollouts, and per-token mismatch measures.

Index convention (same as :class:`sparrow_jax.rollout.Rollout`): the statistic stored at
``[b, t]`` concerns the distribution that produced ``tokens[b, t]``, i.e. the model's
output at position ``t - 1``; index 0 holds zeros. Scorers go over the sequence in
chunks of ``seq_chunk`` positions and over the vocabulary in chunks of ``vocab_chunk``,
so no ``[B, L, V]`` tensor is ever held.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from sparrow_jax.mismatch.measures import mismatch_stats, topk_acceptance_rate
from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.forward import dense_hidden, sparse_hidden, unembedding
from sparrow_jax.models.qwen3 import Params


def _shift(x: jax.Array) -> jax.Array:
    """Stats of positions 0..T-2 -> stored at 1..T-1 (index 0 gets 0)."""
    return jnp.pad(x, [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2))


def _chunked_over_sequence(fn, *arrays, seq_chunk: int):
    """Apply ``fn`` to [B, c, ...] slices of [B, T, ...] arrays; concatenate along T."""
    t = arrays[0].shape[1]
    c = min(seq_chunk, t)
    pad = (-t) % c
    padded = [jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in arrays]
    n = (t + pad) // c
    split = [a.reshape(a.shape[0], n, c, *a.shape[2:]).swapaxes(0, 1) for a in padded]
    out = jax.lax.map(lambda xs: fn(*xs), tuple(split))
    return jax.tree.map(lambda o: o.swapaxes(0, 1).reshape(o.shape[1], n * c, *o.shape[3:])[:, :t], out)


def token_logprobs(hidden: jax.Array, unembed: jax.Array, tokens: jax.Array, temperature: float = 1.0,
                   seq_chunk: int = 128):
    """Differentiable log-prob and entropy of each next token. -> (logp [B, T], entropy [B, T]).

    hidden [B, T, H] final hidden states, unembed [H, V], tokens int32 [B, T]. Output at
    ``t`` is about ``tokens[:, t]`` given ``tokens[:, :t]``; index 0 is 0. Logits exist
    one sequence chunk at a time ([B, seq_chunk, V]), rematerialised in the backward pass.
    """
    @jax.checkpoint
    def chunk(h, tok):
        logits = jnp.dot(h, unembed.astype(h.dtype), preferred_element_type=jnp.float32) / temperature
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        logp = jnp.take_along_axis(logp_all, tok[..., None], -1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return logp, entropy

    logp, ent = _chunked_over_sequence(chunk, hidden[:, :-1], tokens[:, 1:], seq_chunk=seq_chunk)
    return _shift(logp), _shift(ent)


@functools.partial(jax.jit, static_argnames=("config", "temperature", "seq_chunk",
                                             "vocab_chunk", "top_k", "k_max"))
def score_rollout(config: Qwen3Config, dense_params: Params, sparse_params: Params, tokens: jax.Array,
                  prompt_lens: Optional[jax.Array] = None, *, schedule, temperature: float = 1.0, seq_chunk: int = 256, vocab_chunk: int = 8192,
                  top_k: int = 20, k_max: Optional[int] = None) -> dict[str, jax.Array]:
    """Exact per-token mismatch between the dense policy and the sparse actor on rollouts.

    Args:
      dense_params: the policy's params; sparse_params: the sparse actor's (e.g. with LoRA).
      tokens: int32 [B, T] rollouts (positions 0..T-1).
      prompt_lens: int32 [B] prompt lengths (the sampler's prefill of the prompt is dense);
        pass them whenever two or more layers are sparse.
      schedule: the SparsitySchedule the sampler used (same selection is reproduced).
      top_k: also compute the paper's top-k approximation of alpha (0 disables it).
    Returns float32 [B, T] arrays: ``alpha``, ``tv``, ``kl`` (KL(dense || sparse)),
    ``logp_dense``, ``logp_sparse`` (log-probs of ``tokens``), ``entropy_dense`` and, when
    ``top_k``, ``alpha_topk``.
    """
    h_dense = dense_hidden(config, dense_params, tokens) / temperature
    h_sparse = sparse_hidden(config, sparse_params, tokens, schedule, k_max=k_max,
                             prompt_lens=prompt_lens) / temperature
    w_dense = unembedding(config, dense_params)
    w_sparse = unembedding(config, sparse_params)

    def chunk(hp, hq, tok):
        stats = mismatch_stats(hp, hq, w_dense, vocab_chunk=vocab_chunk, sampled_tokens=tok, unembed_q=w_sparse)
        out = dict(alpha=stats["alpha"], tv=stats["tv"], kl=stats["kl"], logp_dense=stats["logp_p_sampled"],
                   logp_sparse=stats["logp_q_sampled"], entropy_dense=stats["entropy_p"])
        if top_k:
            lp = jnp.dot(hp, w_dense.astype(hp.dtype), preferred_element_type=jnp.float32)
            lq = jnp.dot(hq, w_sparse.astype(hq.dtype), preferred_element_type=jnp.float32)
            out["alpha_topk"] = topk_acceptance_rate(lp, lq, k=top_k)
        return out

    out = _chunked_over_sequence(chunk, h_dense[:, :-1], h_sparse[:, :-1], tokens[:, 1:], seq_chunk=seq_chunk)
    return {k: _shift(v) for k, v in out.items()}
