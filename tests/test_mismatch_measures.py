"""Tests for sparrow_jax.mismatch.measures and sparrow_jax.mismatch.tail.

References are independent float64 numpy computations (and numpy.percentile).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.mismatch import measures as M
from sparrow_jax.mismatch import tail as T

NEG = -np.inf


# ----------------------------------------------------------------------- numpy references
def np_logsoftmax(z):
    z = np.asarray(z, np.float64)
    m = np.max(z, axis=-1, keepdims=True)
    e = np.exp(z - m)
    return z - m - np.log(np.sum(e, axis=-1, keepdims=True))


def np_measures(zp, zq):
    lp, lq = np_logsoftmax(zp), np_logsoftmax(zq)
    p, q = np.exp(lp), np.exp(lq)
    alpha = np.sum(np.minimum(p, q), axis=-1)
    tv = 0.5 * np.sum(np.abs(p - q), axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (lp - lq), 0.0)
        # q = 0 < p  ->  +inf (lp finite, lq -inf)
        terms = np.where((lp > -np.inf) & (lq == -np.inf), np.inf, terms)
        ent = -np.sum(np.where(p > 0, p * lp, 0.0), axis=-1)
    return alpha, tv, np.sum(terms, axis=-1), ent


def np_topk_alpha(zp, zq, k):
    """Loop reference: sum over topk(p) ∩ topk(q) of min(p, q)."""
    lp, lq = np_logsoftmax(zp), np_logsoftmax(zq)
    flat_p, flat_q = lp.reshape(-1, lp.shape[-1]), lq.reshape(-1, lq.shape[-1])
    out = []
    for a, b in zip(flat_p, flat_q):
        sp = set(np.argsort(-a, kind="stable")[:k].tolist())
        sq = set(np.argsort(-b, kind="stable")[:k].tolist())
        out.append(sum(min(math.exp(a[x]), math.exp(b[x])) for x in sp & sq))
    return np.asarray(out).reshape(lp.shape[:-1])


def rng(seed=0):
    return np.random.default_rng(seed)


def random_pair(r, shape, scale=2.0, noise=0.5):
    zp = (scale * r.normal(size=shape)).astype(np.float32)
    zq = (zp + noise * r.normal(size=shape)).astype(np.float32)
    return zp, zq


def adversarial_pairs():
    r = rng(1)
    V = 41
    cases = {}
    zp, zq = random_pair(r, (4, V))
    cases["peaked"] = (zp * 300.0, zq * 300.0)                       # near one-hot
    cases["huge_mag"] = ((1e4 * r.normal(size=(4, V))).astype(np.float32),
                         (1e4 * r.normal(size=(4, V))).astype(np.float32))
    base = (1e4 + r.normal(size=(4, V))).astype(np.float32)            # big offset, O(1) spread
    cases["huge_offset"] = (base, (base + 0.3 * r.normal(size=(4, V))).astype(np.float32))
    zp, zq = random_pair(r, (4, V))
    mp, mq = r.random((4, V)) < 0.4, r.random((4, V)) < 0.4
    mp[:, 0] = mq[:, 0] = False                                       # each row keeps support
    cases["neg_inf"] = (np.where(mp, NEG, zp).astype(np.float32), np.where(mq, NEG, zq).astype(np.float32))
    return cases


# ------------------------------------------------------------------------ measures: exact
@pytest.mark.parametrize("shape,scale", [((3, 5, 37), 1.0), ((2, 64), 4.0), ((7,), 0.1)])
def test_measures_match_float64_numpy_random(shape, scale):
    zp, zq = random_pair(rng(shape[0]), shape, scale=scale, noise=scale)
    alpha, tv, kl, _ = np_measures(zp, zq)
    np.testing.assert_allclose(M.acceptance_rate(zp, zq), alpha, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(M.total_variation(zp, zq), tv, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(M.kl_divergence(zp, zq), kl, atol=2e-6, rtol=1e-5)
    # alpha = 1 - TV, both computed independently
    np.testing.assert_allclose(M.acceptance_rate(zp, zq) + M.total_variation(zp, zq), 1.0, atol=2e-6)
    assert M.acceptance_rate(zp, zq).shape == shape[:-1]
    assert M.acceptance_rate(zp, zq).dtype == jnp.float32


@pytest.mark.parametrize("case", ["peaked", "huge_mag", "huge_offset", "neg_inf"])
def test_measures_match_float64_numpy_adversarial(case):
    zp, zq = adversarial_pairs()[case]
    alpha, tv, kl, _ = np_measures(zp, zq)
    a = np.asarray(M.acceptance_rate(zp, zq))
    assert np.all(np.isfinite(a)) and np.all((a >= 0) & (a <= 1))
    np.testing.assert_allclose(a, alpha, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(M.total_variation(zp, zq), tv, atol=2e-6, rtol=1e-5)
    got_kl = np.asarray(M.kl_divergence(zp, zq))
    np.testing.assert_array_equal(np.isinf(got_kl), np.isinf(kl))
    fin = np.isfinite(kl)
    np.testing.assert_allclose(got_kl[fin], kl[fin], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", ["random", "peaked", "huge_mag", "huge_offset", "neg_inf"])
def test_identical_distributions(case):
    z = random_pair(rng(2), (5, 33))[0] if case == "random" else adversarial_pairs()[case][0]
    a = np.asarray(M.acceptance_rate(z, z))
    assert np.all(a >= 1 - 1e-6) and np.all(a <= 1.0)
    assert np.all(np.asarray(M.total_variation(z, z)) <= 1e-6)
    assert np.all(np.asarray(M.kl_divergence(z, z)) <= 1e-6)
    assert np.all(np.asarray(M.topk_acceptance_rate(z, z, k=z.shape[-1])) >= 1 - 1e-6)


def test_disjoint_supports():
    zp = np.array([[0.0, 1.0, NEG, NEG], [5.0, NEG, NEG, NEG]], np.float32)
    zq = np.array([[NEG, NEG, 2.0, 0.0], [NEG, 1e4, -1e4, 3.0]], np.float32)
    np.testing.assert_array_equal(M.acceptance_rate(zp, zq), [0.0, 0.0])
    np.testing.assert_allclose(M.total_variation(zp, zq), [1.0, 1.0], atol=1e-7)
    assert np.all(np.isinf(np.asarray(M.kl_divergence(zp, zq))))


def test_kl_zero_probability_conventions_by_hand():
    # p = (1/2, 1/2, 0), q = (1/4, 1/4, 1/2): KL = log 2; KL(q||p) = inf
    zp = np.array([math.log(0.5), math.log(0.5), NEG], np.float32)
    zq = np.log(np.array([0.25, 0.25, 0.5])).astype(np.float32)
    np.testing.assert_allclose(M.kl_divergence(zp, zq), math.log(2), rtol=1e-6)
    assert np.isinf(M.kl_divergence(zq, zp))
    np.testing.assert_allclose(M.acceptance_rate(zp, zq), 0.5, rtol=1e-6)


# ------------------------------------------------------------------------ measures: top-k
def test_topk_by_hand():
    zp = np.log(np.array([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])).astype(np.float32)
    zq = np.log(np.array([[0.1, 0.2, 0.3, 0.4], [0.35, 0.1, 0.5, 0.05]])).astype(np.float32)
    # row 0: top2 p = {0,1}, top2 q = {3,2} -> no overlap -> 0; exact = .1+.2+.2+.1 = .6
    # row 1: top2 p = {0,1}, top2 q = {2,0} -> only token 0 -> min(.4,.35) = .35
    np.testing.assert_allclose(M.topk_acceptance_rate(zp, zq, k=2), [0.0, 0.35], atol=1e-6)
    np.testing.assert_allclose(M.acceptance_rate(zp, zq), [0.6, 0.35 + 0.1 + 0.2 + 0.05], atol=1e-6)
    # k = 3, row 1: top3 p={0,1,2}, q={2,0,1} -> .35 + .1 + .2
    np.testing.assert_allclose(M.topk_acceptance_rate(zp, zq, k=3)[1], 0.65, atol=1e-6)


@pytest.mark.parametrize("case", ["random", "peaked", "huge_mag", "huge_offset", "neg_inf"])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_topk_is_lower_bound_and_matches_reference(case, k):
    if case == "random":
        zp, zq = random_pair(rng(3), (6, 41), scale=1.0, noise=1.0)
    else:
        zp, zq = adversarial_pairs()[case]
    approx = np.asarray(M.topk_acceptance_rate(zp, zq, k=k))
    exact = np.asarray(M.acceptance_rate(zp, zq))
    assert np.all(approx <= exact + 1e-6)
    np.testing.assert_allclose(approx, np_topk_alpha(zp, zq, k), atol=2e-6, rtol=1e-5)


def test_topk_k_at_least_vocab_is_exact():
    zp, zq = random_pair(rng(4), (3, 9))
    np.testing.assert_allclose(M.topk_acceptance_rate(zp, zq, k=50), M.acceptance_rate(zp, zq), atol=1e-6)


def test_acceptance_from_topk_lists():
    ids_p = np.array([[3, 1, 7]]); lp = np.log(np.array([[0.5, 0.2, 0.1]])).astype(np.float32)
    ids_q = np.array([[1, 3, 9]]); lq = np.log(np.array([[0.6, 0.1, 0.1]])).astype(np.float32)
    # overlap {3, 1}: min(.5, .1) + min(.2, .6) = .3
    np.testing.assert_allclose(M.acceptance_rate_from_topk(ids_p, lp, ids_q, lq), [0.3], atol=1e-6)
    with pytest.raises(ValueError, match="ids_q"):
        M.acceptance_rate_from_topk(ids_p, lp, ids_q[:, :2], lq)
    with pytest.raises(TypeError, match="ids_p"):
        M.acceptance_rate_from_topk(ids_p.astype(np.float32), lp, ids_q, lq)


# ------------------------------------------------------------------------ measures: chunked
def _hidden_case(seed, lead=(2, 3), H=8, V=50, scale=1.0):
    r = rng(seed)
    hp = (scale * r.normal(size=lead + (H,))).astype(np.float32)
    hq = (hp + 0.3 * scale * r.normal(size=hp.shape)).astype(np.float32)
    W = r.normal(size=(H, V)).astype(np.float32)
    return hp, hq, W


@pytest.mark.parametrize("chunk", [1, 7, 50, 8192])
def test_chunked_equals_unchunked(chunk):
    hp, hq, W = _hidden_case(5)
    V = W.shape[1]
    tokens = rng(6).integers(0, V, size=hp.shape[:-1])
    out = M.mismatch_stats(hp, hq, W, vocab_chunk=chunk, sampled_tokens=tokens)
    zp = np.asarray(jnp.dot(hp, W, precision=jax.lax.Precision.HIGHEST))
    zq = np.asarray(jnp.dot(hq, W, precision=jax.lax.Precision.HIGHEST))
    np.testing.assert_allclose(out["alpha"], M.acceptance_rate(zp, zq), atol=1e-5)
    np.testing.assert_allclose(out["tv"], M.total_variation(zp, zq), atol=1e-5)
    np.testing.assert_allclose(out["kl"], M.kl_divergence(zp, zq), atol=1e-5)
    # independent float64 references for entropy and sampled log-probs
    zp64 = hp.astype(np.float64) @ W.astype(np.float64)
    zq64 = hq.astype(np.float64) @ W.astype(np.float64)
    _, _, _, ent = np_measures(zp64, zq64)
    np.testing.assert_allclose(out["entropy_p"], ent, atol=1e-5)
    lp64 = np.take_along_axis(np_logsoftmax(zp64), tokens[..., None], -1)[..., 0]
    lq64 = np.take_along_axis(np_logsoftmax(zq64), tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(out["logp_p_sampled"], lp64, atol=1e-5)
    np.testing.assert_allclose(out["logp_q_sampled"], lq64, atol=1e-5)
    assert set(out) == {"alpha", "tv", "kl", "entropy_p", "logp_p_sampled", "logp_q_sampled"}
    assert all(v.shape == hp.shape[:-1] and v.dtype == jnp.float32 for v in out.values())


def test_chunked_large_magnitude_separate_unembed_and_jit():
    hp, hq, W = _hidden_case(7, lead=(4,), H=16, V=37, scale=30.0)   # logits ~ 1e2, peaked
    Wq = (W + 0.05 * rng(8).normal(size=W.shape)).astype(np.float32)
    f = jax.jit(lambda a, b: M.mismatch_stats(a, b, W, 10, unembed_q=Wq, reverse_kl=True))
    out = f(hp, hq)
    zp = hp.astype(np.float64) @ W.astype(np.float64)
    zq = hq.astype(np.float64) @ Wq.astype(np.float64)
    alpha, tv, kl, ent = np_measures(zp, zq)
    _, _, kl_reverse, _ = np_measures(zq, zp)  # KL(q || p): the same formula, arguments swapped
    np.testing.assert_allclose(out["kl_reverse"], kl_reverse, atol=1e-4, rtol=1e-4)
    assert np.max(np.abs(kl_reverse - kl)) > 1e-2  # the two directions really differ here
    np.testing.assert_allclose(out["alpha"], alpha, atol=2e-5)
    np.testing.assert_allclose(out["tv"], tv, atol=2e-5)
    np.testing.assert_allclose(out["kl"], kl, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out["entropy_p"], ent, atol=2e-5)
    assert "logp_p_sampled" not in out


def test_chunked_identical_inputs_and_bad_tokens():
    hp, _, W = _hidden_case(9, V=23)
    out = M.mismatch_stats(hp, hp, W, 5, sampled_tokens=np.full(hp.shape[:-1], 23))
    assert np.all(np.asarray(out["alpha"]) >= 1 - 1e-6)
    assert np.all(np.asarray(out["tv"]) <= 1e-6) and np.all(np.asarray(out["kl"]) <= 1e-6)
    assert np.all(np.isneginf(np.asarray(out["logp_p_sampled"])))   # id outside [0, V)


# ------------------------------------------------------------------------ measures: errors
def test_measure_errors():
    a = np.zeros((2, 5), np.float32)
    for fn in (M.acceptance_rate, M.total_variation, M.kl_divergence, M.topk_acceptance_rate):
        with pytest.raises(ValueError, match="same shape"):
            fn(a, np.zeros((2, 6), np.float32))
    with pytest.raises(TypeError, match="logits_p"):
        M.acceptance_rate(np.zeros((2, 5), np.int32), a)
    with pytest.raises(ValueError, match="V >= 1"):
        M.acceptance_rate(np.float32(1.0), np.float32(1.0))
    with pytest.raises(ValueError, match="k"):
        M.topk_acceptance_rate(a, a, k=0)
    hp, hq, W = _hidden_case(0)
    with pytest.raises(ValueError, match="hidden_q"):
        M.mismatch_stats(hp, hq[:1], W)
    with pytest.raises(ValueError, match="unembed"):
        M.mismatch_stats(hp, hq, W.T)
    with pytest.raises(ValueError, match="unembed_q"):
        M.mismatch_stats(hp, hq, W, unembed_q=W[:, :3])
    with pytest.raises(ValueError, match="vocab_chunk"):
        M.mismatch_stats(hp, hq, W, vocab_chunk=0)
    with pytest.raises(ValueError, match="sampled_tokens"):
        M.mismatch_stats(hp, hq, W, sampled_tokens=np.zeros((2,), np.int32))
    with pytest.raises(TypeError, match="sampled_tokens"):
        M.mismatch_stats(hp, hq, W, sampled_tokens=np.zeros(hp.shape[:-1], np.float32))


# ------------------------------------------------------------------------ tail: data
def ragged_batch(seed, B=5, Tlen=60, bin_width=7, gap=True):
    """Values, absolute positions (prompt offsets differ per row) and a ragged mask;
    with ``gap`` one row jumps far ahead so some bins in between are empty."""
    r = rng(seed)
    values = r.random((B, Tlen)).astype(np.float32)
    prompt = r.integers(0, 20, size=B)
    positions = prompt[:, None] + np.arange(Tlen)[None, :]
    if gap:
        positions[-1] += 30 * bin_width
    lengths = r.integers(0, Tlen + 1, size=B)
    lengths[0], lengths[-1] = Tlen, max(lengths[-1], 5)
    mask = np.arange(Tlen)[None, :] < lengths[:, None]
    return values, positions.astype(np.int32), mask


def np_binned(values, positions, mask, bin_width, q):
    v, p = values[mask].astype(np.float64), positions[mask]
    bins = p // bin_width
    ks = np.unique(bins)
    return (ks * bin_width, np.array([np.percentile(v[bins == k], q) for k in ks]),
            np.array([np.sum(bins == k) for k in ks]))


# ------------------------------------------------------------------------ tail: percentiles
@pytest.mark.parametrize("q", [5.0, 0.0, 100.0, 37.5, (5.0, 50.0, 95.0)])
def test_binned_percentile_matches_numpy(q):
    values, positions, mask = ragged_batch(10)
    starts, pct, counts = T.binned_percentile(values, positions, mask, bin_width=7, q=q)
    ref_s, ref_p, ref_c = np_binned(values, positions, mask, 7, q)
    np.testing.assert_array_equal(starts, ref_s)
    np.testing.assert_array_equal(counts, ref_c)
    np.testing.assert_allclose(pct, ref_p, rtol=1e-12)
    assert counts.sum() == mask.sum()
    # the gap row makes at least one empty bin in the middle, which must be absent
    assert np.any(np.diff(starts) > 7)


@pytest.mark.parametrize("q", [5.0, 50.0, (0.0, 5.0, 100.0)])
def test_binned_percentile_jax_matches_numpy(q):
    values, positions, mask = ragged_batch(11)
    bw = 7
    num_bins = int(positions.max()) // bw + 3                        # trailing empty bins
    pct, counts = jax.jit(lambda v, p, m: T.binned_percentile_jax(v, p, m, num_bins, bw, q))(
        values, positions, mask)
    pct, counts = np.asarray(pct), np.asarray(counts)
    ref_s, ref_p, ref_c = np_binned(values, positions, mask, bw, q)
    k = ref_s // bw
    np.testing.assert_array_equal(np.flatnonzero(counts), k)
    np.testing.assert_array_equal(counts[k], ref_c)
    np.testing.assert_allclose(pct[k], ref_p, rtol=1e-6, atol=1e-7)
    empty = np.setdiff1d(np.arange(num_bins), k)
    assert empty.size >= 3 and np.all(np.isnan(pct[empty]))


def test_binned_percentile_jax_drops_tokens_past_last_bin():
    values, positions, mask = ragged_batch(12, gap=False)
    bw, num_bins = 7, 3
    pct, counts = T.binned_percentile_jax(values, positions, mask, num_bins, bw, 5.0)
    inside = mask & (positions < num_bins * bw)
    ref_s, ref_p, ref_c = np_binned(values, positions, inside, bw, 5.0)
    np.testing.assert_array_equal(np.asarray(counts)[ref_s // bw], ref_c)
    np.testing.assert_allclose(np.asarray(pct)[ref_s // bw], ref_p, rtol=1e-6)


def test_binned_percentile_large_bin_float32_rank():
    # one bin of 100k tokens: rank computed in float32 must still land between neighbours
    r = rng(13)
    v = r.random((4, 25_000)).astype(np.float32)
    pos = np.tile(np.arange(25_000), (4, 1)).astype(np.int32)
    m = np.ones_like(v, bool)
    pct, _ = T.binned_percentile_jax(v, pos, m, 1, 100_000, 5.0)
    np.testing.assert_allclose(float(pct[0]), np.percentile(v.astype(np.float64), 5.0), rtol=1e-5)


# ------------------------------------------------------------------------ tail: accumulator
def test_accumulator_batches_equal_one_shot():
    batches = [ragged_batch(20 + i) for i in range(3)]
    acc = T.TailAccumulator(bin_width=7, q=(5.0, 50.0))
    for b in batches:
        acc.update(*b)
    cat = [np.concatenate([b[i] for b in batches]) for i in range(3)]
    starts, pct, counts = np_binned(*cat, 7, (5.0, 50.0))
    res = acc.result()
    np.testing.assert_array_equal(res["bin_starts"], starts)
    np.testing.assert_array_equal(res["counts"], counts)
    np.testing.assert_allclose(res["percentiles"][5.0], pct[:, 0], rtol=1e-12)
    np.testing.assert_allclose(res["percentiles"][50.0], pct[:, 1], rtol=1e-12)
    v, p = cat[0][cat[2]].astype(np.float64), cat[1][cat[2]]
    means = [v[p // 7 == s // 7].mean() for s in starts]
    np.testing.assert_allclose(res["mean_by_bin"], means, rtol=1e-12)
    assert res["min_p5"] == pytest.approx(pct[:, 0].min())
    assert res["exact"].all() and acc.num_tokens == cat[2].sum()
    row = res["bins"][0]
    assert row["start"] == starts[0] and row["end"] == starts[0] + 7 and row["p5"] == pytest.approx(pct[0, 0])
    # min_count skips small bins
    big = counts >= 10
    assert acc.min_p5(min_count=10) == pytest.approx(pct[big, 0].min())


def test_accumulator_merge_equals_one_shot():
    batches = [ragged_batch(30 + i) for i in range(3)]
    a, b, whole = (T.TailAccumulator(7, q=5.0) for _ in range(3))
    a.update(*batches[0])
    b.update(*batches[1]); b.update(*batches[2])
    for x in batches:
        whole.update(*x)
    ra, rw = a.merge(b).result(), whole.result()
    np.testing.assert_array_equal(ra["bin_starts"], rw["bin_starts"])
    np.testing.assert_array_equal(ra["counts"], rw["counts"])
    np.testing.assert_allclose(ra["percentiles"][5.0], rw["percentiles"][5.0], rtol=1e-12)
    np.testing.assert_allclose(ra["mean_by_bin"], rw["mean_by_bin"], rtol=1e-12)


def test_accumulator_reservoir():
    n = 20_000
    values = np.arange(n, dtype=np.float64)[None, :]                 # ascending stream: keeping
    # the first (or last) items would bias every quantile
    positions = np.zeros((1, n), np.int64)                           # one bin
    mask = np.ones((1, n), bool)
    cap = 1000
    acc = T.TailAccumulator(100, q=(5.0, 50.0), max_samples_per_bin=cap, seed=0)
    for s in range(0, n, 3000):                                      # uneven batches
        acc.update(values[:, s:s + 3000], positions[:, s:s + 3000], mask[:, s:s + 3000])
    res = acc.result()
    sample = acc._bins[0].values()
    assert sample.size == cap and np.unique(sample).size == cap      # no duplicates
    assert np.all(np.isin(sample, values))
    assert res["counts"][0] == n and not res["exact"][0]
    assert res["mean_by_bin"][0] == pytest.approx(values.mean(), rel=1e-12)   # exact
    # uniform sample: quantiles within ~5 standard errors of the truth
    se = n * math.sqrt(0.05 * 0.95 / cap)
    assert abs(res["percentiles"][5.0][0] - np.percentile(values, 5.0)) < 5 * se
    assert abs(res["percentiles"][50.0][0] - np.percentile(values, 50.0)) < 5 * n * math.sqrt(0.25 / cap)
    # same seed, same batches -> same sample; cap not reached -> exact
    acc2 = T.TailAccumulator(100, q=(5.0, 50.0), max_samples_per_bin=cap, seed=0)
    for s in range(0, n, 3000):
        acc2.update(values[:, s:s + 3000], positions[:, s:s + 3000], mask[:, s:s + 3000])
    np.testing.assert_array_equal(np.sort(acc2._bins[0].values()), np.sort(sample))
    small = T.TailAccumulator(100, q=5.0, max_samples_per_bin=cap)
    small.update(values[:, :500], positions[:, :500], mask[:, :500])
    assert small.result()["exact"][0]
    assert small.result()["percentiles"][5.0][0] == pytest.approx(np.percentile(values[0, :500], 5.0))
    # merging two capped accumulators keeps the cap and exact counts/means
    other = T.TailAccumulator(100, q=(5.0, 50.0), max_samples_per_bin=cap, seed=1)
    other.update(values + n, positions, mask)                       # disjoint values n..2n-1
    acc.merge(other)
    m = acc.result()
    merged = acc._bins[0].values()
    assert m["counts"][0] == 2 * n and merged.size == cap and np.unique(merged).size == cap
    assert m["mean_by_bin"][0] == pytest.approx(n - 0.5, rel=1e-12)
    # equal-sized sides: about half the merged sample from each (hypergeometric)
    assert abs(np.sum(merged >= n) - cap / 2) < 5 * math.sqrt(cap / 4)


# ------------------------------------------------------------------------ tail: errors
def test_tail_errors():
    values, positions, mask = ragged_batch(50)
    with pytest.raises(ValueError, match="positions"):
        T.binned_percentile(values, positions[:, :-1], mask)
    with pytest.raises(ValueError, match="mask"):
        T.binned_percentile(values, positions, mask[:-1])
    for bw in (0, -5):
        with pytest.raises(ValueError, match="bin_width"):
            T.binned_percentile(values, positions, mask, bin_width=bw)
        with pytest.raises(ValueError, match="bin_width"):
            T.TailAccumulator(bin_width=bw)
        with pytest.raises(ValueError, match="bin_width"):
            T.binned_percentile_jax(values, positions, mask, 4, bw)
    for q in (-1.0, 100.5, float("nan"), (5.0, 101.0)):
        with pytest.raises(ValueError, match="q"):
            T.binned_percentile(values, positions, mask, q=q)
        with pytest.raises(ValueError, match="q"):
            T.binned_percentile_jax(values, positions, mask, 4, 7, q=q)
        with pytest.raises(ValueError, match="q"):
            T.TailAccumulator(7, q=q)
    with pytest.raises(TypeError, match="positions"):
        T.binned_percentile(values, positions.astype(np.float32), mask)
    with pytest.raises(ValueError, match="positions"):
        T.binned_percentile(values, positions - 1000, mask)
    bad = values.copy(); bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="values"):
        T.binned_percentile(bad, positions, mask)
    with pytest.raises(ValueError, match="positions"):
        T.binned_percentile_jax(values, positions[:1], mask, 4, 7)
    with pytest.raises(ValueError, match="num_bins"):
        T.binned_percentile_jax(values, positions, mask, 0, 7)
    acc = T.TailAccumulator(7)
    with pytest.raises(ValueError, match="positions"):
        acc.update(values, positions[:, :3], mask)
    with pytest.raises(ValueError, match="bin_width"):
        acc.merge(T.TailAccumulator(8))
    with pytest.raises(ValueError, match="max_samples_per_bin"):
        acc.merge(T.TailAccumulator(7, max_samples_per_bin=10))
    with pytest.raises(ValueError, match="max_samples_per_bin"):
        T.TailAccumulator(7, max_samples_per_bin=0)
    with pytest.raises(ValueError, match="q"):
        acc.min_percentile(50.0)
    assert math.isnan(acc.min_p5()) and acc.result()["bin_starts"].size == 0


def test_binned_tail_jax_one_rule_for_p5_mean_and_count():
    """Positions past the last bin pool into the last bin for the percentile, the mean and the
    count alike (numpy reference on clipped bins); empty bins give NaN and 0."""
    rng = np.random.RandomState(0)
    values = rng.rand(3, 40).astype(np.float32)
    positions = np.broadcast_to(T.query_positions(40), values.shape)
    mask = rng.rand(3, 40) < 0.7
    mask[:, :11] = False  # bin 0 (positions 0..9) stays empty
    p, mean, count = jax.jit(T.binned_tail_jax, static_argnums=(3, 4))(values, positions, mask, 3, 10)
    bins = np.minimum(positions // 10, 2)
    assert np.isnan(p[0]) and np.isnan(mean[0]) and int(count[0]) == 0
    for k in (1, 2):
        sel = values[mask & (bins == k)].astype(np.float64)
        assert int(count[k]) == sel.size
        np.testing.assert_allclose(float(p[k]), np.percentile(sel, 5), rtol=1e-5)
        np.testing.assert_allclose(float(mean[k]), sel.mean(), rtol=1e-5)
    assert int(count.sum()) == int(mask.sum())  # nothing dropped past the last bin
    np.testing.assert_array_equal(T.query_positions(4), [0, 0, 1, 2])
