"""Metric logs: one JSON object per step in `<workdir>/metrics.jsonl`, TensorBoard scalars
in `<workdir>/tb`, and a tqdm progress bar.

JSONL format: {"step": int, "<name>": number, ...} per line, flushed after each write.
Non-finite values are written as the strings "NaN", "Infinity", "-Infinity" (strict JSON,
and NaN stays distinguishable from inf); `read_metrics` turns them back into floats.

Resume: `MetricWriter(workdir, resume_step=k)` keeps only lines with step <= k (the
checkpoint at step k was written after step k's metrics), so a run resumed from that
checkpoint does not log steps k+1.. twice; TensorBoard events from step k+1 on are purged
too (tensorboardX `purge_step`); k = -1 (a fresh start) drops every line. A line cut short by a
crash is dropped on open.

Histograms (per-step arrays too big for scalars) go to `<workdir>/alpha_hist.jsonl` through
`HistogramWriter`, one sparse row per step, trimmed on resume like the metrics:
{"step": int, "bins": {"<bin_start>": [[bucket, count], ...]}, "buckets": int}.

Per-bin metrics are named ``<family>/bin_<start>`` (e.g. ``mismatch/alpha_p5/bin_128``);
:func:`logged_bins` and :func:`bin_series` are the one reader of those names.
"""
from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from sparrow_jax.io import NONFINITE_STRINGS, atomic_write_bytes, to_jsonable
from sparrow_jax.io.closing import Closing

METRICS_FILE = "metrics.jsonl"
HISTOGRAM_FILE = "alpha_hist.jsonl"
TB_DIR = "tb"


def logged_bins(records: Iterable[Mapping[str, Any]], family: str) -> list[int]:
    """Sorted bin starts of the per-bin metrics ``<family>/bin_<start>`` present in any of ``records``."""
    prefix = f"{family}/bin_"
    return sorted({int(k[len(prefix):]) for r in records for k in r if k.startswith(prefix)})


def bin_series(records: Sequence[Mapping[str, Any]], family: str) -> dict[int, list]:
    """``{bin_start: [value per record (nan where absent)]}`` of the metrics ``<family>/bin_<start>``."""
    return {b: [r.get(f"{family}/bin_{b}", np.nan) for r in records] for b in logged_bins(records, family)}


def _scalar(name: str, value: Any) -> int | float:
    """Python number from a Python / numpy / jax scalar (or size-1 array)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    try:
        arr = np.asarray(value)
    except Exception as err:
        raise TypeError(f"metric {name!r}: cannot convert {type(value).__name__} to a number ({err})") from err
    if arr.size != 1 or arr.dtype.kind not in "biuf":
        raise TypeError(f"metric {name!r}: expected a numeric scalar, got {arr.dtype} array of shape {arr.shape}")
    item = arr.reshape(()).item()
    return int(item) if isinstance(item, bool) else item


def _parse_lines(path: Path, text: str) -> tuple[list[dict], int]:
    """Parse JSONL text; returns (records, length of the text they cover).

    A final line without a newline is a write cut short by a crash: it is left out.
    A bad line elsewhere is real corruption: ValueError naming file and line.
    """
    records, covered = [], 0
    lines = text.split("\n")
    for number, line in enumerate(lines[:-1], start=1):  # lines[-1] is '' or an unterminated tail
        covered += len(line) + 1
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{path}:{number}: not a JSON line ({err}): {line[:80]!r}") from err
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{number}: expected an object with an int 'step', got {line[:80]!r}")
        records.append(record)
    return records, covered


def _summary_writer_class():
    """tensorboardX.SummaryWriter, imported without torch.

    tensorboardX imports torch only to accept torch tensors (inside try/except ImportError);
    we log Python floats, and importing torch costs seconds and hundreds of MB. Marking it
    unimportable for the duration of the import (sys.modules[name] = None) skips that.
    """
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file (or of `<path>/metrics.jsonl` if `path` is a folder).

    "NaN" / "Infinity" / "-Infinity" strings come back as floats.
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    records, _ = _parse_lines(path, path.read_text(encoding="utf-8"))
    for record in records:
        for key, value in record.items():
            if isinstance(value, str) and value in NONFINITE_STRINGS:
                record[key] = NONFINITE_STRINGS[value]
    return records


def _check_resume_step(resume_step: int | None) -> None:
    if resume_step is not None and (not isinstance(resume_step, int) or resume_step < -1):
        raise ValueError(f"resume_step: expected an int >= -1 or None, got {resume_step!r}")


def _trim(path: Path, resume_step: int | None) -> None:
    """Drop a crash-truncated last line of a JSONL log and, on resume, steps after `resume_step`
    (atomic rewrite; untouched when nothing is dropped)."""
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    records, covered = _parse_lines(path, text)
    kept = records if resume_step is None else [r for r in records if r["step"] <= resume_step]
    if covered == len(text) and len(kept) == len(records):
        return
    lines = "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept)
    atomic_write_bytes(path, lines.encode("utf-8"))


class HistogramWriter:
    """Append per-step per-bin histograms (int [num_bins, buckets]) to `<workdir>/alpha_hist.jsonl`,
    storing only non-empty buckets. Same `is_primary` / `resume_step` rules as :class:`MetricWriter`."""

    def __init__(self, workdir: str | os.PathLike, is_primary: bool = True, resume_step: int | None = None):
        self.path = Path(workdir) / HISTOGRAM_FILE
        self._file: TextIO | None = None
        if not is_primary:
            return
        _check_resume_step(resume_step)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _trim(self.path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, counts: Any, bin_starts: list[int]) -> None:
        """One row: ``counts`` int [len(bin_starts), buckets]."""
        counts = np.asarray(counts)
        if counts.ndim != 2 or counts.shape[0] != len(bin_starts):
            raise ValueError(f"counts: expected [{len(bin_starts)}, buckets], got shape {counts.shape}")
        if self._file is None:
            return
        bins = {str(int(b)): [[int(i), int(row[i])] for i in np.flatnonzero(row)]
                for b, row in zip(bin_starts, counts)}
        self._file.write(json.dumps({"step": int(step), "buckets": int(counts.shape[1]), "bins": bins}) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_histograms(workdir: str | os.PathLike) -> list[tuple[int, dict[int, np.ndarray]]]:
    """``[(step, {bin_start: int64 [buckets]})]`` from `<workdir>/alpha_hist.jsonl` ([] without one)."""
    path = Path(workdir) / HISTOGRAM_FILE
    if not path.is_file():
        return []
    records, _ = _parse_lines(path, path.read_text(encoding="utf-8"))
    out = []
    for r in records:
        bins = {}
        for start, pairs in r["bins"].items():
            dense = np.zeros(int(r["buckets"]), np.int64)
            if pairs:
                idx, cnt = np.asarray(pairs, np.int64).T
                dense[idx] = cnt
            bins[int(start)] = dense
        out.append((r["step"], bins))
    return out


class MetricWriter:
    """Append per-step scalar metrics to `<workdir>/metrics.jsonl` and TensorBoard.

    Args:
      workdir: run folder (created if needed).
      use_tensorboard: also write scalars with tensorboardX to `<workdir>/tb`.
      is_primary: False on non-primary processes of a multi-host run: writes nothing at all.
      resume_step: when resuming from the checkpoint of step k, drop logged steps > k (-1: all).
      flush_secs: TensorBoard flush period (the JSONL file is flushed on every write).
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        use_tensorboard: bool = True,
        is_primary: bool = True,
        resume_step: int | None = None,
        flush_secs: int = 10,
    ):
        self.workdir = Path(workdir)
        self.path = self.workdir / METRICS_FILE
        self.is_primary = is_primary
        self._file: TextIO | None = None
        self._tb = None
        self._closed = False
        if not is_primary:
            return
        _check_resume_step(resume_step)
        self.workdir.mkdir(parents=True, exist_ok=True)
        _trim(self.path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        if use_tensorboard:
            SummaryWriter = _summary_writer_class()
            purge = None if resume_step is None else resume_step + 1  # hides events with step >= purge
            self._tb = SummaryWriter(logdir=str(self.workdir / TB_DIR), purge_step=purge, flush_secs=flush_secs)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log `metrics` (name -> scalar) for `step`: one JSONL line + TensorBoard scalars."""
        if self._closed:
            raise RuntimeError(f"MetricWriter({self.workdir}) is closed")
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step: expected an int >= 0, got {step!r}")
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics: expected a dict, got {type(metrics).__name__}")
        values = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or name == "step":
                raise ValueError(f"metrics: bad name {name!r} (must be a str other than 'step')")
            values[name] = _scalar(name, value)
        if not self.is_primary:
            return
        record = to_jsonable({"step": int(step), **values}, nonfinite="string")
        assert self._file is not None
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()  # a crash loses at most the line being written
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, float(value), global_step=int(step))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> "MetricWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _format_postfix(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        number = _scalar("postfix", value)
    except TypeError:
        return str(value)
    if isinstance(number, float) and math.isfinite(number):
        return f"{number:.4g}"
    return str(number)


class ProgressBar(Closing):
    """Thin tqdm wrapper driven by absolute step numbers.

    `update(step, loss=..., p5=...)` moves the bar to `step` and shows the values (4 significant
    digits). `disable=True` (e.g. on non-primary processes) makes every call a no-op.
    """

    def __init__(
        self,
        total: int | None = None,
        *,
        initial: int = 0,
        desc: str | None = None,
        disable: bool = False,
        file: TextIO | None = None,
        mininterval: float = 0.5,
    ):
        from tqdm import tqdm  # plain text bar: same output in terminals, logs and headless notebooks

        self._bar = tqdm(
            total=total, initial=initial, desc=desc, disable=disable, file=file, mininterval=mininterval, unit="step"
        )
        self._step = initial

    def update(self, step: int, **postfix: Any) -> None:
        if postfix:
            self._bar.set_postfix({k: _format_postfix(v) for k, v in postfix.items()}, refresh=False)
        self._bar.update(int(step) - self._step)  # tqdm counts increments; we are given positions
        self._step = int(step)

    def close(self) -> None:
        self._bar.close()
