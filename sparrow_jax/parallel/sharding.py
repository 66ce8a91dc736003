"""Logical-axis rules: which mesh axes split each parameter, optimizer, batch and cache array.

Every array dim gets a *logical* name, and one table maps logical names to mesh axes
(the MaxText / flax "logical axis rules" idea, written out for the Qwen3 pytree):

    logical axis   mesh axes           used by
    batch          ("data", "fsdp")    rows of tokens / masks / advantages, KV-cache rows
    embed          "fsdp"              hidden-size dim of every weight (FSDP / ZeRO-3)
    vocab          "tensor"            embed_tokens rows, lm_head columns
    q_heads        "tensor"            q_proj out, o_proj in (num_heads * head_dim)
    kv_heads       "tensor"            k_proj / v_proj out, KV-cache heads
    mlp            "tensor"            gate/up out, down in (intermediate units)
    norm, lora_rank, (other dims)      replicated

Parameter layout (kernels are [in, out]; the spec per dim):

    embed_tokens [V, H]         (vocab, embed)   -> P("tensor", "fsdp")
    q_proj/kernel [H, Hq*D]     (embed, q_heads) -> P("fsdp", "tensor")
    k_proj, v_proj [H, Hkv*D]   (embed, kv_heads)-> P("fsdp", "tensor")
    o_proj/kernel [Hq*D, H]     (q_heads, embed) -> P("tensor", "fsdp")
    gate_proj, up_proj [H, I]   (embed, mlp)     -> P("fsdp", "tensor")
    down_proj [I, H]            (mlp, embed)     -> P("tensor", "fsdp")
    lm_head/kernel [H, V]       (embed, vocab)   -> P("fsdp", "tensor")
    *norm/weight [H] or [D]     (norm,)          -> P(None)
    LoRA <kernel>/a [in, r]     (kernel in, lora_rank)  e.g. q_proj/a -> P("fsdp", None)
    LoRA <kernel>/b [r, out]    (lora_rank, kernel out) e.g. q_proj/b -> P(None, "tensor")

**Fallback to replication.** A dim is split over its mesh axes only if its size is
divisible by their device count; otherwise that dim is replicated (the array stays
correct, only less memory is saved). For the ``batch`` axis the pair ("data", "fsdp")
is tried first, then "data" alone, then "fsdp" alone. Given the model ``config``, head
dims are split over "tensor" only if the *number of heads* divides (never a split
inside one head), e.g. 2 KV heads on tensor=4 keep k/v kernels and KV caches
replicated over "tensor". A mesh axis is used at most once per array.

Optimizer states (optax) mirror the params: every sub-tree of the state with the
params' tree structure (Adam's ``mu`` / ``nu``, ...) gets the params' shardings leaf by
leaf (when the shapes match); all other leaves (step counts, ...) are replicated.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from sparrow_jax.parallel.mesh import axis_size

MeshLike = Mesh | AbstractMesh

LOGICAL_RULES: dict[str, Any] = {
    "batch": ("data", "fsdp"),
    "embed": "fsdp",
    "vocab": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    "lora_rank": None,
}

# [in, out] logical axes of every linear kernel, by module name
KERNEL_AXES = {
    "q_proj": ("embed", "q_heads"), "k_proj": ("embed", "kv_heads"), "v_proj": ("embed", "kv_heads"),
    "o_proj": ("q_heads", "embed"), "gate_proj": ("embed", "mlp"), "up_proj": ("embed", "mlp"),
    "down_proj": ("mlp", "embed"), "lm_head": ("embed", "vocab"),
}


def _key_name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def path_str(path: Sequence[Any]) -> str:
    """'layers/0/self_attn/q_proj/kernel' from a jax key path (or a tuple of names)."""
    return "/".join(_key_name(e) for e in path) or "<root>"


def param_logical_axes(path: Sequence[Any]) -> tuple[Optional[str], ...]:
    """Logical axis names of a params or LoRA leaf from its tree path. KeyError for unknown leaves."""
    names = [_key_name(e) for e in path]
    last = names[-1] if names else ""
    parent = names[-2] if len(names) >= 2 else ""
    if last == "embed_tokens":
        return ("vocab", "embed")
    if last == "weight" and parent.endswith("norm"):
        return ("norm",)
    if parent in KERNEL_AXES:
        d_in, d_out = KERNEL_AXES[parent]
        if last == "kernel":
            return (d_in, d_out)
        if last == "a":  # LoRA down-projection [in, r]: split like the kernel's input
            return (d_in, "lora_rank")
        if last == "b":  # LoRA up-projection [r, out]: split like the kernel's output
            return ("lora_rank", d_out)
    raise KeyError(f"no sharding rule for parameter {path_str(path)!r}; known leaves: embed_tokens, "
                   f"*norm/weight, {{{', '.join(KERNEL_AXES)}}}/kernel, LoRA <kernel>/a and /b")


def _head_counts(config: Any) -> dict[str, int]:
    if config is None:
        return {}
    return {"q_heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads}


def _fit(dim: int, mesh_axes: Any, mesh: MeshLike, used: set, units: Optional[int]) -> Any:
    """The largest candidate of ``mesh_axes`` that splits ``dim`` (and ``units`` heads) evenly, or None."""
    if mesh_axes is None:
        return None
    if isinstance(mesh_axes, str):
        candidates = [mesh_axes]
    else:
        mesh_axes = tuple(mesh_axes)
        candidates = [mesh_axes] + list(mesh_axes) if len(mesh_axes) > 1 else list(mesh_axes)
    for cand in candidates:
        axes = (cand,) if isinstance(cand, str) else cand
        if used.intersection(axes):
            continue
        size = axis_size(mesh, axes)
        if dim % size == 0 and (units is None or units % size == 0):
            used.update(axes)
            return cand
    return None


def logical_to_spec(logical: Sequence[Optional[str]], shape: Sequence[int], mesh: MeshLike,
                    units: Optional[dict[str, int]] = None, rules: Optional[dict[str, Any]] = None) -> P:
    """PartitionSpec of an array with per-dim logical names, dims that do not divide replicated.

    units: optional ``{logical name: count}`` that must divide too (heads: never split a head).
    """
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {tuple(logical)} do not match array shape {tuple(shape)}")
    rules = LOGICAL_RULES if rules is None else rules
    units = units or {}
    used: set = set()
    entries = [_fit(int(d), rules.get(name) if name else None, mesh, used, units.get(name))
               for name, d in zip(logical, shape)]
    return P(*entries)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)


# ---- params, LoRA, optimizer state ------------------------------------------------------

def param_spec(path: Sequence[Any], shape: Sequence[int], mesh: MeshLike, config: Any = None) -> P:
    """PartitionSpec of one params / LoRA leaf (path as from ``jax.tree_util`` or a tuple of names)."""
    logical = param_logical_axes(path)
    if len(logical) != len(shape):
        raise ValueError(f"parameter {path_str(path)!r}: expected a {len(logical)}-d array {logical}, "
                         f"got shape {tuple(shape)}")
    return logical_to_spec(logical, shape, mesh, _head_counts(config))


def param_specs(params: Any, mesh: MeshLike, config: Any = None) -> Any:
    """Pytree of PartitionSpecs for a params (or LoRA) pytree of arrays / ShapeDtypeStructs."""
    return jax.tree_util.tree_map_with_path(lambda p, x: param_spec(p, _shape(x), mesh, config), params)


def param_shardings(params_or_shapes: Any, mesh: MeshLike, config: Any = None) -> Any:
    """Pytree of NamedShardings for params / LoRA (arrays or ``jax.ShapeDtypeStruct`` leaves).

    Use for checkpoint restore targets: ``abstract_target(shapes, param_shardings(shapes, mesh))``.
    """
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(params_or_shapes, mesh, config),
                        is_leaf=lambda x: isinstance(x, P))


def mirror_shardings(state: Any, params: Any, shardings: Any, mesh: MeshLike) -> Any:
    """Shardings for a pytree ``state`` whose sub-trees may mirror ``params`` (an optax state).

    A sub-tree with the params' tree structure gets ``shardings`` leaf by leaf where the
    shapes match (replicated where they do not, e.g. factored second moments); every
    other leaf is replicated.
    """
    params_def = jax.tree.structure(params)
    replicated = NamedSharding(mesh, P())

    def is_mirror(x):
        return x is not None and jax.tree.structure(x) == params_def

    def assign(sub):
        if is_mirror(sub) and params_def.num_leaves:
            return jax.tree.map(lambda leaf, s, p: s if _shape(leaf) == _shape(p) else replicated,
                                sub, shardings, params)
        return replicated

    return jax.tree.map(assign, state, is_leaf=is_mirror)


def opt_state_shardings(opt_state: Any, params: Any, mesh: MeshLike, config: Any = None) -> Any:
    """Shardings of an optax state for ``params`` (moments like the params, counters replicated)."""
    return mirror_shardings(opt_state, params, param_shardings(params, mesh, config), mesh)


def train_state_shardings(state: Any, mesh: MeshLike, config: Any = None) -> Any:
    """Shardings of a ``TrainState(step, params, opt_state)`` or ``LoraState(lora, opt_state)``."""
    replicated = NamedSharding(mesh, P())
    if hasattr(state, "params"):
        weights = param_shardings(state.params, mesh, config)
        out = state._replace(params=weights,
                             opt_state=mirror_shardings(state.opt_state, state.params, weights, mesh))
        return out._replace(step=replicated) if hasattr(state, "step") else out
    if hasattr(state, "lora"):
        weights = param_shardings(state.lora, mesh, config)
        return state._replace(lora=weights, opt_state=mirror_shardings(state.opt_state, state.lora, weights, mesh))
    raise TypeError(f"train_state_shardings: expected a TrainState (params, opt_state) or LoraState "
                    f"(lora, opt_state), got {type(state).__name__}")


# ---- batch, activations, KV caches ------------------------------------------------------

def batch_spec(shape: Sequence[int], mesh: MeshLike) -> P:
    """[B, ...] rows over ("data", "fsdp") (fallbacks: "data", "fsdp", replicated); other dims replicated."""
    if len(shape) == 0:
        return P()
    return logical_to_spec(("batch",) + (None,) * (len(shape) - 1), shape, mesh)


def batch_shardings(batch: Any, mesh: MeshLike) -> Any:
    """Shardings of a pytree whose leaves all have a leading batch dim (``Batch``, activations)."""
    return jax.tree.map(lambda x: NamedSharding(mesh, batch_spec(_shape(x), mesh)), batch)


def cache_spec(shape: Sequence[int], mesh: MeshLike) -> P:
    """KV-cache leaf [B, Hkv, ...] (k, v: [B, Hkv, P, S, D]; centroid/kmin/kmax: [B, Hkv, P, D])."""
    if len(shape) < 2:
        raise ValueError(f"a KV-cache array is [B, Hkv, ...], got shape {tuple(shape)}")
    return logical_to_spec(("batch", "kv_heads") + (None,) * (len(shape) - 2), shape, mesh)


def cache_shardings(caches: Any, mesh: MeshLike) -> Any:
    """Shardings of a tuple of ``PagedKVCache`` (None leaves, e.g. absent kmin/kmax, stay None)."""
    return jax.tree.map(lambda x: NamedSharding(mesh, cache_spec(_shape(x), mesh)), caches)


# ---- placing data -----------------------------------------------------------------------

def _put(x: Any, sharding: NamedSharding) -> jax.Array:
    """Place one leaf; numpy / single-process data onto a multi-process mesh via per-shard callbacks."""
    if isinstance(x, jax.Array) and (sharding.is_fully_addressable or not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)  # every process holds the same global value (SPMD): keep only local shards
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_to(tree: Any, shardings: Any) -> Any:
    """``tree`` placed leaf by leaf on ``shardings`` (a matching pytree of NamedShardings)."""
    return jax.tree.map(_put, tree, shardings)


def shard_params(params: Any, mesh: Mesh, config: Any = None) -> Any:
    """Params (or a LoRA pytree) placed on ``mesh`` by the rules above."""
    return shard_to(params, param_shardings(params, mesh, config))


def shard_train_state(state: Any, mesh: Mesh, config: Any = None) -> Any:
    """``TrainState`` / ``LoraState`` placed on ``mesh`` (optimizer moments like their params)."""
    return shard_to(state, train_state_shardings(state, mesh, config))


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """A ``Batch`` (or any pytree of [B, ...] arrays) split over rows on ("data", "fsdp")."""
    return shard_to(batch, batch_shardings(batch, mesh))


def shard_caches(caches: Any, mesh: Mesh) -> Any:
    """Paged KV caches split over rows and KV heads."""
    return shard_to(caches, cache_shardings(caches, mesh))


def abstract_target(tree: Any, shardings: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves carrying ``shardings``: a checkpoint restore target.

    ``CheckpointManager.restore(target={"params": abstract_target(shapes, param_shardings(shapes, mesh))})``
    reads every shard straight onto its devices (no full copy on one device first).
    """
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(_shape(x), x.dtype, sharding=s), tree, shardings)


def describe(tree: Any, shardings: Any = None) -> list[str]:
    """'path shape spec' lines (logs, docs): the specs of ``shardings`` or of the arrays' own shardings."""
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding, tree)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    specs = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
    return [f"{path_str(p)} {tuple(_shape(x))} {getattr(s, 'spec', s)}" for (p, x), s in zip(leaves, specs)]
