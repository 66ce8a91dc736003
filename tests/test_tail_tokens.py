"""train.tail_tokens="loss": the acceptance tail counts the policy loss's tokens (those up to each
completion's reward horizon) in the train step's statistics and in calibration, and nothing else."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.mismatch import calibrate as C
from sparrow_jax.models import init_params, tiny_config
from sparrow_jax.rl.train_step import Batch, StepOptions, init_train_state, make_optimizer, train_step
from sparrow_jax.rollout import SamplingParams, SparsitySchedule

SCHEDULE = SparsitySchedule.fixed(1, page_size=8, bin_width=16, dense_layers=(0,))


def _batch(b=4, t=64, vocab=128):
    rng = np.random.RandomState(3)
    mask = np.zeros((b, t), np.float32)
    mask[:, 20:60] = 1
    loss_mask = mask.copy()
    loss_mask[:, 36:] = 0  # the loss ends early on every row, later on the last
    loss_mask[-1, 36:50] = 1
    return Batch(jnp.asarray(rng.randint(0, vocab, (b, t)), jnp.int32), jnp.asarray(mask),
                 jnp.asarray(-rng.rand(b, t).astype(np.float32) * mask), jnp.asarray(rng.randn(b), jnp.float32),
                 jnp.full((b,), 20, jnp.int32), jnp.asarray(loss_mask))


def _statistics(batch, opts):
    config = tiny_config()
    optimizer = make_optimizer(1e-3)
    state = init_train_state(init_params(config), optimizer)
    metrics = train_step(state, batch, config=config, optimizer=optimizer, schedule=SCHEDULE, opts=opts)[2]
    return {k: np.asarray(v) for k, v in metrics.items() if k.startswith("mismatch/")}


def test_the_step_s_statistics_count_the_loss_tokens():
    batch = _batch()
    opts = StepOptions(num_bins=4, bin_width=16)
    over_loss = _statistics(batch, StepOptions(num_bins=4, bin_width=16, tail_over_loss=True))
    # the reference: the completion-token statistics of a batch whose completions are the loss's tokens
    want = _statistics(batch._replace(mask=batch.loss_mask), opts)
    everything = _statistics(batch, opts)
    assert set(over_loss) == set(want)
    for k in want:
        np.testing.assert_allclose(over_loss[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
    loss_tokens = float(np.asarray(batch.loss_mask).sum())
    counted = sum(float(over_loss[f"mismatch/count/bin_{s}"]) for s in (0, 16, 32, 48))
    assert counted == loss_tokens < sum(float(everything[f"mismatch/count/bin_{s}"]) for s in (0, 16, 32, 48))


def test_calibration_counts_the_tokens_its_mask_keeps():
    config = tiny_config(num_hidden_layers=2, vocab_size=64)
    params = init_params(config, seed=3)
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(3, 64, n)) for n in (20, 40, 60)]
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0)
    schedule = SparsitySchedule.fixed(1, page_size=8, bin_width=64, dense_layers=(0,))
    calls = []

    def first_ten(rollout, first):  # each row's first 10 completion tokens
        calls.append((first, len(rollout.lengths)))
        keep = np.zeros(rollout.tokens.shape, bool)
        for b, start in enumerate(np.asarray(rollout.prompt_lens)):
            keep[b, start:start + 10] = True
        return keep

    run = lambda mask: C.measure_tail(config, params, prompts, schedule, sampling, 2, jax.random.PRNGKey(0),
                                      batch_size=4, token_mask=mask)
    masked, every = run(first_ten), run(None)
    assert calls == [(0, 4), (4, 2)]  # batches of 4 rows: each call names its first row
    assert int(np.sum(masked["count"])) == 6 * 10 and int(np.sum(every["count"])) == 6 * 24
    ones = run(lambda rollout, first: np.ones(rollout.tokens.shape, bool))  # keeps every completion token
    np.testing.assert_array_equal(ones["count"], every["count"])
    np.testing.assert_allclose(ones["p"], every["p"])


def test_the_loss_tail_needs_the_reward_horizon():
    from configs.headline import get_config
    from sparrow_jax.run.specs import ConfigError, parse_spec

    cfg = get_config()
    cfg.train.tail_tokens, cfg.train.reward_horizon_mask, cfg.train.horizon_groups = "loss", False, 0
    with pytest.raises(ConfigError, match="train.tail_tokens.*reward_horizon_mask=True"):
        parse_spec(cfg)


def test_calibration_s_mask_hands_each_batch_its_own_examples(monkeypatch):
    """The rows of a calibration are its examples in order, each samples_per_prompt times: a batch
    from row ``first`` on gets the reward horizons of exactly its rows."""
    from configs.headline import get_config
    from sparrow_jax.run import calibration
    from sparrow_jax.run.specs import parse_spec

    cfg = get_config()
    cfg.train.tail_tokens = "loss"
    cfg.calibration.samples_per_prompt = 2
    got = []
    monkeypatch.setattr(calibration, "reward_horizon_mask",
                        lambda ctx, rollout, rows, width: got.append((rows, width)) or np.ones((len(rows), width)))
    rollout = type("Rollout", (), {"lengths": np.zeros(3), "tokens": np.zeros((3, 7))})()
    mask = calibration.tail_token_mask(parse_spec(cfg), None, ["a", "b", "c"])
    assert mask(rollout, 1).shape == (3, 7) and got == [(["a", "b", "b"], 7)]
    cfg.train.tail_tokens = "completion"
    assert calibration.tail_token_mask(parse_spec(cfg), None, ["a"]) is None
