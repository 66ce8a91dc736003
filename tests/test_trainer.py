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
        state, _, metrics = train_step(state, _batch(seed), config=config, optimizer=optimizer,
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
        state, _, metrics = train_step(state, batch, config=config, optimizer=optimizer, schedule=None,
                                    opts=StepOptions(micro_batches=n, loss_agg=agg))
        results.append((float(metrics["loss"]), state.params))
    assert abs(results[0][0] - results[1][0]) < 1e-6
    diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), results[0][1], results[1][1])
    assert max(jax.tree.leaves(diffs)) < 1e-6
    assert max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), params,
                                            results[0][1]))) > 1e-4  # the step did move the params


def test_bf16_params_train_and_accumulate_like_float32():
    """bf16 parameters (and compute) train: params and optimiser state keep their dtype, and the
    micro-batch gradient sum, accumulated in float32, gives the one-batch update."""
    import optax

    config = dataclasses.replace(tiny_config(), dtype="bfloat16", param_dtype="bfloat16")
    optimizer = optax.sgd(50.0)  # params move by -50 x grad: visible above bf16 rounding
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(config, seed=3))
    fresh = lambda: init_train_state(jax.tree.map(jnp.array, params), optimizer)  # the step donates its state
    got, _, metrics = train_step(fresh(), _batch(5), config=config, optimizer=optimizer, schedule=None,
                                 opts=StepOptions(micro_batches=2))
    assert {x.dtype for x in jax.tree.leaves(got.params)} == {jnp.dtype(jnp.bfloat16)}
    assert np.isfinite(float(metrics["loss"]))
    one, _, _ = train_step(fresh(), _batch(5), config=config, optimizer=optimizer,
                           schedule=None, opts=StepOptions(micro_batches=1))
    moved = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
             for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(params))]
    assert max(moved) > 1e-3  # the update is not lost to bf16 rounding
    # two micro-batches vs one (bf16 compute rounds each pass differently): the same update within 10%
    flat = lambda tree: np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(tree)])
    upd2, upd1 = flat(got.params) - flat(params), flat(one.params) - flat(params)
    assert np.linalg.norm(upd2 - upd1) <= 0.1 * np.linalg.norm(upd1)


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
    _, _, metrics = train_step(state, batch, config=config, optimizer=optimizer, schedule=schedule,
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
    for field, value, match in (("mini_batches", 3, "train.mini_batches"), ("ppo_epochs", 0, "train.ppo_epochs"),
                                ("tis_mask_low", 2.0, "train.tis_mask_low"),
                                ("overlong_buffer", 24, "train.overlong_buffer"),
                                ("seq_mean_rows", "rows", "train.seq_mean_rows")):
        cfg = get_config()
        cfg.train[field] = value
        if field == "tis_mask_low":
            cfg.train.tis_mask_high = 1.5
        with pytest.raises(ConfigError, match=match):
            parse_spec(cfg)


def test_step_options_from_config():
    from sparrow_jax.rl.trainer import step_options

    cfg = get_config()
    opts = step_options(parse_spec(cfg).train, 1.0, bin_width=64, max_len=100)
    assert (opts.ppo_epochs, opts.mini_batches, opts.kl_coef, opts.tis_mask_bounds, opts.global_rows) == (1, 1, 0, None,
                                                                                                       False)
    cfg.train.update(ppo_epochs=2, mini_batches=4, kl_coef=0.1, kl_kind="k2", tis_mask_low=0.5, tis_mask_high=2.0)
    opts = step_options(parse_spec(cfg).train, 1.0, bin_width=64, max_len=100)
    assert (opts.ppo_epochs, opts.mini_batches, opts.kl_coef, opts.kl_kind) == (2, 4, 0.1, "k2")
    assert opts.tis_mask_bounds == (0.5, 2.0) and opts.global_rows  # auto: verl's divisor when masking is on
    cfg.train.seq_mean_rows = "valid"
    assert not step_options(parse_spec(cfg).train, 1.0, bin_width=64, max_len=100).global_rows


def _run(workdir, steps):
    cmd = [sys.executable, "-m", "experiments.run", "--config", "configs/grpo_tiny.py",
           f"--config.workdir={workdir}", f"--config.steps={steps}", "--config.checkpoint_every=2",
           "--config.rollout.max_new_tokens=12", "--config.task.num_eval=2", "--config.eval_k=2",
           "--config.eval_every=2"]
    # The killed, the resumed and the finished process run the same programs: a compilation cache
    # beside the workdir lets the later ones load them (half of a process's time here is compiling).
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(workdir.parent / "xla_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.heavy
def test_sigkill_mid_run_then_resume_finishes_and_a_rerun_touches_nothing(tmp_path):
    """SIGKILL after the first checkpoint (step 2), resume: every step logged once, the report
    rebuilt from the logs (validation at steps 0, 2, 4 from both processes, the pooled tail, the
    paired speedup); the same command once more prints the report, exits 0 and writes nothing."""
    workdir = tmp_path / "run"
    proc = _run(workdir, steps=4)
    marker = workdir / "checkpoints"
    deadline, steps = time.time() + 900, []
    while time.time() < deadline and proc.poll() is None:
        steps = [d for d in os.listdir(marker) if (marker / d / "sparrow_commit.json").exists()] if marker.exists() else []
        if steps:
            break
        time.sleep(0.5)
    assert proc.poll() is None and steps, proc.stdout.read() if proc.poll() is not None else "no checkpoint in 900 s"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    from experiments.summary import summarize

    text, plot = summarize(str(workdir))  # a killed run: the figures of the steps it logged
    logged = [r["step"] for r in map(json.loads, open(workdir / "metrics.jsonl")) if "reward_mean" in r]
    assert f"at step {len(logged)} of 4" in text and "dense validation" in text and plot.endswith("reward.png")
    proc = _run(workdir, steps=4)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    assert "resumed from checkpoint at step" in out
    steps = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
    assert steps == list(range(0, 5))  # step 0: the validation before any update
    report = json.load(open(workdir / "report.json"))
    for side in ("val_dense", "val_sparse"):
        assert [p["step"] for p in report[side]["steps"]] == [0, 2, 4]
        assert report[side]["end"] == report[side]["steps"][-1]["reward_mean@2"]
    assert report["trained_steps"] == 4 and report["reward_window_steps"] == 3
    assert sum(b["count"] for b in report["p5_by_bin"]) > 0 and all(0 < b["p5"] <= 1 for b in report["p5_by_bin"])
    assert report["sparse_token_fraction"] == 0.75  # every token sparse on 3 of 4 layers (layer 0 is dense)
    assert report["speedup_timed_compiles"] == 0  # the timed rollouts reuse the untimed run's programs
    paired = report["rollout_speedup_paired"]
    assert 0 < paired["min"] <= paired["median"] == report["rollout_speedup"] <= paired["max"]
    text, _ = summarize(str(workdir))
    assert "finished" in text and f"{report['rollout_speedup']:.2f}x" in text
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in workdir.rglob("*") if p.is_file()}
    proc = _run(workdir, steps=4)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    assert "has finished its 4 steps" in out and json.dumps(report["val_dense"]) in out
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in workdir.rglob("*") if p.is_file()} == files


def test_reward_windows_are_one_pass_over_cycled_prompts():
    from sparrow_jax.data.datasets import PromptIterator
    from sparrow_jax.run.report import reward_start_end, reward_window

    assert reward_window(16, 4, 24) == 4  # 6 passes of 4 steps
    assert reward_window(18, 4, 10) == 5  # a pass of 18 prompts spans 5 steps; two fit in 10
    assert reward_window(18, 4, 9) == 3 and reward_window(256, 4, 12) == 3  # under two passes: 3 steps
    # the premise: the trainer's iterator shows the first and the last pass the same prompts
    it = PromptIterator(list(range(16)), 4, seed=0)
    batches = [it.next_indices() for _ in range(24)]
    first, last = (sorted(i for b in w for i in b) for w in (batches[:4], batches[-4:]))
    assert first == last == list(range(16)) and batches[:4] != batches[-4:]
    out = reward_start_end([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], 4)
    assert out["reward_window_steps"] == 4
    se = np.sqrt(2 * np.var([0.1, 0.2, 0.3, 0.4], ddof=1) / 4)
    np.testing.assert_allclose([out["reward_start"], out["reward_end"], out["reward_change_se"]], [0.25, 0.65, se])
    assert reward_start_end([0.3], 3)["reward_change_se"] is None


@pytest.mark.heavy
def test_distill_sparse_step_isolates_gradients():
    import optax
    from sparrow_jax.models.lora import LoraConfig, init_lora
    from sparrow_jax.rl.train_step import DistillOptions, LoraState

    config = tiny_config()
    optimizer, lora_opt = optax.sgd(1.0), optax.adam(1e-2)  # SGD: round-off stays round-off (Adam scales it to lr)
    params = init_params(config, seed=2)
    schedule = SparsitySchedule.fixed(1, page_size=8, bin_width=16, dense_layers=(0,))
    opts = StepOptions(num_bins=3, bin_width=16)
    lora_cfg = LoraConfig(rank=4)
    lora = init_lora(params, lora_cfg, jax.random.PRNGKey(0))
    copy = lambda t: jax.tree.map(lambda x: jnp.array(x, copy=True), t)
    plain, _, _ = train_step(init_train_state(copy(params), optimizer), _batch(0), config=config,
                          optimizer=optimizer, schedule=schedule, opts=opts)
    adapters = {}
    # the KL kinds' per-token values are tested on their own (test_mismatch_measures, test_rl_losses)
    for kl, updates in (("exact_reverse", 1), ("k3", 1), ("exact_reverse", 3)):
        state, lora_state, metrics = train_step(
            init_train_state(copy(params), optimizer), _batch(0), None, LoraState(copy(lora), lora_opt.init(lora)),
            config=config, optimizer=optimizer, schedule=schedule, opts=opts, lora_cfg=lora_cfg,
            lora_optimizer=lora_opt, distill=DistillOptions(kl=kl, kl_coef=0.1, updates=updates))
        adapters[kl, updates] = lora_state.lora
        # the policy update ignores L_LoRA entirely (1e-6 leaves room for two compiled programs'
        # round-off in -grad); the adapter moves
        same = jax.tree.map(lambda a, b: bool(np.allclose(a, b, rtol=0, atol=1e-6)), plain.params, state.params)
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


@pytest.mark.heavy
def test_loop_state_resumes_exactly(tmp_path):
    """Two steps straight vs one step, a restart from the checkpoint, one more step: the same
    losses, rewards and final loop state (policy, LoRA, optimiser moments, data position, key),
    and the same report figures rebuilt from each workdir's logs. Validation runs at step 0
    (before any update: the initial policy with dense attention, and the sparse actor at the
    schedule) and after every step (eval_every 0 on 2 steps: every step), and each step's logged alpha
    histogram holds the step's tokens of each bin."""
    from sparrow_jax.io.metrics import read_histograms, read_metrics
    from sparrow_jax.rl.trainer import VALIDATION_KEY, evaluate, train
    from sparrow_jax.run.context import build_run_context
    from sparrow_jax.run.report import training_report, training_rows

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

    logs = {run: (read_metrics(tmp_path / run), read_histograms(tmp_path / run)) for run in ("a", "b")}
    kw = dict(num_prompts=len(ctx.train_rows), prompts_per_step=2, steps=2, eval_k=2, tau=0.86, min_count=1)
    report_a, report_b = (training_report(*logs[run], **kw) for run in ("a", "b"))
    assert report_a == report_b and report_a["trained_steps"] == 2
    records = logs["a"][0]
    assert [r["step"] for r in records if "val/dense/reward_mean@2" in r] == [0, 1, 2]
    assert [r["step"] for r in records if "val/sparse/reward_mean@2" in r] == [0, 1, 2]
    key = jax.random.fold_in(jax.random.PRNGKey(0), VALIDATION_KEY)
    want = {**{f"val/dense/{k}": v for k, v in evaluate(ctx, ctx.params, None, ctx.eval_rows, 2, key).items()},
            **{f"val/sparse/{k}": v for k, v in evaluate(ctx, ctx.params, ctx.schedule, ctx.eval_rows, 2,
                                                         key).items()}}  # the LoRA starts at zero
    assert {k: v for k, v in records[0].items() if k not in ("timing_s/validation", "timing_s/eval")} == {"step": 0, **want}
    assert records[0]["timing_s/eval"] == records[0]["timing_s/validation"]
    for r in training_rows(records):  # the four phases are sums of the verl-named parts
        assert r["timing_s/rollout"] == r["timing_s/gen"] and r["timing_s/eval"] == r["timing_s/validation"]
        np.testing.assert_allclose(r["timing_s/score"] + r["timing_s/update"], r["timing_s/update_actor"], rtol=1e-9)
    for (step, bins), row in zip(logs["a"][1], training_rows(records)):
        assert step == row["step"]
        assert {b: int(c.sum()) for b, c in bins.items()} == {b: int(row.get(f"mismatch/count/bin_{b}", 0))
                                                              for b in bins}


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


# ---- PPO epochs x mini-batches, reference KL, non-finite updates ----------------------

def _plain_ppo_loss(logp, logp_old, adv, mask, weights, clip_low=0.2, clip_high=0.28):
    """Token-mean PPO-clip loss with TIS weights, written from the formula (jnp, for its gradient)."""
    ratio = jnp.exp(logp - logp_old)
    a = adv[:, None]
    per_token = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 1 - clip_low, 1 + clip_high)) * weights
    return jnp.sum(per_token * mask) / jnp.sum(mask)


def _numpy_ppo_reference(logp, logp_old, adv, mask, weights, clip_low=0.2, clip_high=0.28):
    """(loss, clipfrac) of a PPO-clip token-mean update in plain numpy."""
    ratio = np.exp(logp - logp_old)
    a = adv[:, None]
    pg1, pg2 = -a * ratio, -a * np.clip(ratio, 1 - clip_low, 1 + clip_high)
    m = mask > 0
    return float(np.sum(np.maximum(pg1, pg2) * weights * mask) / mask.sum()), float(np.mean((pg2 > pg1)[m]))


def _logp(config, params, tokens):
    from sparrow_jax.models.scoring import token_logprobs
    from sparrow_jax.models.forward import dense_hidden, unembedding
    return token_logprobs(dense_hidden(config, params, tokens), unembedding(config, params), tokens)[0]


@pytest.mark.heavy
def test_ppo_epochs_and_mini_batches_match_a_plain_loop_and_compile_once():
    """2 epochs x 2 mini-batches (4 SGD updates, one scan) equal a plain Python loop of updates
    whose loss is the PPO formula in numpy; logp_old and the TIS weights are the batch policy's;
    later updates clip; the step compiles once."""
    import optax

    config = tiny_config()
    lr = 30.0  # large SGD steps: the ratios leave the clip range after the first update
    optimizer = optax.sgd(lr)
    params0 = init_params(config, seed=4)
    batch = _batch(11)
    opts = StepOptions(ppo_epochs=2, mini_batches=2, tis_cap=2.0)
    n0 = train_step._cache_size()
    state, _, metrics = train_step(init_train_state(jax.tree.map(jnp.array, params0), optimizer), batch,
                                   config=config, optimizer=optimizer, opts=opts)
    train_step(init_train_state(jax.tree.map(jnp.array, params0), optimizer), _batch(12), config=config,
               optimizer=optimizer, opts=opts)
    assert train_step._cache_size() - n0 == 1

    tokens, mask, adv = batch.tokens, np.asarray(batch.mask), np.asarray(batch.advantages)
    logp_old = np.asarray(_logp(config, params0, tokens))
    weights = np.minimum(np.exp(logp_old - np.asarray(batch.logp_sampler)), 2.0) * mask
    params, losses, clipfracs = params0, [], []
    for u in range(4):
        rows = slice(0, 2) if u % 2 == 0 else slice(2, 4)
        logp = np.asarray(_logp(config, params, tokens[rows]))
        loss, clipfrac = _numpy_ppo_reference(logp, logp_old[rows], adv[rows], mask[rows], weights[rows])
        losses.append(loss)
        clipfracs.append(clipfrac)
        grads = jax.grad(lambda p: _plain_ppo_loss(_logp(config, p, tokens[rows]), logp_old[rows], adv[rows],
                                                   mask[rows], weights[rows]))(params)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    assert clipfracs[0] == 0.0 and max(clipfracs[1:]) > 0  # the first update is on-policy: ratio 1
    np.testing.assert_allclose(float(metrics["loss"]), np.mean(losses), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(metrics["actor/pg_clipfrac"]), np.mean(clipfracs), atol=1e-6)
    diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), params, state.params)
    assert max(jax.tree.leaves(diffs)) < 1e-4
    assert float(metrics["actor/nonfinite_updates"]) == 0


def test_kl_term_gradient_matches_finite_differences():
    """With zero advantages only kl_coef * KL(pi || ref) moves the params: SGD(1) applies exactly
    -grad, and its projection on a direction matches a central difference of actor/kl_loss."""
    import optax

    config = tiny_config()
    optimizer = optax.sgd(1.0)
    ref = init_params(config, seed=5)
    rng = np.random.RandomState(0)
    direction = jax.tree.map(lambda x: jnp.asarray(rng.randn(*x.shape), x.dtype), ref)
    norm = float(optax.tree.norm(direction))
    direction = jax.tree.map(lambda d: d / norm, direction)
    params = init_params(config, seed=6)  # another random policy: KL(pi || ref) > 0
    batch = _batch(6)._replace(advantages=jnp.zeros((4,), jnp.float32))
    opts = StepOptions(kl_coef=1.0, kl_kind="k3", tis_cap=0.0)

    def step(p):
        return train_step(init_train_state(jax.tree.map(jnp.array, p), optimizer), batch, ref_params=ref,
                          config=config, optimizer=optimizer, opts=opts)

    state, _, metrics = step(params)
    grad = jax.tree.map(lambda a, b: a - b, params, state.params)
    along = sum(float(jnp.sum(g * d)) for g, d in zip(jax.tree.leaves(grad), jax.tree.leaves(direction)))
    eps = 1e-2
    kl_at = lambda s: float(step(jax.tree.map(lambda p, d: p + s * d, params, direction))[2]["actor/kl_loss"])
    fd = (kl_at(eps) - kl_at(-eps)) / (2 * eps)
    assert float(metrics["actor/kl_loss"]) > 0.01 and float(metrics["actor/kl_coef"]) == 1.0
    np.testing.assert_allclose(along, fd, rtol=2e-2)
    with pytest.raises(ValueError, match="ref_params"):
        train_step(init_train_state(params, optimizer), batch, config=config, optimizer=optimizer, opts=opts)


def test_nonfinite_gradient_is_skipped_and_counted():
    config = tiny_config()
    optimizer = make_optimizer(1e-3)
    params = init_params(config, seed=1)
    before = jax.tree.map(lambda x: np.asarray(x).copy(), params)
    state = init_train_state(params, optimizer)
    opt_before = jax.tree.map(lambda x: np.asarray(x).copy(), state.opt_state)
    batch = _batch(3)._replace(advantages=jnp.asarray([np.nan, 1.0, -1.0, 0.5], jnp.float32))
    state, _, metrics = train_step(state, batch, config=config, optimizer=optimizer, opts=StepOptions())
    assert float(metrics["actor/nonfinite_updates"]) == 1
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, np.asarray(b))), before, state.params)
    assert all(jax.tree.leaves(same))
    same_opt = jax.tree.map(lambda a, b: bool(np.array_equal(a, np.asarray(b))), opt_before, state.opt_state)
    assert all(jax.tree.leaves(same_opt))
    assert int(state.step) == 1


def test_rollout_engines_agree_in_the_loop_and_auto_follows_the_mesh(tmp_path):
    """The loop's sampler: continuous batching and the fixed batch give the same rollouts and
    rewards (per-request keys); ``auto`` is continuous on one device, fixed on a mesh."""
    import dataclasses

    from sparrow_jax.rl.trainer import sample
    from sparrow_jax.run.context import build_run_context, rollout_engine

    spec = _tiny_spec(tmp_path, 1)
    assert rollout_engine(spec) == "continuous"
    assert rollout_engine(dataclasses.replace(spec, mesh=dataclasses.replace(spec.mesh, fsdp=2))) == "fixed"
    ctx = build_run_context(spec)
    key = jax.random.PRNGKey(3)
    out = {e: sample(dataclasses.replace(ctx, engine=e), ctx.params, ctx.train_rows[:2], key, 2, ctx.schedule)
           for e in ("continuous", "fixed")}
    (r_new, rew_new), (r_old, rew_old) = out["continuous"], out["fixed"]
    np.testing.assert_array_equal(r_new.tokens, r_old.tokens)
    np.testing.assert_array_equal(r_new.completion_mask, r_old.completion_mask)
    np.testing.assert_allclose(r_new.logprobs, r_old.logprobs, atol=1e-5)
    np.testing.assert_array_equal(rew_new, rew_old)
    assert r_new.stats["slot_steps"] > 0  # the continuous engine actually ran
