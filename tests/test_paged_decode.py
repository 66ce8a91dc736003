"""Dense CPU kernel and page-pool decode: equal to the reference decode on the same tokens."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_refs import brute_force_sparse_decode

from sparrow_jax.attention import dense_decode, dense_decode_dispatch, select_pages
from sparrow_jax.attention.cpu_kernel import (cpu_kernel_available, dense_decode_cpu, paged_decode_cpu,
                                             paged_sparse_step_cpu, score_select_cpu, select_pages_cpu)
from sparrow_jax.rollout import SparsitySchedule
from sparrow_jax.attention.selection import group_mean_query
from sparrow_jax.rollout.page_pool import PoolLayer, append_and_decode, append_to_pool, paged_decode

B, H, HKV, P, S, D = 3, 4, 2, 6, 4, 16
needs_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler: CPU kernel off")


@pytest.fixture(scope="module")
def cache():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    k = jax.random.normal(keys[0], (B, HKV, P, S, D), jnp.float32)
    v = jax.random.normal(keys[1], (B, HKV, P, S, D), jnp.float32)
    q = jax.random.normal(keys[2], (B, H, D), jnp.float32)
    positions = jnp.array([0, 9, P * S - 1], jnp.int32)  # first token, mid page, last token
    # The same pages scattered over a pool of B * P + 1 pages (page 0 unused) by a page table.
    table = np.random.RandomState(0).permutation(B * P).reshape(B, P).astype(np.int32) + 1
    to_pool = lambda x: jnp.zeros((B * P + 1, HKV, S, D)).at[table.reshape(-1)].set(
        jnp.swapaxes(x, 1, 2).reshape(B * P, HKV, S, D))
    return q, k, v, positions, jnp.asarray(table), to_pool(k), to_pool(v)


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_kernel_equals_reference_dense_decode(cache, dtype):
    q, k, v, positions, *_ = cache
    k, v = k.astype(dtype), v.astype(dtype)
    expected = dense_decode(q, k, v, positions)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(dense_decode_cpu(q, k, v, positions), expected, atol=tol, rtol=tol)
    np.testing.assert_allclose(dense_decode_dispatch(q, k, v, positions, impl="auto"), expected, atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("dim, groups", [(32, 1), (32, 2), (64, 4), (32, 3)])  # (32, 3): G at run time
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_with_head_dim_and_group_fixed_at_compile_time_equals_reference(dim, groups, dtype):
    keys = jax.random.split(jax.random.PRNGKey(7), 3)
    q = jax.random.normal(keys[0], (2, HKV * groups, dim), jnp.float32)
    k, v = (jax.random.normal(key, (2, HKV, 5, S, dim), jnp.float32).astype(dtype) for key in keys[1:])
    positions = jnp.array([6, 5 * S - 1], jnp.int32)  # mid page; every slot
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(dense_decode_cpu(q, k, v, positions), dense_decode(q, k, v, positions), atol=tol,
                               rtol=tol)


@needs_kernel
def test_cpu_page_selection_equals_top_k_slot_for_slot_with_tied_scores():
    # Scores from 3 values over 12 pages: most candidates tie, and top-k's order (larger score,
    # then lower page) decides both which pages are taken and their slots.
    scores = jax.random.randint(jax.random.PRNGKey(8), (4, HKV, 12), 0, 3).astype(jnp.float32)
    positions = jnp.array([3, 20, 35, 47], jnp.int32)
    budget = jnp.array([2, 3, 5, 9], jnp.int32)
    got = select_pages_cpu(scores, positions, budget, 6, S, 1, 2)
    want = select_pages(scores, positions[:, None], budget[:, None], 6, S, 1, 2)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@needs_kernel
def test_paged_kernel_through_a_page_table_equals_per_row_layout(cache):
    q, k, v, positions, table, k_pool, v_pool = cache
    np.testing.assert_array_equal(paged_decode_cpu(q, k_pool, v_pool, table, positions), dense_decode_cpu(q, k, v, positions))
    scores = jax.random.normal(jax.random.PRNGKey(3), (B, HKV, P))
    idx, valid = select_pages(scores, positions[:, None], 2, 2, S, 1, 1)
    expected = brute_force_sparse_decode(*(np.asarray(x) for x in (q, k, v, idx, valid, positions)))
    got = paged_decode_cpu(q, k_pool, v_pool, table, positions, idx, valid)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    with pytest.raises(Exception, match="outside the pool"):
        jax.block_until_ready(paged_decode_cpu(q, k_pool, v_pool, table + 100, positions))


@pytest.mark.parametrize("schedule", [None, SparsitySchedule.fixed(2, page_size=S, reserved_first=1,
                                                                    reserved_last=1, dense_layers=())],
                         ids=["dense", "sparse"])
def test_paged_decode_xla_fallback_equals_cpu_kernel(cache, schedule):
    q, k, v, positions, table, k_pool, v_pool = cache
    centroid = jax.random.normal(jax.random.PRNGKey(4), (B * P + 1, HKV, D))
    pool = PoolLayer(k_pool, v_pool, centroid)
    budget = jnp.full((B,), 2, jnp.int32)
    xla = paged_decode(q, pool, table, positions, schedule, budget, 2, impl="xla")
    if schedule is None:
        np.testing.assert_allclose(xla, dense_decode(q, k, v, positions), atol=1e-5)
    if cpu_kernel_available():
        np.testing.assert_allclose(paged_decode(q, pool, table, positions, schedule, budget, 2, impl="cpu"), xla,
                                   atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("selector", ["quest", "centroid"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tied", [False, True], ids=["distinct", "tied"])
def test_fused_sparse_step_is_score_select_then_paged_decode_bit_for_bit(cache, selector, dtype, tied):
    q, _, _, positions, table, k_pool, v_pool = cache
    k_pool, v_pool = k_pool.astype(dtype), v_pool.astype(dtype)
    keys = jax.random.split(jax.random.PRNGKey(5), 2)
    # tied: every page has the same metadata, so every score ties and the lower pages win
    lo = jax.random.normal(keys[0], (1 if tied else B * P + 1, HKV, D))
    hi = lo + jax.random.uniform(keys[1], lo.shape)
    lo, hi = (jnp.broadcast_to(x, (B * P + 1, HKV, D)) for x in (lo, hi))
    meta = dict(centroid=lo, kmin=lo, kmax=hi)
    budget = jnp.array([1, 2, 3], jnp.int32)  # per row; k_max 3 is clipped by no row
    idx, valid = score_select_cpu(group_mean_query(q, HKV), meta["centroid"], meta["kmin"], meta["kmax"], positions,
                                  budget, 3, S, reserved_first=1, reserved_last=1, selector=selector, page_table=table)
    expected = paged_decode_cpu(q, k_pool, v_pool, table, positions, idx, valid)
    fused, fused_meta = paged_sparse_step_cpu(q, k_pool, v_pool, table, positions, meta["centroid"], meta["kmin"],
                                              meta["kmax"], budget, 3, reserved_first=1, reserved_last=1,
                                              selector=selector)
    np.testing.assert_array_equal(fused, expected)
    kept = (meta["centroid"], None, None) if selector == "centroid" else (None, meta["kmin"], meta["kmax"])
    for got, given in zip(fused_meta, kept):  # no k_new: the metadata comes back as given
        assert (got is None) == (given is None) and (got is None or np.array_equal(got, given))
    with pytest.raises(Exception, match="outside the pool"):
        jax.block_until_ready(paged_sparse_step_cpu(q, k_pool, v_pool, table + 100, positions, **meta,
                                                    budget=budget, k_max=3, selector=selector))
    with pytest.raises(ValueError, match="metadata"):
        paged_sparse_step_cpu(q, k_pool, v_pool, table, positions, *(x[:-1] for x in meta.values()),
                              budget=budget, k_max=3, selector=selector)
    with pytest.raises(ValueError, match="k_new"):
        paged_sparse_step_cpu(q, k_pool, v_pool, table, positions, **meta, budget=budget, k_max=3, selector=selector,
                              k_new=jnp.zeros((B, HKV, D + 1)))


def _assert_same_pool(got_pool: PoolLayer, want_pool: PoolLayer) -> None:
    """K / V pages and min / max bit for bit; the centroid's running mean to an ulp: XLA contracts
    its update into one multiply-add as the kernel does at LLVM -O3, not at the -O0 the suite
    compiles with (tests/conftest.py)."""
    for name, got, want in zip(PoolLayer._fields, got_pool, want_pool):
        assert (got is None) == (want is None), name
        if got is not None and name == "centroid":
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)
        elif got is not None:
            np.testing.assert_array_equal(got, want, err_msg=name)


@needs_kernel
@pytest.mark.parametrize("selector", ["quest", "centroid"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sparse_step_appending_in_the_kernel_equals_append_to_pool_then_decode(cache, selector, dtype):
    """The engine's sparse step: the kernel's own metadata append (in XLA's buffers) gives the
    output and pool of XLA's append_to_pool followed by the kernel on that pool, bit for bit
    (the centroid to an ulp); the pure-XLA step agrees to rounding."""
    q, _, _, _, table, k_pool, v_pool = cache
    # In-page slots 0 (a page starts afresh), 2 (the centroid divides by 3) and 3; every row's
    # page being written is its own (distinct physical pages).
    positions = jnp.array([8, 2 * S + 2, P * S - 1], jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(6), 4)
    lo = jax.random.normal(keys[0], (B * P + 1, HKV, D))
    quest = selector == "quest"
    pool = PoolLayer(k_pool.astype(dtype), v_pool.astype(dtype), None if quest else lo, lo if quest else None,
                     lo + jax.random.uniform(keys[1], lo.shape) if quest else None)
    k_new, v_new = (jax.random.normal(key, (B, HKV, D)) for key in keys[2:])
    schedule = SparsitySchedule.fixed(2, page_size=S, reserved_first=1, reserved_last=1, dense_layers=(),
                                      selector=selector)
    budget = jnp.array([1, 2, 3], jnp.int32)
    # Jitted as in the engine's step: XLA fuses the centroid's update into one multiply-add.
    step = lambda impl: jax.jit(lambda *a: append_and_decode(*a, schedule, budget, 3, impl=impl))  # noqa: E731
    out, new_pool = step("cpu")(q, k_new, v_new, pool, table, positions)
    appended = jax.jit(append_to_pool)(pool, table, k_new, v_new, positions)
    expected = paged_decode(q, appended, table, positions, schedule, budget, 3, impl="cpu")
    np.testing.assert_array_equal(out, expected)
    _assert_same_pool(new_pool, appended)
    xla_out, xla_pool = step("xla")(q, k_new, v_new, pool, table, positions)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(out, xla_out, atol=tol, rtol=tol)
    _assert_same_pool(new_pool, xla_pool)
