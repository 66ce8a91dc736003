"""Block-sparse decode kernels (Pallas TPU / GPU in interpret mode, fast XLA, C++ CPU custom call) vs references.

Each implementation is checked against ``sparse_decode_reference`` and against an
independent numpy brute force written here. Shapes are tiny (interpret mode is slow) and
chosen so one jit compile per (kernel, config) serves several tests.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_refs import brute_force_sparse_decode

from pallas_kernels import sparse_decode_gpu, sparse_decode_tpu, sparse_decode_triton, triton_available
from sparrow_jax.attention import dense_decode, score_pages, select_pages, sparse_decode, sparse_decode_reference
from sparrow_jax.attention.cpu_kernel import cpu_kernel_available, sparse_decode_cpu
from sparrow_jax.attention.fast_xla import sparse_decode_xla_fast

PAGES, PAGE, DIM, K_MAX = 7, 4, 8, 4  # k_max 4 = every candidate page (1..cur-2) when cur <= 6
N_SLOTS = 1 + K_MAX + 2
POSITIONS = np.array([27, 10, 0], np.int32)  # ragged: full cache, mid page, very first token
# (name, query heads, kv heads): GQA ratio 4 and ratio 1.
CONFIGS = {"gqa4": (8, 2), "gqa1": (2, 2)}
# Pages per block: the default for gqa4 (one block for TPU, 2 with padding for GPU) and 2 for
# gqa1 (several double-buffered TPU blocks, N=7 padded to 8).
PPB = {"gqa4": {}, "gqa1": {"pages_per_block": 2}}


def _impl(name: str, config: str):
    if name == "cpu":
        if not cpu_kernel_available():
            pytest.skip("no C++ compiler here: the CPU custom call is off (sparse_decode falls back to XLA)")
        return sparse_decode_cpu
    if name == "pallas_tpu":
        return functools.partial(sparse_decode_tpu, interpret=True, **PPB[config])
    if name == "pallas_gpu":
        return functools.partial(sparse_decode_gpu, interpret=True, **PPB[config])
    return sparse_decode_xla_fast


IMPLS = ["pallas_tpu", "pallas_gpu", "fast_xla", "cpu"]


def _inputs(config: str, seed: int):
    heads, kv_heads = CONFIGS[config]
    rng = np.random.default_rng(seed)
    b = len(POSITIONS)
    q = rng.standard_normal((b, heads, DIM), dtype=np.float32)
    k = rng.standard_normal((b, kv_heads, PAGES, PAGE, DIM), dtype=np.float32)
    v = rng.standard_normal((b, kv_heads, PAGES, PAGE, DIM), dtype=np.float32)
    return q, k, v


def _select(config: str, budget, seed: int, drop: float = 0.0):
    """select_pages on random scores; optionally invalidate a random part of the top-k slots."""
    _, kv_heads = CONFIGS[config]
    rng = np.random.default_rng(seed + 1)
    scores = rng.standard_normal((len(POSITIONS), kv_heads, PAGES)).astype(np.float32)
    idx, valid = select_pages(jnp.asarray(scores), jnp.asarray(POSITIONS)[:, None],
                              jnp.asarray(budget)[:, None], K_MAX, PAGE)
    valid = np.array(valid)
    drop_mask = rng.random(valid.shape) < drop
    drop_mask[..., 0] = False
    drop_mask[..., -2:] = False  # keep the reserved pages: the current page stays visible
    valid &= ~drop_mask
    return np.array(idx), valid


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_references_small_budgets(impl, config):
    q, k, v = _inputs(config, seed=0)
    idx, valid = _select(config, budget=np.array([2, 1, 3]), seed=0, drop=0.3)
    assert (~valid).any() and valid.sum() > 0  # the case really has invalid slots
    got = np.asarray(_impl(impl, config)(q, k, v, idx, valid, POSITIONS))
    ref = np.asarray(sparse_decode_reference(q, k, v, idx, valid, POSITIONS))
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got, brute_force_sparse_decode(q, k, v, idx, valid, POSITIONS), atol=1e-5, rtol=0)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("impl", IMPLS)
def test_full_budget_equals_dense(impl, config):
    q, k, v = _inputs(config, seed=1)
    idx, valid = _select(config, budget=np.full(3, K_MAX), seed=1)
    got = np.asarray(_impl(impl, config)(q, k, v, idx, valid, POSITIONS))
    np.testing.assert_allclose(got, np.asarray(dense_decode(q, k, v, POSITIONS)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_cache(impl):
    """bf16 q/k/v: products in bf16 with f32 accumulation; output in bf16 close to f64 math."""
    config = "gqa4"
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in _inputs(config, seed=8))
    idx, valid = _select(config, budget=np.array([3, 2, 1]), seed=8)
    got = _impl(impl, config)(q, k, v, idx, valid, POSITIONS)
    assert got.dtype == jnp.bfloat16
    f32 = lambda x: np.asarray(x, np.float32)
    want = brute_force_sparse_decode(f32(q), f32(k), f32(v), idx, valid, POSITIONS)
    np.testing.assert_allclose(f32(got), want, atol=2e-2, rtol=0)
    ref = sparse_decode_reference(q, k, v, idx, valid, POSITIONS)
    np.testing.assert_allclose(f32(got), f32(ref), atol=2e-2, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_arbitrary_selection_masks_future_and_out_of_range(impl):
    """Unsorted slots, a page entirely after the position listed first, an out-of-range
    valid index (ignored, as in the reference), and invalid slots naming real pages."""
    config = "gqa4"
    q, k, v = _inputs(config, seed=2)
    # Rows decode at positions 27 (page 6), 10 (page 2), 0 (page 0).
    row_idx = [[6, 5, 1, 3, 99, 0, 2], [5, 2, 0, 1, 4, -1, 6], [3, 0, 6, 1, 2, 4, 5]]
    row_ok = [[1, 1, 0, 1, 1, 1, 0], [1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 1, 0, 0, 0]]
    idx = np.broadcast_to(np.array(row_idx, np.int32)[:, None], (3, 2, N_SLOTS)).copy()
    valid = np.broadcast_to(np.array(row_ok, bool)[:, None], (3, 2, N_SLOTS)).copy()
    idx[:, 1] = idx[:, 1, ::-1]  # the other KV head sees the same pages in reverse order
    valid[:, 1] = valid[:, 1, ::-1]
    got = np.asarray(_impl(impl, config)(q, k, v, idx, valid, POSITIONS))
    want = brute_force_sparse_decode(q, k, v, idx, valid, POSITIONS)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    ref = np.asarray(sparse_decode_reference(q, k, v, idx, valid, POSITIONS))
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_dispatch_from_decode_uses_interpreted_kernel(impl):
    """decode.sparse_decode(impl=...) on CPU runs the kernel in interpret mode."""
    config = "gqa4"
    q, k, v = _inputs(config, seed=3)
    idx, valid = _select(config, budget=np.array([1, 2, 0]), seed=3)
    got = np.asarray(sparse_decode(q, k, v, idx, valid, POSITIONS, impl=impl))
    np.testing.assert_allclose(got, brute_force_sparse_decode(q, k, v, idx, valid, POSITIONS), atol=1e-5, rtol=0)


def test_tpu_kernel_double_buffering_has_no_dma_races():
    try:
        from jax.experimental.pallas import tpu as pltpu
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interp
    except ImportError:
        pytest.skip("this jax has no TPU interpreter with race detection")
    config = "gqa1"
    q, k, v = _inputs(config, seed=4)
    idx, valid = _select(config, budget=np.array([4, 1, 2]), seed=4)
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
    got = np.asarray(sparse_decode_tpu(q, k, v, idx, valid, POSITIONS, interpret=params, pages_per_block=2))
    assert tpu_interp.races is not None and not tpu_interp.races.races_found
    np.testing.assert_allclose(got, brute_force_sparse_decode(q, k, v, idx, valid, POSITIONS), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kernel", [sparse_decode_tpu, sparse_decode_gpu, sparse_decode_triton, sparse_decode_cpu])
def test_bad_inputs_name_the_tensor(kernel):
    q, k, v = _inputs("gqa4", seed=5)
    idx, valid = _select("gqa4", budget=np.array([1, 1, 1]), seed=5)
    if kernel is sparse_decode_triton:
        pytest.importorskip("jax_triton")
    with pytest.raises(ValueError, match="v_pages"):
        kernel(q, k, v[:, :, :-1], idx, valid, POSITIONS)
    with pytest.raises(ValueError, match="page_valid"):
        kernel(q, k, v, idx, valid[..., :-1], POSITIONS)
    with pytest.raises(ValueError, match="positions"):
        kernel(q, k, v, idx, valid, POSITIONS[:2])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        kernel(q[:, :3], k, v, idx, valid, POSITIONS)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_gpu_kernel_split_k_merge(num_splits):
    """1 split (no merge) and 3 uneven splits, some of them empty for small budgets."""
    config = "gqa1"
    q, k, v = _inputs(config, seed=9)
    idx, valid = _select(config, budget=np.array([4, 0, 1]), seed=9)
    got = sparse_decode_gpu(q, k, v, idx, valid, POSITIONS, interpret=True, pages_per_block=2,
                            num_splits=num_splits)
    np.testing.assert_allclose(np.asarray(got), brute_force_sparse_decode(q, k, v, idx, valid, POSITIONS),
                               atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="num_splits"):
        sparse_decode_gpu(q, k, v, idx, valid, POSITIONS, interpret=True, pages_per_block=2, num_splits=5)


def test_gpu_kernel_rejects_non_power_of_two_block():
    q, k, v = _inputs("gqa4", seed=6)
    idx, valid = _select("gqa4", budget=np.array([1, 1, 1]), seed=6)
    with pytest.raises(ValueError, match="pages_per_block"):
        sparse_decode_gpu(q, k, v, idx, valid, POSITIONS, interpret=True, pages_per_block=3)


def test_triton_path_is_guarded():
    available = triton_available()  # must never raise
    assert isinstance(available, bool)
    if jax.default_backend() != "gpu":
        assert available is False
    try:
        import jax_triton  # noqa: F401
    except ImportError:
        q, k, v = _inputs("gqa4", seed=7)
        idx, valid = _select("gqa4", budget=np.array([1, 1, 1]), seed=7)
        with pytest.raises(RuntimeError, match="jax-triton"):
            sparse_decode_triton(q, k, v, idx, valid, POSITIONS)


def test_device_check_script_agrees_on_cpu_and_catches_wrong_selection():
    """experiments.check_kernels (run on GPUs) passes the kernel here and its reference is discriminating."""
    from experiments.check_kernels import SMALL_SHAPES, check_case, make_case, reference_attention

    row = check_case("pallas_gpu", SMALL_SHAPES["small"], "float32", seed=3, time_it=False)
    assert row["ok"] and row["rel_err"] < 1e-5 and row["rel_err_full_budget_vs_dense"] < 1e-5
    assert 0 < row["selected_pages_per_head"] < SMALL_SHAPES["small"][-1] // 16  # really sparse
    b, h, hkv, d, ctx = SMALL_SHAPES["small"]
    case = make_case(b, h, hkv, d, ctx, jnp.float32, seed=3)
    k = np.asarray(case["k"]).reshape(b, hkv, ctx, d)
    v = np.asarray(case["v"]).reshape(b, hkv, ctx, d)
    mask = np.ones((b, hkv, ctx), bool)
    ref = reference_attention(np.asarray(case["q"]), k, v, mask, d ** -0.5)
    np.testing.assert_allclose(ref, np.asarray(dense_decode(case["q"], case["k"], case["v"], jnp.full((b,), ctx - 1))),
                               rtol=1e-5, atol=1e-6)
    mask[:, :, ctx // 2:] = False  # a different selection must give a clearly different answer
    other = reference_attention(np.asarray(case["q"]), k, v, mask, d ** -0.5)
    assert np.linalg.norm(other - ref) / np.linalg.norm(ref) > 1e-2


def test_cpu_kernel_counts_a_repeated_page_once_and_empty_rows_give_zero():
    """The reference masks pages, so a page listed twice counts once; a row whose selection
    sees no token (every valid page after the position) gives 0 as the Pallas kernels do."""
    q, k, v = _inputs("gqa4", seed=11)
    kernel = _impl("cpu", "gqa4")
    idx = np.zeros((3, 2, N_SLOTS), np.int32)
    valid = np.zeros((3, 2, N_SLOTS), bool)
    idx[:, :, :4] = [2, 0, 2, 1]  # page 2 twice
    valid[:, :, :4] = True
    valid[2] = False
    idx[2, :, 0], valid[2, :, 0] = 5, True  # row 2 decodes at position 0: page 5 is all in its future
    got = np.asarray(kernel(q, k, v, idx, valid, POSITIONS))
    want = brute_force_sparse_decode(q[:2], k[:2], v[:2], idx[:2], valid[:2], POSITIONS[:2])
    np.testing.assert_allclose(got[:2], want, atol=1e-5, rtol=0)
    assert np.array_equal(got[2], np.zeros_like(got[2]))


def test_cpu_kernel_falls_back_without_a_compiler(monkeypatch, tmp_path):
    """No C++ compiler (and an empty build cache): a warning, False, and auto resolves to XLA."""
    from sparrow_jax.attention import cpu_kernel
    from sparrow_jax.attention.decode import resolve_impl

    monkeypatch.setenv("SPARROW_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(cpu_kernel.shutil, "which", lambda name: None)
    cpu_kernel.cpu_kernel_available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
            assert cpu_kernel.cpu_kernel_available() is False
        if jax.default_backend() == "cpu":
            assert resolve_impl("auto") == "xla"
        with pytest.raises(RuntimeError, match="unavailable"):
            sparse_decode_cpu(*_inputs("gqa4", seed=0), *_select("gqa4", np.array([1, 1, 1]), seed=0), POSITIONS)
        assert not list(tmp_path.iterdir())  # nothing half-built left behind
    finally:
        cpu_kernel.cpu_kernel_available.cache_clear()  # the next caller builds / loads again


def test_cpu_kernel_failed_build_warns_and_leaves_no_partial_library(monkeypatch, tmp_path):
    from sparrow_jax.attention import cpu_kernel

    monkeypatch.setenv("SPARROW_JAX_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    cpu_kernel.cpu_kernel_available.cache_clear()
    try:
        with pytest.warns(UserWarning, match="CPU sparse decode kernel unavailable"):
            assert cpu_kernel.cpu_kernel_available() is False
        assert not list(tmp_path.rglob("*.so"))
    finally:
        cpu_kernel.cpu_kernel_available.cache_clear()


@pytest.mark.parametrize("selector", ["centroid", "quest"])
def test_cpu_score_select_equals_score_pages_then_select_pages(selector):
    """The fused C++ score + select gives score_pages + select_pages' slots exactly, per-row
    metadata and a pool read through a page table. Small integers make every score exact in
    float32 whatever the summation order, so ties (broken by page index) are compared too."""
    from sparrow_jax.attention.cpu_kernel import score_select_cpu
    from sparrow_jax.attention.decode import score_select_decode

    if not cpu_kernel_available():
        pytest.skip("no C++ compiler here: the CPU custom call is off")
    rng = np.random.default_rng(1)
    ints = lambda *shape: jnp.asarray(rng.integers(-3, 4, shape).astype(np.float32))  # noqa: E731
    b, hkv, d = 3, 2, 8
    for trial in range(12):
        pages = int(rng.integers(3, 30))
        qg, low = ints(b, hkv, d), ints(b, hkv, pages, d)
        high = low + jnp.abs(ints(b, hkv, pages, d))
        meta = dict(centroid=(low + high) / 2, kmin=low, kmax=high) if selector == "quest" else \
            dict(centroid=low, kmin=None, kmax=None)
        positions = jnp.asarray(rng.integers(0, pages * 4, b), jnp.int32)
        budget = jnp.asarray(rng.integers(-1, 12, b), jnp.int32)
        k_max, first, last = int(rng.integers(0, 12)), int(rng.integers(0, 3)), int(rng.integers(0, 3))
        scores = score_pages(qg, meta["centroid"], meta["kmin"], meta["kmax"], selector)
        want = select_pages(scores, positions[:, None], budget[:, None], k_max, 4, first, last)
        got = score_select_decode(qg, **meta, positions=positions, budget=budget, k_max=k_max, page_size=4,
                                  reserved_first=first, reserved_last=last, selector=selector, impl="cpu")
        # The same metadata as a shuffled pool [NP, Hkv, D] behind a page table [B, P].
        table = rng.permutation(b * pages + 5)[:b * pages].reshape(b, pages).astype(np.int32)
        pooled = {}
        for name, x in meta.items():
            if x is not None:
                pool = np.zeros((b * pages + 5, hkv, d), np.float32)
                pool[table] = np.moveaxis(np.asarray(x), 1, 2)
                pooled[name] = jnp.asarray(pool)
        got_pool = score_select_cpu(qg, pooled.get("centroid"), pooled.get("kmin"), pooled.get("kmax"), positions,
                                    budget, k_max, 4, first, last, selector, page_table=jnp.asarray(table))
        for w, g, gp in zip(want, got, got_pool):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"trial {trial}")
            np.testing.assert_array_equal(np.asarray(gp), np.asarray(w), err_msg=f"pool, trial {trial}")
    with pytest.raises(ValueError, match="metadata must be"):
        score_select_cpu(qg, low[..., :-1], None, None, positions, budget, 2, 4)
    with pytest.raises(Exception, match="outside the pool"):
        jax.block_until_ready(score_select_cpu(qg, pooled["centroid"], None, None, positions, budget, 2, 4,
                                               page_table=jnp.full((b, pages), b * pages + 5, jnp.int32)))


def test_cpu_select_pages_equals_select_pages_slot_for_slot():
    """The C++ selection gives XLA top-k's slots exactly: ragged rows, budgets <= 0 and
    above k_max, ties and signed zeros (XLA orders -0 below +0), any reserved counts."""
    from sparrow_jax.attention.cpu_kernel import select_pages_cpu

    if not cpu_kernel_available():
        pytest.skip("no C++ compiler here: the CPU custom call is off")
    rng = np.random.default_rng(0)
    for trial in range(40):
        pages = int(rng.integers(3, 40))
        scores = rng.standard_normal((3, 2, pages)).astype(np.float32)
        if trial % 2:
            scores = np.round(scores, 1)  # many ties, and -0.0 next to 0.0
        positions = rng.integers(0, pages * 4, 3).astype(np.int32)
        budget = rng.integers(-1, 12, 3).astype(np.int32)
        k_max, first, last = int(rng.integers(0, 12)), int(rng.integers(0, 3)), int(rng.integers(0, 3))
        want = select_pages(jnp.asarray(scores), jnp.asarray(positions)[:, None], jnp.asarray(budget)[:, None],
                            k_max, 4, first, last)
        got = select_pages_cpu(jnp.asarray(scores), jnp.asarray(positions), jnp.asarray(budget), k_max, 4,
                               first, last)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"trial {trial}")
