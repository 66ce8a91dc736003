"""The fall probe: the candidate budgets' p5 and its bound on given rollouts, the controller's rejections, the report."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.mismatch.probe import (candidate_tail, group_draws, grouped_p5_lower_bound, probe_metrics,
                                        probe_report)
from sparrow_jax.mismatch.scorers import score_rollout
from sparrow_jax.mismatch.tail import binned_percentile, query_positions
from sparrow_jax.models import tiny_config
from sparrow_jax.models.qwen3 import init_params
from sparrow_jax.rollout.schedule import SparsitySchedule
from sparrow_jax.rollout.schedule_control import (ControllerSettings, controller_step_jit,
                                                  init_controller, probe_rejections, topk_grid)

CONFIG = tiny_config()
BIN, BINS = 32, 3
SETTINGS = ControllerSettings(grid=topk_grid(32, 4), tau=0.86, margin=0.03, up_levels=2, down_levels=2,
                              min_tokens=100, smoothing=0.5, z=1.64, patience=2, probe=True, probe_margin=0.02)


def _reference_bound(alpha, bins, mask, groups, num_bins, confidence, resamples, seed):
    """The bound spelled out: each resample's tokens listed with repetition, numpy's inverted-CDF p5."""
    draws = group_draws(len(set(groups)), resamples, seed)
    out = []
    for b in range(num_bins):
        p5s = []
        for counts in draws:
            v = np.concatenate([np.repeat(alpha[r][mask[r] & (bins[r] == b)], counts[groups[r]])
                                for r in range(len(groups))])
            if v.size:
                p5s.append(np.percentile(v, 5.0, method="inverted_cdf"))
        out.append(np.quantile(p5s, 1 - confidence, method="lower"))
    return np.asarray(out)


def test_grouped_bound_matches_the_spelled_out_bootstrap():
    rng = np.random.default_rng(0)
    alpha = rng.uniform(0.7, 1.0, size=(8, 40))
    bins = np.broadcast_to(np.arange(40) // 20, (8, 40))
    mask = rng.uniform(size=(8, 40)) < 0.8
    groups = np.arange(8) // 2
    got = grouped_p5_lower_bound(alpha, bins, mask, groups, 2, confidence=0.9, resamples=50, seed=3, min_tokens=1)
    np.testing.assert_allclose(got, _reference_bound(alpha, bins, mask, groups, 2, 0.9, 50, 3), atol=0)
    # one group has its tail far lower: a bound over prompts sees it, well below the pooled p5
    alpha[:2, :] *= 0.5
    low = grouped_p5_lower_bound(alpha, bins, mask, groups, 2, confidence=0.9, resamples=200, seed=3)
    pooled = [np.percentile(alpha[mask & (bins == b)], 5.0) for b in range(2)]
    assert (low < 0.5).all() and (np.asarray(pooled) < 0.5).all()
    healthy = grouped_p5_lower_bound(alpha[2:], bins[2:], mask[2:], groups[2:], 2, confidence=0.9, seed=3,
                                     min_tokens=1)
    assert (healthy > 0.7).all()


def test_grouped_bound_edge_cases():
    alpha, bins = np.full((4, 6), 0.9), np.broadcast_to(np.arange(6) // 2, (4, 6))
    mask = np.ones((4, 6), bool)
    mask[:, 4:] = False  # bin 2 empty
    mask[2:, 2:4] = False  # bin 1: only group 0 reaches it
    out = grouped_p5_lower_bound(alpha, bins, mask, np.asarray([0, 0, 1, 1]), 3, min_tokens=8)
    assert out[0] == 0.9 and out[1] == -np.inf and np.isnan(out[2])
    assert grouped_p5_lower_bound(alpha, bins, mask, np.asarray([0, 0, 1, 1]), 3, min_tokens=9)[0] == -np.inf


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
    """p5 per bin equals numpy's over the scorer's alpha at the candidate table; alpha and bins come back
    for the grouped bound."""
    params, tokens, mask, prompt_lens = rollouts
    sched = _schedule((1, 1, 2))
    out = jax.device_get(candidate_tail(CONFIG, params, params, tokens, mask, prompt_lens, sched, num_bins=BINS,
                                        bin_width=BIN, seq_chunk=32))
    alpha = np.asarray(score_rollout(CONFIG, params, params, tokens, prompt_lens, schedule=sched, top_k=0)["alpha"])
    pos = np.minimum(np.broadcast_to(query_positions(96), alpha.shape), BINS * BIN - 1)  # the last bin pools later
    starts, p5, counts = binned_percentile(alpha, pos, np.asarray(mask), BIN, 5.0)
    assert list(starts) == [0, 32, 64]
    np.testing.assert_array_equal(out["count"], counts)
    np.testing.assert_allclose(out["p5"], p5, atol=1e-6)
    np.testing.assert_allclose(out["alpha"], alpha, atol=1e-6)
    np.testing.assert_array_equal(out["bins"], pos // BIN)
    assert (p5[1:] < 0.999).all()  # beyond the reserved pages the table changes alpha: real tails
    lower = grouped_p5_lower_bound(out["alpha"], out["bins"], np.asarray(mask), np.arange(6) // 2, BINS, min_tokens=1)
    assert (lower <= out["p5"] + 0.02).all()  # a bound over draws of prompts sits at or under the step's p5


def test_a_covering_table_reads_alpha_one_and_budgets_in_a_bucket_compile_once(rollouts):
    params, tokens, mask, prompt_lens = rollouts
    kw = dict(num_bins=BINS, bin_width=BIN, seq_chunk=32)
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
