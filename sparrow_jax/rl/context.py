"""What an RL run works with: :class:`RunContext`, built once by
:func:`sparrow_jax.run.context.build_run_context` from the run's specs.

Defined here and built there because of the layering (tests/test_layers.py): the RL loop
(:mod:`sparrow_jax.rl.trainer`) consumes the context and ``rl/`` may not import ``run/``; the
builder resolves the run's config into objects (tokenizer, model source, schedule files,
examples, engine), which is the entry layer's job. Imports: data, models and rollout types only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from sparrow_jax.data.registry import Task
from sparrow_jax.models import Qwen3Config
from sparrow_jax.rollout import SamplingParams, SparsitySchedule


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What a run works with, built once from its :class:`RunSpec`.

    schedule: the sparse actor's schedule (None: dense rollouts).
    sampling: the rollout's sampling parameters (stop ids from the tokenizer).
    impl / decode_progress: sparse-attention implementation and decode progress printing.
    engine: ``continuous`` (:func:`~sparrow_jax.rollout.engine.generate_continuous`) or ``fixed``
      (:func:`~sparrow_jax.rollout.sampler.generate`); both return the same ``Rollout``.
    """

    model_config: Qwen3Config
    params: Any
    tokenizer: Any
    task: Task
    schedule: Optional[SparsitySchedule]
    train_rows: list
    eval_rows: list
    sampling: SamplingParams
    impl: str = "auto"
    decode_progress: bool = False
    engine: str = "continuous"

    def encode(self, example: dict) -> list[int]:
        """Prompt token ids of a task example."""
        return self.tokenizer.encode(self.task.format_prompt(example, self.tokenizer))
