"""Validation of run configs (configs/common.py): fail at start-up naming the bad field."""
from __future__ import annotations

from ml_collections import ConfigDict

CHOICES = {
    "model.source": ("tiny", "hf", "warmup"),
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "schedule.kind": ("dense", "fixed", "preset", "json", "calibrated"),
    "schedule.selector": ("centroid", "quest"),
    "schedule.impl": ("auto", "reference", "xla", "cpu", "pallas_tpu", "pallas_gpu", "triton"),
    "train.adv_mode": ("grpo", "drgrpo"),
    "train.loss_agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
    "train.tis_level": ("token", "sequence"),
    "train.kl_kind": ("k1", "k2", "k3"),
    "distill.kl": ("exact", "exact_reverse", "k3"),
}
POSITIVE = ("steps", "checkpoint_every", "keep_checkpoints", "eval_k", "rollout.prompts_per_step",
            "rollout.group_size", "rollout.max_new_tokens", "schedule.page_size", "schedule.bin_width",
            "train.micro_batches", "task.num_train", "task.num_eval", "mesh.data", "mesh.fsdp", "mesh.tensor",
            "distill.eval_samples", "distill.updates_per_step")
NON_NEGATIVE = ("eval_every", "rollout.temperature", "rollout.top_k", "schedule.topk", "schedule.reserved_first",
                "schedule.reserved_last", "train.learning_rate", "train.max_grad_norm", "train.clip_low",
                "train.clip_high", "train.dual_clip", "train.tis_cap", "train.kl_coef", "train.entropy_coef",
                "distill.learning_rate", "distill.kl_coef", "distill.tis_cap")


class ConfigError(ValueError):
    """An invalid config value; the message names the field."""


def _get(cfg: ConfigDict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if part not in node:
            raise ConfigError(f"config field {dotted} is missing")
        node = node[part]
    return node


def validate(cfg: ConfigDict) -> None:
    """Raise :class:`ConfigError` naming the first invalid field."""
    if not cfg.get("workdir"):
        raise ConfigError("config field workdir must be a non-empty path")
    for field, allowed in CHOICES.items():
        value = _get(cfg, field)
        if value not in allowed:
            raise ConfigError(f"config field {field}={value!r} is invalid; expected one of {allowed}")
    for field in POSITIVE:
        if not _get(cfg, field) > 0:
            raise ConfigError(f"config field {field} must be > 0, got {_get(cfg, field)!r}")
    for field in NON_NEGATIVE:
        if not _get(cfg, field) >= 0:
            raise ConfigError(f"config field {field} must be >= 0, got {_get(cfg, field)!r}")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"config field rollout.top_p must be in (0, 1], got {cfg.rollout.top_p}")
    if cfg.rollout.group_size < 2:
        raise ConfigError(f"config field rollout.group_size must be >= 2 for group advantages, got {cfg.rollout.group_size}")
    if cfg.model.source == "hf" and not cfg.model.hf_dir:
        raise ConfigError("config field model.hf_dir is required when model.source='hf'")
    if cfg.schedule.kind == "preset" and not cfg.schedule.preset:
        raise ConfigError("config field schedule.preset is required when schedule.kind='preset'")
    if cfg.schedule.kind == "json" and not cfg.schedule.path:
        raise ConfigError("config field schedule.path is required when schedule.kind='json'")
    if (cfg.rollout.prompts_per_step * cfg.rollout.group_size) % cfg.train.micro_batches:
        raise ConfigError("config field train.micro_batches must divide rollout.prompts_per_step * group_size")
    if "calibration" in cfg and not 0 < cfg.calibration.tau < 1:
        raise ConfigError(f"config field calibration.tau must be in (0, 1), got {cfg.calibration.tau}")
