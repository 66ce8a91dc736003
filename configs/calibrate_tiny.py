"""Calibration of the warmed-up tiny model on pointer chasing: a couple of minutes on 2 CPU cores
once the warm-up is cached (the first run trains it: a few minutes more).

    python -m experiments.calibrate --config configs/calibrate_tiny.py
    python -m experiments.warmup --config configs/calibrate_tiny.py      # the warm-up alone
"""
from ml_collections import ConfigDict

from configs.common import base_config, warmup_config


def get_config():
    c = base_config()
    c.workdir = "runs/calibrate_tiny"
    c.model.source = "warmup"
    c.model.tiny = ConfigDict(dict(  # vocabulary: the builtin tokenizer's (111)
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=256, tie_word_embeddings=True, rope_theta=10000.0,
        max_position_embeddings=8192))
    # Warm-up SFT settings (sparrow_jax.sft.settings.WarmupSettings); the RL trainer reads them too.
    # prompt_weight 0.3: the records' NLL also trains the copy (induction) heads; measured at 600
    # steps, greedy accuracy at 64/128/256 tokens 42/36/16% with it vs 16/22/9% without.
    c.model.warmup = warmup_config()
    c.model.warmup.update(dict(steps=800, batch_size=32, lr=3e-3, min_context=32, max_train_context=128,
                               train_hops=3, queries_per_example=4, prompt_weight=0.3, seed=0,
                               cache_dir="runs/cache"))
    c.task.context_tokens = 256  # the warm-up trains on <= 128 and generalises (accuracy table)
    c.task.hops = 1
    c.schedule.page_size = 16
    c.schedule.bin_width = 64
    c.schedule.dense_layers = (0,)  # the retrieval (induction) layer 1 is the sparse one
    c.rollout.max_new_tokens = 40
    c.rollout.temperature = 1.0
    c.calibration.tau = 0.86
    c.calibration.budgets = (0, 1, 2, 4, 8, 16)
    c.calibration.num_prompts = 96  # context lengths spread over 32..256 tokens
    c.calibration.samples_per_prompt = 2
    c.calibration.validate_prompts = 64
    c.calibration.min_count = 40  # completion tokens a (budget, bin) cell needs to count
    return c
