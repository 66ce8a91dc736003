"""headline_veto.py's study on a warm-up whose sparse actor was trained at 1 selected page: can the
calibrated schedule keep <= 30% of the visible pages?

    python -m experiments.warmup --config configs/headline_lean.py   # the warm-up alone (+ sparse check)
    python -m experiments.run --config configs/headline_lean.py "--config.study.arms=('dense','calibrated')"

Why: on headline_sparse.py's warm-up (its slip run's sparse loss at 4 selected pages) the calibration at
tau = 0.86 cannot go below 4 pages (min p5 0.0008 / 0.006 / 0.035 at 1 / 2 / 3 pages), which keeps 39% of
the visible pages of these ~1.4K-token traces: the key table's 6 pages and the last 2 are kept in every
step, so <= 30% needs at most 1 selected page. The task needs no more: a line reads the last few lines
and, every 10th line, one key of the table. The dense warm-up instead reads its line numbers through
attention spread over the whole trace. Here the same slip run (300 steps on top of the shipped headline
warm-up) trains the sparse loss at 1 selected page, and the calibration tries budgets from 1 page.

Measured (docs/results.md): the sparse actor's greedy reward at 240 lines is 0.656 / 0.294 / 0.167 at
1 / 2 / 4 pages (dense 0.687), and the calibration selects 1 page in the bins before position 1280. The
last bin (1280+, the longest traces' ends) fails at every budget, 96 pages included (p5 ~0.55 on fresh
prompts), so the schedule is 1 / 1 / 1 / 1 / 1 / 96: 39% of the visible pages kept, rollouts 1.52x dense
(paired), against 1.72x for headline_veto.py's 4 pages. Seeds 0 and 1 (each its own study): dense rollouts gain
+0.113 +- 0.009 from 0.317, the 1-page rollouts with the veto +0.063 +- 0.007, 0.051 +- 0.009 below dense.
This warm-up buys nothing over headline_veto.py's.
"""
from configs.headline_veto import get_config as headline_veto_config


def get_config():
    c = headline_veto_config()
    c.workdir = "runs/headline_lean"
    c.model.warmup.slip_sparse_topk = 1  # the slip run's sparse loss at 1 selected page (+ the table's 6, the last 2)
    c.calibration.budgets = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96)
    return c
