"""Rollout engine: sparsity schedules, the dense / block-sparse sampler and the continuous-batching engine."""
from sparrow_jax.rollout.engine import generate_continuous
from sparrow_jax.rollout.sampler import Rollout, SamplingParams, generate, request_keys, sample_logits
from sparrow_jax.rollout.schedule import Segment, SparsitySchedule, available_presets
