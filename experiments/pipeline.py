"""The end-to-end Sparrow pipeline behind ``experiments.run``.

warm-up (model.source == "warmup", cached) -> calibration (schedule.kind == "calibrated",
unless ``<workdir>/schedule.json`` exists) -> RL with the configured rollouts -> report:
``<workdir>/report.json`` (reward start/end, per-bin p5, tau, measured rollout speedup)
and ``<workdir>/reward.png``.
"""
from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from ml_collections import ConfigDict

from sparrow_jax.config_schema import validate
from sparrow_jax.io import atomic_write_json
from sparrow_jax.io.plots import plot_curves
from sparrow_jax.parallel import is_primary
from sparrow_jax.rl.trainer import train


def _window_mean(values, n=3):
    values = [v for v in values if v is not None]
    return float(np.mean(values[:n])) if values else None


def measure_rollout_speedup(result: dict, num_prompts: int = 4) -> dict:
    """Dense vs sparse rollout of the same eval prompts with the final params, timed in one run."""
    worker, schedule = result["worker"], result["schedule"]
    if schedule is None:
        return {"rollout_speedup": 1.0}
    rows = result["eval_rows"][:num_prompts]
    params = result["params"]
    timings = {}
    for name, sched in (("dense", None), ("sparse", schedule)):
        worker.schedule = sched
        worker.sample(params, rows, jax.random.PRNGKey(0), repeats=2)  # compile
        rollout, _ = worker.sample(params, rows, jax.random.PRNGKey(1), repeats=2)
        timings[name] = rollout.stats["decode_tokens"] / max(rollout.stats["decode_s"], 1e-9)
    worker.schedule = schedule
    return {"rollout_speedup": timings["sparse"] / timings["dense"], "dense_tok_s": timings["dense"],
            "sparse_tok_s": timings["sparse"]}


def _tail_on_heldout(cfg: ConfigDict, result_or_none, schedule, actor_params=None) -> dict:
    """Per-bin p5 of the sparse actor on the run's held-out prompts (before: initial model)."""
    from sparrow_jax.data.registry import get_task
    from sparrow_jax.models.tokenizer import load_tokenizer
    from sparrow_jax.rl.trainer import RolloutWorker, actor_tail, build_examples, build_model

    if result_or_none is None:
        tokenizer = load_tokenizer(cfg.tokenizer)
        task = get_task(cfg.task.name)
        config, params = build_model(cfg, tokenizer)
        worker = RolloutWorker(cfg, config, tokenizer, task, schedule)
        eval_rows = build_examples(cfg, task)[1]
    else:
        worker, config, params = result_or_none["worker"], result_or_none["config"], result_or_none["params"]
        eval_rows = result_or_none["eval_rows"]
    tail = actor_tail(worker, config, params, actor_params if actor_params is not None else params, eval_rows,
                      schedule, cfg.calibration.tau, jax.random.PRNGKey(cfg.seed + 99),
                      samples=cfg.distill.eval_samples)
    return {"bin_starts": tail["bin_starts"], "p5": tail["p5"], "mean": tail["mean"], "count": tail["count"]}


def _dense_policy_eval(cfg: ConfigDict, result: dict) -> dict:
    """mean@k / pass@k of the final dense policy with dense rollouts on the held-out prompts."""
    from sparrow_jax.rl.trainer import evaluate

    worker = result["worker"]
    saved, worker.schedule = worker.schedule, None
    try:
        return evaluate(worker, result["params"], result["eval_rows"], cfg.eval_k, jax.random.PRNGKey(cfg.seed + 7))
    finally:
        worker.schedule = saved


def _update_cost(history) -> float:
    times = [h["timing_s/update_actor"] for h in history[1:]]  # step 1 includes compilation
    return float(np.mean(times)) if times else float("nan")


def distill_report(cfg: ConfigDict, result: dict) -> dict:
    """p5 before/after DistillSparse on the same held-out prompts, and the reward vs a no-LoRA run.

    ``p5_before``: the initial model's sparse actor; ``p5_after``: the final sparse actor (final
    policy + LoRA); ``p5_after_without_lora``: the final policy's sparse actor without the
    LoRA, which separates what the LoRA did from how the policy moved.
    """
    schedule = result["schedule"]
    before = _tail_on_heldout(cfg, None, schedule)
    after = _tail_on_heldout(cfg, result, schedule, result["distiller"].actor_params(result["params"]))
    without = _tail_on_heldout(cfg, result, schedule)
    out = {"p5_before": before["p5"], "p5_after": after["p5"], "p5_after_without_lora": without["p5"],
           "bin_starts": after["bin_starts"], "tail_before": before, "tail_after": after,
           "tail_after_without_lora": without}
    rows = [f"{'bin':>6} {'before':>8} {'after':>8} {'no LoRA':>8}"]
    rows += [f"{start:>6} {b:8.3f} {a:8.3f} {w:8.3f}"
             for start, b, a, w in zip(after["bin_starts"], before["p5"], after["p5"], without["p5"])]
    print("[distill] held-out p5 of the sparse actor\n" + "\n".join(rows), flush=True)
    if cfg.distill.compare_without:
        plain_cfg = ConfigDict(cfg.to_dict())
        plain_cfg.distill.enabled = False
        plain_cfg.workdir = os.path.join(cfg.workdir, "without_distill")
        plain = train(plain_cfg, schedule=schedule)
        out["reward_with"] = [h["reward_mean"] for h in result["history"]]
        out["reward_without"] = [h["reward_mean"] for h in plain["history"]]
        out["final_eval_without"] = plain["final_eval"]
        out["dense_eval_with"] = _dense_policy_eval(cfg, result)
        out["dense_eval_without"] = _dense_policy_eval(cfg, plain)
        out["update_cost_ratio"] = _update_cost(result["history"]) / _update_cost(plain["history"])
        steps = [h["step"] for h in result["history"]]
        plot_curves({"DistillSparse": (steps, out["reward_with"]), "no LoRA": (steps, out["reward_without"])},
                    os.path.join(cfg.workdir, "reward_distill.png"), ylabel="reward", title="dense policy reward")
    return out


def _min_p5(history) -> float | None:
    """Minimum over bins of the per-bin p5 averaged over training (None for dense rollouts)."""
    keys = {k for h in history for k in h if k.startswith("mismatch/alpha_p5/bin_")}
    per_bin = [np.mean([h[k] for h in history if k in h]) for k in keys]
    return float(min(per_bin)) if per_bin else None


def run_study(cfg: ConfigDict) -> dict:
    """Same seeds and steps: dense rollouts vs the calibrated tau schedule vs an aggressive fixed budget."""
    from sparrow_jax.io.plots import plot_panels
    from sparrow_jax.rl.trainer import build_schedule

    if not os.path.exists(os.path.join(cfg.workdir, "schedule.json")):
        from sparrow_jax.mismatch.calibrate import calibrate_run
        calibrate_run(cfg)
    calibrated = build_schedule(cfg, cfg.workdir)
    arms = {}
    for arm in ("dense", "calibrated", "aggressive"):
        arm_cfg = ConfigDict(cfg.to_dict())
        arm_cfg.workdir = os.path.join(cfg.workdir, arm)
        arm_cfg.schedule.kind = {"dense": "dense", "calibrated": "json", "aggressive": "fixed"}[arm]
        arm_cfg.schedule.path = os.path.join(cfg.workdir, "schedule.json")
        arm_cfg.schedule.topk = cfg.study.aggressive_topk
        print(f"[study] arm {arm}", flush=True)
        arms[arm] = train(arm_cfg)["history"] if arm != "calibrated" else train(arm_cfg, schedule=calibrated)["history"]
    steps = {a: [h["step"] for h in hist] for a, hist in arms.items()}
    panels = [("reward", "reward_mean", {a: (steps[a], [h["reward_mean"] for h in hist]) for a, hist in arms.items()}),
              ("response length", "tokens", {a: (steps[a], [h["response_length/mean"] for h in hist])
                                             for a, hist in arms.items()}),
              ("min per-bin p5", "alpha p5", {a: (steps[a], [min([v for k, v in h.items()
                                                                   if k.startswith("mismatch/alpha_p5/bin_")] or [np.nan])
                                                              for h in hist]) for a, hist in arms.items() if a != "dense"})]
    plot_panels(panels, os.path.join(cfg.workdir, "study.png"))
    table = {a: {"reward_start": _window_mean([h["reward_mean"] for h in hist]),
                 "reward_end": _window_mean([h["reward_mean"] for h in hist][::-1]),
                 "min_p5": _min_p5(hist),
                 "response_length_end": _window_mean([h["response_length/mean"] for h in hist][::-1])}
             for a, hist in arms.items()}
    report = {"arms": table, "tau": cfg.calibration.tau, "calibrated_topk": list(calibrated.topk),
              "aggressive_topk": cfg.study.aggressive_topk, "steps": cfg.steps}
    atomic_write_json(os.path.join(cfg.workdir, "report.json"), report)
    for a, row in table.items():
        print(f"[study] {a:>10}: reward {row['reward_start']:.3f} -> {row['reward_end']:.3f}, min p5 {row['min_p5']}")
    print(json.dumps(report))
    return report


def run_pipeline(cfg: ConfigDict) -> dict:
    if "study" in cfg:
        return run_study(cfg)
    validate(cfg)
    os.makedirs(cfg.workdir, exist_ok=True)
    if is_primary():
        atomic_write_json(os.path.join(cfg.workdir, "config.json"), json.loads(cfg.to_json_best_effort()))
    t0 = time.perf_counter()
    calibration = None
    if cfg.schedule.kind == "calibrated" and not os.path.exists(os.path.join(cfg.workdir, "schedule.json")):
        from sparrow_jax.mismatch.calibrate import calibrate_run  # deferred: only calibrated runs need it
        calibration = calibrate_run(cfg)
    result = train(cfg)
    history = result["history"]
    rewards = [h["reward_mean"] for h in history]
    p5_keys = sorted((k for k in (history[-1] if history else {}) if k.startswith("mismatch/alpha_p5/bin_")),
                     key=lambda k: int(k.rsplit("_", 1)[1]))
    p5_by_bin = {k.rsplit("_", 1)[1]: _window_mean([h.get(k) for h in history if h.get(k) == h.get(k)], len(history))
                 for k in p5_keys}
    report = {
        "reward_start": _window_mean(rewards),
        "reward_end": _window_mean(rewards[::-1]),
        "p5_by_bin": {k: v for k, v in p5_by_bin.items() if v is not None},
        "tau": cfg.calibration.tau,
        "schedule": result["schedule"].to_dict() if result["schedule"] is not None else "dense",
        "final_eval": result["final_eval"],
        "steps": cfg.steps,
    }
    report.update(measure_rollout_speedup(result))
    if cfg.distill.enabled:
        report.update(distill_report(cfg, result))
    if calibration is not None:
        report["calibration"] = {k: v for k, v in calibration.items() if k in ("validation", "table_path", "png")}
    if history:
        plot_curves({"reward_mean": ([h["step"] for h in history], rewards)},
                    os.path.join(cfg.workdir, "reward.png"), ylabel="reward", title="reward over training")
    report["wall_s"] = time.perf_counter() - t0
    if is_primary():  # only process 0 writes reports
        atomic_write_json(os.path.join(cfg.workdir, "report.json"), report)
    print(f"[report] reward {report['reward_start']:.3f} -> {report['reward_end']:.3f}; "
          f"rollout speedup {report['rollout_speedup']:.2f}x; p5 by bin {report['p5_by_bin']}", flush=True)
    print(json.dumps({k: report[k] for k in ("reward_start", "reward_end", "p5_by_bin", "tau", "rollout_speedup")}))
    return report
