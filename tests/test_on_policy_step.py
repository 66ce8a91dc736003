"""A single on-policy update takes its old log-probs from its own forward: the same step as with
the old policy's separate pass (params, optimiser state, every metric, the mismatch statistics)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparrow_jax.models.config import tiny_config
from sparrow_jax.models.lora import LoraConfig, init_lora
from sparrow_jax.models.qwen3 import init_params
from sparrow_jax.rl.train_step import (Batch, DistillOptions, LoraState, StepOptions, init_train_state, on_policy,
                                       shared_prefix_len, timed_train_step, train_step)
from sparrow_jax.rollout import SparsitySchedule

CONFIG = tiny_config()
SCHEDULE = SparsitySchedule(topk=(1, 2), bin_width=16, page_size=4, dense_layers=(0,))
BASE = StepOptions(num_bins=3, bin_width=16)
CASES = {
    "tis": BASE,
    "micro_batches_kl_entropy": dataclasses.replace(BASE, micro_batches=2, kl_coef=0.1, entropy_coef=0.01,
                                                    loss_agg="seq-mean-token-mean"),
    "sequence_ratio_mask": dataclasses.replace(BASE, tis_level="sequence", tis_mask_bounds=(0.05, 20.0),
                                               dual_clip=3.0),
    "distill": BASE,
}


def _batch(seed=0, b=4, t=40):
    r = np.random.RandomState(seed)
    mask = np.broadcast_to(np.arange(t) >= 12, (b, t)).copy()
    mask[1, 30:] = False  # ragged rows
    return Batch(tokens=jnp.asarray(r.randint(0, CONFIG.vocab_size, (b, t)), jnp.int32),
                 mask=jnp.asarray(mask, jnp.float32),
                 # around the random model's own log-probs (-log V ~ -4.6): TIS weights below and at the cap
                 logp_sampler=jnp.asarray(-4.6 + 2 * r.randn(b, t), jnp.float32),
                 advantages=jnp.asarray(r.randn(b), jnp.float32), prompt_lens=jnp.full((b,), 12, jnp.int32))


def test_on_policy_is_one_update_whose_shares_are_known_first():
    assert on_policy(StepOptions()) and on_policy(StepOptions(micro_batches=4))
    assert on_policy(StepOptions(tis_mask_bounds=(0.5, 2.0)))
    assert not on_policy(StepOptions(ppo_epochs=2)) and not on_policy(StepOptions(mini_batches=2))
    assert not on_policy(StepOptions(micro_batches=2, tis_mask_bounds=(0.5, 2.0)))
    assert not on_policy(StepOptions(separate_old_pass=True))


@pytest.mark.parametrize("case,timed", [("tis", False), ("micro_batches_kl_entropy", True),
                                        ("sequence_ratio_mask", False), ("distill", True)])
def test_fused_old_log_probs_give_the_separate_pass_step(case, timed):
    opts = CASES[case]
    # SGD: the new params compare the gradients themselves (Adam's first step, g / |g|, would turn
    # last-bit differences of near-zero gradient entries into visible ones)
    optimizer = optax.sgd(0.1)
    params = init_params(CONFIG, seed=1)
    kw = dict(config=CONFIG, optimizer=optimizer, schedule=SCHEDULE)
    ref = params if opts.kl_coef > 0 else None
    lora = None
    if case == "distill":
        lora_cfg = LoraConfig(rank=2)
        lora_opt = optax.sgd(0.1)
        lora = init_lora(params, lora_cfg, jax.random.PRNGKey(0))
        kw.update(lora_cfg=lora_cfg, lora_optimizer=lora_opt, distill=DistillOptions(updates=2))
    fresh_lora = lambda: None if lora is None else LoraState(jax.tree.map(jnp.copy, lora), lora_opt.init(lora))
    step = timed_train_step if timed else train_step

    def run(o):
        state = init_train_state(jax.tree.map(jnp.copy, params), optimizer)
        return step(state, _batch(), None, fresh_lora(), ref, opts=o, **kw)

    assert on_policy(opts)
    got, want = run(opts), run(dataclasses.replace(opts, separate_old_pass=True))
    if timed:
        assert got[3]["old_log_prob"] == 0.0 and want[3]["old_log_prob"] > 0
    assert set(got[2]) == set(want[2])
    assert any(k.startswith("rollout_corr/") for k in got[2]) and "mismatch/alpha_mean" in got[2]
    assert 0 < float(got[2]["rollout_corr/rollout_is_mean"]) < 3.0  # weights below and at the cap
    for k in want[2]:
        np.testing.assert_allclose(np.asarray(got[2][k]), np.asarray(want[2][k]), rtol=1e-5, atol=1e-6, err_msg=k)
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), got[0].params, params)
    assert max(jax.tree.leaves(moved)) > 1e-3  # the step did update the policy
    for a, b in zip(jax.tree.leaves((want[0], want[1])), jax.tree.leaves((got[0], got[1]))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("separate_old_pass", [False, True])
@pytest.mark.parametrize("tis_level", ["token", "sequence"])
def test_loss_mask_narrows_the_loss_not_the_statistics(separate_old_pass, tis_level):
    """``Batch.loss_mask`` (completions cut at their reward horizon): the update is the one of a
    batch whose mask is the loss mask, the mismatch statistics those of the full mask. At sequence
    level the TIS ratio is the product over the loss's tokens, on either path: the tokens past the
    horizon do not decide the reward the update weighs."""
    opts = dataclasses.replace(BASE, separate_old_pass=separate_old_pass, tis_level=tis_level)
    optimizer = optax.sgd(0.1)
    params = init_params(CONFIG, seed=1)
    full = _batch()
    cut = np.asarray(full.mask).copy()
    cut[0, 20:], cut[2, 25:] = 0.0, 0.0  # two rows end their loss early
    run = lambda batch: train_step(init_train_state(jax.tree.map(jnp.copy, params), optimizer), batch,
                                   config=CONFIG, optimizer=optimizer, schedule=SCHEDULE, opts=opts)
    both = run(full._replace(loss_mask=jnp.asarray(cut)))
    loss_only = run(full._replace(mask=jnp.asarray(cut)))
    stats_only = run(full)
    for a, b in zip(jax.tree.leaves(both[0].params), jax.tree.leaves(loss_only[0].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(both[0].params),
                                                     jax.tree.leaves(stats_only[0].params)))
    for k in [k for k in both[2] if k.startswith("mismatch/")]:
        np.testing.assert_allclose(np.asarray(both[2][k]), np.asarray(stats_only[2][k]), rtol=1e-6, err_msg=k)


def _long_prompt_batch(seed=2, b=4, t=120):
    """Prompts of 66-90 tokens: a shared prefix of 64 below every row's dense prefill."""
    r = np.random.RandomState(seed)
    prompt_lens = np.array([70, 80, 66, 90], np.int32)[:b]
    mask = np.arange(t)[None, :] >= prompt_lens[:, None]
    mask[1, 110:] = False  # ragged rows
    return Batch(tokens=jnp.asarray(r.randint(0, CONFIG.vocab_size, (b, t)), jnp.int32),
                 mask=jnp.asarray(mask, jnp.float32), logp_sampler=jnp.asarray(-4.6 + 2 * r.randn(b, t), jnp.float32),
                 advantages=jnp.asarray(r.randn(b), jnp.float32), prompt_lens=jnp.asarray(prompt_lens))


@pytest.mark.parametrize("separate_old_pass,timed", [(False, False), (True, True)])
def test_shared_prefix_gives_the_recomputing_step(separate_old_pass, timed):
    """The sparse scorer reading the prompt prefix's keys and values from the dense pass (and the
    dense pass's last layer skipping the prefix's queries): the same update and statistics as
    recomputing every position, within float32 summation order."""
    opts = dataclasses.replace(BASE, separate_old_pass=separate_old_pass, num_bins=8)
    batch = _long_prompt_batch()
    assert shared_prefix_len(np.asarray(batch.prompt_lens), opts=opts, bucket=64) == 64
    optimizer = optax.sgd(0.1)
    params = init_params(CONFIG, seed=1)
    step = timed_train_step if timed else train_step
    run = lambda prefix: step(init_train_state(jax.tree.map(jnp.copy, params), optimizer), batch, config=CONFIG,
                              optimizer=optimizer, schedule=SCHEDULE, opts=opts, shared_prefix=prefix)
    got, want = run(64), run(0)
    assert set(got[2]) == set(want[2]) and float(want[2]["mismatch/alpha_mean"]) < 0.999  # sparsity shows
    for k in want[2]:
        np.testing.assert_allclose(np.asarray(got[2][k]), np.asarray(want[2][k]), rtol=1e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(want[0]), jax.tree.leaves(got[0])):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_shared_prefix_only_where_the_actor_is_the_policy():
    lens = np.array([300, 700])
    assert shared_prefix_len(lens, opts=BASE) == 256 and shared_prefix_len(lens, opts=BASE, bucket=64) == 256
    assert shared_prefix_len(np.array([257, 700]), opts=BASE) == 256
    assert shared_prefix_len(np.array([256, 700]), opts=BASE) == 0  # the prefill ends at 255
    for ruled_out in (dict(distill_lora=True), dict(opts=dataclasses.replace(BASE, remat=True)),
                      dict(opts=dataclasses.replace(BASE, attention_impl="reference"))):
        assert shared_prefix_len(lens, **{"opts": BASE, **ruled_out}) == 0
    params = init_params(CONFIG, seed=1)
    batch = _long_prompt_batch(t=200)
    optimizer = optax.sgd(0.1)
    step = lambda prefix, **kw: timed_train_step(init_train_state(params, optimizer), batch, config=CONFIG,
                                                 optimizer=optimizer, schedule=SCHEDULE,
                                                 **{"opts": BASE, "shared_prefix": prefix, **kw})
    with pytest.raises(ValueError, match="multiple of 64"):
        step(32)
    with pytest.raises(ValueError, match="past a row's dense prompt prefill"):
        step(128)
    with pytest.raises(ValueError, match="the sparse actor to be the policy"):
        step(64, opts=dataclasses.replace(BASE, remat=True))
    with pytest.raises(ValueError, match="the sparse actor to be the policy"):
        step(64, sparse_params=params)
