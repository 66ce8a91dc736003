"""The update cut at the reward horizon (row groups, each cut at its longest loss row) is the
whole-row update: the same new params, loss and metrics as train_step on the same batch."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparrow_jax.models.config import tiny_config
from sparrow_jax.models.qwen3 import init_params
from sparrow_jax.rl.horizon_groups import horizon_row_groups, timed_grouped_train_step
from sparrow_jax.rl.train_step import Batch, StepOptions, init_train_state, train_step
from sparrow_jax.rollout import SparsitySchedule

CONFIG = tiny_config()
SCHEDULE = SparsitySchedule(topk=(1, 2), bin_width=64, page_size=4, dense_layers=(0,))
BASE = StepOptions(num_bins=3, bin_width=64)
T, PROMPT = 300, 12
ENDS = (20, 290, 140, 0, 60, 200, 131, 90)  # where each row's loss ends (0: no loss token)


def _batch(seed=0):
    r = np.random.RandomState(seed)
    b = len(ENDS)
    positions = np.arange(T)
    mask = np.broadcast_to(positions >= PROMPT, (b, T)).copy()
    mask[2, 250:] = False  # a completion that ended before the width
    loss_mask = mask & (positions[None] < np.asarray(ENDS)[:, None])
    return Batch(tokens=jnp.asarray(r.randint(0, CONFIG.vocab_size, (b, T)), jnp.int32),
                 mask=jnp.asarray(mask, jnp.float32),
                 logp_sampler=jnp.asarray(-4.6 + 2 * r.randn(b, T), jnp.float32),
                 advantages=jnp.asarray(r.randn(b), jnp.float32), prompt_lens=jnp.full((b,), PROMPT, jnp.int32),
                 loss_mask=jnp.asarray(loss_mask, jnp.float32))


def test_row_groups_sort_rows_by_loss_end_and_cut_each_group_at_its_longest():
    loss_mask = np.asarray(_batch().loss_mask)
    groups = horizon_row_groups(loss_mask, 4)
    assert [sorted(g.rows.tolist()) for g in groups] == [[0, 3], [4, 7], [2, 6], [1, 5]]
    assert [g.width for g in groups] == [128, 128, 256, T]  # ends 20 / 90 / 140 / 290, up to 128s, at most T
    for g in groups:
        assert not loss_mask[g.rows, g.width:].any()
    assert [g.width for g in horizon_row_groups(loss_mask, 1)] == [T]
    with pytest.raises(ValueError, match="groups=3"):
        horizon_row_groups(loss_mask, 3)


CASES = {
    "dense_kl": (dataclasses.replace(BASE, kl_coef=0.1), None, 4),
    "dense_micro_batches_seq_mean": (dataclasses.replace(BASE, micro_batches=2, loss_agg="seq-mean-token-mean",
                                                         entropy_coef=0.01), None, 2),
    "sparse_sequence_tis": (dataclasses.replace(BASE, tis_level="sequence"), SCHEDULE, 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_grouped_update_is_the_whole_row_update(case):
    opts, schedule, num_groups = CASES[case]
    # SGD: the new params compare the gradients themselves (Adam's first step, g / |g|, would turn
    # last-bit differences of near-zero gradient entries into visible ones)
    optimizer = optax.sgd(0.1)
    params = init_params(CONFIG, seed=1)
    ref = params if opts.kl_coef > 0 else None
    batch = _batch()
    groups = horizon_row_groups(np.asarray(batch.loss_mask), num_groups)
    fresh = lambda: init_train_state(jax.tree.map(jnp.copy, params), optimizer)
    got_state, _, got, timings = timed_grouped_train_step(fresh(), batch, groups, ref, config=CONFIG,
                                                          optimizer=optimizer, schedule=schedule, opts=opts)
    covered = np.zeros((len(ENDS), T), np.float32)
    for g in groups:
        covered[g.rows, :g.width] = 1
    assert got["actor/update_position_share"] == pytest.approx(covered.mean())
    assert covered.mean() < 0.75
    if schedule is None:  # no pass covers positions past the cuts: the rollout_corr metrics cover the groups
        batch = batch._replace(mask=batch.mask * covered)
        assert timings["old_log_prob"] == 0 and timings["scoring"] == 0
    else:
        assert timings["old_log_prob"] > 0 and timings["scoring"] > 0
    assert (timings["ref"] > 0) == (ref is not None)
    want_state, _, want = train_step(fresh(), batch, None, None, ref, config=CONFIG, optimizer=optimizer,
                                     schedule=schedule, opts=opts)
    assert set(got) == set(want) | {"actor/update_position_share"}
    for k in want:
        np.testing.assert_allclose(got[k], np.asarray(want[k]), rtol=2e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(want_state), jax.tree.leaves(got_state)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_grouped_update_refuses_several_updates_and_groups_that_miss_rows():
    optimizer = optax.sgd(0.1)
    params = init_params(CONFIG, seed=1)
    batch = _batch()
    groups = horizon_row_groups(np.asarray(batch.loss_mask), 2)
    with pytest.raises(ValueError, match="single on-policy update"):
        timed_grouped_train_step(init_train_state(params, optimizer), batch, groups, config=CONFIG,
                                 optimizer=optimizer, opts=dataclasses.replace(BASE, ppo_epochs=2))
    with pytest.raises(ValueError, match="must cover the batch's 8 rows"):
        timed_grouped_train_step(init_train_state(params, optimizer), batch, groups[:1], config=CONFIG,
                                 optimizer=optimizer, opts=BASE)


@pytest.mark.heavy
def test_a_run_with_horizon_groups_takes_the_whole_row_step(tmp_path):
    """train.horizon_groups in the loop: one step on recurrence_trace with the loss cut at the reward
    horizon gives the whole-row run's loss and policy, and logs the share of positions it computed."""
    from configs.headline import get_config
    from sparrow_jax.rl.trainer import train
    from sparrow_jax.run.context import build_run_context
    from sparrow_jax.run.specs import parse_spec

    def spec(name, groups):  # the shipped warm-up: rewards differ within groups, so the loss has a gradient
        cfg = get_config()
        cfg.workdir, cfg.steps, cfg.eval_every, cfg.schedule.kind = str(tmp_path / name), 1, 0, "dense"
        cfg.task.num_train, cfg.task.num_eval = 8, 2
        # the shipped warm-up's task knobs (a change would train another), its traces cut at 600 tokens
        cfg.rollout.max_new_tokens, cfg.rollout.prompts_per_step, cfg.rollout.group_size = 600, 2, 4
        cfg.train.horizon_groups = groups
        return parse_spec(cfg)

    ctx = build_run_context(spec("whole", 0))
    whole = train(spec("whole", 0), ctx, progress=False)
    grouped = train(spec("grouped", 2), ctx, progress=False)
    assert "actor/update_position_share" not in whole.history[0]
    assert 0 < grouped.history[0]["actor/update_position_share"] < 1 and whole.history[0]["loss"] != 0
    for k in ("reward_mean", "loss", "actor/kl_loss"):
        np.testing.assert_allclose(grouped.history[0][k], whole.history[0][k], rtol=1e-5, atol=1e-7, err_msg=k)
    # Adam's first moments are 0.1 x the gradients (its first step, g / |g|, would make last-bit
    # differences of near-zero entries a whole step apart in the params)
    moments = lambda run: jax.tree.leaves(run.state.train.opt_state)
    for a, b in zip(moments(whole), moments(grouped)):
        scale = np.abs(np.asarray(a)).max()
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5 * scale)
