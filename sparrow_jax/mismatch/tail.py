"""Tail statistics of per-token acceptance rates by absolute-position bin (Sparrow §3).

The paper's stability statistic is the 5th percentile of alpha_t over all tokens whose
ABSOLUTE position (prompt included) falls in a bin ``[k * bin_width, (k + 1) * bin_width)``
(bin_width 2000). Percentiles use numpy's default ("linear") interpolation over the
tokens pooled across the batch in each bin.

  binned_percentile      host-side numpy, one batch, returns non-empty bins only
  binned_percentile_jax  jittable, fixed [num_bins] output, NaN for empty bins
  binned_tail_jax        jittable p / mean / count per bin, the last bin pooling later positions
  query_positions        the position a token is binned at (that of the query that produced it)
  binned_histogram_jax   jittable per-bin counts of values in [0, 1] on a 1e-3 grid (poolable over steps)
  (sparrow_jax.stats.histogram_percentile reads a percentile of the pooled counts)
  TailAccumulator        host-side, across batches (exact, or reservoir-capped)
"""
from __future__ import annotations

from typing import Any, Sequence

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sparrow_jax.rollout.schedule import position_bins

Array = Any


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_bin_width(bin_width: Any) -> int:
    if not _is_int(bin_width):
        raise TypeError(f"bin_width: expected an int, got {bin_width!r} ({type(bin_width).__name__})")
    if bin_width <= 0:
        raise ValueError(f"bin_width: expected > 0, got {bin_width}")
    return int(bin_width)


def _check_q(q: Any) -> tuple[tuple[float, ...], bool]:
    """Returns (q values as a tuple, whether q was a scalar)."""
    scalar = np.ndim(q) == 0
    qs = tuple(float(x) for x in np.atleast_1d(np.asarray(q, dtype=np.float64)))
    if not qs:
        raise ValueError("q: expected at least one percentile")
    bad = [x for x in qs if not (0.0 <= x <= 100.0)]  # also catches NaN
    if bad:
        raise ValueError(f"q: percentiles must lie in [0, 100], got {bad[0]}")
    return qs, scalar


def _check_shapes_and_dtypes(values, positions, mask) -> None:
    """positions and mask shaped like values; float values, integer positions (numpy or jax arrays)."""
    for name, x in (("positions", positions), ("mask", mask)):
        if x.shape != values.shape:
            raise ValueError(f"{name}: expected the shape of values {tuple(values.shape)}, got {tuple(x.shape)}")
    if not jnp.issubdtype(values.dtype, jnp.floating):  # jnp's test: bfloat16 counts as floating
        raise TypeError(f"values: expected a floating dtype, got {values.dtype}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions: expected an integer dtype, got {positions.dtype}")


def _check_inputs(values: Array, positions: Array, mask: Array):
    """Validate [B, T] (any equal shape) inputs; return the masked-in flat float64 values
    and int64 positions, on the host."""
    values, positions, mask = np.asarray(values), np.asarray(positions), np.asarray(mask)
    _check_shapes_and_dtypes(values, positions, mask)
    if not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.integer)):
        raise TypeError(f"mask: expected a bool or integer dtype, got {mask.dtype}")
    keep = mask.reshape(-1) != 0
    v = values.reshape(-1)[keep].astype(np.float64)
    pos = positions.reshape(-1)[keep].astype(np.int64)
    if pos.size and pos.min() < 0:
        raise ValueError(f"positions: masked-in tokens need positions >= 0, got {pos.min()}")
    if not np.all(np.isfinite(v)):
        raise ValueError("values: masked-in tokens have non-finite values (NaN/inf)")
    return v, pos


def binned_percentile(values: Array, positions: Array, mask: Array, bin_width: int = 2000,
                      q: float | Sequence[float] = 5.0):
    """Percentile(s) of the masked-in values pooled per absolute-position bin (host numpy).

    Args:
      values: float [B, T] per-token values (e.g. alpha_t).
      positions: int [B, T] ABSOLUTE token positions (prompt included), >= 0 where masked in.
      mask: bool/int [B, T], nonzero for tokens that count.
      bin_width: bin width in tokens, > 0; bin k is [k * bin_width, (k + 1) * bin_width).
      q: percentile in [0, 100], or a sequence of them.
    Returns:
      (bin_starts int64 [n], percentiles float64 [n] (or [n, len(q)] for a sequence q),
      counts int64 [n]) over the n bins holding at least one masked-in token, ascending.
    """
    bin_width = _check_bin_width(bin_width)
    qs, scalar = _check_q(q)
    v, pos = _check_inputs(values, positions, mask)
    bins = pos // bin_width
    order = np.argsort(bins, kind="stable")
    v, bins = v[order], bins[order]
    uniq, first, counts = np.unique(bins, return_index=True, return_counts=True)
    pct = np.empty((uniq.size, len(qs)), np.float64)
    for i, (f, c) in enumerate(zip(first, counts)):
        pct[i] = np.percentile(v[f:f + c], qs)
    return (uniq * bin_width).astype(np.int64), (pct[:, 0] if scalar else pct), counts.astype(np.int64)


@functools.partial(jax.jit, static_argnames=("num_bins", "bin_width", "q"))
def _binned_percentile_jax(values, positions, mask, *, num_bins, bin_width, q):
    dtype = jnp.promote_types(values.dtype, jnp.float32)
    v = values.reshape(-1).astype(dtype)
    pos = positions.reshape(-1)
    bins = pos // bin_width
    valid = (mask.reshape(-1) != 0) & (pos >= 0) & (bins < num_bins)
    key = jnp.where(valid, bins, num_bins).astype(jnp.int32)
    # One sort by (bin, value): each bin becomes a contiguous ascending run; invalid
    # tokens go to the tail (key num_bins) with value +inf.
    _, v_sorted = lax.sort((key, jnp.where(valid, v, jnp.inf)), num_keys=2)
    counts = jnp.bincount(key, length=num_bins + 1)[:num_bins].astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    last = v_sorted.shape[0] - 1
    out = []
    for qi in q:
        # numpy "linear": virtual index (n - 1) * q / 100, lerp between its neighbours.
        rank = (counts - 1).astype(dtype) * (qi / 100.0)
        lo = jnp.floor(rank).astype(jnp.int32)
        frac = rank - lo.astype(dtype)
        hi = jnp.minimum(lo + 1, counts - 1)
        a = v_sorted[jnp.clip(starts + lo, 0, last)]
        b = v_sorted[jnp.clip(starts + hi, 0, last)]
        # numpy's _lerp form (symmetric around frac = 0.5) for closer agreement.
        val = jnp.where(frac >= 0.5, b - (b - a) * (1 - frac), a + (b - a) * frac)
        out.append(jnp.where(counts > 0, val, jnp.nan))
    return jnp.stack(out, axis=-1), counts


def binned_percentile_jax(values: Array, positions: Array, mask: Array, num_bins: int,
                          bin_width: int = 2000, q: float | Sequence[float] = 5.0):
    """Jittable exact binned percentiles with a fixed number of bins.

    Same statistic as :func:`binned_percentile`, computed with one sort by (bin, value)
    inside jit. Tokens with a position outside [0, num_bins * bin_width) are dropped.
    The interpolation index is computed in the values' float dtype (float32 by
    default): for very large bins it can shift the interpolation weight slightly, but
    the result stays between the two neighbouring order statistics.

    Args:
      values: float [B, T]; positions: int [B, T] (absolute); mask: bool/int [B, T].
      num_bins, bin_width: static ints > 0. q: static percentile or sequence, in [0, 100].
    Returns:
      (percentiles float [num_bins] (or [num_bins, len(q)] for a sequence q), NaN for
      empty bins; counts int32 [num_bins]). Bin k starts at k * bin_width.
    """
    bin_width = _check_bin_width(bin_width)
    if not _is_int(num_bins) or num_bins < 1:
        raise ValueError(f"num_bins: expected an int >= 1, got {num_bins!r}")
    qs, scalar = _check_q(q)
    values, positions, mask = jnp.asarray(values), jnp.asarray(positions), jnp.asarray(mask)
    _check_shapes_and_dtypes(values, positions, mask)
    if values.size == 0:
        shape = (num_bins,) if scalar else (num_bins, len(qs))
        return jnp.full(shape, jnp.nan, jnp.float32), jnp.zeros((num_bins,), jnp.int32)
    pct, counts = _binned_percentile_jax(values, positions, mask, num_bins=int(num_bins),
                                         bin_width=bin_width, q=qs)
    return (pct[:, 0] if scalar else pct), counts


def query_positions(num_tokens: int) -> np.ndarray:
    """int32 [num_tokens]: where token ``t`` is binned, ``max(t - 1, 0)``.

    Token ``t`` is sampled by the query at ``t - 1``, whose budget is the schedule's top-k at
    ``t - 1``; binning there makes a bin's statistic governed by that bin's budget. The train
    step and calibration both bin this way.
    """
    return np.maximum(np.arange(num_tokens) - 1, 0).astype(np.int32)


def binned_tail_jax(values: Array, positions: Array, mask: Array, num_bins: int, bin_width: int,
                    q: float = 5.0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Jittable percentile, mean and count of masked-in values per position bin.

    One binning rule for all three (the schedule's, :func:`position_bins`): bin ``k`` holds
    positions in ``[k * bin_width, (k + 1) * bin_width)`` and the last bin also every later
    position. values float [B, T], positions int [B, T] >= 0, mask [B, T].
    Returns (percentile float [num_bins], mean float [num_bins], count int32 [num_bins]);
    percentile and mean are NaN in empty bins.
    """
    bins = position_bins(jnp.asarray(positions), _check_bin_width(bin_width), num_bins)
    pct, counts = binned_percentile_jax(values, bins, mask, num_bins, 1, q)
    keep = jnp.asarray(mask) != 0
    sums = jax.ops.segment_sum(jnp.where(keep, values, 0).reshape(-1).astype(jnp.float32), bins.reshape(-1),
                               num_bins)
    mean = jnp.where(counts > 0, sums / jnp.maximum(counts, 1), jnp.nan)
    return pct, mean, counts


HIST_BUCKETS = 1000  # buckets of width 1e-3 over [0, 1]: a pooled percentile is exact to 5e-4


def binned_histogram_jax(values: Array, positions: Array, mask: Array, num_bins: int, bin_width: int,
                         buckets: int = HIST_BUCKETS) -> jax.Array:
    """Jittable int32 [num_bins, buckets] counts of masked-in ``values`` (in [0, 1]) per position bin.

    Same binning as :func:`binned_tail_jax`; value ``v`` goes to bucket ``min(floor(v * buckets),
    buckets - 1)`` (values outside [0, 1] are clipped into the end buckets). Counts of several
    batches add up to the counts of their pooled tokens, which
    :func:`sparrow_jax.stats.histogram_percentile` reads.
    values float [B, T], positions int [B, T] >= 0, mask [B, T].
    """
    bins = position_bins(jnp.asarray(positions), _check_bin_width(bin_width), num_bins).reshape(-1)
    v = jnp.asarray(values, jnp.float32).reshape(-1)
    bucket = jnp.clip(jnp.floor(v * buckets), 0, buckets - 1).astype(jnp.int32)
    weight = (jnp.asarray(mask).reshape(-1) != 0).astype(jnp.int32)
    flat = jax.ops.segment_sum(weight, bins * buckets + bucket, num_bins * buckets)
    return flat.reshape(num_bins, buckets)


def percentile_key(q: float) -> str:
    """Name of a percentile in result rows: 5.0 -> "p5", 2.5 -> "p2.5"."""
    return f"p{q:g}"


class _Bin:
    """Values seen in one position bin: all of them, or a uniform reservoir sample."""

    __slots__ = ("chunks", "count", "total")

    def __init__(self):
        self.chunks: list[np.ndarray] = []
        self.count = 0        # tokens seen (exact even when sampling)
        self.total = 0.0      # their sum (exact mean even when sampling)

    def values(self) -> np.ndarray:
        if len(self.chunks) > 1:
            self.chunks = [np.concatenate(self.chunks)]
        return self.chunks[0] if self.chunks else np.zeros((0,), np.float64)


class TailAccumulator:
    """Per-bin tail statistics accumulated over batches on the host.

    Exact by default (stores every value). With ``max_samples_per_bin`` each bin keeps a
    uniform reservoir sample (Algorithm R, seeded) of at most that many values:
    counts and means stay exact, percentiles become estimates (``exact`` is False for
    bins that overflowed).

    Args:
      bin_width: bin width in tokens (absolute position), > 0.
      q: percentile(s) in [0, 100] reported by :meth:`result`.
      max_samples_per_bin: optional reservoir cap (int >= 1), None = keep everything.
      seed: seed of the reservoir's random generator.
    """

    def __init__(self, bin_width: int = 2000, q: float | Sequence[float] = (5.0,),
                 max_samples_per_bin: int | None = None, seed: int = 0):
        self.bin_width = _check_bin_width(bin_width)
        self.q, _ = _check_q(q)
        if max_samples_per_bin is not None and (not _is_int(max_samples_per_bin)
                                                or max_samples_per_bin < 1):
            raise ValueError(f"max_samples_per_bin: expected None or an int >= 1, got {max_samples_per_bin!r}")
        self.max_samples_per_bin = None if max_samples_per_bin is None else int(max_samples_per_bin)
        self._rng = np.random.default_rng(seed)
        self._bins: dict[int, _Bin] = {}

    @property
    def num_tokens(self) -> int:
        """Masked-in tokens seen so far."""
        return sum(b.count for b in self._bins.values())

    def update(self, values: Array, positions: Array, mask: Array) -> None:
        """Add one batch. values float [B, T], positions int [B, T] (absolute), mask [B, T]."""
        v, pos = _check_inputs(values, positions, mask)
        bins = pos // self.bin_width
        order = np.argsort(bins, kind="stable")  # keep token order inside a bin
        v, bins = v[order], bins[order]
        uniq, first, counts = np.unique(bins, return_index=True, return_counts=True)
        for k, f, c in zip(uniq.tolist(), first, counts):
            self._add(self._bins.setdefault(k, _Bin()), v[f:f + c])

    def _add(self, b: _Bin, x: np.ndarray) -> None:
        cap = self.max_samples_per_bin
        seen = b.count
        b.count += x.size
        b.total += float(np.sum(x))
        if cap is None:
            b.chunks.append(x)
            return
        res = b.values()
        n_fill = max(0, min(cap - res.size, x.size))
        res = np.concatenate([res, x[:n_fill]])
        rest = x[n_fill:]
        if rest.size:
            # Algorithm R: item with 0-based global index i replaces slot j ~ U{0..i}
            # when j < cap. Later items win a slot drawn twice, as in the sequential loop.
            idx = seen + n_fill + np.arange(rest.size)
            j = self._rng.integers(0, idx + 1)
            hit = np.flatnonzero(j < cap)
            if hit.size:
                slots = j[hit][::-1]
                _, last = np.unique(slots, return_index=True)  # last write per slot
                res[slots[last]] = rest[hit[::-1][last]]
        b.chunks = [res]

    def merge(self, other: "TailAccumulator") -> "TailAccumulator":
        """Fold ``other`` (same bin_width, q and cap) into this accumulator; returns self."""
        if not isinstance(other, TailAccumulator):
            raise TypeError(f"other: expected a TailAccumulator, got {type(other).__name__}")
        for field in ("bin_width", "q", "max_samples_per_bin"):
            if getattr(self, field) != getattr(other, field):
                raise ValueError(f"merge: {field} differs ({getattr(self, field)!r} vs "
                                 f"{getattr(other, field)!r})")
        cap = self.max_samples_per_bin
        for k, ob in other._bins.items():
            b = self._bins.setdefault(k, _Bin())
            na, nb = b.count, ob.count
            if cap is None or na + nb <= cap:
                merged = [np.concatenate([b.values(), ob.values()])]
            else:
                # Uniform cap-sample of the union: how many come from each side is
                # hypergeometric; each side's reservoir is a uniform sample of its own.
                from_a = int(self._rng.hypergeometric(na, nb, cap))
                a_vals, b_vals = b.values(), ob.values()
                merged = [np.concatenate([
                    self._rng.choice(a_vals, size=from_a, replace=False),
                    self._rng.choice(b_vals, size=cap - from_a, replace=False)])]
            b.chunks, b.count, b.total = merged, na + nb, b.total + ob.total
        return self

    def result(self) -> dict[str, Any]:
        """Per-bin statistics over the non-empty bins, ascending.

        Returns a dict:
          bin_width: int; q: tuple of percentiles;
          bin_starts: int64 [n]; counts: int64 [n]; mean_by_bin: float64 [n];
          percentiles: {q: float64 [n]} (numpy "linear" interpolation);
          exact: bool [n] (False where a reservoir sample stood in for the bin);
          bins: list of JSON-friendly rows {"start", "end", "count", "mean",
            "p5"-style keys (see percentile_key), "exact"};
          min_p5: min over bins of the 5th percentile (only when 5.0 is in q; NaN if
            no bins).
        """
        keys = sorted(self._bins)
        n = len(keys)
        pct = np.full((n, len(self.q)), np.nan)
        counts = np.zeros(n, np.int64)
        means = np.zeros(n, np.float64)
        exact = np.ones(n, bool)
        for i, k in enumerate(keys):
            b = self._bins[k]
            counts[i], means[i] = b.count, b.total / b.count
            pct[i] = np.percentile(b.values(), self.q)
            exact[i] = b.values().size == b.count
        starts = np.asarray(keys, np.int64) * self.bin_width
        rows = []
        for i in range(n):
            row = {"start": int(starts[i]), "end": int(starts[i] + self.bin_width),
                   "count": int(counts[i]), "mean": float(means[i])}
            row.update({percentile_key(qv): float(pct[i, j]) for j, qv in enumerate(self.q)})
            row["exact"] = bool(exact[i])
            rows.append(row)
        out = {
            "bin_width": self.bin_width, "q": self.q,
            "bin_starts": starts, "counts": counts, "mean_by_bin": means,
            "percentiles": {qv: pct[:, j] for j, qv in enumerate(self.q)},
            "exact": exact, "bins": rows,
        }
        if 5.0 in self.q:
            out["min_p5"] = self.min_percentile(5.0)
        return out

    def min_percentile(self, q: float = 5.0, min_count: int = 1) -> float:
        """Smallest per-bin ``q``-th percentile over bins with >= ``min_count`` tokens (NaN if none).

        ``q`` must be one of the accumulator's percentiles.
        """
        q = float(q)
        if q not in self.q:
            raise ValueError(f"q: {q} is not tracked by this accumulator (tracks {self.q})")
        if not _is_int(min_count) or min_count < 1:
            raise ValueError(f"min_count: expected an int >= 1, got {min_count!r}")
        vals = [float(np.percentile(b.values(), q)) for b in self._bins.values()
                if b.count >= min_count]
        return min(vals) if vals else math.nan

    def min_p5(self, min_count: int = 1) -> float:
        """The Sparrow stability statistic: min over bins of the per-bin 5th percentile."""
        return self.min_percentile(5.0, min_count)
