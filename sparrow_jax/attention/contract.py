"""The block-sparse decode contract, shared by every implementation (XLA, C++, Pallas, Triton).

A leaf module: kernels import only this (never ``decode.py``, which dispatches to them).

Inputs: ``q [B, H, D]`` (H a multiple of Hkv) against ``k_pages, v_pages [B, Hkv, P, S, D]``;
``page_idx [B, Hkv, N]`` integer page indices with ``page_valid [B, Hkv, N]`` (slots in any
order; invalid slots and out-of-range indices are ignored); ``positions [B]`` the query
token's absolute position (keys at later positions are masked). Output ``[B, H, D]`` in q's
dtype; softmax in float32. :func:`sparse_decode_reference` defines the result.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def check_decode_inputs(q, k_pages, v_pages, page_idx, page_valid, positions) -> None:
    """Raise ValueError naming the tensor whose shape or dtype breaks the decode contract."""
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, D], got shape {q.shape}")
    if k_pages.ndim != 5:
        raise ValueError(f"k_pages must be [B, Hkv, P, S, D], got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    b, h, d = q.shape
    kb, hkv, _, _, kd = k_pages.shape
    if (kb, kd) != (b, d):
        raise ValueError(f"k_pages batch/head_dim {(kb, kd)} must match q's {(b, d)}")
    if h % hkv:
        raise ValueError(f"query heads H={h} must be a multiple of KV heads Hkv={hkv}")
    if page_idx.ndim != 3 or page_idx.shape[:2] != (b, hkv):
        raise ValueError(f"page_idx must be [B={b}, Hkv={hkv}, N], got shape {page_idx.shape}")
    if page_valid.shape != page_idx.shape:
        raise ValueError(f"page_valid shape {page_valid.shape} must equal page_idx shape {page_idx.shape}")
    if not jnp.issubdtype(page_idx.dtype, jnp.integer):
        raise ValueError(f"page_idx must be an integer array, got dtype {page_idx.dtype}")
    if positions.shape != (b,):
        raise ValueError(f"positions must be [B={b}], got shape {positions.shape}")


def check_whole_sequence_inputs(q, k, v, page_idx, page_valid, dense_before) -> bool:
    """Shape checks of whole-sequence causal attention (q [B, T, H, D]; k, v [B, T, Hkv, D];
    optional per-query page sets page_idx / page_valid [B, Hkv, T, N] and dense_before [B]).
    Raises ValueError naming what is wrong; returns whether page sets are given."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    if h % hkv:
        raise ValueError(f"query heads H={h} must be a multiple of KV heads Hkv={hkv}")
    if k.shape != (b, t, hkv, d) or v.shape != k.shape:
        raise ValueError(f"k and v must be [B={b}, T={t}, Hkv, D={d}], got {k.shape} and {v.shape}")
    if page_idx is None:
        if dense_before is not None:
            raise ValueError("dense_before needs page_idx / page_valid")
        return False
    if page_valid is None or page_idx.shape[:3] != (b, hkv, t) or page_valid.shape != page_idx.shape:
        raise ValueError(f"page_idx and page_valid must both be [B={b}, Hkv={hkv}, T={t}, N], got "
                         f"{page_idx.shape} and {None if page_valid is None else page_valid.shape}")
    return True


def selected_page_mask(page_idx: jax.Array, page_valid: jax.Array, num_pages: int) -> jax.Array:
    """[..., N] selection -> [..., P] boolean mask of selected pages (a scatter, no one-hot)."""
    lead = page_idx.shape[:-1]
    n = page_idx.shape[-1]
    flat_idx = jnp.where(page_valid, page_idx, num_pages).reshape(-1, n)  # invalid -> dropped
    rows = jnp.arange(flat_idx.shape[0])[:, None]
    mask = jnp.zeros((flat_idx.shape[0], num_pages), bool).at[rows, flat_idx].set(True, mode="drop")
    return mask.reshape(*lead, num_pages)


def group_query_heads(q, num_kv_heads):
    """[B, H, D] -> [B, Hkv, H // Hkv, D] (query heads grouped by the KV head they share)."""
    b, h, d = q.shape
    return q.reshape(b, num_kv_heads, h // num_kv_heads, d)


def masked_softmax_attend(qg, k, v, mask, scale):
    """qg [B,Hkv,G,D], k/v [B,Hkv,T,D], mask [B,Hkv,T] -> [B,Hkv,G,D] float32.

    HIGHEST precision: on GPU, XLA would otherwise run f32 products as TF32 (relative error
    ~4e-4 seen on an H200), and decode attention is memory-bound, so full f32 costs nothing.
    """
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, k, preferred_element_type=jnp.float32, precision=hi) * scale
    s = jnp.where(mask[:, :, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhgt,bhtd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=hi)


def sparse_decode_reference(q, k_pages, v_pages, page_idx, page_valid, positions, scale=None):
    """Reference: dense attention restricted to the selected pages by a mask."""
    b, hkv, p, s, d = k_pages.shape
    scale = d ** -0.5 if scale is None else scale
    page_mask = selected_page_mask(page_idx, page_valid, p)  # [B, Hkv, P]
    causal = (jnp.arange(p * s)[None] <= positions[:, None])[:, None]
    mask = jnp.repeat(page_mask, s, axis=-1) & causal
    k, v = k_pages.reshape(b, hkv, p * s, d), v_pages.reshape(b, hkv, p * s, d)
    out = masked_softmax_attend(group_query_heads(q, hkv).astype(k.dtype), k, v, mask, scale)
    return out.reshape(q.shape).astype(q.dtype)
