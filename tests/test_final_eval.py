"""The study's paired final evaluation (sparrow_jax.run.final_eval): figures against hand
computations, a real evaluation of checkpoints on a tiny model (common random numbers: a policy
equal to the start changes by exactly 0), resuming, bad input, and the held-out rows."""
import json
import math

import jax
import numpy as np
import pytest

from sparrow_jax.io.checkpoint import CheckpointManager
from sparrow_jax.run import final_eval
from sparrow_jax.run.final_eval import evaluate_final, final_eval_pending, final_eval_rows
from sparrow_jax.run.final_eval_figures import FINAL_EVAL_FILE, format_final_eval, paired_figures
from sparrow_jax.run.specs import ConfigError, parse_spec
from sparrow_jax.run.workdir import check_workdir, write_config


def _tiny_spec(workdir, prompts=3, steps=2, **overrides):
    from configs.common import study_config
    from configs.grpo_tiny import get_config

    cfg = get_config()
    cfg.workdir, cfg.steps = str(workdir), steps
    cfg.rollout.max_new_tokens = 6
    cfg.study = study_config()
    cfg.study.arms, cfg.study.seeds, cfg.study.final_eval_prompts = ("dense", "calibrated"), (0, 1), prompts
    for k, v in overrides.items():
        cfg.study[k] = v
    return parse_spec(cfg)


def _sd(x):
    return np.std(x, ddof=1) / math.sqrt(len(x))


def test_paired_figures_by_hand():
    start = {0: [0.2, 0.4, 0.6, 0.8], 1: [0.3, 0.4, 0.5, 0.6]}
    dense = {0: [0.3, 0.6, 0.6, 0.9], 1: [0.4, 0.4, 0.7, 0.6]}
    sparse = {0: [0.3, 0.5, 0.6, 0.7], 1: [0.2, 0.4, 0.6, 0.6]}
    runs = {}
    for s in (0, 1):
        runs[f"start/seed_{s}"] = {"reward_mean@2": start[s], "reward_greedy": start[s]}
        runs[f"dense/seed_{s}"] = {"reward_mean@2": dense[s], "reward_greedy": start[s]}
        runs[f"calibrated/seed_{s}"] = {"reward_mean@2": sparse[s], "reward_greedy": start[s]}
    fig = paired_figures({"prompts": 4, "k": 2, "seed": 0, "runs": runs})
    m = fig["reward_mean@2"]

    def combined(per_seed):  # combine_seeds: mean per-seed se^2 plus the variance of the seed means / 2
        means = [np.mean(x) for x in per_seed]
        within = np.mean([_sd(x) ** 2 for x in per_seed])
        return np.mean(means), math.sqrt(within + np.var(means, ddof=1) / 2)

    diff = lambda a, b: [np.subtract(a[s], b[s]) for s in (0, 1)]  # noqa: E731
    for got, (want, want_se) in (((m["start"], m["start_se"]), combined([start[0], start[1]])),
                                 ((m["arms"]["dense"]["change"], m["arms"]["dense"]["change_se"]),
                                  combined(diff(dense, start))),
                                 ((m["arms"]["calibrated"]["vs_dense"], m["arms"]["calibrated"]["vs_dense_se"]),
                                  combined(diff(sparse, dense)))):
        assert got[0] == pytest.approx(want) and got[1] == pytest.approx(want_se)
    # the paired error of the change is far below the unpaired one the prompts' spread would give
    assert m["arms"]["dense"]["change_se"] < 0.5 * math.hypot(m["start_se"], m["arms"]["dense"]["end_se"])
    assert "vs_dense" not in m["arms"]["dense"] and m["arms"]["calibrated"]["seeds"] == [0, 1]
    g = fig["reward_greedy"]["arms"]["calibrated"]
    assert (g["change"], g["change_se"], g["vs_dense"]) == (0.0, 0.0, 0.0)
    lines = format_final_eval(fig)
    assert len(lines) == 3 and "calibrated" in lines[2] and "vs dense" in lines[2]


def _save_final(workdir, params, step):
    with CheckpointManager(workdir / "checkpoints") as ckpt:
        ckpt.save(step, {"loop": {"train": {"params": params}}})


def test_evaluate_final_pairs_every_policy_on_the_same_prompts_and_key_and_resumes(tmp_path, monkeypatch):
    from sparrow_jax.run.context import build_run_context
    from sparrow_jax.sft.model_source import build_model

    spec = _tiny_spec(tmp_path)
    ctx = build_run_context(spec, None)
    workdirs = {arm: {s: tmp_path / arm / f"seed_{s}" for s in (0, 1)} for arm in ("dense", "calibrated")}
    for s in (0, 1):
        start = build_model(spec.model, spec.task, ctx.tokenizer, s)[1]
        _save_final(workdirs["dense"][s], jax.tree.map(lambda x: x * 0.5, start), spec.steps)
        _save_final(workdirs["calibrated"][s], start, spec.steps)  # never moved from its start
    with pytest.raises(ValueError, match="last step 3"):
        evaluate_final(_tiny_spec(tmp_path, steps=3), {"dense": {0: str(workdirs["dense"][0])}})
    assert not (tmp_path / FINAL_EVAL_FILE).exists()  # refused before evaluating anything

    data = evaluate_final(spec, {a: {s: str(w) for s, w in by.items()} for a, by in workdirs.items()})
    assert set(data["runs"]) == {"start/seed_0", "start/seed_1", "dense/seed_0", "dense/seed_1", "calibrated/seed_0",
                                 "calibrated/seed_1"}
    assert all(len(v) == 3 for r in data["runs"].values() for v in r.values())
    assert set(data["seconds"]) == set(data["runs"]) and all(t > 0 for t in data["seconds"].values())
    assert json.loads((tmp_path / FINAL_EVAL_FILE).read_text()) == data and data["steps"] == spec.steps
    for s in (0, 1):  # the same params on the same prompts with the same key: the same rewards, prompt by prompt
        assert data["runs"][f"calibrated/seed_{s}"] == data["runs"][f"start/seed_{s}"]
    fig = paired_figures(data)["reward_mean@2"]["arms"]["calibrated"]
    assert (fig["change"], fig["change_se"]) == (0.0, 0.0)

    calls = []

    def counted(ctx, params, schedule, rows, k, key):
        calls.append(params)
        return {name: np.zeros(len(rows)) for name in ("reward_greedy", "reward_mean@2", "success@2")}

    monkeypatch.setattr(final_eval, "evaluate_per_prompt", counted)
    assert evaluate_final(spec, {a: {s: str(w) for s, w in by.items()} for a, by in workdirs.items()}) == data
    assert calls == []  # every policy was evaluated: nothing runs again
    with pytest.raises(ValueError, match="last step 3"):  # arms continued to 3 steps: their entries are stale
        evaluate_final(_tiny_spec(tmp_path, steps=3), {a: {s: str(w) for s, w in by.items()} for a, by in workdirs.items()})
    data["runs"].pop("dense/seed_1")  # as if interrupted before the last one
    (tmp_path / FINAL_EVAL_FILE).write_text(json.dumps(data))
    again = evaluate_final(spec, {a: {s: str(w) for s, w in by.items()} for a, by in workdirs.items()})
    assert len(calls) == 1 and set(again["runs"]) == set(data["runs"]) | {"dense/seed_1"}
    seed_1_start = build_model(spec.model, spec.task, ctx.tokenizer, 1)[1]
    for got, want in zip(jax.tree.leaves(calls[0]), jax.tree.leaves(seed_1_start)):  # the dense arm's seed-1 policy
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want) * 0.5)


def test_final_eval_rows_extend_the_validation_prompts_and_never_meet_training(tmp_path):
    from sparrow_jax.data.registry import get_task
    from sparrow_jax.run.context import build_examples

    spec = _tiny_spec(tmp_path, prompts=20)
    task = get_task(spec.task.name)
    train, val = build_examples(spec.task, task)
    rows = final_eval_rows(spec, task)
    assert len(rows) == 20 and rows[:len(val)] == val
    assert not {json.dumps(r, sort_keys=True) for r in rows} & {json.dumps(r, sort_keys=True) for r in train}


def test_bad_final_eval_prompts_name_the_field(tmp_path):
    from configs.common import study_config
    from configs.grpo_tiny import get_config

    with pytest.raises(ConfigError, match="study.final_eval_prompts=-1"):
        _tiny_spec(tmp_path, prompts=-1)
    cfg = get_config()
    cfg.task.dataset, cfg.task.num_train, cfg.study = "rows.jsonl", 0, study_config()
    cfg.study.final_eval_prompts = 9  # a dataset holds out its first task.num_eval = 8 rows
    with pytest.raises(ConfigError, match="study.final_eval_prompts=9.*num_eval=8"):
        parse_spec(cfg)
    cfg.study.final_eval_prompts, cfg.study.final_eval_offset = 6, 3  # rows 3-8 of 8
    with pytest.raises(ConfigError, match="study.final_eval_prompts=6.*final_eval_offset=3.*num_eval=8"):
        parse_spec(cfg)
    with pytest.raises(ConfigError, match="study.final_eval_offset=-1"):
        _tiny_spec(tmp_path, final_eval_offset=-1)


def test_an_offset_evaluates_fresh_prompts_and_keeps_the_earlier_record(tmp_path, monkeypatch):
    """study.final_eval_offset: the held-out rows past the first ``offset`` (none of them validation or
    training rows); a study rerun with it is pending, and its evaluation moves the earlier record aside."""
    from sparrow_jax.data.registry import get_task

    spec = _tiny_spec(tmp_path, prompts=4)
    fresh = _tiny_spec(tmp_path, prompts=4, final_eval_offset=3)
    task = get_task(spec.task.name)
    assert final_eval_rows(fresh, task) == final_eval_rows(_tiny_spec(tmp_path, prompts=7), task)[3:]
    assert final_eval_rows(fresh, task)[0] not in final_eval_rows(spec, task)[:3]
    assert final_eval_pending(fresh, {"final_eval": {"prompts": 4, "steps": 2}})  # made before offsets: 0
    assert not final_eval_pending(spec, {"final_eval": {"prompts": 4, "steps": 2}})
    assert not final_eval_pending(fresh, {"final_eval": {"prompts": 4, "steps": 2, "offset": 3}})

    seen = []

    def scored(ctx, params, schedule, rows, k, key):  # rewards that name the prompts each policy met
        seen.append(rows)
        return {name: np.arange(len(rows), dtype=float) for name in ("reward_greedy", "reward_mean@2", "success@2")}

    from sparrow_jax.run.context import build_run_context
    from sparrow_jax.sft.model_source import build_model

    ctx = build_run_context(spec, None)
    _save_final(tmp_path / "dense", build_model(spec.model, spec.task, ctx.tokenizer, 0)[1], spec.steps)
    monkeypatch.setattr(final_eval, "evaluate_per_prompt", scored)
    earlier = {"prompts": 4, "k": 2, "seed": 0, "steps": 2, "runs": {"start/seed_0": {"reward_mean@2": [0.5] * 4}}}
    (tmp_path / FINAL_EVAL_FILE).write_text(json.dumps(earlier))
    data = evaluate_final(fresh, {"dense": {0: str(tmp_path / "dense")}})
    assert data["offset"] == 3 and set(data["runs"]) == {"start/seed_0", "dense/seed_0"}
    assert seen == [final_eval_rows(fresh, task)] * 2  # both policies met the fresh prompts
    assert json.loads((tmp_path / "final_eval.replaced-0.json").read_text()) == earlier  # kept, not lost
    assert paired_figures(data)["offset"] == 3 and "(from held-out prompt 3)" in format_final_eval(
        paired_figures(data))[0]


def test_a_finished_study_continues_only_to_add_its_final_evaluation(tmp_path):
    old = _tiny_spec(tmp_path, prompts=0)
    write_config(old)
    (tmp_path / "checkpoints").mkdir()  # the workdir holds a run
    new = _tiny_spec(tmp_path, prompts=64)
    check_workdir(new)  # the final evaluation trains nothing: allowed
    check_workdir(_tiny_spec(tmp_path, prompts=64, final_eval_offset=64))  # nor on other prompts
    with pytest.raises(ConfigError, match="study.low_tau"):
        check_workdir(_tiny_spec(tmp_path, prompts=64, low_tau=0.5))
    assert final_eval_pending(new, {"steps": 2}) and final_eval_pending(new, {"final_eval": {"prompts": 3, "steps": 2}})
    assert final_eval_pending(new, {"final_eval": {"prompts": 64, "steps": 1}})  # arms continued since
    assert not final_eval_pending(new, {"final_eval": {"prompts": 64, "steps": 2}}) and not final_eval_pending(old, {})


def test_merge_records_joins_seeds_run_as_separate_studies():
    """Seeds 0-1 in one study and seed 2 in another, both with the same start evaluation: the merge
    gives the figures of one record holding all three; a different setting or a disagreeing run is
    refused, naming the workdirs."""
    from sparrow_jax.run.final_eval_figures import merge_records

    rng = np.random.default_rng(0)
    per_prompt = lambda: {"reward_mean@2": rng.uniform(0, 1, 4).tolist(), "reward_greedy": [1.0] * 4}  # noqa: E731
    start = per_prompt()
    runs = {"start": start, **{f"{a}/seed_{s}": per_prompt() for a in ("dense", "calibrated") for s in (0, 1, 2)}}
    setting = {"prompts": 4, "k": 2, "seed": 0, "steps": 10}
    first = dict(setting, runs={n: v for n, v in runs.items() if not n.endswith("seed_2")})
    second = dict(setting, runs={n: v for n, v in runs.items() if n == "start" or n.endswith("seed_2")},
                  seconds={"start": 1.0})
    merged = merge_records({"a": first, "b": second})
    assert merged == dict(setting, offset=0, runs=runs)  # records from before study.final_eval_offset: offset 0
    assert paired_figures(merged) == paired_figures(dict(setting, runs=runs))
    with pytest.raises(ValueError, match="^b: final evaluation k=4 where a has 2"):
        merge_records({"a": first, "b": dict(second, k=4)})
    assert merge_records({"a": first, "b": dict(second, offset=0)})["runs"] == runs
    with pytest.raises(ValueError, match="^b: final evaluation offset=128 where a has 0"):
        merge_records({"a": first, "b": dict(second, offset=128)})
    other_start = dict(second, runs=dict(second["runs"], start=per_prompt()))
    with pytest.raises(ValueError, match="b and a both evaluated 'start', with different rewards"):
        merge_records({"a": first, "b": other_start})
    with pytest.raises(ValueError, match="no final evaluation"):
        merge_records({})
    # an arm one study reused as another's run: its figures are that run's; a study that trained it is refused
    reused = dict(first, same_run_as={"calibrated_low": "calibrated"})
    merged = merge_records({"a": reused, "b": second})
    fig = paired_figures(merged)["reward_mean@2"]["arms"]
    assert fig["calibrated_low"] == fig["calibrated"] and fig["calibrated"]["seeds"] == [0, 1, 2]
    trained = dict(second, runs=dict(second["runs"], **{"calibrated_low/seed_2": per_prompt()}))
    with pytest.raises(ValueError, match="a: its 'calibrated_low' is the 'calibrated' arm's run, while another study "
                                         "trained it"):
        merge_records({"a": reused, "b": trained})
