"""Arms of different studies compared on their final evaluations (sparrow_jax.run.compare,
experiments.compare): figures against hand computations over prompts and seeds, training edges from
metrics.jsonl, and every refusal (another evaluation, another start, a missing arm, a bad entry)."""
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from sparrow_jax.run.compare import Entry, compare_arms, format_comparison, parse_entry
from sparrow_jax.run.final_eval_figures import FINAL_EVAL_FILE

SETTING = {"prompts": 4, "k": 2, "seed": 0, "steps": 20}


def _se(x):
    return np.std(x, ddof=1) / math.sqrt(len(x))


def _combined(per_seed):  # combine_seeds: the mean per-seed se^2 plus the variance of the seed means / S
    means = [np.mean(x) for x in per_seed]
    within = np.mean([_se(x) ** 2 for x in per_seed])
    return np.mean(means), math.sqrt(within + (np.var(means, ddof=1) / len(means) if len(means) > 1 else 0))


def _study(path, runs, **setting):
    path.mkdir(parents=True, exist_ok=True)
    (path / FINAL_EVAL_FILE).write_text(json.dumps(dict(SETTING, **setting, runs=runs)))
    return str(path)


def _per_prompt(values):
    return {"reward_mean@2": list(values), "reward_greedy": [1.0] * len(values)}


@pytest.fixture
def studies(tmp_path):
    """Study a: start, dense and calibrated at seeds 0-1; study b: the same start, calibrated (another
    training) at seeds 0-2. The rewards per prompt, for the hand computations."""
    rng = np.random.default_rng(0)
    draw = lambda: rng.uniform(0, 1, 4).round(3)  # noqa: E731
    r = {"start": draw(), **{(s, n): draw() for s in (0, 1, 2) for n in ("dense", "a", "b")}}
    a = _study(tmp_path / "a", {"start": _per_prompt(r["start"]),
                                **{f"dense/seed_{s}": _per_prompt(r[s, "dense"]) for s in (0, 1)},
                                **{f"calibrated/seed_{s}": _per_prompt(r[s, "a"]) for s in (0, 1)}})
    b = _study(tmp_path / "b", {"start": _per_prompt(r["start"]),
                                **{f"calibrated/seed_{s}": _per_prompt(r[s, "b"]) for s in (0, 1, 2)}})
    return a, b, r


def test_compare_arms_by_hand(studies, tmp_path):
    a, b, r = studies
    # seed 0 of b's arm logged 12 steps: entropy 1..12, a veto fraction, and its phases' seconds
    run = tmp_path / "b" / "calibrated" / "seed_0"
    run.mkdir(parents=True)
    rows = [{"step": 0, "val/dense/reward_mean@2": 0.1}]
    rows += [{"step": i, "reward_mean": 0.1 * i, "actor/entropy": float(i), "rollout_corr/rollout_is_veto_fraction": 0.5,
              "rollout_corr/rows_with_advantage": 0.05 * i, "timing_s/gen": float(i), "timing_s/update_actor": 1.0, "timing_s/veto": 0.5} for i in range(1, 13)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")

    fig = compare_arms([Entry("dense", a, "dense"), parse_entry(f"{a}:calibrated=no change"),
                        parse_entry(f"{b}:calibrated")])
    assert fig["metric"] == "reward_mean@2" and fig["reference"] == "dense" and fig["prompts"] == 4
    arms = fig["arms"]
    assert list(arms) == ["dense", "no change", "b:calibrated"]
    assert "vs_reference" not in arms["dense"]
    want = _combined([r[s, "a"] - r[s, "dense"] for s in (0, 1)])
    assert (arms["no change"]["vs_reference"], arms["no change"]["vs_reference_se"]) == pytest.approx(want)
    # b's seed 2 has no dense run to pair with: its difference is over seeds 0 and 1, its end over all three
    other = arms["b:calibrated"]
    assert other["seeds"] == [0, 1, 2] and list(other["vs_reference_by_seed"]) == [0, 1]
    assert (other["vs_reference"], other["vs_reference_se"]) == pytest.approx(
        _combined([r[s, "b"] - r[s, "dense"] for s in (0, 1)]))
    assert other["vs_reference_by_seed"][1] == pytest.approx(np.mean(r[1, "b"] - r[1, "dense"]))
    assert (other["end"], other["end_se"]) == pytest.approx(_combined([r[s, "b"] for s in (0, 1, 2)]))
    assert (other["change"], other["change_se"]) == pytest.approx(_combined([r[s, "b"] - r["start"] for s in (0, 1, 2)]))
    # training edges: the mean of the first and the last 10 steps; the median step after the first (which compiles)
    edges = other["training"][0]
    assert edges["actor/entropy"] == pytest.approx([5.5, 7.5])
    assert edges["reward_mean"] == pytest.approx([0.55, 0.75])
    assert edges["rollout_corr/rollout_is_veto_fraction"] == pytest.approx([0.5, 0.5])
    assert edges["rollout_corr/rows_with_advantage"] == pytest.approx([0.275, 0.375])
    assert edges["step_s"] == pytest.approx([np.median([i + 1.5 for i in range(2, 13)])])
    assert list(other["training"]) == [0]  # the other seeds logged nothing

    lines = format_comparison(fig)
    assert lines[2].startswith("[compare] no change: end") and "vs dense" in lines[2] and "vs dense" not in lines[1]
    assert "RL step median 8.50 s" in lines[4]

    greedy = compare_arms([Entry("dense", a, "dense"), Entry("b", b, "calibrated")], metric="reward_greedy")
    assert greedy["arms"]["b"]["vs_reference"] == 0.0

    # a study of one seed logs its arm in <arm>/, not <arm>/seed_<s>/ (its config.json names the seed)
    (tmp_path / "a" / "dense").mkdir()
    (tmp_path / "a" / "dense" / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    assert compare_arms([Entry("dense", a, "dense")])["arms"]["dense"]["training"] == {}  # no config.json: unknown
    (tmp_path / "a" / "config.json").write_text(json.dumps({"seed": 0, "study": {"seeds": [5]}}))
    assert compare_arms([Entry("dense", a, "dense")])["arms"]["dense"]["training"] == {}  # another seed's run
    (tmp_path / "a" / "config.json").write_text(json.dumps({"seed": 0, "study": {"seeds": []}}))
    one = compare_arms([Entry("dense", a, "dense")])["arms"]["dense"]["training"]
    assert list(one) == [0] and one[0] == edges


def test_compare_refuses_what_does_not_pair(studies, tmp_path):
    a, b, r = studies
    with open(f"{b}/{FINAL_EVAL_FILE}") as f:
        record = json.load(f)
    other_k = _study(tmp_path / "k", record["runs"], k=4)
    with pytest.raises(ValueError, match="final evaluation k=4 where .* has 2: not the same evaluation"):
        compare_arms([Entry("dense", a, "dense"), Entry("b", other_k, "calibrated")])
    other_start = _study(tmp_path / "s", dict(record["runs"], start=_per_prompt(r["start"] + 0.001)))
    with pytest.raises(ValueError, match="score the start policy 'start' differently"):
        compare_arms([Entry("dense", a, "dense"), Entry("b", other_start, "calibrated")])
    no_start = _study(tmp_path / "n", {n: v for n, v in record["runs"].items() if n != "start"})
    with pytest.raises(ValueError, match="share no start policy entry"):
        compare_arms([Entry("dense", a, "dense"), Entry("b", no_start, "calibrated")])
    with pytest.raises(ValueError, match="no final evaluation of arm 'online'"):
        compare_arms([Entry("dense", a, "dense"), Entry("b", b, "online")])
    with pytest.raises(ValueError, match="share none with the reference"):
        compare_arms([Entry("dense", a, "dense"),
                      Entry("late", _study(tmp_path / "l", {"start": record["runs"]["start"],
                                                           "calibrated/seed_5": _per_prompt(r[0, "b"])}), "calibrated")])
    with pytest.raises(ValueError, match="labels must differ"):
        compare_arms([Entry("x", a, "dense"), Entry("x", b, "calibrated")])
    with pytest.raises(ValueError, match="has no 'success@2'"):
        compare_arms([Entry("dense", a, "dense"), Entry("b", b, "calibrated")], metric="success@2")
    with pytest.raises(FileNotFoundError, match="no final_eval.json"):
        compare_arms([Entry("dense", a, "dense"), Entry("b", str(tmp_path), "calibrated")])
    for bad in ("runs/headline", "runs/headline:", ":dense", "runs/headline:dense="):
        with pytest.raises(ValueError, match="expected <workdir>:<arm>"):
            parse_entry(bad)
    assert parse_entry("runs/x:calibrated") == Entry("x:calibrated", "runs/x", "calibrated")


def test_compare_cli_prints_the_table_and_a_json_line(studies):
    a, b, _ = studies
    out = subprocess.run([sys.executable, "-m", "experiments.compare", f"{a}:dense", f"{b}:calibrated=veto"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0].startswith("[compare] dense reward_mean@2 on 4 held-out prompts")
    figures = json.loads(out[-1])
    assert figures["reference"].endswith("a:dense") and set(figures["arms"]) == {figures["reference"], "veto"}
    bad = subprocess.run([sys.executable, "-m", "experiments.compare", f"{a}:dense"], capture_output=True, text=True)
    assert bad.returncode == 2 and "at least two arms" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "experiments.compare", f"{a}:dense", f"{b}:online"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no final evaluation of arm 'online'" in bad.stderr
