"""CPU decode fast paths vs simple references.

* ``sparse_decode_xla_fast`` (pages gathered in ascending page order) against a NumPy
  float64 brute force and ``sparse_decode_reference``, for slot orders, invalid and
  out-of-range slots, GQA ratios and an explicit scale; its result must not depend on the
  order of the selected slots.
* ``_sorted_selection`` against a NumPy statement of its contract.
* ``decode_step`` with ``impl="xla"`` against ``impl="reference"`` over many decode steps.
* The greedy sampler (which skips the PRNG split) does not depend on the key.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_refs import brute_force_sparse_decode

from sparrow_jax.attention import select_pages, sparse_decode_reference
from sparrow_jax.attention.fast_xla import _sorted_selection, sparse_decode_xla_fast
from sparrow_jax.models import init_params, tiny_config
from sparrow_jax.models.forward import decode_step, init_caches, prefill
from sparrow_jax.rollout import SamplingParams, SparsitySchedule, generate

B, P, S, D = 3, 12, 4, 8
POS = np.array([47, 21, 3], np.int32)  # last slot of the cache, mid page 5, first page


def _inputs(hkv, groups, seed):
    r = np.random.RandomState(seed)
    q = r.randn(B, hkv * groups, D).astype(np.float32)
    k = (2 * r.randn(B, hkv, P, S, D)).astype(np.float32)
    v = r.randn(B, hkv, P, S, D).astype(np.float32)
    return q, k, v


def _random_selection(hkv, n, seed, p_valid=0.7):
    """Distinct pages in random order per (row, head); some slots invalid or out of range."""
    r = np.random.RandomState(seed)
    idx = np.stack([[r.permutation(P)[:n] for _ in range(hkv)] for _ in range(B)]).astype(np.int32)
    valid = r.rand(B, hkv, n) < p_valid
    valid[:, :, 0] = True
    idx[:, :, 0] = POS[:, None] // S  # the current page, so every query sees a key
    idx[0, 0, -1], valid[0, 0, -1] = P + 3, True  # valid but out of range: ignored
    idx[1, -1, -1], valid[1, -1, -1] = -2, True
    return idx, valid


@pytest.mark.parametrize("hkv, groups", [(2, 4), (3, 1)])
def test_fast_sparse_matches_numpy_and_reference(hkv, groups):
    q, k, v = _inputs(hkv, groups, seed=hkv)
    idx, valid = _random_selection(hkv, n=7, seed=groups)
    fast = jax.jit(sparse_decode_xla_fast)
    got = np.asarray(fast(q, k, v, idx, valid, POS))
    np.testing.assert_allclose(got, brute_force_sparse_decode(q, k, v, idx, valid, POS), atol=1e-5, rtol=0)
    ref = np.asarray(sparse_decode_reference(q, k, v, idx, valid, POS))
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
    # An explicit scale reaches the softmax.
    got2 = np.asarray(sparse_decode_xla_fast(q, k, v, idx, valid, POS, scale=0.05))
    np.testing.assert_allclose(got2, brute_force_sparse_decode(q, k, v, idx, valid, POS, scale=0.05), atol=1e-5, rtol=0)
    assert np.abs(got2 - got).max() > 1e-3


def test_fast_sparse_does_not_depend_on_slot_order():
    q, k, v = _inputs(2, 4, seed=7)
    idx, valid = _random_selection(2, n=9, seed=7)
    fast = jax.jit(sparse_decode_xla_fast)
    base = np.asarray(fast(q, k, v, idx, valid, POS))
    r = np.random.RandomState(0)
    for _ in range(3):
        perm = r.permutation(idx.shape[-1])
        out = np.asarray(fast(q, k, v, idx[..., perm], valid[..., perm], POS))
        np.testing.assert_allclose(out, base, atol=1e-6, rtol=0)


def test_fast_sparse_on_real_selection_equals_reference():
    """Selections from select_pages (score order, reserved pages first and last)."""
    q, k, v = _inputs(2, 4, seed=11)
    scores = np.random.RandomState(11).randn(B, 2, P).astype(np.float32)
    for budget in (0, 2, 9):
        idx, valid = select_pages(jnp.asarray(scores), jnp.asarray(POS)[:, None], jnp.full((B, 1), budget),
                                  k_max=9, page_size=S)
        got = np.asarray(sparse_decode_xla_fast(q, k, v, idx, valid, POS))
        want = brute_force_sparse_decode(q, k, v, np.asarray(idx), np.asarray(valid), POS)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"budget {budget}")


def test_sorted_selection_contract():
    r = np.random.RandomState(3)
    num_pages = 10
    idx = r.randint(-3, num_pages + 3, (4, 2, 8)).astype(np.int32)
    valid = r.rand(4, 2, 8) < 0.6
    got_idx, got_valid = (np.asarray(x) for x in jax.jit(_sorted_selection, static_argnums=2)(
        jnp.asarray(idx), jnp.asarray(valid), num_pages))
    for ix in np.ndindex(4, 2):
        keep = sorted(int(p) for p, ok in zip(idx[ix], valid[ix]) if ok and 0 <= p < num_pages)
        n = len(keep)
        assert got_valid[ix].tolist() == [True] * n + [False] * (8 - n), ix
        assert got_idx[ix][:n].tolist() == keep, ix  # ascending, duplicates kept as given
        assert (got_idx[ix][n:] == 0).all(), ix


def test_decode_step_fast_equals_reference_over_many_steps():
    config = tiny_config()
    params = init_params(config, seed=2)
    schedule = SparsitySchedule.fixed(2, page_size=4, dense_layers=(0,))
    b, t, prompt = 2, 48, np.array([9, 17])
    tokens = jnp.asarray(np.random.RandomState(4).randint(0, config.vocab_size, (b, t)))
    caches0 = prefill(config, params, tokens[:, :20], jnp.asarray(prompt), init_caches(config, b, t, page_size=4))
    step = jax.jit(lambda c, x, pos, impl: decode_step(config, params, x, pos, c, schedule, k_max=2, impl=impl),
                   static_argnums=3)
    rows = np.arange(b)
    caches = {"xla": caches0, "reference": caches0}
    for i in range(t - int(prompt.max())):
        pos = jnp.asarray(prompt + i, jnp.int32)
        out = {}
        for impl in caches:
            out[impl], caches[impl] = step(caches[impl], tokens[rows, pos], pos, impl)
        err = np.abs(np.asarray(out["xla"]) - np.asarray(out["reference"])).max()
        assert err <= 1e-4, f"step {i}: fast vs reference logits differ by {err}"


def test_greedy_generation_ignores_the_key_sampling_does_not():
    config = tiny_config(num_hidden_layers=2)
    params = init_params(config, seed=1)
    prompts = [[5, 6, 7, 8, 9], [3, 4]]
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    a = generate(config, params, prompts, jax.random.PRNGKey(0), greedy)
    b = generate(config, params, prompts, jax.random.PRNGKey(1), greedy)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    hot = SamplingParams(max_new_tokens=12, temperature=1.5)
    c = generate(config, params, prompts, jax.random.PRNGKey(0), hot)
    d = generate(config, params, prompts, jax.random.PRNGKey(1), hot)
    assert not np.array_equal(c.tokens, d.tokens)
