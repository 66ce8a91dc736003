"""Standard errors, one definition for the report, the study and the trainer's validation, and
the percentile of pooled histogram counts the report's tail statistics read.

A utility leaf: imports numpy only, so every layer may import it (and ``experiments.summary``
reads a run's files without starting jax).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np


def standard_error(values: Sequence[float]) -> Optional[float]:
    """The standard error of the mean of ``values`` (sample std, ddof 1, over sqrt(n)); None under two."""
    x = np.asarray(values, np.float64)
    return float(np.std(x, ddof=1) / np.sqrt(x.size)) if x.size >= 2 else None  # scipy.stats.sem's formula


def mean_and_se(values: Sequence[float]) -> tuple[Optional[float], Optional[float]]:
    """(mean, :func:`standard_error`) of ``values``; (None, None) when empty."""
    x = np.asarray(values, np.float64)
    return (float(x.mean()) if x.size else None), standard_error(x)


def difference_se(first: Sequence[float], second: Sequence[float]) -> Optional[float]:
    """The standard error of mean(second) - mean(first) for independent samples; None under two each."""
    a, b = standard_error(first), standard_error(second)
    return None if a is None or b is None else float(np.hypot(a, b))


def histogram_percentile(counts: Sequence[int], q: float = 5.0) -> float:
    """The ``q``-th percentile of the values counted in ``counts`` (int [buckets] over [0, 1]).

    numpy's "linear" rule on the order statistics, each taken at its bucket's centre, so the
    result is within half a bucket (5e-4 for 1000 buckets) of ``np.percentile`` of the values
    themselves. NaN for no values.
    """
    counts = np.asarray(counts, np.int64)
    n = int(counts.sum())
    if n == 0:
        return math.nan
    rank = (n - 1) * float(q) / 100.0
    lo = int(math.floor(rank))
    cum = np.cumsum(counts)
    centre = lambda i: (int(np.searchsorted(cum, i, side="right")) + 0.5) / counts.size  # noqa: E731
    a, b = centre(lo), centre(min(lo + 1, n - 1))
    return float(a + (b - a) * (rank - lo))
