"""Sampler: HF greedy parity, log-probs, sparse == dense at full budget, compiles, sampling rules."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_utils import make_hf_model
from sparrow_jax.models import decode_step, dense_logits, init_caches, init_params, load_hf, prefill, tiny_config
from sparrow_jax.rollout import SamplingParams, SparsitySchedule, generate, sample_logits
from sparrow_jax.rollout.sampler import first_argmax

CONFIG = tiny_config(num_hidden_layers=2)
PARAMS = init_params(CONFIG, seed=5)


def _teacher_forced_logprobs(config, params, rollout):
    logp = jax.nn.log_softmax(dense_logits(config, params, jnp.asarray(rollout.tokens)), -1)
    out = np.zeros(rollout.tokens.shape, np.float32)
    out[:, 1:] = np.take_along_axis(np.asarray(logp[:, :-1]), rollout.tokens[:, 1:, None], -1)[..., 0]
    return out


def _prompts(sizes, seed=0, vocab=CONFIG.vocab_size):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(3, vocab, n)) for n in sizes]


def test_greedy_matches_hf_generate_and_logprobs_match_teacher_forcing(tmp_path):
    torch = pytest.importorskip("torch")
    hf_model, path = make_hf_model(tmp_path, vocab_size=96, hidden_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   intermediate_size=128, rope_theta=10000.0, max_position_embeddings=512)
    config, params = load_hf(path)
    prompts = _prompts((7, 19, 30), vocab=96)
    rollout = generate(config, params, prompts, jax.random.PRNGKey(0),
                       SamplingParams(max_new_tokens=24, temperature=0.0))
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0].numpy()
        assert rollout.lengths[b] == len(ref)
        np.testing.assert_array_equal(rollout.tokens[b, :len(ref)], ref)
    tf = _teacher_forced_logprobs(config, params, rollout)
    assert np.abs(np.where(rollout.completion_mask, tf - rollout.logprobs, 0)).max() <= 1e-4
    assert rollout.completion_mask.sum() == 3 * 24


def test_sparse_with_full_budget_generates_exactly_dense():
    prompts = _prompts((5, 40, 70))
    sampling = SamplingParams(max_new_tokens=30, temperature=1.0)
    dense = generate(CONFIG, PARAMS, prompts, jax.random.PRNGKey(1), sampling)
    full = SparsitySchedule.fixed(64, page_size=8, dense_layers=())
    sparse = generate(CONFIG, PARAMS, prompts, jax.random.PRNGKey(1), sampling, schedule=full)
    np.testing.assert_array_equal(sparse.tokens, dense.tokens)
    np.testing.assert_allclose(sparse.logprobs, dense.logprobs, atol=1e-5)


def test_compiles_bounded_by_budget_buckets_and_reproducible():
    schedule = SparsitySchedule(topk=(1, 2, 3), bin_width=32, page_size=4, dense_layers=(0,))
    prompts = _prompts((6, 12))
    sampling = SamplingParams(max_new_tokens=80, temperature=1.0)
    first = generate(CONFIG, PARAMS, prompts, jax.random.PRNGKey(2), sampling, schedule=schedule)
    buckets = schedule.k_buckets(int(first.lengths.max()))
    assert 1 <= first.stats["compiles"] <= len(buckets) == 3
    again = generate(CONFIG, PARAMS, prompts, jax.random.PRNGKey(2), sampling, schedule=schedule)
    assert again.stats["compiles"] == 0
    np.testing.assert_array_equal(again.tokens, first.tokens)
    other = generate(CONFIG, PARAMS, prompts, jax.random.PRNGKey(3), sampling, schedule=schedule)
    assert not np.array_equal(other.tokens, first.tokens)


def _greedy_reference(schedule, prompts, steps):
    """Greedy sparse decoding one eager step at a time with the tight k_max (the largest top-k
    any row uses at that step): the computation generate() did before the schedule became data."""
    lens = np.array([len(p) for p in prompts])
    buf = 64
    tokens = np.zeros((len(prompts), buf), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p
    caches = init_caches(CONFIG, len(prompts), buf, page_size=schedule.page_size)
    caches = prefill(CONFIG, PARAMS, jnp.asarray(tokens[:, :int(lens.max())]), jnp.asarray(lens - 1), caches)
    pos = lens - 1
    for _ in range(steps):
        k_max = int(schedule.topk_at(pos).max())
        logits, caches = decode_step(CONFIG, PARAMS, jnp.asarray(tokens[np.arange(len(pos)), pos]),
                                     jnp.asarray(pos, jnp.int32), caches, schedule=schedule, k_max=k_max)
        pos = pos + 1
        tokens[np.arange(len(pos)), pos] = np.asarray(jnp.argmax(logits, -1))
    return tokens


def test_greedy_sparse_generate_matches_tight_k_max_reference():
    """generate() runs each segment at a bucketed k_max >= the tight one with the top-k table as
    data; greedy tokens equal step-by-step decoding at the tight k_max."""
    schedule = SparsitySchedule(topk=(1, 3, 5), bin_width=16, page_size=4, dense_layers=(0,))
    prompts = _prompts((6, 13))
    steps = 36
    assert [k for _, _, k in schedule.decode_segments(np.array([5, 12]), steps)] == [1, 3, 6]  # 5 -> bucket 6
    out = generate(CONFIG, PARAMS, prompts, jax.random.PRNGKey(0),
                   SamplingParams(max_new_tokens=steps, temperature=0.0), schedule=schedule)
    ref = _greedy_reference(schedule, prompts, steps)
    for b, n in enumerate(out.lengths):
        np.testing.assert_array_equal(out.tokens[b, :n], ref[b, :n])


def test_budget_change_within_buckets_compiles_nothing():
    """The top-k table is traced: new budgets with the same layout and k_max buckets reuse the
    compiled decode segments (and change the rollout)."""
    base = SparsitySchedule(topk=(5, 6, 7), bin_width=16, page_size=2, dense_layers=(0,))  # buckets 6, 8
    prompts = _prompts((6, 12))
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0)
    first = generate(CONFIG, PARAMS, prompts, jax.random.PRNGKey(2), sampling, schedule=base)
    outs = []
    for topk in ((6, 6, 8), (5, 5, 7)):
        changed = dataclasses.replace(base, topk=topk)
        out = generate(CONFIG, PARAMS, prompts, jax.random.PRNGKey(2), sampling, schedule=changed)
        assert out.stats["compiles"] == 0, topk
        outs.append(out.tokens)
    assert first.stats["compiles"] >= 1
    assert any(not np.array_equal(o, first.tokens) for o in outs)  # the new budgets are used


def test_stop_tokens_and_length_limits():
    prompts = _prompts((4, 9))
    # Make token 7 a stop token and force the model to emit it: greedy on a biased head.
    params = jax.tree.map(lambda x: x, PARAMS)
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"].at[:, 7].add(50.0)
    out = generate(CONFIG, params, prompts, jax.random.PRNGKey(0),
                   SamplingParams(max_new_tokens=10, temperature=0.0, stop_ids=(7,)))
    assert out.finished.all()
    np.testing.assert_array_equal(out.lengths, [5, 10])  # the stop token is kept, then the row ends
    assert (out.tokens[np.arange(2), out.lengths - 1] == 7).all()
    capped = generate(CONFIG, PARAMS, prompts, jax.random.PRNGKey(0),
                      SamplingParams(max_new_tokens=50, temperature=1.0), max_total_len=20)
    assert capped.lengths.max() <= 20
    with pytest.raises(ValueError, match="prompt 1 has 9 tokens"):
        generate(CONFIG, PARAMS, prompts, jax.random.PRNGKey(0), SamplingParams(), max_total_len=9)


def test_sample_logits_truncation_and_logprob_semantics():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    key = jax.random.PRNGKey(0)
    # top-p 0.7 keeps {0, 1}: renormalised log-probs log(0.5/0.8), log(0.3/0.8)
    seen = set()
    for i in range(40):
        tok, logp = sample_logits(logits, jax.random.fold_in(key, i), SamplingParams(top_p=0.7))
        t = int(tok[0])
        seen.add(t)
        assert abs(float(logp[0]) - np.log([0.5, 0.3][t] / 0.8)) < 1e-5
    assert seen == {0, 1}
    tok, logp = sample_logits(logits, key, SamplingParams(top_k=1))
    assert int(tok[0]) == 0 and abs(float(logp[0])) < 1e-6
    # temperature 2 flattens: p ~ sqrt(p) renormalised
    tok, logp = sample_logits(logits, key, SamplingParams(temperature=2.0))
    p = np.sqrt([0.5, 0.3, 0.15, 0.05])
    assert abs(float(logp[0]) - np.log(p[int(tok[0])] / p.sum())) < 1e-5
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_first_argmax_matches_argmax_with_ties_and_masked_entries():
    rng = np.random.RandomState(0)
    x = rng.randint(0, 4, size=(64, 111)).astype(np.float32)  # many ties: the first index must win
    x[rng.rand(64, 111) < 0.3] = -np.inf  # top-k / top-p masking
    x[5] = -np.inf  # a row with nothing left
    x[6, :] = 2.0
    got = np.asarray(first_argmax(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    noise = jax.random.gumbel(jax.random.PRNGKey(1), (64, 111))
    np.testing.assert_array_equal(np.asarray(first_argmax(noise + x)), np.asarray(jnp.argmax(noise + x, -1)))
