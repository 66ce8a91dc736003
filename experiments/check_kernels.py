"""Check block-sparse decode implementations against a float64 reference on this backend.

Run on the accelerator: ``python -m experiments.check_kernels [--impls pallas_gpu xla]``.
On CPU the Pallas kernels run in the interpreter (slow: use ``--small``).

Each case draws fresh random q / K / V (normal, never zeros), builds the page selection the
sampler would (centroid metadata -> scores -> block top-k with reserved pages), with
ragged row positions and a different budget per row, and compares the implementation with
float64 numpy attention over exactly the selected tokens by ``|out - ref| / |ref|``
(Frobenius). A second comparison with every page selected checks the result equals dense
attention. Tolerances follow the operand precision: f32 1e-5, bf16 2e-2 (bf16 K/V and
probabilities, f32 accumulation). The last stdout line is JSON with every case.
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from sparrow_jax.attention import group_mean_query, page_metadata, score_pages, select_pages, sparse_decode
from sparrow_jax.attention.decode import resolve_impl
from sparrow_jax.run.cli import parse_flags
from sparrow_jax.run.speed import seconds

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}
# (batch, query heads, KV heads, head_dim, context tokens): the benchmark's shape and a
# Qwen3-8B-like attention layer (32 query heads, 8 KV heads, head_dim 128).
SHAPES = {"bench": (8, 8, 2, 64, 16384), "qwen3_8b": (4, 32, 8, 128, 8192)}
SMALL_SHAPES = {"small": (3, 8, 2, 16, 256)}


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, token_mask: np.ndarray,
                        scale: float) -> np.ndarray:
    """float64 softmax attention over the masked tokens.

    q [B, H, D]; k, v [B, Hkv, T, D]; token_mask [B, Hkv, T] bool. Returns [B, H, D] float64.
    """
    b, h, d = q.shape
    hkv = k.shape[1]
    qg = q.astype(np.float64).reshape(b, hkv, h // hkv, d)
    s = np.einsum("bhgd,bhtd->bhgt", qg, k.astype(np.float64)) * scale
    s = np.where(token_mask[:, :, None], s, -np.inf)
    s -= s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhgt,bhtd->bhgd", p, v.astype(np.float64)).reshape(b, h, d)


def selected_token_mask(page_idx: np.ndarray, page_valid: np.ndarray, positions: np.ndarray,
                        num_pages: int, page_size: int) -> np.ndarray:
    """[B, Hkv, N] selection + [B] positions -> [B, Hkv, P * S] bool: selected and causal."""
    b, hkv, _ = page_idx.shape
    pages = np.zeros((b, hkv, num_pages), bool)
    bi, hi, ni = np.nonzero(page_valid)
    pages[bi, hi, page_idx[bi, hi, ni]] = True
    causal = np.arange(num_pages * page_size)[None] <= positions[:, None]
    return np.repeat(pages, page_size, axis=-1) & causal[:, None]


def make_case(batch: int, heads: int, kv_heads: int, head_dim: int, context: int, dtype, seed: int,
              page_size: int = 16, reserved=(1, 2)):
    """Random inputs and a realistic per-row selection. Returns a dict of device arrays.

    The KV budget is the benchmark's 1024 tokens, capped at half the context so small
    cases stay sparse.
    """
    budget_tokens = min(1024, context // 2)
    rng = np.random.default_rng(seed)
    num_pages = context // page_size
    q = rng.standard_normal((batch, heads, head_dim), np.float32)
    k = rng.standard_normal((batch, kv_heads, num_pages, page_size, head_dim), np.float32)
    v = rng.standard_normal((batch, kv_heads, num_pages, page_size, head_dim), np.float32)
    # Ragged rows: the last position, mid-page positions, a short row.
    positions = np.sort(rng.integers(page_size, context, batch))[::-1].astype(np.int32)
    positions[0] = context - 1
    k_max = max(1, budget_tokens // page_size - sum(reserved))
    budget = rng.integers(k_max // 2, k_max + 1, batch).astype(np.int32)  # per-row budgets
    k_dev, v_dev = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    centroid, _, _ = page_metadata(k_dev, jnp.asarray(positions) + 1, with_minmax=False)
    scores = score_pages(group_mean_query(jnp.asarray(q), kv_heads), centroid)
    page_idx, page_valid = select_pages(scores, jnp.asarray(positions)[:, None], jnp.asarray(budget)[:, None],
                                        k_max, page_size, *reserved)
    full_idx, full_valid = select_pages(scores, jnp.asarray(positions)[:, None], num_pages, num_pages,
                                        page_size, *reserved)
    return dict(q=jnp.asarray(q, dtype), k=k_dev, v=v_dev, positions=jnp.asarray(positions),
                page_idx=page_idx, page_valid=page_valid, full_idx=full_idx, full_valid=full_valid)


def _rel_err(out: jax.Array, ref: np.ndarray) -> float:
    out = np.asarray(out.astype(jnp.float32), np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def check_case(impl: str, shape: tuple, dtype_name: str, seed: int = 0, time_it: bool = True) -> dict:
    """One implementation on one shape and dtype: errors vs float64, and the compiled step time."""
    batch, heads, kv_heads, head_dim, context = shape
    dtype = jnp.dtype(dtype_name)
    case = make_case(batch, heads, kv_heads, head_dim, context, dtype, seed)
    page_size = case["k"].shape[3]
    num_pages = case["k"].shape[2]
    # The reference sees exactly what the kernel sees: inputs rounded to the cache dtype.
    q64 = np.asarray(case["q"].astype(jnp.float32))
    k64 = np.asarray(case["k"].astype(jnp.float32)).reshape(batch, kv_heads, context, head_dim)
    v64 = np.asarray(case["v"].astype(jnp.float32)).reshape(batch, kv_heads, context, head_dim)
    positions = np.asarray(case["positions"])
    scale = head_dim ** -0.5
    fn = jax.jit(lambda q, k, v, i, m, p: sparse_decode(q, k, v, i, m, p, impl=impl))
    args = (case["q"], case["k"], case["v"], case["page_idx"], case["page_valid"], case["positions"])
    out = jax.block_until_ready(fn(*args))
    mask = selected_token_mask(np.asarray(case["page_idx"]), np.asarray(case["page_valid"]), positions,
                               num_pages, page_size)
    err = _rel_err(out, reference_attention(q64, k64, v64, mask, scale))
    full = fn(case["q"], case["k"], case["v"], case["full_idx"], case["full_valid"], case["positions"])
    causal = np.broadcast_to((np.arange(context)[None] <= positions[:, None])[:, None], mask.shape)
    err_full = _rel_err(full, reference_attention(q64, k64, v64, causal, scale))
    row = {"impl": resolve_impl(impl), "shape": dict(zip(("batch", "heads", "kv_heads", "head_dim", "context"),
                                                        shape)),
           "dtype": dtype_name, "rel_err": err, "rel_err_full_budget_vs_dense": err_full,
           "tolerance": TOLERANCE[dtype_name],
           "selected_pages_per_head": float(np.asarray(case["page_valid"]).sum(-1).mean())}
    row["ok"] = bool(err <= row["tolerance"] and err_full <= row["tolerance"])
    if time_it:  # compiled above
        times = [seconds(lambda: fn(*args)) for _ in range(20)]
        row["median_ms"] = round(float(np.median(times)) * 1e3, 4)
    return row


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_multi_string("impls", ["auto", "xla", "reference"], "implementations to check (one or more)",
                              flag_values=fv)
    flags.DEFINE_multi_string("dtypes", ["float32", "bfloat16"], "cache dtypes (one or more)", flag_values=fv)
    flags.DEFINE_bool("small", False, "tiny shapes (CPU / interpreter)", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "seed of the random cases", flag_values=fv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args, _ = parse_flags(define_flags, argv, __doc__)
    shapes = SMALL_SHAPES if args.small else SHAPES
    rows = []
    for impl in args.impls:
        for name, shape in shapes.items():
            for dtype_name in args.dtypes:
                try:
                    row = check_case(impl, shape, dtype_name, args.seed)
                except Exception as exc:  # report and go on: one failing kernel must not hide the rest
                    row = {"impl": impl, "shape": name, "dtype": dtype_name, "ok": False,
                           "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
                row["case"] = name
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
               "jax": jax.__version__, "all_ok": all(r["ok"] for r in rows), "cases": rows}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
