"""Per-decode-step attention time: dense vs block-sparse (CPU, one layer).

Run: ``python -m experiments.bench_attention [--contexts 4096 16384 32768] [--repeats 40]``

Shapes follow the paper's decode setting: batch 8, 8 query heads, 2 KV heads, head_dim 64,
page 16, KV budget 1024 tokens = (61 top-k + 1 first + 2 last pages) x 16. Every row
decodes at the last position of a full ``L``-token cache.

* dense: ``dense_decode`` over all ``L`` tokens.
* sparse: ``group_mean_query`` + ``score_pages`` + ``select_pages`` + ``sparse_decode_xla``,
  jitted together as one decode step runs them.
* sparse_fast: the same step with ``sparse_decode_xla_fast`` (extra columns).

Each step is jitted and warmed up; dense and sparse calls are interleaved (so load from
other processes hits both alike) and the median of ``--repeats`` calls is reported. By
default a 96 MiB buffer is streamed before every timed call so the KV cache is not
L3-resident (a real decode step touches every layer's cache in turn); ``--warm`` skips it.
``ideal_speedup`` = dense KV bytes / (selected KV bytes + centroid bytes read for scoring).
The last stdout line is ``{"results": [...]}``, also written to runs/bench/bench_attention.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable, Dict, List

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention import (dense_decode, group_mean_query, page_metadata, score_pages,
                                   select_pages, sparse_decode_xla)
from sparrow_jax.attention.fast_xla import sparse_decode_xla_fast

BATCH, HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 8, 2, 64, 16
BUDGET_TOKENS, RESERVED_FIRST, RESERVED_LAST = 1024, 1, 2
K_MAX = BUDGET_TOKENS // PAGE - RESERVED_FIRST - RESERVED_LAST  # 61 top-k pages
OUT_PATH = os.path.join("runs", "bench", "bench_attention.json")


def make_sparse_step(attend: Callable) -> Callable:
    """Score pages, select the top-k, attend over them: one jitted decode step."""

    def step(q, k_pages, v_pages, centroid, positions):
        scores = score_pages(group_mean_query(q, KV_HEADS), centroid)
        page_idx, page_valid = select_pages(scores, positions[:, None], K_MAX, K_MAX, PAGE,
                                            RESERVED_FIRST, RESERVED_LAST)
        return attend(q, k_pages, v_pages, page_idx, page_valid, positions), page_valid

    return jax.jit(step)


FLUSH_BYTES = 96 << 20  # > 2x this machine's 32 MiB L3


@jax.jit
def _touch(x):
    return jnp.sum(x)  # read-only: evicts the cache without allocating a new large buffer


def time_interleaved(fns: Dict[str, Callable], args: tuple, repeats: int,
                     cold: bool = True) -> Dict[str, List[float]]:
    """Warm up every fn, then time them round-robin; returns seconds per call per fn.

    cold: stream a buffer larger than the last-level cache before every timed call (not
    timed), as in a real decode step where each layer's cache was evicted by the others.
    """
    flush = jnp.zeros((FLUSH_BYTES // 4,), jnp.float32)
    for fn in fns.values():
        for _ in range(2):
            jax.block_until_ready(fn(*args))
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if cold:
                jax.block_until_ready(_touch(flush))
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return times


def bench_context(length: int, repeats: int, cold: bool = True, seed: int = 0) -> dict:
    if length % PAGE:
        raise ValueError(f"context length {length} must be a multiple of the page size {PAGE}")
    pages = length // PAGE
    keys = jax.random.split(jax.random.PRNGKey(seed + length), 3)
    shape = (BATCH, KV_HEADS, pages, PAGE, HEAD_DIM)
    k_pages = jax.random.normal(keys[0], shape, jnp.float32)
    v_pages = jax.random.normal(keys[1], shape, jnp.float32)
    q = jax.random.normal(keys[2], (BATCH, HEADS, HEAD_DIM), jnp.float32)
    positions = jnp.full((BATCH,), length - 1, jnp.int32)
    centroid, _, _ = page_metadata(k_pages, positions + 1, with_minmax=False)
    args = (q, k_pages, v_pages, centroid, positions)

    dense = jax.jit(lambda q, k, v, c, pos: dense_decode(q, k, v, pos))
    sparse = make_sparse_step(sparse_decode_xla)
    sparse_fast = make_sparse_step(sparse_decode_xla_fast)
    # Sanity: both sparse forms agree (same selection, same math).
    out_ref, valid = sparse(*args)
    out_fast, _ = sparse_fast(*args)
    max_diff = float(jnp.max(jnp.abs(out_ref - out_fast)))
    if not max_diff < 1e-4:
        raise RuntimeError(f"sparse_decode_xla_fast disagrees with sparse_decode_xla by {max_diff}")

    times = time_interleaved({"dense": dense, "sparse": sparse, "sparse_fast": sparse_fast}, args, repeats, cold)
    med = {name: float(np.median(t)) * 1e3 for name, t in times.items()}

    item = jnp.dtype(jnp.float32).itemsize
    dense_bytes = 2 * BATCH * KV_HEADS * length * HEAD_DIM * item
    selected_pages = int(jnp.sum(valid))  # over rows and KV heads
    selected_bytes = 2 * selected_pages * PAGE * HEAD_DIM * item
    centroid_bytes = centroid.size * centroid.dtype.itemsize
    ideal = dense_bytes / (selected_bytes + centroid_bytes)
    return {"context": length, "dense_ms": round(med["dense"], 3), "sparse_ms": round(med["sparse"], 3),
            "speedup": round(med["dense"] / med["sparse"], 3), "ideal_speedup": round(ideal, 3),
            "sparse_fast_ms": round(med["sparse_fast"], 3),
            "speedup_fast": round(med["dense"] / med["sparse_fast"], 3),
            "dense_min_ms": round(min(times["dense"]) * 1e3, 3),
            "sparse_min_ms": round(min(times["sparse"]) * 1e3, 3),
            "sparse_fast_min_ms": round(min(times["sparse_fast"]) * 1e3, 3),
            "repeats": repeats, "cache": "cold" if cold else "warm"}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--warm", action="store_true",
                        help="do not flush the CPU caches between timed calls")
    parser.add_argument("--out", default=OUT_PATH)
    args = parser.parse_args(argv)
    results = []
    for length in args.contexts:
        row = bench_context(length, args.repeats, cold=not args.warm)
        results.append(row)
        print(f"L={length:6d}  dense {row['dense_ms']:8.3f} ms  sparse {row['sparse_ms']:7.3f} ms "
              f"(x{row['speedup']:.2f})  sparse_fast {row['sparse_fast_ms']:7.3f} ms (x{row['speedup_fast']:.2f})"
              f"  ideal x{row['ideal_speedup']:.2f}", flush=True)
    summary = {"results": results, "backend": jax.default_backend(), "devices": jax.device_count(),
               "shape": {"batch": BATCH, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                         "page": PAGE, "budget_tokens": BUDGET_TOKENS, "k_max": K_MAX}}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(summary, f)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
