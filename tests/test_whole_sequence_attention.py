"""The whole-sequence attention entry: every fast path (blockwise XLA, the C++ CPU kernel)
against the XLA reference (values and gradients, f32, max abs diff <= 1e-5) on ragged lengths,
GQA, per-query page sets, queries reading no key and dense prompt prefixes; the per-backend
dispatch; bad input. CPU, tiny shapes."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.attention import whole_sequence
from sparrow_jax.attention.blockwise import _Pages, _plan, blockwise_attention, default_block
from sparrow_jax.attention.contract import selected_page_mask
from sparrow_jax.attention.flash_cpu import flash_attention_cpu
from sparrow_jax.attention.whole_sequence import resolve_causal_impl, whole_sequence_attention
from sparrow_jax.models.config import tiny_config
from sparrow_jax.models.forward import dense_hidden, dense_hidden_and_prefix_kv, sparse_hidden
from sparrow_jax.models.qwen3 import init_params
from sparrow_jax.rollout.schedule import SparsitySchedule

TOL = 1e-5


def _inputs(seed, b=2, t=45, hkv=2, g=2, d=8):
    r = np.random.RandomState(seed)
    q, k, v, w = (r.randn(*s).astype(np.float32) for s in
                  [(b, t, hkv * g, d), (b, t, hkv, d), (b, t, hkv, d), (b, t, hkv * g, d)])
    return q, k, v, w


def _value_and_grads(attend, q, k, v, w):
    """(output, d<out * w>/dq, dk, dv): a random cotangent, so every output element's gradient counts."""
    out = attend(q, k, v)
    grads = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * w), argnums=(0, 1, 2))(q, k, v)
    return (out, *grads)


def _max_diffs(a, b):
    return [float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b)]


@pytest.mark.parametrize("t, block, b", [(45, 8, 2), (45, 16, 3), (13, 64, 2), (64, 16, 4)])  # ragged and exact
def test_blockwise_dense_matches_reference(t, block, b):  # tiles, one tile; rows in pairs (CPU) and an odd count
    q, k, v, w = _inputs(0, b=b, t=t)
    ref = jax.jit(lambda *a: _value_and_grads(functools.partial(whole_sequence_attention, impl="reference",
                                                                chunk=7), *a))(q, k, v, w)
    got = jax.jit(lambda *a: _value_and_grads(functools.partial(blockwise_attention, block=block), *a))(q, k, v, w)
    assert max(_max_diffs(ref, got)) <= TOL


def _random_selection(seed, b, hkv, t, page, n, sparse_union):
    """Per-query page sets [B, Hkv, T, N]: the current page always, plus random earlier pages
    (``sparse_union``: only pages 0-1, so most key tiles hold no selected page and are skipped)."""
    r = np.random.RandomState(seed)
    cur = np.arange(t) // page
    hi = 2 if sparse_union else cur.max() + 1
    idx = r.randint(0, hi, (b, hkv, t, n))
    idx = np.minimum(idx, cur[None, None, :, None])  # never a page past the query's
    valid = r.rand(b, hkv, t, n) < 0.7
    idx[..., 0], valid[..., 0] = np.broadcast_to(cur, (b, hkv, t)), True
    return jnp.asarray(idx, jnp.int32), jnp.asarray(valid)


@pytest.mark.parametrize("sparse_union", [False, True])
@pytest.mark.parametrize("block", [8, 32])
def test_blockwise_paged_matches_reference(sparse_union, block):
    b, t, hkv, page = 2, 45, 2, 4
    q, k, v, w = _inputs(1, b=b, t=t, hkv=hkv)
    idx, valid = _random_selection(2, b, hkv, t, page, 5, sparse_union)
    dense_before = jnp.array([10, 0], jnp.int32)  # row 0: a dense prompt prefix; row 1: none
    kw = dict(page_idx=idx, page_valid=valid, page_size=page, dense_before=dense_before)
    ref = jax.jit(lambda *a: _value_and_grads(functools.partial(whole_sequence_attention, impl="reference",
                                                                chunk=5, **kw), *a))(q, k, v, w)
    got = jax.jit(lambda *a: _value_and_grads(functools.partial(whole_sequence_attention, impl="blockwise",
                                                                chunk=block, **kw), *a))(q, k, v, w)
    assert max(_max_diffs(ref, got)) <= TOL
    # the page sets matter: dense attention differs from both
    dense = jax.jit(functools.partial(blockwise_attention, block=block))(q, k, v)
    assert float(jnp.max(jnp.abs(dense - got[0]))) > 1e-2


def test_paged_blocks_visit_no_tile_past_their_diagonal():
    """A dense prompt prefix allows every page, later ones too; the causal mask drops those, so a
    query block's tile list stops at its diagonal (a prompt block costs what a dense one does)."""
    b, hkv, t, page, block = 2, 2, 64, 4, 16
    idx, valid = _random_selection(3, b, hkv, t, page, 3, False)
    all_prompt = _Pages(idx, valid, jnp.full((b,), t, jnp.int32))
    assert [int(_plan(i, all_prompt, block, page, t).count) for i in range(t // block)] == [1, 2, 3, 4]
    # pages 0-1 only (and each query's own): block 3 visits tiles 0 and 3, not 1 and 2
    idx, valid = _random_selection(3, b, hkv, t, page, 3, True)
    assert int(_plan(3, _Pages(idx, valid, None), block, page, t).count) == 2


def test_default_block_is_a_multiple_of_the_page():
    assert default_block() == 64 and default_block(16) == 64  # CPU
    assert default_block(48) == 96 and default_block(128) == 128


@pytest.mark.parametrize("selector", ["centroid", "quest"])
def test_sparse_hidden_fast_paths_match_reference_with_grads(selector):
    """The sparse scorer end to end (per-query page selection, dense prompt prefix, a dense layer):
    hidden states and parameter gradients of the fast path equal the reference's. Parameter
    gradients sum over every token (entries up to ~1e2), so their bound is relative to each
    leaf's largest entry (f32 summation order alone moves them by a few 1e-6 of it)."""
    config = tiny_config(num_hidden_layers=3)
    params = init_params(config, seed=3)
    schedule = SparsitySchedule(topk=(0, 2, 3), bin_width=16, page_size=4, dense_layers=(0,), selector=selector)
    tokens = jnp.asarray(np.random.RandomState(4).randint(0, config.vocab_size, (2, 42)), jnp.int32)
    prompt_lens = jnp.array([9, 14], jnp.int32)
    w = jnp.asarray(np.random.RandomState(5).randn(2, 42, config.hidden_size), jnp.float32)

    def run(impl):
        f = lambda p: sparse_hidden(config, p, tokens, schedule, k_max=3, prompt_lens=prompt_lens, impl=impl,
                                    chunk=8)
        return f(params), jax.grad(lambda p: jnp.sum(f(p) * w))(params)

    h_ref, g_ref = jax.jit(lambda: run("reference"))()
    for impl in ("blockwise", "cpu"):
        h_got, g_got = jax.jit(lambda: run(impl))()
        assert float(jnp.max(jnp.abs(h_ref - h_got))) <= TOL
        for ref, got in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_got)):
            assert float(jnp.max(jnp.abs(ref - got))) <= TOL * max(1.0, float(jnp.max(jnp.abs(ref))))


def test_auto_on_cpu_is_the_cpu_kernel(monkeypatch):
    q, k, v, _ = _inputs(6)
    resolve = functools.partial(resolve_causal_impl, dtype=jnp.float32, seq_len=45, platform="cpu")
    assert resolve("auto", head_dim=8, paged=False) == "cpu"
    assert resolve("auto", head_dim=8, paged=True, page_size=16) == "cpu"
    assert resolve("auto", head_dim=12, paged=False) == "blockwise"  # not whole 8-float vectors
    assert resolve("auto", head_dim=8, paged=True, page_size=48) == "blockwise"  # pages across its tiles
    np.testing.assert_array_equal(np.asarray(whole_sequence_attention(q, k, v)),
                                  np.asarray(flash_attention_cpu(q, k, v)))
    monkeypatch.setattr(whole_sequence, "flash_cpu_supports", lambda head_dim: False)  # kernel not built
    assert resolve("auto", head_dim=8, paged=False) == "blockwise"


@pytest.mark.parametrize("b, t, hkv, g, d", [(2, 45, 2, 2, 8), (3, 64, 1, 4, 16), (1, 130, 2, 1, 40),
                                             (1, 900, 2, 2, 32)])
def test_cpu_kernel_dense_matches_reference(b, t, hkv, g, d):
    """Ragged, one exact tile, three tiles (GQA, MHA), and 15 tiles at the quickstart's head shape:
    dK / dV sum over hundreds of queries, so their float32 rounding must stay a blockwise sum's."""
    q, k, v, w = _inputs(9, b=b, t=t, hkv=hkv, g=g, d=d)
    ref = jax.jit(lambda *a: _value_and_grads(functools.partial(whole_sequence_attention, impl="reference",
                                                                chunk=32), *a))(q, k, v, w)
    got = jax.jit(lambda *a: _value_and_grads(functools.partial(whole_sequence_attention, impl="cpu"), *a))(
        q, k, v, w)
    assert max(_max_diffs(ref, got)) <= TOL


@pytest.mark.parametrize("sparse_union, page", [(False, 4), (True, 4), (False, 16)])
def test_cpu_kernel_paged_matches_reference(sparse_union, page):
    b, t, hkv = 2, 150, 2
    q, k, v, w = _inputs(10, b=b, t=t, hkv=hkv)
    idx, valid = _random_selection(11, b, hkv, t, page, 5, sparse_union)
    valid = valid.at[1, 0, 70:74].set(False)  # queries that read no key: output 0, no gradient
    dense_before = jnp.array([70, 0], jnp.int32)  # row 0: a dense prompt prefix across tiles; row 1: none
    kw = dict(page_idx=idx, page_valid=valid, page_size=page, dense_before=dense_before)
    ref = jax.jit(lambda *a: _value_and_grads(functools.partial(whole_sequence_attention, impl="reference",
                                                                chunk=32, **kw), *a))(q, k, v, w)
    got = jax.jit(lambda *a: _value_and_grads(functools.partial(whole_sequence_attention, impl="cpu", **kw), *a))(
        q, k, v, w)
    assert max(_max_diffs(ref, got)) <= TOL
    assert float(jnp.max(jnp.abs(got[0][1, 70:74, :2]))) == 0.0
    dense = flash_attention_cpu(q, k, v)
    assert float(jnp.max(jnp.abs(dense - got[0]))) > 1e-2  # the page sets matter


def test_cpu_kernel_bf16_inputs_compute_in_float32():
    q, k, v, _ = (jnp.asarray(x, jnp.bfloat16) for x in _inputs(12, t=70))
    got = whole_sequence_attention(q, k, v, impl="cpu")
    ref = whole_sequence_attention(*(x.astype(jnp.float32) for x in (q, k, v)), impl="reference")
    assert got.dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref))) <= 1e-2  # one bf16 rounding of the output


def test_cpu_kernel_rejects_what_it_cannot_take():
    q, k, v, _ = _inputs(13)
    with pytest.raises(ValueError, match="head_dim a multiple of 8"):
        flash_attention_cpu(q[..., :6], k[..., :6], v[..., :6])
    idx, valid = _random_selection(14, 2, 2, 45, 4, 3, False)
    with pytest.raises(ValueError, match="page_size dividing 64"):
        flash_attention_cpu(q, k, v, page_idx=idx, page_valid=valid, page_size=48)
    with pytest.raises(ValueError, match="page_idx and page_valid must both be"):
        flash_attention_cpu(q, k, v, page_idx=idx[:, :, :40], page_valid=valid[:, :, :40], page_size=4)
    with pytest.raises(ValueError, match="dense_before needs page_idx"):
        flash_attention_cpu(q, k, v, dense_before=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="needs a CPU"):
        resolve_causal_impl("cpu", dtype=jnp.float32, head_dim=8, seq_len=45, paged=False, platform="gpu")


def test_dispatch_per_backend(monkeypatch):
    resolve = functools.partial(resolve_causal_impl, head_dim=128, seq_len=8192)
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert resolve("auto", dtype=bf16, paged=False, platform="gpu") == "cudnn"
    assert resolve("auto", dtype=jnp.float16, paged=False, platform="gpu") == "cudnn"
    assert resolve("auto", dtype=f32, paged=False, platform="gpu") == "blockwise"  # cuDNN: half precision only
    assert resolve_causal_impl("auto", dtype=bf16, head_dim=256, seq_len=8192, paged=False,
                               platform="gpu") == "blockwise"
    assert resolve("auto", dtype=bf16, paged=True, platform="gpu") == "blockwise"  # page sets
    monkeypatch.setattr(whole_sequence, "_pallas_tpu_flash", lambda: object())
    assert resolve("auto", dtype=bf16, paged=False, platform="tpu") == "pallas_tpu"
    assert resolve_causal_impl("auto", dtype=bf16, head_dim=128, seq_len=1000, paged=False,
                               platform="tpu") == "blockwise"  # not a multiple of 128
    monkeypatch.setattr(whole_sequence, "_pallas_tpu_flash", lambda: None)  # a jax without the kernel
    assert resolve("auto", dtype=bf16, paged=False, platform="tpu") == "blockwise"
    assert resolve("reference", dtype=bf16, paged=True, platform="tpu") == "reference"


@pytest.mark.parametrize("impl, platform, paged, match", [
    ("flash", "cpu", False, "unknown causal attention implementation 'flash'"),
    ("cudnn", "cpu", False, "needs a GPU"),
    ("pallas_tpu", "gpu", False, "needs a TPU"),
    ("cudnn", "gpu", True, "takes no per-query page sets"),
])
def test_dispatch_rejects_what_cannot_run(impl, platform, paged, match):
    with pytest.raises(ValueError, match=match):
        resolve_causal_impl(impl, dtype=jnp.bfloat16, head_dim=128, seq_len=256, paged=paged, platform=platform)


def test_blockwise_rejects_bad_page_sets():
    q, k, v, _ = _inputs(7)
    idx, valid = _random_selection(8, 2, 2, 45, 4, 3, False)
    with pytest.raises(ValueError, match="page_idx and page_valid must both be"):
        blockwise_attention(q, k, v, page_idx=idx[:, :, :40], page_valid=valid[:, :, :40], page_size=4)
    with pytest.raises(ValueError, match="block=10 must be a multiple of page_size=4"):
        blockwise_attention(q, k, v, block=10, page_idx=idx, page_valid=valid, page_size=4)
    with pytest.raises(ValueError, match="dense_before needs page_idx"):
        blockwise_attention(q, k, v, dense_before=jnp.zeros((2,), jnp.int32))


@pytest.mark.parametrize("selector", ["centroid", "quest"])
def test_sparse_page_selection_cpu_select_is_xla_page_set_in_page_order(selector):
    """The sparse scorer's per-query top-k by the C++ radix select selects XLA's top-k pages, in
    ascending page order with the valid slots first (budgets above, at and below the candidates;
    a ragged last query block)."""
    from sparrow_jax.models.forward import sparse_page_selection

    r = np.random.RandomState(15)
    q, k = jnp.asarray(r.randn(2, 90, 4, 8), jnp.float32), jnp.asarray(r.randn(2, 90, 2, 8), jnp.float32)
    budget = jnp.asarray(r.randint(0, 9, (2, 90)), jnp.int32)
    schedule = SparsitySchedule(topk=(4,), bin_width=16, page_size=4, selector=selector)
    xla = sparse_page_selection(q, k, budget, 6, schedule, block=32)
    cpu = sparse_page_selection(q, k, budget, 6, schedule, block=32, cpu_select=True)
    as_set = lambda sel: np.asarray(selected_page_mask(*sel, 23))  # noqa: E731  [B, Hkv, T, pages]
    np.testing.assert_array_equal(as_set(cpu), as_set(xla))
    idx, valid = np.asarray(cpu[0]), np.asarray(cpu[1])
    count = valid.sum(-1, keepdims=True)
    assert np.all(valid == (np.arange(valid.shape[-1]) < count))  # valid slots first
    assert np.all(np.where(valid[..., 1:], np.diff(idx, axis=-1) > 0, True))  # ascending pages
    assert np.all(np.where(valid, True, idx == 0))
    assert int(jnp.sum(xla[1])) > 2 * 90  # the selection is not all reserved pages


@pytest.mark.parametrize("impl", ["blockwise", "cpu"])  # every non-CPU path shares blockwise's zeroing
@pytest.mark.parametrize("paged", [False, True])
def test_queries_from_gives_the_later_rows_and_their_gradients(impl, paged):
    """``queries_from``: rows below it are 0 and contribute no gradient; every later row, and the
    gradient of any function of them, equals the full attention's (the CPU kernel skips the
    first query blocks forward and backward)."""
    b, t, hkv, start = 2, 150, 2, 64
    q, k, v, w = _inputs(15, b=b, t=t, hkv=hkv)
    kw = {}
    if paged:
        idx, valid = _random_selection(16, b, hkv, t, 4, 5, False)
        kw = dict(page_idx=idx, page_valid=valid, page_size=4, dense_before=jnp.array([100, 20], jnp.int32))
    later = (np.arange(t) >= start)[None, :, None, None]
    full = jax.jit(lambda *a: _value_and_grads(functools.partial(whole_sequence_attention, impl="reference",
                                                                 chunk=32, **kw), *a))(q, k, v, w * later)
    got = jax.jit(lambda *a: _value_and_grads(functools.partial(whole_sequence_attention, impl=impl,
                                                                queries_from=start, **kw), *a))(q, k, v, w)
    assert float(jnp.max(jnp.abs(got[0][:, :start]))) == 0.0
    assert max(_max_diffs((full[0] * later, *full[1:]), got)) <= TOL
    assert float(jnp.max(jnp.abs(got[1][:, :start]))) == 0.0  # no query gradient below it


def test_cpu_kernel_rejects_queries_from_off_its_tiles():
    q, k, v, _ = _inputs(17, t=150)
    for bad in (32, 192, -64):
        with pytest.raises(ValueError, match="queries_from must be a multiple of 64"):
            flash_attention_cpu(q, k, v, queries_from=bad)


def test_sparse_hidden_from_the_dense_prefix_kv_matches_the_full_scorer():
    """The sparse scorer from the dense pass's prompt-prefix keys and values: its hidden states of
    the later positions equal the full scorer's, and the dense pass's own later hidden states
    (its last layer skipping the prefix's queries) equal :func:`dense_hidden`'s. Ragged prompts,
    the prefix below every row's dense prefill, a dense layer among sparse ones. On the CPU kernel,
    the path the trainer takes (``shared_prefix_len`` is 0 with the reference attention)."""
    impl = "cpu"
    config = tiny_config(num_hidden_layers=3)
    params = init_params(config, seed=7)
    schedule = SparsitySchedule(topk=(1, 2, 3), bin_width=32, page_size=8, dense_layers=(1,), selector="quest")
    tokens = jnp.asarray(np.random.RandomState(8).randint(0, config.vocab_size, (3, 200)), jnp.int32)
    prompt_lens = jnp.array([70, 130, 66], jnp.int32)
    prefix = 64
    full = sparse_hidden(config, params, tokens, schedule, prompt_lens=prompt_lens, impl=impl)
    hidden, kv = dense_hidden_and_prefix_kv(config, params, tokens, prefix, impl=impl)
    assert len(kv) == 3 and kv[0][0].shape == (3, prefix, 2, config.head_dim)
    assert float(jnp.max(jnp.abs(hidden - dense_hidden(config, params, tokens, impl=impl)[:, prefix:]))) <= TOL
    got = sparse_hidden(config, params, tokens, schedule, prompt_lens=prompt_lens, impl=impl, prefix_kv=kv)
    assert got.shape == (3, 200 - prefix, config.hidden_size)
    assert float(jnp.max(jnp.abs(got - full[:, prefix:]))) <= TOL
    assert float(jnp.max(jnp.abs(got - hidden))) > 1e-3  # sparse attention did change them
