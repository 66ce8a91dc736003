"""One-token decode attention against a paged cache: dense, and block-sparse in three forms.

All share one signature shape: ``q [B, H, D]`` against ``k_pages, v_pages [B, Hkv, P, S, D]``
with ``positions [B]`` (the query token's absolute position; keys at later positions are
masked). Sparse forms also take ``page_idx [B, Hkv, N]`` / ``page_valid [B, Hkv, N]``
from :func:`sparrow_jax.attention.selection.select_pages`. Softmax is in float32.

* ``contract.sparse_decode_reference``: masks the full cache with the selected pages (clear, slow).
* ``sparse_decode_xla``: gathers only the selected pages (plain formulation).
* ``fast_xla.sparse_decode_xla_fast``: the same, tuned for XLA:CPU (the CPU fallback).
* ``cpu_kernel.sparse_decode_cpu``: a C++ XLA:CPU custom call, built on first use (the CPU
  default when a C++ compiler is present).
* Pallas kernels (``pallas_kernels``) for TPU and GPU, tested against the reference.
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from sparrow_jax.attention.contract import group_query_heads, masked_softmax_attend, sparse_decode_reference
from sparrow_jax.attention.selection import score_pages, select_pages
from sparrow_jax.parallel.kernels import shard_rows_and_heads

IMPLEMENTATIONS = ("auto", "reference", "xla", "cpu", "pallas_tpu", "pallas_gpu", "triton")


def dense_decode(q, k_pages, v_pages, positions, scale=None):
    """Full attention over every cached token at or before ``positions``. Returns [B, H, D]."""
    b, hkv, p, s, d = k_pages.shape
    scale = d ** -0.5 if scale is None else scale
    k, v = k_pages.reshape(b, hkv, p * s, d), v_pages.reshape(b, hkv, p * s, d)
    mask = jnp.broadcast_to((jnp.arange(p * s)[None] <= positions[:, None])[:, None], (b, hkv, p * s))
    out = masked_softmax_attend(group_query_heads(q, hkv).astype(k.dtype), k, v, mask, scale)
    return out.reshape(q.shape).astype(q.dtype)


def sparse_decode_xla(q, k_pages, v_pages, page_idx, page_valid, positions, scale=None):
    """Gather only the selected pages (rows of S*D contiguous values) and attend over them."""
    b, hkv, p, s, d = k_pages.shape
    n = page_idx.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    # Flat row index of each selected page in a [B*Hkv*P, S*D] view: a contiguous-row gather.
    base = (jnp.arange(b)[:, None] * hkv + jnp.arange(hkv)[None]) * p  # [B, Hkv]
    flat = (base[..., None] + page_idx).reshape(-1)
    k = jnp.take(k_pages.reshape(b * hkv * p, s * d), flat, axis=0).reshape(b, hkv, n * s, d)
    v = jnp.take(v_pages.reshape(b * hkv * p, s * d), flat, axis=0).reshape(b, hkv, n * s, d)
    token_pos = (page_idx[..., None] * s + jnp.arange(s)).reshape(b, hkv, n * s)
    mask = jnp.repeat(page_valid, s, axis=-1) & (token_pos <= positions[:, None, None])
    out = masked_softmax_attend(group_query_heads(q, hkv).astype(k.dtype), k, v, mask, scale)
    return out.reshape(q.shape).astype(q.dtype)


@functools.lru_cache(maxsize=None)
def _platform() -> str:
    return jax.default_backend()


def resolve_impl(impl: str) -> str:
    """Map ``auto`` (and unavailable choices) to a concrete implementation for this platform."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown sparse attention implementation {impl!r}; expected one of {IMPLEMENTATIONS}")
    platform = _platform()
    if impl == "auto":
        if platform == "cpu":
            from sparrow_jax.attention.cpu_kernel import cpu_kernel_available  # builds on first use
            return "cpu" if cpu_kernel_available() else "xla"
        return {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(platform, "xla")
    if impl == "cpu" and platform != "cpu":
        raise ValueError(f"impl='cpu' is the XLA:CPU custom call; this backend is {platform!r}")
    if impl == "triton":
        try:
            from pallas_kernels import triton_available  # noqa: WPS433 (guarded optional import)
            if triton_available():
                return impl
        except ImportError:
            pass
        warnings.warn("jax-triton is not usable with this jax; falling back to the Pallas GPU kernel"
                      if platform == "gpu" else "jax-triton needs a GPU; falling back to XLA")
        return "pallas_gpu" if platform == "gpu" else "xla"
    return impl


def select_pages_decode(scores, positions, budget, k_max: int, page_size: int, reserved_first: int = 1,
                        reserved_last: int = 2, impl: str = "auto"):
    """``select_pages`` for one decode step: scores [B, Hkv, P], positions and budget [B].

    With the CPU kernel as the implementation, a C++ radix selection replaces XLA's top-k (the
    same slots for finite scores); otherwise :func:`select_pages`. Returns (page_idx, page_valid).
    """
    budget = jnp.broadcast_to(jnp.asarray(budget, jnp.int32), positions.shape)
    local = functools.partial(_select_pages_local, k_max=k_max, page_size=page_size, reserved_first=reserved_first,
                              reserved_last=reserved_last, impl=resolve_impl(impl))
    return shard_rows_and_heads(local, scores, positions, budget, kv_heads=scores.shape[1])  # per device on a mesh


def _select_pages_local(scores, positions, budget, *, k_max, page_size, reserved_first, reserved_last, impl):
    if impl == "cpu":
        from sparrow_jax.attention.cpu_kernel import select_pages_cpu
        return select_pages_cpu(scores, positions, budget, k_max, page_size, reserved_first, reserved_last)
    return select_pages(scores, positions[:, None], budget[:, None], k_max, page_size, reserved_first, reserved_last)


def score_select_decode(qg, centroid, kmin, kmax, positions, budget, k_max: int, page_size: int,
                        reserved_first: int = 1, reserved_last: int = 2, selector: str = "centroid",
                        impl: str = "auto"):
    """Page scores and block top-k selection of one decode step. Returns (page_idx, page_valid).

    qg [B, Hkv, D] group-mean queries; centroid (and Quest's kmin / kmax, else None)
    [B, Hkv, P, D]; positions, budget [B]. With the CPU kernel one C++ pass per (row, KV head)
    scores and selects (:func:`score_select_cpu`; the scores never reach memory), per device
    under a mesh; otherwise :func:`score_pages` + :func:`select_pages_decode`.
    """
    impl = resolve_impl(impl)
    if impl != "cpu":
        scores = score_pages(qg, centroid, kmin, kmax, selector)
        return select_pages_decode(scores, positions, budget, k_max, page_size, reserved_first, reserved_last,
                                   impl=impl)
    from sparrow_jax.attention.cpu_kernel import score_select_cpu
    budget = jnp.broadcast_to(jnp.asarray(budget, jnp.int32), positions.shape)
    settings = dict(k_max=k_max, page_size=page_size, reserved_first=reserved_first, reserved_last=reserved_last,
                    selector=selector)
    if selector == "quest":
        if kmin is None or kmax is None:
            raise ValueError("quest selector needs a cache built with with_minmax=True")
        local = lambda q, lo, hi, pos, bud: score_select_cpu(q, None, lo, hi, pos, bud, **settings)  # noqa: E731
        return shard_rows_and_heads(local, qg, kmin, kmax, positions, budget, kv_heads=qg.shape[1])
    local = lambda q, c, pos, bud: score_select_cpu(q, c, None, None, pos, bud, **settings)  # noqa: E731
    return shard_rows_and_heads(local, qg, centroid, positions, budget, kv_heads=qg.shape[1])


def dense_decode_dispatch(q, k_pages, v_pages, positions, scale=None, impl="auto"):
    """Dense decode on the fastest implementation for ``impl``. Returns [B, H, D].

    On CPU with the C++ kernel (``auto`` or ``cpu``), the kernel's loop over every page up to
    the query's (the like-for-like baseline of the sparse kernel), per device on its rows and KV
    heads under a mesh context (an unpartitioned custom call would make every device attend over
    the whole batch); otherwise :func:`dense_decode`, which XLA partitions itself.
    """
    if resolve_impl(impl) == "cpu":
        from sparrow_jax.attention.cpu_kernel import dense_decode_cpu
        local = functools.partial(dense_decode_cpu, scale=scale)
        return shard_rows_and_heads(local, q, k_pages, v_pages, positions, kv_heads=k_pages.shape[1])
    return dense_decode(q, k_pages, v_pages, positions, scale)


def sparse_decode(q, k_pages, v_pages, page_idx, page_valid, positions, scale=None, impl="auto"):
    """Dispatch block-sparse decode attention to the chosen implementation. Returns [B, H, D].

    Under a mesh context the kernel runs per device on its rows and KV heads (shard_map).
    """
    local = functools.partial(_sparse_decode_local, scale=scale, impl=resolve_impl(impl))
    return shard_rows_and_heads(local, q, k_pages, v_pages, page_idx, page_valid, positions,
                                kv_heads=k_pages.shape[1])


def _sparse_decode_local(q, k_pages, v_pages, page_idx, page_valid, positions, *, scale, impl):
    if impl == "reference":
        return sparse_decode_reference(q, k_pages, v_pages, page_idx, page_valid, positions, scale)
    if impl == "xla":  # the whole-page-row gather formulation: ~1.4x faster than sparse_decode_xla on CPU
        from sparrow_jax.attention.fast_xla import sparse_decode_xla_fast
        return sparse_decode_xla_fast(q, k_pages, v_pages, page_idx, page_valid, positions, scale)
    if impl == "cpu":  # C++ custom call, one pass over the selected pages
        from sparrow_jax.attention.cpu_kernel import sparse_decode_cpu
        return sparse_decode_cpu(q, k_pages, v_pages, page_idx, page_valid, positions, scale)
    import pallas_kernels  # deferred: Pallas imports are heavy and optional on CPU

    interpret = _platform() == "cpu"
    if impl == "pallas_tpu":
        return pallas_kernels.sparse_decode_tpu(q, k_pages, v_pages, page_idx, page_valid, positions,
                                                scale=scale, interpret=interpret)
    if impl == "pallas_gpu":
        return pallas_kernels.sparse_decode_gpu(q, k_pages, v_pages, page_idx, page_valid, positions,
                                                scale=scale, interpret=interpret)
    return pallas_kernels.sparse_decode_triton(q, k_pages, v_pages, page_idx, page_valid, positions,
                                               scale=scale)
