"""headline_veto_all.py with the paper's kept pages (the first and the last two) and the key table's pages
found by the quest selector instead of always kept.

    python -m experiments.warmup --config configs/headline_quest.py   # the warm-up alone
    python -m experiments.run --config configs/headline_quest.py "--config.study.arms=('dense','calibrated')"
"""
from configs.headline_veto_all import get_config as headline_veto_all_config


def get_config():
    c = headline_veto_all_config()
    c.workdir = "runs/headline_quest"
    # the slip run's sparse loss at the rollouts' layout: 4 pages selected by quest, the first page kept
    c.model.warmup.update(dict(slip_steps=600, slip_reserved_first=1, slip_selector="quest"))
    c.schedule.reserved_first = 1
    c.schedule.selector = "quest"
    return c
