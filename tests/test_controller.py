"""Online schedule controller: the control rule on synthetic p5 sequences, the grid, exact resume, jit."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.grpo_tiny import get_config
from sparrow_jax.io.checkpoint import CheckpointManager
from sparrow_jax.rl.trainer import LoopState
from sparrow_jax.run.specs import CHOICES, ConfigError, parse_spec
from sparrow_jax.rollout.schedule import SparsitySchedule, k_max_bucket
from sparrow_jax.rollout.schedule_control import (ControllerSettings, controller_step, controller_step_jit,
                                                  controller_topk, dense_topk_by_bin, failed_topk_from_table,
                                                  init_controller, topk_grid)

GRID = topk_grid(64, levels_per_octave=4)
SETTINGS = ControllerSettings(grid=GRID, tau=0.86, margin=0.03, up_levels=2, down_levels=1, min_tokens=100,
                              smoothing=0.5, z=1.64, patience=3)


def _run(settings, state, p5s, counts):
    """Feed rows of per-bin (p5, count); returns the final state and the top-k after every step [T, bins]."""
    out = []
    for p5, n in zip(p5s, counts):
        state, topk = controller_step_jit(settings, state, jnp.asarray(p5, jnp.float32), jnp.asarray(n, jnp.int32))
        out.append(np.asarray(topk))
    return state, np.stack(out)


def test_grid_has_levels_per_octave_points_per_power_of_two_bucket():
    assert GRID == (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)
    for j in range(3, 6):  # buckets (8, 16], (16, 32], (32, 64]
        assert sum(2 ** j < k <= 2 ** (j + 1) for k in GRID) == 4
    # two grid points per k_max bucket (the compile key) above 8: moves cross a bucket edge every other level
    buckets = [k_max_bucket(k) for k in GRID if k > 8]
    assert all(buckets.count(b) == 2 for b in set(buckets))
    assert topk_grid(50, 4, min_topk=9) == (10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56)  # floor 9 -> 10, covers 50
    assert topk_grid(5, 2) == (0, 1, 2, 3, 4, 6)
    with pytest.raises(ValueError, match="levels_per_octave"):
        topk_grid(8, 0)
    with pytest.raises(ValueError, match="min_topk 9 exceeds max_topk 8"):
        topk_grid(8, 4, min_topk=9)


def test_settings_errors_name_the_field():
    with pytest.raises(ValueError, match="patience"):
        ControllerSettings(grid=GRID, patience=1)
    with pytest.raises(ValueError, match="smoothing"):
        ControllerSettings(grid=GRID, smoothing=1.0)
    with pytest.raises(ValueError, match="grid"):
        ControllerSettings(grid=(4, 2))


def test_init_rounds_up_onto_the_grid_expands_bins_and_is_monotone():
    s = init_controller(SETTINGS, (9, 3), num_bins=4)  # 9 -> 10; 3 < 10 lifted by monotonicity; last repeats
    np.testing.assert_array_equal(controller_topk(SETTINGS, s), [10, 10, 10, 10])
    s = init_controller(SETTINGS, (1, 500), num_bins=2)  # above the grid: its top
    np.testing.assert_array_equal(controller_topk(SETTINGS, s), [1, 64])


def test_dense_start_is_each_bins_own_context():
    """Bins of 128 positions, pages of 16, 3 reserved: the last position of bin i sees 8 (i + 1) pages."""
    assert dense_topk_by_bin(4, 128, 16, 3) == (5, 13, 21, 29)
    assert dense_topk_by_bin(2, 100, 16, 1) == (6, 12)  # positions 99 and 199: 7 and 13 pages
    assert dense_topk_by_bin(1, 16, 16, 3) == (0,)  # fewer pages than reserved: nothing to select
    # on the grid: rounded up, so every token of the bin still sees its whole context
    start = controller_topk(SETTINGS, init_controller(SETTINGS, dense_topk_by_bin(4, 128, 16, 3), 4))
    np.testing.assert_array_equal(start, [5, 14, 24, 32])
    with pytest.raises(ValueError, match="bin_width"):
        dense_topk_by_bin(2, 0, 16, 3)


def test_rises_fast_when_below_tau():
    state = init_controller(SETTINGS, (4,), num_bins=1)
    _, topk = _run(SETTINGS, state, [[0.80]] * 3, [[400]] * 3)
    np.testing.assert_array_equal(topk[:, 0], [6, 8, 12])  # two grid levels per step, every step


def test_the_rise_is_one_level_per_margin_of_shortfall_up_to_up_levels():
    wide = dataclasses.replace(SETTINGS, up_levels=4)  # tau 0.86, margin 0.03
    for p5, levels in ((0.85, 1), (0.82, 2), (0.79, 3), (0.50, 4), (0.0, 4)):
        _, topk = _run(wide, init_controller(wide, (10,), num_bins=1), [[p5]], [[400]])
        assert GRID.index(int(topk[0, 0])) - GRID.index(10) == levels, p5
    no_margin = dataclasses.replace(wide, margin=0.0)  # no scale: the full rise
    _, topk = _run(no_margin, init_controller(no_margin, (10,), num_bins=1), [[0.85]], [[400]])
    assert GRID.index(int(topk[0, 0])) - GRID.index(10) == 4


def test_falls_slowly_only_when_confidently_above_tau_plus_margin():
    state = init_controller(SETTINGS, (16,), num_bins=1)
    rng = np.random.RandomState(0)
    p5 = 0.95 + 0.003 * rng.randn(12, 1)  # well above tau + margin = 0.89, small noise
    _, topk = _run(SETTINGS, state, p5, [[400]] * 12)
    # patience 3: three steps of evidence at each budget, then one level down; statistics reset after a move
    np.testing.assert_array_equal(topk[:, 0], [16, 16, 14, 14, 14, 12, 12, 12, 10, 10, 10, 8])


def test_a_bin_far_above_the_band_falls_faster():
    """down_levels 2: a bound clearing tau + margin by more than a margin falls two levels, one just
    above the band falls one."""
    settings = dataclasses.replace(SETTINGS, down_levels=2)
    rng = np.random.RandomState(0)
    far = 0.99 + 0.002 * rng.randn(3, 1)                     # bound ~0.99 > 0.89 + 0.03
    near = 0.905 + 0.002 * rng.randn(3, 1)                   # bound just above 0.89
    _, topk = _run(settings, init_controller(settings, (16,), num_bins=1), far, [[400]] * 3)
    _, topk_near = _run(settings, init_controller(settings, (16,), num_bins=1), near, [[400]] * 3)
    assert topk[-1, 0] == 12 and topk_near[-1, 0] == 14


def test_holds_inside_the_hysteresis_band_and_on_noisy_evidence():
    state = init_controller(SETTINGS, (16,), num_bins=2)
    band = [[0.875, 0.875]] * 10  # tau <= p5 < tau + margin: hold
    _, topk = _run(SETTINGS, state, band, [[400, 400]] * 10)
    assert (topk == 16).all()
    # mean well above the band but noisy: the lower confidence bound stays below tau + margin
    noisy = [[0.99, 0.99], [0.87, 0.87]] * 4  # mean ~0.93 > 0.89, but a step p5 is +-0.06
    _, topk = _run(SETTINGS, state, noisy, [[400, 400]] * 8)
    assert (topk == 16).all()


def test_one_step_below_tau_raises_the_budget_though_the_average_is_above():
    """The smoothed p5 lags a budget that stopped working; a well-filled step below tau is enough.
    A thin step below tau is not (its p5 rests on too few tokens)."""
    settings = dataclasses.replace(SETTINGS, margin=0.2)   # a wide band: no falls in this test
    state = init_controller(settings, (16,), num_bins=1)
    state, topk = _run(settings, state, [[0.95]] * 4 + [[0.80]], [[400]] * 5)
    assert topk[-1, 0] == 20   # one level (0.06 short, margin 0.2); the smoothed p5 was 0.873, above tau
    state = init_controller(settings, (16,), num_bins=1)
    _, topk = _run(settings, state, [[0.95]] * 4 + [[0.80]], [[400]] * 4 + [[60]])
    assert topk[-1, 0] == 16


def test_a_level_found_below_tau_is_not_probed_again_until_the_memory_lapses():
    """Above the band at 16, the bin falls to 14, finds p5 below tau there and rises back; it then
    holds at 16 on the same evidence that made it fall, until ``retry_after`` steps have passed."""
    settings = dataclasses.replace(SETTINGS, retry_after=8)
    state = init_controller(settings, (16,), num_bins=1)
    rng = np.random.RandomState(0)
    high = list(0.95 + 0.003 * rng.randn(16))
    p5 = high[:3] + [0.84] + high[3:]                      # 16 x3 -> falls; 14 reads 0.84 -> back to 16
    _, topk = _run(settings, state, [[x] for x in p5], [[400]] * len(p5))
    np.testing.assert_array_equal(topk[:5, 0], [16, 16, 14, 16, 16])
    assert int(np.argmax(topk[4:, 0] < 16)) + 4 >= 3 + settings.retry_after   # no fall before the memory lapses
    assert (topk[3:3 + settings.retry_after, 0] == 16).all() and 14 in topk[3 + settings.retry_after:, 0]


def test_a_calibration_table_seeds_the_failed_levels():
    table = dict(budgets=[8, 12, 16], bin_width=100, bin_starts=[0, 100, 200],
                 p5=[[0.99, 0.5, None], [0.99, 0.8, 0.3], [0.99, 0.9, 0.95]],
                 count=[[500, 500, 0], [500, 500, 500], [500, 500, 50]])
    failed = failed_topk_from_table(table, tau=0.86, num_bins=3, bin_width=100, min_count=100)
    assert failed == [0, 12, 12]               # bin 2: the 16 cell has too few tokens to count
    assert failed_topk_from_table(table, 0.86, 3, bin_width=128) == [0, 0, 0]  # other bins: no prior
    # grid points between measured budgets: p5 interpolated in log budget (bin 1: 12 -> 0.8, 16 -> 0.9;
    # 14 interpolates to 0.854 < 0.86; bin 0 passes everywhere; bin 2: 12 fails, 16 too thin to count)
    assert failed_topk_from_table(table, 0.86, 3, bin_width=100, min_count=100, grid=GRID) == [0, 14, 12]
    state = init_controller(SETTINGS, (16, 16, 16), num_bins=3, failed_topk=failed)
    np.testing.assert_array_equal(np.asarray(state.failed), [-1, GRID.index(12), GRID.index(12)])
    _, topk = _run(SETTINGS, state, [[0.97, 0.97, 0.97]] * 9, [[400, 400, 400]] * 9)
    # bin 0 falls freely; bins 1-2 stop at 14, above the calibration's failing 12 (the first bin's
    # falls do not pull the later ones down: the schedule only has to stay non-decreasing)
    assert topk[-1, 0] < 14 and (topk[:, 1:] >= 14).all() and (topk[-1, 1:] == 14).all()
    with pytest.raises(ValueError, match="failed_topk"):
        init_controller(SETTINGS, (16,), num_bins=3, failed_topk=[0, 0])


def test_a_lucky_single_residual_does_not_license_a_fall_when_other_bins_are_noisy():
    """patience 2: bin 0 sees two close p5s (one tiny residual); bin 1's steps swing. Alone, bin 0
    would fall; with the pooled noise its lower bound stays inside the band."""
    settings = dataclasses.replace(SETTINGS, patience=2)
    alone = init_controller(settings, (16,), num_bins=1)
    _, topk = _run(settings, alone, [[0.95], [0.951]], [[400]] * 2)
    assert topk[-1, 0] == 14
    pair = init_controller(settings, (16, 16), num_bins=2)
    state, topk = _run(settings, pair, [[0.95, 0.99], [0.951, 0.75]], [[400, 400]] * 2)
    assert topk[-1, 0] == 16 and float(state.pool_noise) > float(state.noise[0])


def test_holds_on_thin_and_empty_bins():
    state = init_controller(SETTINGS, (8,), num_bins=3)
    # bin 0 enough tokens, in the band; bin 1 low but thin (below min_tokens); bin 2 empty (NaN p5)
    p5 = [[0.875, 0.50, np.nan]] * 4
    counts = [[400, 10, 0]] * 4
    state, topk = _run(SETTINGS, state, p5, counts)
    assert (topk[:, 1:] == 8).all()  # thin/empty bins hold
    np.testing.assert_array_equal(np.asarray(state.steps), [4, 4, 0])
    np.testing.assert_array_equal(np.asarray(state.weight)[2], 0.0)
    # thin evidence accumulates across steps (smoothing 0.5): with 60 tokens per step the effective count
    # is 60, 90, 105: the bin reaches min_tokens = 100 at its third step and then rises
    state = init_controller(SETTINGS, (8,), num_bins=1)
    _, topk = _run(SETTINGS, state, [[0.5]] * 3, [[60]] * 3)
    np.testing.assert_array_equal(topk[:, 0], [8, 8, 12])


def test_monotone_in_position_and_never_leaves_the_grid():
    rng = np.random.RandomState(1)
    state = init_controller(SETTINGS, (0, 2, 4, 8, 16), num_bins=5)
    p5 = np.clip(0.86 + 0.1 * rng.randn(200, 5), 0, 1)
    counts = rng.randint(0, 600, size=(200, 5))
    p5[counts == 0] = np.nan
    _, topk = _run(SETTINGS, state, p5, counts)
    assert set(np.unique(topk)) <= set(GRID)
    assert (np.diff(topk, axis=1) >= 0).all()
    for row in topk:  # every table is a valid SparsitySchedule
        SparsitySchedule(tuple(int(k) for k in row))
    # the extremes: stays at the grid's ends under persistent pressure
    top, _ = _run(SETTINGS, init_controller(SETTINGS, (64,), 1), [[0.1]] * 3, [[400]] * 3)
    bottom, _ = _run(SETTINGS, init_controller(SETTINGS, (0,), 1), [[0.999]] * 5, [[400]] * 5)
    assert int(controller_topk(SETTINGS, top)[0]) == 64 and int(controller_topk(SETTINGS, bottom)[0]) == 0


def test_bins_without_traffic_never_hold_the_schedule_up():
    """Prompt-region (empty) and thin bins follow the next active bin: a well-measured later bin can fall."""
    state = init_controller(SETTINGS, (16,), num_bins=5)
    rng = np.random.RandomState(3)
    p5 = np.stack([np.full(7, np.nan), 0.97 + 0.002 * rng.randn(7), np.full(7, 0.5), 0.96 + 0.002 * rng.randn(7),
                   np.full(7, 0.2)], axis=1)
    counts = np.tile([0, 400, 10, 400, 5], (7, 1))  # bin 0: prompts only; bins 2 and 4: thin
    _, topk = _run(SETTINGS, state, p5, counts)
    # bins 1 and 3 fall every third step; empty bin 0 and thin bin 2 take the next active bin's budget;
    # the thin trailing bin 4 keeps its own (16): nothing after it is measured
    np.testing.assert_array_equal(topk[[1, 2, 5, 6]], [[16, 16, 16, 16, 16], [14, 14, 14, 14, 16],
                                                       [12, 12, 12, 12, 16], [12, 12, 12, 12, 16]])


def test_a_rise_in_an_early_bin_lifts_later_bins():
    state = init_controller(SETTINGS, (4, 6, 8), num_bins=3)
    _, topk = _run(SETTINGS, state, [[0.7, 0.87, 0.87]], [[400, 400, 400]])
    np.testing.assert_array_equal(topk[0], [6, 6, 8])  # bin 0: 4 -> 6 (two levels); bin 1 lifted; bin 2 holds


def test_smoothing_and_noise_estimates_against_a_float64_reference():
    """The state after a few steps equals the docstring's formulas computed in float64."""
    rho = SETTINGS.smoothing
    xs, ns = [0.93, 0.95, 0.91], [100.0, 300.0, 200.0]
    state = init_controller(dataclasses.replace(SETTINGS, patience=10), (16,), num_bins=1)
    state, _ = _run(dataclasses.replace(SETTINGS, patience=10), state, [[x] for x in xs], [[int(n)] for n in ns])
    W = U = m = s2 = V = 0.0
    for x, n in zip(xs, ns):
        if W > 0:
            r2 = (x - m) ** 2 / (1 / n + U / W ** 2)
            s2, V = (rho * V * s2 + r2) / (rho * V + 1), rho * V + 1
        m = (rho * W * m + n * x) / (rho * W + n)
        W, U = rho * W + n, rho ** 2 * U + n
    np.testing.assert_allclose([float(state.mean[0]), float(state.weight[0]), float(state.weight_sq[0]),
                                float(state.noise[0]), float(state.noise_weight[0])], [m, W, U, s2, V], rtol=1e-5)


def test_jit_matches_eager_and_compiles_once():
    state = init_controller(SETTINGS, (2, 4), num_bins=7)  # a bin count no other test uses
    p5 = jnp.asarray([0.8, 0.95, 0.9, 0.9, np.nan, 0.7, 0.99], jnp.float32)
    counts = jnp.asarray([300, 300, 10, 300, 0, 300, 300], jnp.int32)
    n0 = controller_step_jit._cache_size()
    for i in range(3):  # new values, same shapes: no new compilation
        controller_step_jit(SETTINGS, state, p5 - 0.01 * i, counts)
    assert controller_step_jit._cache_size() - n0 == 1
    eager, jitted = controller_step(SETTINGS, state, p5, counts), controller_step_jit(SETTINGS, state, p5, counts)
    np.testing.assert_array_equal(eager[1], jitted[1])
    # bins 0 and 5 rose two levels; empty bin 4 takes bin 5's budget, bin 6 is lifted
    np.testing.assert_array_equal(eager[1], [4, 4, 4, 4, 6, 6, 6])
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_resume_from_orbax_checkpoint_is_bit_exact(tmp_path):
    rng = np.random.RandomState(2)
    p5 = np.clip(0.88 + 0.05 * rng.randn(20, 3), 0, 1).astype(np.float32)
    counts = rng.randint(50, 500, size=(20, 3))
    start = init_controller(SETTINGS, (4, 8, 8), num_bins=3)
    whole, whole_topk = _run(SETTINGS, start, p5, counts)

    half, first_topk = _run(SETTINGS, start, p5[:10], counts[:10])
    ckpt = CheckpointManager(tmp_path / "ckpt", max_to_keep=1)  # the controller rides in the loop state
    loop_state = lambda c: LoopState(None, None, controller_topk(SETTINGS, c), jnp.asarray(False),
                                     jnp.zeros((2,), jnp.int32), jax.random.PRNGKey(0), c)
    ckpt.save(10, {"params": {"w": jnp.zeros(2)}, "loop": loop_state(half), "meta": {"step": 10}})
    target = loop_state(init_controller(SETTINGS, (0,), 3))
    restored = CheckpointManager(tmp_path / "ckpt").restore(target={"loop": target})["loop"].controller
    assert isinstance(restored, type(half))
    resumed, rest_topk = _run(SETTINGS, restored, p5[10:], counts[10:])
    np.testing.assert_array_equal(np.concatenate([first_topk, rest_topk]), whole_topk)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(np.unique(whole_topk, axis=0)) > 2  # the sequence actually moved budgets


def test_online_config_validation_names_the_field():
    from sparrow_jax.cost_model import HARDWARE

    assert CHOICES["schedule.cost_hardware"] == tuple(HARDWARE)
    c = get_config()
    c.schedule.kind = "online"
    c.schedule.online.start = "fixed"
    assert parse_spec(c).schedule.online.start == "fixed"
    for field, value, msg in (("start", "json", "schedule.online.start"),
                              ("smoothing", 1.0, "schedule.online.smoothing"),
                              ("patience", 1, "schedule.online.patience"),
                              ("min_tokens", 0, "schedule.online.min_tokens"),
                              ("margin", -0.1, "schedule.online.margin"),
                              ("max_topk", 2, "schedule.online.max_topk")):
        bad = get_config()
        bad.schedule.kind, bad.schedule.online.min_topk = "online", 4
        bad.schedule.online[field] = value
        with pytest.raises(ConfigError, match=msg):
            parse_spec(bad)
    bad = get_config()
    bad.schedule.cost_hardware = "abacus"
    with pytest.raises(ConfigError, match="schedule.cost_hardware"):
        parse_spec(bad)
    bad = get_config()
    bad.schedule.kind, bad.distill.switch_topk, bad.distill.switch_every = "online", 1, 1
    with pytest.raises(ConfigError, match="distill.switch_topk"):
        parse_spec(bad)


def _online_spec(tmp_path, start, steps=2, topk=2):
    c = get_config()  # grpo_tiny: page 8, bins of 64 tokens
    c.workdir, c.steps, c.checkpoint_every, c.eval_k = str(tmp_path), steps, 1, 2
    c.task.context_tokens, c.task.num_train, c.task.num_eval = 64, 8, 2
    c.rollout.max_new_tokens, c.rollout.prompts_per_step, c.rollout.group_size = 6, 2, 2
    c.schedule.kind, c.schedule.online.start, c.schedule.topk = "online", start, topk
    c.schedule.online.min_tokens, c.schedule.online.patience, c.calibration.tau = 4, 2, 0.9
    return parse_spec(c)


def test_trainer_steers_the_table_from_the_step_metrics(tmp_path):
    from types import SimpleNamespace

    from sparrow_jax.rl.train_step import StepOptions
    from sparrow_jax.rl.trainer import online_settings, steer
    from sparrow_jax.run.context import build_schedule

    spec = _online_spec(tmp_path, "dense")
    layout = build_schedule(spec.schedule, str(tmp_path))  # a dense start keeps the configured layout
    assert (layout.page_size, layout.bin_width, layout.dense_layers) == (8, 64, (0,))
    settings = dataclasses.replace(online_settings(spec.schedule, layout, max_len=240, tau=0.86), min_tokens=100)
    assert settings.grid[-1] == 28 and settings.grid[0] == 1  # 240 / 8 - 3 reserved = 27 -> 28; min_topk 1
    loop = SimpleNamespace(opts=StepOptions(num_bins=4, bin_width=64), controller=settings)
    ctrl = init_controller(settings, (2,), 4)
    state = LoopState(None, None, controller_topk(settings, ctrl), jnp.asarray(False), jnp.zeros((2,), jnp.int32),
                      jax.random.PRNGKey(0), ctrl)
    metrics = {"mismatch/count/bin_0": 0.0,  # an empty bin's p5 is not logged
               "mismatch/alpha_p5/bin_64": 0.99, "mismatch/count/bin_64": 500.0,
               "mismatch/alpha_p5/bin_128": 0.5, "mismatch/count/bin_128": 500.0,
               "mismatch/alpha_p5/bin_192": 0.7, "mismatch/count/bin_192": 50.0}
    state, extra = steer(loop, state, metrics)
    np.testing.assert_array_equal(state.topk, [2, 2, 4, 4])  # bin 128 rose two levels, lifting the thin bin 192
    assert extra == {}  # a rise is never probed
    unsteered, extra = steer(SimpleNamespace(), state._replace(controller=None), metrics)
    assert unsteered.topk is state.topk and extra == {}  # not online


def test_online_loop_resumes_exactly_with_the_controller_in_the_checkpoint(tmp_path):
    """Online, dense start: 2 steps straight vs 1 step, a restart, 1 more: the same loop state, controller
    included; p5 = 1 at the dense budget, so after the second step (patience 2) bin 0 proposes a fall of one
    level, and the probe rejects it: its 8 completion tokens are too few for a p5 bound (< 59).
    Bin 0 (positions < 64, pages of 8) starts at its own dense top-k: 8 pages less 3 reserved."""
    from sparrow_jax.rl.trainer import train
    from sparrow_jax.run.context import build_run_context

    ctx = build_run_context(_online_spec(tmp_path / "a", "dense", 2))
    straight = train(_online_spec(tmp_path / "a", "dense", 2), ctx, progress=False)
    first = train(_online_spec(tmp_path / "b", "dense", 1), ctx, progress=False)
    resumed = train(_online_spec(tmp_path / "b", "dense", 2), ctx, progress=False)
    dense = [h["schedule/topk/bin_0"] for h in straight.history]
    assert dense == [h["schedule/topk/bin_0"] for h in first.history + resumed.history] == [5.0, 5.0]
    assert int(straight.state.topk[0]) == 5  # bin 0's fall to 4 (grid ... 4 5 6) was probed and rejected
    last = straight.history[-1]
    assert last["schedule/probe_topk/bin_0"] == 4.0 and last["schedule/probe_rejected"] >= 1
    assert "schedule/probe_lower/bin_0" not in last and "timing_s/probe" in last  # no bound from 8 tokens
    assert int(straight.state.controller.failed[0]) == 3  # grid 1 2 3 4 ...: top-k 4 remembered, not re-probed
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), straight.state, resumed.state)
    assert all(jax.tree.leaves(same)) and resumed.state.controller is not None


def test_schedule_metrics_log_budgets_and_cost_from_the_cost_model():
    from sparrow_jax import cost_model as cm
    from sparrow_jax.models import tiny_config
    from sparrow_jax.rl.trainer import schedule_metrics

    config = tiny_config()
    sched = SparsitySchedule((1, 2, 4), page_size=8, bin_width=64, dense_layers=(0,))
    kw = dict(num_samples=16, prompt_len=200, gen_len=24)
    m = schedule_metrics(sched, config, hardware="cpu", **kw)
    assert {k: v for k, v in m.items() if k.startswith("schedule/topk/")} == {
        "schedule/topk/bin_0": 1.0, "schedule/topk/bin_64": 2.0, "schedule/topk/bin_128": 4.0}
    cost = cm.sparse_rollout_cost(config, sched, hardware="cpu", **kw).time_s / cm.dense_rollout_cost(
        config, hardware="cpu", **kw).time_s
    assert m["schedule/predicted_cost_vs_dense"] == pytest.approx(cost)
    assert schedule_metrics(None, config, hardware="cpu", **kw) == {"schedule/predicted_cost_vs_dense": 1.0}
