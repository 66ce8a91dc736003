"""DAPO dynamic sampling: keep only prompt groups whose rewards differ, sample more until full.

A group whose ``group_size`` rewards are all equal has zero GRPO advantage on every row: it
costs a forward/backward pass and carries no signal. :func:`fill_with_signal` draws rounds
of groups until ``num_groups`` informative ones are collected or ``max_extra_rounds`` extra
rounds are spent; a batch still short is topped up with zero-variance groups so the train
step keeps one shape (and one compiled program).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np


def zero_variance_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """[N] group-major rewards -> [N / group_size] bool, True where every reward of the group is equal."""
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or r.size % group_size:
        raise ValueError(f"zero_variance_groups: rewards must be [N] with N a multiple of group_size={group_size}, "
                         f"got shape {r.shape}")
    g = r.reshape(-1, group_size)
    return np.all(g == g[:, :1], axis=1)


class Round(NamedTuple):
    """One sampling round: ``rows`` (any per-row payload, e.g. a rollout) and its rewards [N]."""

    rows: object
    rewards: np.ndarray


def fill_with_signal(sample_round: Callable[[int], Round], num_groups: int, group_size: int,
                     max_extra_rounds: int, take_rows: Callable[[Sequence[tuple[object, np.ndarray]]], object]
                     ) -> tuple[object, np.ndarray, dict[str, float]]:
    """Collect ``num_groups`` groups, informative ones first.

    Args:
      sample_round: ``i -> Round`` draws round ``i`` (``num_groups`` fresh prompts x group_size).
      max_extra_rounds: rounds allowed after the first.
      take_rows: ``[(rows, row_indices), ...] -> rows`` concatenates the chosen rows of rounds.

    Returns:
      (rows, rewards [num_groups * group_size], metrics): ``dynamic_sampling/rounds``,
      ``dynamic_sampling/zero_var_share_before`` (over the first round's groups, what the batch
      would have been without filtering) and ``dynamic_sampling/zero_var_share_after`` (in the
      returned batch).
    """
    rounds: list[Round] = []
    informative: list[tuple[int, int]] = []  # (round, group)
    flat: list[tuple[int, int]] = []
    for i in range(max_extra_rounds + 1):
        rounds.append(sample_round(i))
        zero = zero_variance_groups(rounds[-1].rewards, group_size)
        informative += [(i, int(g)) for g in np.flatnonzero(~zero)]
        flat += [(i, int(g)) for g in np.flatnonzero(zero)]
        if len(informative) >= num_groups:
            break
    chosen = sorted((informative + flat)[:num_groups])  # round order, then group order
    picks = []
    for i, rnd in enumerate(rounds):
        groups = [g for r, g in chosen if r == i]
        if groups:
            picks.append((rnd.rows, (np.asarray(groups)[:, None] * group_size + np.arange(group_size)).reshape(-1)))
    rewards = np.concatenate([rounds[i].rewards[idx] for i, (_, idx) in
                              zip(sorted({r for r, _ in chosen}), picks)])
    metrics = {"dynamic_sampling/rounds": float(len(rounds)),
               "dynamic_sampling/zero_var_share_before": float(
                   zero_variance_groups(rounds[0].rewards, group_size).mean()),
               "dynamic_sampling/zero_var_share_after": float(zero_variance_groups(rewards, group_size).mean())}
    return take_rows(picks), rewards, metrics
