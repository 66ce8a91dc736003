"""Causal whole-sequence attention on CPU as C++ custom calls, forward and backward.

FlashAttention-2 in 64-token tiles (``cpu_kernel/flash_attention_cpu.cc``): the forward saves
the output and the per-query log-sum-exp, the backward recomputes each tile's probabilities.
Dense causal attention, or per-query page sets (the sparse teacher-forced scorer: a query
block visits only the key tiles holding a page one of its queries reads). Computes in float32
whatever the input dtype.
:func:`sparrow_jax.attention.causal.causal_attention` is the reference it is tested against,
values and gradients.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention.contract import check_whole_sequence_inputs
from sparrow_jax.attention.cpu_kernel import FLASH_BACKWARD_TARGET, FLASH_FORWARD_TARGET, cpu_kernel_available

BLOCK = 64  # the kernel's query / key tile (kBlock in the C++ source)


def flash_cpu_supports(head_dim: int) -> bool:
    """Whether the kernel takes this head size (whole 8-float vectors) and is built on this machine."""
    return head_dim % 8 == 0 and cpu_kernel_available()


def flash_attention_cpu(q: jax.Array, k: jax.Array, v: jax.Array, *, page_idx: Optional[jax.Array] = None,
                        page_valid: Optional[jax.Array] = None, page_size: int = 16,
                        dense_before: Optional[jax.Array] = None, queries_from: int = 0) -> jax.Array:
    """Causal attention. q [B, T, H, D]; k, v [B, T, Hkv, D] -> [B, T, H, D] in q's dtype.

    Query t attends keys 0..t with scale D ** -0.5. With ``page_idx`` / ``page_valid``
    ([B, Hkv, T, N], a selection per query as the sampler makes it) only keys of its valid
    selected pages (``page_size`` must divide 64); ``dense_before`` [B]: queries below it read
    every page. A query reading no key gives 0. ``queries_from`` (static, a multiple of 64):
    queries below it are not computed and give 0 (a caller that has them already, or does not
    read them). Differentiable in q, k, v. Raises RuntimeError where the CPU kernel is
    unavailable, ValueError on inputs it does not take.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    paged = check_whole_sequence_inputs(q, k, v, page_idx, page_valid, dense_before)
    if d % 8:
        raise ValueError(f"flash_attention_cpu needs head_dim a multiple of 8, got {d}")
    if queries_from % BLOCK or not 0 <= queries_from <= t:
        raise ValueError(f"flash_attention_cpu: queries_from must be a multiple of {BLOCK} in [0, {t}], "
                         f"got {queries_from}")
    if paged and BLOCK % page_size:
        raise ValueError(f"flash_attention_cpu needs page_size dividing {BLOCK}, got {page_size}")
    if not cpu_kernel_available():
        raise RuntimeError("the CPU attention kernel is unavailable (see the warning); use impl='blockwise'")
    tp = -(-t // BLOCK) * BLOCK
    # Padded keys come after every real query, so the causal mask hides them; padded queries are cut.
    pad = lambda x: jnp.pad(x.astype(jnp.float32), [(0, 0), (0, tp - t), (0, 0), (0, 0)])
    qg = pad(q).reshape(b, tp, hkv, h // hkv, d).transpose(0, 2, 1, 3, 4)  # [B, Hkv, Tp, G, D]
    kt, vt = pad(k).transpose(0, 2, 1, 3), pad(v).transpose(0, 2, 1, 3)  # [B, Hkv, Tp, D]
    if paged:
        pad_q = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, tp - t), (0, 0)])  # padded queries: no page
        pages = _Pages(pad_q(page_idx.astype(jnp.int32)), pad_q(page_valid.astype(bool)),
                       jnp.zeros((b,), jnp.int32) if dense_before is None else dense_before.astype(jnp.int32))
    else:
        pages = _Pages(jnp.zeros((b, hkv, tp, 0), jnp.int32), jnp.zeros((b, hkv, tp, 0), bool),
                       jnp.zeros((b,), jnp.int32))
    page_size = page_size if paged else 1
    out = _flash(qg, kt, vt, pages, page_size, queries_from)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, tp, h, d)[:, :t].astype(q.dtype)


class _Pages(NamedTuple):
    idx: jax.Array  # int32 [B, Hkv, Tp, N]; N = 0: dense
    valid: jax.Array  # bool [B, Hkv, Tp, N]
    dense_before: jax.Array  # int32 [B]


def _attributes(qg, page_size: int, queries_from: int) -> dict:
    return dict(scale=np.float32(qg.shape[-1] ** -0.5), page_size=np.int64(page_size),
                queries_from=np.int64(queries_from))


def _forward(qg, kt, vt, pages: _Pages, page_size: int, queries_from: int):
    b, hkv, tp, g, _ = qg.shape
    shapes = (jax.ShapeDtypeStruct(qg.shape, jnp.float32), jax.ShapeDtypeStruct((b, hkv, tp, g), jnp.float32))
    return jax.ffi.ffi_call(FLASH_FORWARD_TARGET, shapes, vmap_method="sequential")(
        qg, kt, vt, *pages, **_attributes(qg, page_size, queries_from))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(qg, kt, vt, pages: _Pages, page_size: int, queries_from: int):
    return _forward(qg, kt, vt, pages, page_size, queries_from)[0]


def _flash_fwd(qg, kt, vt, pages, page_size, queries_from):
    out, lse = _forward(qg, kt, vt, pages, page_size, queries_from)
    return out, (qg, kt, vt, pages, out, lse)


def _flash_bwd(page_size, queries_from, res, dout):
    qg, kt, vt, pages, out, lse = res
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (qg, kt, vt))
    grads = jax.ffi.ffi_call(FLASH_BACKWARD_TARGET, shapes, vmap_method="sequential")(
        qg, kt, vt, *pages, out, lse, dout.astype(jnp.float32), **_attributes(qg, page_size, queries_from))
    return (*grads, jax.tree.map(lambda _: None, pages))


_flash.defvjp(_flash_fwd, _flash_bwd)
