"""The RL loop: sample (dense or sparse actor) -> reward -> one compiled train step -> log -> checkpoint.

Resumable: the checkpoint holds params, optimizer state, step, PRNG seed and data position;
metrics after the restored step are truncated so a resumed run never duplicates steps.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from ml_collections import ConfigDict

from sparrow_jax.config_schema import ConfigError, validate
from sparrow_jax.data.datasets import PromptIterator, load_prompt_dataset
from sparrow_jax.data.registry import get_task
from sparrow_jax.io import atomic_write_json
from sparrow_jax.io.checkpoint import CheckpointManager
from sparrow_jax.io.metrics import MetricWriter, ProgressBar
from sparrow_jax.sft.model_source import build_model  # re-exported: one place that turns a config into a model
from sparrow_jax.models.tokenizer import load_tokenizer
from sparrow_jax.rl.advantages import group_advantages
from sparrow_jax.models.lora import LoraConfig, init_lora, with_lora
from sparrow_jax.parallel import is_primary, make_mesh, shard_batch, shard_params, shard_train_state
from sparrow_jax.rl.train_step import (Batch, DistillOptions, LoraState, StepOptions, init_train_state, make_optimizer,
                                       train_step)
from sparrow_jax.rollout import SamplingParams, SparsitySchedule, generate


# ---- set-up pieces ---------------------------------------------------------------------

def build_schedule(cfg: ConfigDict, workdir: str) -> Optional[SparsitySchedule]:
    s = cfg.schedule
    common = dict(page_size=s.page_size, bin_width=s.bin_width, reserved_first=s.reserved_first,
                  reserved_last=s.reserved_last, dense_layers=tuple(s.dense_layers), selector=s.selector)
    if s.kind == "dense":
        return None
    if s.kind == "fixed":
        return SparsitySchedule.fixed(s.topk, name=f"fixed-{s.topk}", **common)
    if s.kind == "preset":
        return SparsitySchedule.from_preset(s.preset)
    if s.kind == "json":
        return SparsitySchedule.from_json(s.path, expected_page_size=s.page_size)
    calibrated = os.path.join(workdir, "schedule.json")
    if os.path.exists(calibrated):
        return SparsitySchedule.from_json(calibrated)
    raise FileNotFoundError(f"schedule.kind='calibrated' needs {calibrated}: run calibration first "
                            "(experiments.run does it for configs that ask for it)")


def build_examples(cfg: ConfigDict, task) -> tuple[list[dict], list[dict]]:
    t = cfg.task
    if t.dataset:
        ds = load_prompt_dataset(t.dataset)
        rows = [dict(r) for r in ds]
        return rows[t.num_eval:], rows[:t.num_eval]
    if task.generate is None:
        raise ValueError(f"task {t.name!r} has no generator: set task.dataset to a local file")
    rows = task.generate(t.num_train + t.num_eval, t.seed, context_tokens=t.context_tokens, hops=t.hops,
                         distractor_frac=t.distractor_frac)
    return rows[:t.num_train], rows[t.num_train:]


def step_options(cfg: ConfigDict, schedule: Optional[SparsitySchedule], max_len: int) -> StepOptions:
    tr = cfg.train
    bin_width = schedule.bin_width if schedule is not None else cfg.schedule.bin_width
    return StepOptions(clip_low=tr.clip_low, clip_high=tr.clip_high, dual_clip=tr.dual_clip,
                       loss_agg=tr.loss_agg, tis_cap=tr.tis_cap, tis_level=tr.tis_level,
                       entropy_coef=tr.entropy_coef, temperature=cfg.rollout.temperature,
                       micro_batches=tr.micro_batches, remat=tr.remat,
                       num_bins=max(1, -(-max_len // bin_width)), bin_width=bin_width)


class RolloutWorker:
    """Formats prompts, samples completions with the actor, scores them with the task."""

    def __init__(self, cfg, config, tokenizer, task, schedule):
        self.cfg, self.config, self.tok, self.task, self.schedule = cfg, config, tokenizer, task, schedule
        r = cfg.rollout
        self.sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                       top_p=r.top_p, top_k=r.top_k, stop_ids=tuple(tokenizer.stop_ids))

    def encode(self, example: dict) -> list[int]:
        return self.tok.encode(self.task.format_prompt(example, self.tok))

    def sample(self, params, examples: list[dict], key, repeats: int, sampling=None):
        prompts = [self.encode(e) for e in examples for _ in range(repeats)]
        rollout = generate(self.config, params, prompts, key, sampling or self.sampling,
                           schedule=self.schedule, impl=self.cfg.schedule.impl, pad_id=self.tok.pad_id,
                           progress=self.cfg.rollout.progress)
        rewards = []
        for b, example in enumerate(e for e in examples for _ in range(repeats)):
            completion = self.tok.decode(rollout.tokens[b, rollout.prompt_lens[b]:rollout.lengths[b]].tolist())
            rewards.append(float(self.task.reward(completion, example)))
        return rollout, np.asarray(rewards, np.float32)


def evaluate(worker: RolloutWorker, params, examples: list[dict], k: int, key) -> dict[str, float]:
    """mean@k and pass@k over held-out prompts (k samples each at the rollout temperature)."""
    _, rewards = worker.sample(params, examples, key, repeats=k)
    r = rewards.reshape(len(examples), k)
    return {f"eval/mean@{k}": float(r.mean()), f"eval/pass@{k}": float((r.max(axis=1) > 0).mean())}


class Distiller:
    """DistillSparse state and settings: a LoRA used only by the sparse actor (Sparrow Alg. 1)."""

    def __init__(self, cfg: ConfigDict, params):
        d = cfg.distill
        self.lora_cfg = LoraConfig(rank=d.rank, alpha=d.alpha, targets=tuple(d.targets))
        self.optimizer = optax.adam(d.learning_rate)
        lora = init_lora(params, self.lora_cfg, jax.random.PRNGKey(cfg.seed + 7))
        self.state = LoraState(lora, self.optimizer.init(lora))
        self.options = DistillOptions(kl_coef=d.kl_coef, kl=d.kl, tis_cap=d.tis_cap, updates=d.updates_per_step)
        self._merge = jax.jit(with_lora, static_argnums=2)
        self.switched = False

    def actor_params(self, params):
        """The sparse actor's effective params: base + merged LoRA (the dense policy never sees it)."""
        return self._merge(params, self.state.lora, self.lora_cfg)


def actor_tail(worker: "RolloutWorker", config, params, actor_params, examples, schedule, tau, key,
               samples: int = 2) -> dict:
    """Per-bin p5 of the sparse actor (``actor_params``) vs the dense policy on ``examples``
    (``samples`` completions per prompt, sampled by the actor)."""
    from sparrow_jax.mismatch.calibrate import validate as validate_schedule  # deferred: heavy
    prompts = [worker.encode(e) for e in examples]
    return validate_schedule(config, params, prompts, schedule, worker.sampling, samples, key, tau=tau,
                             pad_id=worker.tok.pad_id, sparse_params=actor_params)


def _pad_batch(rollout, length_bucket: int = 64):
    t = int(rollout.lengths.max())
    t = -(-t // length_bucket) * length_bucket
    def fit(x):
        x = x[:, :t]
        return np.pad(x, ((0, 0), (0, t - x.shape[1])))
    return fit(rollout.tokens), fit(rollout.completion_mask).astype(np.float32), fit(rollout.logprobs)


# ---- the loop ---------------------------------------------------------------------------

def train(cfg: ConfigDict, schedule: Optional[SparsitySchedule] = None, progress: bool = True) -> dict:
    """Run (or resume) RL training as configured. Returns the summary written to report fields."""
    validate(cfg)
    mesh = make_mesh(cfg.mesh)  # (data, fsdp, tensor) over all devices; fails fast on a wrong product
    workdir = cfg.workdir
    os.makedirs(workdir, exist_ok=True)
    tokenizer = load_tokenizer(cfg.tokenizer)
    task = get_task(cfg.task.name)
    config, params = build_model(cfg, tokenizer)
    if schedule is None and cfg.schedule.kind != "dense":
        schedule = build_schedule(cfg, workdir)
    train_rows, eval_rows = build_examples(cfg, task)
    worker = RolloutWorker(cfg, config, tokenizer, task, schedule)
    optimizer = make_optimizer(cfg.train.learning_rate, cfg.train.max_grad_norm)
    params = shard_params(params, mesh, config)  # before optimizer.init: Adam moments are born sharded
    state = shard_train_state(init_train_state(params, optimizer), mesh, config)
    data = PromptIterator(train_rows, cfg.rollout.prompts_per_step, seed=cfg.seed)
    ckpt = CheckpointManager(os.path.join(workdir, "checkpoints"), max_to_keep=cfg.keep_checkpoints)
    distiller = None
    if cfg.distill.enabled:
        if schedule is None:
            raise ConfigError("config field distill.enabled needs sparse rollouts (schedule.kind != 'dense')")
        distiller = Distiller(cfg, params)
        distiller.state = shard_train_state(distiller.state, mesh, config)
    start = 0
    if ckpt.latest_step() is not None:
        target = {"params": state.params, "opt_state": state.opt_state}
        if distiller is not None:
            target.update(lora=distiller.state.lora, lora_opt_state=distiller.state.opt_state)
        restored = ckpt.restore(target=target)
        meta = restored["meta"]
        start = int(meta["step"])
        state = state._replace(step=jnp.int32(start), params=restored["params"], opt_state=restored["opt_state"])
        state = shard_train_state(state, mesh, config)  # places the step counter too
        data.restore(meta["data"])
        if distiller is not None:
            distiller.state = shard_train_state(LoraState(restored["lora"], restored["lora_opt_state"]), mesh, config)
            if meta.get("distill_switched"):
                schedule = SparsitySchedule.fixed(cfg.distill.switch_topk, **_schedule_fields(schedule))
                worker.schedule, distiller.switched = schedule, True
        print(f"[train] resumed from checkpoint at step {start}", flush=True)
    writer = MetricWriter(workdir, resume_step=start, is_primary=is_primary())
    bar = ProgressBar(total=cfg.steps, initial=start, desc="rl", disable=not progress)
    max_len = max(len(worker.encode(e)) for e in train_rows[:64]) + cfg.rollout.max_new_tokens
    opts = step_options(cfg, schedule, max_len)
    root_key = jax.random.PRNGKey(cfg.seed)
    history = []
    for step in range(start, cfg.steps):
        key = jax.random.fold_in(root_key, step)
        t0 = time.perf_counter()
        actor = distiller.actor_params(state.params) if distiller is not None else state.params
        rollout, rewards = worker.sample(actor, next(data), key, repeats=cfg.rollout.group_size)
        gen_s = time.perf_counter() - t0
        adv = group_advantages(jnp.asarray(rewards), cfg.rollout.group_size, mode=cfg.train.adv_mode)
        tokens, mask, logp = _pad_batch(rollout)
        batch = shard_batch(Batch(tokens, mask, logp, adv, rollout.prompt_lens), mesh)
        t1 = time.perf_counter()
        if distiller is None:
            state, m = train_step(state, batch, config=config, optimizer=optimizer, schedule=schedule, opts=opts)
        else:
            state, distiller.state, m = train_step(
                state, batch, None, distiller.state, config=config, optimizer=optimizer, schedule=schedule,
                opts=opts, lora_cfg=distiller.lora_cfg, lora_optimizer=distiller.optimizer,
                distill=distiller.options)
        metrics = {k: float(v) for k, v in m.items() if np.isfinite(float(v)) or "/bin_" not in k}  # empty bins: omit
        train_s = time.perf_counter() - t1
        comp_len = rollout.completion_mask.sum(axis=1)
        metrics.update({
            "reward_mean": float(rewards.mean()), "critic/score/mean": float(rewards.mean()),
            "response_length/mean": float(comp_len.mean()),
            "rollout/tokens_per_s": float(rollout.stats["decode_tokens"] / max(rollout.stats["decode_s"], 1e-9)),
            "timing_s/gen": gen_s, "timing_s/update_actor": train_s,
        })
        if distiller is not None and _switch_due(cfg, distiller, step):
            aggressive = SparsitySchedule.fixed(cfg.distill.switch_topk, **_schedule_fields(schedule))
            tail = actor_tail(worker, config, state.params, distiller.actor_params(state.params), eval_rows,
                              aggressive, cfg.calibration.tau, jax.random.fold_in(key, 2))
            metrics["distill/p5_under_switch_schedule"] = tail["min_p5"]
            if tail["min_p5"] >= cfg.calibration.tau:  # the paper's phase 2: LoRA lets sparsity go further
                schedule, worker.schedule, distiller.switched = aggressive, aggressive, True
                print(f"[train] step {step + 1}: switched to top-k {cfg.distill.switch_topk} "
                      f"(LoRA-aided min p5 {tail['min_p5']:.3f} >= tau)", flush=True)
        if distiller is not None:
            metrics["distill/switched"] = float(distiller.switched)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
            metrics.update(evaluate(worker, state.params, eval_rows, cfg.eval_k, jax.random.fold_in(key, 1)))
        writer.write(step + 1, metrics)
        history.append({"step": step + 1, **metrics})
        bar.update(step + 1, reward=metrics["reward_mean"], tok_s=metrics["rollout/tokens_per_s"])
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            saved = {"params": state.params, "opt_state": state.opt_state,
                     "meta": {"step": step + 1, "seed": cfg.seed, "data": data.state(),
                              "schedule": schedule.to_dict() if schedule is not None else None,
                              "distill_switched": bool(distiller and distiller.switched)}}
            if distiller is not None:
                saved.update(lora=distiller.state.lora, lora_opt_state=distiller.state.opt_state)
            ckpt.save(step + 1, saved)
    bar.close()
    writer.close()
    final_eval = evaluate(worker, state.params, eval_rows, cfg.eval_k, jax.random.fold_in(root_key, 10**6))
    return {"history": history, "final_eval": final_eval, "params": state.params, "config": config,
            "schedule": schedule, "worker": worker, "eval_rows": eval_rows, "distiller": distiller}


def _schedule_fields(schedule: SparsitySchedule) -> dict:
    return dict(page_size=schedule.page_size, bin_width=schedule.bin_width, reserved_first=schedule.reserved_first,
                reserved_last=schedule.reserved_last, dense_layers=schedule.dense_layers, selector=schedule.selector)


def _switch_due(cfg: ConfigDict, distiller: Distiller, step: int) -> bool:
    d = cfg.distill
    return bool(d.switch_topk and d.switch_every and not distiller.switched and (step + 1) % d.switch_every == 0)
