"""Paged cache, page selection, decode attention (dense / sparse) and the sparse scorer.

Every check is against an independent NumPy (float64) computation of the rule, or against
another implementation whose equality the method requires (sparse == dense at full budget,
teacher-forced sparse scorer == step-by-step sparse sampler). CPU, float32, tiny shapes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.attention import (append_token, dense_decode, group_mean_query, init_cache, page_metadata,
                                   resolve_impl, score_pages, select_pages, selected_page_mask, sparse_decode,
                                   write_prefill)
from sparrow_jax.attention.causal import causal_attention, causal_attention_prefill
from sparrow_jax.models.config import tiny_config
from sparrow_jax.models.forward import decode_step, dense_logits, init_caches, prefill, sparse_hidden
from sparrow_jax.models.forward import sparse_page_mask_fn
from sparrow_jax.models.qwen3 import bind, init_params
from sparrow_jax.rollout.schedule import SparsitySchedule

RNG = np.random.RandomState


# ============================================================ NumPy references (independent)
def np_select(scores, pos, budget, k_max, page_size, rf=1, rl=2):
    """The selection rule for one (row, head[, query]): a set of page indices.

    Reserved: first ``rf`` pages and the ``rl`` pages ending at the current page, never a
    page past the current one; candidates are the pages strictly between; the
    ``min(budget, k_max)`` highest-scoring candidates are added.
    """
    cur = int(pos) // page_size
    last = {cur - i for i in range(rl) if cur - i >= 0}
    first = {i for i in range(rf) if i <= cur}
    cands = [p for p in range(len(scores)) if rf <= p <= cur - rl]
    cands.sort(key=lambda p: -scores[p])
    return first | last | set(cands[:max(0, min(int(budget), k_max))])


def np_attend(q, k_pages, v_pages, pos, page_sets=None):
    """One-token attention in float64. q [B,H,D]; pages [B,Hkv,P,S,D]; page_sets[b][kvh] or None (all)."""
    b_, h_, d_ = q.shape
    _, hkv, p_, s_, _ = k_pages.shape
    g = h_ // hkv
    out = np.zeros((b_, h_, d_))
    for b in range(b_):
        for h in range(h_):
            kh = h // g
            keep = [p * s_ + s for p in range(p_) for s in range(s_)
                    if p * s_ + s <= pos[b] and (page_sets is None or p in page_sets[b][kh])]
            k = k_pages[b, kh].reshape(-1, d_)[keep].astype(np.float64)
            v = v_pages[b, kh].reshape(-1, d_)[keep].astype(np.float64)
            s = k @ q[b, h].astype(np.float64) / np.sqrt(d_)
            w = np.exp(s - s.max())
            out[b, h] = (w / w.sum()) @ v
    return out


def np_causal(q, k, v, allowed=None, page_size=1):
    """Naive causal attention. q [B,T,H,D], k/v [B,T,Hkv,D]; allowed [B,Hkv,T,P] bool or None."""
    b_, t_, h_, d_ = q.shape
    g = h_ // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(b_):
        for h in range(h_):
            kh = h // g
            s = q[b, :, h].astype(np.float64) @ k[b, :, kh].astype(np.float64).T / np.sqrt(d_)
            mask = np.tril(np.ones((t_, t_), bool))
            if allowed is not None:
                mask &= allowed[b, kh][:, np.arange(t_) // page_size]
            s = np.where(mask, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, h] = (w / w.sum(-1, keepdims=True)) @ v[b, :, kh].astype(np.float64)
    return out


def valid_sets(idx, valid):
    """[..., N] selection -> array (object) of sets of valid pages; asserts no valid duplicates."""
    idx, valid = np.asarray(idx), np.asarray(valid)
    assert np.all(idx[~valid] == 0), "invalid slots must point at page 0"
    out = np.empty(idx.shape[:-1], object)
    for ix in np.ndindex(*idx.shape[:-1]):
        pages = idx[ix][valid[ix]].tolist()
        assert len(pages) == len(set(pages)), f"duplicate page at {ix}: {pages}"
        out[ix] = set(pages)
    return out


# ============================================================ jitted functions (one per shape)
@pytest.fixture(scope="module")
def jit_select():
    return jax.jit(select_pages, static_argnames=("k_max", "page_size", "reserved_first", "reserved_last"))


SPARSE_IMPLS = ("reference", "xla", "pallas_tpu", "pallas_gpu")
_KERNEL_EXPORTS = {"pallas_tpu": "sparse_decode_tpu", "pallas_gpu": "sparse_decode_gpu"}


@pytest.fixture(scope="module")
def decode_fns():
    """'dense' and each sparse impl -> jitted function (one executable per shape), built on first use."""
    fns = {"dense": jax.jit(dense_decode)}

    def get(impl):
        if impl in _KERNEL_EXPORTS:  # another module; skip (visibly) while it is absent
            kernels = pytest.importorskip("pallas_kernels")
            if not hasattr(kernels, _KERNEL_EXPORTS[impl]):
                pytest.skip(f"pallas_kernels does not export {_KERNEL_EXPORTS[impl]}")
        if impl not in fns:
            fns[impl] = jax.jit(functools.partial(sparse_decode, impl=impl))
        return fns[impl]

    return get


# ============================================================ 1. decode attention
B1, HKV1, P1, S1, D1 = 3, 2, 7, 4, 16
POS1 = np.array([0, 13, 27])  # ragged: first token, mid-page, last slot of the cache
K_MAX1 = 4  # = the most candidates any row has (P - 3): one k_max, one compile per GQA ratio


def _decode_inputs(groups, seed):
    r = RNG(seed)
    q = r.randn(B1, HKV1 * groups, D1).astype(np.float32)
    # Garbage everywhere past each row's position: masking must hide it.
    k = (2.0 * r.randn(B1, HKV1, P1, S1, D1)).astype(np.float32)
    v = r.randn(B1, HKV1, P1, S1, D1).astype(np.float32)
    scores = r.randn(B1, HKV1, P1).astype(np.float32)
    return q, k, v, scores


@pytest.mark.parametrize("impl", SPARSE_IMPLS)
@pytest.mark.parametrize("groups", [1, 4])
def test_full_budget_sparse_equals_dense(decode_fns, jit_select, groups, impl):
    sparse = decode_fns(impl)
    q, k, v, scores = _decode_inputs(groups, seed=groups)
    pos = jnp.asarray(POS1)
    idx, valid = jit_select(jnp.asarray(scores), pos[:, None], jnp.full((B1, 1), K_MAX1), k_max=K_MAX1,
                            page_size=S1)
    sets = valid_sets(idx, valid)
    for b in range(B1):  # full budget selects exactly pages 0..current
        assert all(s == set(range(POS1[b] // S1 + 1)) for s in sets[b])
    dense = np.asarray(decode_fns("dense")(q, k, v, pos))
    np.testing.assert_allclose(dense, np_attend(q, k, v, POS1), atol=1e-5)
    out = np.asarray(sparse(q, k, v, idx, valid, pos))
    err = np.abs(out - dense).max()
    assert err <= 1e-6, f"{impl}: full-budget sparse differs from dense by {err}"


@pytest.mark.parametrize("impl", SPARSE_IMPLS)
@pytest.mark.parametrize("groups", [1, 4])
def test_small_budget_matches_reference(decode_fns, jit_select, groups, impl):
    sparse = decode_fns(impl)
    q, k, v, scores = _decode_inputs(groups, seed=10 + groups)
    pos = jnp.asarray(POS1)
    for budget in ([0, 0, 0], [1, 2, 3], [3, 1, 2]):
        idx, valid = jit_select(jnp.asarray(scores), pos[:, None], jnp.asarray(budget)[:, None],
                                k_max=K_MAX1, page_size=S1)
        ref = np.asarray(decode_fns("reference")(q, k, v, idx, valid, pos))
        np.testing.assert_allclose(ref, np_attend(q, k, v, POS1, valid_sets(idx, valid)), atol=1e-5,
                                   err_msg=f"reference vs numpy, budget {budget}")
        out = np.asarray(sparse(q, k, v, idx, valid, pos))
        err = np.abs(out - ref).max()
        assert err <= 1e-5, f"{impl} vs reference, budget {budget}: {err}"
    # The last row drops pages there, so the comparison above is not a dense-vs-dense one.
    dense = np.asarray(decode_fns("dense")(q, k, v, pos))
    assert np.abs(out[2] - dense[2]).max() > 1e-2


def test_resolve_impl(monkeypatch):
    from sparrow_jax.attention import cpu_kernel

    backend = jax.default_backend()
    on_cpu = "cpu" if cpu_kernel.cpu_kernel_available() else "xla"
    assert resolve_impl("auto") == {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(backend, on_cpu)
    assert resolve_impl("xla") == "xla"
    if backend == "cpu":  # no compiler / failed build: auto falls back to the XLA path
        monkeypatch.setattr(cpu_kernel, "cpu_kernel_available", lambda: False)
        assert resolve_impl("auto") == "xla"
    with pytest.raises(ValueError, match="unknown sparse attention implementation 'flash'"):
        resolve_impl("flash")


# ============================================================ 2. selection
S2, P2 = 4, 8


def _select(jit_select, scores, pos, budget, k_max, rf=1, rl=2):
    idx, valid = jit_select(jnp.asarray(scores, jnp.float32), jnp.asarray(pos), jnp.asarray(budget),
                            k_max=k_max, page_size=S2, reserved_first=rf, reserved_last=rl)
    return valid_sets(idx, valid)


def test_select_hand_made_scores(jit_select):
    # Reserved pages and pages past the current one score highest: they must not take top-k slots.
    s = np.array([100., 4., 1., 5., 2., 3., 99., 98.])
    rows = [  # (position, budget, expected pages)
        (29, 2, {0, 7, 6, 3, 1}),   # cur 7: last {7, 6}, candidates 1..5, best two 3 (5.) and 1 (4.)
        (29, 0, {0, 7, 6}),         # budget 0: reserved only
        (29, 3, {0, 7, 6, 3, 1, 5}),
        (17, 3, {0, 4, 3, 1, 2}),   # cur 4: candidates 1, 2 (budget > candidates)
        (13, 3, {0, 3, 2, 1}),      # cur 3: page 1 is the only candidate; 6, 7 (99, 98) are future pages
        (9, 3, {0, 2, 1}),          # cur 2: first and last pages touch, no candidate
        (5, 3, {1, 0}),             # cur 1: first page is also a last page (deduplicated)
        (0, 3, {0}),                # cur 0: one page, once
    ]
    scores = np.tile(s, (len(rows), 1))
    pos = np.array([r[0] for r in rows])
    budget = np.array([r[1] for r in rows])
    got = _select(jit_select, scores, pos, budget, k_max=3)
    for (p, bud, want), g in zip(rows, got):
        assert g == want, f"position {p}, budget {bud}: got {sorted(g)}, want {sorted(want)}"
        assert g == np_select(s, p, bud, 3, S2)


def test_select_budget_clipped_to_k_max_and_k_max_beyond_pages(jit_select):
    s = np.array([0., 4., 1., 5., 2., 3., 0., 0.])
    got = _select(jit_select, s[None], np.array([29]), np.array([4]), k_max=2)
    assert got[0] == {0, 7, 6, 3, 1}  # budget 4 clipped to k_max 2
    got = _select(jit_select, s[None], np.array([29]), np.array([20]), k_max=20)  # k_max > pages
    assert got[0] == set(range(8))
    got = _select(jit_select, s[None], np.array([29]), np.array([5]), k_max=0)
    assert got[0] == {0, 6, 7}


@pytest.mark.parametrize("rf, rl", [(1, 2), (2, 1), (0, 2), (3, 0)])
def test_select_per_row_budgets_match_numpy(jit_select, rf, rl):
    r = RNG(rf * 10 + rl)
    b, hkv, k_max = 6, 2, 3
    scores = r.randn(b, hkv, P2).astype(np.float32)
    pos = np.array([0, 5, 9, 17, 29, 31])
    budget = np.array([3, 0, 2, 5, 1, 3])  # per row: 0, within k_max, beyond k_max
    got = _select(jit_select, scores, pos[:, None], budget[:, None], k_max=k_max, rf=rf, rl=rl)
    for i in range(b):
        for h in range(hkv):
            want = np_select(scores[i, h], pos[i], budget[i], k_max, S2, rf, rl)
            assert got[i, h] == want, f"row {i} head {h}: got {sorted(got[i, h])}, want {sorted(want)}"


def test_select_with_query_axis_matches_numpy(jit_select):
    r = RNG(7)
    b, hkv, t, k_max = 2, 2, P2 * S2, 2
    scores = r.randn(b, hkv, t, P2).astype(np.float32)
    pos = np.broadcast_to(np.arange(t), (b, 1, t))
    budget = r.randint(0, 4, (b, 1, t))  # differs per row and per query
    got = _select(jit_select, scores, pos, budget, k_max=k_max)
    for ix in np.ndindex(b, hkv, t):
        want = np_select(scores[ix], ix[2], budget[ix[0], 0, ix[2]], k_max, S2)
        assert got[ix] == want, f"{ix}: got {sorted(got[ix])}, want {sorted(want)}"


def test_selected_page_mask():
    idx = jnp.array([[0, 3, 0, 5], [2, 0, 1, 0]])
    valid = jnp.array([[True, True, False, True], [True, True, True, False]])
    mask = np.asarray(selected_page_mask(idx, valid, 6))
    want = np.zeros((2, 6), bool)
    want[0, [0, 3, 5]] = True
    want[1, [0, 1, 2]] = True
    np.testing.assert_array_equal(mask, want)


# ============================================================ 3. incremental metadata
def test_incremental_metadata_matches_recomputed():
    r = RNG(3)
    b, hkv, d, s, max_len, prompt = 3, 2, 8, 4, 40, 7
    lengths = np.array([3, 7, 0])  # ragged prompt; row 2 starts empty
    steps = 25  # every row crosses several page boundaries
    cache = init_cache(b, hkv, max_len, d, page_size=s, with_minmax=True)
    kp = r.randn(b, prompt, hkv, d).astype(np.float32) + 0.5
    vp = r.randn(b, prompt, hkv, d).astype(np.float32)
    cache = jax.jit(write_prefill)(cache, kp, vp, jnp.asarray(lengths))
    keys = np.zeros((b, max_len, hkv, d), np.float32)  # the tokens each row holds, by position
    vals = np.zeros((b, max_len, hkv, d), np.float32)
    for i in range(b):
        keys[i, :lengths[i]], vals[i, :lengths[i]] = kp[i, :lengths[i]], vp[i, :lengths[i]]
    append = jax.jit(append_token)
    for t in range(steps):
        pos = lengths + t
        kt = (r.randn(b, hkv, d) * (1 + t % 3)).astype(np.float32)
        vt = r.randn(b, hkv, d).astype(np.float32)
        cache = append(cache, kt, vt, jnp.asarray(pos, jnp.int32))
        keys[np.arange(b), pos], vals[np.arange(b), pos] = kt, vt
    final = lengths + steps
    c_ref, mn_ref, mx_ref = page_metadata(cache.k, jnp.asarray(final), True)
    cache_k = np.asarray(cache.k)
    for i in range(b):
        n = final[i]
        np.testing.assert_array_equal(  # [Hkv, P, S, D] -> tokens in position order
            cache_k[i].transpose(1, 2, 0, 3).reshape(-1, hkv, d)[:n], keys[i, :n])
        np.testing.assert_array_equal(np.asarray(cache.v[i]).transpose(1, 2, 0, 3).reshape(-1, hkv, d)[:n],
                                      vals[i, :n])
        for p in range(-(-n // s)):
            tok = keys[i, p * s:min(n, (p + 1) * s)].astype(np.float64)  # [n_p, Hkv, D]
            for name, got, rec, want in (("centroid", cache.centroid, c_ref, tok.mean(0)),
                                         ("kmin", cache.kmin, mn_ref, tok.min(0)),
                                         ("kmax", cache.kmax, mx_ref, tok.max(0))):
                got_p = np.asarray(got[i, :, p])
                assert np.abs(got_p - np.asarray(rec[i, :, p])).max() <= 1e-5, f"{name} row {i} page {p}"
                assert np.abs(got_p - want).max() <= 1e-5, f"{name} row {i} page {p} vs numpy"


def test_write_prefill_rejects_overflow():
    cache = init_cache(1, 1, 8, 4, page_size=4)
    with pytest.raises(ValueError, match="prefill of 9 tokens exceeds the cache capacity 8"):
        write_prefill(cache, jnp.zeros((1, 9, 1, 4)), jnp.zeros((1, 9, 1, 4)), jnp.array([9]))
    with pytest.raises(ValueError, match="page_size must be positive"):
        init_cache(1, 1, 8, 4, page_size=0)


# ============================================================ 4. scoring
def test_group_mean_query_and_scores_match_numpy():
    r = RNG(4)
    b, hkv, g, p, d = 2, 2, 3, 5, 8
    q = r.randn(b, hkv * g, d).astype(np.float32)
    qg = np.asarray(group_mean_query(jnp.asarray(q), hkv))
    np.testing.assert_allclose(qg, q.reshape(b, hkv, g, d).mean(2), atol=1e-6)
    cen = r.randn(b, hkv, p, d).astype(np.float32)
    lo = r.randn(b, hkv, p, d).astype(np.float32)
    hi = lo + np.abs(r.randn(b, hkv, p, d)).astype(np.float32)
    want_c = np.einsum("bhd,bhpd->bhp", qg.astype(np.float64), cen)
    want_q = np.zeros((b, hkv, p))
    for ix in np.ndindex(b, hkv, p):
        qq = qg[ix[:2]].astype(np.float64)
        want_q[ix] = sum(max(qq[j] * lo[ix][j], qq[j] * hi[ix][j]) for j in range(d))
    got_c = np.asarray(score_pages(jnp.asarray(qg), jnp.asarray(cen), selector="centroid"))
    got_q = np.asarray(score_pages(jnp.asarray(qg), jnp.asarray(cen), jnp.asarray(lo), jnp.asarray(hi),
                                   selector="quest"))
    np.testing.assert_allclose(got_c, want_c, atol=1e-5)
    np.testing.assert_allclose(got_q, want_q, atol=1e-5)
    # Several queries at once ([B, Hkv, Q, D], the teacher-forced scorer's form) score each alone.
    qs = jnp.asarray(r.randn(b, hkv, 3, d).astype(np.float32))
    for selector, meta in (("centroid", ()), ("quest", (jnp.asarray(lo), jnp.asarray(hi)))):
        many = np.asarray(score_pages(qs, jnp.asarray(cen), *meta, selector=selector))
        assert many.shape == (b, hkv, 3, p)
        for i in range(3):
            np.testing.assert_allclose(many[:, :, i], score_pages(qs[:, :, i], jnp.asarray(cen), *meta,
                                                                  selector=selector), atol=1e-5)
    # Quest is an upper bound on q . k for every key inside [kmin, kmax].
    inside = lo + (hi - lo) * r.rand(b, hkv, p, d)
    assert np.all(np.einsum("bhd,bhpd->bhp", qg, inside) <= got_q + 1e-5)


def test_score_pages_errors():
    qg, meta = jnp.zeros((1, 1, 4)), jnp.zeros((1, 1, 2, 4))
    with pytest.raises(ValueError, match="with_minmax=True"):
        score_pages(qg, meta, selector="quest")
    with pytest.raises(ValueError, match="unknown page selector 'lsh'"):
        score_pages(qg, meta, meta, meta, selector="lsh")


# ============================================================ model fixtures (5, 6)
PAGE, BIN = 4, 16
# topk[0] = 0 makes bin 0 sparse already (page 1 dropped at positions 12..15).
SCHEDULE = SparsitySchedule(topk=(0, 2), bin_width=BIN, page_size=PAGE, dense_layers=(0,))
K_MAX = 2


def _sharpen(params, factor):
    """Scale the q/k norm weights so attention is peaked and dropped pages change the logits."""
    def f(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return x * factor if ("q_norm" in name or "k_norm" in name) else x
    return jax.tree_util.tree_map_with_path(f, params)


@pytest.fixture(scope="module")
def model():
    config = tiny_config()
    return config, _sharpen(init_params(config, seed=5), 3.0)


# ============================================================ 5. compile count
def test_decode_step_compiles_once_for_any_budget(model):
    config, params = model
    traces = []

    def step(params, tokens, positions, caches, budget):
        traces.append(1)  # runs only while tracing
        return decode_step(config, params, tokens, positions, caches, SCHEDULE, k_max=3, budget=budget,
                           impl="xla")

    jitted = jax.jit(step)
    b = 2
    caches = prefill(config, params, jnp.asarray(RNG(0).randint(0, config.vocab_size, (b, 30))),
                     jnp.array([30, 25]), init_caches(config, b, 36, page_size=PAGE))
    tokens, pos = jnp.array([3, 4]), jnp.array([30, 25])
    outs = {}
    for budget in ([0, 3], [1, 2], [3, 3], [2, 0], [0, 0], [5, 9]):
        outs[tuple(budget)], _ = jitted(params, tokens, pos, caches, jnp.asarray(budget, jnp.int32))
    jitted(params, tokens + 1, pos + 1, caches, jnp.array([1, 1], jnp.int32))  # new positions, same shapes
    assert len(traces) == 1 and jitted._cache_size() == 1
    # The budget is live (not baked in at trace time), and budgets beyond k_max clip to it.
    assert np.abs(np.asarray(outs[(0, 0)] - outs[(3, 3)])).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(outs[(5, 9)]), np.asarray(outs[(3, 3)]))
    np.testing.assert_allclose(np.asarray(outs[(0, 3)][0]), np.asarray(outs[(0, 0)][0]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(outs[(0, 3)][1]), np.asarray(outs[(3, 3)][1]), atol=1e-6)


# ============================================================ 6. sparse scorer == sparse sampler
T6 = 36
LENGTHS6 = np.array([5, 11])  # cached prompt tokens per row (ragged); decode feeds the rest
PREFILL_BLOCK = 20  # one prefill shape for every prompt-length mix (lengths <= block)


@functools.lru_cache(maxsize=None)
def _scorer_and_step(config, schedule):
    """Jitted teacher-forced sparse logits and one sparse decode step, built once per (config, schedule)."""
    scorer = jax.jit(lambda p, x, plen: bind(config, p).logits(
        sparse_hidden(config, p, x, schedule, k_max=K_MAX, chunk=16, prompt_lens=plen)))
    step = jax.jit(lambda p, x, pos, c: decode_step(config, p, x, pos, c, schedule, k_max=K_MAX, impl="xla"))
    return scorer, step


def _scorer_vs_sampler(config, params, schedule, tokens, lengths, with_minmax):
    """(sparse_hidden logits at the decoded positions, decode_step logits, dense logits there).

    Mirrors the sampler: ``lengths[b]`` prompt tokens go through a dense prefill, then every
    later token is fed (teacher-forced) by one sparse decode step.
    """
    b, t = tokens.shape
    scorer, step = _scorer_and_step(config, schedule)
    # The sampler's prompt_len is cached tokens + 1 (its last prompt token is decoded).
    full = np.asarray(scorer(params, tokens, jnp.asarray(lengths + 1, jnp.int32)))
    dense = np.asarray(dense_logits(config, params, tokens))
    caches = init_caches(config, b, t, page_size=PAGE, with_minmax=with_minmax)
    caches = prefill(config, params, tokens[:, :PREFILL_BLOCK], jnp.asarray(lengths), caches)
    rows = np.arange(b)
    got, want, dense_at = [], [], []
    for i in range(t - int(lengths.max())):
        pos = lengths + i
        logits, caches = step(params, tokens[rows, pos], jnp.asarray(pos, jnp.int32), caches)
        got.append(np.asarray(logits))
        want.append(full[rows, pos])
        dense_at.append(dense[rows, pos])
    return np.stack(want), np.stack(got), np.stack(dense_at)


@pytest.mark.parametrize("selector", ["centroid", "quest"])
def test_sparse_scorer_equals_step_by_step_sparse_decode(model, selector):
    config, params = model
    schedule = SCHEDULE if selector == "centroid" else SparsitySchedule(
        topk=SCHEDULE.topk, bin_width=BIN, page_size=PAGE, dense_layers=(0,), selector="quest")
    tokens = jnp.asarray(RNG(6).randint(0, config.vocab_size, (2, T6)))
    scorer, sampler, dense = _scorer_vs_sampler(config, params, schedule, tokens, LENGTHS6, selector == "quest")
    err = np.abs(scorer - sampler).max()
    assert err <= 1e-4, f"{selector}: sparse scorer vs sparse decode max |diff| {err}"
    # Selection really drops pages here, so a scorer that ignored it would fail the check above.
    assert np.abs(sampler - dense).max() > 100 * 1e-4


@pytest.fixture(scope="module")
def model3():
    config = tiny_config(num_hidden_layers=3)  # layers 1 and 2 sparse
    return config, _sharpen(init_params(config, seed=5), 3.0)


def test_sparse_scorer_two_sparse_layers_short_prompt(model3):
    # Control for the long-prompt case below: prompts of 5 and 11 tokens lie where the selection keeps
    # every page (positions < 12), so the dense prefill and the sparse scorer agree there.
    config, params = model3
    tokens = jnp.asarray(RNG(8).randint(0, config.vocab_size, (2, 28)))
    scorer, sampler, dense = _scorer_vs_sampler(config, params, SCHEDULE, tokens, np.array([5, 11]), False)
    assert np.abs(scorer - sampler).max() <= 1e-4
    assert np.abs(sampler - dense).max() > 100 * 1e-4


def test_sparse_scorer_matches_sampler_with_long_prompt_and_two_sparse_layers(model3):
    config, params = model3
    tokens = jnp.asarray(RNG(8).randint(0, config.vocab_size, (2, 28)))
    # Prompts of 16 and 20 tokens: positions 12..15 (bin 0, top-k 0) are sparse inside the prompt.
    scorer, sampler, _ = _scorer_vs_sampler(config, params, SCHEDULE, tokens, np.array([16, 20]), False)
    assert np.abs(scorer - sampler).max() <= 1e-4  # ~0.26 before prompt_lens kept the prompt dense


def test_sparse_page_mask_fn_needs_a_complete_candidate_page():
    with pytest.raises(ValueError, match="reserved_last >= 1"):
        sparse_page_mask_fn(jnp.zeros((1, 8, 1, 4)), jnp.zeros((1, 8), jnp.int32), 1,
                            SparsitySchedule(topk=(1,), page_size=4, reserved_last=0))


# ============================================================ 7. chunked causal attention
@pytest.fixture(scope="module")
def causal_inputs():
    r = RNG(9)
    b, t, hkv, g, d = 2, 13, 2, 2, 8  # GQA 2; chunk 5 does not divide 13
    q = r.randn(b, t, hkv * g, d).astype(np.float32)
    k = r.randn(b, t, hkv, d).astype(np.float32)
    v = r.randn(b, t, hkv, d).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("chunk", [5, 64])  # 64 > T: one chunk (clamped to T)
def test_causal_attention_matches_naive(causal_inputs, chunk):
    q, k, v = causal_inputs
    want = np_causal(q, k, v)
    got = np.asarray(jax.jit(functools.partial(causal_attention, chunk=chunk))(q, k, v))
    np.testing.assert_allclose(got, want, atol=1e-5)
    got = np.asarray(jax.jit(functools.partial(causal_attention_prefill, chunk=chunk))(q, k, v))
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_causal_attention_with_page_mask_matches_naive(causal_inputs):
    q, k, v = causal_inputs
    b, t, _, _ = q.shape
    hkv, page = k.shape[2], 3
    pages = -(-t // page)
    r = RNG(10)
    allowed = r.rand(b, hkv, t + 5, pages) < 0.5  # padded past T: chunk 5 runs to 15
    allowed[..., 0] = True  # key 0 always visible, so every query attends something
    allowed_j = jnp.asarray(allowed)

    def mask_fn(start, q_chunk):
        return jax.lax.dynamic_slice_in_dim(allowed_j, start, q_chunk.shape[1], axis=2)

    got = np.asarray(jax.jit(lambda q, k, v: causal_attention(q, k, v, chunk=5, page_mask_fn=mask_fn,
                                                             page_size=page))(q, k, v))
    np.testing.assert_allclose(got, np_causal(q, k, v, allowed[:, :, :t], page), atol=1e-5)
