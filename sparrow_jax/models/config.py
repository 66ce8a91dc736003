"""Qwen3 model configuration: built from a Hugging Face ``config.json`` or a named preset."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)

# Public HF config.json facts for the Qwen3 thinking family (see shared/reference/qwen3_configs.json).
_QWEN3_COMMON = dict(vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                     max_position_embeddings=40960, head_dim=128, num_key_value_heads=8)
_PRESETS: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       intermediate_size=3072, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       intermediate_size=6144, tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     intermediate_size=9728, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     intermediate_size=12288, tie_word_embeddings=False),
    "Qwen3-14B": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
                      intermediate_size=17408, tie_word_embeddings=False),
}

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Architecture of a Qwen3 causal LM (frozen, hashable: usable as a jit static argument).

    ``param_dtype`` is the storage dtype of weights; ``dtype`` the compute dtype of
    activations. Attention softmax, norms and logits are always computed in float32.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = False
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"Qwen3Config.{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen3Config.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"Qwen3Config.{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}")

    @property
    def gqa_ratio(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def compute_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def weight_dtype(self):
        return _DTYPES[self.param_dtype]

    def num_params(self) -> int:
        """Parameter count (embeddings included; the LM head counted once when tied)."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        attn = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * d
        mlp = 3 * h * i
        layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embed + h

    def replace(self, **kw) -> "Qwen3Config":
        return dataclasses.replace(self, **kw)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides) -> "Qwen3Config":
        """A published Qwen3 size, e.g. ``Qwen3Config.preset("Qwen3-4B", dtype="bfloat16")``."""
        if name not in _PRESETS:
            raise ValueError(f"unknown Qwen3 preset {name!r}; known: {sorted(_PRESETS)}")
        return cls(**{**_QWEN3_COMMON, **_PRESETS[name], **overrides})

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> "Qwen3Config":
        archs = hf.get("architectures") or []
        if hf.get("model_type") != "qwen3" and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(
                f"unsupported architecture: model_type={hf.get('model_type')!r}, architectures={archs}; "
                f"sparrow-jax supports {SUPPORTED_ARCHITECTURES}")
        if hf.get("attention_bias", False):
            raise ValueError("unsupported config: attention_bias=true (Qwen3 has no attention bias)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported config: hidden_act={hf.get('hidden_act')!r} (expected 'silu')")
        rope_scaling = hf.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
            raise ValueError(f"unsupported config: rope_scaling={rope_scaling} (only default RoPE)")
        heads = hf["num_attention_heads"]
        theta = hf.get("rope_theta")
        if theta is None:  # transformers >= 5 nests it under rope_parameters
            theta = (hf.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
        kw = dict(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_theta=float(theta), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike, **overrides) -> "Qwen3Config":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
        with open(cfg_path) as f:
            return cls.from_hf_dict(json.load(f), **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "tie_word_embeddings": self.tie_word_embeddings, "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "torch_dtype": self.param_dtype,
        }


def tiny_config(**overrides) -> Qwen3Config:
    """A small test model: GQA ratio 2, head_dim != hidden/heads, untied embeddings."""
    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, intermediate_size=128,
              tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=4096)
    kw.update(overrides)
    return Qwen3Config(**kw)
