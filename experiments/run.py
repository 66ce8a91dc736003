"""Main entry: ``python -m experiments.run --config configs/<x>.py [--config.<field>=value ...]``.

Runs what the config asks for: optional warm-up and calibration (configs whose
``schedule.kind`` is ``calibrated``), RL training with dense or sparse rollouts,
optional DistillSparse, then writes ``<workdir>/report.json`` and plots.
"""
from __future__ import annotations

import sys

from absl import app
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "run config file (configs/*.py)", lock_config=True)


def main(argv):
    del argv
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    from sparrow_jax.parallel import initialize_distributed
    initialize_distributed()  # multi-host only when configured (JAX_COORDINATOR_ADDRESS / SPARROW_DISTRIBUTED)
    from experiments.pipeline import run_pipeline  # deferred: keeps --help fast
    run_pipeline(_CONFIG.value)


if __name__ == "__main__":
    app.run(main)
