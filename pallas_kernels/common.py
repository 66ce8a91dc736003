"""Helpers shared by the Pallas (TPU, GPU) and Triton sparse decode kernels."""
from __future__ import annotations

import jax.numpy as jnp

# Large negative logit for masked keys; finite so that max/exp never see inf - inf.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def compact_selection(page_idx, page_valid, num_pages: int, pages_per_block: int):
    """Move valid slots to the front of each (row, KV head) selection.

    Returns ``idx [B, Hkv, Np]`` int32 (invalid tail slots point at page 0, so every DMA or
    load stays in bounds) and ``count [B, Hkv]`` int32 valid slots, with ``Np`` = N rounded
    up to a multiple of ``pages_per_block``. Out-of-range valid indices count as invalid.
    """
    idx = page_idx.astype(jnp.int32)
    valid = page_valid.astype(bool) & (idx >= 0) & (idx < num_pages)
    order = jnp.argsort(~valid, axis=-1, stable=True)  # valid first, original order kept
    idx = jnp.take_along_axis(idx, order, axis=-1)
    valid = jnp.take_along_axis(valid, order, axis=-1)
    idx = jnp.where(valid, idx, 0)
    pad = -idx.shape[-1] % pages_per_block
    idx = jnp.pad(idx, ((0, 0), (0, 0), (0, pad)))
    return idx, jnp.sum(valid, axis=-1, dtype=jnp.int32)
