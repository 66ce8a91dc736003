"""The end-to-end Sparrow pipeline behind ``experiments.run`` and the notebooks.

warm-up (model.source == "warmup", cached) -> calibration (schedule.kind == "calibrated",
unless ``<workdir>/schedule.json`` exists) -> RL with the configured rollouts -> report:
``<workdir>/report.json`` (reward start/end, per-bin p5, tau, measured rollout speedup)
and ``<workdir>/reward.png``. ``run_study`` runs the dense / calibrated / aggressive arms.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np

from sparrow_jax.io import atomic_write_json
from sparrow_jax.io.plots import plot_curves, plot_panels
from sparrow_jax.mismatch.calibrate import sparse_token_fraction
from sparrow_jax.mismatch.probe import probe_report
from sparrow_jax.parallel import is_primary
from sparrow_jax.rl.trainer import TrainResult, actor_tail, evaluate, lora_config, merge_lora_actor, sample, train
from sparrow_jax.run.calibration import calibrate_run
from sparrow_jax.run.context import RunContext, build_run_context, build_schedule
from sparrow_jax.run.specs import RunSpec
from sparrow_jax.run.workdir import check_workdir, write_config


def _window_mean(values, n=3):
    values = [v for v in values if v is not None]
    return float(np.mean(values[:n])) if values else None


def reward_window(num_prompts: int, prompts_per_step: int, steps: int) -> int:
    """Steps averaged into ``reward_start`` / ``reward_end``: one pass over the training prompts
    (rounded up to whole steps) when the run makes at least two, so both windows hold the same
    prompts (exactly when ``prompts_per_step`` divides ``num_prompts``) and their difference is
    the policy's, not that of which prompts a step drew; otherwise 3 steps."""
    per_pass = -(-num_prompts // prompts_per_step)
    return per_pass if 2 * per_pass <= steps else 3


def reward_start_end(rewards: list, window: int) -> dict:
    """``reward_start`` / ``reward_end``: mean reward of the first and last ``window`` steps;
    ``reward_change_se``: the standard error of their difference from the steps' spread (None
    under two steps per window)."""
    first, last = (np.asarray([r for r in part if r is not None][:window], np.float64)
                   for part in (rewards, rewards[::-1]))
    se = None
    if min(first.size, last.size) >= 2:
        se = float(np.sqrt(first.var(ddof=1) / first.size + last.var(ddof=1) / last.size))
    mean = lambda x: float(x.mean()) if x.size else None  # noqa: E731
    return {"reward_start": mean(first), "reward_end": mean(last), "reward_window_steps": window,
            "reward_change_se": se}


def speedup_summary(dense_tok_s: list[float], sparse_tok_s: list[float]) -> dict:
    """Rollout speedup from alternating repeats (``dense_tok_s[i]`` then ``sparse_tok_s[i]``).

    ``rollout_speedup``: sparse's best repeat over dense's best (each side's least disturbed
    run). ``rollout_speedup_paired``: min / median / max of the ratios of the repeats timed
    back to back, which show how far one run's figure moves with the machine's noise: on a shared
    2-core machine a process's dense speed varies by a third with where its KV pool lands in memory.
    """
    if not dense_tok_s or len(dense_tok_s) != len(sparse_tok_s):
        raise ValueError(f"need as many sparse as dense repeats (>= 1), got {len(dense_tok_s)} dense and "
                         f"{len(sparse_tok_s)} sparse")
    paired = np.asarray(sparse_tok_s, np.float64) / np.asarray(dense_tok_s, np.float64)
    best_dense, best_sparse = max(dense_tok_s), max(sparse_tok_s)
    return {"rollout_speedup": best_sparse / best_dense, "dense_tok_s": best_dense, "sparse_tok_s": best_sparse,
            "rollout_speedup_paired": {"min": float(paired.min()), "median": float(np.median(paired)),
                                       "max": float(paired.max())}}


def _paired_text(report: dict) -> str:
    paired = report.get("rollout_speedup_paired")
    return f" (repeats timed back to back: {paired['min']:.2f}-{paired['max']:.2f}, median {paired['median']:.2f})" \
        if paired else ""


def measure_rollout_speedup(ctx: RunContext, result: TrainResult, num_prompts: int = 8, repeats: int = 9) -> dict:
    """Dense vs sparse rollout of the same eval prompts with the final params, timed in one run
    (:func:`speedup_summary`); ``sparse_token_fraction`` of the sparse rollout's generated tokens.

    Each side first runs once untimed, then ``repeats`` times with the same key, dense and sparse
    alternating so that other load on the machine hits both alike: the timed runs do exactly the
    compiled work of the first (another key would give other lengths, hence other pool sizes and
    segment shapes, and time their compilation). A repeat's speed is its decode tokens/s."""
    if result.schedule is None:
        return {"rollout_speedup": 1.0, "sparse_token_fraction": 0.0}
    rows, params = ctx.eval_rows[:num_prompts], result.state.train.params
    sides = {"dense": None, "sparse": result.schedule}
    for sched in sides.values():
        sample(ctx, params, rows, jax.random.PRNGKey(1), 2, sched)  # compile every shape this work needs
    tok_s, timed_compiles = {name: [] for name in sides}, 0
    for _ in range(repeats):
        for name, sched in sides.items():
            rollout, _ = sample(ctx, params, rows, jax.random.PRNGKey(1), 2, sched)
            tok_s[name].append(rollout.stats["decode_tokens"] / max(rollout.stats["decode_s"], 1e-9))
            timed_compiles += int(rollout.stats.get("compiles", 0))
    return {**speedup_summary(tok_s["dense"], tok_s["sparse"]), "speedup_timed_compiles": timed_compiles,
            "sparse_token_fraction": sparse_token_fraction(result.schedule, rollout.prompt_lens, rollout.lengths)}


def _tail(spec: RunSpec, ctx: RunContext, params, schedule, actor_params=None) -> dict:
    """Per-bin p5 of the sparse actor on the run's held-out prompts."""
    tail = actor_tail(ctx, params, actor_params if actor_params is not None else params, ctx.eval_rows, schedule,
                      spec.calibration.tau, jax.random.PRNGKey(spec.seed + 99), samples=spec.distill.eval_samples)
    return {"bin_starts": tail["bin_starts"], "p5": tail["p5"], "mean": tail["mean"], "count": tail["count"]}


def _dense_policy_eval(spec: RunSpec, ctx: RunContext, result: TrainResult) -> dict:
    """mean@k / pass@k of the final dense policy with dense rollouts on the held-out prompts."""
    return evaluate(ctx, result.state.train.params, None, ctx.eval_rows, spec.eval_k, jax.random.PRNGKey(spec.seed + 7))


def _update_cost(history) -> float:
    times = [h["timing_s/update_actor"] for h in history[1:]]  # step 1 includes compilation
    return float(np.mean(times)) if times else float("nan")


def distill_report(spec: RunSpec, ctx: RunContext, result: TrainResult) -> dict:
    """p5 before/after DistillSparse on the same held-out prompts, and the reward vs a no-LoRA run.

    ``p5_before``: the initial model's sparse actor; ``p5_after``: the final sparse actor (final
    policy + LoRA); ``p5_after_without_lora``: the final policy's sparse actor without the
    LoRA, which separates what the LoRA did from how the policy moved.
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
    if spec.distill.compare_without:
        plain_spec = dataclasses.replace(spec, workdir=os.path.join(spec.workdir, "without_distill"),
                                         distill=dataclasses.replace(spec.distill, enabled=False))
        plain = train(plain_spec, dataclasses.replace(ctx, schedule=schedule))
        out["reward_with"] = [h["reward_mean"] for h in result.history]
        out["reward_without"] = [h["reward_mean"] for h in plain.history]
        out["final_eval_without"] = plain.final_eval
        out["dense_eval_with"] = _dense_policy_eval(spec, ctx, result)
        out["dense_eval_without"] = _dense_policy_eval(spec, ctx, plain)
        out["update_cost_ratio"] = _update_cost(result.history) / _update_cost(plain.history)
        steps = [h["step"] for h in result.history]
        plot_curves({"DistillSparse": (steps, out["reward_with"]), "no LoRA": (steps, out["reward_without"])},
                    os.path.join(spec.workdir, "reward_distill.png"), ylabel="reward", title="dense policy reward")
    return out


def _min_p5(history) -> float | None:
    """Minimum over bins of the per-bin p5 averaged over training (None for dense rollouts)."""
    per_bin = [np.nanmean(v) for v in _bin_series(history, "mismatch/alpha_p5/bin_").values()]
    return float(min(per_bin)) if per_bin else None


_ONLINE_START = {"online_dense": "dense", "online_aggressive": "fixed", "online_distill": "calibrated"}


def _arm_spec(spec: RunSpec, arm: str) -> RunSpec:
    """The run of one study arm: its schedule (and DistillSparse for ``online_distill``) in ``<workdir>/<arm>``."""
    s, distill = spec.schedule, spec.distill
    if arm in _ONLINE_START:
        schedule = dataclasses.replace(s, kind="online", topk=spec.study.aggressive_topk,
                                       online=dataclasses.replace(s.online, start=_ONLINE_START[arm]))
        if arm == "online_distill":
            distill = dataclasses.replace(distill, enabled=True, compare_without=False)
    else:
        kind = {"dense": "dense", "calibrated": "json", "aggressive": "fixed"}[arm]
        schedule = dataclasses.replace(s, kind=kind, path=os.path.join(spec.workdir, "schedule.json"),
                                       topk=spec.study.aggressive_topk)
    return dataclasses.replace(spec, workdir=os.path.join(spec.workdir, arm), schedule=schedule, distill=distill,
                               study=None)


def _bin_series(history, prefix: str) -> dict[int, list]:
    """``{bin_start: [value per step (nan where absent)]}`` of the metrics ``<prefix><bin_start>``."""
    starts = sorted({int(k[len(prefix):]) for h in history for k in h if k.startswith(prefix)})
    return {b: [h.get(f"{prefix}{b}", np.nan) for h in history] for b in starts}


def p5_hold(history, threshold: float, min_tokens: float) -> dict:
    """When every bin with >= ``min_tokens`` tokens first has p5 >= ``threshold`` (``reached_step``,
    None if never), and the share of (step, bin) cells with that many tokens from then on that
    keep it (``held_fraction``, over ``cells`` cells)."""
    p5 = _bin_series(history, "mismatch/alpha_p5/bin_")
    count = _bin_series(history, "mismatch/count/bin_")
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
    if diffs.size < 2:
        return {"mean": float(diffs.mean()) if diffs.size else None, "se": None, "steps": int(diffs.size)}
    return {"mean": float(diffs.mean()), "se": float(diffs.std(ddof=1) / np.sqrt(diffs.size)),
            "steps": int(diffs.size)}


def _arm_row(spec: RunSpec, arm: str, hist, window: int) -> dict:
    rewards = [h["reward_mean"] for h in hist]
    row = {**reward_start_end(rewards, window), "min_p5": _min_p5(hist),
           "response_length_end": _window_mean([h["response_length/mean"] for h in hist][::-1]),
           "rollout_s_mean": float(np.mean([h["timing_s/gen"] for h in hist[1:]] or [np.nan])),
           # the median ignores steps that compiled (a new pool size or k_max bucket)
           "rollout_s_median": float(np.median([h["timing_s/gen"] for h in hist[1:]] or [np.nan]))}
    costs = [h["schedule/predicted_cost_vs_dense"] for h in hist if "schedule/predicted_cost_vs_dense" in h]
    if costs:
        row["predicted_cost_end"] = float(costs[-1])
    if arm in _ONLINE_START and hist:
        row["topk_end"] = {str(b): int(v[-1]) for b, v in _bin_series(hist, "schedule/topk/bin_").items()}
        row["p5_hold"] = p5_hold(hist, spec.schedule.online.tau - 0.02, spec.schedule.online.min_tokens)
    return row


def plot_study(arms: dict[str, list], path: str) -> None:
    """study.png: reward, mean alpha and rollout seconds per step for every arm; then per sparse
    arm its p5 per generated-position bin, and per online arm its top-k per bin (bins that
    received tokens only)."""
    steps = {a: [h["step"] for h in hist] for a, hist in arms.items()}
    series = lambda key: {a: (steps[a], [h.get(key, np.nan) for h in hist]) for a, hist in arms.items()}
    panels = [("reward", "reward_mean", series("reward_mean")),
              ("mean alpha (sparse arms)", "alpha mean", {a: v for a, v in series("mismatch/alpha_mean").items()
                                                          if a != "dense"}),
              ("rollout seconds per step", "s", series("timing_s/gen"))]
    for a, hist in arms.items():
        if a == "dense":
            continue
        counts = _bin_series(hist, "mismatch/count/bin_")
        used = [b for b, c in counts.items() if np.nansum(c) > 0]
        p5 = _bin_series(hist, "mismatch/alpha_p5/bin_")
        panels.append((f"p5 per bin: {a}", "alpha p5", {f"bin {b}": (steps[a], p5[b]) for b in used if b in p5}))
        if a in _ONLINE_START:
            topk = _bin_series(hist, "schedule/topk/bin_")
            panels.append((f"top-k per bin: {a}", "pages", {f"bin {b}": (steps[a], topk[b]) for b in used
                                                             if b in topk}))
    plot_panels(panels, path, columns=4)


def run_study(spec: RunSpec) -> dict:
    """Same seeds and steps for every arm of ``study.arms``: dense rollouts, the calibrated tau
    schedule, an aggressive fixed budget, and the online controller started dense, aggressive or
    calibrated with DistillSparse."""
    if not os.path.exists(os.path.join(spec.workdir, "schedule.json")):
        calibrate_run(spec)
    calibrated = build_schedule(spec.schedule, spec.workdir)
    arms, num_prompts = {}, 0
    for arm in spec.study.arms:
        arm_spec = _arm_spec(spec, arm)
        print(f"[study] arm {arm}", flush=True)
        with_calibrated = arm in ("calibrated", "online_distill")
        ctx = build_run_context(arm_spec, calibrated) if with_calibrated else build_run_context(arm_spec)
        arms[arm], num_prompts = train(arm_spec, ctx).history, len(ctx.train_rows)
    plot_study(arms, os.path.join(spec.workdir, "study.png"))
    window = reward_window(num_prompts, spec.rollout.prompts_per_step, spec.steps)
    table = {a: _arm_row(spec, a, hist, window) for a, hist in arms.items()}
    if "calibrated" in arms:  # is an arm's reward worse than the calibrated schedule's, beyond noise?
        for a, hist in arms.items():
            table[a]["reward_vs_calibrated"] = paired_reward_diff(hist, arms["calibrated"])
    report = {"arms": table, "tau": spec.calibration.tau, "calibrated_topk": list(calibrated.topk),
              "aggressive_topk": spec.study.aggressive_topk, "steps": spec.steps}
    atomic_write_json(os.path.join(spec.workdir, "report.json"), report)
    for a, row in table.items():
        print(f"[study] {a:>10}: reward {row['reward_start']:.3f} -> {row['reward_end']:.3f}, min p5 {row['min_p5']}")
    print(json.dumps(report))
    return report


def p5_by_bin(history) -> list[dict]:
    """Per position bin over the RL steps: ``{"bin_start", "p5", "mean", "count"}``, p5 and mean
    of alpha averaged over steps weighted by the bin's tokens in each, count the tokens in all."""
    starts = sorted({int(k.rsplit("_", 1)[1]) for h in history for k in h if k.startswith("mismatch/count/bin_")})
    out = []
    for s in starts:
        rows = [(h[f"mismatch/count/bin_{s}"], h[f"mismatch/alpha_p5/bin_{s}"], h[f"mismatch/alpha_mean/bin_{s}"])
                for h in history if h.get(f"mismatch/count/bin_{s}", 0) > 0 and f"mismatch/alpha_p5/bin_{s}" in h]
        count = float(sum(c for c, _, _ in rows))
        if count > 0:
            out.append({"bin_start": s, "p5": sum(c * p for c, p, _ in rows) / count,
                        "mean": sum(c * m for c, _, m in rows) / count, "count": int(count)})
    return out


def run_pipeline(spec: RunSpec) -> dict:
    """Calibrate if asked, train, and write ``<workdir>/report.json`` and plots; returns the report."""
    check_workdir(spec)  # before anything is written: a workdir's run continues only under its own config
    if is_primary():
        write_config(spec)
    if spec.study is not None:
        return run_study(spec)
    t0 = time.perf_counter()
    calibration = None
    start = spec.schedule.online.start if spec.schedule.kind == "online" else spec.schedule.kind
    if start == "calibrated" and not os.path.exists(os.path.join(spec.workdir, "schedule.json")):
        calibration = calibrate_run(spec)
    ctx = build_run_context(spec)
    result = train(spec, ctx)
    rewards = [h["reward_mean"] for h in result.history]
    window = reward_window(len(ctx.train_rows), spec.rollout.prompts_per_step, spec.steps)
    report = {**reward_start_end(rewards, window), "p5_by_bin": p5_by_bin(result.history), "tau": spec.calibration.tau,
              "completion_tokens_mean": (float(np.mean([h["response_length/mean"] for h in result.history]))
                                         if result.history else None),
              "schedule": result.schedule.to_dict() if result.schedule is not None else "dense",
              "final_eval": result.final_eval, "steps": spec.steps}
    report.update(measure_rollout_speedup(ctx, result))
    report.update(probe_report(result.history, spec.calibration.min_count))  # online probe: predicted vs measured p5
    if spec.distill.enabled:
        report.update(distill_report(spec, ctx, result))
    if calibration is not None:
        report["calibration"] = {k: v for k, v in calibration.items() if k in ("validation", "table_path", "png")}
    if result.history:
        plot_curves({"reward_mean": ([h["step"] for h in result.history], rewards)},
                    os.path.join(spec.workdir, "reward.png"), ylabel="reward", title="reward over training")
    report["wall_s"] = time.perf_counter() - t0
    if is_primary():  # only process 0 writes reports
        atomic_write_json(os.path.join(spec.workdir, "report.json"), report)
    print(f"[report] reward {report['reward_start']:.3f} -> {report['reward_end']:.3f}; "
          f"rollout speedup {report['rollout_speedup']:.2f}x{_paired_text(report)}; p5 by bin {report['p5_by_bin']}",
          flush=True)
    print(json.dumps({k: report[k] for k in ("reward_start", "reward_end", "p5_by_bin", "tau", "rollout_speedup",
                                             "completion_tokens_mean", "sparse_token_fraction")}))
    return report
