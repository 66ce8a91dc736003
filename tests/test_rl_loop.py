"""Loop-level RL pieces: DAPO shaping and dynamic sampling, batch collection, reward scoring
with hanging verifiers, non-finite guards. Expected values by hand."""
import time

import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.data import registry
from sparrow_jax.rl.collect import CollectOptions, collect_batch, take_rollout_rows
from sparrow_jax.rl.dynamic_sampling import Round, fill_with_signal, zero_variance_groups
from sparrow_jax.rl.guards import NonFiniteUpdatesError, assert_finite, nonfinite_streak
from sparrow_jax.rl.long_cot import mask_truncated, overlong_penalty, response_length_metrics, truncated
from sparrow_jax.rollout.sampler import Rollout
from test_data import sleepy_reward  # module level in a light module: spawned pool workers import it


def test_overlong_penalty_ramps_in_the_buffer():
    # cap 20, buffer 4: no penalty up to 16, then -(L - 16) / 4 * 0.5 down to -0.5 at 20
    got = overlong_penalty(np.array([3, 16, 17, 18, 20]), max_new_tokens=20, buffer=4, factor=0.5)
    np.testing.assert_allclose(got, [0.0, 0.0, -0.125, -0.25, -0.5])
    np.testing.assert_array_equal(overlong_penalty(np.array([20]), 20, 0, 1.0), [0.0])  # off
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(np.array([1]), 20, 20, 1.0)


def test_truncation_mask_and_length_metrics():
    lens, finished = np.array([5, 8, 8, 2]), np.array([True, False, True, False])
    cut = truncated(lens, finished, max_new_tokens=8)
    np.testing.assert_array_equal(cut, [False, True, False, False])  # at the cap without a stop token
    mask = np.ones((4, 3), np.float32)
    np.testing.assert_array_equal(mask_truncated(mask, cut).sum(axis=1), [3, 0, 3, 3])
    assert response_length_metrics(lens, 8) == {"response_length/mean": 5.75, "response_length/max": 8.0,
                                                 "response_length/min": 2.0, "response_length/clip_ratio": 0.5}


def test_zero_variance_groups():
    np.testing.assert_array_equal(zero_variance_groups(np.array([1, 1, 0, 1, 0.5, 0.5]), 2), [True, False, True])
    with pytest.raises(ValueError, match="group_size=4"):
        zero_variance_groups(np.zeros(6), 4)


def _rounds(*reward_rounds):
    calls = []

    def sample_round(i):
        calls.append(i)
        r = np.asarray(reward_rounds[i], np.float32)
        return Round(np.arange(len(r)) + 100 * i, r)  # rows: ids telling round and row apart

    return sample_round, calls


def _concat(picks):
    return np.concatenate([rows[idx] for rows, idx in picks])


def test_dynamic_sampling_fills_the_batch_with_informative_groups():
    # 2 groups of 2 per step. Round 0: one informative group (1); round 1: group 0 informative.
    sample_round, calls = _rounds([0, 0, 1, 0], [1, 0, 1, 1], [0, 1, 0, 1])
    rows, r, m = fill_with_signal(sample_round, num_groups=2, group_size=2, max_extra_rounds=3, take_rows=_concat)
    assert calls == [0, 1]  # stops as soon as the batch is full
    np.testing.assert_array_equal(rows, [2, 3, 100, 101])
    np.testing.assert_array_equal(r, [1, 0, 1, 0])
    assert m == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/zero_var_share_before": 0.5,
                 "dynamic_sampling/zero_var_share_after": 0.0}


def test_dynamic_sampling_tops_up_with_flat_groups_after_the_round_cap():
    sample_round, calls = _rounds([0, 0, 1, 1], [0, 1, 1, 1], [0, 1, 0, 1])
    rows, r, m = fill_with_signal(sample_round, num_groups=2, group_size=2, max_extra_rounds=1, take_rows=_concat)
    assert calls == [0, 1]
    np.testing.assert_array_equal(rows, [0, 1, 100, 101])  # round 0's first flat group keeps the shape
    assert m["dynamic_sampling/zero_var_share_before"] == 1.0
    assert m["dynamic_sampling/zero_var_share_after"] == 0.5


def _rollout(lens, finished, width, cap):
    b = len(lens)
    mask = np.zeros((b, width), bool)
    for i, n in enumerate(lens):
        mask[i, 2:2 + n] = True
    tokens = np.arange(b * width, dtype=np.int32).reshape(b, width)
    return Rollout(tokens, np.full(b, 2, np.int32), np.asarray(lens, np.int32) + 2, mask,
                   mask.astype(np.float32) * -0.5, np.asarray(finished), {"decode_tokens": sum(lens), "decode_s": 1.0})


def test_take_rollout_rows_pads_to_the_widest_round():
    a, b = _rollout([1, 2], [True, True], 4, 4), _rollout([3, 1], [True, True], 6, 4)
    out = take_rollout_rows([(a, np.array([1])), (b, np.array([0]))])
    assert out.tokens.shape == (2, 6)
    np.testing.assert_array_equal(out.tokens[0], [4, 5, 6, 7, 0, 0])
    np.testing.assert_array_equal(out.completion_mask.sum(axis=1), [2, 3])
    assert out.stats == {"decode_tokens": 7, "decode_s": 2.0}


def test_collect_batch_shapes_rewards_masks_truncation_and_counts():
    cap = 4
    rollout = _rollout([4, 2, 4, 3], [False, True, True, True], 8, cap)
    opts = CollectOptions(num_groups=2, group_size=2, max_new_tokens=cap, overlong_buffer=2, overlong_penalty=1.0,
                          mask_truncated=True)
    out, r, rows_in_loss, m = collect_batch(
        lambda i: (rollout, np.array([1.0, 0.0, 1.0, 1.0]), {"reward/timeouts": 1.0, "reward/errors": 0.0}), opts)
    np.testing.assert_allclose(r, [0.0, 0.0, 0.0, 0.5])  # lengths 4, 2, 4, 3 in a 2-token buffer before cap 4
    np.testing.assert_array_equal(rows_in_loss, [False, True, True, True])  # row 2 stopped at the cap: kept
    assert m["reward/timeouts"] == 1.0 and m["response_length/clip_ratio"] == 0.5


def test_collect_batch_with_a_hanging_verifier_finishes_with_zero_reward_and_a_count():
    """The trainer's scoring path (reward_pool / score / pool_counts): a verifier that hangs
    costs one zero reward and a reward/timeouts count, and the step goes on."""
    from types import SimpleNamespace

    from sparrow_jax.data.registry import Task
    from sparrow_jax.rl.trainer import pool_counts, reward_pool, score

    ctx = SimpleNamespace(task=Task("hang", lambda e, tok: "", sleepy_reward, use_reward_pool=True))
    pool = reward_pool(ctx, num_workers=1, timeout_s=1.0)
    rollout = _rollout([1, 2], [True, True], 4, 4)
    examples = [{"sleep": 0.0, "value": 0.75}, {"sleep": 600.0, "value": 1.0}]

    def sample(i):
        before = pool_counts(pool)
        r = score(ctx, ["a", "b"], examples, pool)
        timeouts, errors = pool_counts(pool) - before
        return rollout, r, {"reward/timeouts": timeouts, "reward/errors": errors}

    try:
        t0 = time.monotonic()
        _, r, _, m = collect_batch(sample, CollectOptions(num_groups=1, group_size=2, max_new_tokens=4))
        assert time.monotonic() - t0 < 120  # worker start-up + one 1 s timeout, not 600 s
    finally:
        pool.close()
    np.testing.assert_array_equal(r, [0.75, 0.0])
    assert m["reward/timeouts"] == 1.0 and m["reward/errors"] == 0.0


def test_partial_credit_reward():
    example = {"reference": "1:ab=cd\nanswer: cd", "answer": "cd"}
    task = registry.get_task("pointer_chase_partial")
    assert task.reward("blah answer: cd", example) == 1.0
    # reference symbols 1 a b c d a n s w e r c d (13); "a1zc<eos>abcd" holds a, 1, c before <eos>
    assert task.reward("a1zc<eos>abcd", example) == pytest.approx(0.5 * 3 / 13)
    assert task.reward("", example) == 0.0


def test_nonfinite_streak_stops_after_the_limit():
    streak = nonfinite_streak(0, 1.0, 3)
    streak = nonfinite_streak(streak, 0.0, 3)  # a clean step resets it
    assert streak == 0
    streak = nonfinite_streak(nonfinite_streak(streak, 2.0, 3), 1.0, 3)
    with pytest.raises(NonFiniteUpdatesError, match="max_nonfinite_steps=3"):
        nonfinite_streak(streak, 1.0, 3)
    assert nonfinite_streak(10, 1.0, 0) == 11  # 0: never stop


def test_assert_finite_names_the_leaf():
    assert_finite({"w": jnp.ones(3), "step": jnp.int32(2)}, "params")
    with pytest.raises(NonFiniteUpdatesError, match=r"params at step 4: .*'w'"):
        assert_finite({"w": jnp.array([1.0, jnp.nan])}, "params at step 4")
