"""A faster XLA (CPU) formulation of block-sparse decode attention.

Same contract and result as :func:`sparrow_jax.attention.decode.sparse_decode_xla`; written
after profiling a jitted decode step (score_pages + select_pages + attention) on XLA:CPU
(B=8, H=8, Hkv=2, D=64, S=16, 64 selected pages, 16K context):

* With ``einsum`` consumers XLA pushes the ``[rows, S*D] -> [B, Hkv, T, D]`` reshape into the
  gather's loop fusion, whose inner loop then runs over D=64 instead of S*D=1024 contiguous
  values; each K/V gather took ~0.9-1.1 ms. Written as multiply + reduce, the consumers
  (YNN fusions) take the ``[rows, 1, S*D]`` gather output as is and each gather takes
  ~0.4-0.5 ms; the score product itself also gets cheaper (M = G = 4 rows is a poor matmul).
* ``jnp.take``'s default ``mode='fill'`` adds an out-of-bounds compare and a NaN select per
  gathered element; here invalid / out-of-range slots are pointed at page 0 first (and
  masked), so the gather can promise in-bounds indices. (Measured effect: small.)

Measured full step at 16K: ~2.1 ms vs ~3.1 ms for ``sparse_decode_xla`` (dense ~8.9 ms).
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
    idx = page_idx.astype(jnp.int32)
    valid = page_valid.astype(bool) & (idx >= 0) & (idx < p)
    idx = jnp.where(valid, idx, 0)  # every gathered row is in bounds
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
