"""Sparse decode kernels on a mesh: ``shard_map`` over batch rows and KV heads.

GSPMD cannot partition a custom call (the C++ CPU kernel, the Pallas TPU / GPU kernels):
given sharded inputs it gathers them and every device runs the whole batch. Decode
attention is independent per (row, KV head), so each device can run the kernel on its own
block of rows (``("data", "fsdp")``) and KV heads (``"tensor"``) with no communication.
:func:`shard_rows_and_heads` does that for any function whose inputs and outputs are laid
out ``[B, Hkv-or-H, ...]`` or ``[B]``, page selection included.

The mesh comes from JAX's mesh context (``with mesh_context(mesh):`` around ``generate``;
the RL loop does it): the context is part of ``jax.jit``'s cache key, so a program traced
without a mesh is never reused on one. With no context mesh, a one-device
mesh, or a mesh without our axis names, the function runs unchanged.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Optional

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P

from sparrow_jax.parallel.mesh import AXES
from sparrow_jax.parallel.sharding import logical_to_spec, shard_batch, shard_caches


def mesh_context(mesh: Optional[Mesh]) -> contextlib.AbstractContextManager:
    """``jax.set_mesh(mesh)`` (kernels split over it), or a no-op context for ``None``."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def kernel_mesh() -> Optional[AbstractMesh]:
    """The context mesh when kernels should be split over it (our axes, more than one device), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or not set(AXES) <= set(mesh.axis_names):
        return None
    return mesh


def place_rows(tree: Any) -> Any:
    """Arrays [B, ...] (a pytree) split over rows of the context mesh, e.g. the prompts and
    lengths of a prefill, which XLA then runs per device on its rows; unchanged without one."""
    if kernel_mesh() is None:
        return tree
    return shard_batch(tree, jax.sharding.get_mesh())


def place_kv_caches(caches: Any) -> Any:
    """Paged KV caches split over rows and KV heads of the context mesh, as the sharded kernels
    read them (left to XLA's propagation, the sampler's caches came out of prefill split over
    heads only, every device holding all rows); unchanged without a mesh context."""
    if kernel_mesh() is None:
        return caches
    return shard_caches(caches, jax.sharding.get_mesh())


def rows_heads_spec(mesh: AbstractMesh, rows: int, kv_heads: int) -> P:
    """P(row axes, head axis) for [B, Hkv]: rows over ("data", "fsdp") (with the batch fallbacks),
    KV heads over "tensor" when the head count divides (a dim that does not divide stays whole)."""
    return logical_to_spec(("batch", "kv_heads"), (rows, kv_heads), mesh, units={"kv_heads": kv_heads})


def _spec_for(ndim: int, base: P) -> P:
    """[B] -> P(rows); [B, heads, ...] -> P(rows, heads, None, ...)."""
    return P(base[0]) if ndim == 1 else P(base[0], base[1], *(None,) * (ndim - 2))


def shard_rows_and_heads(fn: Callable[..., Any], *args: jax.Array, kv_heads: int) -> Any:
    """``fn(*args)`` run per device on its block of rows and KV heads under the context mesh.

    Every input and output is [B] or [B, heads, ...] where ``heads`` is Hkv or a multiple of
    it grouped by KV head (query heads [B, H, D] with H = Hkv * G, KV-head major, as the
    decode kernels expect). ``kv_heads``: Hkv, which decides whether "tensor" can split heads.
    """
    mesh = kernel_mesh()
    if mesh is None:
        return fn(*args)
    base = rows_heads_spec(mesh, args[0].shape[0], kv_heads)
    if base == P(None, None):  # nothing divides: every device needs the whole problem anyway
        return fn(*args)
    out_shapes = jax.eval_shape(fn, *args)
    in_specs = tuple(_spec_for(a.ndim, base) for a in args)
    out_specs = jax.tree.map(lambda s: _spec_for(len(s.shape), base), out_shapes)
    # check_vma off: custom calls (FFI, Pallas) carry no varying-axes rule; rows and heads are independent.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)
