"""Flash-style blockwise causal attention with a recomputing custom VJP (the CPU fast path).

Queries go in blocks of ``block`` tokens; each query block visits only the key tiles it can
see and keeps an online softmax, so no ``[T, T]`` score matrix and no full-row
rematerialisation exist, forward or backward:

* dense: key tiles ``0..i`` for query block ``i`` (causal block skipping);
* paged (the sparse teacher-forced scorer): every query has its own selected pages
  (``page_idx / page_valid [B, Hkv, T, N]``, as the sampler selects them); per query block
  the union of its queries' pages is compacted into a list of tiles of ``block // page_size``
  pages, only those tiles are gathered, and a per-query mask keeps each query to its own
  pages. The loop runs over the longest list among rows and KV heads.

The backward pass saves only the output and the per-query log-sum-exp, and recomputes
each tile's probabilities (FlashAttention-2), accumulating dK / dV tile by tile.
:func:`sparrow_jax.attention.causal.causal_attention` is the reference.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from sparrow_jax.attention.contract import check_whole_sequence_inputs, selected_page_mask


class _Pages(NamedTuple):
    """Per-query page sets (all None for dense causal attention)."""

    idx: Optional[jax.Array]  # int32 [B, Hkv, Tp, N]
    valid: Optional[jax.Array]  # bool [B, Hkv, Tp, N]
    dense_before: Optional[jax.Array]  # int32 [B]: queries below it see every page


def default_block(page_size: int = 1) -> int:
    """The query / key tile when none is given, a multiple of ``page_size``: 64 tokens on CPU,
    where a tile's scores then stay in the core's cache (128 measured ~25% slower forward and
    ~20% slower forward + backward on the quickstart's 16 x 1592 tokens), 128 on accelerators."""
    base = 64 if jax.default_backend() == "cpu" else 128
    return -(-base // page_size) * page_size


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block: Optional[int] = None,
                        page_idx: Optional[jax.Array] = None, page_valid: Optional[jax.Array] = None,
                        page_size: int = 16, dense_before: Optional[jax.Array] = None) -> jax.Array:
    """Causal attention. q [B, T, H, D]; k, v [B, T, Hkv, D] -> [B, T, H, D] in q's dtype.

    Query t attends keys 0..t. With ``page_idx`` / ``page_valid`` ([B, Hkv, T, N], a
    selection per query as :func:`sparrow_jax.attention.selection.select_pages` returns it)
    query t attends only keys of its valid selected pages (and still only keys <= t);
    ``dense_before`` [B]: queries at positions below it attend every page. ``block``: the
    query / key tile (default :func:`default_block`; a multiple of ``page_size`` with pages).
    Differentiable in q, k, v (softmax in float32).
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    paged = check_whole_sequence_inputs(q, k, v, page_idx, page_valid, dense_before)
    block = block or default_block(page_size if paged else 1)
    if paged and block % page_size:
        raise ValueError(f"block={block} must be a multiple of page_size={page_size}")
    block = min(block, -(-t // page_size) * page_size if paged else t)
    tp = -(-t // block) * block
    pad = lambda x: jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2))
    # [B, Hkv, Tp, G, D]: a KV head's query heads next to each other, so one tile product serves the group
    qg = pad(q).reshape(b, tp, hkv, h // hkv, d).transpose(0, 2, 1, 3, 4)
    kt, vt = pad(k).transpose(0, 2, 1, 3), pad(v).transpose(0, 2, 1, 3)  # [B, Hkv, Tp, D]
    pages = _Pages(None, None, None)
    if paged:
        pad_q = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, tp - t), (0, 0)])
        pages = _Pages(pad_q(page_idx.astype(jnp.int32)), pad_q(page_valid.astype(bool)),
                       None if dense_before is None else dense_before.astype(jnp.int32))
    if jax.default_backend() == "cpu":
        # A row at a time, two for dense attention when B is even: a tile's scores then stay in the
        # core's cache (all rows' tiles at once are several MiB per step and every elementwise pass
        # goes to memory), and dK / dV accumulate in a small buffer. Dense row pairs measured ~8%
        # faster than single rows on the quickstart's shapes; with page sets a pair visits the
        # union of both rows' tiles. Accelerators want every row in one program instead.
        rows = 2 if b % 2 == 0 and not paged else 1
        split = lambda x: x.reshape(b // rows, rows, *x.shape[1:])
        out = jax.lax.map(lambda r: _attend(*r, block, page_size), jax.tree.map(split, (qg, kt, vt, pages)))
        out = out.reshape(b, *out.shape[2:])
    else:
        out = _attend(qg, kt, vt, pages, block, page_size)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, tp, h, d)[:, :t].astype(q.dtype)


# ---- one query block: its key tiles and masks -------------------------------------------

class _Plan(NamedTuple):
    tiles: Optional[jax.Array]  # int32 [B, Hkv, NT] tile ids, the union of the block's pages first (paged)
    count: Optional[jax.Array]  # int32 [] tiles to visit (paged; dense visits tiles 0..i)
    allowed: Optional[jax.Array]  # bool [B, Hkv, C, P] each query's pages (paged)


def _plan(i, pages: _Pages, block: int, page_size: int, tp: int) -> _Plan:
    if pages.idx is None:
        return _Plan(None, None, None)
    num_pages = tp // page_size
    idx = jax.lax.dynamic_slice_in_dim(pages.idx, i * block, block, axis=2)
    valid = jax.lax.dynamic_slice_in_dim(pages.valid, i * block, block, axis=2)
    allowed = selected_page_mask(idx, valid, num_pages)  # [B, Hkv, C, P]
    if pages.dense_before is not None:
        q_pos = i * block + jnp.arange(block)
        allowed = allowed | (q_pos[None, :] < pages.dense_before[:, None])[:, None, :, None]
    per_tile = block // page_size
    used = allowed.any(axis=2).reshape(*allowed.shape[:2], tp // block, per_tile).any(-1)  # [B, Hkv, NT]
    # tiles past the diagonal hold only later keys: the causal mask drops them (queries below
    # dense_before allow every page, so without this a prompt block visited every tile)
    used = used & (jnp.arange(tp // block) <= i)
    tiles = jnp.argsort(~used, axis=-1, stable=True).astype(jnp.int32)  # used tiles first, in order
    return _Plan(tiles, jnp.max(jnp.sum(used, axis=-1)).astype(jnp.int32), allowed)


def _tile(j, plan: _Plan, kt, vt, block: int, page_size: int):
    """Tile j of the plan -> (k [B, Hkv, K, D], v, key positions [B|1, Hkv|1, K], tile ids or None)."""
    if plan.tiles is None:
        ks = jax.lax.dynamic_slice_in_dim(kt, j * block, block, axis=2)
        vs = jax.lax.dynamic_slice_in_dim(vt, j * block, block, axis=2)
        return ks, vs, (j * block + jnp.arange(block))[None, None], None
    tid = plan.tiles[:, :, j]  # [B, Hkv]
    b, hkv, tp, d = kt.shape
    gather = lambda x: jnp.take_along_axis(x.reshape(b, hkv, tp // block, block, d), tid[:, :, None, None, None],
                                           axis=2)[:, :, 0]
    return gather(kt), gather(vt), tid[:, :, None] * block + jnp.arange(block), tid


def _mask(i, key_pos, tid, plan: _Plan, block: int, page_size: int):
    """bool [B|1, Hkv|1, C, 1, K]: causal, and (paged) the query's own pages."""
    q_pos = i * block + jnp.arange(block)
    mask = key_pos[:, :, None, :] <= q_pos[None, None, :, None]
    if plan.allowed is not None:
        per_tile = block // page_size
        pages = jnp.take_along_axis(plan.allowed, (tid[:, :, None] * per_tile + jnp.arange(per_tile))[:, :, None],
                                    axis=-1)  # [B, Hkv, C, per_tile]
        mask = mask & jnp.repeat(pages, page_size, axis=-1)
    return mask[:, :, :, None]


def _scores(qb, ks, mask):
    s = jnp.einsum("bhcgd,bhkd->bhcgk", qb, ks, preferred_element_type=jnp.float32)
    return s if mask is None else jnp.where(mask, s, -jnp.inf)


def _tile_loop(i, plan: _Plan, body, init):
    """Run ``body(j, carry, masked)`` over the plan's tiles. Dense: the tiles below the diagonal
    need no mask (every key precedes every query), only the diagonal tile does."""
    if plan.tiles is not None:
        return jax.lax.fori_loop(0, plan.count, lambda j, c: body(j, c, True), init)
    carry = jax.lax.fori_loop(0, i, lambda j, c: body(j, c, False), init)
    return body(i, carry, True)


def _forward(qg, kt, vt, pages: _Pages, block: int, page_size: int):
    """-> out [B, Hkv, Tp, G, D] float32, lse [B, Hkv, Tp, G] float32."""
    b, hkv, tp, g, d = qg.shape
    scale = d ** -0.5

    def one_block(i):
        qb = jax.lax.dynamic_slice_in_dim(qg, i * block, block, axis=2).astype(jnp.float32) * scale
        plan = _plan(i, pages, block, page_size, tp)

        def body(j, carry, masked):
            m, l, acc = carry
            ks, vs, key_pos, tid = _tile(j, plan, kt, vt, block, page_size)
            mask = _mask(i, key_pos, tid, plan, block, page_size) if masked else None
            s = _scores(qb, ks.astype(jnp.float32), mask)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with no key yet: keep zeros
            p = jnp.exp(s - m_safe[..., None])
            corr = jnp.exp(m - m_safe)
            l = l * corr + p.sum(-1)
            acc = acc * corr[..., None] + jnp.einsum("bhcgk,bhkd->bhcgd", p, vs.astype(jnp.float32))
            return m_new, l, acc

        init = (jnp.full((b, hkv, block, g), -jnp.inf, jnp.float32), jnp.zeros((b, hkv, block, g), jnp.float32),
                jnp.zeros((b, hkv, block, g, d), jnp.float32))
        m, l, acc = _tile_loop(i, plan, body, init)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)  # no key: p = exp(s - inf) = 0
        return out, lse

    out, lse = jax.lax.map(one_block, jnp.arange(tp // block))  # [NQ, B, Hkv, C, G, ...]
    merge = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, hkv, tp, *x.shape[4:])
    return merge(out), merge(lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend(qg, kt, vt, pages: _Pages, block: int, page_size: int):
    return _forward(qg, kt, vt, pages, block, page_size)[0]


def _attend_fwd(qg, kt, vt, pages, block, page_size):
    out, lse = _forward(qg, kt, vt, pages, block, page_size)
    return out, (qg, kt, vt, pages, out, lse)


def _attend_bwd(block, page_size, res, dout):
    qg, kt, vt, pages, out, lse = res
    b, hkv, tp, g, d = qg.shape
    scale = d ** -0.5
    delta = jnp.sum(dout * out, axis=-1)  # [B, Hkv, Tp, G]
    blk = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=2)
    kf, vf = kt.astype(jnp.float32), vt.astype(jnp.float32)

    def one_block(i, carry):
        dk, dv = carry
        qb = blk(qg, i).astype(jnp.float32) * scale
        dob, lseb, deltab = blk(dout, i), blk(lse, i), blk(delta, i)
        plan = _plan(i, pages, block, page_size, tp)

        def body(j, inner, masked):
            dq, dk, dv = inner
            ks, vs, key_pos, tid = _tile(j, plan, kf, vf, block, page_size)
            s = _scores(qb, ks, _mask(i, key_pos, tid, plan, block, page_size) if masked else None)
            p = jnp.exp(s - lseb[..., None])  # [B, Hkv, C, G, K]
            dv_t = jnp.einsum("bhcgk,bhcgd->bhkd", p, dob)
            dp = jnp.einsum("bhcgd,bhkd->bhcgk", dob, vs)
            ds = p * (dp - deltab[..., None])
            dq = dq + jnp.einsum("bhcgk,bhkd->bhcgd", ds, ks)
            dk_t = jnp.einsum("bhcgk,bhcgd->bhkd", ds, qb)
            if tid is None:
                add = lambda acc, x: jax.lax.dynamic_update_slice_in_dim(
                    acc, jax.lax.dynamic_slice_in_dim(acc, j * block, block, axis=2) + x, j * block, axis=2)
            else:
                bi, hi = jnp.arange(b)[:, None], jnp.arange(hkv)[None, :]
                add = lambda acc, x: acc.reshape(b, hkv, tp // block, block, d).at[bi, hi, tid].add(x).reshape(
                    acc.shape)
            return dq, add(dk, dk_t), add(dv, dv_t)

        dq, dk, dv = _tile_loop(i, plan, body, (jnp.zeros_like(qb), dk, dv))
        return (dk, dv), dq * scale

    zeros = jnp.zeros((b, hkv, tp, d), jnp.float32)
    (dk, dv), dq = jax.lax.scan(lambda c, i: one_block(i, c), (zeros, zeros), jnp.arange(tp // block))
    dq = jnp.moveaxis(dq, 0, 2).reshape(qg.shape)
    none_like = jax.tree.map(lambda _: None, pages)
    return dq.astype(qg.dtype), dk.astype(kt.dtype), dv.astype(vt.dtype), none_like


_attend.defvjp(_attend_fwd, _attend_bwd)
