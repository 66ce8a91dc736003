"""The README's first command: the whole Sparrow method end to end on a laptop CPU, in the regime
it exists for, long generated traces (configs/long_trace.py: 888-token prompts, completions of
up to 704 generated tokens, ~600 on average, a 2-layer tiny Qwen3 with both layers sparse).

shipped warm-up (sparrow_jax/sft/checkpoints/long_trace*/: the curriculum, then a refine run on
the task's own rows; retrained in ~17 + 9 CPU-minutes if its settings change) -> calibrate a length-dependent schedule for tau = 0.86 (budgets x bins of 148
generated positions) -> GRPO + TIS with sparse rollouts at that schedule -> runs/quickstart/
report.json (reward, p5_by_bin, completion_tokens_mean, sparse_token_fraction, rollout_speedup),
calibration.json and plots.
"""
from configs.long_trace import get_config as long_trace_config


def get_config():
    c = long_trace_config()
    c.workdir = "runs/quickstart"
    return c
