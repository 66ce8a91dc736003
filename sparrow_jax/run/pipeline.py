"""The end-to-end Sparrow pipeline behind ``experiments.run`` and the notebooks.

warm-up (model.source == "warmup", cached) -> calibration (schedule.kind == "calibrated",
unless ``<workdir>/schedule.json`` exists) -> RL with the configured rollouts -> with DistillSparse
and ``distill.compare_without``, the same RL without the LoRA as an arm
(:func:`~sparrow_jax.run.study.run_arm`) -> report:
``<workdir>/report.json`` (figures rebuilt from the workdir's logs, :mod:`sparrow_jax.run.report`,
and the rollout speedup measured like for like, :mod:`sparrow_jax.run.speed`) and
``<workdir>/reward.png``. A study config runs its arms (:mod:`sparrow_jax.run.study`).

A finished run (its ``report.json`` holds this many steps) rerun with the same command prints
its report and returns without writing anything.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Optional

import jax
import numpy as np

from sparrow_jax.io import atomic_write_json
from sparrow_jax.io.metrics import read_histograms, read_metrics
from sparrow_jax.io.plots import plot_curves
from sparrow_jax.mismatch.probe import probe_report
from sparrow_jax.parallel import is_primary
from sparrow_jax.rl.trainer import TrainResult, actor_tail, lora_config, merge_lora_actor, train
from sparrow_jax.run.calibration import calibrate_run
from sparrow_jax.run.context import RunContext, build_run_context
from sparrow_jax.run.report import training_report, training_rows, val_series
from sparrow_jax.run.specs import RunSpec
from sparrow_jax.run.speed import measure_rollout_speedup
from sparrow_jax.run.study import WITHOUT_LORA, print_study, run_arm, run_study, study_pending, without_lora_spec
from sparrow_jax.run.workdir import REPORT_FILE, check_workdir, finished_report, write_config



def _tail(spec: RunSpec, ctx: RunContext, params, schedule, actor_params=None) -> dict:
    """Per-bin p5 of the sparse actor on the run's held-out prompts."""
    tail = actor_tail(ctx, params, actor_params if actor_params is not None else params, ctx.eval_rows, schedule,
                      spec.calibration.tau, jax.random.PRNGKey(spec.seed + 99), samples=spec.distill.eval_samples)
    return {"bin_starts": tail["bin_starts"], "p5": tail["p5"], "mean": tail["mean"], "count": tail["count"]}


def _records(workdir: str, result: TrainResult) -> list[dict]:
    """The whole run's logged steps (earlier processes' too); a non-primary process has only its own."""
    return read_metrics(workdir) if is_primary() else result.history


def _update_cost(history) -> float:
    times = [h["timing_s/update_actor"] for h in history[1:]]  # step 1 includes compilation
    return float(np.mean(times)) if times else float("nan")


def distill_report(spec: RunSpec, ctx: RunContext, result: TrainResult) -> dict:
    """p5 before/after DistillSparse on the same held-out prompts, and the reward vs a no-LoRA run.

    ``p5_before``: the initial model's sparse actor; ``p5_after``: the final sparse actor (final
    policy + LoRA); ``p5_after_without_lora``: the final policy's sparse actor without the
    LoRA, which separates what the LoRA did from how the policy moved. With ``compare_without``,
    read from the logs of the no-LoRA arm the pipeline trained in ``<workdir>/without_distill``
    (process 0 only, which holds them): both runs' rewards, its dense and sparse validation
    series, and the update cost ratio.
    """
    schedule, params = result.schedule, result.state.train.params
    before = _tail(spec, ctx, ctx.params, schedule)
    actor = merge_lora_actor(params, result.state.lora.lora, lora_config(spec.distill))
    after = _tail(spec, ctx, params, schedule, actor)
    without = _tail(spec, ctx, params, schedule)
    out = {"p5_before": before["p5"], "p5_after": after["p5"], "p5_after_without_lora": without["p5"],
           "bin_starts": after["bin_starts"], "tail_before": before, "tail_after": after,
           "tail_after_without_lora": without}
    rows = [f"{'bin':>6} {'before':>8} {'after':>8} {'no LoRA':>8}"]
    rows += [f"{start:>6} {b:8.3f} {a:8.3f} {w:8.3f}"
             for start, b, a, w in zip(after["bin_starts"], before["p5"], after["p5"], without["p5"])]
    print("[distill] held-out p5 of the sparse actor\n" + "\n".join(rows), flush=True)
    if spec.distill.compare_without and is_primary():
        with_records, without_records = read_metrics(spec.workdir), read_metrics(without_lora_spec(spec).workdir)
        with_rows, without_rows = training_rows(with_records), training_rows(without_records)
        out["reward_with"] = [h["reward_mean"] for h in with_rows]
        out["reward_without"] = [h["reward_mean"] for h in without_rows]
        out["val_dense_without"] = val_series(without_records, "dense", spec.eval_k)
        out["val_sparse_without"] = val_series(without_records, "sparse", spec.eval_k)
        out["update_cost_ratio"] = _update_cost(with_rows) / _update_cost(without_rows)
        steps = [h["step"] for h in with_rows]
        plot_curves({"DistillSparse": (steps, out["reward_with"]), "no LoRA": (steps, out["reward_without"])},
                    os.path.join(spec.workdir, "reward_distill.png"), ylabel="reward", title="dense policy reward")
    return out


def calibration_on_disk(workdir: str) -> Optional[dict]:
    """``validation``, ``table_path`` and ``png`` of the calibration written in ``workdir`` (None if none was)."""
    table = os.path.join(workdir, "calibration.json")
    if not os.path.exists(table):
        return None
    with open(table) as f:
        validation = json.load(f).get("validation")
    return {"validation": validation, "table_path": table, "png": os.path.join(workdir, "p5_by_position.png")}


def print_report(report: dict) -> None:
    """The run's summary line, then its headline figures as one JSON line."""
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    paired = report.get("rollout_speedup_paired")
    spread = f" (paired {paired['min']:.2f}-{paired['max']:.2f})" if paired else ""
    val = report.get("val_dense") or {}
    print(f"[report] reward {fmt(report['reward_start'])} -> {fmt(report['reward_end'])}; dense validation "
          f"{fmt(val.get('start'))} -> {fmt(val.get('end'))}; rollout speedup {report['rollout_speedup']:.2f}x"
          f"{spread}; pooled p5 by bin {[fmt(b['p5']) for b in report['p5_by_bin']]}", flush=True)
    print(json.dumps({k: report.get(k) for k in ("reward_start", "reward_end", "val_dense", "val_sparse", "p5_by_bin",
                                                 "p5_min_step_by_bin", "p5_hold_fraction", "tau", "rollout_speedup",
                                                 "rollout_speedup_paired", "dense_tok_s", "sparse_tok_s",
                                                 "completion_tokens_mean", "sparse_token_fraction")}))


def run_pipeline(spec: RunSpec) -> dict:
    """Calibrate if asked, train, and write ``<workdir>/report.json`` and plots; returns the report.
    A finished run's report is printed and returned as it is (nothing is written)."""
    check_workdir(spec)  # before anything is written: a workdir's run continues only under its own config
    done = finished_report(spec)
    if done is not None and not (spec.study is not None and study_pending(spec, done)):
        print(f"[report] {spec.workdir} has finished its {spec.steps} steps; its {REPORT_FILE}:", flush=True)
        (print_study if spec.study is not None else print_report)(done)
        return done
    if is_primary():
        write_config(spec)
    if spec.study is not None:
        return run_study(spec)
    t0 = time.perf_counter()
    start = spec.schedule.online.start if spec.schedule.kind == "online" else spec.schedule.kind
    if start == "calibrated" and not os.path.exists(os.path.join(spec.workdir, "schedule.json")):
        calibrate_run(spec)  # writes <workdir>/calibration.json, which the report reads
    ctx = build_run_context(spec)
    result = train(spec, ctx)
    if spec.distill.enabled and spec.distill.compare_without:  # its schedule: the one this run ended with
        run_arm(without_lora_spec(spec), lambda: dataclasses.replace(ctx, schedule=result.schedule), WITHOUT_LORA)
    records = _records(spec.workdir, result)
    histograms = read_histograms(spec.workdir) if is_primary() else []
    report = {**training_report(records, histograms, num_prompts=len(ctx.train_rows),
                                prompts_per_step=spec.rollout.prompts_per_step, steps=spec.steps,
                                eval_k=spec.eval_k, tau=spec.calibration.tau, min_count=spec.calibration.min_count),
              "tau": spec.calibration.tau,
              "schedule": result.schedule.to_dict() if result.schedule is not None else "dense", "steps": spec.steps}
    report.update(measure_rollout_speedup(ctx, result))
    report.update(probe_report(training_rows(records), spec.calibration.min_count))  # online probe vs the p5 sampled next
    if spec.distill.enabled:
        report.update(distill_report(spec, ctx, result))
    calibration = calibration_on_disk(spec.workdir)  # this process's calibration, or an earlier attempt's
    if calibration is not None:
        report["calibration"] = calibration
    rows = training_rows(records)
    if rows:
        plot_curves({"reward_mean": ([h["step"] for h in rows], [h["reward_mean"] for h in rows])},
                    os.path.join(spec.workdir, "reward.png"), ylabel="reward", title="reward over training")
    report["wall_s"] = time.perf_counter() - t0
    if is_primary():  # only process 0 writes reports
        atomic_write_json(os.path.join(spec.workdir, REPORT_FILE), report)
    print_report(report)
    return report
