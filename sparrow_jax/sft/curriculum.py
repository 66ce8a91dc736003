"""The warm-up's schedule: which rows each step trains on (curriculum stage or final phase),
the phases that continue another warm-up, and each phase's learning-rate schedule.

Imports :mod:`settings` and the shared optimiser chain (:mod:`sparrow_jax.optim`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import optax

from sparrow_jax.optim import clipped_adam
from sparrow_jax.sft.settings import SLIP_LAYOUT_DEFAULTS, WarmupSettings


def stage_settings(settings: WarmupSettings, step: int) -> WarmupSettings:
    """The settings a pre-final ``step`` trains with: its curriculum stage's context, hops, rows
    and (when the stage names one) ``lookup_every`` (the settings themselves without a curriculum)."""
    start = 0
    for steps, context, hops, rows, *every in settings.curriculum:
        if step < start + steps:
            return dataclasses.replace(settings, max_train_context=context, max_train_hops=hops, batch_size=rows,
                                       lookup_every=every[0] if every else settings.lookup_every, curriculum=())
        start += steps
    return dataclasses.replace(settings, curriculum=())


def final_phase_start(settings: WarmupSettings) -> int:
    """First step of the final phase (rows at the task's own context and hops)."""
    return settings.steps - int(round(settings.final_frac * settings.steps))


def continued_warmup(knobs: dict[str, Any], settings: WarmupSettings
                     ) -> tuple[str, dict[str, Any], WarmupSettings] | None:
    """(phase, task knobs, settings) of the warm-up the last phase continues, None from scratch:
    ``preamble`` continues the same task without its preamble, ``slip`` the same settings without
    the slip phase (the refine's or main phase's result), ``refine`` the main phase."""
    if knobs.get("preamble_tokens"):
        if not settings.preamble_steps:
            raise ValueError(f"task.preamble_tokens={knobs['preamble_tokens']} needs model.warmup.preamble_steps > 0: "
                             f"the preamble is learned in a phase of its own, on top of the warm-up without it")
        return "preamble", {k: v for k, v in knobs.items() if k != "preamble_tokens"}, \
            dataclasses.replace(settings, preamble_steps=0)
    if settings.preamble_steps:
        raise ValueError(f"model.warmup.preamble_steps={settings.preamble_steps} needs task.preamble_tokens > 0")
    if settings.slip_steps:
        if knobs["name"] != "recurrence_trace" or knobs.get("key_letters") != 1:
            # two-letter keys: a slipped trace seldom meets the terminal key within a row's bound
            raise ValueError(f"model.warmup.slip_steps={settings.slip_steps} slips recurrence_trace's one-letter "
                             f"look-up keys (task.key_letters=1); task {knobs['name']!r} with knobs {knobs} has none")
        return "slip", knobs, dataclasses.replace(settings, slip_steps=0, slip_prob=0.0, **SLIP_LAYOUT_DEFAULTS)
    if settings.refine_steps:
        return "refine", knobs, dataclasses.replace(settings, refine_steps=0, refine_sparse_topk=0,
                                                    refine_sparse_weight=0.0)
    return None


def phase_steps_lr(settings: WarmupSettings, phase: str) -> tuple[int, float]:
    """(steps, peak learning rate) of the ``main``, ``refine``, ``slip`` or ``preamble`` phase."""
    return {"main": (settings.steps, settings.lr), "refine": (settings.refine_steps, settings.refine_lr),
            "slip": (settings.slip_steps, settings.slip_lr),
            "preamble": (settings.preamble_steps, settings.preamble_lr)}[phase]


def make_optimizer(settings: WarmupSettings, phase: str = "main") -> optax.GradientTransformation:
    """AdamW with linear warm-up then cosine decay to 10% of the peak; global-norm clipping.
    ``phase``: ``main``, or the ``refine`` / ``slip`` / ``preamble`` phase's own run (its steps and peak)."""
    steps, lr = phase_steps_lr(settings, phase)
    warm = max(1, int(settings.warmup_frac * steps))
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warm, max(steps, warm + 1), end_value=0.1 * lr)
    return clipped_adam(sched, settings.max_grad_norm, weight_decay=settings.weight_decay, b2=0.98)
