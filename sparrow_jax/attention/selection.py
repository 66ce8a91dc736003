"""Page scoring and block top-k page selection (Sparrow / Quest selectors).

Selection is per (row, KV head). For a token at absolute position ``pos`` the current page
is ``pos // S``. Always kept: the first ``reserved_first`` pages and the last
``reserved_last`` pages (the current, partial page and those just before it). Candidates
are the pages strictly between them; all are complete, so their metadata is final and a
teacher-forced pass can reproduce the selection exactly. The ``budget`` best candidates
are kept (``budget`` may differ per row and change each step; ``k_max`` is static).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

SELECTORS = ("centroid", "quest")


def group_mean_query(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """q: [..., H, D] -> mean over each GQA group [..., Hkv, D] (float32)."""
    *lead, heads, dim = q.shape
    return q.astype(jnp.float32).reshape(*lead, num_kv_heads, heads // num_kv_heads, dim).mean(-2)


def score_pages(qg: jax.Array, centroid: jax.Array, kmin=None, kmax=None,
                selector: str = "centroid") -> jax.Array:
    """Page scores from group-mean queries.

    qg: [B, Hkv, D] (decode) or [B, Hkv, Q, D] (Q queries, teacher forcing); metadata
    [B, Hkv, P, D]. Returns [B, Hkv, P] or [B, Hkv, Q, P] float32.
    centroid: ``qg . centroid``; quest: ``sum_d max(qg_d * kmin_d, qg_d * kmax_d)``, computed as
    ``max(qg, 0) . kmax + min(qg, 0) . kmin`` (kmin <= kmax: the same product per term, summed
    in another order), two matrix products instead of a [Q, P, D] elementwise pass.
    """
    if selector not in SELECTORS:
        raise ValueError(f"unknown page selector {selector!r}; expected one of {SELECTORS}")
    if selector == "quest" and kmin is None:
        raise ValueError("quest selector needs a cache built with with_minmax=True")
    one_query = qg.ndim == 3
    q4 = qg[:, :, None] if one_query else qg  # [B, Hkv, Q, D]
    dot = lambda a, b: jnp.einsum("bhqd,bhpd->bhqp", a, b)
    if selector == "centroid":
        scores = dot(q4, centroid)
    else:
        scores = dot(jnp.maximum(q4, 0.0), kmax) + dot(jnp.minimum(q4, 0.0), kmin)
    return scores[:, :, 0] if one_query else scores


def select_pages(scores: jax.Array, positions: jax.Array, budget: jax.Array, k_max: int,
                 page_size: int, reserved_first: int = 1, reserved_last: int = 2):
    """Block top-k selection with reserved pages.

    Args:
      scores: [..., P] float32 page scores (leading dims e.g. [B, Hkv] or [B, Hkv, T]).
      positions: absolute position of the querying token, broadcastable (numpy rules, trailing
        alignment) to scores[..., 0]: e.g. [B, 1] for [B, Hkv] scores, [B, 1, T] for [B, Hkv, T].
      budget: top-k pages wanted (excluding reserved ones), broadcastable likewise; clipped to k_max.
      k_max: static number of top-k slots (capped at the number of pages).
    Returns:
      page_idx: [..., N] int32 with N = reserved_first + min(k_max, P) + reserved_last,
      page_valid: [..., N] bool. Invalid slots point at page 0. No page appears twice
      among valid slots; pages past the token's own page are never selected.
    """
    num_pages = scores.shape[-1]
    lead = scores.shape[:-1]
    k_max = min(k_max, num_pages)  # a budget beyond the cache selects every candidate
    cur = jnp.broadcast_to(positions // page_size, lead).astype(jnp.int32)[..., None]
    budget = jnp.broadcast_to(jnp.minimum(budget, k_max), lead)[..., None]
    first = jnp.arange(reserved_first, dtype=jnp.int32)
    first_valid = first <= cur - reserved_last  # not also one of the last pages
    last = cur - jnp.arange(reserved_last, dtype=jnp.int32)
    last_valid = last >= 0
    page = jnp.arange(num_pages, dtype=jnp.int32)
    candidate = (page >= reserved_first) & (page <= cur - reserved_last)
    num_candidates = jnp.sum(candidate, axis=-1, keepdims=True)
    if k_max > 0:
        masked = jnp.where(candidate, scores, -jnp.inf)
        _, top_idx = jax.lax.top_k(masked, k_max)
        top_valid = jnp.arange(k_max) < jnp.minimum(budget, num_candidates)
    else:
        top_idx = jnp.zeros((*lead, 0), jnp.int32)
        top_valid = jnp.zeros((*lead, 0), bool)
    idx = jnp.concatenate([jnp.broadcast_to(first, (*lead, reserved_first)),
                           top_idx.astype(jnp.int32), last], axis=-1)
    valid = jnp.concatenate([jnp.broadcast_to(first_valid, (*lead, reserved_first)),
                             top_valid, last_valid], axis=-1)
    return jnp.where(valid, idx, 0), valid
