"""One-token decode attention against a paged cache: dense, and block-sparse in three forms.

All share one signature shape: ``q [B, H, D]`` against ``k_pages, v_pages [B, Hkv, P, S, D]``
with ``positions [B]`` (the query token's absolute position; keys at later positions are
masked). Sparse forms also take ``page_idx [B, Hkv, N]`` / ``page_valid [B, Hkv, N]``
from :func:`sparrow_jax.attention.selection.select_pages`. Softmax is in float32.

* ``sparse_decode_reference``: masks the full cache with the selected pages (clear, slow).
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

from sparrow_jax.attention.selection import select_pages, selected_page_mask

IMPLEMENTATIONS = ("auto", "reference", "xla", "cpu", "pallas_tpu", "pallas_gpu", "triton")


def check_decode_inputs(q, k_pages, v_pages, page_idx, page_valid, positions) -> None:
    """Raise ValueError naming the tensor whose shape or dtype breaks the decode contract."""
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, D], got shape {q.shape}")
    if k_pages.ndim != 5:
        raise ValueError(f"k_pages must be [B, Hkv, P, S, D], got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    b, h, d = q.shape
    kb, hkv, _, _, kd = k_pages.shape
    if (kb, kd) != (b, d):
        raise ValueError(f"k_pages batch/head_dim {(kb, kd)} must match q's {(b, d)}")
    if h % hkv:
        raise ValueError(f"query heads H={h} must be a multiple of KV heads Hkv={hkv}")
    if page_idx.ndim != 3 or page_idx.shape[:2] != (b, hkv):
        raise ValueError(f"page_idx must be [B={b}, Hkv={hkv}, N], got shape {page_idx.shape}")
    if page_valid.shape != page_idx.shape:
        raise ValueError(f"page_valid shape {page_valid.shape} must equal page_idx shape {page_idx.shape}")
    if not jnp.issubdtype(page_idx.dtype, jnp.integer):
        raise ValueError(f"page_idx must be an integer array, got dtype {page_idx.dtype}")
    if positions.shape != (b,):
        raise ValueError(f"positions must be [B={b}], got shape {positions.shape}")


def _group(q, num_kv_heads):
    b, h, d = q.shape
    return q.reshape(b, num_kv_heads, h // num_kv_heads, d)


def _masked_softmax_attend(qg, k, v, mask, scale):
    """qg [B,Hkv,G,D], k/v [B,Hkv,T,D], mask [B,Hkv,T] -> [B,Hkv,G,D] float32.

    HIGHEST precision: on GPU, XLA would otherwise run f32 products as TF32 (relative error
    ~4e-4 seen on an H200), and decode attention is memory-bound, so full f32 costs nothing.
    """
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, k, preferred_element_type=jnp.float32, precision=hi) * scale
    s = jnp.where(mask[:, :, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhgt,bhtd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=hi)


def dense_decode(q, k_pages, v_pages, positions, scale=None):
    """Full attention over every cached token at or before ``positions``. Returns [B, H, D]."""
    b, hkv, p, s, d = k_pages.shape
    scale = d ** -0.5 if scale is None else scale
    k, v = k_pages.reshape(b, hkv, p * s, d), v_pages.reshape(b, hkv, p * s, d)
    mask = jnp.broadcast_to((jnp.arange(p * s)[None] <= positions[:, None])[:, None], (b, hkv, p * s))
    out = _masked_softmax_attend(_group(q, hkv).astype(k.dtype), k, v, mask, scale)
    return out.reshape(q.shape).astype(q.dtype)


def sparse_decode_reference(q, k_pages, v_pages, page_idx, page_valid, positions, scale=None):
    """Reference: dense attention restricted to the selected pages by a mask."""
    b, hkv, p, s, d = k_pages.shape
    scale = d ** -0.5 if scale is None else scale
    page_mask = selected_page_mask(page_idx, page_valid, p)  # [B, Hkv, P]
    causal = (jnp.arange(p * s)[None] <= positions[:, None])[:, None]
    mask = jnp.repeat(page_mask, s, axis=-1) & causal
    k, v = k_pages.reshape(b, hkv, p * s, d), v_pages.reshape(b, hkv, p * s, d)
    out = _masked_softmax_attend(_group(q, hkv).astype(k.dtype), k, v, mask, scale)
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
    out = _masked_softmax_attend(_group(q, hkv).astype(k.dtype), k, v, mask, scale)
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

    With the CPU kernel as the implementation, a C++ partial sort replaces XLA's top-k (the
    same slots for finite scores); otherwise :func:`select_pages`. Returns (page_idx, page_valid).
    """
    budget = jnp.broadcast_to(jnp.asarray(budget, jnp.int32), positions.shape)
    if resolve_impl(impl) == "cpu":
        from sparrow_jax.attention.cpu_kernel import select_pages_cpu
        return select_pages_cpu(scores, positions, budget, k_max, page_size, reserved_first, reserved_last)
    return select_pages(scores, positions[:, None], budget[:, None], k_max, page_size, reserved_first, reserved_last)


def sparse_decode(q, k_pages, v_pages, page_idx, page_valid, positions, scale=None, impl="auto"):
    """Dispatch block-sparse decode attention to the chosen implementation. Returns [B, H, D]."""
    impl = resolve_impl(impl)
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
