"""Run specs: every shipped config parses with every field read; bad fields are named; the
entry points turn a bad config into one line and exit status 2."""
import glob
import importlib
import os
import re
import subprocess
import sys

import pytest

from configs.grpo_tiny import get_config
from sparrow_jax.run.specs import ConfigError, parse_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                 if not os.path.basename(p).startswith(("_", "common")))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_parses_and_every_field_is_read(name):
    cfg = importlib.import_module(f"configs.{name}").get_config()
    if cfg.model.source == "hf" and not os.path.isdir(cfg.model.hf_dir):  # a snapshot the user points it at
        with pytest.raises(ConfigError, match=rf"^--config\.model\.hf_dir='{re.escape(cfg.model.hf_dir)}': is not a dir"):
            parse_spec(cfg)
        cfg.model.source = "tiny"  # the rest of the config parses, every field read
    spec = parse_spec(cfg)  # raises on a field that no spec consumes
    assert spec.workdir == cfg.workdir and spec.train.learning_rate == cfg.train.learning_rate


def test_a_field_no_code_reads_is_an_error():
    cfg = get_config()
    cfg.train.value_coef = 0.5  # a critic coefficient: GRPO has no critic
    with pytest.raises(ConfigError, match=r"--config\.train\.value_coef is read by no code"):
        parse_spec(cfg)


@pytest.mark.parametrize("field,value,match", [
    ("train.mini_batches", 3, r"--config\.train\.mini_batches=3: times train\.micro_batches=1 must divide"),
    ("mesh.data", 0, r"--config\.mesh\.data=0: must be > 0"),
    ("schedule.kind", "sparse", r"--config\.schedule\.kind='sparse'"),
    ("calibration.tau", 1.5, r"--config\.calibration\.tau"),
    ("distill.switch_topk", 1, r"--config\.distill\.switch_every"),
    ("task.preamble_tokens", 16, r"--config\.task\.preamble_tokens=16: only task pointer_trace has a preamble"),
    ("task.preamble_tokens", -1, r"--config\.task\.preamble_tokens=-1: must be >= 0"),
    ("task.min_lines", 200, r"--config\.task\.min_lines=200: only task recurrence_trace reads it"),
    ("task.far_every", 10, r"--config\.task\.far_every=10: only task recurrence_trace reads it"),
    ("task.gap_tokens", 64, r"--config\.task\.gap_tokens=64: only task recurrence_trace reads it"),
    ("task.far_every", -5, r"--config\.task\.far_every=-5: must be >= 0"),
])
def test_bad_values_name_the_field(field, value, match):
    cfg = get_config()
    section, _, leaf = field.rpartition(".")
    setattr(cfg[section] if section else cfg, leaf, value)
    with pytest.raises(ConfigError, match=match):
        parse_spec(cfg)


def test_a_value_of_the_wrong_type_is_named():
    from ml_collections import ConfigDict
    cfg = ConfigDict(get_config().to_dict(), type_safe=False)  # e.g. a block a config file replaced wholesale
    cfg.rollout.group_size = "4"
    with pytest.raises(ConfigError, match=r"--config\.rollout\.group_size='4': expected an int"):
        parse_spec(cfg)


def test_distill_with_dense_rollouts_is_refused():
    cfg = get_config()
    cfg.distill.enabled, cfg.schedule.kind = True, "dense"
    with pytest.raises(ConfigError, match=r"--config\.distill\.enabled"):
        parse_spec(cfg)


@pytest.mark.parametrize("override,match", [
    ("--config.train.ppo_epoch=2", "--config.train.ppo_epoch: unknown config field"),
    ("--config.train.kl_coef=-0.5", "--config.train.kl_coef=-0.5"),
    ("--config.train.clip_low=abc", "--config.train.clip_low=abc"),
])
def test_entry_point_reports_a_bad_config_in_one_line(override, match, tmp_path):
    cmd = [sys.executable, "-m", "experiments.run", "--config", "configs/grpo_tiny.py",
           f"--config.workdir={tmp_path}", override]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], out.stderr
    assert "Traceback" not in out.stderr and not os.listdir(tmp_path)  # nothing ran


def test_a_workdir_run_continues_only_under_its_own_config(tmp_path):
    """A workdir with checkpoints or a schedule refuses a changed config (naming the fields) and is
    left as it was; more steps, a fresh directory, or a directory without run state are fine."""
    from sparrow_jax.run.workdir import check_workdir, run_state, write_config

    cfg = get_config()
    cfg.workdir = str(tmp_path / "run")
    spec = parse_spec(cfg)
    check_workdir(spec)                                    # no directory yet
    write_config(spec)
    cfg.train.learning_rate = cfg.train.learning_rate * 3
    cfg.model.warmup = {"refine_steps": 5}
    changed = parse_spec(cfg)
    check_workdir(changed)                                 # config.json alone: no run to continue
    os.makedirs(tmp_path / "run" / "checkpoints")
    assert run_state(spec.workdir) == ["checkpoints"]
    before = (tmp_path / "run" / "config.json").read_text()
    with pytest.raises(ValueError, match=r"train\.learning_rate: .* -> .*model\.warmup|model\.warmup.*train\.learning_rate"):
        check_workdir(changed)
    assert (tmp_path / "run" / "config.json").read_text() == before
    cfg = get_config()
    cfg.workdir, cfg.steps, cfg.checkpoint_every = str(tmp_path / "run"), 40, 7
    check_workdir(parse_spec(cfg))                         # continuing for longer is what resuming is for
    study = tmp_path / "study"                             # a study's arms keep their checkpoints one level down
    os.makedirs(study / "dense" / "checkpoints")
    assert run_state(str(study)) == [os.path.join("dense", "checkpoints")]


def test_a_field_added_since_a_run_started_is_continuable_at_its_default(tmp_path):
    """A config.json written before a spec field existed (the field absent) continues when the
    field is at its default, and is refused, naming the field, when it is not."""
    import json

    from sparrow_jax.run.workdir import check_workdir, write_config

    cfg = get_config()
    cfg.workdir = str(tmp_path / "run")
    write_config(parse_spec(cfg))
    os.makedirs(tmp_path / "run" / "checkpoints")
    path = tmp_path / "run" / "config.json"
    old = json.loads(path.read_text())
    del old["task"]["gap_tokens"]                          # as written before the field existed
    path.write_text(json.dumps(old))
    check_workdir(parse_spec(cfg))                         # at its default: the same run
    cfg.task.name, cfg.task.gap_tokens = "recurrence_trace", 8
    cfg.task.context_tokens = 200
    with pytest.raises(ValueError, match=r"^--config\.workdir=.*task\.gap_tokens: 0 -> 8"):
        check_workdir(parse_spec(cfg))

    # the same inside an optional block (study): a study started before study.high_tau existed
    from configs.common import study_config

    study = tmp_path / "study"
    cfg = get_config()
    cfg.workdir, cfg.study = str(study), study_config()
    write_config(parse_spec(cfg))
    os.makedirs(study / "checkpoints")
    old = json.loads((study / "config.json").read_text())
    del old["study"]["high_tau"]
    (study / "config.json").write_text(json.dumps(old))
    check_workdir(parse_spec(cfg))
    cfg.study.high_tau = 0.95
    with pytest.raises(ValueError, match=r"study\.high_tau: 0\.92 -> 0\.95"):
        check_workdir(parse_spec(cfg))


def test_recurrence_trace_knobs_reach_its_generator_and_pointer_knobs_do_not():
    from sparrow_jax.data.registry import get_task
    from sparrow_jax.data.tasks import recurrence_trace
    from sparrow_jax.run.context import generator_args

    cfg = get_config()
    cfg.task.name, cfg.task.context_tokens = "recurrence_trace", 520
    cfg.task.min_lines, cfg.task.far_every, cfg.task.gap_tokens = 40, 5, 32
    t = parse_spec(cfg).task
    args = generator_args(t)
    assert args == dict(context_tokens=520, min_lines=40, far_every=5, gap_tokens=32)
    assert get_task(t.name).generate(2, 7, **args) == recurrence_trace.generate(
        2, 7, context_tokens=520, min_lines=40, far_every=5, gap_tokens=32)
    cfg.task.min_lines, cfg.task.far_every, cfg.task.gap_tokens = 0, 0, 0  # unset: the generator's defaults
    assert generator_args(parse_spec(cfg).task, context_tokens=600) == dict(context_tokens=600)
    cfg.task.name = "pointer_trace"  # pointer tasks get their own knobs, not these
    assert set(generator_args(parse_spec(cfg).task)) == {"context_tokens", "hops", "distractor_frac", "key_len",
                                                         "isolate_chain"}


@pytest.mark.parametrize("field,value,match", [
    ("far_every", 7, r"--config\.task\.far_every=7: must be a divisor of 100 >= 2"),
    ("far_every", 1, r"--config\.task\.far_every=1: must be a divisor of 100 >= 2"),
    ("min_lines", 1, r"--config\.task\.min_lines=1: must be >= 2"),
])
def test_bad_recurrence_knobs_are_refused_at_parse_time(field, value, match):
    cfg = get_config()
    cfg.task.name = "recurrence_trace"
    setattr(cfg.task, field, value)
    with pytest.raises(ConfigError, match=match):
        parse_spec(cfg)
