"""Chunked causal attention over whole sequences (teacher forcing and prefill): the XLA reference
of :mod:`sparrow_jax.attention.whole_sequence`, whose fast paths are tested against it.

Never builds an ``L x L`` score matrix: queries go in chunks of ``chunk`` tokens.

* :func:`causal_attention` is differentiable (each chunk rematerialised in the backward
  pass) and can restrict every query to a per-query set of pages (the sparse scorer).
* :func:`causal_attention_prefill` is forward-only and skips key chunks above the
  diagonal (flash-style online softmax), for prompt prefill.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

# (chunk_start, q_chunk [B, C, H, D]) -> allowed pages [B, Hkv, C, P] bool
PageMaskFn = Callable[[jax.Array, jax.Array], jax.Array]


def _pad_to(x, multiple, axis=1):
    pad = (-x.shape[axis]) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int = 256,
                     page_mask_fn: Optional[PageMaskFn] = None, page_size: int = 16) -> jax.Array:
    """Causal attention, queries in chunks. q [B, T, H, D]; k, v [B, T, Hkv, D] -> [B, T, H, D].

    Query at index t attends keys 0..t (positions are the indices). With ``page_mask_fn``
    it attends only keys whose page ``(index // page_size)`` is allowed for that query.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    chunk = min(chunk, t)
    qp = _pad_to(q, chunk)
    n_chunks = qp.shape[1] // chunk
    q_chunks = qp.reshape(b, n_chunks, chunk, h, d).swapaxes(0, 1)
    key_pos = jnp.arange(t)
    scale = d ** -0.5

    @jax.checkpoint
    def one_chunk(args):
        start, qc = args
        qg = qc.reshape(b, chunk, hkv, g, d)
        s = jnp.einsum("bchgd,bthd->bhgct", qg, k, preferred_element_type=jnp.float32) * scale
        q_pos = start + jnp.arange(chunk)
        mask = (key_pos[None, :] <= q_pos[:, None])[None, None]  # [1, 1, C, T]
        if page_mask_fn is not None:
            pages = page_mask_fn(start, qc)  # [B, Hkv, C, P]
            mask = mask & jnp.take(pages, key_pos // page_size, axis=-1)
        s = jnp.where(mask[:, :, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        p = jnp.where(jnp.isnan(p), 0.0, p)  # padded query rows past T see no key
        out = jnp.einsum("bhgct,bthd->bchgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return out.reshape(b, chunk, h, d).astype(q.dtype)

    starts = jnp.arange(n_chunks, dtype=jnp.int32) * chunk
    out = jax.lax.map(one_chunk, (starts, q_chunks))
    return out.swapaxes(0, 1).reshape(b, n_chunks * chunk, h, d)[:, :t]


def causal_attention_prefill(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int = 256) -> jax.Array:
    """Forward-only causal attention that skips fully-masked key chunks (online softmax).

    q [B, T, H, D]; k, v [B, T, Hkv, D] -> [B, T, H, D]. About half the work of
    :func:`causal_attention` for long prompts.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    chunk = min(chunk, t)
    qp, kp, vp = _pad_to(q, chunk), _pad_to(k, chunk), _pad_to(v, chunk)
    n = qp.shape[1] // chunk
    q_chunks = qp.reshape(b, n, chunk, hkv, g, d).swapaxes(0, 1)
    k_chunks = kp.reshape(b, n, chunk, hkv, d)
    v_chunks = vp.reshape(b, n, chunk, hkv, d)
    scale = d ** -0.5

    def one_query_chunk(args):
        i, qc = args  # qc [B, C, Hkv, G, D]
        q_pos = i * chunk + jnp.arange(chunk)

        def body(j, carry):
            m, l, acc = carry
            kc = jax.lax.dynamic_index_in_dim(k_chunks, j, axis=1, keepdims=False)
            vc = jax.lax.dynamic_index_in_dim(v_chunks, j, axis=1, keepdims=False)
            s = jnp.einsum("bchgd,bthd->bhgct", qc, kc, preferred_element_type=jnp.float32) * scale
            k_pos = j * chunk + jnp.arange(chunk)
            s = jnp.where((k_pos[None, :] <= q_pos[:, None]), s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            corr = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            l = l * corr + p.sum(-1)
            acc = acc * corr[..., None] + jnp.einsum("bhgct,bthd->bhgcd", p.astype(vc.dtype), vc,
                                                     preferred_element_type=jnp.float32)
            return m_new, l, acc

        init = (jnp.full((b, hkv, g, chunk), -jnp.inf, jnp.float32),
                jnp.zeros((b, hkv, g, chunk), jnp.float32),
                jnp.zeros((b, hkv, g, chunk, d), jnp.float32))
        _, l, acc = jax.lax.fori_loop(0, i + 1, body, init)
        out = acc / l[..., None]  # [B, Hkv, G, C, D]
        return out.transpose(0, 3, 1, 2, 4).reshape(b, chunk, h, d).astype(q.dtype)

    out = jax.lax.map(one_query_chunk, (jnp.arange(n), q_chunks))
    return out.swapaxes(0, 1).reshape(b, n * chunk, h, d)[:, :t]
