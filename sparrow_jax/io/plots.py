"""Report figures (PNG), drawn with matplotlib's object API on an Agg canvas.

`matplotlib.figure.Figure` is used directly instead of pyplot, so no global backend is
switched (safe inside notebooks) and no figure is left open. Files are written atomically
(temp file + rename): an interrupted plot never replaces a previous good one.

Series everywhere are `label -> (x values, y values)` with equal lengths; NaN y values
(e.g. empty position bins) show as gaps.
"""
from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from sparrow_jax.io import atomic_write_bytes

Series = Mapping[str, tuple[Sequence[float], Sequence[float]]]
_DPI = 120


def _xy(series: Series, where: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    if not isinstance(series, Mapping) or not series:
        raise ValueError(f"{where}: expected a non-empty dict label -> (x, y), got {series!r:.80}")
    out = []
    for label, pair in series.items():
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"{where}[{label!r}]: expected a pair (x, y), got {type(pair).__name__}")
        x = np.asarray(pair[0], dtype=np.float64).reshape(-1)
        y = np.asarray(pair[1], dtype=np.float64).reshape(-1)
        if x.shape != y.shape or x.size == 0:
            raise ValueError(f"{where}[{label!r}]: x has {x.size} values, y has {y.size}; expected equal and > 0")
        out.append((str(label), x, y))
    return out


def _save_png(fig: Figure, path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"path: expected a .png file name, got {path}")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=_DPI, bbox_inches="tight")
    return atomic_write_bytes(path, buffer.getvalue())


def _draw_series(ax, series: Series, where: str, marker: str | None = None, bands: Mapping | None = None) -> None:
    """Each series as a line; ``bands``: label -> (x, lower, upper), shaded in that line's colour."""
    for label, x, y in _xy(series, where):
        (line,) = ax.plot(x, y, label=label, marker=marker, markersize=3, linewidth=1.5)
        if bands and label in bands:
            bx, lower, upper = (np.asarray(v, dtype=np.float64) for v in bands[label])
            ax.fill_between(bx, lower, upper, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def plot_p5_by_position(
    table: Series, tau: float | None, path: str | os.PathLike, title: str = "p5 of acceptance rate by position"
) -> Path:
    """Tail statistic p5 vs generation position, one line per budget (cf. Sparrow Fig. 3).

    table: budget label -> (bin start positions [n_bins], p5 per bin [n_bins]).
    tau: threshold drawn as a dashed horizontal line (None: no line).
    """
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    _draw_series(ax, table, "table", marker="o")
    if tau is not None:
        ax.axhline(float(tau), color="black", linestyle="--", linewidth=1, label=f"tau = {float(tau):g}")
        ax.legend(fontsize="small")
    ax.set_xlabel("position (tokens, bin start)")
    ax.set_ylabel("p5 of acceptance rate")
    ax.set_title(title)
    return _save_png(fig, path)


def plot_curves(series: Series, path: str | os.PathLike, ylabel: str, title: str = "", xlabel: str = "step") -> Path:
    """Line plot of several curves: series is label -> (steps [n], values [n])."""
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    _draw_series(ax, series, "series")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return _save_png(fig, path)


def plot_panels(
    panels: Sequence[tuple[str, str, Series]], path: str | os.PathLike, xlabel: str = "step",
    columns: int = 0,
) -> Path:
    """Subplots in rows of ``columns`` (0: one row); each panel is (title, ylabel, series label ->
    (steps, values)), or (title, ylabel, series, bands) with bands label -> (steps, lower, upper)
    shaded around that series."""
    if not isinstance(panels, Sequence) or not panels:
        raise ValueError(f"panels: expected a non-empty list of (title, ylabel, series), got {panels!r:.80}")
    cols = min(columns, len(panels)) if columns > 0 else len(panels)
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(4.5 * cols, 3.8 * rows))
    grid = np.atleast_1d(fig.subplots(rows, cols)).reshape(-1)
    for ax in grid[len(panels):]:
        ax.set_axis_off()
    axes = grid[:len(panels)]
    for i, (ax, panel) in enumerate(zip(axes, panels)):
        if not isinstance(panel, (tuple, list)) or len(panel) not in (3, 4):
            raise ValueError(f"panels[{i}]: expected (title, ylabel, series[, bands]), got {panel!r:.80}")
        title, ylabel, series = panel[:3]
        _draw_series(ax, series, f"panels[{i}] ({title!r}) series", bands=panel[3] if len(panel) == 4 else None)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_xlabel(xlabel)
    fig.tight_layout()
    return _save_png(fig, path)
