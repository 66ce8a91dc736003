"""The README's first command: the whole Sparrow method end to end on a laptop CPU, in the regime
it exists for, long generated traces (configs/long_trace.py: 888-token prompts, completions of
up to 704 generated tokens, ~600 on average, a 2-layer tiny Qwen3 with both layers sparse).

shipped warm-up (sparrow_jax/sft/checkpoints/long_trace*/: the curriculum, then a refine run on
the task's own rows; retrained in ~17 + 9 CPU-minutes if its settings change) -> calibrate a
length-dependent schedule for tau = 0.86 (budgets x bins of 148 generated positions) -> GRPO + TIS
with sparse rollouts at that schedule -> runs/quickstart/report.json (reward, p5_by_bin,
completion_tokens_mean, sparse_token_fraction, rollout_speedup), calibration.json and plots.

Unlike long_trace (256 prompts, 12 steps), RL cycles 16 training prompts for 24 steps: 6 passes
of 4 steps, so reward_start / reward_end are the means of the first and last pass over the same
prompts (report.json's reward_window_steps). Drawn from 256 prompts, the first and last three
steps hold different prompts, and which prompts a step draws moves its reward more than 12 steps
of learning do (per-step rewards 0.11-0.36).
"""
from configs.long_trace import get_config as long_trace_config


def get_config():
    c = long_trace_config()
    c.workdir = "runs/quickstart"
    c.task.num_train = 16
    c.steps = 24
    c.checkpoint_every = 12
    return c
