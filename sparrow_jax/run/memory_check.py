"""The run's memory plan, printed and checked before any weight is loaded or any step compiled.

:func:`check_run_memory` is the entry's hook: it reads the model's architecture (``config.json``
of ``model.hf_dir``, or the tiny architecture), the longest prompt of the run's data, and the
batch, lengths, mesh and memory switches of the config; prints the per-device bytes of the train
step and of the rollout's decode (the closed-form plan of :mod:`sparrow_jax.parallel.memory`,
which ``experiments.memory_report`` checks against compiled programs) with whether each known
accelerator fits it; and refuses a plan larger than this host's device memory with a
:class:`ConfigError` naming the fields to change, rather than failing inside XLA. On a CPU (no
device memory limit) it prints and does not refuse. ``dry_run=True`` stops the run after the plan.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax

from sparrow_jax.models import Qwen3Config
from sparrow_jax.parallel.memory import GB, HBM_GB, PlanSettings, analytic_decode, analytic_train
from sparrow_jax.run.specs import ConfigError, RunSpec


# The end-of-run rollout-speedup measurement decodes 8 held-out prompts x 2 samples at once.
SPEEDUP_ROWS = 16


def plan_settings(spec: RunSpec, prompt_len: int) -> PlanSettings:
    """What the train step compiles: every rollout row of a step, its longest prompt plus the completion cap.

    The train step takes ``1 / (mini_batches * micro_batches)`` of the rows at a time and returns the
    dense hidden states of all of them, which is the planner's ``micro_batches`` figure."""
    r, tr = spec.rollout, spec.train
    return PlanSettings(batch=r.prompts_per_step * r.group_size, prompt_len=int(prompt_len), gen_len=r.max_new_tokens,
                        remat=tr.remat, micro_batches=tr.mini_batches * tr.micro_batches,
                        bf16=spec.model.dtype == "bfloat16", page_size=spec.schedule.page_size)


def decode_rows(spec: RunSpec) -> int:
    """The most rows one rollout of the run decodes at once: a step's batch, the held-out
    evaluation (``task.num_eval`` x ``eval_k``) or the speedup measurement."""
    r = spec.rollout
    return max(r.prompts_per_step * r.group_size, spec.task.num_eval * spec.eval_k, SPEEDUP_ROWS)


def model_architecture(spec: RunSpec, vocab_size: int) -> Qwen3Config:
    """The run's architecture without its weights: ``config.json`` of ``model.hf_dir``, else the tiny one."""
    m = spec.model
    if m.source == "hf":
        try:
            return Qwen3Config.from_hf_dir(m.hf_dir, dtype=m.dtype, param_dtype=m.param_dtype)
        except FileNotFoundError:
            raise ConfigError(f"--config.model.hf_dir={m.hf_dir!r}: no config.json there (expected a local Hugging "
                              "Face snapshot: config.json, *.safetensors, tokenizer.json)") from None
    return Qwen3Config(**dict(m.tiny, vocab_size=vocab_size), dtype=m.dtype, param_dtype=m.param_dtype)


def longest_prompt(spec: RunSpec, tokenizer, task) -> int:
    """Tokens of the run's longest prompt: every row of ``task.dataset`` as the task formats it
    (chat template included); a built-in task's ``context_tokens`` (+ its preamble or gap)."""
    if not spec.task.dataset:
        return spec.task.context_tokens + spec.task.preamble_tokens + spec.task.gap_tokens
    from sparrow_jax.data.datasets import load_examples

    try:
        rows = load_examples(spec.task.dataset)
    except (FileNotFoundError, KeyError, ValueError) as e:
        raise ConfigError(f"--config.task.dataset={spec.task.dataset!r}: {str(e).strip(chr(34))}") from None
    return max(len(tokenizer.encode(task.format_prompt(row, tokenizer))) for row in rows)


def memory_plan(config: Qwen3Config, settings: PlanSettings, mesh: dict[str, int],
                rows_decoded: int) -> dict[str, dict[str, float]]:
    """``{"train": {part: bytes}, "decode": {part: bytes}}`` per device, each with a ``total``;
    the decode of ``rows_decoded`` rows at once."""
    decode = dataclasses.replace(settings, batch=rows_decoded)
    return {"train": analytic_train(config, settings, mesh), "decode": analytic_decode(config, decode, mesh)}


def format_plan(plan: dict, config: Qwen3Config, settings: PlanSettings, mesh: dict[str, int], rows_decoded: int,
                device_bytes: Optional[float] = None) -> str:
    """The plan as a few lines: settings, per-step parts in GB, and which accelerators fit it."""
    names = list(HBM_GB)
    n = config.num_params()
    size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    lines = [f"[memory] {size} params, mesh {mesh}, {settings.batch} rows x "
             f"({settings.prompt_len} prompt + {settings.gen_len} generated) tokens per step, {rows_decoded} rows "
             f"decoded at once, {'bf16' if settings.bf16 else 'f32'} activations, remat={settings.remat}, "
             f"micro_batches x mini_batches={settings.micro_batches}",
             f"[memory] GB per device   {'params':>7} {'optim':>7} {'grads':>7} {'kv':>7} {'activ':>7} "
             f"{'gather':>7} {'total':>7}   fits " + " ".join(f"{n:>5}" for n in names)]
    for step, parts in plan.items():
        get = lambda k: parts.get(k, 0.0) / GB  # noqa: E731
        fits = " ".join(f"{'yes' if parts['total'] <= HBM_GB[n] * GB else 'NO':>5}" for n in names)
        lines.append(f"[memory] {step:<15} {get('params'):7.2f} {get('optimizer'):7.2f} {get('gradients'):7.2f} "
                     f"{get('kv_cache'):7.2f} {get('activations') + get('logits'):7.2f} {get('gathered_weights'):7.2f} "
                     f"{get('total'):7.2f}        "
                     + fits)
    if device_bytes is not None:
        lines.append(f"[memory] this host's devices: {device_bytes / GB:.1f} GB each (the allocator's limit)")
    return "\n".join(lines)


def refusal(plan: dict, spec: RunSpec, device_bytes: float) -> Optional[str]:
    """The one-line reason the plan does not fit ``device_bytes`` per device, naming the fields to
    change (None when it fits)."""
    r, tr, m = spec.rollout, spec.train, spec.mesh
    mesh_now = f"mesh.data={m.data}, mesh.fsdp={m.fsdp}, mesh.tensor={m.tensor}"
    fixes = {
        "train": ([] if tr.remat else ["--config.train.remat=True"]) + [
            f"--config.train.micro_batches (now {tr.micro_batches}: rows per pass / it)",
            f"--config.rollout.max_new_tokens (now {r.max_new_tokens})",
            f"more devices on mesh.fsdp / mesh.tensor (now {mesh_now})"],
        "decode": [f"the rows decoded at once: --config.rollout.prompts_per_step (now {r.prompts_per_step}) x "
                   f"--config.rollout.group_size (now {r.group_size}), --config.task.num_eval (now "
                   f"{spec.task.num_eval}) x --config.eval_k (now {spec.eval_k})",
                   f"--config.rollout.max_new_tokens (now {r.max_new_tokens})",
                   f"more devices on mesh.data / mesh.fsdp / mesh.tensor (now {mesh_now})"]}
    over = [step for step, parts in plan.items() if parts["total"] > device_bytes]
    if not over:
        return None
    step = max(over, key=lambda s: plan[s]["total"])
    return (f"memory plan: the {step} step needs {plan[step]['total'] / GB:.1f} GB per device, the devices have "
            f"{device_bytes / GB:.1f} GB; change {', '.join(fixes[step])} (the plan is printed above; "
            f"--config.dry_run=True prints it without running)")


def device_memory_bytes() -> Optional[int]:
    """The allocator's limit of this process's first device (None on a CPU, which reports none)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(limit) if limit and jax.local_devices()[0].platform != "cpu" else None


def check_run_memory(spec: RunSpec, device_bytes: Optional[float] = None, echo: bool = True) -> bool:
    """Print the run's memory plan; raise :class:`ConfigError` when it does not fit ``device_bytes``
    per device (default: this host's; None on a CPU: not checked) or when the mesh does not match
    the device count. Returns ``spec.dry_run``: True when the run should stop here."""
    from sparrow_jax.data.registry import get_task
    from sparrow_jax.parallel import is_primary
    from sparrow_jax.run.context import resolve_tokenizer

    mesh = dict(data=spec.mesh.data, fsdp=spec.mesh.fsdp, tensor=spec.mesh.tensor)
    if not spec.dry_run and math.prod(mesh.values()) != jax.device_count():
        raise ConfigError(f"--config.mesh: data x fsdp x tensor = {math.prod(mesh.values())} devices, this run has "
                          f"{jax.device_count()}; set the mesh fields so that their product is {jax.device_count()}")
    if spec.model.source == "hf":
        model_architecture(spec, 0)  # a missing snapshot is named before the tokenizer looks for it
    tokenizer = resolve_tokenizer(spec)
    config = model_architecture(spec, tokenizer.vocab_size)
    settings = plan_settings(spec, longest_prompt(spec, tokenizer, get_task(spec.task.name)))
    plan = memory_plan(config, settings, mesh, decode_rows(spec))
    if device_bytes is None and not spec.dry_run:
        device_bytes = device_memory_bytes()
    if echo and is_primary():
        print(format_plan(plan, config, settings, mesh, decode_rows(spec), device_bytes), flush=True)
    reason = refusal(plan, spec, device_bytes) if device_bytes is not None else None
    if reason is not None:
        raise ConfigError(reason)
    return spec.dry_run
