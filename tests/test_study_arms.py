"""Study arms: each arm's run spec, the config check of study.arms, the p5-hold summary, and a
rerun that resumes at the first unfinished arm."""
import json
import math
import os
import types

import pytest

from sparrow_jax.run.specs import ConfigError, parse_spec
from sparrow_jax.run.study import WITHOUT_LORA, _arm_spec, p5_hold, paired_reward_diff, without_lora_spec


def _study_spec(arms=None):
    from configs.study_long import get_config

    cfg = get_config()
    if arms is not None:
        cfg.study.arms = arms
    return parse_spec(cfg)


def test_arm_specs_set_schedule_and_distill_per_arm():
    spec = _study_spec()
    assert set(spec.study.arms) >= {"dense", "calibrated", "aggressive", "online_dense", "online_aggressive",
                                    "online_distill"}
    got = {arm: _arm_spec(spec, arm) for arm in spec.study.arms}
    assert got["dense"].schedule.kind == "dense" and got["calibrated"].schedule.kind == "json"
    assert got["calibrated"].schedule.path.endswith("schedule.json")
    assert (got["aggressive"].schedule.kind, got["aggressive"].schedule.topk) == ("fixed", spec.study.aggressive_topk)
    for arm, start in (("online_dense", "dense"), ("online_aggressive", "fixed"), ("online_distill", "calibrated")):
        s = got[arm].schedule
        assert s.kind == "online" and s.online.start == start and s.topk == spec.study.aggressive_topk
        assert got[arm].distill.enabled == (arm == "online_distill")
    assert got["online_distill"].distill.compare_without is False
    assert all(a.workdir.endswith(name) and a.study is None for name, a in got.items())


def test_the_distill_comparison_arm_is_the_same_run_without_the_lora():
    from configs.distill_long_trace import get_config

    spec = parse_spec(get_config())
    arm = without_lora_spec(spec)
    assert spec.distill.enabled and spec.distill.compare_without and not arm.distill.enabled
    assert arm.workdir.endswith(WITHOUT_LORA) and arm.workdir.startswith(spec.workdir)
    assert (arm.schedule, arm.steps, arm.seed, arm.task) == (spec.schedule, spec.steps, spec.seed, spec.task)


@pytest.mark.parametrize("arms", [("dense", "bogus"), ("dense", "dense"), ()])
def test_bad_study_arms_name_the_field(arms):
    with pytest.raises(ConfigError, match="study.arms"):
        _study_spec(arms)


def _step(step, cells):
    h = {"step": step}
    for b, (p5, n) in cells.items():
        h[f"mismatch/alpha_p5/bin_{b}"], h[f"mismatch/count/bin_{b}"] = p5, n
    return h


def test_p5_hold_finds_the_first_step_all_full_bins_pass_then_counts_cells():
    hist = [_step(1, {0: (0.5, 500), 128: (0.9, 500)}),
            _step(2, {0: (0.9, 500), 128: (0.85, 500)}),  # 0.85 >= 0.84: both pass
            _step(3, {0: (0.8, 500), 128: (0.95, 10)}),   # bin 128 too thin to count
            _step(4, {0: (0.9, 500), 128: (0.9, 500)})]
    got = p5_hold(hist, threshold=0.84, min_tokens=256)
    assert got == {"reached_step": 2, "held_fraction": pytest.approx(4 / 5), "cells": 5}
    never = p5_hold(hist[:1], threshold=0.84, min_tokens=256)
    assert never["reached_step"] is None and never["held_fraction"] is None
    thin = p5_hold([_step(1, {0: (0.99, 5)})], threshold=0.84, min_tokens=256)  # no full bin: nothing reached
    assert thin == {"reached_step": None, "held_fraction": None, "cells": 0}
    # a bin dropping below the threshold after it was reached counts against the hold
    late = p5_hold(hist + [_step(5, {0: (0.5, 500), 128: (0.5, 500)})], threshold=0.84, min_tokens=256)
    assert late == {"reached_step": 2, "held_fraction": pytest.approx(4 / 7), "cells": 7}


def test_study_plot_grids_panels_per_arm_over_bins_with_tokens(tmp_path):
    from PIL import Image

    from sparrow_jax.run.study_plots import plot_study

    dense = [{"step": i, "reward_mean": 0.1 * i, "timing_s/gen": 1.0} for i in (1, 2, 3)]
    online = [dict(_step(i, {768: (0.9, 300), 896: (0.8, 0)}), reward_mean=0.1, **{
        "rollout/generated_tokens": 100.0, "rollout/decode_s": 0.5, "mismatch/alpha_mean": 0.99, "schedule/topk/bin_768": 8 * i,
        "schedule/topk/bin_896": 8}) for i in (1, 2, 3)]
    path = tmp_path / "study.png"
    plot_study({"dense": dense, "online_aggressive": online}, str(path))
    # 3 common panels + p5 and top-k panels of the online arm = 5: two rows of 4 columns
    width, height = Image.open(path).size
    assert height > 0.4 * width


def test_paired_reward_diff_matches_steps_and_gives_the_standard_error():
    ref = [{"step": s, "reward_mean": r} for s, r in ((1, 0.1), (2, 0.5), (3, 0.2), (4, 0.3))]
    arm = [{"step": s, "reward_mean": r} for s, r in ((2, 0.6), (3, 0.2), (4, 0.5), (5, 9.0))]  # step 5: no pair
    got = paired_reward_diff(arm, ref)
    # differences 0.1, 0.0, 0.2: mean 0.1, sd 0.1, se 0.1 / sqrt(3)
    assert got["steps"] == 3 and got["mean"] == pytest.approx(0.1) and got["se"] == pytest.approx(0.1 / math.sqrt(3))
    assert paired_reward_diff(arm[:1], ref) == {"mean": pytest.approx(0.1), "se": None, "steps": 1}


def test_study_rerun_resumes_at_the_first_unfinished_arm(tmp_path, monkeypatch):
    """Arms run in order; an arm whose report holds all steps is not trained again, the first
    unfinished one is (from its checkpoints, inside ``train``), and the table covers every arm
    from its logs. A rerun after the study finished trains nothing."""
    from sparrow_jax.io.metrics import MetricWriter
    from sparrow_jax.rollout import SparsitySchedule
    from sparrow_jax.run import study

    cfg = __import__("configs.study_long", fromlist=["get_config"]).get_config()
    cfg.workdir, cfg.steps, cfg.study.arms = str(tmp_path), 2, ("dense", "calibrated", "aggressive")
    spec = parse_spec(cfg)
    (tmp_path / "schedule.json").write_text("{}")  # calibration done (its schedule is stubbed below)
    trained = []

    class Ctx:
        train_rows = [0] * 8

    def fake_train(arm_spec, ctx):
        trained.append(arm_spec.workdir.rsplit("/", 1)[1])
        resumed = os.path.exists(os.path.join(arm_spec.workdir, "metrics.jsonl"))  # as if from step 1's checkpoint
        steps = (2,) if resumed else (1, 2)
        with MetricWriter(arm_spec.workdir, use_tensorboard=False) as w:
            for s in steps:
                w.write(s, {"reward_mean": 0.1 * s, "response_length/mean": 5.0})
        return types.SimpleNamespace(history=[{"step": s} for s in steps])

    monkeypatch.setattr(study, "train", fake_train)
    monkeypatch.setattr(study, "build_run_context", lambda *a: Ctx())
    monkeypatch.setattr(study, "build_schedule", lambda *a: SparsitySchedule.fixed(2))
    fake_train(_arm_spec(spec, "dense"), None)  # the dense arm finished in an earlier run ...
    (tmp_path / "dense" / "report.json").write_text(json.dumps({"steps": 2, "train_prompts": 8}))
    fake_train(_arm_spec(spec, "calibrated"), None)  # ... the calibrated arm died before its report
    trained.clear()
    report = study.run_study(spec)
    assert trained == ["calibrated", "aggressive"]
    assert set(report["arms"]) == {"dense", "calibrated", "aggressive"}
    assert report["arms"]["dense"]["reward_end"] == pytest.approx(0.15)  # rebuilt from the finished arm's log
    # a run's report records its wall time; a resumed run's covers only the process that finished it
    fresh, resumed = (json.loads((tmp_path / a / "report.json").read_text()) for a in ("aggressive", "calibrated"))
    assert fresh.pop("wall_s") >= 0 and fresh == {"steps": 2, "train_prompts": 8}
    assert resumed.pop("wall_s_partial") >= 0 and "wall_s" not in resumed
    assert report["wall_s"]["arms"]["calibrated"] == {"0": None} and report["wall_s"]["total"] is None
    trained.clear()
    study.run_study(spec)
    assert trained == []
