"""A run's sparse-rollout speedup and its ceiling, on its own model and prompts.

    python -m experiments.bench_speedup_ceiling --config configs/quickstart.py [--repeats 7 --initial]

Three sides decode the same rows (``--num_prompts`` held-out prompts x ``--samples``) with the
same params and key, alternating ``--repeats`` times after one untimed run each:

* ``dense``: dense attention;
* ``sparse``: the run's schedule (``schedule.kind``; calibrated reads ``<workdir>/schedule.json``);
* ``floor``: the same schedule at top-k 0, i.e. only its reserved pages. No schedule with this
  layout and selector attends fewer pages, so dense / floor is the most any schedule can gain
  on this machine with this model: the ceiling.

Stop tokens are ignored, so every side decodes ``rollout.max_new_tokens`` tokens per row at the
same positions: the sides differ only in what attention costs, not in how long their samples
happen to be (the timing loop is the run's report's, :mod:`sparrow_jax.run.speed`). Params: the
policy of the newest checkpoint under ``<workdir>/checkpoints``, else (or with ``--initial``) the
run's initial model.

The last stdout line is JSON: per side the best and median decode tokens/s and the mean pages a
token attends, ``rollout_speedup`` / ``speedup_ceiling`` (the median of paired ratios, as in the
run's report) with the paired spread, and ``captured``: the share of the ceiling's gain the
schedule gets, (speedup - 1) / (ceiling - 1).
"""
from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
from absl import flags

from sparrow_jax.run.cli import config_main, define_config_flag


def attended_pages(schedule, prompt_lens: np.ndarray, new_tokens: int, dense: bool = False) -> float:
    """Mean pages (of ``schedule.page_size`` tokens) a generated token attends per sparse layer under
    ``schedule``, or every visible page when ``dense``: the query at position ``t - 1`` sees
    ``ceil(t / page_size)`` pages and keeps ``topk + reserved`` of them."""
    t = np.concatenate([np.arange(p, p + new_tokens) for p in np.asarray(prompt_lens)])
    visible = -(-t // schedule.page_size)
    if dense:
        return float(visible.mean())
    return float(np.minimum(visible, schedule.topk_at(t - 1) + schedule.reserved).mean())


def ceiling_summary(tok_s: dict[str, list[float]], pages: dict[str, float]) -> dict:
    """``rollout_speedup`` (sparse vs dense) and ``speedup_ceiling`` (floor vs dense), each the median
    of paired ratios with their spread (:func:`speedup_summary`), and the share of the ceiling captured."""
    from sparrow_jax.run.speed import speedup_summary

    sparse = speedup_summary(tok_s["dense"], tok_s["sparse"])
    floor = speedup_summary(tok_s["dense"], tok_s["floor"])
    gain = floor["rollout_speedup"] - 1.0
    return {
        "sides": {name: {"best_tok_s": max(v), "median_tok_s": float(np.median(v)), "pages": pages[name]}
                  for name, v in tok_s.items()},
        "rollout_speedup": sparse["rollout_speedup"], "rollout_speedup_paired": sparse["rollout_speedup_paired"],
        "speedup_ceiling": floor["rollout_speedup"], "speedup_ceiling_paired": floor["rollout_speedup_paired"],
        "captured": (sparse["rollout_speedup"] - 1.0) / gain if gain > 0 else None,
    }


def measure_ceiling(spec, repeats: int = 7, num_prompts: int = 8, samples: int = 2, initial: bool = False) -> dict:
    """Time dense, the run's schedule and its top-k-0 floor on the run's held-out prompts (module
    docstring); returns the summary printed as JSON."""
    from sparrow_jax.io.checkpoint import run_policy_params
    from sparrow_jax.run.context import build_run_context, build_schedule
    from sparrow_jax.run.specs import ConfigError
    from sparrow_jax.run.speed import time_sides

    schedule = build_schedule(spec.schedule, spec.workdir)
    if schedule is None:
        raise ConfigError(f"schedule.kind={spec.schedule.kind!r}: dense rollouts have no sparse side to time")
    ctx = build_run_context(spec, schedule)
    stored = None if initial else run_policy_params(spec.workdir, ctx.params)
    params = None if stored is None else stored[0]
    source = "initial" if params is None else "checkpoint"
    params = ctx.params if params is None else params
    prompts = [ctx.encode(e) for e in ctx.eval_rows[:num_prompts] for _ in range(samples)]
    sides = {"dense": None, "sparse": schedule, "floor": dataclasses.replace(schedule, topk=(0,), name="floor")}
    tok_s, _ = time_sides(ctx, params, prompts, sides, repeats, jax.random.PRNGKey(spec.seed + 1))
    prompt_lens = np.asarray([len(p) for p in prompts])
    new_tokens = ctx.sampling.max_new_tokens
    pages = {name: attended_pages(s or schedule, prompt_lens, new_tokens, dense=s is None)
             for name, s in sides.items()}
    return {**ceiling_summary(tok_s, pages),
            "setup": dict(workdir=spec.workdir, params=source, rows=len(prompts), new_tokens=new_tokens,
                          repeats=repeats, schedule=schedule.name, backend=jax.default_backend())}


def report(summary: dict) -> None:
    for name, side in summary["sides"].items():
        print(f"{name:>6}: best {side['best_tok_s']:8.0f} tok/s, median {side['median_tok_s']:8.0f}, "
              f"{side['pages']:.1f} pages per token per sparse layer")
    print(f"speedup {summary['rollout_speedup']:.2f}x of a ceiling {summary['speedup_ceiling']:.2f}x (top-k 0)")
    print(json.dumps(summary))


def _cli() -> None:
    # flags defined at the start, not at import (define_config_flag says why)
    config = define_config_flag()
    repeats = flags.DEFINE_integer("repeats", 7, "timed runs per side (alternating)")
    num_prompts = flags.DEFINE_integer("num_prompts", 8, "held-out prompts")
    samples = flags.DEFINE_integer("samples", 2, "rows per prompt")
    initial = flags.DEFINE_bool("initial", False, "time the run's initial model even if a checkpoint exists")
    config_main(config, lambda spec: report(measure_ceiling(spec, repeats.value, num_prompts.value, samples.value,
                                                            initial.value)))


if __name__ == "__main__":
    _cli()
