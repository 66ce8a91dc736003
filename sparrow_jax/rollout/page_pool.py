"""A shared KV page pool with a page table: memory follows the tokens, prompts are shared.

Device side (one :class:`PoolLayer` per layer): pages of every row live in one pool
``k, v [NP, Hkv, S, D]`` with the metadata its page selector reads (``centroid``, or Quest's
``kmin / kmax``, [NP, Hkv, D]; none for dense decoding); a row sees its
pages through a page table ``[B, W]`` (logical page -> physical page). Physical page 0 is a
scratch page: idle slots and unused table entries point at it, so their writes land nowhere
that matters. Full prompt pages are shared by the rows sampling the same prompt (refcounts);
the page a row appends to is always its own.

Host side, :class:`PageAllocator` hands out physical pages (free list + refcounts) and
records the peak number in use; :func:`reserve_pages` grows it and the device pools together.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention.cache import PagedKVCache, running_page_metadata
from sparrow_jax.attention.decode import dense_decode, resolve_impl, score_select_decode, sparse_decode
from sparrow_jax.attention.selection import group_mean_query

SCRATCH_PAGE = 0


class PoolLayer(NamedTuple):
    k: jax.Array  # [NP, Hkv, S, D]
    v: jax.Array  # [NP, Hkv, S, D]
    centroid: Optional[jax.Array] = None  # [NP, Hkv, D] float32, centroid selector only
    kmin: Optional[jax.Array] = None  # [NP, Hkv, D] float32, Quest selector only
    kmax: Optional[jax.Array] = None


def init_pool(num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int, dtype,
              selector: Optional[str]) -> tuple[PoolLayer, ...]:
    """Empty pools of ``num_pages`` pages per layer (page 0 is the scratch page), with the
    metadata ``selector`` reads ("centroid" or "quest"; None: dense, no metadata). Why not all
    of it always: every decode step updates what the pool holds, and bookkeeping the attention
    never reads would be charged to both sides of the dense-vs-sparse comparison."""
    kv = (num_pages, num_kv_heads, page_size, head_dim)
    meta = (num_pages, num_kv_heads, head_dim)
    quest = selector == "quest"
    return tuple(PoolLayer(jnp.zeros(kv, dtype), jnp.zeros(kv, dtype),
                           jnp.zeros(meta, jnp.float32) if selector == "centroid" else None,
                           jnp.full(meta, jnp.inf, jnp.float32) if quest else None,
                           jnp.full(meta, -jnp.inf, jnp.float32) if quest else None)
                 for _ in range(num_layers))


def pool_size(pages: int) -> int:
    """Pages to allocate for ``pages`` needed: the next value of the grid 2^n, 3 * 2^(n-1)
    (at most 1.5x the need; the same few sizes recur across calls, so compiles are reused)."""
    p = 1 << max(0, int(pages) - 1).bit_length()
    return 3 * p // 4 if pages <= 3 * p // 4 else p


def pool_bytes(pools: Sequence[PoolLayer], pages: Optional[int] = None) -> int:
    """Bytes held by the pools, or by ``pages`` of their pages."""
    total = sum(x.nbytes for layer in pools for x in layer if x is not None)
    return total if pages is None else total * pages // pools[0].k.shape[0]


@functools.partial(jax.jit, static_argnames=("num_pages",))  # new shape: nothing to donate into
def grow_pool(pools: tuple[PoolLayer, ...], num_pages: int) -> tuple[PoolLayer, ...]:
    """The same pools with room for ``num_pages`` pages (new pages empty)."""
    def grow(x, fill):
        pad = [(0, num_pages - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
        return jnp.pad(x, pad, constant_values=fill)

    return tuple(PoolLayer(grow(p.k, 0), grow(p.v, 0), None if p.centroid is None else grow(p.centroid, 0),
                           None if p.kmin is None else grow(p.kmin, jnp.inf),
                           None if p.kmax is None else grow(p.kmax, -jnp.inf)) for p in pools)


@functools.partial(jax.jit, donate_argnums=(0,))
def store_prefill(pools: tuple[PoolLayer, ...], caches: Sequence[PagedKVCache], dest: jax.Array):
    """Copy the pages of a one-row prefill cache ([1, Hkv, P, S, D]) to physical pages ``dest`` [P].

    Pages not to be kept go to the scratch page.
    """
    out = []
    for pool, cache in zip(pools, caches):
        put = lambda dst, src: dst.at[dest].set(jnp.swapaxes(src[0], 0, 1).astype(dst.dtype))
        out.append(PoolLayer(put(pool.k, cache.k), put(pool.v, cache.v),
                             None if pool.centroid is None else put(pool.centroid, cache.centroid),
                             None if pool.kmin is None else put(pool.kmin, cache.kmin),
                             None if pool.kmax is None else put(pool.kmax, cache.kmax)))
    return tuple(out)


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_pages(pools: tuple[PoolLayer, ...], src: jax.Array, dst: jax.Array) -> tuple[PoolLayer, ...]:
    """Copy physical pages ``src`` [N] (K, V and metadata) onto ``dst`` [N]; pad with scratch -> scratch."""
    return tuple(PoolLayer(*(None if x is None else x.at[dst].set(x[src]) for x in pool)) for pool in pools)


def append_to_pool(pool: PoolLayer, page_table: jax.Array, k: jax.Array, v: jax.Array,
                   positions: jax.Array) -> PoolLayer:
    """Write one token per row (k, v [B, Hkv, D]) at ``positions`` [B] through the page table [B, W]."""
    page_size = pool.k.shape[2]
    rows = jnp.arange(k.shape[0])
    phys = page_table[rows, positions // page_size]
    slot = positions % page_size
    old = lambda meta: None if meta is None else meta[phys]
    centroid, kmin, kmax = running_page_metadata(old(pool.centroid), old(pool.kmin), old(pool.kmax),
                                                 k.astype(jnp.float32), slot)
    put = lambda meta, new: None if meta is None else meta.at[phys].set(new)  # noqa: E731
    return PoolLayer(pool.k.at[phys, :, slot].set(k.astype(pool.k.dtype)),
                     pool.v.at[phys, :, slot].set(v.astype(pool.v.dtype)),
                     put(pool.centroid, centroid), put(pool.kmin, kmin), put(pool.kmax, kmax))


def _row_view(x: jax.Array, page_table: jax.Array) -> jax.Array:
    """Pool array [NP, Hkv, ...] -> per-row layout [B, Hkv, W, ...] through the page table."""
    return jnp.moveaxis(x[page_table], 2, 1)


def paged_decode(q: jax.Array, pool: PoolLayer, page_table: jax.Array, positions: jax.Array, schedule=None,
                 budget: Optional[jax.Array] = None, k_max: int = 0, impl: str = "auto") -> jax.Array:
    """Decode attention of q [B, H, D] over the rows' pages in the pool. Returns [B, H, D].

    ``schedule=None``: dense. Otherwise the sparse decode step of
    :func:`sparrow_jax.models.forward.decode_step` (score, select ``min(budget, k_max)`` pages,
    attend) on the logical pages the table maps. With the CPU kernel the pool is read in place;
    other implementations run on a per-row view gathered through the table.
    """
    cpu = resolve_impl(impl) == "cpu"
    if cpu:
        from sparrow_jax.attention.cpu_kernel import paged_decode_cpu, paged_sparse_step_cpu
    if schedule is None:
        if cpu:
            return paged_decode_cpu(q, pool.k, pool.v, page_table, positions)
        return dense_decode(q, _row_view(pool.k, page_table), _row_view(pool.v, page_table), positions)
    if cpu:  # group mean, scores, selection and attention in one C++ pass per (row, KV head) over the pool
        return paged_sparse_step_cpu(q, pool.k, pool.v, page_table, positions, pool.centroid, pool.kmin, pool.kmax,
                                     budget, k_max, schedule.reserved_first, schedule.reserved_last,
                                     schedule.selector)[0]
    qg = group_mean_query(q, pool.k.shape[1])
    select = dict(k_max=k_max, page_size=schedule.page_size, reserved_first=schedule.reserved_first,
                  reserved_last=schedule.reserved_last, selector=schedule.selector)
    meta = lambda x: None if x is None else _row_view(x, page_table)  # [B, Hkv, W, D]
    idx, valid = score_select_decode(qg, meta(pool.centroid), meta(pool.kmin), meta(pool.kmax), positions, budget,
                                     **select, impl=impl)
    return sparse_decode(q, _row_view(pool.k, page_table), _row_view(pool.v, page_table), idx, valid, positions,
                         impl=impl)


def append_and_decode(q: jax.Array, k: jax.Array, v: jax.Array, pool: PoolLayer, page_table: jax.Array,
                      positions: jax.Array, schedule=None, budget: Optional[jax.Array] = None, k_max: int = 0,
                      impl: str = "auto") -> tuple[jax.Array, PoolLayer]:
    """One decode step of one layer on the pool: :func:`append_to_pool` (k, v [B, Hkv, D] at
    ``positions`` [B]) then :func:`paged_decode` of q [B, H, D]. Returns (out [B, H, D], new pool).

    With the CPU kernel a sparse step appends the key to its page's metadata inside the kernel
    (XLA writes only K and V): the same numbers without XLA's small metadata ops, which cost
    the sparse side more than its page selection does.
    """
    if schedule is None or resolve_impl(impl) != "cpu":
        pool = append_to_pool(pool, page_table, k, v, positions)
        return paged_decode(q, pool, page_table, positions, schedule, budget, k_max, impl), pool
    from sparrow_jax.attention.cpu_kernel import paged_sparse_step_cpu

    kv = append_to_pool(PoolLayer(pool.k, pool.v), page_table, k, v, positions)
    out, meta = paged_sparse_step_cpu(q, kv.k, kv.v, page_table, positions, pool.centroid, pool.kmin, pool.kmax,
                                      budget, k_max, schedule.reserved_first, schedule.reserved_last,
                                      schedule.selector, k_new=k)
    return out, PoolLayer(kv.k, kv.v, *meta)


class PageAllocator:
    """Physical pages of a pool: a free list, refcounts, the peak number in use and the number of grows.

    Page 0 (scratch) is never handed out. ``grow`` adds pages at the end (the device pool is
    padded to match by the caller, e.g. :func:`reserve_pages`).
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a page pool needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.refs = np.zeros(num_pages, np.int32)
        self.free: list[int] = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # pop() hands out low pages first
        self.peak = 0
        self.grows = 0

    @property
    def in_use(self) -> int:
        return self.num_pages - 1 - len(self.free)

    def grow(self, num_pages: int) -> None:
        self.free = list(range(num_pages - 1, self.num_pages - 1, -1)) + self.free
        self.refs = np.concatenate([self.refs, np.zeros(num_pages - self.num_pages, np.int32)])
        self.num_pages = num_pages
        self.grows += 1

    def alloc(self, n: int) -> list[int]:
        """``n`` fresh pages (refcount 1). Raises MemoryError if fewer are free (the caller grows first)."""
        if n > len(self.free):
            raise MemoryError(f"page pool exhausted: {n} pages wanted, {len(self.free)} free")
        pages = [self.free.pop() for _ in range(n)]
        self.refs[pages] = 1
        self.peak = max(self.peak, self.in_use)
        return pages

    def share(self, pages: Sequence[int]) -> None:
        for p in pages:
            self.refs[p] += 1

    def release(self, pages: Sequence[int]) -> None:
        for p in pages:
            if p == SCRATCH_PAGE or self.refs[p] <= 0:
                raise ValueError(f"release of page {p}, which is not allocated")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)


def reserve_pages(allocator: PageAllocator, pools: tuple[PoolLayer, ...], n: int) -> tuple[PoolLayer, ...]:
    """Room for ``n`` more pages: when fewer are free, the allocator and the device pools grow together
    to the next :func:`pool_size` (at least one page more). Returns the pools (new arrays if grown)."""
    if n > len(allocator.free):
        size = pool_size(max(allocator.in_use + 1 + n, allocator.num_pages + 1))
        pools = grow_pool(pools, num_pages=size)
        allocator.grow(size)
    return pools
