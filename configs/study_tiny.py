"""Study: dense rollouts vs sparse at the calibrated tau schedule vs an aggressive fixed budget.

Same seeds and steps for the three arms; writes runs/study_tiny/study.png (reward, response
length, min per-bin p5 over training) and report.json with the final table.
"""
from ml_collections import ConfigDict

from configs.long_trace import get_config as long_trace_config


def get_config():
    c = long_trace_config()
    c.workdir = "runs/study_tiny"
    c.steps = 20
    c.study = ConfigDict(dict(aggressive_topk=1))  # top-k pages of the aggressive arm
    return c
