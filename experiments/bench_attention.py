"""Per-decode-step attention time: dense vs block-sparse (one layer; CPU, GPU or TPU).

Run: ``python -m experiments.bench_attention [--contexts 4096 16384 32768] [--mode loop|call]``

Shapes follow the paper's decode setting: batch 8, 8 query heads, 2 KV heads, head_dim 64,
page 16, KV budget 1024 tokens = (61 top-k + 1 first + 2 last pages) x 16. Every row
decodes at the last position of a full ``L``-token cache.

* dense: the best dense decode for ``--impl`` (``dense_decode_dispatch``: on CPU the C++
  kernel's loop over every page, the like-for-like baseline of the sparse kernel).
* dense_xla: the XLA ``dense_decode`` (an extra column: what dense cost before).
* sparse: what a sparse decode step runs per layer: ``group_mean_query`` +
  ``score_select_decode`` (page scores and top-k; on CPU one C++ pass) +
  ``sparse_decode(impl=--impl)`` (``auto``: on CPU the C++ kernel, on GPU the Pallas kernel).
* sparse_xla_ref: the same step with the plain gather formulation ``sparse_decode_xla``.

Timing modes (dense and sparse always measured the same way, interleaved, so load from
other processes hits both alike; the median over ``--repeats`` is reported):

* ``loop`` (default): as in the sampler, the step runs inside one jitted loop over
  ``--layers`` distinct caches (one per "layer", each far larger than the L3 cache, so
  every step reads its cache cold) for ``--steps`` rounds; time per layer-step. Temporary
  buffers are allocated once per call, as in the sampler's ``while_loop``.
* ``call``: one jitted call per step on one cache, a 96 MiB buffer streamed before every
  timed call to evict the caches. Each call also allocates (page-faults) its temporaries,
  which the decode loop does not.

``ideal_speedup`` = dense KV bytes / (selected KV bytes + centroid bytes read for scoring);
``speedup`` and ``fraction_of_ideal`` are against the best dense, so a ratio above 1 of
ideal would mean a better kernel, not fewer bytes.
The last stdout line is ``{"results": [...]}``, also written to runs/bench/bench_attention.json.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from sparrow_jax.attention import (IMPLEMENTATIONS, dense_decode, dense_decode_dispatch, group_mean_query,
                                   page_metadata, resolve_impl, score_select_decode, sparse_decode,
                                   sparse_decode_xla)
from sparrow_jax.run.cli import parse_flags
from sparrow_jax.run.speed import alternate, seconds

BATCH, HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 8, 2, 64, 16
BUDGET_TOKENS, RESERVED_FIRST, RESERVED_LAST = 1024, 1, 2
K_MAX = BUDGET_TOKENS // PAGE - RESERVED_FIRST - RESERVED_LAST  # 61 top-k pages
OUT_PATH = os.path.join("runs", "bench", "bench_attention.json")


def sparse_step(attend: Callable, impl: str = "xla") -> Callable:
    """Score pages, select the top-k, attend over them: one layer of a sparse decode step, as
    :func:`sparrow_jax.models.forward.decode_step` runs it with ``impl``.

    (q, k_pages, v_pages, centroid, positions) -> (out [B, H, D], page_valid [B, Hkv, N]).
    """

    def step(q, k_pages, v_pages, centroid, positions):
        page_idx, page_valid = score_select_decode(group_mean_query(q, KV_HEADS), centroid, None, None, positions,
                                                   K_MAX, K_MAX, PAGE, RESERVED_FIRST, RESERVED_LAST, impl=impl)
        return attend(q, k_pages, v_pages, page_idx, page_valid, positions), page_valid

    return step


def dense_step(attend: Callable) -> Callable:
    return lambda q, k_pages, v_pages, centroid, positions: (attend(q, k_pages, v_pages, positions), None)


def make_steps(impl: str) -> Dict[str, Callable]:
    """The timed steps: best dense for ``impl``, XLA dense, sparse with ``impl``, sparse with the plain XLA gather."""
    return {"dense": dense_step(lambda *a: dense_decode_dispatch(*a, impl=impl)),
            "dense_xla": dense_step(dense_decode),
            "sparse": sparse_step(lambda *a: sparse_decode(*a, impl=impl), impl),
            "sparse_xla_ref": sparse_step(sparse_decode_xla)}

FLUSH_BYTES = 96 << 20  # > 2x this machine's 32 MiB L3


@jax.jit
def _touch(x):
    return jnp.sum(x)  # read-only: evicts the cache without allocating a new large buffer


def looped(step: Callable, num_steps: int) -> Callable:
    """jit: ``num_steps`` rounds of ``step`` over every layer's cache; q carries a dependency."""

    def run(q, layers, positions):
        def body(_, q):
            for k_pages, v_pages, centroid in layers:
                out, _ = step(q, k_pages, v_pages, centroid, positions)
                q = q + 1e-6 * out  # the next layer's query depends on this one's output
            return q

        return jax.lax.fori_loop(0, num_steps, body, q)

    return jax.jit(run)


def time_interleaved(fns: Dict[str, Callable], args: tuple, repeats: int, flush: bool,
                     per_call: int = 1) -> Dict[str, List[float]]:
    """Two untimed calls of every fn, then ``repeats`` alternating rounds (:func:`alternate`);
    seconds per call / ``per_call`` per fn.

    flush: stream a buffer larger than the last-level cache before every call (not timed).
    """
    buf = jnp.zeros((FLUSH_BYTES // 4,), jnp.float32) if flush else None

    def timed(fn: Callable) -> Callable[[], float]:
        def run() -> float:
            if flush:
                jax.block_until_ready(_touch(buf))
            return seconds(lambda: fn(*args)) / per_call
        return run

    return alternate({name: timed(fn) for name, fn in fns.items()}, repeats, warmup=2)


def make_layer(length: int, seed: int, batch: int = BATCH):
    """Random K/V pages of a full ``length``-token cache and their centroids."""
    shape = (batch, KV_HEADS, length // PAGE, PAGE, HEAD_DIM)
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    k_pages = jax.random.normal(keys[0], shape, jnp.float32)
    v_pages = jax.random.normal(keys[1], shape, jnp.float32)
    centroid, _, _ = page_metadata(k_pages, jnp.full((batch,), length, jnp.int32), with_minmax=False)
    return k_pages, v_pages, centroid


def bench_context(length: int, repeats: int, mode: str = "loop", layers: int = 4, steps: int = 4,
                  seed: int = 0, impl: str = "auto", batch: int = BATCH) -> dict:
    if length % PAGE:
        raise ValueError(f"context length {length} must be a multiple of the page size {PAGE}")
    if mode not in ("loop", "call"):
        raise ValueError(f"mode must be 'loop' or 'call', got {mode!r}")
    q = jax.random.normal(jax.random.PRNGKey(seed + 1), (batch, HEADS, HEAD_DIM), jnp.float32)
    positions = jnp.full((batch,), length - 1, jnp.int32)
    caches = [make_layer(length, seed + length + i, batch) for i in range(layers if mode == "loop" else 1)]
    k_pages, v_pages, centroid = caches[0]

    steps_by_name = make_steps(impl)
    # Sanity: the timed path and the plain gather agree (same selection, same math). Relative
    # norm, loose enough for TF32 matmuls that XLA may use on GPU.
    args1 = (q, k_pages, v_pages, centroid, positions)
    out_fast, valid = jax.jit(steps_by_name["sparse"])(*args1)
    out_ref, _ = jax.jit(steps_by_name["sparse_xla_ref"])(*args1)
    rel_diff = float(jnp.linalg.norm(out_ref - out_fast) / jnp.linalg.norm(out_ref))
    if not rel_diff < 1e-3:
        raise RuntimeError(f"sparse impl {impl!r} disagrees with sparse_decode_xla by {rel_diff:.2e} (relative)")
    dense_best, _ = jax.jit(steps_by_name["dense"])(*args1)
    dense_ref, _ = jax.jit(steps_by_name["dense_xla"])(*args1)
    rel_diff = float(jnp.linalg.norm(dense_ref - dense_best) / jnp.linalg.norm(dense_ref))
    if not rel_diff < 1e-3:
        raise RuntimeError(f"best dense for {impl!r} disagrees with dense_decode by {rel_diff:.2e} (relative)")

    if mode == "loop":
        fns = {name: looped(step, steps) for name, step in steps_by_name.items()}
        times = time_interleaved(fns, (q, caches, positions), repeats, flush=False, per_call=layers * steps)
    else:
        fns = {name: jax.jit(step) for name, step in steps_by_name.items()}
        times = time_interleaved(fns, args1, repeats, flush=True)
    med = {name: float(np.median(t)) * 1e3 for name, t in times.items()}

    item = jnp.dtype(jnp.float32).itemsize
    dense_bytes = 2 * batch * KV_HEADS * length * HEAD_DIM * item
    selected_pages = int(jnp.sum(valid))  # over rows and KV heads
    selected_bytes = 2 * selected_pages * PAGE * HEAD_DIM * item
    centroid_bytes = centroid.size * centroid.dtype.itemsize
    ideal = dense_bytes / (selected_bytes + centroid_bytes)
    speedup = med["dense"] / med["sparse"]
    return {"context": length, "dense_ms": round(med["dense"], 3), "sparse_ms": round(med["sparse"], 3),
            "speedup": round(speedup, 3), "ideal_speedup": round(ideal, 3),
            "fraction_of_ideal": round(speedup / ideal, 3),
            "dense_xla_ms": round(med["dense_xla"], 3),
            "best_dense_over_xla_dense": round(med["dense_xla"] / med["dense"], 3),
            "speedup_vs_xla_dense": round(med["dense_xla"] / med["sparse"], 3),
            "sparse_xla_ref_ms": round(med["sparse_xla_ref"], 3),
            "speedup_xla_ref": round(med["dense"] / med["sparse_xla_ref"], 3),
            "dense_min_ms": round(min(times["dense"]) * 1e3, 3),
            "sparse_min_ms": round(min(times["sparse"]) * 1e3, 3),
            "impl": resolve_impl(impl), "dense_impl": "cpu" if resolve_impl(impl) == "cpu" else "xla", "repeats": repeats, "mode": mode, **({"layers": layers, "steps": steps} if mode == "loop" else {})}


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_multi_integer("contexts", [4096, 16384, 32768], "cache lengths (one or more)", flag_values=fv)
    flags.DEFINE_integer("repeats", 30, "timed calls per step (alternating)", lower_bound=1, flag_values=fv)
    flags.DEFINE_enum("mode", "loop", ["loop", "call"], "timing mode (module docstring)", flag_values=fv)
    flags.DEFINE_integer("layers", 4, "loop mode: distinct caches per round", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("steps", 4, "loop mode: rounds per timed call", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("batch", BATCH, "rows (GPUs need many to be memory-bound)", lower_bound=1, flag_values=fv)
    flags.DEFINE_enum("impl", "auto", IMPLEMENTATIONS, "sparse attention implementation "
                      "(auto: Pallas on GPU/TPU; on CPU the C++ kernel, XLA without a compiler)", flag_values=fv)
    flags.DEFINE_string("out", OUT_PATH, "where to write the JSON summary", flag_values=fv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args, _ = parse_flags(define_flags, argv, __doc__)
    load_start = os.getloadavg()[0]
    results = []
    for length in args.contexts:
        row = bench_context(length, args.repeats, args.mode, args.layers, args.steps, impl=args.impl,
                            batch=args.batch)
        results.append(row)
        print(f"L={length:6d}  dense {row['dense_ms']:8.3f} ms  sparse {row['sparse_ms']:7.3f} ms "
              f"(x{row['speedup']:.2f}, {row['fraction_of_ideal']:.2f} of ideal x{row['ideal_speedup']:.2f})"
              f"  dense_xla {row['dense_xla_ms']:8.3f} ms (best dense x{row['best_dense_over_xla_dense']:.2f} faster)"
              f"  sparse_xla_ref {row['sparse_xla_ref_ms']:7.3f} ms (x{row['speedup_xla_ref']:.2f})", flush=True)
    summary = {"results": results, "backend": jax.default_backend(), "devices": jax.device_count(),
               "load_avg_1min": {"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
               "shape": {"batch": args.batch, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                         "page": PAGE, "budget_tokens": BUDGET_TOKENS, "k_max": K_MAX}}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
