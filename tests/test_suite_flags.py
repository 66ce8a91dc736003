"""The suite's compile-time XLA flags (tests/conftest.py): an XLA that rejects one is not given it."""
import os

from conftest import _xla_accepts


def test_the_suite_runs_with_flags_its_xla_accepts_and_a_rejected_flag_is_detected():
    assert "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]
    assert _xla_accepts(os.environ["XLA_FLAGS"])
    assert not _xla_accepts("--xla_backend_optimization_level=0 --xla_no_such_flag=1")
