"""Teacher-forced dense and sparse scorers of rollouts, and per-token mismatch measures.

Index convention: that of :mod:`sparrow_jax.models.scoring` (``[b, t]`` is about the
distribution that produced ``tokens[b, t]``; index 0 holds zeros). Scorers go over the sequence in
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
from sparrow_jax.models.scoring import chunked_over_sequence, shift_to_next_token


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
    h_dense = dense_hidden(config, dense_params, tokens)
    h_sparse = sparse_hidden(config, sparse_params, tokens, schedule, k_max=k_max, prompt_lens=prompt_lens)
    return per_token_mismatch(h_dense, h_sparse, unembedding(config, dense_params),
                              unembedding(config, sparse_params), tokens, temperature=temperature,
                              seq_chunk=seq_chunk, vocab_chunk=vocab_chunk, top_k=top_k)


def per_token_mismatch(h_dense: jax.Array, h_sparse: jax.Array, w_dense: jax.Array, w_sparse: jax.Array,
                       tokens: jax.Array, *, temperature: float = 1.0, seq_chunk: int = 256,
                       vocab_chunk: int = 8192, top_k: int = 0, reverse_kl: bool = False) -> dict[str, jax.Array]:
    """Exact per-token mismatch from final hidden states [B, T, H] and unembeddings [H, V].

    Chunked over the sequence (``seq_chunk``) and the vocabulary (``vocab_chunk``); no
    [B, T, V] tensor. Differentiable w.r.t. ``h_sparse`` / ``w_sparse`` (callers stop
    gradients where they want none). Returns float32 [B, T] arrays (module index
    convention): ``alpha``, ``tv``, ``kl`` (KL(dense || sparse)), ``logp_dense``,
    ``logp_sparse``, ``entropy_dense``; ``kl_reverse`` (KL(sparse || dense)) with
    ``reverse_kl``; ``alpha_topk`` (the paper's top-k approximation) with ``top_k``.
    """
    def chunk(hp, hq, tok):
        hp, hq = hp / temperature, hq / temperature
        stats = mismatch_stats(hp, hq, w_dense, vocab_chunk=vocab_chunk, sampled_tokens=tok, unembed_q=w_sparse,
                               reverse_kl=reverse_kl)
        out = dict(alpha=stats["alpha"], tv=stats["tv"], kl=stats["kl"], logp_dense=stats["logp_p_sampled"],
                   logp_sparse=stats["logp_q_sampled"], entropy_dense=stats["entropy_p"])
        if reverse_kl:
            out["kl_reverse"] = stats["kl_reverse"]
        if top_k:
            lp = jnp.dot(hp, w_dense.astype(hp.dtype), preferred_element_type=jnp.float32)
            lq = jnp.dot(hq, w_sparse.astype(hq.dtype), preferred_element_type=jnp.float32)
            out["alpha_topk"] = topk_acceptance_rate(lp, lq, k=top_k)
        return out

    out = chunked_over_sequence(chunk, h_dense[:, :-1], h_sparse[:, :-1], tokens[:, 1:], seq_chunk=seq_chunk)
    return {k: shift_to_next_token(v) for k, v in out.items()}
