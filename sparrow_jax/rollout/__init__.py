"""Rollout engine: sparsity schedules and the dense / block-sparse sampler."""
from sparrow_jax.rollout.sampler import Rollout, SamplingParams, generate, sample_logits
from sparrow_jax.rollout.schedule import Segment, SparsitySchedule, available_presets
