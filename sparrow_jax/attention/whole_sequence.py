"""The one entry for whole-sequence causal attention (teacher-forced scoring, the train step).

``impl`` picks the implementation, as the decode kernels do (``auto`` per backend, each
overridable):

* ``reference``: :func:`sparrow_jax.attention.causal.causal_attention` (chunked XLA, a dense
  pass with a page mask for per-query page sets); every other path is tested against it;
* ``cpu``: :mod:`sparrow_jax.attention.flash_cpu`, FlashAttention-2 forward and backward as
  C++ custom calls, dense or with per-query page sets (CPU; head_dim a multiple of 8, pages
  dividing 64 tokens): ``auto`` on CPU;
* ``blockwise``: :mod:`sparrow_jax.attention.blockwise`, the same algorithm in XLA (causal
  block skipping, a recomputing VJP); ``auto`` for per-query page sets on accelerators (the
  sparse scorer), and on CPU where the C++ kernel is not built;
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU; bf16 / fp16,
  head_dim a multiple of 8 up to 128);
* ``pallas_tpu``: jax's Pallas TPU flash attention with causal block skipping (sequence a
  multiple of 128, head_dim a multiple of 128 or below it).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from sparrow_jax.attention.blockwise import blockwise_attention
from sparrow_jax.attention.causal import causal_attention
from sparrow_jax.attention.contract import selected_page_mask
from sparrow_jax.attention.flash_cpu import BLOCK as FLASH_BLOCK
from sparrow_jax.attention.flash_cpu import flash_attention_cpu, flash_cpu_supports

CAUSAL_IMPLEMENTATIONS = ("auto", "reference", "blockwise", "cpu", "cudnn", "pallas_tpu")


def cudnn_supports(dtype, head_dim: int) -> bool:
    """Whether cuDNN flash attention takes these inputs (its dtype and head-size constraints)."""
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim % 8 == 0 \
        and head_dim <= 128


def pallas_tpu_supports(seq_len: int, head_dim: int) -> bool:
    """Whether the Pallas TPU flash kernel's block constraints hold (128-token blocks)."""
    return seq_len % 128 == 0 and (head_dim % 128 == 0 or head_dim < 128)


@functools.lru_cache(maxsize=None)
def _pallas_tpu_flash():
    """jax's Pallas TPU flash attention, or None where this jax lacks it."""
    try:
        from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention
    except ImportError:
        return None
    return flash_attention


def resolve_causal_impl(impl: str, *, dtype, head_dim: int, seq_len: int, paged: bool,
                        platform: Optional[str] = None, page_size: int = 16) -> str:
    """``impl`` (maybe ``auto``) -> the implementation that runs on ``platform`` (default: jax's
    backend) for inputs of this dtype and shape, with (``paged``, pages of ``page_size``) or
    without per-query page sets."""
    if impl not in CAUSAL_IMPLEMENTATIONS:
        raise ValueError(f"unknown causal attention implementation {impl!r}; expected one of "
                         f"{CAUSAL_IMPLEMENTATIONS}")
    platform = platform or jax.default_backend()
    if impl == "auto":
        if platform == "cpu" and flash_cpu_supports(head_dim) and (not paged or FLASH_BLOCK % page_size == 0):
            return "cpu"
        if paged:
            return "blockwise"
        if platform == "gpu" and cudnn_supports(dtype, head_dim):
            return "cudnn"
        if platform == "tpu" and pallas_tpu_supports(seq_len, head_dim) and _pallas_tpu_flash() is not None:
            return "pallas_tpu"
        return "blockwise"
    if impl in ("cudnn", "pallas_tpu"):
        if paged:
            raise ValueError(f"impl={impl!r} takes no per-query page sets; use 'blockwise' or 'reference'")
    if impl in ("cpu", "cudnn", "pallas_tpu"):
        wanted = {"cpu": "cpu", "cudnn": "gpu", "pallas_tpu": "tpu"}[impl]
        if platform != wanted:
            raise ValueError(f"impl={impl!r} needs a {wanted.upper()}; this backend is {platform!r}")
    return impl


def whole_sequence_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str = "auto",
                             page_idx: Optional[jax.Array] = None, page_valid: Optional[jax.Array] = None,
                             page_size: int = 16, dense_before: Optional[jax.Array] = None,
                             chunk: Optional[int] = None, queries_from: int = 0) -> jax.Array:
    """Causal attention. q [B, T, H, D]; k, v [B, T, Hkv, D] -> [B, T, H, D] in q's dtype.

    Query t attends keys 0..t; with ``page_idx`` / ``page_valid`` [B, Hkv, T, N] (a
    selection per query) only keys of its valid selected pages; ``dense_before`` [B]: queries
    below it attend every page. ``chunk``: the query chunk of ``reference`` (default 256) and
    the query / key tile of ``blockwise`` (default ``blockwise.default_block``: 64 on CPU, 128
    elsewhere; a multiple of ``page_size`` with pages). ``queries_from`` (static, a multiple of 64):
    the outputs of queries below it are 0, for a caller that has them already (the ``cpu`` kernel
    skips them; other paths compute and drop them).
    """
    paged = page_idx is not None
    b, t, h, d = q.shape
    impl = resolve_causal_impl(impl, dtype=q.dtype, head_dim=d, seq_len=t, paged=paged, page_size=page_size)
    if impl == "cpu":
        return flash_attention_cpu(q, k, v, page_idx=page_idx, page_valid=page_valid, page_size=page_size,
                                   dense_before=dense_before, queries_from=queries_from)
    out = _attention(q, k, v, impl, page_idx, page_valid, page_size, dense_before, chunk)
    if queries_from:
        out = jnp.where((jnp.arange(t) < queries_from)[None, :, None, None], jnp.zeros_like(out), out)
    return out


def _attention(q, k, v, impl: str, page_idx, page_valid, page_size: int, dense_before, chunk):
    """:func:`whole_sequence_attention` on a resolved ``impl`` other than ``cpu``."""
    paged = page_idx is not None
    h, d = q.shape[2], q.shape[3]
    if impl == "blockwise":
        return blockwise_attention(q, k, v, block=chunk, page_idx=page_idx, page_valid=page_valid,
                                   page_size=page_size, dense_before=dense_before)
    if impl == "reference":
        mask_fn = None if not paged else _page_mask_fn(page_idx, page_valid, page_size, dense_before)
        return causal_attention(q, k, v, chunk=chunk or 256, page_mask_fn=mask_fn, page_size=page_size)
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    flash = _pallas_tpu_flash()  # [B, H, T, D] layout, as many KV heads as query heads
    rep = h // k.shape[2]
    heads_first = lambda x: x.transpose(0, 2, 1, 3)
    kv = lambda x: heads_first(jnp.repeat(x, rep, axis=2))
    out = flash(heads_first(q), kv(k), kv(v), causal=True, sm_scale=d ** -0.5)
    return out.transpose(0, 2, 1, 3)


def _page_mask_fn(page_idx, page_valid, page_size: int, dense_before):
    """Per-query selections [B, Hkv, T, N] -> the reference's ``page_mask_fn`` (chunk -> [B, Hkv, C, P])."""
    t = page_idx.shape[2]
    num_pages = -(-t // page_size)

    def mask_fn(start, q_chunk):
        c = q_chunk.shape[1]
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, c), (0, 0)))  # query chunks may run past T
        idx = jax.lax.dynamic_slice_in_dim(pad(page_idx), start, c, axis=2)
        valid = jax.lax.dynamic_slice_in_dim(pad(page_valid), start, c, axis=2)
        allowed = selected_page_mask(idx, valid, num_pages)
        if dense_before is not None:
            allowed = allowed | ((start + jnp.arange(c))[None, :] < dense_before[:, None])[:, None, :, None]
        return allowed

    return mask_fn
