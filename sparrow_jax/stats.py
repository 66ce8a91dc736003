"""Standard errors, one definition for the report, the study and the trainer's validation.

A utility leaf: imports numpy and scipy only, so every layer may import it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from scipy import stats


def standard_error(values: Sequence[float]) -> Optional[float]:
    """The standard error of the mean of ``values`` (sample std, ddof 1, over sqrt(n)); None under two."""
    x = np.asarray(values, np.float64)
    return float(stats.sem(x, ddof=1)) if x.size >= 2 else None


def mean_and_se(values: Sequence[float]) -> tuple[Optional[float], Optional[float]]:
    """(mean, :func:`standard_error`) of ``values``; (None, None) when empty."""
    x = np.asarray(values, np.float64)
    return (float(x.mean()) if x.size else None), standard_error(x)


def difference_se(first: Sequence[float], second: Sequence[float]) -> Optional[float]:
    """The standard error of mean(second) - mean(first) for independent samples; None under two each."""
    a, b = standard_error(first), standard_error(second)
    return None if a is None or b is None else float(np.hypot(a, b))
