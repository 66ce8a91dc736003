"""Trainer: compile-once train step, config validation, SIGKILL + resume of experiments.run."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.grpo_tiny import get_config
from sparrow_jax.run.specs import ConfigError, parse_spec
from sparrow_jax.models import init_params, tiny_config
from sparrow_jax.rl.train_step import Batch, StepOptions, init_train_state, make_optimizer, train_step
from sparrow_jax.rollout import SparsitySchedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batch(seed, b=4, t=48, vocab=128):
    rng = np.random.RandomState(seed)
    mask = np.zeros((b, t), np.float32)
    mask[:, 20:40] = 1
    return Batch(jnp.asarray(rng.randint(0, vocab, (b, t)), jnp.int32), jnp.asarray(mask),
                 jnp.asarray(-rng.rand(b, t).astype(np.float32) * mask), jnp.asarray(rng.randn(b), jnp.float32),
                 jnp.full((b,), 20, jnp.int32))


def test_train_step_compiles_once_and_updates_params():
    """One compilation for three steps whose schedules differ only in budgets within one k_max
    bucket (the top-k table is traced)."""
    config = tiny_config()
    optimizer = make_optimizer(1e-3)
    state = init_train_state(init_params(config), optimizer)
    before = jax.tree.map(lambda x: np.asarray(x).copy(), state.params)
    base = SparsitySchedule(topk=(1, 2), page_size=8, bin_width=16, dense_layers=(0,))
    schedules = [base, dataclasses.replace(base, topk=(2, 2)), dataclasses.replace(base, topk=(0, 2))]
    assert len({s.k_max for s in schedules}) == 1
    opts = StepOptions(micro_batches=2, num_bins=3, bin_width=16)
    n0 = train_step._cache_size()
    for seed, schedule in enumerate(schedules):
        state, metrics = train_step(state, _batch(seed), config=config, optimizer=optimizer,
                                    schedule=schedule, opts=opts)
    assert train_step._cache_size() - n0 == 1
    assert int(state.step) == 3
    assert np.isfinite(float(metrics["loss"]))
    assert 0.0 < float(metrics["mismatch/alpha_p5/bin_32"]) <= 1.0
    changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before, state.params)
    assert all(jax.tree.leaves(changed))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_give_the_full_batch_update(agg):
    """Gradient accumulation over micro-batches with unequal token counts equals one full batch
    (a plain mean of micro-batch means would over-weight the short micro-batch)."""
    import optax

    config = tiny_config()
    optimizer = optax.sgd(1.0)  # params move by exactly -grad: compares the accumulated gradients
    params = init_params(config, seed=3)
    batch = _batch(5)
    mask = np.zeros(batch.mask.shape, np.float32)
    mask[0, 20:44] = mask[1, 20:40] = 1  # micro-batch 1: 44 tokens
    mask[2, 20:23] = 1  # micro-batch 2: 3 tokens, one empty row
    batch = batch._replace(mask=jnp.asarray(mask))
    results = []
    for n in (1, 2):
        state = init_train_state(jax.tree.map(jnp.array, params), optimizer)
        state, metrics = train_step(state, batch, config=config, optimizer=optimizer, schedule=None,
                                    opts=StepOptions(micro_batches=n, loss_agg=agg))
        results.append((float(metrics["loss"]), state.params))
    assert abs(results[0][0] - results[1][0]) < 1e-6
    diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), results[0][1], results[1][1])
    assert max(jax.tree.leaves(diffs)) < 1e-6
    assert max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), params,
                                            results[0][1]))) > 1e-4  # the step did move the params


def test_mismatch_bins_count_a_token_at_its_query_position():
    """Token 32 is sampled by the query at 31: with 16-wide bins it counts in bin 16, as in
    calibration, not in bin 32."""
    config = tiny_config()
    optimizer = make_optimizer(1e-3)
    state = init_train_state(init_params(config), optimizer)
    batch = _batch(7)
    only_32 = np.zeros(batch.mask.shape, np.float32)
    only_32[:, 32] = 1
    batch = batch._replace(mask=jnp.asarray(only_32))
    schedule = SparsitySchedule.fixed(1, page_size=8, bin_width=16, dense_layers=(0,))
    _, metrics = train_step(state, batch, config=config, optimizer=optimizer, schedule=schedule,
                            opts=StepOptions(micro_batches=2, num_bins=3, bin_width=16))
    assert int(metrics["mismatch/count/bin_16"]) == batch.tokens.shape[0]
    assert int(metrics["mismatch/count/bin_32"]) == 0


def test_invalid_config_names_the_field():
    cfg = get_config()
    cfg.train.loss_agg = "token-sum"
    with pytest.raises(ConfigError, match="--config.train.loss_agg"):
        parse_spec(cfg)
    cfg = get_config()
    cfg.rollout.max_new_tokens = 0
    with pytest.raises(ConfigError, match="--config.rollout.max_new_tokens"):
        parse_spec(cfg)


def _run(workdir, steps):
    cmd = [sys.executable, "-m", "experiments.run", "--config", "configs/grpo_tiny.py",
           f"--config.workdir={workdir}", f"--config.steps={steps}", "--config.checkpoint_every=2",
           "--config.rollout.max_new_tokens=12", "--config.task.num_eval=2", "--config.eval_k=2"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigkill_mid_run_then_resume_finishes(tmp_path):
    workdir = tmp_path / "run"
    proc = _run(workdir, steps=6)
    marker = workdir / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        steps = [d for d in os.listdir(marker) if (marker / d / "sparrow_commit.json").exists()] if marker.exists() else []
        if steps:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc = _run(workdir, steps=6)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "resumed from checkpoint at step" in out
    steps = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
    assert steps == list(range(1, 7))
    report = json.load(open(workdir / "report.json"))
    assert {"reward_start", "reward_end", "p5_by_bin", "tau", "rollout_speedup"} <= set(report)


def test_distill_sparse_step_isolates_gradients():
    import optax
    from sparrow_jax.models.lora import LoraConfig, init_lora
    from sparrow_jax.rl.train_step import DistillOptions, LoraState

    config = tiny_config()
    optimizer, lora_opt = make_optimizer(1e-3), optax.adam(1e-2)
    params = init_params(config, seed=2)
    schedule = SparsitySchedule.fixed(1, page_size=8, bin_width=16, dense_layers=(0,))
    opts = StepOptions(num_bins=3, bin_width=16)
    lora_cfg = LoraConfig(rank=4)
    lora = init_lora(params, lora_cfg, jax.random.PRNGKey(0))
    copy = lambda t: jax.tree.map(lambda x: jnp.array(x, copy=True), t)
    plain, _ = train_step(init_train_state(copy(params), optimizer), _batch(0), config=config,
                          optimizer=optimizer, schedule=schedule, opts=opts)
    adapters = {}
    for kl, updates in (("exact", 1), ("exact_reverse", 1), ("k3", 1), ("exact_reverse", 3)):
        state, lora_state, metrics = train_step(
            init_train_state(copy(params), optimizer), _batch(0), None, LoraState(copy(lora), lora_opt.init(lora)),
            config=config, optimizer=optimizer, schedule=schedule, opts=opts, lora_cfg=lora_cfg,
            lora_optimizer=lora_opt, distill=DistillOptions(kl=kl, kl_coef=0.1, updates=updates))
        adapters[kl, updates] = lora_state.lora
        # the policy update ignores L_LoRA entirely; the adapter moves
        same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), plain.params, state.params)
        assert all(jax.tree.leaves(same))
        moved = [not np.array_equal(np.asarray(a), np.asarray(b))
                 for a, b in zip(jax.tree.leaves(lora), jax.tree.leaves(lora_state.lora))]
        assert any(moved)
        assert float(metrics["distill/grad_norm"]) > 0
    # three LoRA updates on the batch go further than one (and the policy is still untouched)
    further = [not np.allclose(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(adapters["exact_reverse", 1]), jax.tree.leaves(adapters["exact_reverse", 3]))]
    assert any(further)


def test_distill_updates_shrink_the_mismatch_they_train_on():
    """LoRA-only updates (zero advantages: both PPO terms vanish) lower KL(sparse || dense) and
    raise the acceptance rate of the LoRA-aided sparse actor on the batch they train on."""
    import optax
    from sparrow_jax.models.lora import LoraConfig, init_lora
    from sparrow_jax.rl.train_step import DistillOptions, LoraState

    config = tiny_config()
    optimizer, lora_opt = make_optimizer(1e-3), optax.adam(3e-3)
    # weights 8x the init scale: peaked attention and logits, so dropped pages change the output
    params = jax.tree.map(lambda x: x * 8 if x.ndim == 2 else x, init_params(config, seed=3))
    schedule = SparsitySchedule.fixed(1, page_size=8, bin_width=16, dense_layers=(0,))
    lora_cfg = LoraConfig(rank=4)
    lora = init_lora(params, lora_cfg, jax.random.PRNGKey(1))
    state, lora_state = init_train_state(params, optimizer), LoraState(lora, lora_opt.init(lora))
    batch = _batch(1)._replace(advantages=jnp.zeros((4,), jnp.float32))
    kl, alpha = [], []
    for _ in range(16):
        state, lora_state, metrics = train_step(
            state, batch, None, lora_state, config=config, optimizer=optimizer, schedule=schedule,
            opts=StepOptions(num_bins=3, bin_width=16), lora_cfg=lora_cfg, lora_optimizer=lora_opt,
            distill=DistillOptions(kl="exact_reverse", kl_coef=1.0))
        kl.append(float(metrics["distill/kl"]))
        alpha.append(float(metrics["mismatch/alpha_mean"]))
    assert kl[-1] < 0.5 * kl[0]
    assert alpha[-1] > alpha[0]


def _tiny_spec(workdir, steps, **distill):
    cfg = get_config()
    cfg.workdir, cfg.steps, cfg.checkpoint_every, cfg.eval_k = str(workdir), steps, 1, 2
    cfg.task.context_tokens, cfg.task.num_train, cfg.task.num_eval = 64, 8, 2
    cfg.rollout.max_new_tokens, cfg.rollout.prompts_per_step, cfg.rollout.group_size = 6, 2, 2
    for k, v in distill.items():
        setattr(cfg.distill, k, v)
    return parse_spec(cfg)


def test_loop_state_resumes_exactly(tmp_path):
    """Two steps straight vs one step, a restart from the checkpoint, one more step: the same
    losses, rewards and final loop state (policy, LoRA, optimiser moments, data position, key)."""
    from sparrow_jax.rl.trainer import train
    from sparrow_jax.run.context import build_run_context

    distill = dict(enabled=True, rank=2)
    ctx = build_run_context(_tiny_spec(tmp_path / "a", 2, **distill))
    straight = train(_tiny_spec(tmp_path / "a", 2, **distill), ctx, progress=False)
    first = train(_tiny_spec(tmp_path / "b", 1, **distill), ctx, progress=False)
    resumed = train(_tiny_spec(tmp_path / "b", 2, **distill), ctx, progress=False)
    assert [h["step"] for h in first.history + resumed.history] == [1, 2]
    for want, got in zip(straight.history, first.history + resumed.history):
        for k in ("loss", "reward_mean", "distill/kl", "mismatch/alpha_mean"):
            assert want[k] == got[k], (k, want["step"])
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), straight.state, resumed.state)
    assert all(jax.tree.leaves(same)) and int(resumed.state.data[1]) == 4  # 2 steps x 2 prompts of 8


def test_a_task_that_asks_for_a_reward_pool_is_scored_in_it():
    import dataclasses
    from types import SimpleNamespace

    from sparrow_jax.data.registry import Task
    from sparrow_jax.data.rewards import RewardPool
    from sparrow_jax.rl.trainer import reward_pool, score

    task = Task("len", lambda e, tok: e["prompt"], lambda c, e: float(len(c)), use_reward_pool=True)
    pool = reward_pool(SimpleNamespace(task=task))
    assert isinstance(pool, RewardPool)
    pool.close()
    assert reward_pool(SimpleNamespace(task=dataclasses.replace(task, use_reward_pool=False))) is None
    with RewardPool(lambda c, e: 10.0 * len(c), num_workers=0) as in_process:  # marks what the pool scored
        np.testing.assert_array_equal(score(SimpleNamespace(task=task), ["ab", "c"], [{}, {}], in_process), [20, 10])
    np.testing.assert_array_equal(score(SimpleNamespace(task=task), ["ab", "c"], [{}, {}]), [2, 1])
