"""Main entry: ``python -m experiments.run --config configs/<x>.py [--config.<field>=value ...]``.

Runs what the config asks for (:func:`sparrow_jax.run.pipeline.run_pipeline`): optional warm-up
and calibration (configs whose ``schedule.kind`` is ``calibrated``), RL training with dense or
sparse rollouts, optional DistillSparse, then writes ``<workdir>/report.json`` and plots.
A bad config field prints one line naming ``--config.<field>`` and exits with status 2.
"""
from __future__ import annotations


from sparrow_jax.run.cli import config_main, define_config_flag

def main(spec) -> None:
    from sparrow_jax.parallel import initialize_distributed
    initialize_distributed()  # multi-host only when configured (JAX_COORDINATOR_ADDRESS / SPARROW_DISTRIBUTED)
    from sparrow_jax.run.memory_check import check_run_memory
    if check_run_memory(spec):  # prints the memory plan, refuses one that cannot fit; True: a dry run
        return
    from sparrow_jax.run.allocator import keep_freed_memory
    keep_freed_memory()  # a train step after a rollout would otherwise fault its buffers in again
    from sparrow_jax.run.pipeline import run_pipeline  # deferred: keeps --help fast
    run_pipeline(spec)


def _cli() -> None:
    # flags defined at the start, not at import (define_config_flag says why)
    config_main(define_config_flag(), main)


if __name__ == "__main__":
    _cli()
