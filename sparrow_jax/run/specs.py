"""Typed run specs: the ``ml_collections`` run config parsed once, validated in one place.

``parse_spec(cfg)`` reads every leaf of the config into frozen dataclasses (model, task,
sampling, schedule, calibration, train, distill, mesh, optional study) and raises
:class:`ConfigError` naming ``--config.<field>`` for a bad value, a missing field or a field
that no spec consumes (so a config field that no code reads cannot exist silently). Below
this module and the entry points no library function takes a ``ConfigDict``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from typing import Any, Optional

from ml_collections import ConfigDict

from sparrow_jax.io.presets import paper_presets, preset_layout


class ConfigError(ValueError):
    """An invalid run config; the message names the field as ``--config.<field>``."""


def _spec(cls):
    return dataclasses.dataclass(frozen=True)(cls)


@_spec
class ModelSpec:
    source: str  # tiny | hf | warmup
    hf_dir: str
    dtype: str
    param_dtype: str
    tiny: dict  # Qwen3Config fields of the tiny / warm-up architecture, less vocab_size (the tokenizer's)
    warmup: dict = dataclasses.field(default_factory=dict)  # optional warm-up SFT block (WarmupSettings + cache_dir)


@_spec
class TaskSpec:
    name: str
    dataset: str
    context_tokens: int
    hops: int
    distractor_frac: float
    num_train: int
    num_eval: int
    seed: int
    key_len: int
    isolate_chain: bool  # built-in task: off-chain records never point into the chain
    preamble_tokens: int  # pointer_trace: tokens of unrelated text before the records
    reward_workers: int  # RewardPool processes (tasks that ask for a pool)
    reward_timeout_s: float  # per-answer verifier timeout in the pool
    min_lines: int = 0  # recurrence_trace: trace lines before the terminal look-up (0: the generator's default)
    far_every: int = 0  # recurrence_trace: one line in far_every is a look-up (0: the generator's default)
    gap_tokens: int = 0  # recurrence_trace: tokens of unrelated text between the table and the start line
    key_letters: int = 0  # recurrence_trace: letters of a look-up key, 1 or 2 (0: the generator's default 2)


@_spec
class SamplingSpec:
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    progress: bool
    engine: str  # auto | continuous | fixed


@_spec
class OnlineScheduleSpec:  # schedule.kind = online: the per-bin p5 controller (rollout/schedule_control.py)
    start: str  # calibrated | preset | fixed | dense
    margin: float
    up_levels: int
    down_levels: int
    min_tokens: int
    smoothing: float
    z: float
    patience: int
    retry_after: int
    levels_per_octave: int
    min_topk: int
    max_topk: int  # 0: the dense top-k of the run's longest sequence
    probe: bool  # score a fall's candidate budgets on the step's rollouts before taking it
    probe_margin: float  # a probed fall needs its candidate p5 lower bound >= calibration.tau + probe_margin


@_spec
class ScheduleSpec:
    kind: str  # dense | fixed | preset | json | calibrated | online
    topk: int
    preset: str
    path: str
    page_size: int
    bin_width: int
    reserved_first: int
    reserved_last: int
    dense_layers: tuple
    selector: str
    impl: str
    cost_hardware: str  # cost_model.HARDWARE key of the logged predicted rollout cost
    online: OnlineScheduleSpec


@_spec
class CalibrationSpec:
    tau: float
    budgets: tuple
    num_prompts: int
    samples_per_prompt: int
    validate_prompts: int
    percentile: float
    min_count: int
    spread_prompts: bool  # prompt lengths spread up to task.context_tokens (False: all at it)
    allow_failed: bool  # RL may use a schedule whose validation failed (else the run stops before RL)
    revalidate_rounds: int = 0  # failed bins raised to the next budget and validated again, this many times
    min_survival: float = 0.0  # a budget keeps >= this share of the largest budget's unbroken traces per bin (0: off)
    survival_unmeasured: str = "free"  # a bin too few rows reach: p5 alone (free) or the largest budget (largest)
    survival_decoding: str = "sampled"  # the survival counts' rows: the tail's samples or one greedy trace a prompt


@_spec
class TrainSpec:
    learning_rate: float
    max_grad_norm: float
    adv_mode: str
    clip_low: float
    clip_high: float
    dual_clip: float
    loss_agg: str
    tis_cap: float
    tis_level: str
    tis_mask_low: float  # ratio rejection bounds (both 0: off)
    tis_mask_high: float
    seq_mean_rows: str  # auto | valid | all
    kl_coef: float
    kl_kind: str
    entropy_coef: float
    ppo_epochs: int
    mini_batches: int
    micro_batches: int
    overlong_buffer: int
    overlong_penalty: float
    mask_truncated: bool
    reward_horizon_mask: bool  # the policy loss ends at each completion's reward horizon
    dynamic_sampling: bool
    dynamic_sampling_rounds: int
    max_nonfinite_steps: int
    remat: bool
    random_reward: bool  # the control arm: learn from coin flips with the batch's mean reward
    lr_warmup_steps: int = 0  # N: the k-th update runs at learning_rate * min(1, k / N) (0: constant from the first)
    frozen_params: str = ""  # regex over dotted parameter names (layers.0.self_attn.q_proj.kernel): no updates ("": none)
    lr_scale_params: str = ""  # regex over dotted parameter names: these move at lr_scale times the rate ("": none)
    lr_scale: float = 1.0
    horizon_groups: int = 0  # G > 0: the update runs in G row groups, each cut at its longest loss row (0: whole rows)
    mismatch_every: int = 1  # N: the sparse actor's exact acceptance statistics on every N-th step (TIS every step)
    adv_baseline: str = "group"  # group: the group's mean reward | prefix: the mean over the rows sharing a token's prefix
    tail_tokens: str = "completion"  # the acceptance tail counts every completion token | the loss's (reward horizon)
    tis_veto: float = 0.0  # reject a sparse rollout's row with a loss token whose ratio p_dense / p_sampler is below this (0: off)
    tis_veto_tokens: str = "loss"  # the tokens the veto reads: loss (all of the loss's) | horizon_line (the first wrong line's)
    tis_veto_baseline: str = "kept"  # a group's advantage baseline with the veto: kept (its kept rows) | all (all its rows)


@_spec
class DistillSpec:
    enabled: bool
    rank: int
    alpha: float
    targets: tuple
    learning_rate: float
    kl_coef: float
    kl: str
    tis_cap: float
    updates_per_step: int
    switch_topk: int
    switch_every: int
    compare_without: bool
    eval_samples: int


@_spec
class MeshSpec:
    data: int
    fsdp: int
    tensor: int


@_spec
class StudySpec:
    aggressive_topk: int
    # arms run in order, same seeds; any of STUDY_ARMS (online_*: schedule.kind=online started dense,
    # at the aggressive fixed budget, or calibrated with DistillSparse; calibrated_low / calibrated_high:
    # calibrated at low_tau / high_tau; random_reward: dense rollouts learning from coin-flip rewards)
    arms: tuple = ("dense", "calibrated", "aggressive")
    seeds: tuple = ()  # every arm runs once per seed (empty: the run's seed alone)
    low_tau: float = 0.75  # calibration.tau of the calibrated_low arm
    high_tau: float = 0.92  # calibration.tau of the calibrated_high arm (paper: stable, slower)
    measure_speedup: bool = False  # paired rollout speedup of each arm's final schedule vs dense (first seed)
    # > 0: after training, every arm's final dense policy (each seed) and the starting one sampled densely
    # on this many held-out prompts, rewards per prompt (sparrow_jax.run.final_eval): paired errors
    final_eval_prompts: int = 0
    # the final evaluation's prompts start this many held-out prompts in (0: the validation prompts first):
    # prompts no setting of the study was chosen on
    final_eval_offset: int = 0


STUDY_ARMS = ("dense", "calibrated", "aggressive", "online_dense", "online_aggressive", "online_distill",
              "calibrated_low", "calibrated_high", "random_reward")


@_spec
class RunSpec:
    workdir: str
    seed: int
    steps: int
    checkpoint_every: int
    keep_checkpoints: int
    eval_every: int
    eval_k: int
    tokenizer: str
    model: ModelSpec
    task: TaskSpec
    schedule: ScheduleSpec
    rollout: SamplingSpec
    calibration: CalibrationSpec
    train: TrainSpec
    distill: DistillSpec
    mesh: MeshSpec
    study: Optional[StudySpec] = None  # optional block: run the study's arms (sparrow_jax.run.study)
    dry_run: bool = False  # print the memory plan and stop (sparrow_jax.run.memory_check)


# ---- parsing -------------------------------------------------------------------------------

def _leaves(node: Any, prefix: str) -> list[str]:
    if isinstance(node, (ConfigDict, dict)):
        out = []
        for k in node.keys():
            out += _leaves(node[k], f"{prefix}.{k}" if prefix else str(k))
        return out
    return [prefix]


def _coerce(field: str, hint: Any, value: Any) -> Any:
    bad = lambda what: ConfigError(f"--config.{field}={value!r}: expected {what}")
    if hint is bool:
        if not isinstance(value, bool):
            raise bad("a bool")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an int")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if hint is tuple:
        if not isinstance(value, (list, tuple)):
            raise bad("a tuple")
        return tuple(value)
    if hint is dict:
        if not isinstance(value, (ConfigDict, dict)):
            raise bad("a block of fields")
        return value.to_dict() if isinstance(value, ConfigDict) else dict(value)
    raise TypeError(f"spec field {field}: unsupported type {hint}")


def _section(cls, node: ConfigDict, prefix: str, consumed: set[str]):
    """Instance of spec ``cls`` from ``node``; records the consumed config paths."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        optional = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if f.name not in node:
            if optional:
                continue
            raise ConfigError(f"--config.{path} is missing")
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) or typing.get_origin(hint) is typing.Union:  # a section: its leaves count
            sub = hint if dataclasses.is_dataclass(hint) else typing.get_args(hint)[0]
            if not isinstance(node[f.name], ConfigDict):
                raise ConfigError(f"--config.{path}: expected a block of fields")
            kw[f.name] = _section(sub, node[f.name], f"{path}.", consumed)
        else:
            consumed.add(path)  # a leaf, or a whole free-form block (model.tiny, model.warmup)
            kw[f.name] = _coerce(path, hint, node[f.name])
    return cls(**kw)


def parse_spec(cfg: ConfigDict) -> RunSpec:
    """The typed, validated :class:`RunSpec` of a run config. Raises :class:`ConfigError`
    naming ``--config.<field>`` for a bad, missing or unread field."""
    consumed: set[str] = set()
    spec = _section(RunSpec, cfg, "", consumed)
    unread = [p for p in _leaves(cfg, "") if not any(p == c or p.startswith(c + ".") for c in consumed)]
    if unread:
        raise ConfigError(f"--config.{unread[0]} is read by no code (unknown field"
                          f"{'s ' + ', '.join(unread[1:]) + ' too' if unread[1:] else ''})")
    validate(spec)
    return spec


# ---- validation: every rule in one place -----------------------------------------------------

CHOICES = {
    "model.source": ("tiny", "hf", "warmup"),
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "schedule.kind": ("dense", "fixed", "preset", "json", "calibrated", "online"),
    "schedule.online.start": ("calibrated", "preset", "fixed", "dense"),
    "schedule.cost_hardware": ("H200", "H100", "TPU v5e", "TPU v6e", "cpu"),  # cost_model.HARDWARE (a test checks)
    "schedule.selector": ("centroid", "quest"),
    "rollout.engine": ("auto", "continuous", "fixed"),
    "schedule.impl": ("auto", "reference", "xla", "cpu", "pallas_tpu", "pallas_gpu", "triton"),
    "train.adv_mode": ("grpo", "drgrpo"),
    "train.adv_baseline": ("group", "prefix"),
    "train.tail_tokens": ("completion", "loss"),
    "train.tis_veto_tokens": ("loss", "horizon_line"),
    "train.tis_veto_baseline": ("kept", "all"),
    "train.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "train.tis_level": ("token", "sequence"),
    "train.kl_kind": ("k1", "k2", "k3"),
    "train.seq_mean_rows": ("auto", "valid", "all"),
    "distill.kl": ("exact", "exact_reverse", "k3"),
}
# Generator knobs of one built-in task each (0: unset, the generator's default): refused for any other task.
TASK_ONLY_KNOBS = {"preamble_tokens": ("pointer_trace", "has a preamble"), "min_lines": ("recurrence_trace", "reads it"),
                   "far_every": ("recurrence_trace", "reads it"), "gap_tokens": ("recurrence_trace", "reads it"),
                   "key_letters": ("recurrence_trace", "reads it")}
POSITIVE = ("steps", "checkpoint_every", "keep_checkpoints", "eval_k", "rollout.prompts_per_step",
            "rollout.group_size", "rollout.max_new_tokens", "schedule.page_size", "schedule.bin_width",
            "train.micro_batches", "train.mismatch_every", "train.ppo_epochs", "train.mini_batches", "task.reward_workers",
            "task.reward_timeout_s", "task.num_eval", "mesh.data", "mesh.fsdp", "mesh.tensor",
            "distill.eval_samples", "distill.updates_per_step", "distill.rank", "calibration.num_prompts",
            "calibration.samples_per_prompt", "calibration.validate_prompts", "schedule.online.up_levels",
            "schedule.online.down_levels", "schedule.online.min_tokens", "schedule.online.levels_per_octave")
NON_NEGATIVE = ("eval_every", "task.preamble_tokens", "task.min_lines", "task.far_every", "task.gap_tokens", "rollout.temperature", "rollout.top_k", "schedule.topk",
                "schedule.reserved_first", "schedule.reserved_last", "train.learning_rate", "train.max_grad_norm",
                "train.clip_low", "train.clip_high", "train.dual_clip", "train.tis_cap", "train.kl_coef",
                "train.entropy_coef", "train.lr_warmup_steps", "train.horizon_groups", "train.tis_mask_low", "train.tis_mask_high", "train.tis_veto", "train.overlong_buffer",
                "train.overlong_penalty", "train.dynamic_sampling_rounds", "train.max_nonfinite_steps",
                "distill.learning_rate", "distill.kl_coef", "distill.tis_cap", "distill.switch_topk",
                "distill.switch_every", "calibration.min_count", "calibration.revalidate_rounds",
                "schedule.online.margin", "schedule.online.z", "schedule.online.min_topk", "schedule.online.max_topk")


def _get(spec: RunSpec, dotted: str) -> Any:
    node = spec
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _require(ok: bool, field: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"--config.{field}={value!r}: {why}")


def validate(spec: RunSpec) -> None:
    """Raise :class:`ConfigError` naming the first invalid field of ``spec``."""
    _require(bool(spec.workdir), "workdir", spec.workdir, "must be a non-empty path")
    for field, allowed in CHOICES.items():
        _require(_get(spec, field) in allowed, field, _get(spec, field), f"expected one of {allowed}")
    for field in POSITIVE:
        _require(_get(spec, field) > 0, field, _get(spec, field), "must be > 0")
    for field in NON_NEGATIVE:
        _require(_get(spec, field) >= 0, field, _get(spec, field), "must be >= 0")
    r, s, m = spec.rollout, spec.schedule, spec.model
    _require(0 < r.top_p <= 1, "rollout.top_p", r.top_p, "must be in (0, 1]")
    _require(r.group_size >= 2, "rollout.group_size", r.group_size, "must be >= 2 for group advantages")
    for field, (reader, why) in TASK_ONLY_KNOBS.items():  # 0 means unset; a set knob must be its task's
        value = getattr(spec.task, field)
        _require(value == 0 or spec.task.name == reader, f"task.{field}", value,
                 f"only task {reader} {why} (task.name={spec.task.name!r})")
    t = spec.task
    _require(t.far_every == 0 or (t.far_every >= 2 and 100 % t.far_every == 0), "task.far_every", t.far_every,
             "must be a divisor of 100 >= 2 (the trace's line index wraps at 100), or 0 for the default")
    _require(t.key_letters in (0, 1, 2), "task.key_letters", t.key_letters, "must be 1 or 2, or 0 for the default 2")
    _require(t.min_lines != 1, "task.min_lines", t.min_lines, "must be >= 2 (the two start lines), or 0 for the default")
    _require(m.source != "hf" or bool(m.hf_dir), "model.hf_dir", m.hf_dir, "is required when model.source='hf'")
    _require(m.source != "hf" or os.path.isfile(os.path.join(m.hf_dir, "config.json")), "model.hf_dir", m.hf_dir,
             "is not a directory holding a Hugging Face config.json")
    _require(spec.tokenizer == "builtin" or os.path.isdir(spec.tokenizer), "tokenizer", spec.tokenizer,
             "expected 'builtin' or an existing tokenizer directory")
    _require(m.source != "warmup" or spec.tokenizer == "builtin", "tokenizer", spec.tokenizer,
             "the warm-up model is trained with the builtin tokenizer (model.source='warmup')")
    _require(s.kind != "preset" or bool(s.preset), "schedule.preset", s.preset,
             "is required when schedule.kind='preset'")
    _require(s.kind != "json" or bool(s.path), "schedule.path", s.path, "is required when schedule.kind='json'")
    tr = spec.train
    _require((r.prompts_per_step * r.group_size) % (tr.mini_batches * tr.micro_batches) == 0, "train.mini_batches",
             tr.mini_batches, f"times train.micro_batches={tr.micro_batches} must divide rollout.prompts_per_step * "
             "rollout.group_size")
    _require(not tr.horizon_groups or (r.prompts_per_step * r.group_size) % (tr.horizon_groups * tr.micro_batches) == 0,
             "train.horizon_groups", tr.horizon_groups, f"times train.micro_batches={tr.micro_batches} must divide "
             "rollout.prompts_per_step * rollout.group_size")
    _require(_is_regex(tr.frozen_params), "train.frozen_params", tr.frozen_params, "is not a regular expression")
    _require(_is_regex(tr.lr_scale_params), "train.lr_scale_params", tr.lr_scale_params, "is not a regular expression")
    _require(tr.lr_scale > 0, "train.lr_scale", tr.lr_scale, "must be > 0")
    _require(tr.lr_scale == 1.0 or bool(tr.lr_scale_params), "train.lr_scale", tr.lr_scale,
             "scales no parameter: set train.lr_scale_params (a regex over parameter names)")
    _require(not tr.horizon_groups or tr.reward_horizon_mask, "train.horizon_groups", tr.horizon_groups,
             "cuts rows at their reward horizon: it needs train.reward_horizon_mask=True")
    _require(not tr.horizon_groups or (tr.ppo_epochs, tr.mini_batches) == (1, 1), "train.horizon_groups",
             tr.horizon_groups, "needs a single on-policy update (train.ppo_epochs = train.mini_batches = 1)")
    _require(not tr.horizon_groups or tr.tis_mask_high == 0, "train.horizon_groups", tr.horizon_groups,
             "does not combine with ratio masking (train.tis_mask_high > 0): the groups' shares of the loss "
             "are fixed before their forwards")
    _require(not tr.horizon_groups or not spec.distill.enabled, "train.horizon_groups", tr.horizon_groups,
             "does not combine with distill.enabled (DistillSparse's LoRA trains on whole rows)")
    _require(tr.mismatch_every == 1 or s.kind != "online", "train.mismatch_every", tr.mismatch_every,
             "must be 1 with schedule.kind='online' (the controller reads every step's p5)")
    _require(tr.mismatch_every == 1 or not spec.distill.enabled, "train.mismatch_every", tr.mismatch_every,
             "must be 1 with distill.enabled (DistillSparse's LoRA trains from the sparse pass every step)")
    _require((tr.tis_mask_low, tr.tis_mask_high) == (0, 0) or tr.tis_mask_low < tr.tis_mask_high, "train.tis_mask_low",
             tr.tis_mask_low, f"must be < train.tis_mask_high={tr.tis_mask_high} (both 0: no ratio masking)")
    _require(tr.tis_veto < 1, "train.tis_veto", tr.tis_veto, "must be < 1 (a ratio threshold; 0: off)")
    _require(not tr.tis_veto or tr.adv_baseline == "group", "train.tis_veto", tr.tis_veto,
             "needs train.adv_baseline='group' (the group's baseline is recomputed over the rows kept)")
    _require(tr.tis_veto_tokens != "horizon_line" or tr.reward_horizon_mask, "train.tis_veto_tokens",
             tr.tis_veto_tokens, "needs train.reward_horizon_mask=True (the line where the reward horizon falls)")
    _require(tr.overlong_buffer < r.max_new_tokens, "train.overlong_buffer", tr.overlong_buffer,
             "must be < rollout.max_new_tokens")
    _require(0 < spec.calibration.tau < 1, "calibration.tau", spec.calibration.tau, "must be in (0, 1)")
    _require(0 <= spec.calibration.min_survival <= 1, "calibration.min_survival", spec.calibration.min_survival,
             "must be in [0, 1] (0: off)")
    # calibrate.SURVIVAL_UNMEASURED's values (and the decodings calibrate_run knows), spelled here: config
    # parsing imports no jax module
    _require(spec.calibration.survival_unmeasured in ("free", "largest"), "calibration.survival_unmeasured",
             spec.calibration.survival_unmeasured, "must be one of ('free', 'largest')")
    _require(spec.calibration.survival_decoding in ("sampled", "greedy"), "calibration.survival_decoding",
             spec.calibration.survival_decoding, "must be one of ('sampled', 'greedy')")
    _require(not spec.distill.enabled or s.kind != "dense", "distill.enabled", spec.distill.enabled,
             "DistillSparse needs sparse rollouts (schedule.kind != 'dense')")
    _require(bool(spec.distill.switch_topk) == bool(spec.distill.switch_every), "distill.switch_every",
             spec.distill.switch_every, "phase 2 needs both distill.switch_topk and distill.switch_every (or neither)")
    _validate_online(spec)
    _validate_inert(spec)
    if spec.study is not None:
        _validate_study(spec)


def _validate_study(spec: RunSpec) -> None:
    """study.*: known distinct arms, distinct non-negative int seeds, a low tau below the main one and a
    high one above it, a final evaluation on held-out rows only."""
    st = spec.study
    unknown = [a for a in st.arms if a not in STUDY_ARMS]
    _require(bool(st.arms) and not unknown and len(set(st.arms)) == len(st.arms), "study.arms", st.arms,
             f"expected distinct arms from {STUDY_ARMS}")
    ints = all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in st.seeds)
    _require(ints and len(set(st.seeds)) == len(st.seeds), "study.seeds", st.seeds,
             "expected distinct non-negative ints (empty: the run's seed)")
    _require(isinstance(st.final_eval_prompts, int) and st.final_eval_prompts >= 0, "study.final_eval_prompts",
             st.final_eval_prompts, "expected an int >= 0 (0: no final evaluation)")
    _require(isinstance(st.final_eval_offset, int) and not isinstance(st.final_eval_offset, bool)
             and st.final_eval_offset >= 0, "study.final_eval_offset", st.final_eval_offset, "expected an int >= 0")
    if st.final_eval_prompts and spec.task.dataset:  # a dataset's held-out rows are its first task.num_eval
        _require(st.final_eval_offset + st.final_eval_prompts <= spec.task.num_eval, "study.final_eval_prompts",
                 st.final_eval_prompts, f"from held-out row study.final_eval_offset={st.final_eval_offset}: a "
                 f"dataset holds out task.num_eval={spec.task.num_eval} rows; more would take training rows")
    if "calibrated_low" in st.arms:  # read only by that arm
        _require(0 < st.low_tau < spec.calibration.tau, "study.low_tau", st.low_tau,
                 f"must be in (0, calibration.tau={spec.calibration.tau})")
    if "calibrated_high" in st.arms:
        _require(spec.calibration.tau < st.high_tau < 1, "study.high_tau", st.high_tau,
                 f"must be in (calibration.tau={spec.calibration.tau}, 1)")


def _validate_online(spec: RunSpec) -> None:
    """schedule.online.*: the ranges ControllerSettings needs, and what online excludes."""
    s, o = spec.schedule, spec.schedule.online
    _require(o.margin < 1, "schedule.online.margin", o.margin, "must be < 1")
    _require(0 <= o.probe_margin < 1, "schedule.online.probe_margin", o.probe_margin, "must be in [0, 1)")
    _require(0 <= o.smoothing < 1, "schedule.online.smoothing", o.smoothing, "must be in [0, 1)")
    _require(o.patience >= 2, "schedule.online.patience", o.patience, "must be >= 2 (a noise estimate needs two steps)")
    _require(o.retry_after >= 1, "schedule.online.retry_after", o.retry_after, "must be >= 1")
    _require(o.max_topk == 0 or o.max_topk >= o.min_topk, "schedule.online.max_topk", o.max_topk,
             "must be 0 (dense) or >= schedule.online.min_topk")
    if s.kind != "online":
        return
    _require(o.start != "preset" or bool(s.preset), "schedule.preset", s.preset,
             "is required when schedule.online.start='preset'")
    _require(spec.distill.switch_topk == 0, "distill.switch_topk", spec.distill.switch_topk,
             "must be 0 with schedule.kind='online' (the controller sets the budgets)")


# the schedule fields a paper preset fixes (its table was measured with them)
PRESET_LAYOUT = ("page_size", "bin_width", "reserved_first", "reserved_last", "dense_layers", "selector")


def _is_regex(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def _num_layers(m: ModelSpec) -> Optional[int]:
    """The model's layer count, known before it is built (None where it is not)."""
    if m.source == "hf":
        with open(os.path.join(m.hf_dir, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("num_hidden_layers")
    return m.tiny.get("num_hidden_layers")


def _validate_inert(spec: RunSpec) -> None:
    """Fields the run would accept and then ignore, or break on deep inside a compiled step."""
    r, s, tr, t, m = spec.rollout, spec.schedule, spec.train, spec.task, spec.model
    _require(r.temperature > 0, "rollout.temperature", r.temperature,
             "must be > 0 (greedy rollouts give every group one completion, hence no advantage to learn from)")
    # the sampler truncates its distribution, the train step's log-probs do not: the ratio would
    # count the truncation as mismatch
    _require(r.top_p == 1, "rollout.top_p", r.top_p, "must be 1 (the train step scores the untruncated distribution)")
    _require(r.top_k == 0, "rollout.top_k", r.top_k, "must be 0 (the train step scores the untruncated distribution)")
    _require(tr.clip_low < 1, "train.clip_low", tr.clip_low,
             "must be < 1 (the PPO ratio's lower bound is 1 - clip_low)")
    _require(tr.tail_tokens != "loss" or tr.reward_horizon_mask, "train.tail_tokens", tr.tail_tokens,
             "counts the tokens up to each completion's reward horizon: it needs train.reward_horizon_mask=True")
    _require(not (tr.reward_horizon_mask and tr.dynamic_sampling), "train.reward_horizon_mask",
             tr.reward_horizon_mask, "does not combine with train.dynamic_sampling (its rounds drop rows)")
    devices = spec.mesh.data * spec.mesh.fsdp * spec.mesh.tensor
    _require(r.engine != "continuous" or devices == 1, "rollout.engine", r.engine,
             f"runs on one device (the page-pool kernel is not sharded); the mesh has {devices}: "
             "use 'auto' or 'fixed'")
    _require(not t.dataset or t.num_train == 0, "task.num_train", t.num_train,
             f"must be 0 with task.dataset={t.dataset!r} (the file's rows after the eval rows are the "
             "training prompts)")
    _require(bool(t.dataset) or t.num_train > 0, "task.num_train", t.num_train, "must be > 0")
    _require("vocab_size" not in m.tiny, "model.tiny.vocab_size", m.tiny.get("vocab_size"),
             "is the tokenizer's; remove the field")
    dense = tuple(s.dense_layers)
    if "preset" in (s.kind, s.online.start if s.kind == "online" else None):
        known = sorted(paper_presets()["presets"])
        _require(s.preset in known, "schedule.preset", s.preset, f"expected one of {known}")
        preset = preset_layout(s.preset)
        dense = preset["dense_layers"]  # what the run will use
        for field in PRESET_LAYOUT:
            ours, theirs = getattr(s, field), preset[field]
            ours = tuple(ours) if field == "dense_layers" else ours
            _require(ours == theirs, f"schedule.{field}", ours,
                     f"schedule.preset {s.preset!r} fixes it to {theirs!r} (set that, or use schedule.kind='fixed')")
    layers = _num_layers(m)
    if layers is not None:
        beyond = [d for d in dense if not 0 <= d < layers]
        _require(not beyond, "schedule.dense_layers", dense, f"layers {beyond} are not in the model's {layers}")
