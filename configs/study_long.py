"""Study at length on configs/long_trace.py's long traces, same seeds and steps for every arm:
dense rollouts, the calibrated tau = 0.86 schedule, an aggressive fixed budget (16 pages), and the
online controller (schedule.kind=online) started dense, started at the aggressive budget, and
started calibrated with DistillSparse (~31 minutes on an idle 2-core machine).

    python -m experiments.run --config configs/study_long.py

Writes runs/study_long/study.png (reward, mean alpha and rollout seconds per step for every arm;
p5 per bin per sparse arm; top-k per bin per online arm) and report.json (per arm: reward
start/end, min per-bin p5, rollout seconds, predicted cost vs dense; the online arms' final
budgets and p5_hold). The calibration is long_trace's (same model, task and bins).
"""
from configs.common import study_config
from configs.long_trace import get_config as long_trace_config


def get_config():
    c = long_trace_config()
    c.workdir = "runs/study_long"
    c.steps = 12
    c.checkpoint_every = 6
    c.calibration.tau = 0.86
    c.study = study_config()
    c.study.aggressive_topk = 16  # top-k pages of the aggressive arm (256 tokens + 3 kept pages)
    c.study.arms = ("dense", "calibrated", "aggressive", "online_dense", "online_aggressive", "online_distill")
    return c
