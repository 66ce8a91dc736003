"""Bad input is refused at parse time in one line naming ``--config.<field>`` (exit status 2 from
the entry points), or works: a corrupted checkpoint falls back to the step before, a run killed
by an exception keeps its logged metrics, non-finite rewards are zeroed and counted, and a
calibration that fails validation stops the run before RL."""
import dataclasses
import json
import os
import subprocess
import sys
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from configs.grpo_tiny import get_config
from sparrow_jax.models import init_params, tiny_config
from sparrow_jax.run.specs import ConfigError, parse_spec
from tests.test_io import read_tb_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**fields):
    cfg = get_config()
    for dotted, value in fields.items():
        section, _, leaf = dotted.replace("__", ".").rpartition(".")
        node = cfg
        for part in filter(None, section.split(".")):
            node = node[part]
        setattr(node, leaf, value)
    return cfg


# ---- parse time ------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,match", [
    (dict(rollout__temperature=0.0), r"^--config\.rollout\.temperature=0\.0: must be > 0 \(greedy rollouts"),
    (dict(rollout__top_p=0.9), r"^--config\.rollout\.top_p=0\.9: must be 1 \(the train step scores the untruncated"),
    (dict(rollout__top_k=5), r"^--config\.rollout\.top_k=5: must be 0 \(the train step scores the untruncated"),
    (dict(train__clip_low=1.0), r"^--config\.train\.clip_low=1\.0: must be < 1"),
    (dict(train__reward_horizon_mask=True, train__dynamic_sampling=True),
     r"^--config\.train\.reward_horizon_mask=True: does not combine with train\.dynamic_sampling"),
    (dict(train__horizon_groups=2), r"^--config\.train\.horizon_groups=2: cuts rows at their reward horizon: it needs "
                                    r"train\.reward_horizon_mask=True"),
    (dict(train__horizon_groups=3, train__reward_horizon_mask=True),
     r"^--config\.train\.horizon_groups=3: times train\.micro_batches=1 must divide rollout\.prompts_per_step"),
    (dict(train__horizon_groups=2, train__reward_horizon_mask=True, train__ppo_epochs=2),
     r"^--config\.train\.horizon_groups=2: needs a single on-policy update"),
    (dict(train__horizon_groups=2, train__reward_horizon_mask=True, train__tis_mask_low=0.5, train__tis_mask_high=2.0),
     r"^--config\.train\.horizon_groups=2: does not combine with ratio masking"),
    (dict(train__mismatch_every=0), r"^--config\.train\.mismatch_every=0: must be > 0"),
    (dict(train__mismatch_every=4, schedule__kind="online"),
     r"^--config\.train\.mismatch_every=4: must be 1 with schedule\.kind='online' \(the controller reads"),
    (dict(train__mismatch_every=2, distill__enabled=True),
     r"^--config\.train\.mismatch_every=2: must be 1 with distill\.enabled"),
    (dict(train__frozen_params="self_attn("), r"^--config\.train\.frozen_params='self_attn\(': is not a regular expression"),
    (dict(train__lr_scale_params="norm(", train__lr_scale=10.0),
     r"^--config\.train\.lr_scale_params='norm\(': is not a regular expression"),
    (dict(train__lr_scale_params="norm", train__lr_scale=0.0), r"^--config\.train\.lr_scale=0\.0: must be > 0"),
    (dict(train__lr_scale=10.0), r"^--config\.train\.lr_scale=10\.0: scales no parameter"),
    (dict(calibration__min_survival=1.5), r"^--config\.calibration\.min_survival=1\.5: must be in \[0, 1\]"),
    (dict(calibration__survival_unmeasured="dense"),
     r"^--config\.calibration\.survival_unmeasured='dense': must be one of \('free', 'largest'\)"),
    (dict(calibration__survival_decoding="beam"),
     r"^--config\.calibration\.survival_decoding='beam': must be one of \('sampled', 'greedy'\)"),
    (dict(rollout__engine="continuous", mesh__data=2), r"^--config\.rollout\.engine='continuous': runs on one device.*"
                                                       r"the mesh has 2"),
    (dict(task__dataset="rows.parquet"),
     r"^--config\.task\.num_train=64: must be 0 with task\.dataset='rows\.parquet'"),
    (dict(task__num_train=0), r"^--config\.task\.num_train=0: must be > 0"),
    (dict(task__key_letters=1), r"^--config\.task\.key_letters=1: only task recurrence_trace reads it"),
    (dict(task__name="recurrence_trace", task__key_letters=3), r"^--config\.task\.key_letters=3: must be 1 or 2"),
    (dict(model__tiny__vocab_size=128),
     r"^--config\.model\.tiny\.vocab_size=128: is the tokenizer's; remove the field"),
    (dict(schedule__kind="preset", schedule__preset="qwen3-4b-0.86"),
     r"^--config\.schedule\.page_size=8: schedule\.preset 'qwen3-4b-0\.86' fixes it to 16"),
    (dict(schedule__kind="preset", schedule__preset="qwen3-4b-0.86", schedule__page_size=16),
     r"^--config\.schedule\.bin_width=64: schedule\.preset 'qwen3-4b-0\.86' fixes it to 2000"),
    (dict(schedule__kind="preset", schedule__preset="qwen3-5b-0.86"), r"^--config\.schedule\.preset='qwen3-5b-0\.86': "
                                                                      r"expected one of \["),
    (dict(schedule__dense_layers=(0, 4)), r"^--config\.schedule\.dense_layers=\(0, 4\): layers \[4\] are not in the "
                                          r"model's 4"),
    (dict(tokenizer="/no/such/tokenizer"), r"^--config\.tokenizer='/no/such/tokenizer': expected 'builtin' or an "
                                           r"existing tokenizer directory$"),
    (dict(model__source="hf", model__hf_dir="/no/such/model"),
     r"^--config\.model\.hf_dir='/no/such/model': is not a directory holding a Hugging Face config\.json$"),
])
def test_inert_or_broken_fields_are_refused_naming_the_field(fields, match):
    with pytest.raises(ConfigError, match=match) as err:
        parse_spec(_cfg(**fields))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("field", ["frozen_params", "lr_scale_params"])
@pytest.mark.parametrize("pattern,what", [("attn_out", "no"), (".", "every")])
def test_parameter_regexes_must_match_some_but_not_every_parameter(field, pattern, what):
    from types import SimpleNamespace

    from sparrow_jax.data.registry import get_task
    from sparrow_jax.rl.trainer import make_loop

    spec = parse_spec(_cfg(**{f"train__{field}": pattern}))
    ctx = SimpleNamespace(schedule=None, task=get_task(spec.task.name), params=init_params(tiny_config(), seed=0))
    with pytest.raises(ValueError, match=rf"train.{field}='{pattern}' matches {what} parameter of the model "
                                         r"\(names like 'layers.0.input_layernorm.weight'"):
        make_loop(spec, ctx)


def test_a_reward_horizon_mask_needs_a_task_that_defines_one():
    from types import SimpleNamespace

    from sparrow_jax.data.registry import get_task
    from sparrow_jax.rl.trainer import make_loop

    spec = parse_spec(_cfg(train__reward_horizon_mask=True))  # grpo_tiny: pointer_chase_partial
    with pytest.raises(ValueError, match="train.reward_horizon_mask=True: task 'pointer_chase_partial' defines no "
                                         "reward horizon"):
        make_loop(spec, SimpleNamespace(schedule=None, task=get_task(spec.task.name)))


def test_the_working_variants_parse():
    """What the refusals point to: a dataset with num_train 0, a preset with its own layout,
    the hf model's own layer count, allow_failed off by default."""
    spec = parse_spec(_cfg(task__dataset="rows.parquet", task__num_train=0))
    assert (spec.task.dataset, spec.task.num_train, spec.calibration.allow_failed) == ("rows.parquet", 0, False)
    preset = dict(schedule__kind="preset", schedule__preset="qwen3-4b-0.86", schedule__page_size=16,
                  schedule__bin_width=2000, schedule__dense_layers=(0, 1))
    assert parse_spec(_cfg(**preset)).schedule.bin_width == 2000
    assert parse_spec(_cfg(schedule__dense_layers=(0, 3))).schedule.dense_layers == (0, 3)  # 4 layers


def test_dense_layers_are_checked_against_an_hf_models_layer_count(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    base = dict(model__source="hf", model__hf_dir=str(tmp_path))
    assert parse_spec(_cfg(**base, schedule__dense_layers=(1,))).schedule.dense_layers == (1,)
    with pytest.raises(ConfigError, match=r"dense_layers=\(0, 2\): layers \[2\] are not in the model's 2"):
        parse_spec(_cfg(**base, schedule__dense_layers=(0, 2)))


def _entry(module, *args, timeout=120):
    out = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    return out.returncode, out.stderr.strip().splitlines()


MISSING = ("error: --config=configs/no_such_config.py: cannot load the config file ([Errno 2] No such file or "
           "directory: 'configs/no_such_config.py')")


@pytest.mark.parametrize("args,line", [
    (["--config", "configs/no_such_config.py"], MISSING),  # read while the override is parsed
    (["--config=configs/no_such_config.py", None], MISSING),  # no override: read when parsed into a spec
    ([None], "error: --config is required: a config file, e.g. --config configs/quickstart.py"),
    (["--config", "configs/grpo_tiny.py", "--config.model.source=hf", "--config.model.hf_dir=/no/such/model"],
     "error: --config.model.hf_dir='/no/such/model': is not a directory holding a Hugging Face config.json"),
    (["--config", "configs/grpo_tiny.py", "--config.rollout.temperature=0"],
     "error: --config.rollout.temperature=0.0: must be > 0 (greedy rollouts give every group one completion, "
     "hence no advantage to learn from)"),
])
def test_the_run_entry_reports_bad_input_in_one_line(args, line, tmp_path):
    workdir = f"--config.workdir={tmp_path / 'run'}"  # None: no override
    rc, lines = _entry("experiments.run", *[a for a in args if a is not None], *([workdir] if None not in args else []))
    assert (rc, lines) == (2, [line])
    assert not os.path.exists(tmp_path / "run")


# ---- calibration -----------------------------------------------------------------------------

def test_calibrating_into_a_runs_workdir_is_refused_without_force(tmp_path):
    from sparrow_jax.run.calibration import check_calibration_target

    workdir = tmp_path / "run"
    check_calibration_target(str(workdir), force=False)  # no directory yet
    os.makedirs(workdir / "checkpoints")
    (workdir / "schedule.json").write_text("{}")
    check_calibration_target(str(workdir), force=True)
    rc, lines = _entry("experiments.calibrate", "--config", "configs/calibrate_tiny.py",
                       f"--config.workdir={workdir}")
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0] == (f"error: --config.workdir='{workdir}' holds a run ({workdir / 'checkpoints'}); calibrating "
                        "would replace its schedule.json and calibration.json: pass --force to replace them, or "
                        "choose another --config.workdir")
    assert sorted(os.listdir(workdir)) == ["checkpoints", "schedule.json"]
    assert (workdir / "schedule.json").read_text() == "{}"


def _fake_calibration(monkeypatch, p5):
    """calibrate / validate stand-ins: a two-bin schedule whose fresh-prompt p5 is ``p5``."""
    from sparrow_jax.run import calibration

    def calibrate(config, params, prompts, budgets, tau, base, *a, **kw):
        table = dict(budgets=list(budgets), bin_starts=[0, 64], p5=[[0.9, 0.9]] * len(budgets),
                     mean=[[1.0, 1.0]] * len(budgets), count=[[50, 50]] * len(budgets))
        return dict(schedule=dataclasses.replace(base, topk=(2, 4)), table=table, flagged_bins=[], inherited_bins=[],
                    cost_s=0.0, per_budget={})

    def validate(*a, tau, min_count, **kw):
        return dict(bin_starts=[0, 64], p5=list(p5), mean=[1.0, 1.0], count=[50, 50], tau=tau, margin=0.02,
                    meets=[p >= tau - 0.02 for p in p5], ok=all(p >= tau - 0.02 for p in p5))

    monkeypatch.setattr(calibration, "calibrate", calibrate)
    monkeypatch.setattr(calibration, "validate", validate)


def test_a_calibration_that_fails_validation_stops_the_run_before_rl(tmp_path, monkeypatch):
    from sparrow_jax.run import pipeline

    _fake_calibration(monkeypatch, p5=(0.95, 0.70))
    trained = []
    monkeypatch.setattr(pipeline, "train", lambda *a, **kw: trained.append(1))
    spec = parse_spec(_cfg(workdir=str(tmp_path / "run"), schedule__kind="calibrated"))
    with pytest.raises(ConfigError, match=r"^--config\.calibration\.allow_failed=False: the calibrated schedule "
                                          r"failed validation on fresh prompts \(bin 64: p5 0\.700; needs >= 0\.840\); "
                                          r"no schedule\.json written") as err:
        pipeline.run_pipeline(spec)
    assert "\n" not in str(err.value) and not trained
    assert sorted(os.listdir(tmp_path / "run")) == ["calibration.json", "config.json", "p5_by_position.png"]
    assert json.loads((tmp_path / "run" / "calibration.json").read_text())["validation"]["meets"] == [True, False]


def test_allow_failed_writes_the_failed_schedule_and_a_passing_one_is_written(tmp_path, monkeypatch):
    from sparrow_jax.run.calibration import calibrate_run

    _fake_calibration(monkeypatch, p5=(0.95, 0.70))
    spec = parse_spec(_cfg(workdir=str(tmp_path / "a"), schedule__kind="calibrated", calibration__allow_failed=True))
    assert calibrate_run(spec, progress=False)["validation"]["ok"] is False
    assert json.loads((tmp_path / "a" / "schedule.json").read_text())["topk"] == [2, 4]
    _fake_calibration(monkeypatch, p5=(0.95, 0.90))
    spec = parse_spec(_cfg(workdir=str(tmp_path / "b"), schedule__kind="calibrated"))
    assert calibrate_run(spec, progress=False)["validation"]["ok"] is True
    assert json.loads((tmp_path / "b" / "schedule.json").read_text())["topk"] == [2, 4]


def test_revalidation_raises_the_failed_bins_and_validates_on_new_fresh_prompts(tmp_path, monkeypatch):
    from sparrow_jax.run import calibration

    _fake_calibration(monkeypatch, p5=(0.95, 0.70))
    first_validate, seen = calibration.validate, []

    def validate(config, params, prompts, schedule, *a, **kw):  # fails until bin 64 has 16 pages
        seen.append((schedule.topk, [tuple(p) for p in prompts]))
        out = first_validate(config, params, prompts, schedule, *a, **kw)
        return out if schedule.topk[1] < 16 else dict(out, p5=[0.95, 0.9], meets=[True, True], ok=True)

    monkeypatch.setattr(calibration, "validate", validate)
    spec = parse_spec(_cfg(workdir=str(tmp_path / "a"), schedule__kind="calibrated", calibration__revalidate_rounds=3,
                           calibration__budgets=(1, 2, 4, 8, 16, 32)))
    result = calibration.calibrate_run(spec, progress=False)
    assert result["validation"]["ok"] is True and [t for t, _ in seen] == [(2, 4), (2, 8), (2, 16)]
    assert len({tuple(p) for _, p in seen}) == 3  # each round validates on prompts no earlier round saw
    assert json.loads((tmp_path / "a" / "schedule.json").read_text())["topk"] == [2, 16]
    assert json.loads((tmp_path / "a" / "calibration.json").read_text())["raised"] == [
        dict(from_topk=[2, 4], to_topk=[2, 8], failed_bins=[[64, 0.7]]),
        dict(from_topk=[2, 8], to_topk=[2, 16], failed_bins=[[64, 0.7]])]
    # out of rounds: the last raised schedule still fails, so the run stops before RL as without rounds
    seen.clear()
    spec = parse_spec(_cfg(workdir=str(tmp_path / "b"), schedule__kind="calibrated", calibration__revalidate_rounds=1))
    with pytest.raises(ConfigError, match=r"failed validation on fresh prompts \(bin 64: p5 0\.700"):
        calibration.calibrate_run(spec, progress=False)
    assert [t for t, _ in seen] == [(2, 4), (2, 8)] and not (tmp_path / "b" / "schedule.json").exists()


def test_raise_failed_bins_keeps_budgets_non_decreasing_and_raises_earlier_bins_at_the_largest():
    from sparrow_jax.rollout import SparsitySchedule
    from sparrow_jax.run.calibration import raise_failed_bins

    s = SparsitySchedule(topk=(6, 6, 8, 8, 24, 48), bin_width=256)
    budgets = (4, 6, 8, 12, 16, 24, 32, 48, 96)
    assert raise_failed_bins(s, [1280], budgets).topk == (6, 6, 8, 8, 24, 96)
    assert raise_failed_bins(s, [512], budgets).topk == (6, 6, 12, 12, 24, 48)  # later bins follow
    assert raise_failed_bins(s, [256, 5000], budgets).topk == (6, 8, 8, 8, 24, 96)  # past the last bin: the last
    # a failed bin at the largest budget: the nearest earlier bin with room rises instead
    assert raise_failed_bins(dataclasses.replace(s, topk=(6, 96)), [256], budgets).topk == (8, 96)
    assert raise_failed_bins(dataclasses.replace(s, topk=(6, 96, 96)), [512], budgets).topk == (8, 96, 96)
    assert raise_failed_bins(dataclasses.replace(s, topk=(96, 96)), [256], budgets) is None  # nothing larger


# ---- checkpoints -----------------------------------------------------------------------------

def _corrupt(step_dir):
    """Overwrite the array chunks of every item of a checkpoint step with garbage."""
    chunks = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs if os.path.basename(r) == "d"]
    assert chunks
    for path in chunks:
        with open(path, "wb") as f:
            f.write(b"garbage" * 3)


def test_a_corrupted_latest_checkpoint_falls_back_to_the_previous_committed_step(tmp_path):
    from sparrow_jax.io.checkpoint import CheckpointManager, CheckpointMismatchError

    ckpt = CheckpointManager(tmp_path / "ck", max_to_keep=3)
    for step in (1, 2, 3):
        ckpt.save(step, {"loop": {"w": jnp.full((4,), float(step))}, "meta": {"step": step}})
    _corrupt(tmp_path / "ck" / "3")
    target = {"loop": {"w": jnp.zeros((4,))}}
    with pytest.warns(RuntimeWarning, match=r"checkpoint step 3 in .* does not load \(step 3: ValueError: .*\); "
                                            r"restored step 2, the newest committed step that does"):
        restored = ckpt.restore_latest(target)
    np.testing.assert_array_equal(restored["loop"]["w"], np.full((4,), 2.0))
    assert restored["meta"] == {"step": 2} and ckpt.all_steps() == [1, 2]
    assert ckpt.save(3, {"loop": {"w": jnp.full((4,), 30.0)}, "meta": {"step": 3}})  # the resumed run saves 3 again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(ckpt.restore_latest(target)["loop"]["w"], np.full((4,), 30.0))
    with pytest.raises(CheckpointMismatchError):  # a target of another shape is an error, not corruption
        ckpt.restore_latest({"loop": {"w": jnp.zeros((5,))}})
    assert CheckpointManager(tmp_path / "empty").restore_latest(target) is None


# ---- the RL loop -----------------------------------------------------------------------------

def test_finite_rewards_zeroes_and_counts():
    from sparrow_jax.rl.trainer import finite_rewards

    rewards, count = finite_rewards(np.asarray([0.5, np.nan, np.inf, -np.inf, 1.0], np.float32))
    np.testing.assert_array_equal(rewards, [0.5, 0.0, 0.0, 0.0, 1.0])
    assert count == 3.0 and rewards.dtype == np.float32


def test_a_run_killed_by_an_exception_keeps_its_metrics_and_resumes_past_a_corrupted_checkpoint(tmp_path, monkeypatch):
    """A tiny run whose verifier returns NaN for one row of four and whose third step raises
    mid-step (after its rollouts, in the update): steps 1 and 2 are in metrics.jsonl and in
    TensorBoard, with ``reward/nonfinite`` 1 and finite rewards and losses; with checkpoint 2
    corrupted, the next run resumes from step 1."""
    from sparrow_jax.rl import trainer
    from sparrow_jax.run.context import build_run_context

    cfg = _cfg(workdir=str(tmp_path / "run"), steps=3, checkpoint_every=1)
    cfg.task.context_tokens, cfg.task.num_train, cfg.task.num_eval = 64, 8, 2
    cfg.rollout.max_new_tokens, cfg.rollout.prompts_per_step, cfg.rollout.group_size = 6, 2, 2
    spec = parse_spec(cfg)
    ctx = build_run_context(spec)
    calls, task_reward = [], ctx.task.reward

    def reward(completion, example):  # rows are scored in order, 4 per step: the first of each step is NaN
        calls.append(1)
        return float("nan") if len(calls) % 4 == 1 else task_reward(completion, example)

    ctx = dataclasses.replace(ctx, task=dataclasses.replace(ctx.task, reward=reward))
    real_update = trainer.update

    def update(loop, state, batch):
        if state.step == 2:
            raise RuntimeError("killed mid-step")
        return real_update(loop, state, batch)

    monkeypatch.setattr(trainer, "update", update)
    monkeypatch.setattr(trainer, "validation", lambda loop, state: {})  # only training rows score with `reward`
    with pytest.raises(RuntimeError, match="killed mid-step"):
        trainer.train(spec, ctx, progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    rows = [r for r in rows if "reward_mean" in r]  # step 0 holds only the (here empty) validation
    assert [r["step"] for r in rows] == [1, 2] and len(calls) == 12
    assert [r["reward/nonfinite"] for r in rows] == [1.0, 1.0]
    assert all(np.isfinite(r["reward_mean"]) and np.isfinite(r["loss"]) for r in rows)
    tb = read_tb_scalars(tmp_path / "run" / "tb")
    assert tb["reward/nonfinite"] == [(1, 1.0), (2, 1.0)]
    assert tb["loss"] == [(r["step"], pytest.approx(r["loss"])) for r in rows]

    _corrupt(tmp_path / "run" / "checkpoints" / "2")
    loop = trainer.make_loop(spec, ctx)
    with trainer._checkpoints(spec) as ckpt, pytest.warns(RuntimeWarning, match=r"checkpoint step 2 .*restored step 1"):
        state = trainer.restore_or_init(loop, ckpt)
    assert state.step == 1 and [int(x) for x in np.asarray(state.data)] == [0, 2]
