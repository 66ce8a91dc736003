"""DistillSparse on the warm-up model with a fixed aggressive budget: p5 before/after, reward vs no LoRA."""
from configs.quickstart import get_config as quickstart_config


def get_config():
    c = quickstart_config()
    c.workdir = "runs/distill_tiny"
    c.schedule.kind = "fixed"
    c.schedule.topk = 2  # aggressive: well below what calibration picks for tau = 0.86
    c.distill.enabled = True
    c.distill.learning_rate = 1e-3
    c.distill.kl_coef = 1.0
    c.steps = 12
    return c
