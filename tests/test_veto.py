"""train.tis_veto: a sparse rollout's row with a loss token whose ratio p_policy / p_sampler is below
the threshold leaves the update, and its group's advantages are those of the rows kept."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.rl.advantages import group_advantages
from sparrow_jax.rl.losses import token_veto


def test_token_veto_rejects_rows_with_a_masked_token_below_the_threshold():
    rng = np.random.RandomState(0)
    logp_sampler = np.log(rng.uniform(0.05, 1.0, (6, 10))).astype(np.float32)
    logp_policy = logp_sampler + rng.uniform(-0.5, 0.5, (6, 10)).astype(np.float32)
    logp_policy[1, 4] = logp_sampler[1, 4] + np.log(0.05)  # a token the policy rates 20x below the sampler
    logp_policy[2, 9] = logp_sampler[2, 9] + np.log(0.05)  # the same, outside row 2's mask
    logp_policy[3, 0] = logp_sampler[3, 0] + np.log(0.2)  # below 1 but above the threshold
    mask = np.ones((6, 10), np.float32)
    mask[2, 8:] = 0
    got = np.asarray(token_veto(logp_policy, logp_sampler, mask, 0.1))
    want = ((logp_policy - logp_sampler < np.log(0.1)) & (mask > 0)).any(-1)  # the reference
    np.testing.assert_array_equal(got, want)
    assert got.tolist() == [False, True, False, False, False, False]
    assert np.asarray(token_veto(logp_policy, logp_sampler, mask, 0.3))[3]


@pytest.mark.parametrize("threshold", [0.0, 1.0, 1.5])
def test_token_veto_refuses_a_threshold_outside_0_1(threshold):
    with pytest.raises(ValueError, match="threshold must be in"):
        token_veto(np.zeros((2, 3)), np.zeros((2, 3)), np.ones((2, 3)), threshold)


def test_token_veto_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="logp_sampler has shape"):
        token_veto(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3)), 0.1)


@pytest.mark.parametrize("mode", ["grpo", "drgrpo"])
def test_kept_rows_get_their_own_group_s_advantages(mode):
    rng = np.random.RandomState(1)
    rewards = rng.rand(16).astype(np.float32)
    keep = np.array([1, 0, 1, 1] + [1, 1, 1, 1] + [0, 1, 0, 0] + [0, 0, 0, 0], bool)
    got = np.asarray(group_advantages(jnp.asarray(rewards), 4, mode=mode, keep=keep))
    want = np.zeros(16, np.float32)
    for g in range(4):  # the reference: plain GRPO over each group's kept rows
        rows = [i for i in range(4 * g, 4 * g + 4) if keep[i]]
        if len(rows) >= 2:
            r = rewards[rows]
            want[rows] = (r - r.mean()) / ((r.std(ddof=1) + 1e-6) if mode == "grpo" else 1.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    every = np.asarray(group_advantages(jnp.asarray(rewards), 4, mode=mode, keep=np.ones(16, bool)))
    np.testing.assert_allclose(every, np.asarray(group_advantages(jnp.asarray(rewards), 4, mode=mode)), rtol=1e-6)


@pytest.mark.parametrize("mode", ["grpo", "drgrpo"])
def test_the_all_rows_baseline_zeroes_only_the_rejected_rows(mode):
    """veto_baseline="all": each group's mean and std over all its rows, so a lone kept row keeps its advantage."""
    rng = np.random.RandomState(2)
    rewards = rng.rand(12).astype(np.float32)
    keep = np.array([1, 0, 0, 0] + [1, 1, 0, 1] + [0, 0, 0, 0], bool)
    got = np.asarray(group_advantages(jnp.asarray(rewards), 4, mode=mode, keep=keep, veto_baseline="all"))
    r = rewards.reshape(3, 4)  # the reference: plain GRPO over whole groups, then the rejected rows zeroed
    plain = (r - r.mean(1, keepdims=True)) / ((r.std(1, ddof=1, keepdims=True) + 1e-6) if mode == "grpo" else 1.0)
    np.testing.assert_allclose(got, np.where(keep, plain.reshape(12), 0.0), rtol=1e-5, atol=1e-6)
    assert got[0] != 0  # the kept rows' own baseline would give this lone row nothing
    with pytest.raises(ValueError, match="veto_baseline must be one of"):
        group_advantages(jnp.asarray(rewards), 4, keep=keep, veto_baseline="mean")
    with pytest.raises(ValueError, match="keep must be bool"):
        group_advantages(jnp.asarray(rewards), 4, keep=keep[:8], veto_baseline="all")


def test_kept_lone_samples_keep_verl_s_advantage_and_a_bad_keep_is_refused():
    rewards = jnp.asarray([0.3, 0.7, 0.1])
    got = np.asarray(group_advantages(rewards, 1, keep=np.array([True, False, True])))
    np.testing.assert_allclose(got, [0.3, 0.0, 0.1], rtol=1e-6)
    with pytest.raises(ValueError, match="keep must be bool"):
        group_advantages(rewards, 1, keep=np.array([True, False]))


def test_the_veto_needs_a_threshold_below_1_the_group_baseline_and_a_horizon_for_its_line():
    from configs.grpo_tiny import get_config
    from sparrow_jax.run.specs import ConfigError, parse_spec

    cfg = get_config()
    cfg.train.tis_veto = 1.0
    with pytest.raises(ConfigError, match="train.tis_veto.*must be < 1"):
        parse_spec(cfg)
    cfg.train.tis_veto, cfg.train.adv_baseline = 0.1, "prefix"
    with pytest.raises(ConfigError, match="train.tis_veto.*adv_baseline='group'"):
        parse_spec(cfg)
    cfg.train.adv_baseline, cfg.train.tis_veto_tokens = "group", "horizon_line"
    with pytest.raises(ConfigError, match="train.tis_veto_tokens.*reward_horizon_mask=True"):
        parse_spec(cfg)


def _collected_with_and_without_the_veto(cfg, veto_tokens: str, veto_baseline: str = "kept"):
    """The same rollouts collected without and with the veto (same policy and key), at a threshold
    between two rows' lowest ratios over the veto's tokens (scored by hand), near the median.
    -> (plain batch, vetoed batch, veto metrics, bool [B] rows the hand scoring keeps, group size,
    float [B, T] the tokens the veto read)"""
    from sparrow_jax.rl.train_step import policy_loss_mask, policy_logprobs
    from sparrow_jax.rl.trainer import collect, horizon_line_mask, init_state, make_loop
    from sparrow_jax.run.context import build_run_context
    from sparrow_jax.run.specs import parse_spec

    cfg.train.adv_mode = "drgrpo"  # advantages are rewards minus a baseline
    spec = parse_spec(cfg)
    ctx = build_run_context(spec)
    loop = make_loop(spec, ctx)
    state = init_state(loop)
    key = jax.random.PRNGKey(5)
    plain, plain_metrics, _ = collect(loop, state, key)
    assert "rollout_corr/rollout_is_veto_fraction" not in plain_metrics
    read = np.asarray(policy_loss_mask(plain))
    if veto_tokens == "horizon_line":  # rebuild the rollout's rows to find each row's first wrong line
        from types import SimpleNamespace

        from sparrow_jax.rl.trainer import next_examples
        examples, _ = next_examples(loop, state)
        g = spec.rollout.group_size
        tokens = np.asarray(plain.tokens)
        lengths = np.asarray(plain.prompt_lens) + np.asarray(plain.mask).sum(-1).astype(int)
        rollout = SimpleNamespace(tokens=tokens, prompt_lens=np.asarray(plain.prompt_lens), lengths=lengths)
        read = read * horizon_line_mask(ctx, rollout, [e for e in examples for _ in range(g)], tokens.shape[1])
    logp = policy_logprobs(state.train.params, plain.tokens, config=ctx.model_config, opts=loop.opts)
    log_ratio = np.where(read > 0, np.asarray(logp) - np.asarray(plain.logp_sampler), np.inf)
    lowest = np.unique(log_ratio.min(-1))  # rows of a group can share their lowest token: ties
    lowest = lowest[lowest < 0]
    split = len(lowest) // 2  # a threshold between two rows' lowest ratios vetoes some rows, not all
    assert split >= 1
    threshold = float(np.exp((lowest[split - 1] + lowest[split]) / 2))

    train = dataclasses.replace(spec.train, tis_veto=threshold, tis_veto_tokens=veto_tokens,
                                tis_veto_baseline=veto_baseline)
    batch, metrics, _ = collect(make_loop(dataclasses.replace(spec, train=train), ctx), state, key)
    np.testing.assert_array_equal(np.asarray(batch.tokens), np.asarray(plain.tokens))
    return plain, batch, metrics, log_ratio.min(-1) >= np.log(threshold), spec.rollout.group_size, read


def _assert_vetoed_rows_leave_and_groups_rebase(plain, batch, metrics, kept, g):
    from sparrow_jax.rl.train_step import policy_loss_mask

    assert 0 < kept.sum() < len(kept)
    assert metrics["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(1 - kept.mean())
    assert metrics["timing_s/veto"] > 0
    assert metrics["rollout_corr/rows_with_advantage"] == pytest.approx(np.mean(np.asarray(batch.advantages) != 0))
    np.testing.assert_array_equal(np.asarray(batch.loss_mask), np.asarray(policy_loss_mask(plain)) * kept[:, None])
    adv, adv_plain = np.asarray(batch.advantages), np.asarray(plain.advantages)
    for rows in np.arange(len(kept)).reshape(-1, g):
        k = rows[kept[rows]]
        if len(k) < 2:
            np.testing.assert_array_equal(adv[rows], 0.0)
            continue
        np.testing.assert_array_equal(adv[rows[~kept[rows]]], 0.0)
        np.testing.assert_allclose(adv[k] - adv[k[0]], adv_plain[k] - adv_plain[k[0]], atol=1e-6)
        assert abs(adv[k].sum()) < 1e-5


def test_a_collected_batch_drops_the_vetoed_rows_and_rebases_their_groups(tmp_path):
    """Veto over every loss token: the vetoed rows are those whose lowest loss-token ratio (the policy
    scored by hand) is below the threshold; they leave the loss and get advantage 0, and each group's
    kept rows keep their reward differences and sum to 0."""
    from configs.grpo_tiny import get_config

    cfg = get_config()  # sparse rollouts (a fixed top-k) on a tiny random model
    cfg.workdir = str(tmp_path)
    _assert_vetoed_rows_leave_and_groups_rebase(*_collected_with_and_without_the_veto(cfg, "loss")[:5])


def test_with_the_all_rows_baseline_kept_rows_keep_their_unvetoed_advantages(tmp_path):
    """tis_veto_baseline=all: the vetoed rows leave the loss with advantage 0, and every kept row keeps the
    advantage it had without the veto (its group's baseline is over all of its rows)."""
    from configs.grpo_tiny import get_config
    from sparrow_jax.rl.train_step import policy_loss_mask

    cfg = get_config()
    cfg.workdir = str(tmp_path)
    plain, batch, metrics, kept, g, _ = _collected_with_and_without_the_veto(cfg, "loss", veto_baseline="all")
    assert 0 < kept.sum() < len(kept)
    np.testing.assert_array_equal(np.asarray(batch.loss_mask), np.asarray(policy_loss_mask(plain)) * kept[:, None])
    adv, adv_plain = np.asarray(batch.advantages), np.asarray(plain.advantages)
    np.testing.assert_array_equal(adv, np.where(kept, adv_plain, 0.0))
    assert metrics["rollout_corr/rows_with_advantage"] == pytest.approx(np.mean(adv != 0))


def test_the_horizon_line_veto_reads_each_row_s_first_wrong_line(tmp_path):
    """tis_veto_tokens=horizon_line with the shipped headline warm-up (its rows get lines right before
    the first wrong one, so that line is a strict part of the loss): the vetoed rows are those whose
    first wrong line holds a token below the threshold."""
    from configs.headline import get_config

    cfg = get_config()  # recurrence_trace, the loss cut at the reward horizon
    cfg.workdir, cfg.schedule.kind, cfg.schedule.topk = str(tmp_path), "fixed", 4
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_new_tokens = 4, 4, 96
    cfg.train.kl_coef, cfg.train.horizon_groups = 0.0, 0
    plain, batch, metrics, kept, g, read = _collected_with_and_without_the_veto(cfg, "horizon_line")
    from sparrow_jax.rl.train_step import policy_loss_mask
    assert (read.sum(-1) < np.asarray(policy_loss_mask(plain)).sum(-1)).any()  # not the whole loss span
    _assert_vetoed_rows_leave_and_groups_rebase(plain, batch, metrics, kept, g)


def test_policy_logprobs_are_the_dense_logits_log_softmax_at_the_next_token():
    from sparrow_jax.models import init_params, tiny_config
    from sparrow_jax.models.forward import dense_logits
    from sparrow_jax.rl.train_step import StepOptions, policy_logprobs

    config = tiny_config(num_hidden_layers=2, vocab_size=64)
    params = init_params(config, seed=2)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 64, (4, 24)), jnp.int32)
    got = np.asarray(policy_logprobs(params, tokens, config=config, opts=StepOptions(temperature=0.7), chunks=2))
    logits = np.asarray(dense_logits(config, params, tokens), np.float64) / 0.7
    logp_all = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = np.zeros((4, 24))
    want[:, 1:] = np.take_along_axis(logp_all[:, :-1], np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
