import os
import subprocess
import sys

# Tests share helper modules (hf_utils, attention_refs) and import the repo's top-level packages.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

# The suite compiles hundreds of small programs that then run for milliseconds, so compile time is
# most of its time. Two XLA:CPU settings cut it:
# - LLVM at -O0: compiles ~3x faster. XLA's graph optimisations, its matmul library calls and the
#   C++ kernels (built with their own flags) are unchanged.
# - The elemental (pre-MLIR) fusion emitters: ~45% less compile time again (3.1 vs 5.7 s for the
#   sparse scorer's three programs in test_whole_sequence_attention). Newer XLA drops this switch,
#   and an unknown flag aborts the backend, so a child process tries it first.
# Set before any test starts a JAX backend; the xdist workers and the runs tests start as
# subprocesses inherit them. An explicit level in XLA_FLAGS wins (and skips both).
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(flags: str) -> bool:
    probe = "import jax; jax.devices('cpu')"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    try:
        return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=300).returncode == 0
    except (subprocess.TimeoutExpired, OSError):  # a probe that cannot answer: keep the flags known to work
        return False


if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    _flags = os.environ.get("XLA_FLAGS", "")
    _with_both = " ".join((_flags, *_FAST_COMPILE)).strip()
    os.environ["XLA_FLAGS"] = _with_both if _xla_accepts(_with_both) else f"{_flags} {_FAST_COMPILE[0]}".strip()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``heavy`` (~40-100 s each on 2 cores) run first: started last, one of them keeps
    a worker busy after the other has run out of tests (longest first balances the two workers).
    A stable sort: the order is otherwise the collection's, a module's tests stay together."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
