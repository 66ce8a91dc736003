"""Hugging Face checkpoint I/O: a local HF directory <-> (Qwen3Config, params pytree).

Reads ``model.safetensors`` or shards listed in ``model.safetensors.index.json``; writes
the same layout back (sharded past ``max_shard_bytes``). HF linear weights are [out, in];
ours are [in, out], so loading and saving transpose (exact). Every file is written to a
temporary name and renamed, so an interrupted save never leaves a half-written file
under a real name.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.flax import save_file

from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.qwen3 import Params, param_shapes

_LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
_LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


class CheckpointError(ValueError):
    """A checkpoint does not match the model: names the tensor, expected and found."""


def _name_map(config: Qwen3Config) -> Iterator[tuple[str, tuple, bool]]:
    """Yields (HF tensor name, path in params, transpose?) for every parameter."""
    yield "model.embed_tokens.weight", ("embed_tokens",), False
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}"
        for block, names in _LINEARS.items():
            for n in names:
                yield f"{pre}.{block}.{n}.weight", ("layers", i, block, n, "kernel"), True
        for n in ("q_norm", "k_norm"):
            yield f"{pre}.self_attn.{n}.weight", ("layers", i, "self_attn", n, "weight"), False
        for n in _LAYER_NORMS:
            yield f"{pre}.{n}.weight", ("layers", i, n, "weight"), False
    yield "model.norm.weight", ("norm", "weight"), False
    if not config.tie_word_embeddings:
        yield "lm_head.weight", ("lm_head", "kernel"), True


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _set(tree, path, value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _tensor_files(path: str) -> dict[str, str]:
    """HF tensor name -> file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        for fname in set(weight_map.values()):
            if not os.path.exists(os.path.join(path, fname)):
                raise CheckpointError(f"shard {fname} listed in {index} is missing")
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    if os.path.exists(single):
        with safe_open(single, framework="flax") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_hf(path: str | os.PathLike, dtype=jnp.float32, **config_overrides) -> tuple[Qwen3Config, Params]:
    """Load a local HF Qwen3 directory. Returns (config, params) with params cast to ``dtype``.

    Raises :class:`CheckpointError` naming the tensor for missing, unexpected or misshapen
    tensors. A tied checkpoint may carry a redundant ``lm_head.weight``; it is ignored.
    """
    path = os.fspath(path)
    dtype_name = jnp.dtype(dtype).name
    config = Qwen3Config.from_hf_dir(path, param_dtype=dtype_name, **config_overrides)
    files = _tensor_files(path)
    expected = param_shapes(config)
    wanted = {name: (p, t) for name, p, t in _name_map(config)}
    missing = sorted(set(wanted) - set(files))
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing tensor(s): {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    extra = sorted(set(files) - set(wanted) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    if extra:
        raise CheckpointError(f"checkpoint {path} has unexpected tensor(s): {', '.join(extra[:5])}")
    params: Params = {}
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    for fname, names in by_file.items():
        with safe_open(fname, framework="flax") as f:
            for name in names:
                p, transpose = wanted[name]
                x = f.get_tensor(name)
                x = x.T if transpose else x
                want = tuple(_get(expected, p).shape)
                if tuple(x.shape) != want:
                    hf_want = want[::-1] if transpose else want
                    raise CheckpointError(f"tensor {name}: expected shape {hf_want}, found {tuple(x.shape)[::-1] if transpose else tuple(x.shape)}")
                _set(params, p, jnp.asarray(x, dtype))
    return config, params


def save_hf(path: str | os.PathLike, config: Qwen3Config, params: Params,
            max_shard_bytes: int = 5 * 1024 ** 3) -> None:
    """Write ``config.json`` and safetensors (sharded with an index past ``max_shard_bytes``)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for name, p, transpose in _name_map(config):
        x = _get(params, p)
        tensors[name] = jnp.asarray(x.T if transpose else x)
    shards: list[dict[str, jax.Array]] = [{}]
    size = 0
    for name, x in tensors.items():
        nbytes = x.size * x.dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = x
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        _atomic(os.path.join(path, "model.safetensors"), lambda tmp: save_file(shards[0], tmp, metadata=meta))
        stale = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(stale):
            os.remove(stale)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _atomic(os.path.join(path, fname), lambda tmp, s=shard: save_file(s, tmp, metadata=meta))
            weight_map.update({n: fname for n in shard})
        total = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in tensors.values())
        _atomic_json(os.path.join(path, "model.safetensors.index.json"),
                     {"metadata": {"total_size": total}, "weight_map": weight_map})
    _atomic_json(os.path.join(path, "config.json"), config.to_hf_dict())


def _atomic(final: str, write) -> None:
    tmp = final + ".tmp"
    write(tmp)
    os.replace(tmp, final)


def _atomic_json(final: str, obj) -> None:
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
    _atomic(final, write)
