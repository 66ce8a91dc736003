"""experiments.summary on workdirs whose logs the project's own writers wrote: a run's table
equals its logged figures, a study gets a column per arm, and bad input is one line + exit 2."""
import json
import subprocess
import sys

import numpy as np
import pytest

from configs.grpo_tiny import get_config
from experiments.summary import phase_seconds, summarize
from sparrow_jax.io.metrics import HistogramWriter, MetricWriter
from sparrow_jax.run.specs import parse_spec
from sparrow_jax.run.workdir import spec_json


def _log_run(workdir, steps_logged: int, steps: int = 4, study=None):
    cfg = get_config()
    cfg.steps, cfg.workdir = steps, str(workdir)
    config = spec_json(parse_spec(cfg))
    if study is not None:
        config["study"] = study
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(config))
    return config


def _log_steps(workdir, n: int, reward0: float = 0.1):
    rng = np.random.default_rng(0)
    with MetricWriter(str(workdir), resume_step=-1) as w:
        h = HistogramWriter(str(workdir), resume_step=-1)
        w.write(0, {"val/dense/reward_mean@2": 0.3, "val/dense/reward_mean@2_se": 0.05})
        for step in range(1, n + 1):
            alpha = rng.uniform(0.8, 1.0, size=200)
            counts = np.histogram(alpha, bins=1000, range=(0.0, 1.0))[0][None]  # one bin at 0
            w.write(step, {"reward_mean": reward0 + 0.1 * step, "response_length/mean": 10.0,
                           "mismatch/count/bin_0": 200.0, "mismatch/alpha_p5/bin_0": float(np.percentile(alpha, 5)),
                           "mismatch/alpha_mean/bin_0": float(alpha.mean()), "timing_s/gen": 1.0 + step,
                           "rollout/generated_tokens": 100.0, "rollout/decode_s": 0.5,
                           "rollout/sparse_token_fraction": 1.0})
            h.write(step, counts, [0])
        h.close()


def test_summary_of_a_killed_run_then_its_report(tmp_path):
    run = tmp_path / "run"
    _log_run(run, 2)
    assert summarize(str(run)) == (f"{run}: no training step logged yet", None)
    _log_steps(run, 2)
    text, plot = summarize(str(run))
    lines = {line[:26].strip(): line[26:].strip() for line in text.splitlines()[1:]}  # label column, value column
    assert lines["status"] == "at step 2 of 4"
    assert lines["reward (sampled, train)"].startswith("0.250 -> 0.250")  # both 3-step windows hold steps 1-2
    assert lines["dense validation"] == "0.300±0.050 -> 0.300±0.050"
    assert lines["gen tokens / rollout s"] == "200"
    assert lines["s/step gen"] == "3.00"  # the steps after the first (which compiles)
    assert lines["p5 bin 0"].startswith("0.8") and "400 tok" in lines["p5 bin 0"]
    assert lines["rollout speedup (paired)"] == "-"  # measured only when the run finishes
    assert lines["wall time"] == "-"  # recorded when the run finishes
    assert plot == str(run / "reward.png") and (run / "reward.png").stat().st_size > 0
    (run / "report.json").write_text(json.dumps({"steps": 4, "rollout_speedup": 1.7, "wall_s_partial": 90.0,
                                                 "rollout_speedup_paired": {"min": 1.5, "median": 1.7, "max": 1.9}}))
    text, _ = summarize(str(run))
    assert "1.70x (1.50-1.90)" in text and "finished" in text.splitlines()[1]  # the report holds the config's steps
    lines = {line[:26].strip(): line[26:].strip() for line in text.splitlines()[1:]}
    assert lines["wall time"] == "1.5 min (resumed: its last process)"


def test_study_gets_a_column_per_logged_arm(tmp_path):
    _log_run(tmp_path, 0, study={"arms": ["dense", "calibrated", "online_dense"]})
    _log_steps(tmp_path / "dense", 3)
    _log_steps(tmp_path / "calibrated", 2, reward0=0.0)
    text, plot = summarize(str(tmp_path))
    header = text.splitlines()[0].split()
    assert header == ["dense", "calibrated"] and plot == str(tmp_path / "study.png")


def test_study_with_seeds_gets_a_column_per_arm_and_seed(tmp_path):
    _log_run(tmp_path, 0, study={"arms": ["dense", "calibrated"], "seeds": [0, 1]})
    _log_steps(tmp_path / "dense" / "seed_0", 2)
    _log_steps(tmp_path / "dense" / "seed_1", 2)
    _log_steps(tmp_path / "calibrated" / "seed_0", 1)
    text, _ = summarize(str(tmp_path))
    assert text.splitlines()[0].split() == ["dense/seed_0", "dense/seed_1", "calibrated/seed_0"]
    # the paired final evaluation, as far as it got (the calibrated arm's second seed not yet evaluated)
    per_prompt = lambda *r: {"reward_mean@2": list(r), "reward_greedy": list(r)}  # noqa: E731
    (tmp_path / "final_eval.json").write_text(json.dumps({"prompts": 2, "k": 2, "seed": 0, "runs": {
        "start": per_prompt(0.2, 0.4), "dense/seed_0": per_prompt(0.3, 0.6), "dense/seed_1": per_prompt(0.3, 0.6),
        "calibrated/seed_0": per_prompt(0.3, 0.5)}}))
    final = summarize(str(tmp_path))[0].splitlines()[-3:]
    assert "on 2 held-out prompts" in final[0] and "start 0.300±0.100" in final[0]
    assert "dense: end 0.450±0.150, change +0.150±0.050, vs dense -" in final[1]  # seeds alike: no spread
    assert "calibrated: end 0.400±0.100, change +0.100±0.000, vs dense -0.050±0.050 (seeds [0])" in final[2]


def test_several_workdirs_get_their_final_evaluations_merged(tmp_path, capsys):
    """Two studies (seeds 0 and 1 run apart): each one's table, then one paired evaluation over both
    seeds; two that evaluated the start policy differently are one error line and exit 2."""
    from experiments.summary import main

    per_prompt = lambda *r: {"reward_mean@2": list(r), "reward_greedy": list(r)}  # noqa: E731
    for seed in (0, 1):
        study = tmp_path / f"seed{seed}"
        _log_run(study, 0, study={"arms": ["dense", "calibrated"], "seeds": [seed]})
        _log_steps(study / "dense", 2)
        (study / "final_eval.json").write_text(json.dumps({"prompts": 2, "k": 2, "seed": 0, "steps": 4, "runs": {
            "start": per_prompt(0.2, 0.4), f"dense/seed_{seed}": per_prompt(0.3, 0.6),
            f"calibrated/seed_{seed}": per_prompt(0.3, 0.5 - 0.1 * seed)}}))
    main(["summary", str(tmp_path / "seed0"), str(tmp_path / "seed1")])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"== {tmp_path / 'seed0'}" and f"== {tmp_path / 'seed1'}" in out
    merged = out[out.index(f"[final eval] merged over {tmp_path / 'seed0'}, {tmp_path / 'seed1'}:"):]
    assert "vs dense -0.075" in merged[-1] and "(seeds [0, 1])" in merged[-1]  # (-0.05 - 0.10) / 2
    record = json.loads((tmp_path / "seed1" / "final_eval.json").read_text())
    record["runs"]["start"] = per_prompt(0.2, 0.5)
    (tmp_path / "seed1" / "final_eval.json").write_text(json.dumps(record))
    proc = subprocess.run([sys.executable, "-m", "experiments.summary", str(tmp_path / "seed0"),
                           str(tmp_path / "seed1")], capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith("error: ") and "both evaluated 'start'" in proc.stderr


def test_phase_seconds_is_the_median_after_the_first_step():
    rows = [{"timing_s/gen": 9.0}, {"timing_s/gen": 1.0}, {"timing_s/gen": 3.0}, {"timing_s/gen": 2.0}]
    assert phase_seconds(rows) == {"gen": 2.0} and phase_seconds(rows[:1]) == {"gen": 9.0}


@pytest.mark.parametrize("args", [[], ["no/such/workdir"]])
def test_bad_input_is_one_line_and_exit_2(args):
    proc = subprocess.run([sys.executable, "-m", "experiments.summary", *args], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and len(proc.stderr.splitlines()) == 1


def test_summary_reads_a_workdir_without_starting_jax():
    """The summary only reads files: importing it pulls in no jax, flax or optax (their imports
    were most of its ~8 s a call)."""
    code = "import sys, experiments.summary; print([m for m in ('jax', 'flax', 'optax') if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
