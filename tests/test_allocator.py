"""keep_freed_memory: freed host memory stays in the process (glibc), so the next program's
buffers are not faulted in again."""
from __future__ import annotations

import subprocess
import sys

import pytest


# Resident MiB after allocating, touching and freeing 96 MiB, in a fresh interpreter.
_SCRIPT = """
import os, sys
import numpy as np
from sparrow_jax.run.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
before = rss()
block = np.ones(96 * 2**18, np.float32)
del block
print(kept, rss() - before)
"""


def _resident_after_free(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, check=True)
    kept, mib = out.stdout.split()
    return kept, float(mib)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_stays_resident_only_when_kept():
    kept, with_keep = _resident_after_free("keep")
    _, without = _resident_after_free("default")
    assert kept == "True"
    assert with_keep > 80  # the freed 96 MiB are still the process's
    assert without < 16  # glibc's default: an mmap'd block goes back to the OS when freed
