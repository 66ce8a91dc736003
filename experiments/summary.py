"""A run's or a study's summary from its workdir, without rerunning anything:
``python -m experiments.summary runs/quickstart``.

Reads ``config.json``, ``metrics.jsonl``, ``alpha_hist.jsonl`` and (when the run finished)
``report.json``; prints a table (the run's wall time, reward and dense / sparse validation start -> end with their
standard errors, the pooled per-bin p5 and each bin's worst step, the hold fraction, the rollout
speedup and costs, seconds per phase) and redraws the run's plots. Works on a run that is still
going or was killed: the figures are those of the steps logged so far. A study's workdir
(``config.json`` with a ``study`` block) gets one column per arm that has logged steps (per arm and
seed with several ``study.seeds``), then its paired final evaluation when ``final_eval.json`` holds
one (:mod:`sparrow_jax.run.final_eval`).

Several workdirs (``python -m experiments.summary runs/headline runs/headline_seed2``): each one's
summary, then their final evaluations merged into one paired evaluation over all their seeds
(:func:`~sparrow_jax.run.final_eval_figures.merge_records`: seeds run as separate studies).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Optional

import numpy as np
from absl import app

from sparrow_jax.io.metrics import read_histograms, read_metrics
from sparrow_jax.io.plots import plot_curves
from sparrow_jax.run.final_eval_figures import FINAL_EVAL_FILE, format_final_eval, merge_records, paired_figures
from sparrow_jax.run.report import generated_tokens_per_s, reward_window, training_report, training_rows

USAGE = "usage: python -m experiments.summary <workdir> [<workdir> ...]"


def _read_json(path: str) -> Optional[dict]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _with_se(value: Optional[float], se: Optional[float]) -> str:
    return _fmt(value) if se is None else f"{_fmt(value)}±{_fmt(se)}"


def _start_end(series: Optional[dict]) -> str:
    if not series:
        return "-"
    return f"{_with_se(series['start'], series.get('start_se'))} -> {_with_se(series['end'], series.get('end_se'))}"


def phase_seconds(rows: list[dict]) -> dict[str, float]:
    """Median seconds per step of every ``timing_s/*`` phase over the steps after the first
    (which compiles); the first step's when it is the only one."""
    later = rows[1:] or rows
    names = sorted({k for r in later for k in r if k.startswith("timing_s/")})
    return {n[len("timing_s/"):]: float(np.median([r[n] for r in later if n in r])) for n in names}


def summarize_run(workdir: str, config: dict) -> dict:
    """The figures of one run's workdir (a study arm's included), from its files alone."""
    logged = os.path.exists(os.path.join(workdir, "metrics.jsonl"))  # none before the first step
    records, histograms = (read_metrics(workdir), read_histograms(workdir)) if logged else ([], [])
    rows = training_rows(records)
    steps, rollout = int(config["steps"]), config["rollout"]
    num_train = int(config["task"].get("num_train") or 0) or 10 ** 9  # a dataset's size is not in config.json
    figures = training_report(records, histograms, num_prompts=num_train,
                              prompts_per_step=int(rollout["prompts_per_step"]), steps=steps,
                              eval_k=int(config["eval_k"]), tau=float(config["calibration"]["tau"]),
                              min_count=float(config["calibration"]["min_count"]))
    report = _read_json(os.path.join(workdir, "report.json")) or {}
    done = report.get("steps") == steps
    costs = [r["schedule/predicted_cost_vs_dense"] for r in rows if "schedule/predicted_cost_vs_dense" in r]
    return {**figures, "workdir": workdir, "status": "finished" if done else f"at step {len(rows)} of {steps}",
            "window": reward_window(num_train, int(rollout["prompts_per_step"]), steps),
            "rollout_speedup": report.get("rollout_speedup"), "rollout_speedup_paired": report.get("rollout_speedup_paired"),
            "wall_s": report.get("wall_s"), "wall_s_partial": report.get("wall_s_partial"),
            "gen_tokens_per_s": generated_tokens_per_s(rows), "predicted_cost_end": costs[-1] if costs else None,
            "timing_s": phase_seconds(rows), "rows": rows}


def table(columns: dict[str, dict]) -> str:
    """Rows of figures, one column per run (or study arm)."""
    def speedup(s: dict) -> str:
        paired = s.get("rollout_speedup_paired")
        spread = f" ({paired['min']:.2f}-{paired['max']:.2f})" if paired else ""
        return "-" if s["rollout_speedup"] is None else f"{s['rollout_speedup']:.2f}x{spread}"

    def wall(s: dict) -> str:  # a run resumed from a checkpoint timed only its last process
        if s["wall_s"] is not None:
            return f"{s['wall_s'] / 60:.1f} min"
        return "-" if s["wall_s_partial"] is None else f"{s['wall_s_partial'] / 60:.1f} min (resumed: its last process)"

    lines = [("status", lambda s: s["status"]),
             ("wall time", wall),
             ("reward (sampled, train)", lambda s: f"{_fmt(s['reward_start'])} -> {_fmt(s['reward_end'])}"
                                                  f" (se of change {_fmt(s['reward_change_se'])})"),
             ("dense validation", lambda s: _start_end(s["val_dense"])),
             ("sparse validation", lambda s: _start_end(s["val_sparse"])),
             ("p5 hold fraction", lambda s: f"{_fmt(s['p5_hold_fraction'])} of {s['p5_hold_cells']} cells"),
             ("dips after fall/held/rise", lambda s: "/".join(str(s["p5_dips"][m]) for m in ("fell", "held", "rose"))
              if s.get("p5_dips") else "-"),
             ("sparse token fraction", lambda s: _fmt(s["sparse_token_fraction"])),
             ("rollout speedup (paired)", speedup),
             ("gen tokens / rollout s", lambda s: _fmt(s["gen_tokens_per_s"], ".0f")),
             ("predicted cost vs dense", lambda s: _fmt(s["predicted_cost_end"]))]
    bins = sorted({b["bin_start"] for s in columns.values() for b in s["p5_by_bin"]})
    for b in bins:
        def cell(s, b=b):
            pooled = next((x for x in s["p5_by_bin"] if x["bin_start"] == b), None)
            worst = next((x for x in s["p5_min_step_by_bin"] if x["bin_start"] == b), None)
            if pooled is None:
                return "-"
            return f"{_fmt(pooled['p5'])} (worst step {_fmt(worst and worst['p5'])}, {pooled['count']} tok)"
        lines.append((f"p5 bin {b}", cell))
    phases = sorted({p for s in columns.values() for p in s["timing_s"]})
    lines += [(f"s/step {p}", lambda s, p=p: _fmt(s["timing_s"].get(p), ".2f")) for p in phases]
    cells = [[name] + [fn(s) for s in columns.values()] for name, fn in lines]
    header = [""] + list(columns)
    widths = [max(len(r[i]) for r in cells + [header]) for i in range(len(header))]
    render = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([render(header)] + [render(r) for r in cells])


def redraw(workdir: str, columns: dict[str, dict], study: bool) -> str:
    """The reward curve (a run's ``reward.png``) or the study's ``study.png``, from the logs."""
    if study:
        from sparrow_jax.run.study_plots import plot_study

        path = os.path.join(workdir, "study.png")
        plot_study({a: s["rows"] for a, s in columns.items() if s["rows"]}, path)
        return path
    path = os.path.join(workdir, "reward.png")
    (s,) = columns.values()
    plot_curves({"reward_mean": ([r["step"] for r in s["rows"]], [r["reward_mean"] for r in s["rows"]])},
                path, ylabel="reward", title="reward over training")
    return path


def summarize(workdir: str) -> tuple[str, Optional[str]]:
    """(the table, the redrawn plot's path or None when nothing is logged yet)."""
    config = _read_json(os.path.join(workdir, "config.json"))
    if config is None:
        raise FileNotFoundError(f"{workdir}: no config.json (not a run's or a study's workdir)")
    study = config.get("study") is not None
    if study:
        seeds = config["study"].get("seeds") or [None]  # several seeds: a column per (arm, seed)
        runs = [a if len(seeds) == 1 else f"{a}/seed_{s}" for a in config["study"]["arms"] for s in seeds]
        runs = [r for r in runs if os.path.exists(os.path.join(workdir, r, "metrics.jsonl"))]
        columns = {r: summarize_run(os.path.join(workdir, r), config) for r in runs}
    else:
        columns = {os.path.basename(os.path.normpath(workdir)): summarize_run(workdir, config)}
    if not columns or not any(s["rows"] for s in columns.values()):
        return (f"{workdir}: no training step logged yet", None)
    return table(columns) + final_evaluation(workdir), redraw(workdir, columns, study)


def final_evaluation(workdir: str) -> str:
    """A study's paired final evaluation (``final_eval.json``, the policies evaluated so far) as lines
    after the table; empty without one."""
    data = _read_json(os.path.join(workdir, FINAL_EVAL_FILE))
    if not data or not data.get("runs"):
        return ""
    return "\n" + "\n".join(format_final_eval(paired_figures(data)))


def merged_final_evaluation(workdirs: list[str]) -> str:
    """The final evaluations of ``workdirs`` (those that have one) merged into one paired evaluation;
    empty when fewer than two have one."""
    records = {w: r for w in workdirs if (r := _read_json(os.path.join(w, FINAL_EVAL_FILE))) and r.get("runs")}
    if len(records) < 2:
        return ""
    figures = paired_figures(merge_records(records))
    return "\n".join([f"[final eval] merged over {', '.join(records)}:"] + format_final_eval(figures))


def main(argv: list[str]) -> None:
    workdirs = argv[1:]
    if not workdirs:
        print(f"error: {USAGE}", file=sys.stderr)
        sys.exit(2)
    try:
        for workdir in workdirs:
            text, plot = summarize(workdir)
            print(text if len(workdirs) == 1 else f"== {workdir}\n{text}")
            if plot:
                print(f"plot: {plot}")
        merged = merged_final_evaluation(workdirs) if len(workdirs) > 1 else ""
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if merged:
        print(merged)


if __name__ == "__main__":
    app.run(main)
