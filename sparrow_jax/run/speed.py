"""Like-for-like speed: the one warm-up + alternating-repeat timing loop (:func:`alternate`), the
rollout sides built on it and the paired-ratio summary, shared by the run's report, the study's
arms (:func:`measure_rollout_speedup`: a trained run's final schedule against dense rollouts) and
the ``experiments/bench_*`` benchmarks. Imports the rollout engines and the run context's type.

Rollout sides (:func:`time_sides`): every side decodes the same rows (prompts x samples) with
the same params and key, stop tokens ignored, so each decodes ``max_new_tokens`` tokens per row
at the same positions: the sides differ only in what attention costs. Sides alternate within
each repeat so that other load on the machine hits them alike; the speedup is the median of the
repeats' paired ratios.
"""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import jax
import numpy as np

from sparrow_jax.rl.context import RunContext
from sparrow_jax.run.allocator import keep_freed_memory
from sparrow_jax.rollout import SparsitySchedule, generate, generate_continuous

if TYPE_CHECKING:  # annotations only: the benchmarks import this module without the trainer
    from sparrow_jax.rl.trainer import TrainResult

T = TypeVar("T")


def alternate(runs: dict[str, Callable[[], T]], repeats: int, warmup: int = 1) -> dict[str, list[T]]:
    """Call every run ``warmup`` times untimed (compiles every shape the timed calls use), then
    ``repeats`` rounds calling each run once in turn, so that other load on the machine hits
    every side alike. Returns ``{name: [what the run returned, one per round]}``. Freed host memory
    stays in the process (:func:`keep_freed_memory`), so no side pays for the pages the side before
    it gave back."""
    keep_freed_memory()
    for run in runs.values():
        for _ in range(warmup):
            run()
    out: dict[str, list[T]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            out[name].append(run())
    return out


def seconds(fn: Callable[[], Any]) -> float:
    """Wall seconds of ``fn()`` until its outputs are ready (JAX dispatches asynchronously)."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def time_sides(ctx: RunContext, params, prompts: list[list[int]], sides: dict[str, Optional[SparsitySchedule]],
               repeats: int, key) -> tuple[dict[str, list[float]], int]:
    """Decode tokens/s of each side's rollout of ``prompts`` (token ids), ``repeats`` alternating runs
    after an untimed one per side, which compiles every shape the timed runs use (same key, same
    lengths). Returns (``{side: [tok/s per repeat]}``, compilations seen in the timed runs)."""
    sampling = dataclasses.replace(ctx.sampling, stop_ids=())  # every row decodes max_new_tokens
    engine = generate_continuous if ctx.engine == "continuous" else generate

    def run(schedule):
        out = engine(ctx.model_config, params, prompts, key, sampling, schedule=schedule, impl=ctx.impl,
                     pad_id=ctx.tokenizer.pad_id)
        return out.stats["decode_tokens"] / max(out.stats["decode_s"], 1e-9), int(out.stats.get("compiles", 0))

    timed = alternate({name: (lambda s=schedule: run(s)) for name, schedule in sides.items()}, repeats)
    tok_s = {name: [speed for speed, _ in runs] for name, runs in timed.items()}
    return tok_s, sum(n for runs in timed.values() for _, n in runs)


def speedup_summary(dense_tok_s: list[float], sparse_tok_s: list[float]) -> dict:
    """Rollout speedup from alternating repeats (``dense_tok_s[i]`` timed beside ``sparse_tok_s[i]``).

    ``rollout_speedup``: the median over repeats of sparse / dense tokens/s of the same repeat;
    ``rollout_speedup_paired``: min / median / max of those ratios (how far the figure moves with
    the machine's noise); ``dense_tok_s`` / ``sparse_tok_s``: each side's median tokens/s.
    """
    if not dense_tok_s or len(dense_tok_s) != len(sparse_tok_s):
        raise ValueError(f"need as many sparse as dense repeats (>= 1), got {len(dense_tok_s)} dense and "
                         f"{len(sparse_tok_s)} sparse")
    paired = np.asarray(sparse_tok_s, np.float64) / np.asarray(dense_tok_s, np.float64)
    median = float(np.median(paired))
    return {"rollout_speedup": median, "dense_tok_s": float(np.median(dense_tok_s)),
            "sparse_tok_s": float(np.median(sparse_tok_s)),
            "rollout_speedup_paired": {"min": float(paired.min()), "median": median, "max": float(paired.max()),
                                       "repeats": int(paired.size)}}


def measure_rollout_speedup(ctx: RunContext, result: TrainResult, num_prompts: int = 8, samples: int = 2,
                            repeats: int = 7) -> dict:
    """Dense vs sparse rollout speed of the final policy on the same held-out rows (``num_prompts``
    x ``samples``) at the same positions (stop tokens ignored), sides alternated
    (:func:`time_sides`): the median of the paired ratios with their spread and each side's median
    tokens/s (:func:`speedup_summary`); ``{"rollout_speedup": 1.0}`` for a run without a schedule.
    ``speedup_timed_compiles``: compilations inside the timed runs (0: none was timed)."""
    if result.schedule is None:
        return {"rollout_speedup": 1.0}
    prompts = [ctx.encode(e) for e in ctx.eval_rows[:num_prompts] for _ in range(samples)]
    sides = {"dense": None, "sparse": result.schedule}
    tok_s, compiles = time_sides(ctx, result.state.train.params, prompts, sides, repeats, jax.random.PRNGKey(1))
    return {**speedup_summary(tok_s["dense"], tok_s["sparse"]), "speedup_timed_compiles": compiles}
