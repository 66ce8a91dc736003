"""timed_train_step (the trainer's timing_s/* split) computes what train_step computes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models.config import tiny_config
from sparrow_jax.models.lora import LoraConfig, init_lora
from sparrow_jax.models.qwen3 import init_params
from sparrow_jax.rl.train_step import (TIMING_PARTS, Batch, DistillOptions, LoraState, StepOptions, init_train_state,
                                       make_optimizer, timed_train_step, train_step)
from sparrow_jax.rollout import SparsitySchedule

CONFIG = tiny_config()
SCHEDULE = SparsitySchedule(topk=(1, 2), bin_width=16, page_size=4, dense_layers=(0,))


def _batch(seed=0, b=4, t=40):
    r = np.random.RandomState(seed)
    return Batch(tokens=jnp.asarray(r.randint(0, CONFIG.vocab_size, (b, t)), jnp.int32),
                 mask=jnp.asarray(np.broadcast_to(np.arange(t) >= 12, (b, t)), jnp.float32),
                 logp_sampler=jnp.asarray(-3 * r.rand(b, t), jnp.float32),
                 advantages=jnp.asarray(r.randn(b), jnp.float32), prompt_lens=jnp.full((b,), 12, jnp.int32))


@pytest.mark.parametrize("case", ["sparse_kl_minibatches", "distill"])
def test_timed_step_equals_train_step(case):
    optimizer = make_optimizer(1e-3)
    params = init_params(CONFIG, seed=1)
    kw = dict(config=CONFIG, optimizer=optimizer, schedule=SCHEDULE)
    if case == "distill":
        lora_cfg = LoraConfig(rank=2)
        lora_opt = make_optimizer(1e-3, max_grad_norm=0.0)
        lora = init_lora(params, lora_cfg, jax.random.PRNGKey(0))
        make_lora = lambda: LoraState(jax.tree.map(jnp.copy, lora), lora_opt.init(lora))
        kw.update(opts=StepOptions(num_bins=3, bin_width=16), lora_cfg=lora_cfg, lora_optimizer=lora_opt,
                  distill=DistillOptions(updates=2))
        args = lambda: (None, make_lora(), None)
    else:
        kw.update(opts=StepOptions(num_bins=3, bin_width=16, kl_coef=0.1, mini_batches=2, ppo_epochs=2))
        args = lambda: (None, None, params)
    fresh = lambda: init_train_state(jax.tree.map(jnp.copy, params), optimizer)
    want_state, want_lora, want = train_step(fresh(), _batch(), *args(), **kw)
    got_state, got_lora, got, timings = timed_train_step(fresh(), _batch(), *args(), **kw)
    assert set(timings) == set(TIMING_PARTS) and all(v >= 0 for v in timings.values())
    assert timings["scoring"] > 0 and timings["forward_backward"] > 0 and timings["optimizer"] > 0
    assert (timings["ref"] > 0) == (case != "distill")
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], np.asarray(want[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    # Adam divides each gradient by its own scale, so a near-zero gradient's round-off (the phases
    # are separate programs: other summation orders) can move its update by a few 1e-3 of a step: the
    # states agree within 1% of one step (lr = 1e-3), a missing or extra term moves them by ~lr.
    for a, b in zip(jax.tree.leaves((want_state, want_lora)), jax.tree.leaves((got_state, got_lora))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-2 * 1e-3)
