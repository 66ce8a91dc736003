"""LoRA adapters for the sparse actor, as a pure pytree transform (DistillSparse, notes §7).

The adapter pytree ``lora`` mirrors the targeted kernels of a Qwen3 ``params`` pytree::

    lora["layers"][i]["self_attn"]["q_proj"] = {"a": [in, r], "b": [r, out]}   (float32)
    lora["layers"][i]["mlp"]["down_proj"]    = {"a": [in, r], "b": [r, out]}

:func:`with_lora` returns effective params whose targeted kernels are
``kernel + (alpha / rank) * a @ b`` (computed in float32, cast back to the kernel dtype);
every other leaf is passed through as the same object. ``b`` starts at zero, so the
sparse actor starts exactly equal to the base policy.

**Only the sparse actor uses LoRA.** The dense policy (PPO update, dense log-probs, the
KL target) always runs on the plain ``params``; ``with_lora`` is applied when building
the sampler's weights and the sparse scorer's weights. To update ``lora`` with ``params``
frozen, differentiate ``with_lora(jax.lax.stop_gradient(params), lora, cfg)``.

Merging materialises one dense delta per targeted kernel (memory of one extra copy of
those kernels while it lives); for rank-8 adapters this is cheaper to run than the
factored ``x @ a @ b`` at every matmul and keeps the model code free of LoRA.

Adapter checkpoints use a PEFT-like layout: ``adapter_config.json`` and
``adapter_model.safetensors`` with tensors
``base_model.model.model.layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`` of shape
[r, in] and ``...lora_B.weight`` of shape [out, r] (PyTorch's [out, in] convention, so
ours are transposed on save and load; exact).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from sparrow_jax.models.hf_io import CheckpointError
from sparrow_jax.models.qwen3 import Params

Lora = dict[str, Any]

# Targetable linear layers and the block that holds each of them.
BLOCK_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
            "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ALL_TARGETS = tuple(BLOCK_OF)
INITS = ("kaiming_uniform", "gaussian")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers"
_NAME_RE = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA hyper-parameters (frozen, hashable: usable as a jit static argument).

    rank: r of the factors; alpha: scale numerator (delta = alpha / rank * a @ b);
    targets: names of the linear layers adapted in every decoder layer;
    init: "kaiming_uniform" (PEFT's default: a ~ U(-1/sqrt(in), 1/sqrt(in))) or
    "gaussian" (a ~ N(0, (1/r)^2)); b is always zero.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ALL_TARGETS
    init: str = "kaiming_uniform"

    def __post_init__(self):
        if isinstance(self.targets, str):
            raise ValueError(f"LoraConfig.targets must be a sequence of names, got the string {self.targets!r}")
        targets = tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, np.integer)) or self.rank <= 0:
            raise ValueError(f"LoraConfig.rank must be a positive int, got {self.rank!r}")
        object.__setattr__(self, "rank", int(self.rank))
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoraConfig.alpha must be a positive finite number, got {self.alpha!r}")
        object.__setattr__(self, "alpha", float(self.alpha))
        if not targets:
            raise ValueError(f"LoraConfig.targets must not be empty; choose from {list(ALL_TARGETS)}")
        unknown = [t for t in targets if t not in BLOCK_OF]
        if unknown:
            raise ValueError(f"LoraConfig.targets has unknown name(s) {unknown}; known: {list(ALL_TARGETS)}")
        dup = sorted({t for t in targets if targets.count(t) > 1})
        if dup:
            raise ValueError(f"LoraConfig.targets repeats {dup}")
        if self.init not in INITS:
            raise ValueError(f"LoraConfig.init must be one of {list(INITS)}, got {self.init!r}")

    @property
    def scale(self) -> float:
        """alpha / rank: the factor applied to a @ b."""
        return self.alpha / self.rank


def _layer_ids(params: Params) -> list:
    if "layers" not in params:
        raise ValueError("params has no 'layers' entry (expected a Qwen3 params pytree)")
    return sorted(params["layers"])


def _kernel(params: Params, i, name: str) -> jax.Array:
    try:
        return params["layers"][i][BLOCK_OF[name]][name]["kernel"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"params has no layers.{i}.{BLOCK_OF[name]}.{name}.kernel") from None


def init_lora(params: Params, lora_cfg: LoraConfig, key: jax.Array) -> Lora:
    """Fresh adapters for every targeted kernel of ``params`` (b = 0: no change at start).

    For a kernel [in, out]: ``a`` float32 [in, r] (see :class:`LoraConfig` ``init``),
    ``b`` float32 [r, out] zeros. Each (layer, target) gets its own folded key.
    """
    r = lora_cfg.rank
    lora: Lora = {"layers": {}}
    for li, i in enumerate(_layer_ids(params)):
        layer: dict[str, dict] = {}
        for ti, name in enumerate(lora_cfg.targets):
            d_in, d_out = _kernel(params, i, name).shape
            k = jax.random.fold_in(jax.random.fold_in(key, li), ti)
            if lora_cfg.init == "kaiming_uniform":
                # torch kaiming_uniform_(a=sqrt(5)) on PEFT's lora_A [r, in]: bound 1/sqrt(in).
                bound = 1.0 / math.sqrt(d_in)
                a = jax.random.uniform(k, (d_in, r), jnp.float32, -bound, bound)
            else:
                a = jax.random.normal(k, (d_in, r), jnp.float32) / r
            layer.setdefault(BLOCK_OF[name], {})[name] = {"a": a, "b": jnp.zeros((r, d_out), jnp.float32)}
        lora["layers"][i] = layer
    return lora


def _check_structure(params: Params, lora: Lora, lora_cfg: LoraConfig) -> None:
    """Static (shape-only) checks: runs at trace time under jit."""
    if not isinstance(lora, dict) or "layers" not in lora:
        raise ValueError("lora must be a dict with a 'layers' entry (from init_lora / load_lora)")
    p_ids, l_ids = _layer_ids(params), sorted(lora["layers"])
    if p_ids != l_ids:
        raise ValueError(f"lora has layers {l_ids}, params has layers {p_ids}")
    wanted = set(lora_cfg.targets)
    for i in l_ids:
        got = {n for blk in lora["layers"][i].values() for n in blk}
        if got != wanted:
            raise ValueError(f"lora layers.{i} adapts {sorted(got)}, LoraConfig.targets is {sorted(wanted)}")
        for name in lora_cfg.targets:
            d_in, d_out = _kernel(params, i, name).shape
            ab = lora["layers"][i][BLOCK_OF[name]][name]
            where = f"lora layers.{i}.{BLOCK_OF[name]}.{name}"
            for part, want in (("a", (d_in, lora_cfg.rank)), ("b", (lora_cfg.rank, d_out))):
                if part not in ab:
                    raise ValueError(f"{where} has no '{part}'")
                if tuple(ab[part].shape) != want:
                    raise ValueError(f"{where}.{part}: expected shape {want}, found {tuple(ab[part].shape)}")


def with_lora(params: Params, lora: Lora, lora_cfg: LoraConfig) -> Params:
    """Effective params of the sparse actor: targeted kernels + (alpha/rank) * a @ b.

    params: Qwen3 params pytree (kernels [in, out], any float dtype); lora: from
    :func:`init_lora` / :func:`load_lora`. The delta is computed in float32 at highest
    matmul precision, added to the float32 kernel and cast back to the kernel dtype, so
    ``b == 0`` gives back the kernels exactly (bit for bit, up to the sign of zero entries). Untargeted leaves are the same
    objects (no copy); containers are new dicts, ``params`` is not mutated. Jittable
    (``lora_cfg`` static) and differentiable w.r.t. both ``params`` and ``lora``.

    Use only for the sparse actor (sampler / sparse scorer); the dense policy runs on
    ``params`` itself.
    """
    _check_structure(params, lora, lora_cfg)
    out = dict(params)
    out["layers"] = dict(params["layers"])
    for i, lora_layer in lora["layers"].items():
        layer = out["layers"][i] = dict(params["layers"][i])
        for block, adapters in lora_layer.items():
            layer[block] = dict(layer[block])
            for name, ab in adapters.items():
                w = layer[block][name]["kernel"]
                delta = jnp.matmul(ab["a"].astype(jnp.float32), ab["b"].astype(jnp.float32),
                                   precision=jax.lax.Precision.HIGHEST)
                merged = (w.astype(jnp.float32) + lora_cfg.scale * delta).astype(w.dtype)
                layer[block][name] = {**layer[block][name], "kernel": merged}
    return out


merge_lora = with_lora  # export: the merged kernels are a plain Qwen3 checkpoint (save_hf)


def lora_param_count(lora: Lora) -> int:
    """Number of trainable adapter scalars (sum of every a and b size)."""
    return int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(lora)))


# ---- adapter-only checkpoint (PEFT-like) --------------------------------------------------

def _tensor_name(i, block: str, name: str, part: str) -> str:
    return f"{_PREFIX}.{i}.{block}.{name}.lora_{part}.weight"


def save_lora(path: str | os.PathLike, lora: Lora, lora_cfg: LoraConfig,
              base_model_name_or_path: Optional[str] = None) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` under ``path``.

    A [in, r] is stored as PEFT's lora_A [r, in]; B [r, out] as lora_B [out, r]; dtype kept.
    Files are written to a temporary name and renamed (no half-written file under a real name).
    """
    path = os.fspath(path)
    if not isinstance(lora, dict) or "layers" not in lora:
        raise ValueError("lora must be a dict with a 'layers' entry (from init_lora / load_lora)")
    tensors: dict[str, np.ndarray] = {}
    for i in sorted(lora["layers"]):
        for name in lora_cfg.targets:
            block = BLOCK_OF[name]
            try:
                ab = lora["layers"][i][block][name]
            except KeyError:
                raise ValueError(f"lora layers.{i}.{block}.{name} is missing (LoraConfig.targets has {name})") from None
            for part, key in (("A", "a"), ("B", "b")):
                x = np.asarray(jax.device_get(ab[key]))
                want_r_axis = 1 if key == "a" else 0
                if x.ndim != 2 or x.shape[want_r_axis] != lora_cfg.rank:
                    raise ValueError(f"lora layers.{i}.{block}.{name}.{key}: shape {x.shape} does not have "
                                     f"rank {lora_cfg.rank} on axis {want_r_axis}")
                tensors[_tensor_name(i, block, name, part)] = np.ascontiguousarray(x.T)
    os.makedirs(path, exist_ok=True)
    cfg = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha, "lora_dropout": 0.0,
        "target_modules": list(lora_cfg.targets), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True,
        "init_lora_weights": True if lora_cfg.init == "kaiming_uniform" else "gaussian",
    }
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    save_file(tensors, weights + ".tmp", metadata={"format": "pt"})
    os.replace(weights + ".tmp", weights)
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    with open(cfg_path + ".tmp", "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(cfg_path + ".tmp", cfg_path)


def _config_from_json(cfg: dict, where: str) -> LoraConfig:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported (expected 'LORA')")
    for flag in ("fan_in_fan_out", "use_rslora", "use_dora"):
        if cfg.get(flag):
            raise CheckpointError(f"{where}: {flag}=true is not supported")
    if cfg.get("bias", "none") != "none":
        raise CheckpointError(f"{where}: bias={cfg.get('bias')!r} is not supported (expected 'none')")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise CheckpointError(f"{where}: per-module rank_pattern / alpha_pattern is not supported")
    for field in ("r", "lora_alpha", "target_modules"):
        if field not in cfg:
            raise CheckpointError(f"{where}: missing field {field!r}")
    targets = cfg["target_modules"]
    if targets == "all-linear":
        targets = ALL_TARGETS
    elif isinstance(targets, str):
        raise CheckpointError(f"{where}: target_modules={targets!r} (a regex) is not supported; expected a list "
                              f"of names from {list(ALL_TARGETS)}")
    init = cfg.get("init_lora_weights", True)
    # Keep target order canonical so the config matches the tensors whatever order the file lists.
    targets = tuple(t for t in ALL_TARGETS if t in targets) + tuple(t for t in targets if t not in BLOCK_OF)
    try:
        return LoraConfig(rank=cfg["r"], alpha=cfg["lora_alpha"], targets=targets,
                          init="gaussian" if init == "gaussian" else "kaiming_uniform")
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None


def load_lora(path: str | os.PathLike, params: Optional[Params] = None) -> tuple[Lora, LoraConfig]:
    """Read an adapter written by :func:`save_lora` (or PEFT with the same conventions).

    Returns (lora, lora_cfg) with arrays in the stored dtype, exactly as saved. Layers
    must be 0..L-1, each with an A and B for every target of ``target_modules``. With
    ``params`` the layer count and every shape are checked against its kernels. Raises
    FileNotFoundError naming a missing file and :class:`CheckpointError` naming the tensor,
    expected and found shape for any mismatch.
    """
    path = os.fspath(path)
    cfg_path, weights = os.path.join(path, ADAPTER_CONFIG), os.path.join(path, ADAPTER_WEIGHTS)
    for f in (cfg_path, weights):
        if not os.path.exists(f):
            raise FileNotFoundError(f"adapter checkpoint {path} has no {os.path.basename(f)}")
    with open(cfg_path) as f:
        lora_cfg = _config_from_json(json.load(f), cfg_path)
    r = lora_cfg.rank
    found: dict[tuple, np.ndarray] = {}
    with safe_open(weights, framework="numpy") as f:
        for name in f.keys():
            m = _NAME_RE.match(name)
            if not m or BLOCK_OF.get(m.group(3)) != m.group(2):
                raise CheckpointError(f"{weights}: unexpected tensor {name}")
            if m.group(3) not in lora_cfg.targets:
                raise CheckpointError(f"{weights}: tensor {name} adapts {m.group(3)}, which is not in "
                                      f"target_modules {list(lora_cfg.targets)}")
            found[(int(m.group(1)), m.group(3), m.group(4))] = f.get_tensor(name)
    n_layers = 1 + max((k[0] for k in found), default=-1)
    if params is not None:
        p_ids = _layer_ids(params)
        if p_ids != list(range(len(p_ids))):
            raise ValueError(f"params layers must be 0..L-1, got {p_ids}")
        if n_layers > len(p_ids):
            raise CheckpointError(f"{weights}: adapter has layer {n_layers - 1}, params has {len(p_ids)} layers")
        n_layers = len(p_ids)
    if n_layers == 0:
        raise CheckpointError(f"{weights}: no LoRA tensors")
    lora: Lora = {"layers": {}}
    for i in range(n_layers):
        layer: dict[str, dict] = {}
        for name in lora_cfg.targets:
            block = BLOCK_OF[name]
            if params is not None:
                d_in, d_out = _kernel(params, i, name).shape
                expect = {"A": (r, d_in), "B": (d_out, r)}
            for part in ("A", "B"):
                tname = _tensor_name(i, block, name, part)
                if (i, name, part) not in found:
                    raise CheckpointError(f"{weights}: missing tensor {tname}")
                x = found[(i, name, part)]
                r_axis = 0 if part == "A" else 1
                if x.ndim != 2 or x.shape[r_axis] != r:
                    raise CheckpointError(f"tensor {tname}: expected rank {r} on axis {r_axis} (r={r} in "
                                          f"{ADAPTER_CONFIG}), found shape {tuple(x.shape)}")
                if params is not None and tuple(x.shape) != expect[part]:
                    raise CheckpointError(f"tensor {tname}: expected shape {expect[part]}, found {tuple(x.shape)}")
            a, b = found[(i, name, "A")], found[(i, name, "B")]
            layer.setdefault(block, {})[name] = {"a": jnp.asarray(a.T), "b": jnp.asarray(b.T)}
        lora["layers"][i] = layer
    return lora, lora_cfg
