"""Main entry: ``python -m experiments.run --config configs/<x>.py [--config.<field>=value ...]``.

Runs what the config asks for (:func:`sparrow_jax.run.pipeline.run_pipeline`): optional warm-up
and calibration (configs whose ``schedule.kind`` is ``calibrated``), RL training with dense or
sparse rollouts, optional DistillSparse, then writes ``<workdir>/report.json`` and plots.
A bad config field prints one line naming ``--config.<field>`` and exits with status 2.
"""
from __future__ import annotations

from ml_collections import config_flags

from sparrow_jax.run.cli import config_main

_CONFIG = config_flags.DEFINE_config_file("config", None, "run config file (configs/*.py)", lock_config=True)


def main(spec):
    from sparrow_jax.parallel import initialize_distributed
    initialize_distributed()  # multi-host only when configured (JAX_COORDINATOR_ADDRESS / SPARROW_DISTRIBUTED)
    from sparrow_jax.run.memory_check import check_run_memory
    if check_run_memory(spec):  # prints the memory plan, refuses one that cannot fit; True: a dry run
        return
    from sparrow_jax.run.pipeline import run_pipeline  # deferred: keeps --help fast
    run_pipeline(spec)


if __name__ == "__main__":
    config_main(_CONFIG, main)
