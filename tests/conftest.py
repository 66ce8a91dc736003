import os
import sys

# Tests share helper modules (hf_utils, attention_refs) and import the repo's top-level packages.
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

# The suite compiles hundreds of small programs that then run for milliseconds: LLVM at -O0 compiles
# them ~3x faster. XLA's graph optimisations, its matmul library calls and the C++ kernels (built
# with their own flags) are unchanged. Set before any test starts a JAX backend; the xdist workers
# and the runs tests start as subprocesses inherit it. An explicit level in XLA_FLAGS wins.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``heavy`` (~40-100 s each on 2 cores) run first: started last, one of them keeps
    a worker busy after the other has run out of tests (longest first balances the two workers).
    A stable sort: the order is otherwise the collection's, a module's tests stay together."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)
