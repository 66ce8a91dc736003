"""The README's first command: the whole Sparrow method end to end on a laptop CPU.

warm-up SFT of a tiny Qwen3 on the pointer-chase task (cached under runs/cache; ~7 min the
first time on 2 cores) -> calibrate a schedule for tau = 0.86 (~1 min) -> GRPO + TIS with
sparse rollouts at that schedule -> runs/quickstart/report.json and plots. Page size and
position bins are scaled down for tiny contexts.
"""
from configs.calibrate_tiny import get_config as calibrate_config


def get_config():
    c = calibrate_config()  # same model, warm-up and calibration settings (shares the warm-up cache)
    c.workdir = "runs/quickstart"
    c.schedule.kind = "calibrated"
    c.task.num_train = 512
    c.task.num_eval = 16
    c.rollout.max_new_tokens = 24
    c.rollout.prompts_per_step = 8
    c.rollout.group_size = 8
    c.steps = 60
    c.checkpoint_every = 20
    c.eval_k = 4
    c.train.learning_rate = 3e-4
    return c
