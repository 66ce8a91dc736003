"""Block-sparse paged decode attention: Pallas TPU (Mosaic) kernel.

Same contract as :func:`sparrow_jax.attention.contract.sparse_decode_reference`:
``q [B, H, D]`` attends over the pages named by ``page_idx [B, Hkv, N]`` where
``page_valid [B, Hkv, N]``, in ``k_pages / v_pages [B, Hkv, P, S, D]``; token ``s`` of page
``p`` has position ``p * S + s`` and is masked when it lies after ``positions[b]``.
Valid slots must name distinct pages (``select_pages`` guarantees it); valid slots whose
page index is out of range are ignored, as in the reference.

Kernel layout: one program per (row, KV head) serves the ``G = H / Hkv`` query heads of
its group. The (compacted) page table, the number of valid slots and the positions are
scalar-prefetched into SMEM; K/V pages stay in HBM and blocks of ``pages_per_block``
selected pages are copied into a double-buffered VMEM scratch with async DMAs while the
previous block is being attended (online softmax in float32). Valid slots are moved to
the front first, so a program only walks ``ceil(num_valid / pages_per_block)`` blocks:
a small per-row budget costs proportionally less.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import MASK_VALUE, compact_selection
from sparrow_jax.attention.contract import check_decode_inputs

# Names moved across jax versions; resolve once, preferring the current stable spelling.
_ANY = getattr(pl, "ANY", None) or getattr(pltpu, "ANY", None) or pltpu.TPUMemorySpace.ANY
_CompilerParams = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")


def _online_softmax_step(q, k, v, mask, carry, scale):
    """One flash-decoding block: q [G, D], k/v [T, D], mask [G, T]; carry (m, l, acc) in f32.

    Products run in the cache dtype with f32 accumulation and P is cast to v's dtype before
    P.V, matching ``sparse_decode_reference`` (exactly the same math for float32 caches).
    """
    m_prev, l_prev, acc_prev = carry
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = jnp.where(mask, s * scale, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    # where(): a block whose keys are all masked adds exactly nothing (not exp(0) = 1).
    p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    return m_next, l_next, alpha * acc_prev + pv


def _kernel(idx_ref, count_ref, pos_ref,  # scalar prefetch (SMEM)
            q_ref, k_hbm, v_hbm,  # q block in VMEM [G, D]; pages in HBM [B, Hkv, P, S, D]
            o_ref,  # [G, D]
            k_buf, v_buf, sems,  # VMEM [2, ppb, S, D] x2; DMA semaphores [2 (k/v), 2 (buffer)]
            *, pages_per_block: int, slots: int, scale: float):
    b, h = pl.program_id(0), pl.program_id(1)
    num_kv = pl.num_programs(1)
    row = b * num_kv + h
    base = row * slots
    count = count_ref[row]
    position = pos_ref[b]
    num_blocks = (count + pages_per_block - 1) // pages_per_block
    _, page_size, dim = k_buf.shape[1:]
    groups = q_ref.shape[0]
    tokens = pages_per_block * page_size

    def block_copies(blk, buf):
        copies = []
        for j in range(pages_per_block):
            page = idx_ref[base + blk * pages_per_block + j]
            copies.append(pltpu.make_async_copy(k_hbm.at[b, h, page], k_buf.at[buf, j], sems.at[0, buf]))
            copies.append(pltpu.make_async_copy(v_hbm.at[b, h, page], v_buf.at[buf, j], sems.at[1, buf]))
        return copies

    @pl.when(num_blocks > 0)
    def _prefetch_first():
        for c in block_copies(0, 0):
            c.start()

    q = q_ref[...]  # in the cache dtype, as the reference computes q.k
    col = jax.lax.broadcasted_iota(jnp.int32, (groups, tokens), 1)

    def body(blk, carry):
        buf = blk % 2

        @pl.when(blk + 1 < num_blocks)
        def _prefetch_next():  # overlap the next block's DMA with this block's math
            for c in block_copies(blk + 1, 1 - buf):
                c.start()

        for c in block_copies(blk, buf):
            c.wait()
        # Column c = j * S + s holds token s of slot j: position page_j * S + s.
        tok_pos = col
        for j in range(pages_per_block):
            page = idx_ref[base + blk * pages_per_block + j]
            in_slot = (col >= j * page_size) & (col < (j + 1) * page_size)
            tok_pos = jnp.where(in_slot, col + (page - j) * page_size, tok_pos)
        live = (count - blk * pages_per_block) * page_size  # columns of valid slots
        mask = (tok_pos <= position) & (col < live)
        k = k_buf[buf].reshape(tokens, dim)
        v = v_buf[buf].reshape(tokens, dim)
        return _online_softmax_step(q, k, v, mask, carry, scale)

    init = (jnp.full((groups, 1), -jnp.inf, jnp.float32), jnp.zeros((groups, 1), jnp.float32),
            jnp.zeros((groups, dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    # No visible key at all (nothing selected): output 0 rather than 0/0.
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "pages_per_block"))
def sparse_decode_tpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_idx: jax.Array,
                      page_valid: jax.Array, positions: jax.Array, scale: Optional[float] = None,
                      interpret=False, pages_per_block: int = 8) -> jax.Array:
    """Block-sparse decode attention on TPU. Returns [B, H, D] in q's dtype.

    Args:
      q: [B, H, D] one query token per row.
      k_pages, v_pages: [B, Hkv, P, S, D] paged cache (stays in HBM).
      page_idx, page_valid: [B, Hkv, N] selection from ``select_pages``.
      positions: [B] int32 absolute position of the query token.
      scale: softmax scale (default D**-0.5).
      interpret: run the kernel in the Pallas TPU interpreter (CPU tests); a
        ``pltpu.InterpretParams`` selects interpreter options (e.g. race detection).
      pages_per_block: pages per DMA / compute block (``pages_per_block * S`` keys).
    """
    check_decode_inputs(q, k_pages, v_pages, page_idx, page_valid, positions)
    b, h, d = q.shape
    _, hkv, num_pages, page_size, _ = k_pages.shape
    groups = h // hkv
    scale = d ** -0.5 if scale is None else float(scale)
    ppb = max(1, min(pages_per_block, page_idx.shape[-1]))
    idx, count = compact_selection(page_idx, page_valid, num_pages, ppb)
    slots = idx.shape[-1]
    # Pad the group to a multiple of 8 sublanes: Mosaic tiles f32 as (8, 128), and a
    # [G < 8, D] matmul operand would need an unusual layout.
    g_pad = -(-groups // 8) * 8
    qg = q.reshape(b, hkv, groups, d).astype(k_pages.dtype)  # q.k in the cache dtype, f32 accumulate
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, g_pad - groups), (0, 0)))

    q_spec = pl.BlockSpec((None, None, g_pad, d), lambda bi, hi, *_: (bi, hi, 0, 0))
    kernel = functools.partial(_kernel, pages_per_block=ppb, slots=slots, scale=scale)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, hkv),
            in_specs=[q_spec, pl.BlockSpec(memory_space=_ANY), pl.BlockSpec(memory_space=_ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, ppb, page_size, d), k_pages.dtype),
                pltpu.VMEM((2, ppb, page_size, d), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
            ]),
        out_shape=jax.ShapeDtypeStruct((b, hkv, g_pad, d), jnp.float32),
        # Every program prefetches only its own blocks, so both grid axes are independent.
        compiler_params=_CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_interpret_arg(interpret),
        name="sparse_decode_tpu",
    )(idx.reshape(-1), count.reshape(-1), positions.astype(jnp.int32), qg, k_pages, v_pages)
    return out[:, :, :groups].reshape(b, h, d).astype(q.dtype)


def _interpret_arg(interpret):
    """False, or the TPU interpreter (simulates DMAs and semaphores) when this jax has it.

    ``interpret`` may also be a ``pltpu.InterpretParams`` (e.g. ``detect_races=True``), passed on.
    """
    if interpret is False or interpret is None:
        return False
    if interpret is not True:
        return interpret
    params = getattr(pltpu, "InterpretParams", None)
    return params() if params is not None else True
