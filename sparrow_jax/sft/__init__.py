"""Supervised fine-tuning: the warm-up that teaches a tiny model a synthetic task before RL
(:func:`sparrow_jax.sft.warmup.warmup_model`; its parts by role are listed there) and the run's
model source. Sits above data, models and rollout."""
