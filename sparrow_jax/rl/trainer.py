"""The RL loop as functions of one state pytree: collect rollouts (dense or sparse actor) ->
reward -> one compiled train step -> optional phase-2 switch -> log -> checkpoint.

:class:`LoopState` holds everything that changes during a run (train state, LoRA state,
current top-k table and phase-2 flag, data position, PRNG key) and is checkpointed as it
is, so a resumed run continues exactly. The static parts (run context, optimisers, step
options) live in a frozen :class:`Loop`. :func:`train` returns data: the final state, the
metric history and the final evaluation.

Validation (:func:`validation`): at step 0 before any update, every ``eval_every`` steps and at
the last step, the dense policy is evaluated with dense attention on the held-out prompts
(``val/dense/...``) and the sparse actor at its current schedule (``val/sparse/...``), with one
fixed key, so every point (and a resumed run's) samples alike.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparrow_jax.cost_model import relative_rollout_cost
from sparrow_jax.data.datasets import PromptIterator
from sparrow_jax.data.rewards import RewardPool
from sparrow_jax.io.checkpoint import CheckpointManager
from sparrow_jax.io.metrics import HistogramWriter, MetricWriter, ProgressBar
from sparrow_jax.mismatch.calibrate import kept_page_share, sparse_token_fraction, validate as validate_schedule
from sparrow_jax.mismatch.probe import (candidate_tail, grouped_p5_lower_bound, probe_cost_vs_dense,
                                        probe_metrics)
from sparrow_jax.models.lora import LoraConfig, init_lora, with_lora
from sparrow_jax.optim import names_matching
from sparrow_jax.parallel import (host_array, is_primary, make_mesh, mesh_context, shard_batch, shard_params,
                                  shard_train_state)
from sparrow_jax.parallel.process_rows import gather_rows, process_rows, rows_to_global
from sparrow_jax.rl.advantages import coin_flip_rewards, group_advantages, prefix_advantages
from sparrow_jax.rl.collect import CollectOptions, collect_batch, completion_lens
from sparrow_jax.rl.context import RunContext
from sparrow_jax.rl.guards import assert_finite, nonfinite_streak
from sparrow_jax.rl.horizon_groups import horizon_row_groups, timed_grouped_train_step
from sparrow_jax.rl.long_cot import mask_truncated, response_length_metrics
from sparrow_jax.rl.losses import token_veto
from sparrow_jax.rl.train_step import (Batch, DistillOptions, LoraState, StepOptions, TrainState,
                                       init_train_state, make_optimizer, policy_logprobs, shared_prefix_len,
                                       timed_train_step)
from sparrow_jax.rollout import SparsitySchedule, generate, generate_continuous
from sparrow_jax.rollout.schedule_control import (ControllerSettings, ControllerState, controller_step_jit,
                                                  controller_topk, dense_topk_by_bin, failed_topk_from_table,
                                                  init_controller, probe_rejections, probed_bins, topk_grid)
from sparrow_jax.stats import mean_and_se

if TYPE_CHECKING:
    from sparrow_jax.run.specs import DistillSpec, RunSpec, ScheduleSpec, TrainSpec


class LoopState(NamedTuple):
    """Everything the RL loop changes, as one pytree (checkpointed whole).

    topk: int32 [bins] the sparse actor's current per-bin top-k table ([0] for dense rollouts).
    switched: bool [] phase 2 (the more aggressive LoRA-aided budget) is on.
    data: int32 [2] (epoch, index) of the prompt iterator. key: the run's root PRNG key.
    controller: the online schedule's per-bin controller state (schedule.kind = online), else None.
    """

    train: TrainState
    lora: Optional[LoraState]
    topk: jax.Array
    switched: jax.Array
    data: jax.Array
    key: jax.Array
    controller: Optional[ControllerState] = None

    @property
    def step(self) -> int:
        return int(self.train.step)


@dataclasses.dataclass(frozen=True)
class Loop:
    """The static half of a run: context, spec and the objects derived from them once."""

    spec: RunSpec
    ctx: RunContext
    mesh: Any
    optimizer: optax.GradientTransformation
    opts: StepOptions
    lora_cfg: Optional[LoraConfig]
    lora_optimizer: Optional[optax.GradientTransformation]  # the LoRA's own Adam (no clipping)
    distill: Optional[DistillOptions]
    pool: Optional[RewardPool] = None  # reward workers of a task that asks for them (closed by train)
    controller: Optional[ControllerSettings] = None  # schedule.kind = online: the per-bin p5 controller
    ref_params: Any = None  # the KL reference (the initial policy), None when train.kl_coef == 0


class TrainResult(NamedTuple):
    state: LoopState
    schedule: Optional[SparsitySchedule]  # the actor's schedule at the end (after a phase-2 switch)
    history: list  # this process's step metrics (the whole run's are in <workdir>/metrics.jsonl)
    final_eval: dict  # the last validation this process ran ({} when it ran none)


# ---- rollouts ----------------------------------------------------------------------------

def reward_pool(ctx: RunContext, num_workers: int = 2, timeout_s: float = 5.0) -> Optional[RewardPool]:
    """Worker processes for a task that asks for them (``use_reward_pool``: slow or unbounded verifiers);
    an answer past ``timeout_s`` or a crash scores 0 and is counted."""
    if not ctx.task.use_reward_pool:
        return None
    return RewardPool(ctx.task.reward, num_workers, timeout_s, initializer=ctx.task.reward_pool_initializer)


def pool_counts(pool: Optional[RewardPool]) -> np.ndarray:
    """[timeouts, errors] so far (zeros without a pool)."""
    return np.asarray([pool.num_timeouts, pool.num_errors] if pool is not None else [0, 0], np.float64)


def score(ctx: RunContext, completions: list[str], examples: list[dict], pool: Optional[RewardPool] = None):
    """Task rewards [B] float32, in ``pool`` when given, else in this process."""
    if pool is not None:
        return np.asarray(pool.score_batch(completions, examples), np.float32)
    return np.asarray([float(ctx.task.reward(c, e)) for c, e in zip(completions, examples)], np.float32)


def _horizon_spans(ctx: RunContext, rollout, rows: list[dict]) -> list[tuple[int, int, int]]:
    """Per row (first completion position, tokens up to the reward horizon, the first of those on the
    horizon's line): the token whose text reaches the horizon is included; where the horizon is None
    every completion token counts and no line decided the reward (the third is then the second).
    Token boundaries come from decoding each token alone (exact for the built-in tokenizer)."""
    spans = []
    for b, example in enumerate(rows):
        start, stop = int(rollout.prompt_lens[b]), int(rollout.lengths[b])
        pieces = [ctx.tokenizer.decode([i]) for i in rollout.tokens[b, start:stop].tolist()]
        text = "".join(pieces)
        horizon = ctx.task.reward_horizon(text, example)
        keep = line = stop - start
        if horizon is not None:
            ends = np.cumsum([len(p) for p in pieces])  # each token's last character + 1
            keep = min(keep, int(np.searchsorted(ends, horizon)) + 1)
            line_start = text.rfind("\n", 0, max(horizon - 1, 0)) + 1  # the horizon's own newline excluded
            line = min(keep, int(np.searchsorted(ends, line_start, side="right")))
        spans.append((start, keep, line))
    return spans


def _spans_mask(spans: list[tuple[int, int, int]], width: int, from_line: bool) -> np.ndarray:
    """float32 [B, width] over :func:`_horizon_spans`' tokens up to the horizon, from the first
    completion token or (``from_line``) from the first token of the horizon's line."""
    out = np.zeros((len(spans), width), np.float32)
    for b, (start, keep, line) in enumerate(spans):
        out[b, start + (line if from_line else 0):start + keep] = 1.0
    return out


def reward_horizon_mask(ctx: RunContext, rollout, rows: list[dict], width: int) -> np.ndarray:
    """float32 [B, width]: each row's completion tokens up to its task's reward horizon (the
    token whose text reaches the horizon included; all of them where the horizon is None)."""
    return _spans_mask(_horizon_spans(ctx, rollout, rows), width, from_line=False)


def horizon_line_mask(ctx: RunContext, rollout, rows: list[dict], width: int) -> np.ndarray:
    """float32 [B, width]: the tokens of the line where each row's reward horizon falls (its first
    wrong line: the step that decided the reward), none where the horizon is None (nothing wrong)."""
    return _spans_mask(_horizon_spans(ctx, rollout, rows), width, from_line=True)


def finite_rewards(rewards: np.ndarray) -> tuple[np.ndarray, float]:
    """Rewards [B] with NaN / inf zeroed (one would poison its group's advantages), and how many were."""
    bad = ~np.isfinite(rewards)
    return np.where(bad, np.float32(0.0), rewards).astype(np.float32), float(bad.sum())


def sample(ctx: RunContext, params, examples: list[dict], key, repeats: int, schedule: Optional[SparsitySchedule],
           pool: Optional[RewardPool] = None, first_request: int = 0):
    """``repeats`` completions per example with ``params`` under ``schedule``; (rollout, rewards [B]).

    ``first_request``: the global index of the first row (the PRNG key of each row follows it)."""
    rows = [e for e in examples for _ in range(repeats)]
    engine = generate_continuous if ctx.engine == "continuous" else generate
    rollout = engine(ctx.model_config, params, [ctx.encode(e) for e in rows], key, ctx.sampling,
                     schedule=schedule, impl=ctx.impl, pad_id=ctx.tokenizer.pad_id, progress=ctx.decode_progress,
                     first_request=first_request)
    completions = [ctx.tokenizer.decode(rollout.tokens[b, rollout.prompt_lens[b]:rollout.lengths[b]].tolist())
                   for b in range(len(rows))]
    return rollout, score(ctx, completions, rows, pool)


def _mean_se(per_prompt: np.ndarray) -> tuple[float, float]:
    """Mean over prompts and its standard error (NaN under two prompts)."""
    mean, se = mean_and_se(per_prompt)
    return mean, float("nan") if se is None else se


def evaluate_per_prompt(ctx: RunContext, params, schedule, examples: list[dict], k: int, key,
                        pool: Optional[RewardPool] = None) -> dict[str, np.ndarray]:
    """Held-out figures of ``params`` sampling under ``schedule`` (None: dense attention), per
    prompt, each [P] for the P ``examples``: ``reward_greedy`` (the greedy, temperature-0
    completion's reward), ``reward_mean@k`` (the mean reward of k samples at the rollout
    temperature), ``success@k`` (1 if a sample is fully correct, reward >= 1: partial credit is
    not success). The same ``key`` draws the same samples for the same policy."""
    greedy = dataclasses.replace(ctx, sampling=dataclasses.replace(ctx.sampling, temperature=0.0))
    _, best = sample(greedy, params, examples, key, 1, schedule, pool)
    _, rewards = sample(ctx, params, examples, key, k, schedule, pool)
    r = rewards.reshape(len(examples), k)
    return {"reward_greedy": np.asarray(best, np.float64), f"reward_mean@{k}": np.asarray(r.mean(axis=1), np.float64),
            f"success@{k}": (r >= 1.0).any(axis=1).astype(np.float64)}


def evaluate(ctx: RunContext, params, schedule, examples: list[dict], k: int, key,
             pool: Optional[RewardPool] = None) -> dict[str, float]:
    """:func:`evaluate_per_prompt`'s figures as means over the prompts, each with ``<name>_se``,
    its standard error over the prompts."""
    out = {}
    for name, per_prompt in evaluate_per_prompt(ctx, params, schedule, examples, k, key, pool).items():
        out[name], out[f"{name}_se"] = _mean_se(per_prompt)
    return out


VALIDATION_KEY = 10**6  # folded into the run's key: validation never draws a training key


def eval_interval(steps: int, eval_every: int) -> int:
    """Steps between validations: ``eval_every``, or when 0 a third of the run (with step 0 and
    the last step, >= 4 points for runs of >= 3 steps)."""
    return eval_every or max(1, steps // 3)


def validation(loop: Loop, state: LoopState) -> dict[str, float]:
    """``val/dense/*``: the policy with dense attention; ``val/sparse/*``: the sparse actor (with the
    LoRA under DistillSparse) at its current schedule (absent for dense rollouts); both on the
    held-out prompts with the same fixed key (:func:`evaluate`); ``timing_s/validation``."""
    spec, ctx, t0 = loop.spec, loop.ctx, time.perf_counter()
    key = jax.random.fold_in(state.key, VALIDATION_KEY)
    out = {f"val/dense/{k}": v for k, v in evaluate(ctx, state.train.params, None, ctx.eval_rows, spec.eval_k, key,
                                                     loop.pool).items()}
    schedule = current_schedule(loop, state)
    if schedule is not None:
        out.update({f"val/sparse/{k}": v for k, v in evaluate(ctx, actor_params(loop, state), schedule,
                                                               ctx.eval_rows, spec.eval_k, key, loop.pool).items()})
    return {**out, "timing_s/validation": time.perf_counter() - t0}


def actor_tail(ctx: RunContext, params, actor_params, examples, schedule, tau: float, key, samples: int = 2) -> dict:
    """Per-bin p5 of the sparse actor (``actor_params``) vs the dense policy on ``examples``."""
    return validate_schedule(ctx.model_config, params, [ctx.encode(e) for e in examples], schedule, ctx.sampling,
                             samples, key, tau=tau, pad_id=ctx.tokenizer.pad_id, sparse_params=actor_params)


def lora_config(d: DistillSpec) -> LoraConfig:
    return LoraConfig(rank=d.rank, alpha=d.alpha, targets=tuple(d.targets))


merge_lora_actor = jax.jit(with_lora, static_argnums=2)  # (params, lora, lora_cfg) -> the sparse actor's params


def actor_params(loop: Loop, state: LoopState):
    """The sparse actor's params: the policy plus the merged LoRA (the dense policy never sees it)."""
    if state.lora is None:
        return state.train.params
    return merge_lora_actor(state.train.params, state.lora.lora, loop.lora_cfg)


def current_schedule(loop: Loop, state: LoopState) -> Optional[SparsitySchedule]:
    """The actor's schedule: the run's layout with the state's top-k table."""
    base = loop.ctx.schedule
    topk = tuple(int(k) for k in np.asarray(state.topk))
    return None if base is None else dataclasses.replace(base, topk=topk)


def _pad_batch(rollout, max_len: int, length_bucket: int = 64):
    """tokens, completion mask and log-probs [B, T]: T is ``max_len`` rounded up to ``length_bucket``."""
    t = -(-int(max_len) // length_bucket) * length_bucket
    fit = lambda x: np.pad(x[:, :t], ((0, 0), (0, t - min(t, x.shape[1]))))
    return fit(rollout.tokens), fit(rollout.completion_mask).astype(np.float32), fit(rollout.logprobs)


# ---- set-up --------------------------------------------------------------------------------

def step_options(tr: TrainSpec, temperature: float, bin_width: int, max_len: int) -> StepOptions:
    masking = (tr.tis_mask_low, tr.tis_mask_high) if tr.tis_mask_high > 0 else None
    return StepOptions(clip_low=tr.clip_low, clip_high=tr.clip_high, dual_clip=tr.dual_clip, loss_agg=tr.loss_agg,
                       tis_cap=tr.tis_cap, tis_level=tr.tis_level, tis_mask_bounds=masking,
                       global_rows=tr.seq_mean_rows == "all" or (tr.seq_mean_rows == "auto" and masking is not None),
                       entropy_coef=tr.entropy_coef, kl_coef=tr.kl_coef, kl_kind=tr.kl_kind, temperature=temperature,
                       ppo_epochs=tr.ppo_epochs, mini_batches=tr.mini_batches, micro_batches=tr.micro_batches,
                       remat=tr.remat, num_bins=max(1, -(-max_len // bin_width)), bin_width=bin_width,
                       tail_over_loss=tr.tail_tokens == "loss")


def make_loop(spec: RunSpec, ctx: RunContext) -> Loop:
    """The static half of a run: mesh, optimisers, step options, LoRA settings, reward pool, KL reference."""
    tr, bin_width = spec.train, (ctx.schedule or spec.schedule).bin_width
    if tr.reward_horizon_mask and ctx.task.reward_horizon is None:
        raise ValueError(f"train.reward_horizon_mask=True: task {ctx.task.name!r} defines no reward horizon "
                         "(tasks that do: recurrence_trace)")
    if tr.frozen_params:
        _require_some_not_all(ctx.params, "train.frozen_params", tr.frozen_params)
    if tr.lr_scale_params:
        _require_some_not_all(ctx.params, "train.lr_scale_params", tr.lr_scale_params)
    max_len = max(len(ctx.encode(e)) for e in ctx.train_rows[:64]) + spec.rollout.max_new_tokens
    opts = step_options(tr, spec.rollout.temperature, bin_width, max_len)
    mesh = make_mesh(spec.mesh)
    # the context's params are the initial policy and are never donated: the reference needs no copy
    ref = shard_params(ctx.params, mesh, ctx.model_config) if tr.kl_coef > 0 else None
    d = spec.distill
    distill = DistillOptions(kl_coef=d.kl_coef, kl=d.kl, tis_cap=d.tis_cap, updates=d.updates_per_step)
    lora = (lora_config(d), _optimizer(d.learning_rate, max_grad_norm=0.0), distill) if d.enabled else (None,) * 3
    controller = (online_settings(spec.schedule, ctx.schedule, max_len, spec.calibration.tau)
                  if spec.schedule.kind == "online" else None)
    optimizer = _optimizer(tr.learning_rate, tr.max_grad_norm, tr.lr_warmup_steps, tr.frozen_params, tr.lr_scale_params,
                           tr.lr_scale)
    return Loop(spec, ctx, mesh, optimizer,
                opts, *lora,
                pool=reward_pool(ctx, spec.task.reward_workers, spec.task.reward_timeout_s), controller=controller,
                ref_params=ref)


def _require_some_not_all(params, field: str, pattern: str) -> None:
    """A regex over parameter names that matches none of them or all of them is a mistake: name the field."""
    matched, names = names_matching(params, pattern)
    if not matched or len(matched) == len(names):
        raise ValueError(f"{field}={pattern!r} matches {'no' if not matched else 'every'} "
                         f"parameter of the model (names like {names[1]!r}, {names[-1]!r})")


@functools.lru_cache(maxsize=None)
def _optimizer(learning_rate: float, max_grad_norm: float, warmup_steps: int = 0, frozen: str = "",
               scaled: str = "", scale: float = 1.0) -> optax.GradientTransformation:
    """``make_optimizer``, one object per setting: the jitted steps take the optimiser as a static
    argument, so a loop built again in the same process (a resumed run, a study's next arm or seed)
    reuses their compiled programs instead of compiling them anew."""
    return make_optimizer(learning_rate, max_grad_norm, warmup_steps, frozen, scaled, scale)


def online_settings(s: ScheduleSpec, layout: SparsitySchedule, max_len: int, tau: float) -> ControllerSettings:
    """The controller's settings, holding each bin's p5 at ``tau`` (the run's ``calibration.tau``); its grid
    tops out at the dense top-k of ``max_len`` (or ``online.max_topk``)."""
    o = s.online
    max_topk = o.max_topk or max(-(-max_len // layout.page_size) - layout.reserved, 0)
    return ControllerSettings(grid=topk_grid(max_topk, o.levels_per_octave, min(o.min_topk, max_topk)), tau=tau,
                              margin=o.margin, up_levels=o.up_levels, down_levels=o.down_levels,
                              min_tokens=o.min_tokens, smoothing=o.smoothing, z=o.z, patience=o.patience,
                              retry_after=o.retry_after, probe=o.probe, probe_margin=o.probe_margin)


def init_state(loop: Loop) -> LoopState:
    """Fresh loop state; params are copied (the train step donates its state, the context keeps its own)."""
    config, mesh, spec = loop.ctx.model_config, loop.mesh, loop.spec
    params = shard_params(jax.tree.map(jnp.array, loop.ctx.params), mesh, config)  # Adam moments born sharded
    train = shard_train_state(init_train_state(params, loop.optimizer), mesh, config)
    lora = None
    if loop.lora_cfg is not None:
        adapter = init_lora(params, loop.lora_cfg, jax.random.PRNGKey(spec.seed + 7))
        lora = shard_train_state(LoraState(adapter, loop.lora_optimizer.init(adapter)), mesh, config)
    topk = loop.ctx.schedule.topk if loop.ctx.schedule is not None else (0,)
    controller = None
    if loop.controller is not None:  # online: one top-k per train-step bin, from the start schedule
        layout, opts = loop.ctx.schedule, loop.opts
        start = (dense_topk_by_bin(opts.num_bins, opts.bin_width, layout.page_size, layout.reserved)
                 if spec.schedule.online.start == "dense" else topk)
        table = (layout.meta or {}).get("table") if spec.schedule.online.start == "calibrated" else None
        failed = (None if table is None else  # the calibration's own failures: budgets not to fall to
                  failed_topk_from_table(table, loop.controller.tau, opts.num_bins, opts.bin_width,
                                         spec.calibration.min_count, loop.controller.grid))
        controller = init_controller(loop.controller, start, loop.opts.num_bins, failed)
        topk = controller_topk(loop.controller, controller)
    return LoopState(train, lora, jnp.asarray(topk, jnp.int32), jnp.asarray(False), jnp.zeros((2,), jnp.int32),
                     jax.random.PRNGKey(spec.seed), controller)


def _checkpoints(spec: RunSpec) -> CheckpointManager:
    return CheckpointManager(os.path.join(spec.workdir, "checkpoints"), max_to_keep=spec.keep_checkpoints)


def restore_or_init(loop: Loop, ckpt: CheckpointManager) -> LoopState:
    state = init_state(loop)
    restored = ckpt.restore_latest(target={"loop": state})  # a corrupted newest step falls back to the one before
    if restored is None:
        return state
    state = restored["loop"]
    state = state._replace(train=shard_train_state(state.train, loop.mesh, loop.ctx.model_config))
    print(f"[train] resumed from checkpoint at step {state.step}", flush=True)
    return state


def save(ckpt: CheckpointManager, loop: Loop, state: LoopState) -> None:
    schedule = current_schedule(loop, state)
    meta = {"step": state.step, "seed": loop.spec.seed, "schedule": schedule.to_dict() if schedule else None}
    assert_finite(state.train.params, f"params at step {state.step}")  # no checkpoint ever holds NaN / inf
    ckpt.save(state.step, {"loop": state, "meta": meta})


# ---- one step -------------------------------------------------------------------------------

def next_examples(loop: Loop, state: LoopState) -> tuple[list[dict], jax.Array]:
    """The next prompts and the data position after them."""
    rows = loop.ctx.train_rows
    it = PromptIterator(rows, loop.spec.rollout.prompts_per_step, seed=loop.spec.seed)
    epoch, index = (int(v) for v in np.asarray(state.data))
    it.restore(dict(epoch=epoch, index=index, seed=loop.spec.seed, shuffle=True, num_examples=len(rows)))
    examples = next(it)
    return examples, jnp.asarray([it.state()["epoch"], it.state()["index"]], jnp.int32)


def collect_options(spec: RunSpec) -> CollectOptions:
    r, tr = spec.rollout, spec.train
    return CollectOptions(r.prompts_per_step, r.group_size, r.max_new_tokens, tr.overlong_buffer, tr.overlong_penalty,
                          tr.mask_truncated, tr.dynamic_sampling, tr.dynamic_sampling_rounds)


def veto_rows(loop: Loop, state: LoopState, tokens: np.ndarray, logp_sampler: np.ndarray, loss_mask: np.ndarray,
              rewards: np.ndarray) -> tuple[np.ndarray, dict]:
    """``train.tis_veto``: the policy scores the sparse rollouts densely, and a row with a token of
    ``loss_mask`` [B, T] (``train.tis_veto_tokens``' tokens) whose ratio p_policy / p_sampler is below the
    threshold leaves the update (the dense policy would rarely have made that error, so the row's reward
    says little about it).
    -> (bool [B] rows kept, ``rollout_corr/`` metrics and ``timing_s/veto``)"""
    t0 = time.perf_counter()
    opts = loop.opts
    logp = policy_logprobs(state.train.params, jnp.asarray(tokens), config=loop.ctx.model_config, opts=opts,
                           chunks=opts.mini_batches * opts.micro_batches)
    vetoed = np.asarray(token_veto(logp, jnp.asarray(logp_sampler), jnp.asarray(loss_mask), loop.spec.train.tis_veto))
    metrics = {"rollout_corr/rollout_is_veto_fraction": float(vetoed.mean()), "timing_s/veto": time.perf_counter() - t0}
    if vetoed.any():  # what the rejected rows scored (their reward does not reach the update)
        metrics["rollout_corr/vetoed_reward_mean"] = float(np.mean(rewards[vetoed]))
    return ~vetoed, metrics


def collect(loop: Loop, state: LoopState, key) -> tuple[Batch, dict, jax.Array]:
    """Sample a group of completions per prompt with the actor, score them, shape and filter the
    groups (DAPO options); (batch, metrics, data position after the prompts used). Non-finite
    rewards are zeroed before the advantages and counted (``reward/nonfinite``).

    On several processes each one samples and scores only the prompts of its block of the
    batch's rows (:func:`process_rows`), on its own devices with a full copy of the actor, and
    the batch is assembled from the blocks; the row PRNG keys follow the global row index, so
    the tokens are those one process would draw."""
    t0 = time.perf_counter()
    g, actor, schedule = loop.spec.rollout.group_size, actor_params(loop, state), current_schedule(loop, state)
    num_rows = loop.spec.rollout.prompts_per_step * g
    start, stop = process_rows(loop.mesh, num_rows, g)
    local = stop - start < num_rows
    if local:
        if loop.spec.train.dynamic_sampling:
            raise ValueError("train.dynamic_sampling needs every process to sample the whole batch (its rounds "
                             "differ per process); turn it off when the batch's rows span processes")
        actor = jax.tree.map(host_array, actor)
        if int(state.step) == 0:
            print(f"[train] process {jax.process_index()} samples and scores rows [{start}, {stop}) of {num_rows} "
                  f"on its {jax.local_device_count()} devices", flush=True)
    gather = gather_rows if local else np.asarray  # per-row host values of the whole batch
    data = state.data

    rows_of_round = []  # the rows' examples (one round: reward_horizon_mask rules out dynamic sampling)

    def sample_round(i: int):  # dynamic sampling draws further rounds of fresh prompts
        nonlocal data
        examples, data = next_examples(loop, state._replace(data=data))
        rows_of_round.append([e for e in examples[start // g:stop // g] for _ in range(g)])
        before = pool_counts(loop.pool)
        with jax.set_mesh(None) if local else contextlib.nullcontext():  # this process's devices only
            rollout, rewards = sample(loop.ctx, actor, examples[start // g:stop // g],
                                      key if i == 0 else jax.random.fold_in(key, 3 + i), g, schedule, loop.pool,
                                      first_request=start)
        timeouts, errors = pool_counts(loop.pool) - before
        rewards, nonfinite = finite_rewards(rewards)
        return rollout, rewards, {"reward/timeouts": timeouts, "reward/errors": errors, "reward/nonfinite": nonfinite}

    rollout, rewards, rows_in_loss, metrics = collect_batch(sample_round, collect_options(loop.spec))
    learned = rewards
    if loop.spec.train.random_reward:  # the control: the update sees coin flips, the logs the real rewards
        learned = coin_flip_rewards(rewards, (loop.spec.seed, int(state.step), start))
        metrics["reward/random_mean"] = float(np.mean(learned))
    width = int(gather(np.asarray([rollout.lengths.max()])).max())  # the same padded length everywhere
    tokens, mask, logp = _pad_batch(rollout, width)
    mask = mask_truncated(mask, ~rows_in_loss)
    loss_mask = spans = None
    if loop.spec.train.reward_horizon_mask:  # each row's tokens decoded once for both masks
        spans = _horizon_spans(loop.ctx, rollout, rows_of_round[0])
        loss_mask = mask * _spans_mask(spans, mask.shape[1], from_line=False)
        metrics["actor/reward_horizon_token_share"] = float(loss_mask.sum() / max(mask.sum(), 1.0))
    keep = None
    if loop.spec.train.tis_veto > 0 and schedule is not None:
        if local:
            raise ValueError("train.tis_veto scores the whole batch densely in one process; set it to 0 when the "
                             "batch's rows span processes")
        veto_mask = mask if loss_mask is None else loss_mask
        if loop.spec.train.tis_veto_tokens == "horizon_line":  # the spec requires reward_horizon_mask
            veto_mask = mask * _spans_mask(spans, mask.shape[1], from_line=True)
        keep, veto_metrics = veto_rows(loop, state, tokens, logp, veto_mask, rewards)
        metrics.update(veto_metrics)
        loss_mask = (mask if loss_mask is None else loss_mask) * keep[:, None]
    if loop.spec.train.adv_baseline == "prefix":  # [B, T]: each block of rows holds whole groups
        adv = prefix_advantages(learned, tokens, mask, g, mode=loop.spec.train.adv_mode)
    else:
        adv = np.asarray(group_advantages(jnp.asarray(learned), g, mode=loop.spec.train.adv_mode, keep=keep,
                                          veto_baseline=loop.spec.train.tis_veto_baseline))
    if keep is not None:  # the rows whose update carries a comparison (a group left with one row may not)
        metrics["rollout_corr/rows_with_advantage"] = float(np.mean(adv != 0))
    fields = Batch(tokens, mask, logp, adv, rollout.prompt_lens, loss_mask)
    if local:
        batch = Batch(*(None if x is None else rows_to_global(x, loop.mesh, num_rows) for x in fields))
        for k in ("reward/timeouts", "reward/errors", "reward/nonfinite"):
            metrics[k] = float(gather(np.asarray([metrics[k]])).sum())
        metrics.update(response_length_metrics(gather(completion_lens(rollout)), loop.spec.rollout.max_new_tokens))
    else:
        batch = shard_batch(fields, loop.mesh)
    rewards, adv, prompt_lens = (gather(np.asarray(x)) for x in (rewards, adv, rollout.prompt_lens))
    decoded = gather(np.asarray([[rollout.stats["decode_tokens"], rollout.stats["decode_s"]]], np.float64))
    lengths = gather(np.asarray(rollout.lengths))
    metrics.update({"rollout/generated_tokens": float((lengths - prompt_lens).sum()),
                    "rollout/sparse_token_fraction": sparse_token_fraction(
                        schedule, prompt_lens, lengths, loop.ctx.model_config.num_hidden_layers),
                    "rollout/kept_page_share": kept_page_share(
                        schedule, prompt_lens, lengths, loop.ctx.model_config.num_hidden_layers),
                    "rollout/decode_tokens": float(decoded[:, 0].sum()),
                    "rollout/decode_s": float(decoded[:, 1].max())})
    metrics.update({"reward_mean": float(rewards.mean()), "critic/score/mean": float(rewards.mean()),
                    "critic/advantages/max": float(adv.max()), "critic/advantages/min": float(adv.min()),
                    "prompt_length/mean": float(np.mean(prompt_lens)),
                    "rollout/tokens_per_s": float(decoded[:, 0].sum() / max(decoded[:, 1].max(), 1e-9)),
                    "timing_s/gen": time.perf_counter() - t0 - metrics.get("timing_s/veto", 0.0)})
    return batch, metrics, data


def update(loop: Loop, state: LoopState, batch: Batch) -> tuple[LoopState, dict]:
    """One train step (policy, and the LoRA with DistillSparse), its phases timed as verl's
    ``timing_s/*``: ``timing_s/update_actor`` is the sum of ``timing_s/<part>`` over
    :data:`TIMING_PARTS` (``ref`` only with a KL reference). A step that ``train.mismatch_every``
    skips runs without the schedule: no sparse teacher-forced pass and no ``mismatch/*`` metrics
    (the update reads only the sampler's log-probs of the sparse rollouts, as on every step)."""
    scored = state.step % loop.spec.train.mismatch_every == 0
    kw = dict(config=loop.ctx.model_config, optimizer=loop.optimizer,
              schedule=current_schedule(loop, state) if scored else None, opts=loop.opts)
    if state.lora is not None:
        kw.update(lora_cfg=loop.lora_cfg, lora_optimizer=loop.lora_optimizer, distill=loop.distill)
    if kw["schedule"] is not None and getattr(batch.prompt_lens, "is_fully_addressable", True):  # every row here
        kw["shared_prefix"] = shared_prefix_len(np.asarray(batch.prompt_lens), opts=loop.opts,
                                                distill_lora=state.lora is not None)
    groups = loop.spec.train.horizon_groups
    if groups:  # the update cut at the reward horizon (same gradient): spec validation ruled out what it cannot run
        if not getattr(batch.loss_mask, "is_fully_addressable", True):
            raise ValueError("train.horizon_groups needs every row of the batch in this process (its rows span "
                             "processes here); set it to 0")
        row_groups = horizon_row_groups(np.asarray(batch.loss_mask), groups)
        train, lora, host, timings = timed_grouped_train_step(state.train, batch, row_groups, loop.ref_params, **kw)
    else:
        train, lora, host, timings = timed_train_step(state.train, batch, None, state.lora, loop.ref_params, **kw)
    metrics = {k: float(v) if np.ndim(v) == 0 else v for k, v in host.items()  # arrays: histograms
               if np.ndim(v) or np.isfinite(v) or "/bin_" not in k}  # empty bins: omit
    if loop.ref_params is None:
        timings.pop("ref")
    metrics.update({f"timing_s/{part}": seconds for part, seconds in timings.items()})
    metrics["timing_s/update_actor"] = sum(timings.values())
    return state._replace(train=train, lora=lora), metrics


def maybe_switch(loop: Loop, state: LoopState, key) -> tuple[LoopState, dict]:
    """The paper's phase 2: every ``switch_every`` steps, if the LoRA-aided actor keeps p5 >= tau
    under the more aggressive ``switch_topk``, switch the actor's table to it."""
    d, step = loop.spec.distill, state.step
    if state.lora is None:
        return state, {}
    if not (d.switch_topk and d.switch_every and not bool(state.switched) and step % d.switch_every == 0):
        return state, {"distill/switched": float(bool(state.switched))}
    aggressive = jnp.full_like(state.topk, d.switch_topk)
    trial = state._replace(topk=aggressive)
    tail = actor_tail(loop.ctx, state.train.params, actor_params(loop, state), loop.ctx.eval_rows,
                      current_schedule(loop, trial), loop.spec.calibration.tau, key)
    if tail["min_p5"] >= loop.spec.calibration.tau:
        state = state._replace(topk=aggressive, switched=jnp.asarray(True))
        print(f"[train] step {step}: switched to top-k {d.switch_topk} "
              f"(LoRA-aided min p5 {tail['min_p5']:.3f} >= tau)", flush=True)
    return state, {"distill/p5_under_switch_schedule": tail["min_p5"], "distill/switched": float(bool(state.switched))}


def steer(loop: Loop, state: LoopState, metrics: dict, batch: Optional[Batch] = None) -> tuple[LoopState, dict]:
    """schedule.kind = online: this step's per-bin p5 and token counts -> the next rollout's top-k table.

    With ``probe`` and the step's ``batch``, a proposed fall is first scored on the batch's rollouts at the
    candidate table (:func:`probe_falls`). Returns (state, metrics): the probe's metrics, and
    ``schedule/controller_cost_vs_dense``, the step's predicted rollout cost plus its probe's.
    """
    if state.controller is None:
        return state, {}
    settings, starts = loop.controller, loop.opts.bin_starts
    p5 = jnp.asarray([metrics.get(f"mismatch/alpha_p5/bin_{b}", np.nan) for b in starts], jnp.float32)  # empty: NaN
    counts = jnp.asarray([metrics.get(f"mismatch/count/bin_{b}", 0.0) for b in starts], jnp.float32)
    controller, topk = controller_step_jit(settings, state.controller, p5, counts)
    out = {}
    if settings.probe and batch is not None and bool(jnp.any(probed_bins(settings, state.controller, controller))):
        controller, topk, out = probe_falls(loop, state, controller, topk, p5, counts, metrics, batch)
    if "schedule/predicted_cost_vs_dense" in metrics:
        out["schedule/controller_cost_vs_dense"] = (metrics["schedule/predicted_cost_vs_dense"]
                                                    + out.get("schedule/probe_cost_vs_dense", 0.0))
    return state._replace(controller=controller, topk=topk), out


def probe_falls(loop: Loop, state: LoopState, proposed: ControllerState, topk: jax.Array, p5: jax.Array,
                counts: jax.Array, metrics: dict, batch: Batch) -> tuple[ControllerState, jax.Array, dict]:
    """Score ``batch`` at the proposed table ``topk`` with the updated params (those the next rollouts use);
    an active falling bin keeps its fall only when its candidate p5 lower bound clears tau + probe_margin,
    else the step is recomputed with the rejection (schedule_control). -> (controller state, top-k [bins],
    the probe's metrics: per-bin prediction, time, predicted cost vs a dense rollout)."""
    t0, settings = time.perf_counter(), loop.controller
    candidate = current_schedule(loop, state._replace(topk=topk))
    result = jax.device_get(candidate_tail(loop.ctx.model_config, state.train.params, actor_params(loop, state),
                                           batch.tokens, batch.mask > 0, batch.prompt_lens, candidate,
                                           num_bins=loop.opts.num_bins, bin_width=loop.opts.bin_width,
                                           temperature=loop.opts.temperature, seq_chunk=loop.opts.seq_chunk))
    rows = int(batch.tokens.shape[0])
    # resampled by prompt (a group's rows together), seeded by the step: a resumed run draws the same
    result["lower"] = grouped_p5_lower_bound(
        result["alpha"], result["bins"], np.asarray(batch.mask) > 0, np.arange(rows) // loop.spec.rollout.group_size,
        loop.opts.num_bins, confidence=0.5 * (1.0 + math.erf(settings.z / math.sqrt(2.0))),
        seed=loop.spec.seed * 1_000_003 + int(state.train.step))
    probed = np.asarray(probed_bins(settings, state.controller, proposed))
    rejected = probe_rejections(settings, state.controller, proposed, result["lower"])
    if bool(jnp.any(rejected >= 0)):
        proposed, topk = controller_step_jit(settings, state.controller, p5, counts, rejected)
    out = probe_metrics(loop.opts.bin_starts, np.asarray(candidate.topk),
                        probed, result, np.asarray(rejected))
    out["schedule/probe_cost_vs_dense"] = probe_cost_vs_dense(
        loop.ctx.model_config, num_samples=int(batch.tokens.shape[0]),
        prompt_len=max(1, round(metrics.get("prompt_length/mean", 1))), gen_len=loop.spec.rollout.max_new_tokens,
        hardware=loop.spec.schedule.cost_hardware)
    out["timing_s/probe"] = time.perf_counter() - t0
    return proposed, topk, out


def schedule_metrics(schedule: Optional[SparsitySchedule], config, *, num_samples: int, prompt_len: int,
                     gen_len: int, hardware: str) -> dict[str, float]:
    """schedule/topk/bin_<start> of a sparse schedule and its predicted rollout cost relative to dense."""
    out = {"schedule/predicted_cost_vs_dense": relative_rollout_cost(
        config, schedule, num_samples=num_samples, prompt_len=prompt_len, gen_len=gen_len, hardware=hardware)}
    for i, k in enumerate(schedule.topk if schedule is not None else ()):
        out[f"schedule/topk/bin_{i * schedule.bin_width}"] = float(k)
    return out


def rl_step(loop: Loop, state: LoopState) -> tuple[LoopState, dict]:
    """One RL step: collect -> update -> schedule control -> phase-2 check. The metrics hold
    ``mismatch/alpha_hist`` (an array, sparse rollouts only) beside the scalars."""
    key = jax.random.fold_in(state.key, state.step)
    batch, metrics, data = collect(loop, state, key)
    r = loop.spec.rollout
    metrics.update(schedule_metrics(current_schedule(loop, state), loop.ctx.model_config,
                                    num_samples=r.prompts_per_step * r.group_size,
                                    prompt_len=max(1, round(metrics["prompt_length/mean"])), gen_len=r.max_new_tokens,
                                    hardware=loop.spec.schedule.cost_hardware))
    state, step_metrics = update(loop, state._replace(data=data), batch)
    state, control_metrics = steer(loop, state, {**metrics, **step_metrics}, batch)
    state, switch_metrics = maybe_switch(loop, state, jax.random.fold_in(key, 2))
    return state, {**step_metrics, **metrics, **switch_metrics, **control_metrics}


# Where an RL step's time goes, in four coarse phases (for dashboards and reports) summed over
# the verl-named parts logged beside them; a phase is logged when any of its parts was timed.
PHASES = (("timing_s/rollout", ("timing_s/gen",)),
          ("timing_s/score", ("timing_s/old_log_prob", "timing_s/ref", "timing_s/scoring", "timing_s/probe",
                              "timing_s/statistics", "timing_s/veto")),
          ("timing_s/update", ("timing_s/forward_backward", "timing_s/optimizer")),
          ("timing_s/eval", ("timing_s/validation",)))


def phase_timings(metrics: dict) -> dict[str, float]:
    """``timing_s/rollout`` (sampling), ``timing_s/score`` (log-probs of the old policy, the KL
    reference and the sparse actor; the online probe; statistics), ``timing_s/update`` (forward,
    backward and optimiser) and ``timing_s/eval`` (validation): sums of the parts of :data:`PHASES`
    present in ``metrics``."""
    return {phase: float(sum(metrics[p] for p in parts if p in metrics))
            for phase, parts in PHASES if any(p in metrics for p in parts)}


# ---- the loop -------------------------------------------------------------------------------

def train(spec: RunSpec, ctx: RunContext, progress: bool = True) -> TrainResult:
    """Run (or resume from ``<workdir>/checkpoints``) RL training; returns data, not live objects."""
    os.makedirs(spec.workdir, exist_ok=True)
    loop = make_loop(spec, ctx)
    with contextlib.ExitStack() as resources:  # closed on any exception too (TensorBoard keeps the steps logged)
        if loop.pool is not None:
            resources.callback(loop.pool.close)
        with mesh_context(loop.mesh):  # sparse decode kernels split over the mesh's rows and KV heads
            return _run(loop, progress, resources)


def _run(loop: Loop, progress: bool, resources: contextlib.ExitStack) -> TrainResult:
    spec, ckpt = loop.spec, resources.enter_context(_checkpoints(loop.spec))
    state = restore_or_init(loop, ckpt)
    # a fresh start (no checkpoint) drops what an earlier attempt logged before its first checkpoint
    resume = state.step if ckpt.latest_step() is not None else -1
    writer = resources.enter_context(MetricWriter(spec.workdir, resume_step=resume, is_primary=is_primary()))
    hist_writer = HistogramWriter(spec.workdir, resume_step=resume, is_primary=is_primary())
    resources.callback(hist_writer.close)
    bar = resources.enter_context(ProgressBar(total=spec.steps, initial=state.step, desc="rl", disable=not progress))
    every, final_eval = eval_interval(spec.steps, spec.eval_every), {}
    history, streak = [], 0
    if state.step == 0 < spec.steps:  # the starting point, before any update
        final_eval = validation(loop, state)
        writer.write(0, {**final_eval, **phase_timings(final_eval)})
    while state.step < spec.steps:
        state, metrics = rl_step(loop, state)
        streak = nonfinite_streak(streak, metrics["actor/nonfinite_updates"], spec.train.max_nonfinite_steps)
        alpha_hist = metrics.pop("mismatch/alpha_hist", None)
        if state.step % every == 0 or state.step == spec.steps:
            final_eval = validation(loop, state)
            metrics.update(final_eval)
        metrics.update(phase_timings(metrics))
        if alpha_hist is not None:
            hist_writer.write(state.step, alpha_hist, loop.opts.bin_starts)
        writer.write(state.step, metrics)
        history.append({"step": state.step, **metrics})
        bar.update(state.step, reward=metrics["reward_mean"], tok_s=metrics["rollout/tokens_per_s"])
        if state.step % spec.checkpoint_every == 0 or state.step == spec.steps:
            save(ckpt, loop, state)
    return TrainResult(state, current_schedule(loop, state), history, final_eval)
