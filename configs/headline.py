"""The headline study on configs/recurrence_trace.py's setup (636-token prompts, ~1.3K-token mostly
local traces, the 3-layer warm-up Qwen3 with every layer sparse): does RL with sparse rollouts at
the calibrated tau = 0.86 schedule train the dense policy as well as dense rollouts, and does the
paper's collapse threshold tau = 0.75 not?

    python -m experiments.run --config configs/headline.py

Arms, each at seeds 0 and 1 with the same prompts (``runs/headline/<arm>/seed_<s>``): dense
rollouts; the schedule calibrated at tau = 0.86 (``runs/headline/schedule.json``); the schedule
calibrated the same way at ``study.low_tau`` = 0.75 (``runs/headline/calibrated_low/``); the
online controller started dense; and the random-reward control (dense rollouts whose update learns
from coin flips with the batch's mean reward: a held-out gain there is not from the reward).
Resumable arm by arm and seed by seed. Writes ``runs/headline/report.json`` (per arm over seeds:
dense held-out reward start / end / change with standard errors, area under the dense validation
curve, sampled reward, pooled and worst-step per-bin p5, generated tokens per rollout second,
predicted cost, median RL step time vs dense, and the paired rollout speedup of each sparse arm's
final schedule measured after its first seed) and ``headline.png``.

The RL settings (32 rollouts a step, 30 steps, validation every 6 on 16 held-out prompts x 4
samples, 64 training prompts so the sampled reward's first and last 8-step windows hold the same
prompts) are a first guess aimed at <= ~24 minutes per arm and seed on 2 cores, not yet measured:
tune them (and the learning rate) on the warm model before reading the study.
"""
from configs.common import study_config
from configs.recurrence_trace import get_config as recurrence_trace_config


def get_config():
    c = recurrence_trace_config()
    c.workdir = "runs/headline"
    c.calibration.tau = 0.86
    c.rollout.prompts_per_step = 8
    c.rollout.group_size = 4
    c.train.learning_rate = 5e-5  # between long_trace's 3e-5 (a sharp warm-up) and the default 1e-4
    c.steps = 30
    c.eval_every = 6  # validations at steps 0, 6, ..., 30: six points of the dense curve
    c.eval_k = 4
    c.checkpoint_every = 6
    c.task.num_train = 64  # one pass = 8 steps: the reward windows compare the same prompts
    c.task.num_eval = 16
    c.study = study_config()
    c.study.arms = ("dense", "calibrated", "calibrated_low", "online_dense", "random_reward")
    c.study.seeds = (0, 1)
    c.study.low_tau = 0.75  # the paper's collapse threshold, calibrated exactly as the main tau
    c.study.measure_speedup = True
    return c
