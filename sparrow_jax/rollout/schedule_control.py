"""Online control of the sparsity schedule from the train step's per-bin p5 (tail statistic).

The paper calibrates a schedule once and keeps it; but the policy changes during RL, and a
schedule that held ``p5 >= tau`` at step 0 may break it later (training destabilises) or
become wasteful. Every train step measures the exact per-bin p5 of the sparse actor on its
own rollout; :func:`controller_step` feeds it back:

    (ControllerState, p5 [bins], token counts [bins]) -> (ControllerState, top-k [bins])

a pure jnp function (jittable, no Python branching on values) whose state is a pytree of
fixed-shape arrays, checkpointed as data and resumed bit for bit.

**Grid.** Budgets live on a floating-point-like grid of top-k values (:func:`topk_grid`):
every integer up to ``2 * levels_per_octave``, then ``m * 2**e`` for mantissas
``m in (L, 2L]``; with ``L = 4``: 0 1 2 ... 8 10 12 14 16 20 24 28 32 40 ... The state
holds grid *indices*, so budgets can never leave the grid. Compilation follows the static
``k_max`` bucket (``schedule.k_max_bucket``: 0..4, 6, 8, 12, 16, 24, ..., half-octaves); the
per-bin table itself is traced data. Above 8 each bucket holds ``L / 2`` grid points (2 at
``L = 4``), so a move meets a new compile key only when it crosses a bucket edge (at most every
``L / 2`` single-level moves of a bin), and the keys a run can ever meet are the few buckets up
to the dense top-k, each compiled once and then cached. Relative steps are
``2**(1/L)`` (19% at ``L = 4``): p5 responds roughly to the budget's logarithm, so equal ratios
are equal steps.

**The rule, per bin** (statistics of a noisy percentile). The sample 5th percentile of
``n`` tokens is asymptotically normal around the true one with variance ``sigma^2 / n``
(``sigma^2 = p(1 - p) / f(q)^2``, ``f`` the unknown density of alpha at its 5th percentile).
Hence:

* *Smoothing*: a token-count-weighted exponential average of the step p5s,
  ``W_t = rho W_{t-1} + n_t``, ``m_t = (rho W_{t-1} m_{t-1} + n_t x_t) / W_t``: inverse-variance
  weighting of the steps (a step with 4x the tokens counts 4x), forgetting old evidence at
  ``rho`` per step because the policy drifts. Its variance is ``sigma^2 U_t / W_t^2`` with
  ``U_t = rho^2 U_{t-1} + n_t`` (exact for independent steps).
* *Noise level* ``sigma^2`` is estimated from the data, without knowing ``f``: the one-step
  prediction residual ``x_t - m_{t-1}`` has variance ``sigma^2 (1/n_t + U_{t-1}/W_{t-1}^2)``,
  so ``(x_t - m_{t-1})^2 / (1/n_t + U_{t-1}/W_{t-1}^2)`` is an unbiased one-residual estimate,
  averaged with the same forgetting. Policy drift inflates it: the error is conservative.
* *Up fast*: when ``min(m_t, x_t) < tau`` (point estimates, no confidence needed; ``x_t``
  counts only over ``>= min_tokens`` tokens) the bin moves up one grid level per ``margin`` of
  shortfall, ``ceil((tau - min(m_t, x_t)) / margin)``, at most ``up_levels`` at once. This
  step's own p5 counts because the smoothed one lags: in a long-trace run the policy drifted
  until 20 pages read p5 0.80, 0.97, 0.74, 0.88, 0.81 in five steps while the average of the
  budget's history stayed above tau. Under-budget is the dangerous side (p5 below tau destabilises
  training), so one step with enough tokens suffices; scaling the rise with the shortfall
  keeps a bin just below tau from doubling its budget (a long-trace study: with a fixed
  4-level rise, the arm started dense went from predicted cost 0.72 back to 1.0 after one
  dip to 0.82).
* *Down slowly*: only when the one-sided lower confidence bound
  ``m_t - z * sigma * sqrt(U_t) / W_t`` stays above ``tau + margin`` after at least
  ``patience`` steps of evidence at the current budget, by one level plus one per ``margin``
  the bound clears ``tau + margin`` by, at most ``down_levels`` (default 1: one level). A long-
  trace study's arm started dense (p5 ~1.0 at its own contexts' budgets) came down one level
  per two steps and ended 21% above the calibrated schedule's cost after 12 steps.
  The margin is a hysteresis band: a bin whose p5 sits between tau and tau + margin holds,
  so budgets do not oscillate around tau; ``patience >= 2`` is needed for a noise estimate.
* *Noise pooled over bins*: a bin's own noise estimate rests on the few residuals since its
  budget last changed (one, right after ``patience = 2`` steps: a chi-square with one degree
  of freedom, often far too small). The lower bound uses the larger of it and a pooled
  estimate, the forgetting-weighted mean of every bin's residual estimates since the run began
  (never reset): p5's spread across steps comes mostly from which prompts a step drew, which
  every bin shares.
* *Failed levels are remembered*: a bin that rises because its p5 fell below tau at a level
  remembers that level and does not fall back to it, or below, for ``retry_after`` steps (the
  policy may change; then it may probe again). p5 can drop off a cliff between two grid levels
  (a long-trace model: ~0.95 at 20 pages, ~0.5 at 16); without the memory a bin holding above
  the cliff re-probes it every few steps, and every probe is a step of bad rollouts. A start
  from a calibrated schedule seeds the memory from its calibration table (per bin, the largest
  budget measured, or interpolated between two measured ones, below tau:
  :func:`failed_topk_from_table`).
* *Thin bins hold*: no move unless this step brought tokens to the bin and the effective
  count ``W_t >= min_tokens`` (``min_tokens`` tokens put ``0.05 * min_tokens`` of them in the
  tail the percentile is read from). A bin without tokens this step keeps its smoothed p5
  while the weight behind it ages (``n_t = 0``).
* *Fresh evidence after a move*: a bin's statistics reset whenever its budget changes,
  because p5 is a property of (model, budget, length): the old p5 measured another budget.

* *Probed falls* (``probe``): a fall need not be a guess. Before the next rollout samples at a
  lower budget, the trainer scores this step's rollouts teacher-forced with the sparse actor at
  the proposed table (every falling bin lowered at once, one pass:
  :func:`sparrow_jax.mismatch.probe.candidate_tail`) and each falling active bin keeps its fall
  only when the candidate's p5 lower bound reaches ``tau + probe_margin``
  (:func:`probe_rejections`). A rejected level joins the failed-level memory (the bin holds this
  step, and a later fall stops above it, so a two-level fall rejected becomes a one-level
  candidate), and the step is recomputed with ``rejected`` (:func:`controller_step`). Rises never
  wait for a probe.

**Monotone in position: kept.** After the moves the table is projected onto non-decreasing
top-k. Why: (1) the needed budget grows with context length (the paper: at a fixed budget p5
falls with length), so a dip is noise, not signal; (2) bins far out hold few tokens (only long
completions reach them): the projection lends them the floor of the well-measured bins before
them; (3) the sampler's segment split and ``SparsitySchedule`` assume it.
The projection distinguishes *active* bins, whose recent traffic ``T_t = rho T_{t-1} + n_t``
(never reset) reaches ``min_tokens``, from *free* ones (the prompt region, rare lengths):
active bins take the running maximum over active bins (a rise lifts every later active bin,
only ever raising: the safe direction); a free bin takes the budget of the next active bin
after it (it decodes few tokens, at shorter context than that bin), and free bins after the
last active one keep their own budget, floored by it. So bins that see no completion tokens
never hold the schedule up, and a thin bin never blocks a well-measured later bin's fall.
Any change of a bin's budget, by its own move or by the projection, resets its statistics.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def topk_grid(max_topk: int, levels_per_octave: int = 4, min_topk: int = 0) -> tuple[int, ...]:
    """Top-k values the controller may use, ascending: the grid from ``min_topk`` up to ``max_topk``.

    All integers up to ``2 * L``, then ``m * 2**e`` for ``m in (L, 2L]`` (``L = levels_per_octave``):
    ``L`` points per octave. The first point is the first ``>= min_topk`` (a floor), the last the
    first ``>= max_topk`` (it covers ``max_topk``).
    """
    for name, v, lo in (("max_topk", max_topk, 0), ("levels_per_octave", levels_per_octave, 1),
                        ("min_topk", min_topk, 0)):
        if not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    if min_topk > max_topk:
        raise ValueError(f"min_topk {min_topk} exceeds max_topk {max_topk}")
    L = int(levels_per_octave)
    values = list(range(2 * L + 1))
    scale = 2
    while values[-1] < max_topk:
        values += [m * scale for m in range(L + 1, 2 * L + 1)]
        scale *= 2
    top = next(v for v in values if v >= max_topk)
    bottom = next(v for v in values if v >= min_topk)  # a floor: never below min_topk
    return tuple(v for v in values if bottom <= v <= top)


@dataclasses.dataclass(frozen=True)
class ControllerSettings:
    """Static settings of the online controller (hashable: a jit static argument).

    Fields:
      grid: ascending top-k values the budgets move on (:func:`topk_grid`).
      tau: target p5 acceptance rate per bin.
      margin: hysteresis band: a bin moves down only when confidently above ``tau + margin``.
      up_levels: most grid levels a bin rises per step when its smoothed or this step's p5 is below ``tau``
        (one per ``margin`` of shortfall).
      down_levels: most grid levels a bin falls per step when confidently above ``tau + margin``
        (one per ``margin`` its lower bound clears it by).
      min_tokens: effective token count a bin needs before it may move.
      smoothing: per-step forgetting factor ``rho`` in [0, 1) of the weighted p5 average.
      z: one-sided normal quantile of the lower confidence bound used for down moves.
      patience: steps of evidence at the current budget before a down move (>= 2).
      retry_after: steps a bin keeps away from a level where its p5 was below tau (>= 1).
      probe: score a fall's candidate budgets on the step's own rollouts before taking it (the trainer).
      probe_margin: a falling bin keeps its fall only when the candidate's p5 lower bound is >= tau + probe_margin.
    """

    grid: tuple[int, ...]
    tau: float = 0.86
    margin: float = 0.03
    up_levels: int = 2
    down_levels: int = 1
    min_tokens: int = 256
    smoothing: float = 0.7
    z: float = 1.64
    patience: int = 3
    retry_after: int = 25
    probe: bool = False
    probe_margin: float = 0.02

    def __post_init__(self) -> None:
        grid = tuple(int(v) for v in self.grid)
        object.__setattr__(self, "grid", grid)
        if not grid or any(b <= a for a, b in zip(grid, grid[1:])) or grid[0] < 0:
            raise ValueError(f"grid: expected strictly ascending top-k values >= 0, got {list(grid)}")
        checks = (("tau", 0 < self.tau < 1, "in (0, 1)"), ("margin", 0 <= self.margin < 1, "in [0, 1)"),
                  ("up_levels", self.up_levels >= 1, ">= 1"), ("down_levels", self.down_levels >= 1, ">= 1"),
                  ("min_tokens", self.min_tokens >= 1, ">= 1"), ("smoothing", 0 <= self.smoothing < 1, "in [0, 1)"),
                  ("z", self.z >= 0, ">= 0"), ("patience", self.patience >= 2, ">= 2"),
                  ("retry_after", self.retry_after >= 1, ">= 1"),
                  ("probe_margin", 0 <= self.probe_margin < 1, "in [0, 1)"))
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name}: expected {want}, got {getattr(self, name)!r}")


class ControllerState(NamedTuple):
    """Per-bin controller state, arrays of shape [bins] but the pooled noise (scalars); a checkpointable pytree.

    level: int32 grid index of the bin's current top-k.
    mean: float32 smoothed p5 at the current budget (m_t).
    weight: float32 forgetting-weighted token count (W_t).
    weight_sq: float32 forgetting^2-weighted token count (U_t); the mean's variance is sigma^2 U / W^2.
    noise: float32 estimate of sigma^2 (a step p5 over n tokens has variance noise / n).
    noise_weight: float32 forgetting-weighted number of residuals behind ``noise``.
    steps: int32 steps with tokens since the bin's budget last changed.
    traffic: float32 forgetting-weighted token count, never reset (T_t): bins at ``min_tokens`` are active.
    failed: int32 highest grid index where the bin's p5 was found below tau (-1: none); falls stay above it.
    failed_age: int32 steps since ``failed`` was set (the memory lapses at ``retry_after``).
    pool_noise: float32 [] pooled sigma^2 over all bins' residuals, never reset.
    pool_weight: float32 [] forgetting-weighted number of residuals behind ``pool_noise``.
    """

    level: jax.Array
    mean: jax.Array
    weight: jax.Array
    weight_sq: jax.Array
    noise: jax.Array
    noise_weight: jax.Array
    steps: jax.Array
    traffic: jax.Array
    failed: jax.Array
    failed_age: jax.Array
    pool_noise: jax.Array
    pool_weight: jax.Array


def failed_topk_from_table(table: dict, tau: float, num_bins: int, bin_width: int, min_count: int = 1,
                           grid: Sequence[int] = ()) -> list[int]:
    """Per controller bin, the largest budget a calibration table shows with p5 below ``tau`` (0:
    none), from a schedule's ``meta["table"]`` (budgets x bin_starts; p5 and count per cell).

    A measured budget fails when its p5 is below ``tau``; a ``grid`` point between two measured
    budgets fails when p5 interpolated linearly in log budget is (p5 can fall off a cliff
    between two measured budgets: a long-trace bin read 0.97 at 24 pages and 0.65 at 16, and 20,
    never measured, read 0.79 online). A cell counts only with ``>= min_count`` tokens; a table
    over another bin width seeds nothing.
    """
    out = [0] * num_bins
    if int(table.get("bin_width", -1)) != bin_width:
        return out
    for i, start in enumerate(table["bin_starts"]):
        j = int(start) // bin_width
        if j >= num_bins:
            continue
        points = sorted((int(budget), float(table["p5"][b][i])) for b, budget in enumerate(table["budgets"])
                        if table["p5"][b][i] is not None and table["count"][b][i] >= min_count and budget > 0)
        failing = [k for k, p5 in points if p5 < tau]
        for (k0, p0), (k1, p1) in zip(points, points[1:]):
            for g in grid:
                if k0 < g < k1:
                    t = (np.log(g) - np.log(k0)) / (np.log(k1) - np.log(k0))
                    if p0 + t * (p1 - p0) < tau:
                        failing.append(int(g))
        out[j] = max(failing, default=0)
    return out


def dense_topk_by_bin(num_bins: int, bin_width: int, page_size: int, reserved: int) -> tuple[int, ...]:
    """Per position bin, the smallest top-k that is dense for every token of the bin: the pages
    visible at the bin's last position, less the always-kept reserved pages.

    The controller's dense start: a bin starting at the global dense top-k (that of the longest
    sequence) would spend its first falls on budgets above its own context, which change nothing.
    """
    for name, v, lo in (("num_bins", num_bins, 1), ("bin_width", bin_width, 1), ("page_size", page_size, 1),
                        ("reserved", reserved, 0)):
        if not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    return tuple(max(-(-((i + 1) * bin_width) // page_size) - reserved, 0) for i in range(num_bins))


def init_controller(settings: ControllerSettings, start_topk: Sequence[int], num_bins: int,
                    failed_topk: Sequence[int] | None = None) -> ControllerState:
    """State for ``num_bins`` bins starting at ``start_topk`` (one value per bin, or fewer: the last repeats).

    Each start value is rounded up to the nearest grid point (the top point when above the grid);
    the result is made non-decreasing in position. ``failed_topk``: per bin, a budget known to
    hold p5 below tau (0: none; e.g. :func:`failed_topk_from_table`): falls keep above its grid point.
    """
    if not isinstance(num_bins, (int, np.integer)) or num_bins < 1:
        raise ValueError(f"num_bins: expected an int >= 1, got {num_bins!r}")
    start = [int(k) for k in start_topk]
    if not start:
        raise ValueError("start_topk: expected at least one value")
    start = (start + [start[-1]] * num_bins)[:num_bins]
    grid = np.asarray(settings.grid)
    level = np.minimum(np.searchsorted(grid, start, side="left"), len(grid) - 1)
    failed = np.full(num_bins, -1)
    if failed_topk is not None:
        if len(failed_topk) != num_bins:
            raise ValueError(f"failed_topk: expected {num_bins} values (one per bin), got {len(failed_topk)}")
        known = np.asarray([int(k) for k in failed_topk])  # the grid point at or below each failing budget
        failed = np.where(known > 0, np.searchsorted(grid, known, side="right") - 1, -1)
    zeros = jnp.zeros((num_bins,), jnp.float32)
    counter = jnp.zeros((num_bins,), jnp.int32)
    return ControllerState(level=jnp.asarray(np.maximum.accumulate(level), jnp.int32), mean=zeros, weight=zeros,
                           weight_sq=zeros, noise=zeros, noise_weight=zeros, steps=counter, traffic=zeros,
                           failed=jnp.asarray(failed, jnp.int32), failed_age=counter,
                           pool_noise=jnp.zeros((), jnp.float32), pool_weight=jnp.zeros((), jnp.float32))


def controller_topk(settings: ControllerSettings, state: ControllerState) -> jax.Array:
    """Current top-k per bin, int32 [bins]."""
    return jnp.asarray(settings.grid, jnp.int32)[state.level]


def _noise_update(state: ControllerState, rho: jax.Array, seen: jax.Array, n: jax.Array,
                  x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Noise level from the one-step residual of this step's p5 ``x`` over ``n`` tokens (bins ``seen``
    with a previous estimate at this budget): (noise, noise_weight [bins], pool_noise, pool_weight [])."""
    has_prev = seen & (state.weight > 0)
    prev_var = state.weight_sq / jnp.maximum(state.weight, 1e-30) ** 2  # Var(m_{t-1}) / sigma^2
    resid_sigma2 = (x - state.mean) ** 2 / (1.0 / jnp.maximum(n, 1.0) + prev_var)
    noise_weight = jnp.where(has_prev, rho * state.noise_weight + 1.0, state.noise_weight)
    noise = jnp.where(has_prev, (rho * state.noise_weight * state.noise + resid_sigma2)
                      / jnp.maximum(noise_weight, 1e-30), state.noise)
    fresh = jnp.sum(has_prev.astype(jnp.float32))  # this step's residuals, every bin's
    pool_weight = rho * state.pool_weight + fresh
    pool_noise = jnp.where(fresh > 0, (rho * state.pool_weight * state.pool_noise
                                       + jnp.sum(jnp.where(has_prev, resid_sigma2, 0.0)))
                           / jnp.maximum(pool_weight, 1e-30), state.pool_noise)
    return noise, noise_weight, pool_noise, pool_weight


def controller_step(settings: ControllerSettings, state: ControllerState, p5: jax.Array,
                    counts: jax.Array, rejected: jax.Array | None = None) -> tuple[ControllerState, jax.Array]:
    """One control update from this step's per-bin tail statistic (see the module docstring).

    Args:
      settings: static settings.
      state: per-bin state, arrays [bins].
      p5: float [bins] this step's p5 acceptance rate per bin (NaN or anything where counts == 0).
      counts: int/float [bins] tokens behind each p5.
      rejected: int [bins] grid level a probe rejected for the bin (-1: none; :func:`probe_rejections`):
        the bin does not fall this step, and the level joins its failed-level memory. None: no rejection.
    Returns:
      (new state, top-k per bin int32 [bins]), top-k on the grid and non-decreasing in position.
    """
    rho = jnp.float32(settings.smoothing)
    n = jnp.asarray(counts, jnp.float32)
    x = jnp.asarray(p5, jnp.float32)
    seen = (n > 0) & jnp.isfinite(x)
    n = jnp.where(seen, n, 0.0)
    x = jnp.where(seen, x, 0.0)

    # Noise level from the one-step residual (needs a previous estimate at this budget).
    noise, noise_weight, pool_noise, pool_weight = _noise_update(state, rho, seen, n, x)

    # Count-weighted exponential average of p5; evidence ages every step, seen or not.
    decayed = rho * state.weight
    weight = decayed + n
    mean = jnp.where(seen, (decayed * state.mean + n * x) / jnp.maximum(weight, 1e-30), state.mean)
    weight_sq = rho * rho * state.weight_sq + n
    steps = state.steps + seen.astype(jnp.int32)

    enough = seen & (weight >= settings.min_tokens)
    std_err = jnp.sqrt(jnp.maximum(noise, pool_noise) * weight_sq) / jnp.maximum(weight, 1e-30)
    lower = mean - jnp.float32(settings.z) * std_err
    # Up on the smoothed p5 or on this step's own (when it rests on min_tokens tokens): the smoothing
    # must not hold a budget that has stopped working (the policy drifted) for steps below tau.
    low = jnp.minimum(mean, jnp.where(n >= settings.min_tokens, x, mean))
    go_up = enough & (low < settings.tau)
    # A level found below tau (or at or below one) is off limits for a fall until the memory lapses.
    lapsed = state.failed_age + 1 >= settings.retry_after
    remembered = jnp.where(lapsed, -1, state.failed)
    failed = jnp.where(go_up, jnp.maximum(state.level, remembered), remembered)
    failed_age = jnp.where(go_up, 0, state.failed_age + 1)
    probed_out = jnp.zeros_like(go_up)
    if rejected is not None:  # a level a probe rejected counts as failed; the bin holds this step
        rejected = jnp.asarray(rejected, jnp.int32)
        probed_out = (rejected >= 0) & ~go_up
        failed = jnp.where(probed_out, jnp.maximum(failed, rejected), failed)
        failed_age = jnp.where(probed_out, 0, failed_age)
    go_down = (enough & ~go_up & ~probed_out & (steps >= settings.patience) & (noise_weight > 0)
               & (lower > settings.tau + settings.margin) & (state.level - 1 > failed))
    # One level per margin of shortfall, at most up_levels: a bin just below tau steps up one level,
    # one far below rises fast (the budgets move on a log scale, and p5 with the log budget).
    shortfall = (settings.tau - low) / settings.margin if settings.margin > 0 else jnp.inf
    rise = jnp.clip(jnp.ceil(shortfall), 1, settings.up_levels).astype(jnp.int32)
    # One level, and one more per margin the bound clears tau + margin by, at most down_levels: a bin
    # far above the band (a dense start reads p5 ~1.0) comes down fast, one near it a level at a time.
    surplus = (lower - settings.tau - settings.margin) / settings.margin if settings.margin > 0 else jnp.inf
    fall = jnp.clip(jnp.floor(surplus) + 1, 1, settings.down_levels).astype(jnp.int32)
    delta = jnp.where(go_up, rise, jnp.where(go_down, -fall, 0))
    moved_level = jnp.clip(state.level + delta, 0, len(settings.grid) - 1)
    moved_level = jnp.where(go_down, jnp.maximum(moved_level, failed + 1), moved_level)
    traffic = rho * state.traffic + n
    level = _monotone(moved_level, traffic >= settings.min_tokens, len(settings.grid))

    moved = level != state.level  # new budget: its statistics start afresh
    zero = jnp.zeros_like(mean)
    new = ControllerState(level=level, mean=jnp.where(moved, zero, mean), weight=jnp.where(moved, zero, weight),
                          weight_sq=jnp.where(moved, zero, weight_sq), noise=jnp.where(moved, zero, noise),
                          noise_weight=jnp.where(moved, zero, noise_weight),
                          steps=jnp.where(moved, 0, steps).astype(jnp.int32), traffic=traffic,
                          failed=failed.astype(jnp.int32), failed_age=failed_age.astype(jnp.int32),
                          pool_noise=pool_noise, pool_weight=pool_weight)
    return new, controller_topk(settings, new)


def probe_rejections(settings: ControllerSettings, state: ControllerState, proposed: ControllerState,
                     lower: jax.Array) -> jax.Array:
    """The levels a probe rejects: int32 [bins], the proposed level of each active bin that falls with a
    candidate p5 lower bound below ``tau + probe_margin`` (NaN or -inf: no bound, rejected), else -1.

    Args:
      state: the state before the step; proposed: :func:`controller_step`'s state without rejections.
      lower: float [bins] the candidate table's p5 lower bound per bin (the probe's, on this step's tokens).
    A bin without traffic (``proposed.traffic < min_tokens``) follows the projection unprobed: it decodes
    few tokens, and the next active bin's budget it takes was itself probed.
    """
    falling = probed_bins(settings, state, proposed)
    lower = jnp.asarray(lower, jnp.float32)
    passes = jnp.isfinite(lower) & (lower >= settings.tau + settings.probe_margin)
    return jnp.where(falling & ~passes, proposed.level, -1).astype(jnp.int32)


def probed_bins(settings: ControllerSettings, state: ControllerState, proposed: ControllerState) -> jax.Array:
    """bool [bins]: the active bins whose proposed budget is below their current one (what a probe checks)."""
    return (proposed.level < state.level) & (proposed.traffic >= settings.min_tokens)


def _monotone(level: jax.Array, active: jax.Array, num_levels: int) -> jax.Array:
    """Non-decreasing grid indices [bins]: running max over active bins; a free bin takes the next
    active bin's level, or after the last active bin its own level floored (module docstring)."""
    floor = jax.lax.cummax(jnp.where(active, level, -1), axis=0)  # active bins: their final level
    next_active = jax.lax.cummin(jnp.where(active, floor, num_levels), axis=0, reverse=True)
    trailing = next_active >= num_levels  # no active bin at or after this one
    tail = jax.lax.cummax(jnp.where(trailing, jnp.maximum(floor, level), -1), axis=0)
    return jnp.where(trailing, tail, next_active).astype(jnp.int32)


controller_step_jit = jax.jit(controller_step, static_argnums=0)
