"""The headline study's machinery on synthetic logs: arm specs of the new arms and the seed layout,
refused study fields, the per-arm table over seeds against hand computations, headline.png, and a
two-seed study (training stubbed) that resumes seed by seed."""
import dataclasses
import json
import math
import os
import types

import numpy as np
import pytest

from sparrow_jax.run.headline import SeedRun, arm_summary, combine_seeds, curve_area, held_out, relative_step_time
from sparrow_jax.run.specs import ConfigError, parse_spec, validate
from sparrow_jax.run.study import _arm_spec, arm_row


def _config(**study):
    from configs.headline import get_config

    cfg = get_config()
    for k, v in study.items():
        cfg.study[k] = v
    return cfg


def test_new_arms_and_one_directory_per_seed():
    spec = parse_spec(_config())
    assert spec.study.seeds == (0, 1) and spec.study.low_tau == 0.75
    for seed in (0, 1):
        got = {arm: _arm_spec(spec, arm, seed) for arm in spec.study.arms}
        assert all(a.workdir == f"{spec.workdir}/{arm}/seed_{seed}" and a.seed == seed and a.study is None
                   for arm, a in got.items())
        for arm, tau in (("calibrated_low", 0.75), ("calibrated_high", 0.92)):
            other = got[arm]
            assert (other.schedule.kind, other.schedule.path) == ("json", f"{spec.workdir}/{arm}/schedule.json")
            assert other.calibration.tau == tau and got["calibrated"].calibration.tau == spec.calibration.tau
        assert got["calibrated"].schedule.path == f"{spec.workdir}/schedule.json"
        assert got["random_reward"].schedule.kind == "dense" and got["random_reward"].train.random_reward
        assert not any(got[a].train.random_reward for a in ("dense", "calibrated", "calibrated_low", "online_dense"))
    # one seed (or none: the run's) keeps the single-seed layout <workdir>/<arm>
    for seeds, expect in (((), spec.seed), ((3,), 3)):
        one = _arm_spec(parse_spec(_config(seeds=seeds)), "random_reward")
        assert (one.workdir, one.seed) == (f"{spec.workdir}/random_reward", expect)


def test_the_distill_arm_updates_whole_rows_and_passes_validation():
    # the config's horizon groups do not combine with DistillSparse: its arm alone updates whole rows
    spec = parse_spec(_config(arms=("dense", "online_distill")))
    assert spec.train.horizon_groups == 4
    arm = _arm_spec(spec, "online_distill", 0)
    assert arm.distill.enabled and arm.train.horizon_groups == 0
    assert _arm_spec(spec, "dense", 0).train.horizon_groups == 4
    validate(arm)  # the arm's own spec: what the distill arm would have refused


def test_online_arms_score_every_step_whatever_the_study_sets():
    # the controller reads every step's p5; the fixed-schedule arms keep the study's mismatch_every
    cfg = _config(arms=("dense", "calibrated", "online_dense", "online_distill"))
    cfg.train.mismatch_every = 4
    spec = parse_spec(cfg)
    for arm in ("online_dense", "online_distill"):
        got = _arm_spec(spec, arm, 0)
        assert got.train.mismatch_every == 1
        validate(got)
    assert _arm_spec(spec, "calibrated", 0).train.mismatch_every == 4


@pytest.mark.parametrize("field, value, arms", [
    ("seeds", (0, 0), None), ("seeds", (-1,), None), ("seeds", ("a",), None), ("seeds", (True,), None),
    ("low_tau", 0.9, None), ("low_tau", 0.0, None), ("low_tau", 0.86, None),
    ("high_tau", 0.86, None), ("high_tau", 1.0, None), ("high_tau", 0.5, None),
    ("arms", ("dense", "bogus"), None)])
def test_bad_study_fields_name_the_field(field, value, arms):
    with pytest.raises(ConfigError, match=f"study.{field}"):
        parse_spec(_config(**{field: value}))


def test_low_and_high_tau_are_read_only_with_their_arms():
    spec = parse_spec(_config(low_tau=0.95, high_tau=0.5, arms=("dense", "calibrated")))
    assert (spec.study.low_tau, spec.study.high_tau) == (0.95, 0.5)


def test_combine_seeds_adds_shared_prompt_error_and_between_seed_spread():
    mean, se = combine_seeds([0.5, 0.3], [0.04, 0.03])
    # within: mean(0.04^2, 0.03^2) = 0.00125; between: var(0.5, 0.3) / 2 = 0.02 / 2
    assert mean == pytest.approx(0.4) and se == pytest.approx(math.sqrt(0.00125 + 0.01))
    assert combine_seeds([0.5], [0.04]) == (pytest.approx(0.5), pytest.approx(0.04))  # one seed: its own
    assert combine_seeds([0.5, None], [0.04, None]) == (pytest.approx(0.5), pytest.approx(0.04))
    assert combine_seeds([0.5], [None]) == (pytest.approx(0.5), None)
    assert combine_seeds([], []) == (None, None)


def test_curve_area_is_the_mean_height_over_the_run():
    assert curve_area([0, 3, 6], [0.2, 0.3, 0.5], 6) == pytest.approx((0.75 + 1.2) / 6)
    assert curve_area([0, 3, 6], [0.2, None, 0.5], 6) == pytest.approx(0.35 * 6 / 6)
    assert curve_area([0], [0.4], 6) == pytest.approx(0.4) and curve_area([], [], 6) is None


def _val(points):
    steps = [{"step": s, "reward_mean@4": v, "reward_mean@4_se": se} for s, v, se in points]
    return {"metric": "reward_mean@4", "start": points[0][1], "end": points[-1][1], "start_se": points[0][2],
            "end_se": points[-1][2], "steps": steps}


def test_held_out_over_two_seeds_by_hand():
    got = held_out([_val([(0, 0.2, 0.05), (3, 0.3, 0.05), (6, 0.5, 0.04)]),
                    _val([(0, 0.2, 0.05), (3, 0.5, 0.06), (6, 0.3, 0.03)]), None], total_steps=6)
    assert got["seeds"] == 2 and got["metric"] == "reward_mean@4"
    assert (got["start"], got["start_se"]) == (pytest.approx(0.2), pytest.approx(0.05))
    assert (got["end"], got["end_se"]) == (pytest.approx(0.4), pytest.approx(math.sqrt(0.00125 + 0.01)))
    # changes 0.3 and 0.1 with se^2 0.05^2 + 0.04^2 = 0.0041 and 0.05^2 + 0.03^2 = 0.0034
    assert got["change"] == pytest.approx(0.2)
    assert got["change_se"] == pytest.approx(math.sqrt((0.0041 + 0.0034) / 2 + 0.02 / 2))
    # areas (0.75 + 1.2) / 6 = 0.325 and (1.05 + 1.2) / 6 = 0.375
    assert got["auc"] == pytest.approx(0.35) and got["auc_se"] == pytest.approx(0.025)
    assert [p["step"] for p in got["curve"]] == [0, 3, 6] and got["curve"][1]["mean"] == pytest.approx(0.4)
    assert held_out([None], 6) is None


def _records(p5_by_step, val, gen_s, probe_s=0.0, kept=0.5):
    """Synthetic metrics.jsonl of one seed: validation at 0, 3, 6; steps 1-6 with bin 0's p5 / count."""
    out = [{"step": 0, "val/dense/reward_mean@4": val[0], "val/dense/reward_mean@4_se": 0.05}]
    for step in range(1, 7):
        p5, n = p5_by_step.get(step, (0.95, 100))
        r = {"step": step, "reward_mean": 0.1 * step, "response_length/mean": 50.0,
             "rollout/generated_tokens": 1000.0, "rollout/decode_s": gen_s, "rollout/sparse_token_fraction": 0.5,
             "timing_s/gen": gen_s, "timing_s/update_actor": 2.0, "schedule/predicted_cost_vs_dense": 0.5,
             "schedule/topk/bin_0": 8.0, "rollout/kept_page_share": kept,
             "mismatch/count/bin_0": float(n), "mismatch/alpha_p5/bin_0": p5, "mismatch/alpha_mean/bin_0": 0.97}
        if probe_s:
            r["timing_s/probe"] = probe_s
        if step in (3, 6):
            r.update({"val/dense/reward_mean@4": val[step // 3], "val/dense/reward_mean@4_se": 0.05})
        out.append(r)
    return out


def _hist(bucket, tokens=100):
    counts = np.zeros(1000, np.int64)
    counts[bucket] = tokens
    return [(1, {0: counts})]


def _two_seeds(spec):
    runs = {0: SeedRun(_records({2: (0.7, 100), 3: (0.5, 10)}, (0.2, 0.3, 0.5), gen_s=1.0, kept=0.4), _hist(900),
                       {"steps": 6, "rollout_speedup": 1.9}),
            1: SeedRun(_records({1: (0.6, 100)}, (0.2, 0.5, 0.3), gen_s=2.0, probe_s=1.0, kept=0.2), _hist(500),
                       {"steps": 6})}
    rows = {s: arm_row(spec, "calibrated", run.records, run.histograms, window=2) for s, run in runs.items()}
    return rows, runs


def test_arm_summary_over_two_seeds_by_hand():
    cfg = _config()
    cfg.steps, cfg.calibration.min_count = 6, 50
    spec = _arm_spec(parse_spec(cfg), "calibrated", 0)
    rows, runs = _two_seeds(spec)
    got = arm_summary(spec, rows, runs)
    assert got["seeds"] == [0, 1] and set(got["per_seed"]) == {"0", "1"}
    assert got["held_out"]["end"] == pytest.approx(0.4) and got["held_out"]["auc"] == pytest.approx(0.35)
    # windows of 2 steps: 0.15 -> 0.55 in both seeds
    assert (got["reward_start"], got["reward_end"]) == (pytest.approx(0.15), pytest.approx(0.55))
    # bin 0 pooled over both seeds' tokens (100 at 0.9005, 100 at 0.5005): p5 is seed 1's
    (pooled,) = got["p5_by_bin"]
    assert pooled["count"] == 510 + 600 and pooled["p5"] == pytest.approx(0.5005)
    assert got["min_p5"] == pytest.approx(0.5005)
    # the worst full step: seed 1's step 1 (0.6); seed 0's 0.5 at step 3 has 10 < 50 tokens
    assert got["p5_min_step_by_bin"] == [{"bin_start": 0, "p5": 0.6, "step": 1, "seed": 1}]
    # step seconds after the first: 3, 3, 3, 3, 3 (seed 0) and 5 x 5 (seed 1): median 4
    assert got["step_time_median_s"] == pytest.approx(4.0)
    assert got["gen_tokens_per_s"] == pytest.approx((1000 + 500) / 2)
    assert got["kept_page_share"] == pytest.approx(0.3)  # 1000 tokens a step in both seeds
    assert got["predicted_cost_end"] == pytest.approx(0.5) and got["rollout_speedup"] == pytest.approx(1.9)
    one = arm_summary(spec, {0: rows[0]}, {0: runs[0]})  # one seed: its own row plus the figures
    assert "per_seed" not in one and one["val_dense"] == rows[0]["val_dense"]
    assert one["held_out"]["end"] == pytest.approx(0.5) and one["held_out"]["end_se"] == pytest.approx(0.05)
    table = {"dense": {"step_time_median_s": 8.0}, "calibrated": got, "other": {"step_time_median_s": None}}
    relative_step_time(table)
    assert table["calibrated"]["step_time_vs_dense"] == pytest.approx(2.0) and table["dense"]["step_time_vs_dense"] == 1
    assert table["other"]["step_time_vs_dense"] is None


def test_kept_page_share_by_hand():
    from sparrow_jax.mismatch.calibrate import kept_page_share
    from sparrow_jax.rollout import SparsitySchedule

    # pages of 4 tokens, 1 + 1 reserved pages; top-k 1 below position 16, then 3
    s = SparsitySchedule(topk=(1, 3), bin_width=16, page_size=4, reserved_first=1, reserved_last=1,
                         dense_layers=(0,))
    # row 0: tokens 8..11 see 2, 3, 3, 3 pages and keep all (3 allowed); row 1: tokens 12..19 see
    # 3, 4, 4, 4, 4, 5, 5, 5 pages and keep 3 up to token 16 (queries < 16), then 5: 3/3, 4 x 3/4, 3 x 5/5
    assert kept_page_share(s, np.array([8, 12]), np.array([12, 20])) == pytest.approx(11 / 12)
    assert kept_page_share(s, np.array([8, 12]), np.array([12, 20]), num_layers=2) == pytest.approx(23 / 24)
    assert kept_page_share(None, np.array([8]), np.array([12])) == 1.0


def test_headline_plot_writes_a_small_png(tmp_path):
    from PIL import Image

    from sparrow_jax.run.study_plots import plot_headline
    from sparrow_jax.run.report import training_rows

    cfg = _config()
    cfg.steps, cfg.calibration.min_count = 6, 50
    spec = _arm_spec(parse_spec(cfg), "calibrated", 0)
    rows, runs = _two_seeds(spec)
    table = {"dense": arm_summary(spec, rows, runs), "calibrated": arm_summary(spec, rows, runs)}
    seed_rows = [training_rows(run.records) for run in runs.values()]
    dense_rows = [[{k: v for k, v in r.items() if not k.startswith("schedule/")} for r in s] for s in seed_rows]
    path = tmp_path / "headline.png"
    assert plot_headline(table, {"dense": dense_rows, "calibrated": seed_rows}, str(path), taus={"calibrated": 0.86})
    # held-out curves, tokens/s, and one p5 panel (the dense arm logged no schedule): one row of 3
    width, height = Image.open(path).size
    assert width > 3 * height and path.stat().st_size < 400_000
    assert not plot_headline({"dense": {"seeds": [0]}}, {"dense": [[{"step": 1}]]}, str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists()


def _stub_study(monkeypatch, tmp_path, build_schedule=None):
    """``study``'s training, calibration, speedup timing and contexts stubbed: every run logs two steps
    whose reward is 0.1 x step + 0.01 x seed. ``build_schedule(spec_schedule, workdir)`` gives the
    schedules (default: top-k 2 everywhere). -> (fake_train, trained, calibrations, timed)."""
    from sparrow_jax.io.metrics import MetricWriter
    from sparrow_jax.rollout import SparsitySchedule
    from sparrow_jax.run import study

    trained, calibrations, timed = [], [], []

    class Ctx:
        train_rows = [0] * 8

    def fake_train(arm_spec, ctx):
        trained.append(arm_spec.workdir[len(str(tmp_path)) + 1:])
        history = [{"step": s, "reward_mean": 0.1 * s + 0.01 * arm_spec.seed, "response_length/mean": 5.0,
                    "timing_s/gen": 1.0, "timing_s/update_actor": 1.0, "rollout/generated_tokens": 10.0,
                    "rollout/decode_s": 0.5, "rollout/sparse_token_fraction": 0.0} for s in (1, 2)]
        with MetricWriter(arm_spec.workdir, use_tensorboard=False) as w:
            for h in history:
                w.write(h["step"], {k: v for k, v in h.items() if k != "step"})
        return types.SimpleNamespace(workdir=arm_spec.workdir, history=history)

    def fake_calibrate(arm_cal_spec):
        calibrations.append((arm_cal_spec.workdir, arm_cal_spec.calibration.tau))
        os.makedirs(arm_cal_spec.workdir, exist_ok=True)
        with open(os.path.join(arm_cal_spec.workdir, "schedule.json"), "w") as f:
            f.write("{}")

    def fake_speedup(ctx, result):
        timed.append(result.workdir[len(str(tmp_path)) + 1:])
        return {"rollout_speedup": 2.0}

    monkeypatch.setattr(study, "train", fake_train)
    monkeypatch.setattr(study, "calibrate_run", fake_calibrate)
    monkeypatch.setattr(study, "measure_rollout_speedup", fake_speedup)
    monkeypatch.setattr(study, "build_run_context", lambda *a: Ctx())
    monkeypatch.setattr(study, "build_schedule", build_schedule or (lambda *a: SparsitySchedule.fixed(2)))
    return fake_train, trained, calibrations, timed


def test_two_seed_study_resumes_seed_by_seed_and_calibrates_the_low_arm(tmp_path, monkeypatch):
    """(arm, seed) runs in order, a finished one skipped; calibrated_low is calibrated once at low_tau
    into its own directory; the first seed's report keeps the measured speedup; the table holds
    every arm over both seeds; the finished study, rerun, adds its final evaluation, then an arm."""
    from sparrow_jax.run import study

    cfg = _config(arms=("dense", "calibrated_low", "random_reward"), final_eval_prompts=0)
    cfg.workdir, cfg.steps = str(tmp_path), 2
    spec = parse_spec(cfg)
    (tmp_path / "schedule.json").write_text("{}")  # the main calibration is done
    fake_train, trained, calibrations, timed = _stub_study(monkeypatch, tmp_path)
    fake_train(_arm_spec(spec, "dense", 0), None)  # dense seed 0 finished earlier ...
    (tmp_path / "dense" / "seed_0" / "report.json").write_text(json.dumps({"steps": 2, "train_prompts": 8}))
    trained.clear()
    report = study.run_study(spec)
    assert trained == ["dense/seed_1", "calibrated_low/seed_0", "calibrated_low/seed_1", "random_reward/seed_0",
                       "random_reward/seed_1"]
    assert calibrations == [(f"{tmp_path}/calibrated_low", 0.75)]
    assert timed == ["calibrated_low/seed_0", "random_reward/seed_0"]  # the first seed of each arm run now
    assert report["seeds"] == [0, 1] and report["low_tau"] == 0.75
    assert set(report["arms"]) == {"dense", "calibrated_low", "random_reward"}
    row = report["arms"]["random_reward"]
    assert row["reward_end"] == pytest.approx(0.205) and set(row["per_seed"]) == {"0", "1"}
    assert row["rollout_speedup"] == 2.0 and "rollout_speedup" not in report["arms"]["dense"]
    assert row["step_time_vs_dense"] == pytest.approx(1.0)
    assert (tmp_path / "headline.png").exists() and (tmp_path / "study.png").exists()
    # wall time: every run trained now has its own; dense seed 0 (finished before runs recorded it) and
    # the calibrations (stubbed: no calibration.json) are not measured, so neither is the total
    wall = report["wall_s"]
    assert wall["arms"]["dense"]["0"] is None and wall["total"] is None
    assert all(wall["arms"][a][s] >= 0 for a in ("calibrated_low", "random_reward") for s in ("0", "1"))
    assert wall["calibration"] == {"calibrated": None, "calibrated_low": None} and wall["final_eval"] is None
    trained.clear()
    study.run_study(spec)
    assert trained == [] and len(calibrations) == 1

    # a finished study asked later for its paired final evaluation runs that and trains nothing
    from sparrow_jax.run.pipeline import run_pipeline

    evaluated = []
    runs = {name: {"reward_mean@4": [0.5, 0.7], "reward_greedy": [1.0, 1.0]}
            for name in ("start", "dense/seed_0", "dense/seed_1", "random_reward/seed_0", "random_reward/seed_1")}
    monkeypatch.setattr(study, "evaluate_final", lambda s, workdirs: evaluated.append(workdirs) or
                        {"prompts": 2, "k": 4, "seed": 0, "steps": s.steps, "runs": runs,
                         "seconds": {name: 5.0 for name in runs}})
    for d in (tmp_path, tmp_path / "calibrated_low"):  # the calibrations, timed now
        (d / "calibration.json").write_text(json.dumps({"seconds": 30.0}))
    dense_0 = tmp_path / "dense" / "seed_0" / "report.json"
    dense_0.write_text(json.dumps({**json.loads(dense_0.read_text()), "wall_s": 60.0}))
    cfg.study.final_eval_prompts = 2
    with_eval = parse_spec(cfg)
    for _ in range(2):  # the second call finds the evaluation in the report
        report = run_pipeline(with_eval)
    assert trained == [] and len(evaluated) == 1
    assert evaluated[0]["random_reward"] == {s: f"{tmp_path}/random_reward/seed_{s}" for s in (0, 1)}
    fig = report["final_eval"]["reward_mean@4"]
    assert report["final_eval"]["prompts"] == 2 and fig["arms"]["random_reward"]["vs_dense"] == 0.0
    wall = report["wall_s"]  # every part measured now: the total is their sum
    assert wall["final_eval"] == 25.0 and wall["calibration"] == {"calibrated": 30.0, "calibrated_low": 30.0}
    arm_s = [t for by_seed in wall["arms"].values() for t in by_seed.values()]
    assert wall["arms"]["dense"]["0"] == 60.0 and wall["total"] == pytest.approx(85.0 + sum(arm_s), abs=0.2)

    # an arm added to the finished study later: calibrated at high_tau into its own directory, trained
    # beside the finished arms (which stay untouched), then evaluated
    runs.update({f"calibrated_high/seed_{s}": {"reward_mean@4": [0.5, 0.6], "reward_greedy": [1.0, 1.0]}
                 for s in (0, 1)})
    cfg.study.arms = ("dense", "calibrated_low", "calibrated_high", "random_reward")
    report = run_pipeline(parse_spec(cfg))
    assert trained == ["calibrated_high/seed_0", "calibrated_high/seed_1"]
    assert calibrations[-1] == (f"{tmp_path}/calibrated_high", 0.92) and report["high_tau"] == 0.92
    assert report["final_eval"]["reward_mean@4"]["arms"]["calibrated_high"]["vs_dense"] == pytest.approx(-0.05)


@pytest.mark.parametrize("arms", [("dense", "calibrated", "calibrated_low", "calibrated_high"),
                                  ("dense", "calibrated_low", "calibrated", "calibrated_high")])
def test_an_other_tau_arm_with_the_calibrated_schedule_reuses_the_calibrated_run(tmp_path, monkeypatch, arms):
    """calibrated_low derives the calibrated arm's schedule (labels aside): it is the same run, so the
    study trains and evaluates it once (first, when it comes before the calibrated arm), reports it
    under both names (marked, and in final_eval.json), and counts its time once; calibrated_high's
    schedule differs and trains."""
    from sparrow_jax.rollout import SparsitySchedule
    from sparrow_jax.run import study

    def schedules(s, workdir):  # calibrated_high's calibration picked more pages
        topk = 4 if workdir.endswith("calibrated_high") else 2
        return dataclasses.replace(SparsitySchedule.fixed(topk), name=os.path.basename(workdir), meta={"w": workdir})

    cfg = _config(arms=arms, final_eval_prompts=2)
    cfg.workdir, cfg.steps = str(tmp_path), 2
    (tmp_path / "schedule.json").write_text("{}")
    _, trained, calibrations, _ = _stub_study(monkeypatch, tmp_path, schedules)
    evaluated = []

    def fake_evaluate(s, workdirs):
        evaluated.append(workdirs)
        runs = {"start": {"reward_mean@4": [0.5, 0.5], "reward_greedy": [1.0, 1.0]}}
        runs.update({f"{a}/seed_{seed}": {"reward_mean@4": [0.6 + 0.1 * (a == "calibrated"), 0.6],
                                          "reward_greedy": [1.0, 1.0]} for a in workdirs for seed in (0, 1)})
        return {"prompts": 2, "k": 4, "seed": 0, "steps": s.steps, "runs": runs, "seconds": {n: 1.0 for n in runs}}

    monkeypatch.setattr(study, "evaluate_final", fake_evaluate)
    plotted = {}
    monkeypatch.setattr(study, "plot_headline", lambda table, rows, path, taus: plotted.update(taus))
    os.makedirs(tmp_path / "calibrated_low")
    (tmp_path / "calibrated_low" / "calibration.json").write_text(json.dumps({"seconds": 30.0}))
    report = study.run_study(parse_spec(cfg))
    assert [c[1] for c in calibrations] == [0.75, 0.92]  # both other taus calibrated
    assert trained == [f"{a}/seed_{s}" for a in ("dense", "calibrated", "calibrated_high") for s in (0, 1)]
    arms = report["arms"]
    assert arms["calibrated_low"]["same_run_as"] == "calibrated" and "same_run_as" not in arms["calibrated_high"]
    assert arms["calibrated_low"]["reward_end"] == arms["calibrated"]["reward_end"]
    assert set(evaluated[0]) == {"dense", "calibrated", "calibrated_high"}
    assert json.loads((tmp_path / "final_eval.json").read_text())["same_run_as"] == {"calibrated_low": "calibrated"}
    fig = report["final_eval"]["reward_mean@4"]["arms"]
    assert fig["calibrated_low"]["vs_dense"] == fig["calibrated"]["vs_dense"] == pytest.approx(0.05)
    # headline.png draws the run once, named for both arms, with the calibrated arm's tau
    assert plotted == {"dense": 0.86, "calibrated = calibrated_low": 0.86, "calibrated_high": 0.92}
    wall = report["wall_s"]  # the reused run counted once, its own calibration counted
    assert "calibrated_low" not in wall["arms"] and wall["calibration"]["calibrated_low"] == 30.0
    assert wall["final_eval"] == 7.0  # the start and 3 arms x 2 seeds evaluated, 1 s each


def test_same_schedule_compares_the_pages_not_the_labels():
    from sparrow_jax.rollout import SparsitySchedule
    from sparrow_jax.run.study import same_schedule

    a = SparsitySchedule.fixed(2)
    assert same_schedule(dataclasses.replace(a, name="x", meta={"tau": 0.75}), a)
    assert not same_schedule(SparsitySchedule.fixed(3), a)
    assert not same_schedule(dataclasses.replace(a, reserved_first=3), a)
    assert same_schedule(None, None) and not same_schedule(None, a)


def test_p5_series_join_the_scored_steps_of_a_run_scored_every_other_step():
    """With ``train.mismatch_every=2`` the p5 is logged on steps 1 and 3 only: the panel's line runs
    through those points (NaN gaps would leave no line at all); a step where a bin got no tokens
    is left out of that bin's line."""
    from sparrow_jax.run.study_plots import p5_by_bin_over_steps

    rows = [{"step": 1, "mismatch/count/bin_0": 50.0, "mismatch/alpha_p5/bin_0": 0.9,
             "mismatch/count/bin_16": 0.0, "mismatch/alpha_p5/bin_16": 0.0},
            {"step": 2},
            {"step": 3, "mismatch/count/bin_0": 40.0, "mismatch/alpha_p5/bin_0": 0.8,
             "mismatch/count/bin_16": 10.0, "mismatch/alpha_p5/bin_16": 0.7},
            {"step": 4}]
    assert p5_by_bin_over_steps(rows) == {"bin 0": ([1, 3], [0.9, 0.8]), "bin 16": ([3], [0.7])}
