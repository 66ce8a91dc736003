"""Input/output: orbax checkpoints, metric logs, plots, crash-safe JSON results.

The JSON helpers live here (they are tiny and used by every submodule). The
heavier submodules are imported lazily, so `from sparrow_jax.io import
atomic_write_json` does not pull in orbax or matplotlib.

Non-finite floats: JSON has no NaN/Infinity, so `to_jsonable` writes them as the
strings "NaN", "Infinity", "-Infinity" by default (kept distinguishable, unlike
null); `read_metrics` turns them back into floats.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

import numpy as np

NonFinite = Literal["string", "null", "error"]
NONFINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _float_to_json(value: float, nonfinite: NonFinite, where: str) -> float | str | None:
    if math.isfinite(value):
        return value
    if nonfinite == "string":
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if nonfinite == "null":
        return None
    raise ValueError(f"{where}: non-finite float {value!r} cannot be written as strict JSON")


def to_jsonable(obj: Any, *, nonfinite: NonFinite = "string", where: str = "<root>") -> Any:
    """Convert `obj` to plain JSON types (dict[str, ...], list, str, int, float, bool, None).

    numpy / jax scalars become Python scalars, arrays become nested lists, tuples become
    lists. Non-finite floats follow `nonfinite` ("string" | "null" | "error").
    Raises TypeError naming the offending path (e.g. "meta/schedule/0") for anything else,
    including non-string dict keys (JSON would silently stringify them).
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return _float_to_json(float(obj), nonfinite, where)
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: dict key {key!r} is {type(key).__name__}, expected str")
            out[key] = to_jsonable(value, nonfinite=nonfinite, where=f"{where}/{key}")
        return out
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v, nonfinite=nonfinite, where=f"{where}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, np.generic) or hasattr(obj, "__array__"):
        try:
            arr = np.asarray(obj)
        except Exception as err:  # e.g. typed jax PRNG keys: convert with jax.random.key_data
            raise TypeError(f"{where}: cannot convert {type(obj).__name__} to an array ({err})") from err
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"{where}: array dtype {arr.dtype} is not bool/int/float")
        if arr.ndim == 0:
            return to_jsonable(arr.item(), nonfinite=nonfinite, where=where)
        return to_jsonable(arr.tolist(), nonfinite=nonfinite, where=where)
    raise TypeError(f"{where}: cannot write {type(obj).__name__} as JSON")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` so a crash leaves either the old file or the new one, never half.

    Writes a temp file in the same directory, fsyncs it, then `os.replace`s it (atomic on
    POSIX within one filesystem) and fsyncs the directory. Creates parent directories.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results should be readable like normal files
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(directory: Path) -> None:
    """Persist a rename (best effort: some filesystems refuse to open directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_json(
    path: str | os.PathLike, obj: Any, *, indent: int | None = 2, nonfinite: NonFinite = "string"
) -> Path:
    """Atomically write `obj` as strict JSON (see `to_jsonable`) to `path`; returns the path.

    The object is fully converted and serialised before the file system is touched, so bad
    input raises without disturbing a previous result at `path`.
    """
    text = json.dumps(to_jsonable(obj, nonfinite=nonfinite), indent=indent, allow_nan=False)
    return atomic_write_bytes(path, (text + "\n").encode("utf-8"))


_LAZY = {
    "CheckpointManager": "checkpoint",
    "CheckpointMismatchError": "checkpoint",
    "MetricWriter": "metrics",
    "ProgressBar": "metrics",
    "read_metrics": "metrics",
    "plot_p5_by_position": "plots",
    "plot_curves": "plots",
    "plot_panels": "plots",
}

__all__ = ["to_jsonable", "atomic_write_bytes", "atomic_write_json", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
