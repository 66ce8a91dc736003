"""Block-sparse paged decode attention: Pallas GPU kernel (Triton lowering).

Same contract as :func:`sparrow_jax.attention.contract.sparse_decode_reference` (see
:mod:`pallas_kernels.sparse_decode_tpu` for the details shared by both kernels).

Kernel layout: grid (B, Hkv, splits); a program holds the G query heads of one KV group
and walks its share of the compacted selection (valid slots first) ``pages_per_block``
pages at a time, gathering those pages with one vector-indexed load per block
(``k_ref[page_vector]``) and updating a float32 online softmax. Split-K (flash-decoding):
B * Hkv alone is far too few programs to fill a GPU at decode time, so each selection is
cut into ``num_splits`` parts whose (acc, l, m) are merged in XLA afterwards. Triton wants power-of-two tensor sizes and matmul dims >= 16, so the group is
padded to ``max(16, next_pow2(G))`` query rows (padding rows are zeros and are dropped),
and ``pages_per_block`` must be a power of two (S and D must be too).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import MASK_VALUE, compact_selection
from sparrow_jax.attention.contract import check_decode_inputs


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _compiler_params(num_warps: int, num_stages: int):
    """Triton compiler params under their current or older name (None when neither exists)."""
    try:
        from jax.experimental.pallas import triton as plgpu
    except ImportError:  # pragma: no cover - very old/new jax without the Triton backend
        return None
    cls = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams", None)
    return None if cls is None else cls(num_warps=num_warps, num_stages=num_stages)


def _kernel(q_ref, k_ref, v_ref, idx_ref, meta_ref, o_ref, l_ref, m_ref, *, pages_per_block: int,
            blocks_per_split: int, scale: float, precision):
    # q_ref [Gp, D]; k_ref/v_ref [P, S, D] (this row and KV head); idx_ref [Np]; meta_ref [2] =
    # (valid slots, query position). Outputs of this split: o_ref [Gp, D] (unnormalised),
    # l_ref / m_ref [Gp] (softmax denominator and running max).
    groups, dim = q_ref.shape
    page_size = k_ref.shape[1]
    tokens = pages_per_block * page_size
    count, position = meta_ref[0], meta_ref[1]
    q = q_ref[...]  # cache dtype; products accumulate in f32 like the reference
    slot_in_block = jnp.arange(pages_per_block, dtype=jnp.int32)
    token_in_page = jnp.arange(page_size, dtype=jnp.int32)

    def body(blk, carry):
        m_prev, l_prev, acc_prev = carry
        pages = idx_ref[pl.ds(blk * pages_per_block, pages_per_block)]  # [ppb] int32
        k = k_ref[pages].reshape(tokens, dim)  # gather ppb pages
        v = v_ref[pages].reshape(tokens, dim)
        tok_pos = (pages[:, None] * page_size + token_in_page[None, :]).reshape(tokens)
        slot_ok = (blk * pages_per_block + slot_in_block) < count
        live = jnp.broadcast_to(slot_ok[:, None], (pages_per_block, page_size)).reshape(tokens)
        mask = ((tok_pos <= position) & live)[None, :]  # [1, T]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)
        s = jnp.where(mask, s * scale, MASK_VALUE)  # [Gp, T]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)  # masked keys add exactly 0
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32)
        return m_next, l_next, alpha[:, None] * acc_prev + pv

    init = (jnp.full((groups,), MASK_VALUE, jnp.float32), jnp.zeros((groups,), jnp.float32),
            jnp.zeros((groups, dim), jnp.float32))
    # This split owns blocks [first, first + blocks_per_split), clipped to the valid slots.
    first = pl.program_id(2) * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, (count + pages_per_block - 1) // pages_per_block)
    m, l, acc = jax.lax.fori_loop(first, jnp.maximum(first, last), body, init)
    o_ref[...] = acc.astype(o_ref.dtype)
    l_ref[...] = l
    m_ref[...] = m


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "pages_per_block", "num_splits",
                                             "num_warps", "num_stages"))
def sparse_decode_gpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_idx: jax.Array,
                      page_valid: jax.Array, positions: jax.Array, scale: Optional[float] = None,
                      interpret: bool = False, pages_per_block: int = 4, num_splits: Optional[int] = None,
                      num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Block-sparse decode attention on GPU (Pallas/Triton). Returns [B, H, D] in q's dtype.

    Args:
      q: [B, H, D]; k_pages, v_pages: [B, Hkv, P, S, D]; page_idx, page_valid: [B, Hkv, N];
      positions: [B] int32; scale: softmax scale (default D**-0.5).
      interpret: run in the Pallas interpreter (CPU tests).
      pages_per_block: pages gathered per loop step (power of two; ``pages_per_block * S`` keys).
      num_splits: split-K partitions of the selection per (row, KV head), merged afterwards
        (flash-decoding); default: enough for ~128 programs, at most one per block.
    """
    check_decode_inputs(q, k_pages, v_pages, page_idx, page_valid, positions)
    b, h, d = q.shape
    _, hkv, num_pages, page_size, _ = k_pages.shape
    for name, val in (("pages_per_block", pages_per_block), ("page_size S", page_size), ("head_dim D", d)):
        if val != _next_pow2(val):
            raise ValueError(f"{name} must be a power of two for the Triton kernel, got {val}")
    groups = h // hkv
    scale = d ** -0.5 if scale is None else float(scale)
    idx, count = compact_selection(page_idx, page_valid, num_pages, pages_per_block)
    slots = idx.shape[-1]
    blocks = slots // pages_per_block
    splits = min(blocks, -(-128 // (b * hkv))) if num_splits is None else num_splits
    if not 1 <= splits <= blocks:
        raise ValueError(f"num_splits must be in [1, {blocks}] (blocks of selected pages), got {splits}")
    blocks_per_split = -(-blocks // splits)
    meta = jnp.stack([count, jnp.broadcast_to(positions.astype(jnp.int32)[:, None], (b, hkv))], -1)
    g_pad = max(16, _next_pow2(groups))  # Triton dot: power-of-two dims, M >= 16
    qg = q.reshape(b, hkv, groups, d).astype(k_pages.dtype)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, g_pad - groups), (0, 0)))
    # f32 matmuls in full precision (Triton would otherwise use TF32 on tensor cores).
    precision = jax.lax.Precision.HIGHEST if k_pages.dtype == jnp.float32 else None

    kernel = functools.partial(_kernel, pages_per_block=pages_per_block,
                               blocks_per_split=blocks_per_split, scale=scale, precision=precision)
    kv_spec = pl.BlockSpec((None, None, num_pages, page_size, d), lambda bi, hi, si: (bi, hi, 0, 0, 0))
    vec_spec = pl.BlockSpec((None, None, None, g_pad), lambda bi, hi, si: (si, bi, hi, 0))
    o, l, m = pl.pallas_call(
        kernel,
        grid=(b, hkv, splits),
        in_specs=[pl.BlockSpec((None, None, g_pad, d), lambda bi, hi, si: (bi, hi, 0, 0)), kv_spec, kv_spec,
                  pl.BlockSpec((None, None, slots), lambda bi, hi, si: (bi, hi, 0)),
                  pl.BlockSpec((None, None, 2), lambda bi, hi, si: (bi, hi, 0))],
        out_specs=[pl.BlockSpec((None, None, None, g_pad, d), lambda bi, hi, si: (si, bi, hi, 0, 0)),
                   vec_spec, vec_spec],
        out_shape=[jax.ShapeDtypeStruct((splits, b, hkv, g_pad, d), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, hkv, g_pad), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, hkv, g_pad), jnp.float32)],
        compiler_params=None if interpret else _compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="sparse_decode_gpu",
    )(qg, k_pages, v_pages, idx, meta)
    # Merge the splits: rescale each to the global max. Empty splits have l = 0 and acc = 0.
    m_all = jnp.max(m, axis=0)
    w = jnp.exp(m - m_all)
    l_all = jnp.sum(w * l, axis=0)
    acc = jnp.sum(w[..., None] * o, axis=0)
    out = acc / jnp.where(l_all > 0, l_all, 1.0)[..., None]  # nothing visible: 0, not 0/0
    return out[:, :, :groups].reshape(b, h, d).astype(q.dtype)
