"""Paged KV cache with per-page key metadata for block-sparse decode.

Layout (one layer): every row owns ``num_pages`` pages of ``page_size`` tokens, so the page
table is the identity and shapes are static. Page metadata lives beside the pages in
``[B, Hkv, P, D]`` arrays, so scoring every page is one batched mat-vec with no gather:

* ``centroid``: mean of the page's keys (running mean while the page fills),
* ``kmin`` / ``kmax``: elementwise min / max of the page's keys (Quest selector; optional).

Keys are stored after RoPE and q/k-norm, exactly as attention consumes them.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp


class PagedKVCache(NamedTuple):
    k: jax.Array  # [B, Hkv, P, S, D]
    v: jax.Array  # [B, Hkv, P, S, D]
    centroid: jax.Array  # [B, Hkv, P, D] float32
    kmin: Optional[jax.Array] = None  # [B, Hkv, P, D] float32, Quest selector only
    kmax: Optional[jax.Array] = None

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def capacity(self) -> int:
        return self.k.shape[2] * self.k.shape[3]


def init_cache(batch: int, num_kv_heads: int, max_len: int, head_dim: int, page_size: int = 16,
               dtype=jnp.float32, with_minmax: bool = False) -> PagedKVCache:
    """An empty cache able to hold ``max_len`` tokens per row (rounded up to whole pages)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    pages = -(-max_len // page_size)
    kv_shape = (batch, num_kv_heads, pages, page_size, head_dim)
    meta_shape = (batch, num_kv_heads, pages, head_dim)
    return PagedKVCache(
        k=jnp.zeros(kv_shape, dtype), v=jnp.zeros(kv_shape, dtype),
        centroid=jnp.zeros(meta_shape, jnp.float32),
        kmin=jnp.full(meta_shape, jnp.inf, jnp.float32) if with_minmax else None,
        kmax=jnp.full(meta_shape, -jnp.inf, jnp.float32) if with_minmax else None)


def page_metadata(k_pages: jax.Array, lengths: jax.Array, with_minmax: bool):
    """Metadata recomputed from pages: k_pages [B, Hkv, P, S, D], lengths [B] valid tokens per row.

    Returns (centroid, kmin, kmax), each [B, Hkv, P, D] float32 (kmin/kmax None unless asked).
    Empty pages get centroid 0, kmin +inf, kmax -inf.
    """
    _, _, num_pages, page_size, _ = k_pages.shape
    token_pos = jnp.arange(num_pages * page_size).reshape(num_pages, page_size)
    valid = (token_pos[None] < lengths[:, None, None])[:, None, :, :, None]  # [B,1,P,S,1]
    kf = k_pages.astype(jnp.float32)
    count = jnp.sum(valid, axis=3)
    centroid = jnp.sum(jnp.where(valid, kf, 0.0), axis=3) / jnp.maximum(count, 1)
    if not with_minmax:
        return centroid, None, None
    kmin = jnp.min(jnp.where(valid, kf, jnp.inf), axis=3)
    kmax = jnp.max(jnp.where(valid, kf, -jnp.inf), axis=3)
    return centroid, kmin, kmax


def write_prefill(cache: PagedKVCache, k: jax.Array, v: jax.Array, lengths: jax.Array) -> PagedKVCache:
    """Write a prompt block at positions 0..L-1 and (re)compute metadata of the pages it touches.

    k, v: [B, L, Hkv, D] (model layout); lengths: [B] number of valid tokens per row (<= L).
    Tokens at positions >= lengths[b] are written but excluded from metadata; decode
    overwrites them later.
    """
    batch, length, heads, dim = k.shape
    page_size = cache.page_size
    if length > cache.capacity:
        raise ValueError(f"prefill of {length} tokens exceeds the cache capacity {cache.capacity}")
    pages = -(-length // page_size)
    pad = pages * page_size - length

    def to_pages(x):
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
        return x.reshape(batch, pages, page_size, heads, dim).transpose(0, 3, 1, 2, 4)

    kp, vp = to_pages(k).astype(cache.k.dtype), to_pages(v).astype(cache.v.dtype)
    with_minmax = cache.kmin is not None
    centroid, kmin, kmax = page_metadata(kp, lengths, with_minmax)
    upd = lambda dst, src: jax.lax.dynamic_update_slice_in_dim(dst, src, 0, axis=2)
    return PagedKVCache(
        k=upd(cache.k, kp), v=upd(cache.v, vp), centroid=upd(cache.centroid, centroid),
        kmin=upd(cache.kmin, kmin) if with_minmax else None,
        kmax=upd(cache.kmax, kmax) if with_minmax else None)


def running_page_metadata(old_centroid: Optional[jax.Array], old_min: Optional[jax.Array],
                          old_max: Optional[jax.Array], kf: jax.Array, slot: jax.Array):
    """Page metadata after adding key ``kf`` [B, Hkv, D] float32 at in-page ``slot`` [B].

    The centroid is a running mean: c <- c + (k - c) / n with n the tokens now in the page;
    slot 0 starts the page afresh. Returns (centroid, kmin, kmax), each None when its old
    value is None (kmin and kmax go together).
    """
    first = (slot == 0)[:, None, None]
    n = (slot + 1).astype(jnp.float32)[:, None, None]
    centroid = None if old_centroid is None else jnp.where(first, kf, old_centroid + (kf - old_centroid) / n)
    if old_min is None:
        return centroid, None, None
    return (centroid, jnp.where(first, kf, jnp.minimum(old_min, kf)),
            jnp.where(first, kf, jnp.maximum(old_max, kf)))


def append_token(cache: PagedKVCache, k: jax.Array, v: jax.Array, positions: jax.Array) -> PagedKVCache:
    """Write one token per row at ``positions`` and update that page's metadata incrementally.

    k, v: [B, Hkv, D]; positions: [B] int32 absolute position of the token (< capacity).
    """
    page_size = cache.page_size
    rows = jnp.arange(k.shape[0])
    page, slot = positions // page_size, positions % page_size
    old = lambda meta: None if meta is None else meta[rows, :, page]  # [B, Hkv, D]
    centroid, kmin, kmax = running_page_metadata(old(cache.centroid), old(cache.kmin), old(cache.kmax),
                                                 k.astype(jnp.float32), slot)
    out = PagedKVCache(
        k=cache.k.at[rows, :, page, slot].set(k.astype(cache.k.dtype)),
        v=cache.v.at[rows, :, page, slot].set(v.astype(cache.v.dtype)),
        centroid=cache.centroid.at[rows, :, page].set(centroid))
    if cache.kmin is None:
        return out
    return out._replace(kmin=cache.kmin.at[rows, :, page].set(kmin), kmax=cache.kmax.at[rows, :, page].set(kmax))
