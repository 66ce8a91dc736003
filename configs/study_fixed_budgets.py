"""Study on the long-trace setup: dense rollouts vs the calibrated tau schedule vs an aggressive
fixed budget.

configs/long_trace.py's task and model (pointer_trace, 888-token prompts, up to 704 generated
tokens, the shipped 2-layer warm-up Qwen3 with both layers sparse, bins of 148 generated
positions). The arms (``study.arms``, default dense / calibrated / aggressive) run 20 steps each
with the same seeds, in ``<workdir>/<arm>``: the calibrated arm at the schedule calibrated for
tau = 0.86 into ``<workdir>/schedule.json`` (budgets 16-80 pages), the aggressive arm at a fixed
top-k of 1 page (plus the 3 reserved ones). Writes ``runs/study_fixed_budgets/study.png`` (reward, mean
alpha and rollout seconds per step, and each sparse arm's p5 per bin) and ``report.json`` with
the per-arm table.
"""
from configs.common import study_config
from configs.long_trace import get_config as long_trace_config


def get_config():
    c = long_trace_config()
    c.workdir = "runs/study_fixed_budgets"
    c.steps = 20
    c.study = study_config()
    c.study.aggressive_topk = 1  # top-k pages of the aggressive arm
    return c
