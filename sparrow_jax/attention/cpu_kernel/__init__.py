"""Block-sparse decode attention as an XLA:CPU FFI custom call (C++, built on first use).

``sparse_decode_cpu`` has the contract of
:func:`sparrow_jax.attention.contract.sparse_decode_reference`. The C++ source
(``sparse_decode_cpu.cc``) is compiled once per machine with the system C++ compiler
against the XLA FFI headers shipped in jaxlib, into ``$SPARROW_JAX_CACHE`` (default
``~/.cache/sparrow_jax``), keyed by source, jaxlib version, flags and CPU. Without a
compiler, or if the build fails, :func:`cpu_kernel_available` is False (with one warning)
and ``sparse_decode(impl="auto")`` keeps the pure-XLA path.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention.contract import check_decode_inputs

TARGET = "sparrow_sparse_decode_cpu"
SELECT_TARGET = "sparrow_select_pages_cpu"
SOURCE = Path(__file__).with_name("sparse_decode_cpu.cc")
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("model name", "flags"))), "")
    except OSError:
        return platform.processor()


def _library_path(compiler: str) -> Path:
    import jaxlib

    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jaxlib.__version__.encode(), " ".join(FLAGS).encode(), compiler.encode(),
                 platform.machine().encode(), _cpu_signature().encode()):
        key.update(part)
    root = Path(os.environ.get("SPARROW_JAX_CACHE", Path.home() / ".cache" / "sparrow_jax"))
    return root / "cpu_kernel" / key.hexdigest()[:16] / "libsparrow_cpu.so"


def _build(compiler: str, out: Path) -> None:
    """Compile to a temporary file next to ``out`` and rename it in place (atomic)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        cmd = [compiler, *FLAGS, "-w", f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@functools.lru_cache(maxsize=None)
def cpu_kernel_available() -> bool:
    """Build (first use on this machine), load and register the custom call. False if impossible."""
    if os.environ.get("SPARROW_JAX_NO_CPU_KERNEL"):
        return False
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        warnings.warn("no C++ compiler found: the CPU sparse decode kernel is off, using the XLA path")
        return False
    try:
        path = _library_path(compiler)
        if not path.exists():
            _build(compiler, path)
        library = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.SparrowSparseDecodeCpu), platform="cpu")
        jax.ffi.register_ffi_target(SELECT_TARGET, jax.ffi.pycapsule(library.SparrowSelectPagesCpu), platform="cpu")
    except Exception as exc:  # any build/load problem: warn once and keep the XLA path
        warnings.warn(f"CPU sparse decode kernel unavailable ({type(exc).__name__}: {str(exc)[:500]}); "
                      "using the XLA path")
        return False
    return True


def sparse_decode_cpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_idx: jax.Array,
                      page_valid: jax.Array, positions: jax.Array, scale: Optional[float] = None) -> jax.Array:
    """Block-sparse decode attention on CPU (C++ custom call). Returns [B, H, D] in q's dtype.

    q [B, H, D]; k_pages, v_pages [B, Hkv, P, S, D] float32 or bfloat16; page_idx, page_valid
    [B, Hkv, N]; positions [B]. Raises RuntimeError when the kernel is unavailable.
    """
    check_decode_inputs(q, k_pages, v_pages, page_idx, page_valid, positions)
    if not cpu_kernel_available():
        raise RuntimeError("the CPU sparse decode kernel is unavailable (see the warning); use impl='xla'")
    if k_pages.dtype not in (jnp.float32, jnp.bfloat16) or v_pages.dtype != k_pages.dtype:
        raise TypeError(f"K/V pages must both be float32 or bfloat16, got {k_pages.dtype} / {v_pages.dtype}")
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else float(scale)
    # q rounded to the cache dtype first, as the reference's q.k does.
    q32 = q.astype(k_pages.dtype).astype(jnp.float32)
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q32, k_pages, v_pages, page_idx.astype(jnp.int32), page_valid.astype(bool), positions.astype(jnp.int32),
        scale=np.float32(scale))
    return out.astype(q.dtype)


def select_pages_cpu(scores: jax.Array, positions: jax.Array, budget: jax.Array, k_max: int, page_size: int,
                     reserved_first: int = 1, reserved_last: int = 2):
    """:func:`sparrow_jax.attention.selection.select_pages` for one decode step, in C++.

    scores [B, Hkv, P] (finite); positions, budget [B]. Returns (page_idx int32, page_valid
    bool), both [B, Hkv, reserved_first + min(k_max, P) + reserved_last], slot for slot equal
    to ``select_pages(scores, positions[:, None], budget[:, None], ...)`` (a partial sort per
    (row, KV head) instead of XLA's full top-k).
    """
    if not cpu_kernel_available():
        raise RuntimeError("the CPU sparse decode kernel is unavailable (see the warning); use impl='xla'")
    b, hkv, num_pages = scores.shape
    if positions.shape != (b,) or jnp.shape(budget) != (b,):
        raise ValueError(f"positions and budget must be [B={b}], got {positions.shape} and {jnp.shape(budget)}")
    k_max = min(int(k_max), num_pages)
    slots = reserved_first + k_max + reserved_last
    out = (jax.ShapeDtypeStruct((b, hkv, slots), jnp.int32), jax.ShapeDtypeStruct((b, hkv, slots), jnp.bool_))
    return jax.ffi.ffi_call(SELECT_TARGET, out)(
        scores.astype(jnp.float32), positions.astype(jnp.int32), jnp.asarray(budget, jnp.int32),
        k_max=np.int64(k_max), page_size=np.int64(page_size), reserved_first=np.int64(reserved_first),
        reserved_last=np.int64(reserved_last))
