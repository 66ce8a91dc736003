"""The run's model from its ``model.source``: a fresh tiny model, a Hugging Face checkpoint,
or the checkpoint of the SFT warm-up (trained and cached on first use)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from sparrow_jax.models import Qwen3Config, init_params, load_hf

if TYPE_CHECKING:
    from sparrow_jax.run.specs import ModelSpec, TaskSpec


def build_model(model: ModelSpec, task: TaskSpec, tokenizer, seed: int) -> tuple[Qwen3Config, Any]:
    """(model config, params) for ``model.source`` tiny / hf / warmup; a tiny model's
    vocabulary is the tokenizer's, its params drawn with ``seed``."""
    if model.source == "hf":
        return _load_hf(model, model.hf_dir)
    if model.source == "warmup":
        from sparrow_jax.sft.warmup import warmup_model  # deferred: trains on first use
        return _load_hf(model, warmup_model(model, task))
    tiny = dict(model.tiny, vocab_size=tokenizer.vocab_size)  # the model emits only known ids
    config = Qwen3Config(**tiny, dtype=model.dtype, param_dtype=model.param_dtype)
    return config, jax.tree.map(lambda x: x.astype(config.weight_dtype), init_params(config, seed))


def _load_hf(model: ModelSpec, path: str) -> tuple[Qwen3Config, Any]:
    config, params = load_hf(path, dtype=jnp.dtype(model.param_dtype))
    return config.replace(dtype=model.dtype), params
