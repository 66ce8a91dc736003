"""Continuous-batching engine: same rollouts as the fixed-batch sampler, bounded compiles, pooled pages."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models import init_params, tiny_config
from sparrow_jax.rollout import SamplingParams, SparsitySchedule, engine, generate, generate_continuous, sampler
from sparrow_jax.rollout.page_pool import PageAllocator, init_pool

# one xdist worker runs the whole module: its module-scoped fixtures are built once (pytest.ini)
pytestmark = pytest.mark.xdist_group("test_engine")

CONFIG = tiny_config(num_hidden_layers=2)
PARAMS = init_params(CONFIG, seed=5)
SPARSE = SparsitySchedule.from_budget_tokens(40, page_size=4, dense_layers=(), name="test-40")  # top-k 7
ENGINE = dict(max_slots=4, segment_steps=8)  # fewer slots than requests: refills and compaction happen


def _requests(seed, group=2):
    """Ragged requests: 3 prompts sampled ``group`` times each, one single prompt."""
    rng = np.random.RandomState(seed)
    base = [list(rng.randint(3, CONFIG.vocab_size, n)) for n in (5, 14, 30)]
    return [p for p in base for _ in range(group)] + [list(rng.randint(3, CONFIG.vocab_size, 9))]


def _pair(schedule, temperature, seed=0, max_new=24):
    """The same requests through both engines; stop id chosen so that some rows stop early."""
    sampling = SamplingParams(max_new_tokens=max_new, temperature=temperature, stop_ids=(7, 11, 19))
    prompts = _requests(seed)
    key = jax.random.PRNGKey(seed)
    fixed = generate(CONFIG, PARAMS, prompts, key, sampling, schedule=schedule)
    new = generate_continuous(CONFIG, PARAMS, prompts, key, sampling, schedule=schedule, **ENGINE)
    return fixed, new


@pytest.fixture(scope="module", params=[None, SPARSE], ids=["dense", "sparse"])
def greedy_pair(request):
    return request.param, _pair(request.param, 0.0)


def _assert_same_rollout(fixed, new, logprob_atol):
    np.testing.assert_array_equal(new.prompt_lens, fixed.prompt_lens)
    np.testing.assert_array_equal(new.lengths, fixed.lengths)
    np.testing.assert_array_equal(new.tokens, fixed.tokens)
    np.testing.assert_array_equal(new.completion_mask, fixed.completion_mask)
    np.testing.assert_array_equal(new.finished, fixed.finished)
    np.testing.assert_allclose(new.logprobs, fixed.logprobs, atol=logprob_atol)


def test_greedy_token_identical_to_fixed_batch_sampler(greedy_pair):
    _, (fixed, new) = greedy_pair
    lengths = fixed.lengths - fixed.prompt_lens
    assert lengths.min() < lengths.max()  # ragged: some rows stopped early
    _assert_same_rollout(fixed, new, 1e-5)
    # Finished rows stopped costing: fewer row-steps than the fixed batch's rows x steps.
    assert new.stats["slot_steps"] < len(fixed.lengths) * fixed.stats["decode_steps"]
    assert new.stats["segments"] > 1


def test_sampling_same_tokens_and_logprob_semantics():
    fixed, new = _pair(SPARSE, 1.0, seed=1)
    assert (fixed.lengths - fixed.prompt_lens).min() < (fixed.lengths - fixed.prompt_lens).max()
    _assert_same_rollout(fixed, new, 1e-5)  # per-request keys: the draws do not depend on batch-mates


def test_quest_pages_and_pool_metadata_follow_the_selector():
    """A Quest schedule through the engine samples what the fixed sampler samples, and each pool
    holds only the metadata its selector reads (dense: none)."""
    quest = dataclasses.replace(SPARSE, selector="quest")
    fixed, new = _pair(quest, 1.0, seed=3)
    _assert_same_rollout(fixed, new, 1e-5)
    present = {sel: tuple(x is not None for x in init_pool(1, 4, 2, 4, 8, jnp.float32, sel)[0][2:])
               for sel in (None, "centroid", "quest")}
    assert present == {None: (False, False, False), "centroid": (True, False, False), "quest": (False, True, True)}


def test_tied_embedding_reaches_the_loop_row_major_and_samples_the_same():
    """On CPU a tied embedding reaches the decode loop as its own row-major [hidden, V] copy
    (row_major_unembedding); the engine still samples what the fixed sampler samples."""
    tied = tiny_config(num_hidden_layers=2, tie_word_embeddings=True)
    params = init_params(tied, seed=5)
    np.testing.assert_array_equal(engine.row_major_unembedding(tied, params), params["embed_tokens"].T)
    assert engine.row_major_unembedding(CONFIG, PARAMS) is None  # untied: the head is row-major already
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, stop_ids=(7, 11, 19))
    prompts, key = _requests(1), jax.random.PRNGKey(1)
    fixed = generate(tied, params, prompts, key, sampling, schedule=SPARSE)
    new = generate_continuous(tied, params, prompts, key, sampling, schedule=SPARSE, **ENGINE)
    _assert_same_rollout(fixed, new, 1e-5)


@pytest.mark.parametrize("noise_bytes", [1, 3 * 5 * 4 * CONFIG.vocab_size])
def test_sampling_noise_drawn_ahead_in_blocks_draws_the_same_tokens(monkeypatch, noise_bytes):
    """Gumbel noise drawn a step at a time (1 byte: blocks of 1) or in blocks of 3 steps that do
    not divide the segments of 8 (3 steps x batch 4 x 4 bytes x vocab, rounded down: 3) samples
    what the fixed sampler's per-step keys sample."""
    monkeypatch.setattr(sampler, "NOISE_BYTES", noise_bytes)
    assert sampler.draws_ahead(ENGINE["max_slots"], CONFIG.vocab_size, ENGINE["segment_steps"]) == (
        1 if noise_bytes == 1 else 3)
    fixed, new = _pair(SPARSE, 1.0, seed=2)
    _assert_same_rollout(fixed, new, 1e-5)


def test_sample_logits_with_drawn_noise_is_categorical_with_its_key():
    logits = jax.random.normal(jax.random.PRNGKey(0), (6, CONFIG.vocab_size)) * 3
    keys = sampler.request_keys(jax.random.PRNGKey(1), 6)
    generated = jnp.arange(6, dtype=jnp.int32) * 5
    noise = sampler.gumbel_noise(keys, generated, 4, CONFIG.vocab_size)  # [6, 4, V]
    for top_k, top_p in ((0, 1.0), (5, 1.0), (0, 0.8)):
        sampling = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
        for j in range(4):
            with_key = sampler.sample_logits(logits, sampler.token_keys(keys, generated + j), sampling)
            with_noise = sampler.sample_logits(logits, None, sampling, noise=noise[:, j])
            np.testing.assert_array_equal(with_noise[0], with_key[0])
            np.testing.assert_array_equal(with_noise[1], with_key[1])


def test_compiles_bounded_and_a_budget_change_compiles_nothing():
    # No stop ids: rows end at the same places in both runs, so slots and pages evolve alike.
    sampling = SamplingParams(max_new_tokens=16, temperature=0.0)
    first = generate_continuous(CONFIG, PARAMS, _requests(3), jax.random.PRNGKey(3), sampling, schedule=SPARSE,
                                **ENGINE)
    k_buckets, batch_buckets, pool_sizes = 1, 3, 1 + first.stats["pool_grows"]  # top-k 7: bucket 8; batches 4, 2, 1
    # decode segments per (batch, k_max bucket, pool size); prefill per prompt-length bucket;
    # prefill store, page copies and pool growth per pool size.
    assert 0 < first.stats["compiles"] <= (batch_buckets * k_buckets + 3) * pool_sizes + 1
    changed = dataclasses.replace(SPARSE, topk=(8,))  # within the k_max bucket: data, not a new compile
    again = generate_continuous(CONFIG, PARAMS, _requests(4), jax.random.PRNGKey(4), sampling, schedule=changed,
                                **ENGINE)
    assert again.stats["compiles"] == 0


def test_pages_follow_tokens_and_groups_share_prompt_pages(greedy_pair):
    schedule, (fixed, new) = greedy_pair
    page = schedule.page_size if schedule is not None else 16
    fixed_pages = fixed.tokens.shape[0] * fixed.tokens.shape[1] // page
    assert new.stats["peak_pages"] < fixed_pages
    assert new.stats["peak_pages"] < new.stats["pool_pages"]  # page 0 is scratch
    # A prompt sampled 4 times: its full pages are held once, not 4 times.
    prompt = list(range(3, 3 + 8 * page + 1))  # 8 full pages of prompt[:-1]
    sampling = SamplingParams(max_new_tokens=2, temperature=0.0)
    shared = generate_continuous(CONFIG, PARAMS, [prompt] * 4, jax.random.PRNGKey(0), sampling, schedule=schedule,
                                 **ENGINE)
    assert shared.stats["peak_pages"] <= 8 + 4


def test_bad_input_is_named():
    sampling = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_continuous(CONFIG, PARAMS, [[3, 4], []], jax.random.PRNGKey(0), sampling)
    with pytest.raises(ValueError, match="total length cap"):
        generate_continuous(CONFIG, PARAMS, [[3] * 9], jax.random.PRNGKey(0), sampling, max_total_len=9)
    with pytest.raises(ValueError, match="max_slots"):
        generate_continuous(CONFIG, PARAMS, [[3, 4]], jax.random.PRNGKey(0), sampling, max_slots=0)


def test_page_allocator_refcounts():
    pages = PageAllocator(4)
    a = pages.alloc(2)
    assert 0 not in a and pages.in_use == 2
    pages.share(a[:1])
    pages.release(a)
    assert pages.in_use == 1  # the shared page is still held once
    with pytest.raises(MemoryError, match="exhausted"):
        pages.alloc(3)
    pages.grow(8)
    b = pages.alloc(6)
    assert len(set(b)) == 6 and pages.peak == 7
    pages.release(b)
    with pytest.raises(ValueError, match="not allocated"):
        pages.release(b[:1])  # twice
    with pytest.raises(ValueError, match="not allocated"):
        pages.release([0])  # the scratch page
