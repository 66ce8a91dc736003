"""The quickstart's setup after a long context: configs/quickstart.py (long_trace's task, model and
calibration; RL cycling 16 training prompts for 24 steps) with an 888-token preamble of unrelated
text before the 888 tokens of records: 1776-token prompts, completions of up to 704 generated
tokens, ~2.4K tokens per rollout.

    python -m experiments.warmup --config configs/long_preamble.py   # the preamble phase (~19 min)
    python -m experiments.run --config configs/long_preamble.py      # calibration, GRPO, report

The warm-up ships (sparrow_jax/sft/checkpoints/long_preamble/: long_trace's shipped model, then a
preamble phase of 300 steps on this task's rows). What the preamble tests: whether a longer
context at the same number of records lets the same budget cover a smaller share of it. On this
model it does not: the lookups need ~64 pages here against 24-32 without the preamble (Quest's
key bounds admit more pages as the rows grow), so the sparse actor still reads about half of
what it can see (README: the figures of one run).
"""
from configs.quickstart import get_config as quickstart_config


def get_config():
    c = quickstart_config()
    c.workdir = "runs/long_preamble"
    c.task.preamble_tokens = 888  # prompts of 1776 tokens: the bins of 148 stay bins of generated positions
    # The preamble phase (WarmupSettings.preamble_steps): long_trace's model fails past the
    # positions it was trained on (greedy 104-hop reward 0.00 at 1770-token prompts); 300 steps
    # of 4 rows of ~2.4K tokens teach it the new positions and to read past the preamble.
    c.model.warmup.preamble_steps = 300
    c.model.warmup.preamble_lr = 1e-3
    c.model.warmup.preamble_batch_size = 4
    c.model.warmup.eval_hops = (32, 104)
    c.calibration.num_prompts = 16  # a bin's p5 from 8 prompts x 2 samples moved by 0.1-0.3 between draws
    return c
