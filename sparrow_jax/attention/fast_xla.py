"""A faster XLA (CPU) formulation of block-sparse decode attention.

Same contract as :func:`sparrow_jax.attention.decode.sparse_decode_xla` (the result differs
only by float summation order); the CPU path of ``sparse_decode(impl="xla"|"auto")``.
Written after profiling the jitted decode step (score_pages + select_pages + attention)
on XLA:CPU, 2 cores:

* Rows, not tokens: the selected pages are gathered as rows of ``S*D`` contiguous values
  from a ``[B*Hkv*P, S*D]`` view (one index per 4 KiB row, vectorised copy loop).
* Multiply + reduce instead of ``einsum`` for q.K and P.V: the consumers are then YNN
  fusions that take the ``[rows, 1, S*D]`` gather output as is. With a dot consumer XLA
  folds the ``-> [B*Hkv, T, D]`` reshape into the gather fusion, whose loop then runs
  over D=64 values per index and is emitted as scalar loads/stores (~2x slower gathers),
  or inserts a relayout copy of the gathered block; either costs more than the dot saves.
* In-bounds promise: invalid / out-of-range slots are pointed at page 0 first (and
  masked), so the gather skips ``jnp.take``'s per-element bounds check and NaN fill.
* Ascending page order: the N slots of each (row, KV head) are sorted by page index (one
  int sort of [B, Hkv, N]; invalid slots sort last and are masked), so each row's cache
  is read front to back instead of in score order. In the decode loop (caches far larger
  than L3) this cut gather time by ~10-40% for ~8 us of sorting per layer.

Tried and not kept (measured slower or no better in the decode loop): einsum / dot_general
score in either operand order (relayout copies or scalar gathers, see above), a K/V
gather with K and V of a page adjacent (8 KiB rows, via strided K/V views), pages stored
with K transposed ([D, S], vertical score reduction: ~5%, not worth a layout that the
Pallas kernels and tests do not use), splitting top_k by rows, int32 top_k keys.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax


def _gather_rows(table: jax.Array, rows: jax.Array) -> jax.Array:
    """table [R, C], rows [M] (in bounds) -> [M, C]: one contiguous row per index."""
    dnums = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
    return lax.gather(table, rows[:, None], dnums, slice_sizes=(1, table.shape[1]),
                      mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def sparse_decode_xla_fast(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_idx: jax.Array,
                           page_valid: jax.Array, positions: jax.Array,
                           scale: Optional[float] = None) -> jax.Array:
    """Block-sparse decode attention over the selected pages only. Returns [B, H, D] in q's dtype.

    q [B, H, D]; k_pages, v_pages [B, Hkv, P, S, D]; page_idx, page_valid [B, Hkv, N];
    positions [B]. Keys after ``positions[b]`` and invalid slots are masked; valid slots with
    an out-of-range page index are ignored (as in ``sparse_decode_reference``).
    """
    b, hkv, p, s, d = k_pages.shape
    n = page_idx.shape[-1]
    groups = q.shape[1] // hkv
    scale = d ** -0.5 if scale is None else scale
    idx, valid = _sorted_selection(page_idx, page_valid, p)
    base = (jnp.arange(b, dtype=jnp.int32)[:, None] * hkv + jnp.arange(hkv, dtype=jnp.int32)[None]) * p
    flat = (base[..., None] + idx).reshape(-1)
    k = _gather_rows(k_pages.reshape(b * hkv * p, s * d), flat).reshape(b, hkv, n * s, d)
    v = _gather_rows(v_pages.reshape(b * hkv * p, s * d), flat).reshape(b, hkv, n * s, d)
    # q rounded to the cache dtype first, as the reference's q.k does.
    qg = q.reshape(b, hkv, groups, d).astype(k_pages.dtype).astype(jnp.float32) * scale
    # Multiply + reduce instead of einsum: see the module docstring.
    scores = jnp.sum(k.astype(jnp.float32)[:, :, None] * qg[:, :, :, None, :], axis=-1)  # [B,Hkv,G,T]
    token_pos = (idx[..., None] * s + jnp.arange(s, dtype=jnp.int32)).reshape(b, hkv, n * s)
    mask = jnp.repeat(valid, s, axis=-1) & (token_pos <= positions[:, None, None])
    probs = jax.nn.softmax(jnp.where(mask[:, :, None], scores, -jnp.inf), axis=-1)
    probs = probs.astype(v.dtype).astype(jnp.float32)  # same rounding as the reference's P.V
    out = jnp.sum(probs[..., None] * v.astype(jnp.float32)[:, :, None], axis=-2)  # [B,Hkv,G,D]
    return out.reshape(q.shape).astype(q.dtype)


def _sorted_selection(page_idx: jax.Array, page_valid: jax.Array, num_pages: int):
    """[..., N] slots -> (idx, valid) with the valid in-range pages first, ascending; the rest
    (invalid or out-of-range slots) last, marked invalid and pointing at page 0."""
    idx = page_idx.astype(jnp.int32)
    ok = page_valid.astype(bool) & (idx >= 0) & (idx < num_pages)
    key = jnp.sort(jnp.where(ok, idx, num_pages), axis=-1)  # num_pages: a sentinel past every page
    valid = key < num_pages
    return jnp.where(valid, key, 0), valid
