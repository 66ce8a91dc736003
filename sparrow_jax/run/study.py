"""Arms: runs trained beside the main one with the same seeds and steps, each in its own workdir
(:func:`run_arm`), whose figures are then read from their logs.

The study: every arm of ``study.arms`` (dense rollouts, the calibrated schedule, the schedules
calibrated at ``study.low_tau`` and ``study.high_tau``, an aggressive fixed budget, the online
controller started dense, aggressive or calibrated with DistillSparse, and dense rollouts learning
from random rewards), each in ``<workdir>/<arm>`` (with several ``study.seeds``, one run per seed in
``<workdir>/<arm>/seed_<s>``), and a table of their figures. A DistillSparse run with
``distill.compare_without`` has one arm, the same RL without the LoRA in
``<workdir>/without_distill`` (:func:`without_lora_spec`), which the pipeline trains before its
report reads it.

An arm's run is finished when its ``report.json`` holds this many steps: a rerun skips finished
(arm, seed) runs and resumes the first unfinished one from its checkpoints. Every figure of the
table is rebuilt from the arms' logs (:mod:`sparrow_jax.run.report`, :mod:`sparrow_jax.run.headline`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable, Collection, Optional

import numpy as np

from sparrow_jax.io import atomic_write_json
from sparrow_jax.io.metrics import bin_series, read_histograms, read_metrics
from sparrow_jax.rollout import SparsitySchedule
from sparrow_jax.rl.context import RunContext
from sparrow_jax.rl.trainer import TrainResult, train
from sparrow_jax.run.calibration import calibrate_run
from sparrow_jax.run.context import build_run_context, build_schedule
from sparrow_jax.run.final_eval import evaluate_final, final_eval_pending
from sparrow_jax.run.final_eval_figures import FINAL_EVAL_FILE, format_final_eval, paired_figures
from sparrow_jax.run.headline import SeedRun, arm_summary, relative_step_time
from sparrow_jax.run.study_plots import plot_headline, plot_study
from sparrow_jax.run.report import (generated_tokens_per_s, reward_start_end, reward_window, training_report,
                                    training_rows)
from sparrow_jax.run.specs import RunSpec
from sparrow_jax.run.speed import measure_rollout_speedup
from sparrow_jax.run.workdir import REPORT_FILE, finished_report
from sparrow_jax.stats import mean_and_se

_ONLINE_START = {"online_dense": "dense", "online_aggressive": "fixed", "online_distill": "calibrated"}
WITHOUT_LORA = "without_distill"  # the DistillSparse run's comparison arm


def study_seeds(spec: RunSpec) -> tuple[int, ...]:
    """The seeds every arm runs at: ``study.seeds``, or the run's ``seed`` alone."""
    return tuple(spec.study.seeds) or (spec.seed,)


_OTHER_TAU = {"calibrated_low": "low_tau", "calibrated_high": "high_tau"}  # arms calibrated at another tau


def _tau_calibration_spec(spec: RunSpec, arm: str) -> RunSpec:
    """The calibration of an arm of :data:`_OTHER_TAU`: the main one's at its tau (``study.low_tau``
    or ``study.high_tau``), written into ``<workdir>/<arm>``."""
    tau = getattr(spec.study, _OTHER_TAU[arm])
    return dataclasses.replace(spec, workdir=os.path.join(spec.workdir, arm), study=None,
                               calibration=dataclasses.replace(spec.calibration, tau=tau))


def _arm_spec(spec: RunSpec, arm: str, seed: Optional[int] = None) -> RunSpec:
    """The run of one study arm at ``seed`` (default: the first of :func:`study_seeds`): its schedule
    (statistics on every step for the online arms, DistillSparse on whole-row updates for
    ``online_distill``, coin-flip rewards for ``random_reward``, tau
    ``study.low_tau`` / ``study.high_tau`` for ``calibrated_low`` / ``calibrated_high``) in
    ``<workdir>/<arm>``, or ``<workdir>/<arm>/seed_<s>`` with several seeds."""
    s, distill, cal, train_spec = spec.schedule, spec.distill, spec.calibration, spec.train
    schedule_dir = spec.workdir
    if arm in _OTHER_TAU:
        other = _tau_calibration_spec(spec, arm)
        schedule_dir, cal = other.workdir, other.calibration
    if arm == "random_reward":
        train_spec = dataclasses.replace(train_spec, random_reward=True)
    if arm in _ONLINE_START:
        schedule = dataclasses.replace(s, kind="online", topk=spec.study.aggressive_topk,
                                       online=dataclasses.replace(s.online, start=_ONLINE_START[arm]))
        # the controller reads every step's p5: the sparse actor's statistics on every step
        train_spec = dataclasses.replace(train_spec, mismatch_every=1)
        if arm == "online_distill":  # DistillSparse's LoRA trains on whole rows: no horizon groups (same gradient)
            distill = dataclasses.replace(distill, enabled=True, compare_without=False)
            train_spec = dataclasses.replace(train_spec, horizon_groups=0)
    else:
        kind = {"dense": "dense", "calibrated": "json", "aggressive": "fixed", "calibrated_low": "json",
                "calibrated_high": "json", "random_reward": "dense"}[arm]
        schedule = dataclasses.replace(s, kind=kind, path=os.path.join(schedule_dir, "schedule.json"),
                                       topk=spec.study.aggressive_topk)
    seeds = study_seeds(spec)
    seed = seeds[0] if seed is None else seed
    workdir = os.path.join(spec.workdir, arm, *([f"seed_{seed}"] if len(seeds) > 1 else []))
    return dataclasses.replace(spec, workdir=workdir, seed=seed, schedule=schedule, distill=distill, calibration=cal,
                               train=train_spec, study=None)


def without_lora_spec(spec: RunSpec) -> RunSpec:
    """The comparison arm of a DistillSparse run: the same RL without the LoRA in ``<workdir>/without_distill``."""
    return dataclasses.replace(spec, workdir=os.path.join(spec.workdir, WITHOUT_LORA),
                               distill=dataclasses.replace(spec.distill, enabled=False))


def run_arm(arm_spec: RunSpec, build_ctx: Callable[[], RunContext], name: str,
            after_train: Optional[Callable[[RunContext, TrainResult], dict]] = None) -> dict:
    """Train one arm unless it has finished (an interrupted arm resumes from its checkpoints, inside
    ``train``); ``build_ctx`` is called only to train. Returns the arm's ``report.json``:
    ``{"steps", "train_prompts"}`` and what ``after_train(ctx, result)`` adds (once, after training)."""
    done = finished_report(arm_spec)
    if done is not None:
        print(f"[arm] {name}: finished ({arm_spec.workdir}/{REPORT_FILE})", flush=True)
        return done
    print(f"[arm] {name}", flush=True)
    t0 = time.perf_counter()
    ctx = build_ctx()
    result = train(arm_spec, ctx)
    done = {"steps": arm_spec.steps, "train_prompts": len(ctx.train_rows)}
    if after_train is not None:
        done.update(after_train(ctx, result))
    # the arm's wall time (model build, compiles, steps, validations, the speedup measurement); a run
    # resumed from a checkpoint records only this process's part, under another name
    first_step = min((h["step"] for h in result.history), default=0)
    done["wall_s" if first_step <= 1 else "wall_s_partial"] = round(time.perf_counter() - t0, 1)
    atomic_write_json(os.path.join(arm_spec.workdir, REPORT_FILE), done)
    return done


def p5_hold(history, threshold: float, min_tokens: float) -> dict:
    """When every bin with >= ``min_tokens`` tokens first has p5 >= ``threshold`` (``reached_step``,
    None if never), and the share of (step, bin) cells with that many tokens from then on that
    keep it (``held_fraction``, over ``cells`` cells)."""
    p5 = bin_series(history, "mismatch/alpha_p5")
    count = bin_series(history, "mismatch/count")
    cells = lambda i: [p5[b][i] for b in p5 if b in count and count[b][i] >= min_tokens]  # p5 of full bins
    reached = next((i for i in range(len(history)) if cells(i) and min(cells(i)) >= threshold), None)
    if reached is None:
        return {"reached_step": None, "held_fraction": None, "cells": 0}
    after = [p for i in range(reached, len(history)) for p in cells(i)]
    return {"reached_step": int(history[reached]["step"]),
            "held_fraction": float(np.mean([p >= threshold for p in after])), "cells": len(after)}


def paired_reward_diff(hist, ref_hist) -> dict:
    """Per-step reward of an arm minus a reference arm's, step by step: the arms share their
    seeds, so step t samples the same prompts in both and the prompt-to-prompt variation
    cancels. ``{"mean", "se", "steps"}`` (se: the standard error of the mean difference)."""
    ref = {h["step"]: h["reward_mean"] for h in ref_hist}
    diffs = np.asarray([h["reward_mean"] - ref[h["step"]] for h in hist if h["step"] in ref], np.float64)
    mean, se = mean_and_se(diffs)
    return {"mean": mean, "se": se, "steps": int(diffs.size)}


def arm_row(spec: RunSpec, arm: str, records: list[dict], histograms: list, window: int) -> dict:
    """One arm's figures at one seed (``spec``: the arm's run spec): reward windows, dense / sparse
    validation, the pooled tail (``min_p5``: the lowest pooled p5 of bins with >=
    ``calibration.min_count`` tokens, None for dense rollouts), its hold fraction, and the cost:
    ``gen_tokens_per_s`` (generated tokens per rollout decode second) beside the cost model's
    ``predicted_cost`` relative to dense."""
    rows = training_rows(records)
    full = training_report(records, histograms, num_prompts=1, prompts_per_step=1, steps=1, eval_k=spec.eval_k,
                           tau=spec.calibration.tau, min_count=spec.calibration.min_count)
    pooled = [b["p5"] for b in full["p5_by_bin"] if b["count"] >= spec.calibration.min_count and b["p5"] is not None]
    row = {**reward_start_end([h["reward_mean"] for h in rows], window),
           **{k: full[k] for k in ("val_dense", "val_sparse", "p5_by_bin", "p5_min_step_by_bin", "p5_hold_fraction",
                                   "sparse_token_fraction")},
           "min_p5": min(pooled) if pooled and spec.schedule.kind != "dense" else None,
           "response_length_end": float(np.mean([h["response_length/mean"] for h in rows][-3:])) if rows else None,
           "gen_tokens_per_s": generated_tokens_per_s(rows)}
    costs = [h["schedule/predicted_cost_vs_dense"] for h in rows if "schedule/predicted_cost_vs_dense" in h]
    if costs:
        row["predicted_cost_end"], row["predicted_cost_mean"] = float(costs[-1]), float(np.mean(costs))
    if arm in _ONLINE_START and rows:
        row["topk_end"] = {str(b): int(v[-1]) for b, v in bin_series(rows, "schedule/topk").items()}
        row["p5_hold"] = p5_hold(rows, spec.calibration.tau - 0.02, spec.schedule.online.min_tokens)
    return row


def _run_arm(spec: RunSpec, arm: str, seed: int, calibrated) -> SeedRun:
    """One arm at one seed (:func:`run_arm`), then its logs. With ``study.measure_speedup`` the first
    seed's run also times its final schedule against dense rollouts (kept in its ``report.json``;
    1.0 untimed for dense rollouts)."""
    arm_spec = _arm_spec(spec, arm, seed)
    seeds = study_seeds(spec)
    name = arm if len(seeds) == 1 else f"{arm}, seed {seed}"
    schedule = (calibrated,) if arm in ("calibrated", "online_distill") else ()  # else the arm's own
    timed = measure_rollout_speedup if spec.study.measure_speedup and seed == seeds[0] else None
    done = run_arm(arm_spec, lambda: build_run_context(arm_spec, *schedule), name, after_train=timed)
    return SeedRun(read_metrics(arm_spec.workdir), read_histograms(arm_spec.workdir), done)


def study_pending(spec: RunSpec, report: dict) -> bool:
    """Whether a finished study's ``report`` lacks an arm of ``study.arms`` (one added since) or the
    final evaluation its spec asks for: rerun, the study trains and evaluates only what is missing."""
    return set(spec.study.arms) != set(report.get("arms", {})) or final_eval_pending(spec, report)


def run_study(spec: RunSpec) -> dict:
    """Train every (arm, seed) of ``study.arms`` x :func:`study_seeds` not yet finished (arm by arm,
    seed by seed), calibrating ``calibrated_low`` / ``calibrated_high`` at ``study.low_tau`` /
    ``study.high_tau`` first when it has no schedule (one whose schedule equals the calibrated arm's,
    :func:`same_schedule`, is that arm's run: trained and evaluated once, marked ``same_run_as``),
    then write ``<workdir>/report.json`` (the table under ``arms``, :func:`arm_summary` per arm, and
    with ``study.final_eval_prompts`` the paired final evaluation under ``final_eval``,
    :mod:`sparrow_jax.run.final_eval`), ``study.png`` (the first seed's steps) and ``headline.png``
    from the arms' logs."""
    if not os.path.exists(os.path.join(spec.workdir, "schedule.json")):
        calibrate_run(spec)
    calibrated = build_schedule(spec.schedule, spec.workdir)
    seeds = study_seeds(spec)
    runs: dict[str, dict[int, SeedRun]] = {}
    same_run: dict[str, str] = {}  # arm -> the earlier arm whose run it is
    for arm in spec.study.arms:
        if arm in runs:  # the calibrated arm, run early for an arm before it that is its run
            continue
        if arm in _OTHER_TAU:
            other = _tau_calibration_spec(spec, arm)
            if not os.path.exists(os.path.join(other.workdir, "schedule.json")):
                calibrate_run(other)
            if _is_calibrated_run(spec, arm, other.workdir, calibrated):
                print(f"[arm] {arm}: its schedule is the calibrated arm's (top-k {list(calibrated.topk)}): "
                      "the same run", flush=True)
                if "calibrated" not in runs:
                    runs["calibrated"] = {seed: _run_arm(spec, "calibrated", seed, calibrated) for seed in seeds}
                same_run[arm], runs[arm] = "calibrated", runs["calibrated"]
                continue
        runs[arm] = {seed: _run_arm(spec, arm, seed, calibrated) for seed in seeds}
    num_prompts = runs[spec.study.arms[-1]][seeds[-1]].report["train_prompts"]
    seed_rows = {a: [training_rows(run.records) for run in by_seed.values()] for a, by_seed in runs.items()}
    # the plots draw a reused run once, under the names of every arm it stands for
    shown = {a: a + "".join(f" = {b}" for b, c in same_run.items() if c == a) for a in runs if a not in same_run}
    plot_study({shown[a]: seed_rows[a][0] for a in shown}, os.path.join(spec.workdir, "study.png"))
    window = reward_window(num_prompts, spec.rollout.prompts_per_step, spec.steps)
    rows = {a: {s: arm_row(_arm_spec(spec, a, s), a, run.records, run.histograms, window)
                for s, run in by_seed.items()} for a, by_seed in runs.items()}
    if "calibrated" in runs:  # is an arm's reward worse than the calibrated schedule's, beyond noise?
        for a, by_seed in runs.items():
            for s, run in by_seed.items():
                rows[a][s]["reward_vs_calibrated"] = paired_reward_diff(
                    training_rows(run.records), training_rows(runs["calibrated"][s].records))
    table = {a: arm_summary(_arm_spec(spec, a), rows[a], runs[a]) for a in runs}
    for a, b in same_run.items():
        table[a]["same_run_as"] = b
    relative_step_time(table)
    plot_headline({shown[a]: table[a] for a in shown}, {shown[a]: seed_rows[a] for a in shown},
                  os.path.join(spec.workdir, "headline.png"),
                  taus={shown[a]: _arm_spec(spec, a).calibration.tau for a in shown})
    report = {"arms": table, "seeds": list(seeds), "tau": spec.calibration.tau,
              "calibrated_topk": list(calibrated.topk), "aggressive_topk": spec.study.aggressive_topk,
              "steps": spec.steps}
    for arm, field in _OTHER_TAU.items():
        if arm in runs:
            report[field] = getattr(spec.study, field)
    final_eval_s = None
    if spec.study.final_eval_prompts:
        workdirs = {a: {s: _arm_spec(spec, a, s).workdir for s in seeds} for a in runs if a not in same_run}
        evaluated = evaluate_final(spec, workdirs)
        final_eval_s = _sum_known(evaluated.get("seconds", {}).get(name) for name in evaluated["runs"])
        if same_run:  # recorded beside the runs, so that readers of the file (summary, merges) see those arms
            evaluated["same_run_as"] = dict(same_run)
            atomic_write_json(os.path.join(spec.workdir, FINAL_EVAL_FILE), evaluated)
        report["final_eval"] = paired_figures(evaluated)
    report["wall_s"] = study_wall_seconds(spec, runs, final_eval_s, reused=set(same_run))
    atomic_write_json(os.path.join(spec.workdir, "report.json"), report)
    print_study(report)
    return report


def _is_calibrated_run(spec: RunSpec, arm: str, schedule_dir: str, calibrated: SparsitySchedule) -> bool:
    """Whether an arm of :data:`_OTHER_TAU` would train the calibrated arm's run: that arm is in the
    study, their schedules agree, and no part of training reads tau (it enters only the reports,
    except DistillSparse's switch to a sparser phase)."""
    return ("calibrated" in spec.study.arms and not spec.distill.enabled
            and same_schedule(build_schedule(_arm_spec(spec, arm).schedule, schedule_dir), calibrated))


def same_schedule(a: Optional[SparsitySchedule], b: Optional[SparsitySchedule]) -> bool:
    """Whether two schedules select the same pages everywhere (their labels and metadata aside)."""
    if a is None or b is None:
        return a is b
    unlabelled = lambda x: dataclasses.replace(x, name="", meta=None)  # noqa: E731
    return unlabelled(a) == unlabelled(b)


def _sum_known(values) -> Optional[float]:
    """The sum of ``values``, None if any is None (a part not measured)."""
    values = list(values)
    return None if any(v is None for v in values) else round(float(sum(values)), 1)


def _calibration_seconds(workdir: str) -> Optional[float]:
    path = os.path.join(workdir, "calibration.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get("seconds")


def study_wall_seconds(spec: RunSpec, runs: dict[str, dict[int, SeedRun]], final_eval_s: Optional[float],
                       reused: Collection[str] = ()) -> dict:
    """Where a study's wall time went, in seconds: ``calibration`` (the main schedule's and each other
    tau's, from their ``calibration.json``), ``arms`` (arm -> seed -> its run's ``wall_s``: model
    build, compiles, steps, validations and the speedup measurement; the ``reused`` arms, another
    arm's runs, are left out), ``final_eval`` (every policy's evaluation) and ``total``. A part not
    measured (an arm resumed from a checkpoint or finished before runs recorded their time) is None,
    and so is every sum that holds it."""
    calibration = {"calibrated": _calibration_seconds(spec.workdir)}
    calibration.update({a: _calibration_seconds(_tau_calibration_spec(spec, a).workdir) for a in runs if a in _OTHER_TAU})
    arms = {a: {str(s): run.report.get("wall_s") for s, run in by_seed.items()} for a, by_seed in runs.items()
            if a not in reused}
    parts = [*calibration.values(), *(t for by_seed in arms.values() for t in by_seed.values())]
    if spec.study.final_eval_prompts:
        parts.append(final_eval_s)
    return {"calibration": calibration, "arms": arms, "final_eval": final_eval_s, "total": _sum_known(parts)}


def print_study(report: dict) -> None:
    """The study table, one line per arm (dense held-out reward over seeds start -> end with standard
    errors, its change and curve area, sampled reward, min pooled p5, generated tokens per rollout
    second, paired speedup, step time relative to dense, share of visible pages kept, predicted cost
    relative to dense), the final evaluation's lines when it ran, then the report as one JSON line."""
    fmt = lambda x, f=".3f": "-" if x is None else format(x, f)  # noqa: E731
    pm = lambda x, se: fmt(x) if se is None else f"{fmt(x)}±{fmt(se)}"  # noqa: E731
    for a, row in report["arms"].items():
        val = row.get("held_out") or {}
        print(f"[study] {a:>17}: dense val {pm(val.get('start'), val.get('start_se'))} -> "
              f"{pm(val.get('end'), val.get('end_se'))} (change {pm(val.get('change'), val.get('change_se'))}, "
              f"area {fmt(val.get('auc'))}), reward {fmt(row['reward_start'])} -> {fmt(row['reward_end'])}, "
              f"min p5 {fmt(row['min_p5'])}, {fmt(row['gen_tokens_per_s'], '.0f')} gen tok/s, speedup "
              f"{fmt(row.get('rollout_speedup'), '.2f')}x, step time vs dense "
              f"{fmt(row.get('step_time_vs_dense'), '.2f')}x, kept pages {fmt(row.get('kept_page_share'))}, "
              f"predicted cost {fmt(row.get('predicted_cost_end'))}"
              + (f" (the {row['same_run_as']} arm's run: the same schedule)" if "same_run_as" in row else ""),
              flush=True)
    if "final_eval" in report:
        print("\n".join(format_final_eval(report["final_eval"])), flush=True)
    wall = report.get("wall_s")
    if wall:
        minutes = lambda x: "not measured" if x is None else f"{x / 60:.1f} min"  # noqa: E731
        arms = ", ".join(f"{a} {' / '.join(minutes(t) for t in by_seed.values())}" for a, by_seed in wall["arms"].items())
        cal = ", ".join(f"{a} {minutes(t)}" for a, t in wall["calibration"].items())
        print(f"[study] wall time: {minutes(wall['total'])} in all; calibration {cal}; arms (per seed) {arms}; "
              f"final evaluation {minutes(wall['final_eval'])}", flush=True)
    print(json.dumps(report))
