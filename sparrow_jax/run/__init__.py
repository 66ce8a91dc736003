"""The run layer: typed specs parsed once from the run config, the run context builder, the
RL pipeline / calibration / study orchestration, and the command-line entry helper.

Import the submodules directly (``sparrow_jax.run.specs``, ``.context``, ``.pipeline``,
``.calibration``, ``.cli``); this package file imports nothing so that the leaf
``specs`` module can be imported by lower layers for type hints without pulling the rest in.
"""
