"""Supervised fine-tuning: the warm-up that teaches a tiny model a synthetic task before RL
(:func:`sparrow_jax.sft.warmup.warmup_model`). Sits above data, models and rollout."""
