"""The calibration run: measure the acceptance-rate tail of the run's model per budget and
position bin, derive the cheapest schedule with p5 >= tau, validate it on fresh prompts, and
write ``<workdir>/schedule.json``, ``calibration.json`` and ``p5_by_position.png``.

A schedule that fails validation is not written (RL never trains on it) unless
``calibration.allow_failed``; :func:`check_calibration_target` keeps a calibration from
replacing the schedule of a run already in its workdir."""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Optional, Sequence

import jax
import numpy as np

from sparrow_jax.io import atomic_write_json
from sparrow_jax.io.plots import plot_p5_by_position
from sparrow_jax.mismatch.calibrate import TokenMask, calibrate, spread_context_lengths, validate
from sparrow_jax.rl.trainer import reward_horizon_mask
from sparrow_jax.rollout import SparsitySchedule
from sparrow_jax.run.context import RunContext, build_run_context, generator_args, schedule_layout
from sparrow_jax.run.specs import ConfigError, RunSpec, TaskSpec

# what in a workdir shows a run that a new calibration's schedule would change under it
RUN_FILES = ("checkpoints", "metrics.jsonl", "report.json", "schedule.json", "calibration.json")


# the greedy survival rows' prompts: task seed + this (calibration: + 1, validation: + 2 + round)
SURVIVAL_SEED_OFFSET = 1000


def check_calibration_target(workdir: str, force: bool) -> None:
    """Raise :class:`ConfigError` naming the first of :data:`RUN_FILES` in ``workdir`` unless ``force``:
    a resumed run would train on the new schedule, and the old calibration would be lost."""
    found = [name for name in RUN_FILES if os.path.exists(os.path.join(workdir, name))]
    if found and not force:
        raise ConfigError(f"--config.workdir={workdir!r} holds a run ({os.path.join(workdir, found[0])}); calibrating "
                          "would replace its schedule.json and calibration.json: pass --force to replace them, or "
                          "choose another --config.workdir")


def failed_bins(validation: dict) -> list[tuple[int, float]]:
    """(bin start, p5) of the validated bins whose p5 missed ``tau - margin``."""
    return [(int(b), float(p)) for b, p, ok in zip(validation["bin_starts"], validation["p5"], validation["meets"])
            if ok is False]


def raise_failed_bins(schedule: SparsitySchedule, failed_starts: Sequence[int],
                      budgets: Sequence[int]) -> Optional[SparsitySchedule]:
    """``schedule`` with each bin that starts at one of ``failed_starts`` (token positions) raised to
    the next larger of ``budgets``, and every later bin to at least that (budgets never fall with
    position). A failed bin already at the largest budget raises the nearest earlier bin that has
    a larger one left: the mismatch builds up along the generation, so the sparsity before a bin
    sets its tail too. None when nothing can be raised."""
    topk = list(schedule.topk)
    for start in failed_starts:
        failed = min(int(start) // schedule.bin_width, len(topk) - 1)
        for b in range(failed, -1, -1):  # the failed bin, else the nearest earlier one with room
            larger = [k for k in sorted(budgets) if k > topk[b]]
            if larger:
                topk[b:] = [max(k, larger[0]) for k in topk[b:]]
                break
    return None if topk == list(schedule.topk) else dataclasses.replace(schedule, topk=tuple(topk))


def context_lengths(t: TaskSpec, n: int, spread: bool = True) -> list[int]:
    """Context lengths of ``n`` calibration prompts: spread up to ``t.context_tokens`` (short
    completions), else all at it (long completions cover the bins after a near-constant prompt)."""
    return spread_context_lengths(int(t.context_tokens), n) if spread else [int(t.context_tokens)] * n


def task_prompts(t: TaskSpec, ctx: RunContext, n: int, seed: int,
                 spread: bool = True) -> tuple[list[dict], list[list[int]]]:
    """``n`` task examples at :func:`context_lengths`, and their prompt ids."""
    if t.dataset or ctx.task.generate is None:
        raise ValueError(f"calibration generates its prompts: task {t.name!r} needs a generator and "
                         f"task.dataset must be empty (got {t.dataset!r})")
    examples = [ctx.task.generate(1, seed * 100_003 + i, **generator_args(t, context_tokens=c))[0]
                for i, c in enumerate(context_lengths(t, n, spread))]
    return examples, [ctx.encode(ex) for ex in examples]


def tail_token_mask(spec: RunSpec, ctx: RunContext, examples: list[dict]) -> Optional[TokenMask]:
    """The tokens calibration's tail counts, as the RL step's statistics do (``train.tail_tokens``):
    None (every completion token), or each row's tokens up to its reward horizon (``"loss"``); the
    rows are ``examples`` in order, each ``calibration.samples_per_prompt`` times."""
    return horizon_token_mask(spec, ctx, examples) if spec.train.tail_tokens == "loss" else None


def horizon_token_mask(spec: RunSpec, ctx: RunContext, examples: list[dict],
                       samples: Optional[int] = None) -> TokenMask:
    """Each row's completion tokens up to its task's reward horizon; the rows are ``examples`` in
    order, each ``samples`` times (default ``calibration.samples_per_prompt``)."""
    samples = spec.calibration.samples_per_prompt if samples is None else samples
    rows = [e for e in examples for _ in range(samples)]
    return lambda rollout, first: reward_horizon_mask(ctx, rollout, rows[first:first + len(rollout.lengths)],
                                                      rollout.tokens.shape[1])


def calibrate_run(spec: RunSpec, ctx: Optional[RunContext] = None, progress: bool = True) -> dict[str, Any]:
    """Calibrate the run's model (the same :func:`build_run_context` model RL will run).

    Prompts: ``calibration.num_prompts`` task prompts at :func:`context_lengths` (spread up to
    ``task.context_tokens`` unless ``calibration.spread_prompts`` is False; seed ``task.seed + 1``),
    validated on ``calibration.validate_prompts`` fresh ones (seed ``task.seed + 2``). With
    ``calibration.revalidate_rounds`` > 0, a failed validation raises the failed bins (or, at the
    largest budget already, the bin before; :func:`raise_failed_bins`) and validates again on new fresh prompts (seed ``task.seed + 2 +
    round``), until it passes, no larger budget is left, or the rounds are spent. Returns dict:
    schedule, table, validation, raised (the rounds), per_budget, flagged_bins, inherited_bins,
    schedule_path, table_path, png, seconds.
    """
    t0 = time.perf_counter()
    ctx = ctx if ctx is not None else build_run_context(spec, schedule=None)
    cal, config = spec.calibration, ctx.model_config
    load_s = time.perf_counter() - t0
    base = schedule_layout(spec.schedule, 0)
    bad = [d for d in base.dense_layers if d >= config.num_hidden_layers]
    if bad:
        raise ValueError(f"schedule.dense_layers {list(base.dense_layers)} name layers past the model's "
                         f"{config.num_hidden_layers}")
    examples, prompts = task_prompts(spec.task, ctx, cal.num_prompts, spec.task.seed + 1, cal.spread_prompts)
    fresh_examples, fresh = task_prompts(spec.task, ctx, cal.validate_prompts, spec.task.seed + 2, cal.spread_prompts)
    key = jax.random.PRNGKey(spec.seed)
    if progress:
        print(f"[calibrate] {config.num_params():,} params ({spec.model.source}), {len(prompts)} prompts of "
              f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens x {cal.samples_per_prompt} samples, "
              f"budgets {list(cal.budgets)}, tau {cal.tau}", flush=True)
    horizon_mask, survival_prompts = None, None
    if cal.min_survival > 0 and cal.survival_decoding == "greedy":
        # as many greedy rows as the tail has sampled ones, on prompts of their own (greedy repeats would be copies)
        survival_examples, survival_prompts = task_prompts(spec.task, ctx, cal.num_prompts * cal.samples_per_prompt,
                                                           spec.task.seed + SURVIVAL_SEED_OFFSET, cal.spread_prompts)
        horizon_mask = horizon_token_mask(spec, ctx, survival_examples, samples=1)
    elif cal.min_survival > 0:
        horizon_mask = horizon_token_mask(spec, ctx, examples)
    result = calibrate(config, ctx.params, prompts, cal.budgets, cal.tau, base, ctx.sampling,
                       cal.samples_per_prompt, jax.random.fold_in(key, 1), cal.percentile,
                       min_count=cal.min_count, pad_id=ctx.tokenizer.pad_id, progress=progress,
                       token_mask=tail_token_mask(spec, ctx, examples), min_survival=cal.min_survival,
                       horizon_mask=horizon_mask, survival_unmeasured=cal.survival_unmeasured,
                       survival_prompts=survival_prompts)
    check = lambda sched, rows, rows_examples, round_: validate(  # noqa: E731
        config, ctx.params, rows, sched, ctx.sampling, cal.samples_per_prompt, jax.random.fold_in(key, 2 + round_),
        cal.percentile, tau=cal.tau, min_count=cal.min_count, pad_id=ctx.tokenizer.pad_id,
        token_mask=tail_token_mask(spec, ctx, rows_examples))
    schedule, validation = result["schedule"], check(result["schedule"], fresh, fresh_examples, 0)
    raised = []  # one entry per revalidation round
    for round_ in range(1, cal.revalidate_rounds + 1):
        failed = failed_bins(validation)
        bumped = raise_failed_bins(schedule, [b for b, _ in failed], cal.budgets) if failed else None
        if bumped is None:  # passed, or no larger budget left
            break
        # fresh prompts each round: a schedule raised until it passes one set would fit that set's noise
        fresh_examples, fresh = task_prompts(spec.task, ctx, cal.validate_prompts, spec.task.seed + 2 + round_,
                                             cal.spread_prompts)
        raised.append(dict(from_topk=list(schedule.topk), to_topk=list(bumped.topk), failed_bins=failed))
        schedule, validation = bumped, check(bumped, fresh, fresh_examples, round_)
        if progress:
            print(f"[calibrate] validation failed in bins {[b for b, _ in failed]}: raised to top-k "
                  f"{list(schedule.topk)}, revalidated on fresh prompts: min p5 {validation['min_p5']:.4f}", flush=True)
    result = dict(result, schedule=schedule, raised=raised)
    seconds = time.perf_counter() - t0
    failed = failed_bins(validation)
    paths = _write_outputs(spec, config, base, result, validation, seconds, load_s,
                           write_schedule=not failed or cal.allow_failed)
    if failed and not cal.allow_failed:  # stop before RL: its tail guarantee would not hold
        shown = ", ".join(f"bin {b}: p5 {p:.3f}" for b, p in failed)
        raise ConfigError(f"--config.calibration.allow_failed=False: the calibrated schedule failed validation on "
                          f"fresh prompts ({shown}; needs >= {validation['tau'] - validation['margin']:.3f}); no "
                          f"schedule.json written, see {paths['table_path']}. Widen calibration.budgets or lower "
                          "calibration.tau, or pass --config.calibration.allow_failed=True to train on it anyway")
    return dict(result, validation=validation, **paths, seconds=seconds)


def _write_outputs(spec: RunSpec, config, base, result: dict, validation: dict, seconds: float,
                   load_s: float, write_schedule: bool = True) -> dict[str, str]:
    cal, workdir = spec.calibration, spec.workdir
    os.makedirs(workdir, exist_ok=True)
    paths = dict(schedule_path=os.path.join(workdir, "schedule.json"),
                 table_path=os.path.join(workdir, "calibration.json"),
                 png=os.path.join(workdir, "p5_by_position.png"))
    table, schedule = result["table"], result["schedule"]
    series = {f"top-k {k} ({(k + base.reserved) * base.page_size} tok)":
              (table["bin_starts"], [np.nan if v is None else v for v in table["p5"][i]])
              for i, k in enumerate(table["budgets"])}
    series["calibrated (fresh prompts)"] = (validation["bin_starts"], validation["p5"])
    plot_p5_by_position(series, cal.tau, paths["png"],
                        title=f"p{cal.percentile:g} of acceptance rate by position ({spec.model.source} model)")
    atomic_write_json(paths["table_path"], dict(
        tau=cal.tau, min_count=cal.min_count, min_survival=cal.min_survival,
        survival_unmeasured=cal.survival_unmeasured, survival_decoding=cal.survival_decoding,
        model_source=spec.model.source, tail_tokens=spec.train.tail_tokens,
        num_params=config.num_params(), **table, schedule_topk=list(schedule.topk),
        flagged_bins=result["flagged_bins"], inherited_bins=result["inherited_bins"],
        per_budget=result["per_budget"], validation=validation, raised=result.get("raised", []),
        seconds=round(seconds, 1),
        load_seconds=round(load_s, 1)))
    if write_schedule:
        atomic_write_json(paths["schedule_path"], schedule.to_dict())  # crash-safe; same content as to_json
    elif os.path.exists(paths["schedule_path"]):  # a forced recalibration: the old schedule is not this table's
        os.remove(paths["schedule_path"])
    return paths
