"""The run report's figures from the logged steps: pooled tail statistics, validation series,
measured sparse share, paired speedup, the evaluation's definitions, and the logs they read."""
import json
import math

import numpy as np
import pytest

from sparrow_jax.io.metrics import HistogramWriter, MetricWriter, read_histograms, read_metrics
from sparrow_jax.mismatch.tail import binned_histogram_jax, query_positions
from sparrow_jax.run.report import (generated_tokens_per_s, measured_sparse_token_fraction, p5_dips,
                                    p5_hold_fraction, p5_min_step_by_bin, pooled_p5_by_bin, training_report,
                                    val_series)
from sparrow_jax.stats import histogram_percentile


def test_pooled_histogram_percentile_matches_numpy_on_the_pooled_tokens():
    """Per-step histograms summed over steps give each bin's 5th percentile of all its tokens to
    within half a bucket, where a token-weighted mean of per-step p5s does not."""
    rng = np.random.RandomState(0)
    steps = [rng.beta(20, 1, (8, 40)), np.clip(rng.normal(0.3, 0.05, (8, 40)), 0, 1)]  # a step at ~0.24 p5
    masks = [rng.rand(8, 40) > 0.3 for _ in steps]
    pos = np.broadcast_to(query_positions(40), (8, 40))
    pooled = sum(np.asarray(binned_histogram_jax(v.astype(np.float32), pos, m, 2, 20)) for v, m in zip(steps, masks))
    for b, sl in enumerate((slice(0, 21), slice(21, 40))):  # query position t-1: bin 0 holds tokens 0..20
        tokens = np.concatenate([v[:, sl][m[:, sl]] for v, m in zip(steps, masks)]).astype(np.float32)
        assert pooled[b].sum() == tokens.size
        for q in (5.0, 50.0, 95.0):
            assert abs(histogram_percentile(pooled[b], q) - np.percentile(tokens, q)) <= 5e-4 + 1e-7
    assert math.isnan(histogram_percentile(np.zeros(1000), 5.0))


def _row(step, cells, **extra):
    r = {"step": step, "reward_mean": extra.pop("reward", 0.5), "response_length/mean": 10.0, **extra}
    for b, (p5, n, mean) in cells.items():
        r[f"mismatch/alpha_p5/bin_{b}"], r[f"mismatch/count/bin_{b}"] = p5, n
        r[f"mismatch/alpha_mean/bin_{b}"] = mean
    return r


def _hist(values):
    counts = np.zeros(1000, np.int64)
    np.add.at(counts, np.minimum((np.asarray(values) * 1000).astype(int), 999), 1)
    return counts


def test_pooled_p5_worst_step_and_hold_fraction():
    good, bad = np.linspace(0.9, 1.0, 300), np.linspace(0.2, 1.0, 100)
    rows = [_row(1, {0: (np.percentile(good, 5), 300, good.mean()), 148: (0.95, 10, 0.97), 296: (np.nan, 0, np.nan)}),
            _row(2, {0: (np.percentile(bad, 5), 100, bad.mean())})]
    hists = [(1, {0: _hist(good), 148: _hist(np.full(10, 0.95))}), (2, {0: _hist(bad)}),
             (3, {0: _hist(np.zeros(50))})]  # a step beyond the logged ones (a run cut short): ignored
    got = pooled_p5_by_bin(rows, hists)
    pooled = np.concatenate([good, bad])
    assert [b["bin_start"] for b in got] == [0, 148] and [b["count"] for b in got] == [400, 10]
    assert got[0]["p5"] == pytest.approx(np.percentile(pooled, 5), abs=5e-4)
    weighted = (300 * np.percentile(good, 5) + 100 * np.percentile(bad, 5)) / 400  # the old figure
    assert abs(got[0]["p5"] - weighted) > 0.05
    assert got[0]["mean"] == pytest.approx(pooled.mean())
    worst = p5_min_step_by_bin(rows, min_count=50)
    assert worst == [{"bin_start": 0, "p5": pytest.approx(np.percentile(bad, 5)), "step": 2},
                     {"bin_start": 148, "p5": None, "step": None}]  # 10 tokens: below min_count
    hold = p5_hold_fraction(rows, threshold=0.84, min_count=50)
    assert hold == {"p5_hold_fraction": 0.5, "p5_hold_cells": 2}
    assert p5_hold_fraction(rows, 0.84, min_count=10**6) == {"p5_hold_fraction": None, "p5_hold_cells": 0}


def test_p5_dips_name_the_budget_move_into_each_dip():
    """Cells below the threshold with enough tokens, each with its budget's move from the step before."""
    topk = lambda a, b: {"schedule/topk/bin_0": a, "schedule/topk/bin_64": b}  # noqa: E731
    rows = [_row(1, {0: (0.70, 300, 0.9), 64: (0.95, 300, 0.9)}, **topk(16, 16)),  # first step: held
            _row(2, {0: (0.80, 300, 0.9), 64: (0.83, 300, 0.9)}, **topk(12, 16)),  # bin 0 fell, bin 64 held
            _row(3, {0: (0.82, 300, 0.9), 64: (0.50, 100, 0.9)}, **topk(16, 12)),  # bin 0 rose; bin 64 too thin
            _row(4, {0: (0.99, 300, 0.9), 64: (0.84, 300, 0.9)}, **topk(16, 12))]  # at the threshold: no dip
    got = p5_dips(rows, threshold=0.84, min_count=200)
    assert {k: got[k] for k in ("fell", "held", "rose")} == {"fell": 1, "held": 2, "rose": 1}
    assert [(c["step"], c["bin_start"], c["move"], c["topk"]) for c in got["cells"]] == [
        (1, 0, "held", 16), (2, 0, "fell", 12), (2, 64, "held", 16), (3, 0, "rose", 16)]
    dense = p5_dips([_row(1, {0: (0.5, 300, 0.9)}), _row(2, {0: (0.5, 300, 0.9)})], 0.84, 200)  # no schedule
    assert dense["held"] == 2 and dense["fell"] == dense["rose"] == 0


def test_val_series_start_end_and_every_point():
    val = lambda s, m, se: {"val/dense/reward_mean@2": m, "val/dense/reward_mean@2_se": se,  # noqa: E731
                            "val/dense/success@2": 0.25, "val/dense/success@2_se": float("nan"), "step": s}
    records = [val(0, 0.1, 0.01), _row(1, {}), {**_row(2, {}), **val(2, 0.3, 0.02)}, val(4, 0.4, 0.03)]
    got = val_series(records, "dense", 2)
    assert (got["metric"], got["start"], got["end"], got["start_se"], got["end_se"]) == ("reward_mean@2", 0.1, 0.4,
                                                                                         0.01, 0.03)
    assert [p["step"] for p in got["steps"]] == [0, 2, 4]
    assert got["steps"][1] == {"step": 2, "reward_mean@2": 0.3, "reward_mean@2_se": 0.02, "success@2": 0.25,
                               "success@2_se": None}
    assert val_series(records, "sparse", 2) is None


def test_measured_sparse_share_is_token_weighted_and_counts_dense_layers():
    from sparrow_jax.mismatch.calibrate import sparse_token_fraction
    from sparrow_jax.rollout import SparsitySchedule

    rows = [{"rollout/generated_tokens": 100.0, "rollout/sparse_token_fraction": 1.0},
            {"rollout/generated_tokens": 300.0, "rollout/sparse_token_fraction": 0.0}, {"step": 0}]
    assert measured_sparse_token_fraction(rows) == pytest.approx(0.25)
    assert measured_sparse_token_fraction([]) == 0.0
    s = SparsitySchedule.fixed(1, page_size=4, bin_width=64, reserved_first=1, reserved_last=1, dense_layers=(0,))
    # tokens 20..23 see 5-6 pages and keep 3: all sparse on the sparse layers; 1 of 2 layers is dense
    assert sparse_token_fraction(s, np.array([20]), np.array([24])) == 1.0
    assert sparse_token_fraction(s, np.array([20]), np.array([24]), num_layers=2) == 0.5
    assert sparse_token_fraction(s, np.array([20]), np.array([24]), num_layers=4) == 0.75


def test_generated_tokens_per_s_skips_the_compiling_first_step():
    rows = [{"rollout/generated_tokens": 10.0, "rollout/decode_s": 100.0},
            {"rollout/generated_tokens": 300.0, "rollout/decode_s": 1.0},
            {"rollout/generated_tokens": 100.0, "rollout/decode_s": 3.0}]
    assert generated_tokens_per_s(rows) == pytest.approx(400.0 / 4.0)
    assert generated_tokens_per_s(rows[:1]) is None


def test_speedup_is_the_median_of_paired_ratios_with_their_spread():
    from sparrow_jax.run.speed import speedup_summary

    out = speedup_summary([10.0, 20.0, 16.0], [15.0, 22.0, 24.0])  # ratios 1.5, 1.1, 1.5
    assert out["rollout_speedup"] == pytest.approx(1.5)
    assert (out["dense_tok_s"], out["sparse_tok_s"]) == (16.0, 22.0)  # each side's median
    assert out["rollout_speedup_paired"] == pytest.approx({"min": 1.1, "median": 1.5, "max": 1.5, "repeats": 3})
    for dense, sparse in (([10.0, 20.0], [15.0]), ([], [])):
        with pytest.raises(ValueError, match="as many sparse as dense"):
            speedup_summary(dense, sparse)


def test_evaluate_success_needs_a_fully_correct_sample(monkeypatch):
    """success@k counts prompts with a reward-1 sample (partial credit is no success); greedy and
    sampled rewards come with their standard errors over prompts; greedy decodes at temperature 0."""
    import dataclasses

    from sparrow_jax.rl import trainer
    from sparrow_jax.rollout import SamplingParams

    seen = []

    def fake_sample(ctx, params, examples, key, repeats, schedule, pool=None):
        seen.append((ctx.sampling.temperature, repeats))
        if repeats == 1:
            return None, np.asarray([1.0, 0.5, 0.0], np.float32)
        return None, np.asarray([0.5, 0.5, 1.0, 0.0, 0.9, 0.9], np.float32)  # 3 prompts x k=2

    monkeypatch.setattr(trainer, "sample", fake_sample)

    @dataclasses.dataclass(frozen=True)
    class Ctx:
        sampling: SamplingParams

    out = trainer.evaluate(Ctx(SamplingParams(temperature=0.7)), None, None, [{}, {}, {}], 2, None)
    assert seen == [(0.0, 1), (0.7, 2)]
    assert out["success@2"] == pytest.approx(1 / 3)  # only prompt 1 has a reward-1 sample
    assert out["reward_mean@2"] == pytest.approx(np.mean([0.5, 0.5, 0.9]))
    assert out["reward_mean@2_se"] == pytest.approx(np.std([0.5, 0.5, 0.9], ddof=1) / np.sqrt(3))
    assert out["reward_greedy"] == pytest.approx(0.5)
    assert out["reward_greedy_se"] == pytest.approx(np.std([1.0, 0.5, 0.0], ddof=1) / np.sqrt(3))
    assert "pass@2" not in out


def test_eval_interval_gives_at_least_four_points():
    from sparrow_jax.rl.trainer import eval_interval

    for steps in range(3, 101):
        every = eval_interval(steps, 0)
        points = {0, steps} | set(range(every, steps + 1, every))
        assert len(points) >= 4, steps
    assert eval_interval(24, 0) == 8  # the quickstart: steps 0, 8, 16, 24
    assert eval_interval(24, 5) == 5


def test_logs_trim_on_resume_and_a_fresh_start_drops_all(tmp_path):
    bins = [0, 148]
    with MetricWriter(tmp_path, use_tensorboard=False) as w:
        for s in (0, 1, 2, 3):
            w.write(s, {"x": float(s)})
    hw = HistogramWriter(tmp_path)
    for s in (1, 2, 3):
        hw.write(s, np.asarray([[0, s, 0], [2, 0, 0]]), bins)
    hw.close()
    got = read_histograms(tmp_path)
    assert [s for s, _ in got] == [1, 2, 3]
    np.testing.assert_array_equal(got[1][1][0], [0, 2, 0])
    np.testing.assert_array_equal(got[1][1][148], [2, 0, 0])
    HistogramWriter(tmp_path, resume_step=2).close()
    MetricWriter(tmp_path, use_tensorboard=False, resume_step=2).close()
    assert [s for s, _ in read_histograms(tmp_path)] == [1, 2]
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    MetricWriter(tmp_path, use_tensorboard=False, resume_step=-1).close()
    HistogramWriter(tmp_path, resume_step=-1).close()
    assert read_metrics(tmp_path) == [] and read_histograms(tmp_path) == []
    with pytest.raises(ValueError, match="counts"):
        HistogramWriter(tmp_path).write(4, np.zeros((3, 5)), bins)
    with pytest.raises(ValueError, match="resume_step"):
        MetricWriter(tmp_path, resume_step=-2)


def test_training_report_is_a_function_of_the_logs():
    rows = [_row(s, {0: (0.9, 100, 0.95)}, reward=0.1 * s, **{"rollout/generated_tokens": 10.0,
                                                              "rollout/sparse_token_fraction": 1.0})
            for s in range(1, 9)]
    hists = [(s, {0: _hist(np.linspace(0.8, 1.0, 100))}) for s in range(1, 9)]
    kw = dict(num_prompts=8, prompts_per_step=2, steps=8, eval_k=2, tau=0.86, min_count=50)
    got = training_report([{"step": 0, "val/dense/reward_mean@2": 0.0, "val/dense/reward_mean@2_se": 0.1}] + rows,
                          hists, **kw)
    assert (got["reward_start"], got["reward_end"], got["reward_window_steps"]) == (pytest.approx(0.25),
                                                                                    pytest.approx(0.65), 4)
    assert got["trained_steps"] == 8 and got["sparse_token_fraction"] == 1.0 and got["p5_hold_fraction"] == 1.0
    assert got["val_dense"]["start"] == 0.0 and got["final_eval"] == {"val/dense/reward_mean@2": 0.0,
                                                                      "val/dense/reward_mean@2_se": 0.1}
    json.dumps(got, allow_nan=False)  # strict JSON as it is


def test_a_resumed_run_reports_the_calibration_its_first_attempt_wrote(tmp_path):
    """A run killed after calibrating resumes without calibrating again: its report takes the
    validation from the workdir's calibration.json, as the uninterrupted run's report does."""
    import json

    from sparrow_jax.run.pipeline import calibration_on_disk

    assert calibration_on_disk(str(tmp_path)) is None
    validation = {"bin_starts": [0, 16], "p5": [0.97, 0.91], "ok": True}
    (tmp_path / "calibration.json").write_text(json.dumps({"tau": 0.86, "validation": validation}))
    assert calibration_on_disk(str(tmp_path)) == {"validation": validation,
                                                  "table_path": str(tmp_path / "calibration.json"),
                                                  "png": str(tmp_path / "p5_by_position.png")}
