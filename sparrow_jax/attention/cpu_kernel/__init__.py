"""Decode attention and whole-sequence flash attention as XLA:CPU FFI custom calls (C++, built on first use).

``sparse_decode_cpu`` has the contract of
:func:`sparrow_jax.attention.contract.sparse_decode_reference`, ``dense_decode_cpu`` that of
:func:`sparrow_jax.attention.decode.dense_decode` (the same kernel over every page: the
like-for-like dense baseline), ``paged_decode_cpu`` reads a shared page pool through a
page table (the rollout engine's layout), sparse or dense, and ``paged_sparse_step_cpu`` is
the engine's sparse decode step in one call (metadata append, group-mean query,
``score_select_cpu``, then ``paged_decode_cpu`` on a pool). ``flash_attention_cpu.cc`` holds the
causal whole-sequence attention's forward and backward (wrapped by
:mod:`sparrow_jax.attention.flash_cpu`). The C++ sources are compiled once per machine with the
system C++ compiler against the XLA FFI headers shipped in jaxlib, into ``$SPARROW_JAX_CACHE`` (default
``~/.cache/sparrow_jax``), keyed by source, jaxlib version, flags and CPU. Without a
compiler, or if the build fails, :func:`cpu_kernel_available` is False (with one warning)
and ``sparse_decode(impl="auto")`` keeps the pure-XLA path.
"""
from __future__ import annotations

import ctypes
import fcntl
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
DENSE_TARGET = "sparrow_dense_decode_cpu"
PAGED_TARGET = "sparrow_paged_decode_cpu"
SCORE_SELECT_TARGET = "sparrow_score_select_cpu"
PAGED_SPARSE_STEP_TARGET = "sparrow_paged_sparse_step_cpu"
FLASH_FORWARD_TARGET = "sparrow_flash_forward_cpu"
FLASH_BACKWARD_TARGET = "sparrow_flash_backward_cpu"
SOURCES = tuple(Path(__file__).with_name(name) for name in ("sparse_decode_cpu.cc", "flash_attention_cpu.cc"))
HEADERS = (Path(__file__).with_name("parallel_for.h"),)
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-std=c++17", "-fPIC")  # each source to an object


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("model name", "flags"))), "")
    except OSError:
        return platform.processor()


def _library_path(compiler: str) -> Path:
    import jaxlib

    key = hashlib.sha256()
    sources = (path.read_bytes() for path in SOURCES + HEADERS)
    for part in (*sources, jaxlib.__version__.encode(), " ".join(FLAGS).encode(), compiler.encode(),
                 platform.machine().encode(), _cpu_signature().encode()):
        key.update(part)
    root = Path(os.environ.get("SPARROW_JAX_CACHE", Path.home() / ".cache" / "sparrow_jax"))
    return root / "cpu_kernel" / key.hexdigest()[:16] / "libsparrow_cpu.so"


def _build(compiler: str, out: Path) -> None:
    """Compile the sources to objects in parallel, link them next to ``out`` and rename the library
    in place (atomic). Under an exclusive lock on ``out``'s folder: processes that start together
    (test workers, jobs sharing a home directory) build once, and the ones that waited load it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return
        with tempfile.TemporaryDirectory(dir=out.parent) as work:
            objects = [str(Path(work) / f"{source.stem}.o") for source in SOURCES]
            compiles = [[compiler, *FLAGS, "-w", f"-I{jax.ffi.include_dir()}", "-c", str(source), "-o", obj]
                        for source, obj in zip(SOURCES, objects)]
            running = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                       for cmd in compiles]
            for cmd, proc in zip(compiles, running):
                _check(cmd, proc)
            library = str(Path(work) / out.name)
            link = [compiler, "-shared", *objects, "-o", library]
            _check(link, subprocess.Popen(link, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
            os.replace(library, out)


def _check(cmd: list[str], proc: subprocess.Popen) -> None:
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"{' '.join(cmd)} took over 300 s")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-4000:]}")


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
        jax.ffi.register_ffi_target(DENSE_TARGET, jax.ffi.pycapsule(library.SparrowDenseDecodeCpu), platform="cpu")
        jax.ffi.register_ffi_target(PAGED_TARGET, jax.ffi.pycapsule(library.SparrowPagedDecodeCpu), platform="cpu")
        jax.ffi.register_ffi_target(SCORE_SELECT_TARGET, jax.ffi.pycapsule(library.SparrowScoreSelectCpu),
                                    platform="cpu")
        jax.ffi.register_ffi_target(PAGED_SPARSE_STEP_TARGET, jax.ffi.pycapsule(library.SparrowPagedSparseStepCpu),
                                    platform="cpu")
        jax.ffi.register_ffi_target(FLASH_FORWARD_TARGET, jax.ffi.pycapsule(library.SparrowFlashForwardCpu),
                                    platform="cpu")
        jax.ffi.register_ffi_target(FLASH_BACKWARD_TARGET, jax.ffi.pycapsule(library.SparrowFlashBackwardCpu),
                                    platform="cpu")
    except Exception as exc:  # any build/load problem: warn once and keep the XLA path
        warnings.warn(f"CPU sparse decode kernel unavailable ({type(exc).__name__}: {str(exc)[:500]}); "
                      "using the XLA path")
        return False
    return True


def _checked_query(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, scale: Optional[float]):
    """Kernel availability and dtype checks; q as float32 rounded to the cache dtype, the scale."""
    if not cpu_kernel_available():
        raise RuntimeError("the CPU decode kernel is unavailable (see the warning); use impl='xla'")
    if k_pages.dtype not in (jnp.float32, jnp.bfloat16) or v_pages.dtype != k_pages.dtype:
        raise TypeError(f"K/V pages must both be float32 or bfloat16, got {k_pages.dtype} / {v_pages.dtype}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    # q rounded to the cache dtype first, as the reference's q.k does.
    return q.astype(k_pages.dtype).astype(jnp.float32), np.float32(scale)


def sparse_decode_cpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_idx: jax.Array,
                      page_valid: jax.Array, positions: jax.Array, scale: Optional[float] = None) -> jax.Array:
    """Block-sparse decode attention on CPU (C++ custom call). Returns [B, H, D] in q's dtype.

    q [B, H, D]; k_pages, v_pages [B, Hkv, P, S, D] float32 or bfloat16; page_idx, page_valid
    [B, Hkv, N]; positions [B]. Raises RuntimeError when the kernel is unavailable.
    """
    check_decode_inputs(q, k_pages, v_pages, page_idx, page_valid, positions)
    q32, scale = _checked_query(q, k_pages, v_pages, scale)
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q32, k_pages, v_pages, page_idx.astype(jnp.int32), page_valid.astype(bool), positions.astype(jnp.int32),
        scale=scale)
    return out.astype(q.dtype)


def dense_decode_cpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, positions: jax.Array,
                     scale: Optional[float] = None) -> jax.Array:
    """Dense decode attention on CPU: the sparse kernel's loop over every page up to the query's.

    Contract of :func:`sparrow_jax.attention.decode.dense_decode`: q [B, H, D]; k_pages,
    v_pages [B, Hkv, P, S, D]; positions [B]. Returns [B, H, D] in q's dtype.
    """
    b, hkv = k_pages.shape[:2]
    none = jnp.zeros((b, hkv, 0), jnp.int32)
    check_decode_inputs(q, k_pages, v_pages, none, none.astype(bool), positions)
    q32, scale = _checked_query(q, k_pages, v_pages, scale)
    out = jax.ffi.ffi_call(DENSE_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q32, k_pages, v_pages, positions.astype(jnp.int32), scale=scale)
    return out.astype(q.dtype)


def paged_decode_cpu(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array,
                     positions: jax.Array, page_idx: Optional[jax.Array] = None,
                     page_valid: Optional[jax.Array] = None, scale: Optional[float] = None) -> jax.Array:
    """Decode attention over a shared page pool. Returns [B, H, D] in q's dtype.

    q [B, H, D]; k_pool, v_pool [NP, Hkv, S, D]; page_table int32 [B, W] (physical page of each
    logical page; every entry must be in [0, NP)); positions [B]. page_idx / page_valid
    [B, Hkv, N] select logical pages (block-sparse); None: dense over logical pages
    0..positions // S. Equal to the per-row kernels on the pages the table gathers.
    """
    b, h, d = q.shape
    if k_pool.ndim != 4 or v_pool.shape != k_pool.shape or k_pool.shape[-1] != d or h % k_pool.shape[1]:
        raise ValueError(f"k_pool / v_pool must be [NP, Hkv, S, D={d}] with H % Hkv == 0, "
                         f"got {k_pool.shape} / {v_pool.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != b or positions.shape != (b,):
        raise ValueError(f"page_table must be [B={b}, W] and positions [B], got {page_table.shape} / {positions.shape}")
    dense = page_idx is None
    if dense:
        page_idx = jnp.zeros((b, k_pool.shape[1], 0), jnp.int32)
        page_valid = jnp.zeros((b, k_pool.shape[1], 0), bool)
    q32, scale = _checked_query(q, k_pool, v_pool, scale)
    out = jax.ffi.ffi_call(PAGED_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q32, k_pool, v_pool, page_table.astype(jnp.int32), page_idx.astype(jnp.int32), page_valid.astype(bool),
        positions.astype(jnp.int32), scale=scale, dense=np.int64(dense))
    return out.astype(q.dtype)


def select_pages_cpu(scores: jax.Array, positions: jax.Array, budget: jax.Array, k_max: int, page_size: int,
                     reserved_first: int = 1, reserved_last: int = 2, page_order: bool = False):
    """:func:`sparrow_jax.attention.selection.select_pages` for one decode step, in C++.

    scores [B, Hkv, P] (finite); positions, budget [B]. Returns (page_idx int32, page_valid
    bool), both [B, Hkv, reserved_first + min(k_max, P) + reserved_last], slot for slot equal
    to ``select_pages(scores, positions[:, None], budget[:, None], ...)`` (a partial sort per
    (row, KV head) instead of XLA's full top-k). ``page_order``: the same pages per (row, KV
    head) in ascending order, valid slots first, without sorting the top-k by score (most of a
    selection's time), for a caller that reads the slots as a set.
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
        reserved_last=np.int64(reserved_last), page_order=np.int64(page_order))


def score_select_cpu(qg: jax.Array, centroid: jax.Array, kmin: Optional[jax.Array], kmax: Optional[jax.Array],
                     positions: jax.Array, budget: jax.Array, k_max: int, page_size: int, reserved_first: int = 1,
                     reserved_last: int = 2, selector: str = "centroid", page_table: Optional[jax.Array] = None):
    """Page scores and block top-k selection of one decode step in one C++ pass.

    qg [B, Hkv, D] group-mean queries; metadata (``centroid``, or Quest's ``kmin`` / ``kmax``)
    per row [B, Hkv, P, D], or a pool [NP, Hkv, D] read through ``page_table`` [B, W] (P = W).
    positions, budget [B]. Returns (page_idx int32, page_valid bool), both
    [B, Hkv, reserved_first + min(k_max, P) + reserved_last]: the slots of
    ``select_pages_cpu(score_pages(qg, ...))`` (scores summed in another order: pages whose
    scores tie to float rounding may swap).
    """
    if not cpu_kernel_available():
        raise RuntimeError("the CPU sparse decode kernel is unavailable (see the warning); use impl='xla'")
    if selector not in ("centroid", "quest"):
        raise ValueError(f"unknown page selector {selector!r}; expected 'centroid' or 'quest'")
    if selector == "quest" and (kmin is None or kmax is None):
        raise ValueError("quest selector needs a cache built with with_minmax=True")
    b, hkv, d = qg.shape
    budget = jnp.broadcast_to(jnp.asarray(budget, jnp.int32), (b,))
    meta_a, meta_b = (kmin, kmax) if selector == "quest" else (centroid, centroid)
    if page_table is None:
        page_table, num_pages = jnp.zeros((b, 0), jnp.int32), meta_a.shape[2]
        expected = (b, hkv, num_pages, d)
    else:
        num_pages = page_table.shape[1]
        expected = (meta_a.shape[0], hkv, d)
    if meta_a.shape != expected or meta_b.shape != expected or positions.shape != (b,):
        raise ValueError(f"score_select_cpu: metadata must be {expected} and positions [B={b}], got "
                         f"{meta_a.shape}, {meta_b.shape}, {positions.shape}")
    k_max = min(int(k_max), num_pages)
    slots = reserved_first + k_max + reserved_last
    out = (jax.ShapeDtypeStruct((b, hkv, slots), jnp.int32), jax.ShapeDtypeStruct((b, hkv, slots), jnp.bool_))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return jax.ffi.ffi_call(SCORE_SELECT_TARGET, out)(
        f32(qg), f32(meta_a), f32(meta_b), page_table.astype(jnp.int32), positions.astype(jnp.int32),
        budget, k_max=np.int64(k_max), page_size=np.int64(page_size),
        reserved_first=np.int64(reserved_first), reserved_last=np.int64(reserved_last),
        quest=np.int64(selector == "quest"))


def paged_sparse_step_cpu(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array,
                          positions: jax.Array, centroid: Optional[jax.Array], kmin: Optional[jax.Array],
                          kmax: Optional[jax.Array], budget: jax.Array, k_max: int, reserved_first: int = 1,
                          reserved_last: int = 2, selector: str = "centroid", scale: Optional[float] = None,
                          k_new: Optional[jax.Array] = None):
    """One layer's sparse decode step on a page pool in one C++ pass per (row, KV head).

    Bit for bit (with up to four query heads per KV head; XLA may sum larger groups' mean in
    another order): ``k_new`` appended to its page's metadata as
    :func:`sparrow_jax.rollout.page_pool.append_to_pool` does, the group-mean query
    (:func:`sparrow_jax.attention.selection.group_mean_query`), :func:`score_select_cpu`, then
    the sparse :func:`paged_decode_cpu`. Why one call: at small batches each thread-pool round,
    and each of XLA's small gather / reduce / scatter ops around it, costs about as much as the
    selection itself.

    q [B, H, D]; k_pool, v_pool [NP, Hkv, S, D] (the step's K / V already written); page_table
    int32 [B, W]; positions, budget [B]; metadata (``centroid``, or Quest's ``kmin`` / ``kmax``)
    [NP, Hkv, D]; k_new [B, Hkv, D] the step's keys, or None (metadata used as given).
    Returns (out [B, H, D], (centroid, kmin, kmax)): the metadata after the append (updated in
    place in XLA's buffers), None where the selector keeps none.
    """
    if selector not in ("centroid", "quest"):
        raise ValueError(f"unknown page selector {selector!r}; expected 'centroid' or 'quest'")
    quest = selector == "quest"
    if (kmin is None or kmax is None) if quest else centroid is None:
        raise ValueError(f"the {selector} selector needs its page metadata ({'kmin / kmax' if quest else 'centroid'})")
    b, h, d = q.shape
    if k_pool.ndim != 4 or v_pool.shape != k_pool.shape or k_pool.shape[-1] != d or h % k_pool.shape[1]:
        raise ValueError(f"k_pool / v_pool must be [NP, Hkv, S, D={d}] with H % Hkv == 0, "
                         f"got {k_pool.shape} / {v_pool.shape}")
    num_pages, hkv = k_pool.shape[:2]
    meta_a = kmin if quest else centroid
    meta_b = kmax if quest else jnp.zeros((0, hkv, d), jnp.float32)  # centroid: an empty stand-in
    if (page_table.ndim != 2 or page_table.shape[0] != b or positions.shape != (b,)
            or meta_a.shape != (num_pages, hkv, d) or (quest and meta_b.shape != meta_a.shape)):
        raise ValueError(f"paged_sparse_step_cpu: expected page_table [B={b}, W], positions [B] and metadata "
                         f"[{num_pages}, {hkv}, {d}], got {page_table.shape}, {positions.shape}, {meta_a.shape}, "
                         f"{meta_b.shape}")
    if k_new is not None and k_new.shape != (b, hkv, d):
        raise ValueError(f"paged_sparse_step_cpu: k_new must be [B={b}, {hkv}, {d}], got {k_new.shape}")
    q_attn, scale = _checked_query(q, k_pool, v_pool, scale)
    budget = jnp.broadcast_to(jnp.asarray(budget, jnp.int32), (b,))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    keys = jnp.zeros((0, hkv, d), jnp.float32) if k_new is None else f32(k_new)
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, meta_a, meta_b))
    out, meta_a, meta_b = jax.ffi.ffi_call(PAGED_SPARSE_STEP_TARGET, shapes, input_output_aliases={6: 1, 7: 2})(
        q_attn, f32(q), k_pool, v_pool, page_table.astype(jnp.int32), keys, f32(meta_a), f32(meta_b),
        positions.astype(jnp.int32), budget, scale=scale, k_max=np.int64(min(int(k_max), page_table.shape[1])),
        reserved_first=np.int64(reserved_first), reserved_last=np.int64(reserved_last), quest=np.int64(quest))
    return out.astype(q.dtype), ((None, meta_a, meta_b) if quest else (meta_a, None, None))
