"""Qwen3 policy model: config, NNX modules, pure forward functions, HF checkpoint I/O."""
from sparrow_jax.models.config import Qwen3Config, tiny_config
from sparrow_jax.models.forward import (decode_step, dense_hidden, dense_logits, init_caches, prefill,
                                        sparse_hidden, unembedding)
from sparrow_jax.models.qwen3 import Qwen3, bind, init_params, param_shapes
from sparrow_jax.models.hf_io import CheckpointError, load_hf, save_hf
from sparrow_jax.models.scoring import chunked_over_sequence, shift_to_next_token, token_logprobs
from sparrow_jax.models.lora import LoraConfig, init_lora, load_lora, lora_param_count, merge_lora, save_lora, with_lora
