"""Optional block-sparse decode kernel written directly in Triton and called via jax-triton.

Everything here is guarded: ``jax_triton`` / ``triton`` are imported lazily, and
:func:`triton_available` returns False (never raises) when they are missing, when the
backend is not a GPU, or when a one-time smoke test against
``sparse_decode_reference`` fails or crashes (jax-triton often lags behind jax releases).
Same contract as the Pallas kernels; see :mod:`pallas_kernels.sparse_decode_tpu`.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels.common import compact_selection
from sparrow_jax.attention.contract import check_decode_inputs


@functools.lru_cache(maxsize=None)
def _triton_kernel():
    """Build the @triton.jit kernel on first use (import errors propagate to the caller)."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(q_ptr, k_ptr, v_ptr, idx_ptr, meta_ptr, o_ptr,
               HKV: tl.constexpr, P: tl.constexpr, S: tl.constexpr, D: tl.constexpr,
               G: tl.constexpr, GP: tl.constexpr, NP: tl.constexpr, PPB: tl.constexpr,
               SCALE: tl.constexpr):
        row = tl.program_id(0) * HKV + tl.program_id(1)  # (b, kv head)
        count = tl.load(meta_ptr + row * 2)
        position = tl.load(meta_ptr + row * 2 + 1)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        q_offs = (row * G + g)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=(g < G)[:, None], other=0.0).to(tl.float32)
        t = tl.arange(0, PPB * S)
        j = t // S
        s = t % S
        m_i = tl.full([GP], -1e30, tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for blk in range(0, tl.cdiv(count, PPB)):
            slot = blk * PPB + j
            page = tl.load(idx_ptr + row * NP + slot)  # NP is a multiple of PPB: in bounds
            tok = page * S + s
            valid = (slot < count) & (tok <= position)
            kv_offs = (row * P * S + tok)[:, None] * D + d[None, :]
            k = tl.load(k_ptr + kv_offs, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_offs, mask=valid[:, None], other=0.0).to(tl.float32)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee") * SCALE
            qk = tl.where(valid[None, :], qk, -1e30)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.where(valid[None, :], tl.exp(qk - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + q_offs, out, mask=(g < G)[:, None])

    return kernel


def sparse_decode_triton(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_idx: jax.Array,
                         page_valid: jax.Array, positions: jax.Array, scale: Optional[float] = None,
                         pages_per_block: int = 4) -> jax.Array:
    """Block-sparse decode attention through jax-triton. Returns [B, H, D] in q's dtype.

    Shapes as in ``sparse_decode_reference``. Raises RuntimeError when jax-triton is not
    importable; check :func:`triton_available` first.
    """
    try:
        import jax_triton
    except ImportError as err:
        raise RuntimeError("sparse_decode_triton needs jax-triton (pip install jax-triton) and a GPU; "
                           "use triton_available() to check") from err
    check_decode_inputs(q, k_pages, v_pages, page_idx, page_valid, positions)
    b, h, d = q.shape
    _, hkv, num_pages, page_size, _ = k_pages.shape
    groups = h // hkv
    idx, count = compact_selection(page_idx, page_valid, num_pages, pages_per_block)
    meta = jnp.stack([count, jnp.broadcast_to(positions.astype(jnp.int32)[:, None], (b, hkv))], -1)
    out = jax_triton.triton_call(
        q.astype(jnp.float32), k_pages, v_pages, idx, meta,
        kernel=_triton_kernel(), out_shape=jax.ShapeDtypeStruct((b, h, d), jnp.float32),
        grid=(b, hkv), num_warps=4, num_stages=2,
        HKV=hkv, P=num_pages, S=page_size, D=d, G=groups,
        GP=max(16, 1 << max(0, (groups - 1).bit_length())), NP=idx.shape[-1], PPB=pages_per_block,
        SCALE=float(d ** -0.5 if scale is None else scale))
    return out.astype(q.dtype)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True only if jax-triton imports, the backend is a GPU and a smoke test matches the reference."""
    try:
        import jax_triton  # noqa: F401
        import triton  # noqa: F401

        if jax.default_backend() != "gpu":
            return False
        from sparrow_jax.attention.contract import sparse_decode_reference

        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(keys[0], (2, 4, 16))
        k = jax.random.normal(keys[1], (2, 2, 4, 16, 16))
        v = jax.random.normal(keys[2], (2, 2, 4, 16, 16))
        idx = jnp.broadcast_to(jnp.array([0, 2, 3, 1], jnp.int32), (2, 2, 4))
        valid = jnp.broadcast_to(jnp.array([True, True, True, False]), (2, 2, 4))
        positions = jnp.array([60, 50], jnp.int32)
        got = sparse_decode_triton(q, k, v, idx, valid, positions)
        want = sparse_decode_reference(q, k, v, idx, valid, positions)
        err = float(jnp.max(jnp.abs(got - want)))
        if not err <= 1e-4:
            warnings.warn(f"jax-triton sparse decode smoke test mismatch (max abs err {err}); disabled")
            return False
        return True
    except Exception as err:  # any import/compile/runtime incompatibility means "not available"
        if not isinstance(err, ImportError):
            warnings.warn(f"jax-triton sparse decode path disabled: {type(err).__name__}: {err}")
        return False
