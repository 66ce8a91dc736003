"""The README's first command: the whole Sparrow method end to end on a laptop CPU.

warm-up SFT of a tiny Qwen3 on the pointer-chase task (cached under runs/cache) ->
calibrate a schedule for tau = 0.86 -> GRPO + TIS with sparse rollouts at that schedule
-> runs/quickstart/report.json and plots. Page size and position bins are scaled down
for tiny contexts.
"""
from configs.common import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/quickstart"
    c.model.source = "warmup"
    c.task.context_tokens = 384
    c.task.hops = 2
    c.task.num_train = 256
    c.task.num_eval = 16
    c.schedule.kind = "calibrated"
    c.schedule.page_size = 8
    c.schedule.bin_width = 128
    c.schedule.dense_layers = (0,)
    c.calibration.tau = 0.86
    c.calibration.budgets = (2, 4, 8, 16, 32)
    c.calibration.num_prompts = 8
    c.calibration.validate_prompts = 8
    c.rollout.prompts_per_step = 4
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 48
    c.steps = 12
    c.checkpoint_every = 4
    c.eval_k = 2
    c.train.learning_rate = 5e-5
    return c
