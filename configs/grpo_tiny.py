"""GRPO + TIS on sparse rollouts, tiny random model, built-in pointer-chase task: ~1 min on CPU.

The reward gives partial credit (symbol overlap with the reference chain): a random model
never answers right, but its samples differ in credit, so advantages and gradients are
non-zero from the first step.
"""
from configs.common import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/grpo_tiny"
    c.steps = 6
    c.checkpoint_every = 2
    c.task.name = "pointer_chase_partial"
    c.task.context_tokens = 192
    c.task.hops = 1
    c.task.num_train = 64
    c.task.num_eval = 8
    c.rollout.prompts_per_step = 4
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 24
    c.schedule.kind = "fixed"
    c.schedule.topk = 2
    c.schedule.page_size = 8
    c.schedule.bin_width = 64
    c.train.learning_rate = 3e-4
    c.eval_k = 2
    return c
