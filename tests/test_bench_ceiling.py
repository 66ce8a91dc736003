"""experiments.bench_speedup_ceiling: dense vs a run's schedule vs its top-k-0 floor."""
import jax
import numpy as np
import pytest

from configs.grpo_tiny import get_config
from experiments.bench_speedup_ceiling import attended_pages, measure_ceiling
from sparrow_jax.io.checkpoint import CheckpointManager, run_policy_params
from sparrow_jax.rollout import SparsitySchedule
from sparrow_jax.run.specs import ConfigError, parse_spec


def _spec(workdir, **schedule):
    cfg = get_config()
    cfg.workdir = str(workdir)
    cfg.task.num_eval, cfg.rollout.max_new_tokens = 2, 6
    for k, v in schedule.items():
        setattr(cfg.schedule, k, v)
    return parse_spec(cfg)


def test_attended_pages_follow_the_schedule_per_generated_position():
    sched = SparsitySchedule(topk=(1, 4), bin_width=32, page_size=8, reserved_first=1, reserved_last=1)
    # one row, prompt of 30 tokens, 6 new: tokens 30..35 come from queries at 29..34, which see 4-5 pages
    visible = np.array([4, 4, 4, 5, 5, 5])
    topk = np.array([1, 1, 1, 4, 4, 4]) + 2  # query 29..31 in bin 0, 32..34 in bin 1
    assert attended_pages(sched, np.array([30]), 6, dense=True) == pytest.approx(visible.mean())
    assert attended_pages(sched, np.array([30]), 6) == pytest.approx(np.minimum(visible, topk).mean())


def test_measure_ceiling_times_three_sides_on_the_same_rows(tmp_path):
    summary = measure_ceiling(_spec(tmp_path), repeats=1, num_prompts=2, samples=1)
    sides = summary["sides"]
    assert summary["setup"]["params"] == "initial" and summary["setup"]["rows"] == 2
    assert sides["floor"]["pages"] == 3.0  # grpo_tiny's reserved pages: only those at top-k 0
    assert sides["floor"]["pages"] < sides["sparse"]["pages"] < sides["dense"]["pages"]
    assert summary["rollout_speedup"] == pytest.approx(sides["sparse"]["best_tok_s"] / sides["dense"]["best_tok_s"])
    assert summary["speedup_ceiling"] == pytest.approx(sides["floor"]["best_tok_s"] / sides["dense"]["best_tok_s"])
    if summary["speedup_ceiling"] > 1:
        assert summary["captured"] == pytest.approx((summary["rollout_speedup"] - 1) / (summary["speedup_ceiling"] - 1))
    with pytest.raises(ConfigError, match="schedule.kind='dense'"):
        measure_ceiling(_spec(tmp_path, kind="dense"), repeats=1)


def test_run_policy_params_reads_the_newest_or_a_given_step_and_rejects_another_model(tmp_path):
    from sparrow_jax.run.context import build_run_context

    like = build_run_context(_spec(tmp_path)).params
    assert run_policy_params(str(tmp_path), like) is None  # no checkpoints yet
    trained = jax.tree.map(lambda x: x + 1.0, like)
    with CheckpointManager(tmp_path / "checkpoints") as ckpt:
        ckpt.save(1, {"loop": {"train": {"params": like}}})
        ckpt.save(2, {"loop": {"train": {"params": trained}}})
    for step, want in ((None, trained), (2, trained), (1, like)):
        got, got_step = run_policy_params(str(tmp_path), like, step)
        assert got_step == (step or 2) and jax.tree.structure(got) == jax.tree.structure(like)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    other = dict(like, embed_tokens=like["embed_tokens"][:, :8])
    with pytest.raises(ValueError, match="embed_tokens"):
        run_policy_params(str(tmp_path), other)
