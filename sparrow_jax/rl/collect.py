"""One step's rollout batch: sample, score, shape rewards (DAPO), filter groups, length stats.

The loop passes a ``sample(i)`` callable (round ``i`` of fresh prompts -> rollout, task
rewards, reward-scoring counts); everything else here is host-side numpy, no model.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from sparrow_jax.rl.dynamic_sampling import Round, fill_with_signal
from sparrow_jax.rl.long_cot import overlong_penalty, response_length_metrics, truncated
from sparrow_jax.rollout.sampler import Rollout

SampleFn = Callable[[int], tuple[Rollout, np.ndarray, dict[str, float]]]


@dataclasses.dataclass(frozen=True)
class CollectOptions:
    num_groups: int  # prompts per step
    group_size: int  # completions per prompt
    max_new_tokens: int  # completion cap
    overlong_buffer: int = 0  # DAPO soft overlong penalty ramp (0: off)
    overlong_penalty: float = 1.0  # penalty at the cap
    mask_truncated: bool = False  # truncated completions leave the loss
    dynamic_sampling: bool = False  # keep groups whose rewards differ, sample more
    dynamic_sampling_rounds: int = 3  # extra rounds allowed


def completion_lens(rollout: Rollout) -> np.ndarray:
    return np.asarray(rollout.completion_mask).sum(axis=1)


def take_rollout_rows(picks: Sequence[tuple[Rollout, np.ndarray]]) -> Rollout:
    """Rows ``idx`` of each rollout, concatenated; [B, T] arrays zero-padded to the widest T,
    numeric stats summed."""
    width = max(r.tokens.shape[1] for r, _ in picks)

    def take(x, idx):
        x = np.asarray(x)[idx]
        return np.pad(x, [(0, 0), (0, width - x.shape[1])]) if x.ndim == 2 else x

    fields = {f: np.concatenate([take(getattr(r, f), idx) for r, idx in picks])
              for f in Rollout._fields if f != "stats"}
    stats = {k: sum(r.stats[k] for r, _ in picks) for k in picks[0][0].stats}
    return Rollout(**fields, stats=stats)


def collect_batch(sample: SampleFn, opts: CollectOptions) -> tuple[Rollout, np.ndarray, np.ndarray, dict[str, float]]:
    """-> (rollout [B rows], rewards [B] (shaped), rows_in_loss [B] bool, metrics)

    ``rows_in_loss`` is False for truncated completions when ``mask_truncated``. Metrics:
    ``reward/timeouts|errors`` (summed over rounds), ``response_length/*``,
    ``dynamic_sampling/*`` when on.
    """
    counts: dict[str, float] = {}

    def one_round(i: int) -> Round:
        rollout, rewards, reward_metrics = sample(i)
        for k, v in reward_metrics.items():
            counts[k] = counts.get(k, 0.0) + v
        penalty = overlong_penalty(completion_lens(rollout), opts.max_new_tokens, opts.overlong_buffer,
                                   opts.overlong_penalty)
        return Round(rollout, np.asarray(rewards, np.float32) + penalty)

    metrics: dict[str, float] = {}
    if opts.dynamic_sampling:
        rollout, rewards, metrics = fill_with_signal(one_round, opts.num_groups, opts.group_size,
                                                     opts.dynamic_sampling_rounds, take_rollout_rows)
    else:
        rollout, rewards = one_round(0)
    lens = completion_lens(rollout)
    cut = truncated(lens, rollout.finished, opts.max_new_tokens)
    rows_in_loss = ~cut if opts.mask_truncated else np.ones_like(cut)
    metrics.update(counts)
    metrics.update(response_length_metrics(lens, opts.max_new_tokens))
    return rollout, rewards, rows_in_loss, metrics
