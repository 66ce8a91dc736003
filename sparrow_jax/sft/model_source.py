"""The run's model from its config's ``model.source``: a fresh tiny model, a Hugging Face
checkpoint, or the checkpoint of the SFT warm-up (trained and cached on first use)."""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from sparrow_jax.models import Qwen3Config, init_params, load_hf


def build_model(cfg: ConfigDict, tokenizer) -> tuple[Qwen3Config, Any]:
    """(model config, params) for ``cfg.model.source`` tiny / hf / warmup; a tiny model's
    vocabulary is the tokenizer's, its params drawn with ``cfg.seed``."""
    m = cfg.model
    if m.source == "hf":
        return _load_hf(m)
    if m.source == "warmup":
        from sparrow_jax.sft.warmup import warmup_model  # deferred: trains on first use
        path = warmup_model(m, cfg.task)
        return _load_hf(m, path)
    tiny = dict(m.tiny.to_dict(), vocab_size=tokenizer.vocab_size)  # the model emits only known ids
    config = Qwen3Config(**tiny, dtype=m.dtype, param_dtype=m.param_dtype)
    return config, jax.tree.map(lambda x: x.astype(config.weight_dtype), init_params(config, cfg.seed))


def _load_hf(m: ConfigDict, path: Optional[str] = None):
    config, params = load_hf(path or m.hf_dir, dtype=jnp.dtype(m.param_dtype))
    return config.replace(dtype=m.dtype), params
