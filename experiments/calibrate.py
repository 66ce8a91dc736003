"""Calibrate a sparsity schedule: ``python -m experiments.calibrate --config configs/calibrate_tiny.py``.

Override any field from the command line, e.g. ``--config.calibration.tau=0.9``.
Loads (or warms up) the model as the RL trainer would, measures p5 of the acceptance rate
per position bin for every budget in ``calibration.budgets``, derives the cheapest
non-decreasing schedule with p5 >= tau, validates it on fresh prompts and writes
``<workdir>/schedule.json``, ``<workdir>/calibration.json`` and
``<workdir>/p5_by_position.png``. The last stdout line is a JSON summary.

A workdir that holds a run (checkpoints, metrics, a report or a calibration) is refused unless
``--force``: a resumed run would train on the new schedule. A schedule that fails validation is
not written and the command exits with status 2 naming the bins (unless
``--config.calibration.allow_failed=True``).
"""
from __future__ import annotations

import json

import numpy as np
from absl import flags

from sparrow_jax.run.cli import config_main, define_config_flag


def fixed_budget_trend(table: dict) -> dict:
    """For each budget: p5 and mean in the first and last bin with tokens (the acceptance check:
    p5 falls with position while the mean stays near 1)."""
    out = {}
    for i, k in enumerate(table["budgets"]):
        cells = [(s, p, m) for s, p, m, c in zip(table["bin_starts"], table["p5"][i], table["mean"][i],
                                                   table["count"][i]) if p is not None and c > 0]
        if len(cells) >= 2:
            (s0, p0, m0), (s1, p1, m1) = cells[0], cells[-1]
            out[str(k)] = dict(first_bin=s0, last_bin=s1, p5_first=p0, p5_last=p1, mean_first=m0, mean_last=m1,
                               min_mean=float(np.min([m for _, _, m in cells])))
    return out


def main(spec, force: bool = False) -> None:
    from sparrow_jax.mismatch.calibrate import format_report  # deferred: keeps --help fast
    from sparrow_jax.run.calibration import calibrate_run, check_calibration_target

    check_calibration_target(spec.workdir, force)  # before the model is built: refusing is instant
    result = calibrate_run(spec)
    print(format_report(result))
    trend = fixed_budget_trend(result["table"])
    for k, t in trend.items():
        print(f"fixed top-k {k}: p5 {t['p5_first']:.4f} (bin {t['first_bin']}) -> {t['p5_last']:.4f} "
              f"(bin {t['last_bin']}); mean {t['mean_first']:.4f} -> {t['mean_last']:.4f} (min {t['min_mean']:.4f})")
    val = result["validation"]
    print(f"wrote {result['schedule_path']}, {result['table_path']}, {result['png']} in {result['seconds']:.0f}s")
    print(json.dumps(dict(schedule_topk=list(result["schedule"].topk), tau=val.get("tau"),
                          validation_p5=val["p5"], validation_bins=val["bin_starts"], validation_ok=val.get("ok"),
                          flagged_bins=result["flagged_bins"], seconds=round(result["seconds"], 1),
                          schedule_path=result["schedule_path"])))


def _cli() -> None:
    # flags defined at the start, not at import (define_config_flag says why)
    config = define_config_flag()
    force = flags.DEFINE_bool("force", False, "replace the schedule and calibration of a run in --config.workdir")
    config_main(config, lambda spec: main(spec, force.value))


if __name__ == "__main__":
    _cli()
