"""The headline study (configs/headline.py) on a warm-up whose sparse actor was trained at the
rollouts' layout: does RL with sparse rollouts at 4 selected pages a token train the dense policy as
well as dense rollouts?

    python -m experiments.warmup --config configs/headline_sparse.py   # the warm-up alone (+ reward by trace length)
    python -m experiments.run --config configs/headline_sparse.py

Why: headline.py's warm-up trained its sparse actor at 8 pages with only the first page kept, and
calibrated with the key table's 6 pages kept its late bins needed 92% of the pages (rollouts 1.00x
dense). Here the warm-up adds a slip run on top of it (300 steps, 0.2% of the look-ups slipped: a
second refine, in effect) whose sparse loss is the layout the rollouts use: 4 selected pages, the
table's 6 kept, at weight 2. Its greedy reward at 240 lines rises from 0.57 to 0.83, and top-k 4
keeps p5 >= 0.87 in every bin, so the calibration at tau = 0.86 (p5 alone, the paper's rule: the
survival rule's counts over ~50 greedy rows move by more than its 5% margin) selects 4 pages in
every bin. The warm-up ships (sparrow_jax/sft/checkpoints/headline_sparse): its slip run on top of
the shipped headline warm-up took 5.3-6.0 min on 2 cores and reproduced it bit for bit;
``--noshipped`` retrains both (~50 min).

Measured (docs/results.md; dense, tau = 0.86 and random-reward arms, seeds 0 and 1, 90 min on 2
cores: ``"--config.study.arms=('dense','calibrated','random_reward')"``): dense rollouts raise the
dense held-out reward by 0.161 +- 0.017 (from 0.435; the random-reward control -0.023 +- 0.011); the
4-page schedule holds pooled p5 >= 0.86 in every bin and its rollouts run 1.60x dense (paired), but
the dense policy they train gains 0.087 +- 0.011, 0.075 +- 0.014 below dense: p5 holding is not
enough on this task. The tau = 0.75 / 0.92 and online arms were not run on this warm-up.
"""
from configs.headline import get_config as headline_config


def get_config():
    c = headline_config()
    c.workdir = "runs/headline_sparse"
    c.model.warmup.update(dict(
        # a second refine on top of headline.py's warm-up, its sparse loss at the rollouts' layout; a slip
        # run at 0.2% slips (the warm-up's only phase that continues a finished warm-up)
        slip_steps=300, slip_lr=3e-4, slip_batch_size=4, slip_prob=0.002,
        slip_sparse_topk=4, slip_sparse_weight=2.0, slip_reserved_first=6))
    # p5 alone decides (the paper's rule): with this warm-up top-k 4 holds p5 >= 0.87 in every bin, and
    # the survival rule's shares over ~50 greedy rows per bin move by more than its 5% margin between
    # budgets (top-k 12 below top-k 4 in two bins; docs/results.md)
    c.calibration.min_survival = 0.0
    return c
