"""tunix's sampler (google-tunix, optional extra ``peers``) on our random Qwen3 weights, for the benchmarks.

Weights go through our ``save_hf`` directory into tunix's own Qwen3 loader. What differs from
our samplers, as far as its API allows:

* its ``Sampler`` takes strings only: prompts are written as space-separated token ids and
  read back by a tokenizer that splits them (no BOS);
* it masks every position whose token equals the pad id (0 here), also generated ones: the
  prompts avoid id 0, a greedy draw of 0 would differ from our samplers;
* its Qwen3 attention applies RoPE with the default base 1e6 whatever ``rope_theta`` says:
  use a model with ``rope_theta == 1e6``;
* no stop at a per-request length: a batch runs until its longest request (as our
  fixed-batch sampler), eos is an id outside the vocabulary so nothing stops early;
* the whole cache (``cache_size``) is attended at every step.
"""
from __future__ import annotations

import tempfile
import time
from typing import Sequence

import numpy as np

from sparrow_jax.models import Qwen3Config, save_hf

TUNIX_ROPE_THETA = 1_000_000.0


class IdTokenizer:
    """Space-separated token ids <-> lists of ints: the string interface tunix's Sampler wants."""

    def __init__(self, vocab_size: int, pad_id: int = 0):
        self.vocab_size, self._pad = vocab_size, pad_id

    def encode(self, text: str, **_) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, **_) -> str:
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> int:
        return 0  # falsy: tunix adds no BOS

    def eos_id(self) -> int:
        return self.vocab_size  # never sampled

    def pad_id(self) -> int:
        return self._pad


class TunixPeer:
    """A tunix ``Sampler`` over ``params`` (our pytree) for prompts of one length, greedy."""

    def __init__(self, config: Qwen3Config, params, batch: int, cache_size: int):
        try:
            from tunix.generate import sampler as tunix_sampler
            from tunix.models.qwen3 import model as tunix_model
            from tunix.models.qwen3 import params as tunix_params
        except ImportError as exc:  # optional extra
            raise ImportError("the tunix peer needs google-tunix: pip install 'sparrow-jax[peers]'") from exc
        if config.rope_theta != TUNIX_ROPE_THETA:
            raise ValueError(f"tunix's Qwen3 uses rope_theta {TUNIX_ROPE_THETA:g}; the model has {config.rope_theta:g}")
        cfg = tunix_model.ModelConfig(
            num_layers=config.num_hidden_layers, vocab_size=config.vocab_size, embed_dim=config.hidden_size,
            hidden_dim=config.intermediate_size, num_heads=config.num_attention_heads, head_dim=config.head_dim,
            num_kv_heads=config.num_key_value_heads, rope_theta=int(config.rope_theta), norm_eps=config.rms_norm_eps,
            use_tied_embedding=config.tie_word_embeddings)
        with tempfile.TemporaryDirectory() as d:
            save_hf(d, config, params)
            model = tunix_params.create_model_from_safe_tensors(d, cfg)
        self.tokenizer = IdTokenizer(config.vocab_size)
        self.sampler = tunix_sampler.Sampler(model, self.tokenizer, tunix_sampler.CacheConfig(
            cache_size=cache_size, num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim))
        self.batch = batch

    def generate(self, prompts: Sequence[Sequence[int]], steps: int) -> np.ndarray:
        """Greedy ``steps`` new tokens per prompt -> int [B, steps]."""
        out = self.sampler([self.tokenizer.decode(p) for p in prompts], max_generation_steps=steps,
                           max_prompt_length=max(len(p) for p in prompts), temperature=0.0,
                           eos_tokens=[self.tokenizer.eos_id()], pad_output=True)
        return np.asarray([self.tokenizer.encode(t)[:steps] for t in out.text])

    def timing(self, prompts: Sequence[Sequence[int]], short: int, long: int) -> tuple[float, float]:
        """(prefill seconds, seconds per decode step) from warm runs of ``short`` and ``long`` steps.

        tunix runs prefill and decode in one call; its decode attends the whole cache at every
        step, so a call costs prefill + steps x step time, and two lengths separate the two.
        """
        times = {}
        for steps in (short, long):
            self.generate(prompts, steps)  # compile (the token buffer's shape depends on steps)
            start = time.perf_counter()
            self.generate(prompts, steps)
            times[steps] = time.perf_counter() - start
        step_s = (times[long] - times[short]) / (long - short)
        return max(times[short] - short * step_s, 0.0), step_s
