"""Loop-level guards around the train step: non-finite streaks, finite checkpoints."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


class NonFiniteUpdatesError(FloatingPointError):
    """Too many RL steps in a row had an update skipped for a non-finite loss or gradient."""


def nonfinite_streak(streak: int, skipped_updates: float, max_in_a_row: int) -> int:
    """Steps in a row with a skipped (non-finite) update, after this step; raises at ``max_in_a_row``.

    ``skipped_updates``: this step's ``actor/nonfinite_updates``. ``max_in_a_row == 0`` never stops.
    """
    streak = streak + 1 if skipped_updates > 0 else 0
    if max_in_a_row and streak >= max_in_a_row:
        raise NonFiniteUpdatesError(
            f"{streak} steps in a row had a non-finite loss or gradient (train.max_nonfinite_steps="
            f"{max_in_a_row}); the params hold the last finite update. Lower train.learning_rate or check "
            "the rewards / log-probs of the batch")
    return streak


def assert_finite(tree: Any, what: str) -> None:
    """Raise :class:`NonFiniteUpdatesError` unless every float leaf of ``tree`` is finite (checked
    before a checkpoint is written: none may hold NaN / inf)."""
    bad = [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_leaves_with_path(tree)
           if jnp.issubdtype(x.dtype, jnp.inexact) and not bool(jnp.all(jnp.isfinite(x)))]
    if bad:
        raise NonFiniteUpdatesError(f"{what}: non-finite values in {bad[:3]}{' ...' if len(bad) > 3 else ''}")
