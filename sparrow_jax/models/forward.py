"""Pure functions over (config, params) for every way the model is run.

* :func:`dense_logits` / :func:`dense_hidden`: teacher-forced, full causal attention.
* :func:`sparse_hidden`: teacher-forced, every query restricted to the pages the sparse
  sampler would have selected at that position (the sparse scorer).
* :func:`prefill`: prompt into a paged cache (dense attention, as in the paper).
* :func:`decode_step`: one token per row against the cache, dense or block-sparse.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from sparrow_jax.attention.cache import PagedKVCache, append_token, init_cache, write_prefill
from sparrow_jax.attention.causal import causal_attention, causal_attention_prefill
from sparrow_jax.attention.cpu_kernel import select_pages_cpu
from sparrow_jax.attention.decode import dense_decode_dispatch, score_select_decode, sparse_decode
from sparrow_jax.attention.contract import selected_page_mask
from sparrow_jax.attention.selection import group_mean_query, score_pages, select_pages
from sparrow_jax.attention.whole_sequence import resolve_causal_impl, whole_sequence_attention
from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.qwen3 import Params, bind


def _positions(tokens):
    """Positions 0..T-1 of every row, int32 [1, T]: one row, so the rotary tables are computed once
    per position rather than once per row and position (the quickstart's train step -2.3%, paired)."""
    return jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]


def dense_hidden(config: Qwen3Config, params: Params, tokens: jax.Array, chunk: Optional[int] = None,
                 remat: bool = False, impl: str = "auto") -> jax.Array:
    """tokens int32 [B, L] (positions 0..L-1) -> final hidden states [B, L, hidden].

    ``impl`` / ``chunk``: the whole-sequence attention's (:mod:`sparrow_jax.attention.whole_sequence`).
    """
    model = bind(config, params)
    attention = lambda layer, q, k, v: whole_sequence_attention(q, k, v, impl=impl, chunk=chunk)
    return model(tokens, _positions(tokens), attention, remat=remat)


PrefixKV = tuple[tuple[jax.Array, jax.Array], ...]  # per layer (k, v) [B, S, Hkv, D] of positions 0..S-1


def dense_hidden_and_prefix_kv(config: Qwen3Config, params: Params, tokens: jax.Array, prefix: int,
                               impl: str = "auto") -> tuple[jax.Array, PrefixKV]:
    """:func:`dense_hidden` of positions ``prefix..L-1`` only, and every layer's keys and values
    (post RoPE, no gradient) of positions ``0..prefix-1``, which :func:`sparse_hidden` takes
    instead of recomputing a prompt prefix. Positions below ``prefix`` (a multiple of 64) are a
    prompt whose logits no loss reads: the last layer computes their keys and values only.
    -> (hidden [B, L - prefix, hidden], per layer (k, v) [B, prefix, Hkv, D])"""
    model = bind(config, params)
    kept = []
    last = config.num_hidden_layers - 1

    def attention(layer, q, k, v):
        kept.append(jax.lax.stop_gradient((k[:, :prefix], v[:, :prefix])))
        return whole_sequence_attention(q, k, v, impl=impl, queries_from=prefix if layer == last else 0)

    hidden = model(tokens, _positions(tokens), attention, outputs_from=prefix)
    return hidden, tuple(kept)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("impl",))
def dense_logits(config: Qwen3Config, params: Params, tokens: jax.Array, impl: str = "auto") -> jax.Array:
    """Full-sequence causal logits, float32 [B, L, V]. tokens int32 [B, L], positions 0..L-1.

    Convenience for tests and small inputs; scorers use :func:`dense_hidden` and reduce
    over the vocabulary in chunks instead of holding [B, L, V].
    """
    model = bind(config, params)
    attention = lambda layer, q, k, v: whole_sequence_attention(q, k, v, impl=impl)
    return model.logits(model(tokens, _positions(tokens), attention))


def unembedding(config: Qwen3Config, params: Params) -> jax.Array:
    """[hidden, V] output projection (the tied embedding transposed when tied)."""
    return bind(config, params).unembedding()


def _page_metadata(k: jax.Array, schedule):
    """Keys [B, T, Hkv, D] -> per-page (centroid, kmin, kmax) [B, Hkv, P, D] float32 (None unless quest)."""
    b, t, hkv, d = k.shape
    s = schedule.page_size
    pages = -(-t // s)
    kp = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, pages * s - t), (0, 0), (0, 0)))
    kp = kp.reshape(b, pages, s, hkv, d).transpose(0, 3, 1, 2, 4)  # [B, Hkv, P, S, D]
    quest = schedule.selector == "quest"
    return kp.mean(axis=3), (kp.min(axis=3) if quest else None), (kp.max(axis=3) if quest else None)


def _check_reserved_last(schedule) -> None:
    if schedule.reserved_last < 1:
        raise ValueError("the sparse scorer needs reserved_last >= 1 (the current page is partial)")


def _select_chunk(start, q_chunk, metadata, budget_p, k_max: int, schedule, cpu_select: bool = False,
                  offset: int = 0):
    """Queries [B, C, H, D] at positions offset + start.. -> the sampler's selection (idx, valid)
    [B, Hkv, C, N]; ``budget_p``'s column 0 is position ``offset``. ``cpu_select``: the top-k by the
    C++ radix select, each query's pages in ascending order (the same sets as XLA's top-k)."""
    centroid, kmin, kmax = metadata
    b, c, hkv = q_chunk.shape[0], q_chunk.shape[1], centroid.shape[1]
    qg = group_mean_query(q_chunk, hkv).transpose(0, 2, 1, 3)  # [B, Hkv, C, D]
    scores = score_pages(qg, centroid, kmin, kmax, schedule.selector)
    q_pos = offset + start + jnp.arange(c)
    chunk_budget = jax.lax.dynamic_slice_in_dim(budget_p, start, c, axis=1)
    reserved = (schedule.reserved_first, schedule.reserved_last)
    if not cpu_select:
        return select_pages(scores, q_pos[None, None, :], chunk_budget[:, None, :], k_max, schedule.page_size,
                            *reserved)
    per_query = scores.transpose(0, 2, 1, 3).reshape(b * c, hkv, -1)  # each query a decode step's row
    idx, valid = select_pages_cpu(per_query, jnp.broadcast_to(q_pos, (b, c)).reshape(-1), chunk_budget.reshape(-1),
                                  k_max, schedule.page_size, *reserved, page_order=True)
    back = lambda x: x.reshape(b, c, hkv, -1).transpose(0, 2, 1, 3)
    return back(idx), back(valid)


def sparse_page_mask_fn(k: jax.Array, budget: jax.Array, k_max: int, schedule,
                        dense_before: Optional[jax.Array] = None):
    """Per-query allowed pages reproducing the sampler's selection in one teacher-forced pass
    (the reference attention's ``page_mask_fn``).

    k: [B, T, Hkv, D] keys of the layer (post RoPE); budget: int32 [B, T] top-k pages
    wanted at each query position; dense_before: int32 [B], queries at positions below it
    see every page (the sampler's prompt prefill is dense). Page metadata is recomputed from ``k``; candidate pages
    are complete before every query that may pick them (reserved_last >= 1), so their
    metadata equals what the sampler's cache held at that step.
    """
    _check_reserved_last(schedule)
    t = k.shape[1]
    pages = -(-t // schedule.page_size)
    metadata = _page_metadata(k, schedule)
    budget_p = jnp.pad(budget, ((0, 0), (0, t)))  # query chunks may run past T (padding)

    def page_mask(start, q_chunk):
        idx, valid = _select_chunk(start, q_chunk, metadata, budget_p, k_max, schedule)
        allowed = selected_page_mask(idx, valid, pages)
        if dense_before is not None:
            q_pos = start + jnp.arange(q_chunk.shape[1])
            allowed = allowed | (q_pos[None, :] < dense_before[:, None])[:, None, :, None]
        return allowed

    return page_mask


def sparse_page_selection(q: jax.Array, k: jax.Array, budget: jax.Array, k_max: int, schedule,
                          block: int = 256, cpu_select: bool = False,
                          queries_from: int = 0) -> tuple[jax.Array, jax.Array]:
    """The sampler's page selection for every query, a query block at a time (no gradient).

    q [B, T, H, D], k [B, T, Hkv, D] (post RoPE); budget int32 [B, T]. ``cpu_select``: top-k
    by :func:`sparrow_jax.attention.cpu_kernel.select_pages_cpu`, each query's page set in
    ascending order (XLA:CPU's sort-based top-k was ~10% of the quickstart's train step, and
    sorting the C++ top-k into XLA's slot order most of what was left). ``queries_from`` (static): queries
    below it select nothing (index 0, invalid), for a caller that does not read them.
    -> (page_idx int32, page_valid bool) [B, Hkv, T, N], as :func:`select_pages` returns them (in
    page order with ``cpu_select``).
    Same metadata and scores as :func:`sparse_page_mask_fn` (see there why they are exact).
    """
    _check_reserved_last(schedule)
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    b, t, h, d = q.shape
    if not 0 <= queries_from < t:
        raise ValueError(f"queries_from={queries_from} must be in [0, {t}) (T = {t} queries)")
    selected = t - queries_from
    block = min(block, selected)
    n = -(-selected // block)
    metadata = _page_metadata(k, schedule)
    budget_p = jnp.pad(budget[:, queries_from:], ((0, 0), (0, n * block - selected)))
    q_blocks = jnp.pad(q[:, queries_from:], ((0, 0), (0, n * block - selected), (0, 0), (0, 0)))
    q_blocks = q_blocks.reshape(b, n, block, h, d).swapaxes(0, 1)
    starts = jnp.arange(n, dtype=jnp.int32) * block  # within the selected queries
    select = lambda a: _select_chunk(a[0], a[1], metadata, budget_p, k_max, schedule, cpu_select,
                                     offset=queries_from)
    idx, valid = jax.lax.map(select, (starts, q_blocks))  # [n, B, Hkv, C, N]
    merge = lambda x: jnp.moveaxis(x, 0, 2).reshape(*x.shape[1:3], n * block, x.shape[-1])[:, :, :selected]
    front = lambda x: jnp.pad(x, ((0, 0), (0, 0), (queries_from, 0), (0, 0)))  # unselected: 0 / False
    return front(merge(idx)), front(merge(valid))


def sparse_hidden(config: Qwen3Config, params: Params, tokens: jax.Array, schedule,
                  k_max: Optional[int] = None, chunk: Optional[int] = None, remat: bool = False,
                  prompt_lens: Optional[jax.Array] = None, impl: str = "auto",
                  prefix_kv: Optional[PrefixKV] = None) -> jax.Array:
    """Teacher-forced hidden states under the sparse actor's attention. -> [B, L, hidden], or
    [B, L - S, hidden] (positions S..L-1) with ``prefix_kv``.

    Position t uses the pages the sparse sampler selects when decoding the token at t
    (budget ``schedule.topk_at(t)``, the top-k table may be traced); layers in
    ``schedule.dense_layers`` stay dense. ``k_max`` (static) defaults to ``schedule.k_max``.
    ``prompt_lens`` [B]: the sampler prefills ``prompt[:-1]`` densely, so positions below
    ``prompt_lens - 1`` attend to every page (needed once two or more layers are sparse).
    ``impl`` / ``chunk``: the whole-sequence attention's; every path but ``reference`` selects
    pages per query block and attends only the tiles holding selected pages.

    ``prefix_kv`` (:func:`dense_hidden_and_prefix_kv` of the same ``params``; no gradient): the
    keys and values of positions 0..S-1, S a multiple of 64 at most ``prompt_lens - 1``. Those
    positions are the densely prefilled prompt, the same under both attentions, so only positions
    S.. are computed: the prompt's share of the weights, attention and page selection is saved.
    """
    b, t = tokens.shape
    prefix = 0 if prefix_kv is None else prefix_kv[0][0].shape[1]
    positions = _positions(tokens)
    budget = jnp.broadcast_to(schedule.topk_at(positions), (b, t))
    if k_max is None:
        k_max = schedule.k_max
    model = bind(config, params)
    dense_layers = set(schedule.dense_layers)
    dense_before = None if prompt_lens is None else prompt_lens - 1

    def attention(layer, q, k, v):
        if prefix:  # queries from S on, keys from 0 (the prefix's from the dense pass)
            k, v = (jnp.concatenate([p.astype(x.dtype), x], axis=1) for p, x in zip(prefix_kv[layer], (k, v)))
            q = jnp.pad(q, ((0, 0), (prefix, 0), (0, 0), (0, 0)))
        if layer in dense_layers:
            out = whole_sequence_attention(q, k, v, impl=impl, chunk=chunk, queries_from=prefix)
            return out[:, prefix:]
        resolved = resolve_causal_impl(impl, dtype=q.dtype, head_dim=q.shape[-1], seq_len=t, paged=True,
                                       page_size=schedule.page_size)
        if resolved == "reference":
            mask_fn = sparse_page_mask_fn(jax.lax.stop_gradient(k), budget, k_max, schedule, dense_before)
            out = causal_attention(q, k, v, chunk=chunk or 256, page_mask_fn=mask_fn, page_size=schedule.page_size)
            return out[:, prefix:]
        idx, valid = sparse_page_selection(q, k, budget, k_max, schedule, cpu_select=resolved == "cpu",
                                           queries_from=prefix)
        out = whole_sequence_attention(q, k, v, impl=impl, page_idx=idx, page_valid=valid, page_size=schedule.page_size,
                                       dense_before=dense_before, chunk=chunk, queries_from=prefix)
        return out[:, prefix:]

    return model(tokens[:, prefix:], positions[:, prefix:], attention, remat=remat)


# ---- cache-based generation ---------------------------------------------------------

def init_caches(config: Qwen3Config, batch: int, max_len: int, page_size: int = 16,
                with_minmax: bool = False) -> tuple[PagedKVCache, ...]:
    """One empty paged cache per layer, in the compute dtype."""
    return tuple(init_cache(batch, config.num_key_value_heads, max_len, config.head_dim, page_size,
                            config.compute_dtype, with_minmax) for _ in range(config.num_hidden_layers))


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("chunk",), donate_argnums=(4,))
def prefill(config: Qwen3Config, params: Params, tokens: jax.Array, lengths: jax.Array,
            caches: Sequence[PagedKVCache], chunk: int = 256) -> tuple[PagedKVCache, ...]:
    """Write prompts (right-padded tokens [B, L], valid lengths [B]) into the caches.

    Returns the new caches; no logits (the last prompt token goes through
    :func:`decode_step` so every sampled token comes from one decode step).
    """
    model = bind(config, params)
    new_caches = list(caches)

    def attention(layer, q, k, v):
        new_caches[layer] = write_prefill(caches[layer], k, v, lengths)
        return causal_attention_prefill(q, k, v, chunk=chunk)

    model(tokens, _positions(tokens), attention)
    return tuple(new_caches)


def decode_step(config: Qwen3Config, params: Params, tokens: jax.Array, positions: jax.Array,
                caches: Sequence[PagedKVCache], schedule=None, k_max: int = 0,
                budget: Optional[jax.Array] = None, impl: str = "auto"):
    """One decode step. tokens, positions: int32 [B] -> (logits float32 [B, V], new caches).

    ``schedule=None`` is dense attention. Otherwise sparse layers select
    ``reserved + min(budget, k_max)`` pages per (row, KV head) with the schedule's selector;
    ``budget`` [B] defaults to ``schedule.topk_at(positions)``.
    """
    model = bind(config, params)
    new_caches = list(caches)
    dense_layers = set(schedule.dense_layers) if schedule is not None else set()
    if schedule is not None and budget is None:
        budget = schedule.topk_at(positions)

    def attention(layer, q, k, v):
        cache = append_token(caches[layer], k[:, 0], v[:, 0], positions)
        new_caches[layer] = cache
        q1 = q[:, 0]
        if schedule is None or layer in dense_layers:
            out = dense_decode_dispatch(q1, cache.k, cache.v, positions, impl=impl)
        else:
            qg = group_mean_query(q1, config.num_key_value_heads)
            idx, valid = score_select_decode(qg, cache.centroid, cache.kmin, cache.kmax, positions, budget, k_max,
                                             schedule.page_size, schedule.reserved_first, schedule.reserved_last,
                                             schedule.selector, impl=impl)
            out = sparse_decode(q1, cache.k, cache.v, idx, valid, positions, impl=impl)
        return out[:, None]

    hidden = model(tokens[:, None], positions[:, None], attention)
    return model.logits(hidden[:, 0]), tuple(new_caches)
