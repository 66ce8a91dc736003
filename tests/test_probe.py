"""The fall probe: the candidate budgets' p5 and its bound on given rollouts, the controller's rejections, the report."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from sparrow_jax.mismatch.probe import (LOWER_PERCENTILES, candidate_tail, p5_rank_lower_bound, probe_metrics,
                                        probe_report)
from sparrow_jax.mismatch.scorers import score_rollout
from sparrow_jax.mismatch.tail import binned_percentile, query_positions
from sparrow_jax.models import tiny_config
from sparrow_jax.models.qwen3 import init_params
from sparrow_jax.rollout.schedule import SparsitySchedule
from sparrow_jax.rollout.schedule_control import (ControllerSettings, controller_step_jit, controller_topk,
                                                  init_controller, probe_rejections, topk_grid)

CONFIG = tiny_config()
BIN, BINS = 32, 3
SETTINGS = ControllerSettings(grid=topk_grid(32, 4), tau=0.86, margin=0.03, up_levels=2, down_levels=2,
                              min_tokens=100, smoothing=0.5, z=1.64, patience=2, probe=True, probe_margin=0.02)


def _reference_rank(n: int, z: float) -> int:
    """Largest r in [0, n] with P(Binomial(n, 0.05) >= r) >= Phi(z), by scipy in float64."""
    conf = stats.norm.cdf(z)
    return max(r for r in range(n + 1) if (1.0 if r == 0 else stats.binom.sf(r - 1, n, 0.05)) >= conf)


def test_rank_bound_matches_the_binomial_reference():
    counts = [0, 1, 20, 58, 59, 60, 100, 250, 1000, 1130, 4000]
    got = np.asarray(p5_rank_lower_bound(jnp.asarray(counts), 1.64))
    want = [_reference_rank(n, 1.64) for n in counts]
    np.testing.assert_array_equal(got, want)
    assert want[3] == 0 and want[4] == 1  # 59 tokens: the smallest bound at 95% (1 - 0.95^59 >= 0.95)
    assert np.asarray(p5_rank_lower_bound(jnp.asarray([1000]), 0.0))[0] == _reference_rank(1000, 0.0)


@pytest.fixture(scope="module")
def rollouts():
    params = init_params(CONFIG, seed=0)
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(1, CONFIG.vocab_size, size=(6, 96)), jnp.int32)
    prompt_lens = jnp.asarray([20, 24, 16, 30, 20, 22], jnp.int32)
    ends = np.asarray([96, 80, 96, 70, 90, 96])
    t = np.arange(96)[None, :]
    mask = (t >= np.asarray(prompt_lens)[:, None]) & (t < ends[:, None])
    return params, tokens, jnp.asarray(mask), prompt_lens


def _schedule(topk):
    return SparsitySchedule(tuple(topk), page_size=8, bin_width=BIN, dense_layers=(0,))


def test_candidate_tail_matches_the_scorer_and_the_host_percentiles(rollouts):
    """p5 per bin equals numpy's over the scorer's alpha at the candidate table; the bound is the order
    statistic of the binomial rank, rounded down onto the percentiles read."""
    params, tokens, mask, prompt_lens = rollouts
    sched = _schedule((1, 1, 2))
    out = jax.device_get(candidate_tail(CONFIG, params, params, tokens, mask, prompt_lens, sched, num_bins=BINS,
                                        bin_width=BIN, seq_chunk=32, z=1.64))
    alpha = np.asarray(score_rollout(CONFIG, params, params, tokens, prompt_lens, schedule=sched, top_k=0)["alpha"])
    pos = np.minimum(np.broadcast_to(query_positions(96), alpha.shape), BINS * BIN - 1)  # the last bin pools later
    starts, p5, counts = binned_percentile(alpha, pos, np.asarray(mask), BIN, 5.0)
    assert list(starts) == [0, 32, 64]
    np.testing.assert_array_equal(out["count"], counts)
    np.testing.assert_allclose(out["p5"], p5, atol=1e-6)
    assert (p5[1:] < 0.999).all()  # beyond the reserved pages the table changes alpha: real tails
    for i in range(BINS):
        v = np.sort(alpha[(pos // BIN == i) & np.asarray(mask)])
        r = _reference_rank(len(v), 1.64)
        if r == 0:
            assert out["lower"][i] == -np.inf
            continue
        exact_q = 100.0 * (r - 1) / (len(v) - 1)
        q = max(g for g in LOWER_PERCENTILES if g <= exact_q + 1e-9)
        np.testing.assert_allclose(out["lower"][i], np.percentile(v, q), atol=1e-6)
        assert out["lower"][i] <= v[r - 1] + 1e-6 and out["lower"][i] <= out["p5"][i]
    assert np.isfinite(out["lower"][1])  # the middle bin is full: a real bound


def test_a_covering_table_reads_alpha_one_and_budgets_in_a_bucket_compile_once(rollouts):
    params, tokens, mask, prompt_lens = rollouts
    kw = dict(num_bins=BINS, bin_width=BIN, seq_chunk=32, z=1.64)
    dense = jax.device_get(candidate_tail(CONFIG, params, params, tokens, mask, prompt_lens, _schedule((12, 12, 12)),
                                          **kw))
    np.testing.assert_allclose(dense["p5"], 1.0, atol=1e-5)  # every page kept: sparse == dense
    n0 = candidate_tail._cache_size()
    for table in ((3, 3, 4), (3, 4, 4), (4, 4, 4)):  # one k_max bucket (4): traced tables, no new program
        candidate_tail(CONFIG, params, params, tokens, mask, prompt_lens, _schedule(table), **kw)
    assert candidate_tail._cache_size() - n0 == 1


def _feed(state, p5, counts, steps):
    for _ in range(steps):
        state, _ = controller_step_jit(SETTINGS, state, jnp.asarray(p5, jnp.float32), jnp.asarray(counts, jnp.float32))
    return state


def test_a_rejected_fall_holds_is_remembered_and_the_next_candidate_is_one_level():
    """Two bins at top-k 16 read p5 ~1 (a two-level fall each): bin 0's candidate bound clears tau + margin
    (0.88) and falls; bin 1's does not: it holds, its rejected level joins the failed memory, and next
    step it proposes one level only."""
    grid = SETTINGS.grid
    state = _feed(init_controller(SETTINGS, (16, 16), 2), [0.999, 0.999], [400, 400], 1)
    p5, n = jnp.asarray([0.999, 0.999], jnp.float32), jnp.asarray([400, 400], jnp.float32)
    proposed, topk = controller_step_jit(SETTINGS, state, p5, n)
    np.testing.assert_array_equal(topk, [12, 12])  # two levels: 16 -> 14 -> 12
    rejected = probe_rejections(SETTINGS, state, proposed, jnp.asarray([0.90, 0.87]))
    np.testing.assert_array_equal(rejected, [-1, grid.index(12)])
    assert probe_rejections(SETTINGS, state, proposed, jnp.asarray([0.90, -jnp.inf]))[1] == grid.index(12)  # no bound
    after, topk = controller_step_jit(SETTINGS, state, p5, n, rejected)
    np.testing.assert_array_equal(topk, [12, 16])  # monotone: bin 1 holds above bin 0
    assert int(after.failed[1]) == grid.index(12) and int(after.failed_age[1]) == 0
    assert int(after.steps[1]) == 2 and float(after.weight[1]) > 0  # a held bin keeps its evidence
    # next step: bin 1 may fall, but only above the rejected level: one level, to 14
    _, topk = controller_step_jit(SETTINGS, after, p5, n)
    assert int(topk[1]) == 14
    # without rejections the step is the plain controller's, array or None
    same, topk_none = controller_step_jit(SETTINGS, state, p5, n, jnp.full((2,), -1, jnp.int32))
    np.testing.assert_array_equal(topk_none, [12, 12])
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(proposed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_rises_and_thin_bins_are_never_probed():
    """Bin 0 is thin (a free bin: it follows bin 1 down by the projection), bin 1 falls, bin 2 rises: with
    no bound anywhere only bin 1's fall is rejected, and bin 0 then follows bin 1's held budget."""
    counts = jnp.asarray([10, 400, 400], jnp.float32)
    state = _feed(init_controller(SETTINGS, (16, 16, 16), 3), [0.999, 0.999, 0.87], counts, 1)
    p5 = jnp.asarray([0.999, 0.999, 0.80], jnp.float32)
    proposed, topk = controller_step_jit(SETTINGS, state, p5, counts)
    np.testing.assert_array_equal(topk, [12, 12, 24])  # bin 2 rose two levels (0.06 short of tau)
    rejected = probe_rejections(SETTINGS, state, proposed, jnp.full((3,), -jnp.inf))
    np.testing.assert_array_equal(rejected >= 0, [False, True, False])
    _, topk = controller_step_jit(SETTINGS, state, p5, counts, rejected)
    np.testing.assert_array_equal(topk[:2], [16, 16])


def test_settings_check_the_probe_margin():
    with pytest.raises(ValueError, match="probe_margin"):
        dataclasses.replace(SETTINGS, probe_margin=-0.1)


def test_probe_report_pairs_kept_falls_with_the_next_steps_p5():
    history = [
        {"step": 1, "schedule/topk/bin_0": 16.0, "mismatch/alpha_p5/bin_0": 0.99, "mismatch/count/bin_0": 300.0},
        {"step": 2, "schedule/topk/bin_0": 16.0, "mismatch/alpha_p5/bin_0": 0.98, "mismatch/count/bin_0": 300.0,
         "schedule/probe_p5/bin_0": 0.95, "schedule/probe_topk/bin_0": 12.0, "timing_s/probe": 1.5,
         "schedule/probe_p5/bin_148": 0.80, "schedule/probe_topk/bin_148": 12.0, "schedule/probe_rejected": 1.0},
        {"step": 3, "schedule/topk/bin_0": 12.0, "mismatch/alpha_p5/bin_0": 0.91, "mismatch/count/bin_0": 300.0,
         "schedule/topk/bin_148": 16.0, "mismatch/alpha_p5/bin_148": 0.97, "mismatch/count/bin_148": 300.0,
         "schedule/probe_p5/bin_0": 0.90, "schedule/probe_topk/bin_0": 10.0, "timing_s/probe": 0.5},
        {"step": 4, "schedule/topk/bin_0": 10.0, "mismatch/alpha_p5/bin_0": 0.93, "mismatch/count/bin_0": 20.0},
    ]
    out = probe_report(history, min_count=200)["probe_error"]
    assert out["by_bin"] == {"0": {"pairs": 1, "mean_abs_error": pytest.approx(0.04),
                                   "worst_abs_error": pytest.approx(0.04), "mean_error": pytest.approx(-0.04)}}
    # bin 148's fall was rejected (sampled at 16, not 12): no pair; step 4's bin 0 has too few tokens
    assert out["pairs"] == 1 and out["probes"] == 2 and out["rejected"] == 1 and out["probe_s"] == 2.0
    assert probe_report(history[:1]) == {}
    m = probe_metrics([0, 148], np.asarray([12, 12]), np.asarray([True, True]),
                      {"p5": np.asarray([0.95, 0.8]), "lower": np.asarray([0.93, -np.inf])}, np.asarray([-1, 3]))
    assert m == {"schedule/probe_rejected": 1.0, "schedule/probe_p5/bin_0": 0.95, "schedule/probe_lower/bin_0": 0.93,
                 "schedule/probe_topk/bin_0": 12.0, "schedule/probe_p5/bin_148": 0.8,
                 "schedule/probe_topk/bin_148": 12.0}
    assert math.isclose(out["mean_abs_error"], 0.04)


def test_probe_config_is_on_for_online_runs_and_its_margin_is_checked():
    from configs.grpo_tiny import get_config
    from sparrow_jax.run.specs import ConfigError, parse_spec

    c = get_config()
    c.schedule.kind = "online"
    o = parse_spec(c).schedule.online
    assert o.probe is True and o.probe_margin == 0.02
    c.schedule.online.probe_margin = 1.0
    with pytest.raises(ConfigError, match="schedule.online.probe_margin"):
        parse_spec(c)
