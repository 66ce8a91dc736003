"""Study at length: dense rollouts vs the calibrated tau = 0.86 schedule vs an aggressive fixed
budget, same seeds and steps, on configs/long_trace.py's long traces (~60 minutes on 2 CPU cores).

    python -m experiments.run --config configs/study_long.py

Writes runs/study_long/study.png (reward per step, per-bin p5 and mean alpha over training,
rollout seconds per step, per arm) and report.json (arm x reward start/end, min per-bin p5,
mean rollout seconds). The calibration is long_trace's (same model, task and bins).
"""
from ml_collections import ConfigDict

from configs.long_trace import get_config as long_trace_config


def get_config():
    c = long_trace_config()
    c.workdir = "runs/study_long"
    c.steps = 12
    c.checkpoint_every = 6
    c.calibration.tau = 0.86
    c.study = ConfigDict(dict(
        aggressive_topk=16,  # top-k pages of the aggressive arm (256 tokens + 3 kept pages)
        arms=("dense", "calibrated", "aggressive", "online_dense", "online_aggressive", "online_distill")))
    c.schedule.online.tau = c.calibration.tau
    return c
