"""Position-binned block top-k sparsity schedules (Sparrow §4).

A schedule says how many top-k KV pages a decode step may attend to, as a function of
the token's absolute position (prompt included). Positions are cut into bins of
``bin_width`` tokens; bin ``i`` uses ``topk[i]`` pages and the last entry covers every
later position. Reserved pages (the first page and the last two) come on top, so the KV
budget in tokens is ``(topk + reserved_first + reserved_last) * page_size``.

A schedule is a pytree: inside ``jax.jit`` its top-k table is a traced int32 array
``[num_bins]`` and only its layout (page size, bin width, reserved pages, dense layers,
selector, number of bins) and a coarse static ``k_max`` bucket (:func:`k_max_bucket` of the
largest top-k) are static. So ``dataclasses.replace(s, topk=...)`` with the same layout and
bucket compiles nothing new. The sampler splits a rollout into runs of decode steps that
share one ``k_max`` bucket (``decode_segments``); ``k_buckets`` / ``bucket_segments`` give
the tight (unbucketed) values.

Paper presets (``from_preset``) ship in ``presets/paper_schedules.json``: tables from the
release of "Sparrow: Sparse Rollout for Stable and Efficient Long-context RL of Large
Language Models" (arXiv 2606.08446, CC BY 4.0).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.io.presets import PRESET_SELECTOR, paper_presets

FORMAT = "sparrow-schedule/v1"
SELECTORS = ("centroid", "quest")
# Keys of our own JSON schema; "name" and "meta" are optional.
_REQUIRED_KEYS = ("topk", "bin_width", "page_size", "reserved_first", "reserved_last",
                  "dense_layers", "selector")
_OPTIONAL_KEYS = ("format", "name", "meta")


class Segment(NamedTuple):
    """A run of decode steps ``[first_step, first_step + num_steps)`` with static ``k_max``."""

    first_step: int
    num_steps: int
    k_max: int


def k_max_bucket(k: int) -> int:
    """The static ``k_max`` compiled for a largest top-k of ``k``: the smallest value of the
    grid 0, 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5x powers of two) that is
    >= ``k``. Coarse so budget changes rarely recompile; at most 1.5x the pages selected."""
    if not _is_int(k) or k < 0:
        raise ValueError(f"k: expected an int >= 0, got {k!r}")
    k = int(k)
    if k <= 4:
        return k
    p = 1 << (k - 1).bit_length()  # next power of two >= k
    return 3 * p // 4 if k <= 3 * p // 4 else p


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int_tuple(field: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise TypeError(f"{field}: expected a sequence of ints, got {type(value).__name__}")
    bad = [v for v in value if not _is_int(v)]
    if bad:
        raise TypeError(f"{field}: expected ints, got {bad[0]!r} ({type(bad[0]).__name__})")
    return tuple(int(v) for v in value)


@dataclasses.dataclass(frozen=True)
class SparsitySchedule:
    """Block top-k pages per absolute-position bin. A pytree (see the module docstring).

    On the host ``topk`` is a tuple of ints and the schedule is hashable; inside ``jax.jit``
    ``topk`` is a traced int32 array and ``name`` / ``meta`` are dropped.

    Fields:
      topk: top-k pages per bin, non-decreasing; the last entry covers all later positions.
      bin_width: bin width in tokens (absolute position, prompt included). Need not be a
        multiple of page_size (the paper uses 2000 with pages of 16).
      page_size: tokens per KV page.
      reserved_first / reserved_last: pages always kept outside the top-k (sink page;
        current partial page and the one before).
      dense_layers: layer indices that attend densely.
      selector: page scoring rule, "centroid" (Sparrow) or "quest" (min/max bound).
      name: free label (preset name for presets).
      meta: optional JSON-able extras (tau, model, calibration table). Not part of
        equality or hash.
    """

    topk: tuple[int, ...]
    bin_width: int = 2000
    page_size: int = 16
    reserved_first: int = 1
    reserved_last: int = 2
    dense_layers: tuple[int, ...] = (0, 1)
    selector: str = "centroid"
    name: str = ""
    meta: Mapping[str, Any] | None = dataclasses.field(
        default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        # Lists are accepted and stored as tuples so the schedule stays hashable.
        topk = _int_tuple("topk", self.topk)
        object.__setattr__(self, "topk", topk)
        if not topk:
            raise ValueError("topk: expected at least one bin, got an empty sequence")
        neg = [k for k in topk if k < 0]
        if neg:
            raise ValueError(f"topk: expected values >= 0, got {neg[0]} in {list(topk)}")
        for i in range(1, len(topk)):
            if topk[i] < topk[i - 1]:
                raise ValueError(
                    f"topk: expected non-decreasing values (budget grows with position), "
                    f"got topk[{i - 1}]={topk[i - 1]} > topk[{i}]={topk[i]}")
        for field in ("bin_width", "page_size", "reserved_first", "reserved_last"):
            v = getattr(self, field)
            if not _is_int(v):
                raise TypeError(f"{field}: expected an int, got {v!r} ({type(v).__name__})")
            object.__setattr__(self, field, int(v))
        if self.bin_width <= 0:
            raise ValueError(f"bin_width: expected > 0 tokens, got {self.bin_width}")
        if self.page_size <= 0:
            raise ValueError(f"page_size: expected > 0 tokens, got {self.page_size}")
        for field in ("reserved_first", "reserved_last"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field}: expected >= 0 pages, got {getattr(self, field)}")
        dense = _int_tuple("dense_layers", self.dense_layers)
        object.__setattr__(self, "dense_layers", dense)
        if any(d < 0 for d in dense):
            raise ValueError(f"dense_layers: expected layer indices >= 0, got {list(dense)}")
        if len(set(dense)) != len(dense):
            raise ValueError(f"dense_layers: expected distinct layer indices, got {list(dense)}")
        if self.selector not in SELECTORS:
            raise ValueError(f"selector: expected one of {list(SELECTORS)}, got {self.selector!r}")
        if not isinstance(self.name, str):
            raise TypeError(f"name: expected a str, got {type(self.name).__name__}")
        if self.meta is not None and not isinstance(self.meta, Mapping):
            raise TypeError(f"meta: expected a mapping or None, got {type(self.meta).__name__}")

    # ------------------------------------------------------------------ lookups
    @property
    def num_bins(self) -> int:
        return len(self.topk)

    @property
    def k_max(self) -> int:
        """The static ``k_max`` bucket of this schedule (``k_max_bucket(max(topk))``)."""
        traced = self.__dict__.get("_k_max")
        return traced if traced is not None else k_max_bucket(max(self.topk))

    @property
    def reserved(self) -> int:
        """Reserved pages per step (first + last)."""
        return self.reserved_first + self.reserved_last

    def topk_at(self, positions: Any) -> Any:
        """Top-k pages for tokens at absolute ``positions`` (any shape, integer dtype).

        Returns int32 of the same shape: a jax array for jax input (jittable, traced input
        fine), a numpy array otherwise. Negative positions clip to bin 0.
        """
        if isinstance(positions, jax.Array) or isinstance(self.topk, jax.Array):  # tracers too
            xp = jnp
            positions = jnp.asarray(positions)
        else:
            xp = np
            positions = np.asarray(positions)
        if not jnp.issubdtype(positions.dtype, jnp.integer):
            raise TypeError(f"positions: expected an integer dtype, got {positions.dtype}")
        table = xp.asarray(self.topk, dtype=xp.int32)
        return xp.take(table, position_bins(positions, self.bin_width, self.num_bins), mode="clip")

    def budget_tokens_at(self, positions: Any) -> Any:
        """KV budget in tokens at ``positions``: (topk + reserved_first + reserved_last) * page_size."""
        return (self.topk_at(positions) + self.reserved) * self.page_size

    def k_buckets(self, max_position: int) -> tuple[int, ...]:
        """Sorted distinct top-k values used by positions ``[0, max_position)``.

        One decode-loop compilation per value; ``()`` for ``max_position == 0``.
        """
        if not _is_int(max_position) or max_position < 0:
            raise ValueError(f"max_position: expected an int >= 0, got {max_position!r}")
        if max_position == 0:
            return ()
        last_bin = min((int(max_position) - 1) // self.bin_width, self.num_bins - 1)
        return tuple(sorted(set(self.topk[: last_bin + 1])))

    def bucket_segments(self, start_positions: Any, max_new_tokens: int) -> list[Segment]:
        """Split ``max_new_tokens`` decode steps into runs that share one static ``k_max``.

        Args:
          start_positions: int [B], absolute position of each row's first generated token.
          max_new_tokens: number of decode steps; every row advances one position per step.
        Returns:
          Contiguous ``Segment(first_step, num_steps, k_max)`` covering
          ``[0, max_new_tokens)``; in each, every row's topk <= k_max and k_max is the
          max over rows and steps (tight). Consecutive segments have distinct k_max.
        """
        starts = np.asarray(start_positions)
        if starts.ndim != 1 or starts.size == 0:
            raise ValueError(f"start_positions: expected a non-empty 1-D array [B], got shape {starts.shape}")
        if not np.issubdtype(starts.dtype, np.integer):
            raise TypeError(f"start_positions: expected an integer dtype, got {starts.dtype}")
        if starts.min() < 0:
            raise ValueError(f"start_positions: expected >= 0, got min {int(starts.min())}")
        if not _is_int(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
        steps = int(max_new_tokens)
        if steps == 0:
            return []
        # topk is non-decreasing in position and all rows advance together, so the max over
        # rows at every step is the row with the largest start: only its bin changes matter.
        p0 = int(starts.max())
        cuts = [0]
        for i in range(1, self.num_bins):
            edge = i * self.bin_width - p0  # step at which the leading row enters bin i
            if 0 < edge < steps and self.topk[i] != self.topk[i - 1]:
                cuts.append(edge)
        cuts.append(steps)
        return [Segment(a, b - a, int(self.topk_at(p0 + a))) for a, b in zip(cuts[:-1], cuts[1:])]

    def decode_segments(self, start_positions: Any, max_new_tokens: int) -> list[Segment]:
        """``bucket_segments`` with each ``k_max`` raised to its :func:`k_max_bucket` and
        consecutive segments of one bucket merged: the decode loop's compile keys, so a budget
        change that keeps every bucket compiles nothing new."""
        out: list[Segment] = []
        for first, count, k in self.bucket_segments(start_positions, max_new_tokens):
            k = k_max_bucket(k)
            if out and out[-1].k_max == k:
                out[-1] = Segment(out[-1].first_step, out[-1].num_steps + count, k)
            else:
                out.append(Segment(first, count, k))
        return out

    # ------------------------------------------------------------- constructors
    @classmethod
    def fixed(cls, topk: int, **kw: Any) -> "SparsitySchedule":
        """One bin: the same top-k at every position."""
        if not _is_int(topk):
            raise TypeError(f"topk: expected an int, got {topk!r}")
        return cls(topk=(int(topk),), **kw)

    @classmethod
    def from_budget_tokens(cls, budget: int | Sequence[int], page_size: int = 16,
                           reserved_first: int = 1, reserved_last: int = 2,
                           **kw: Any) -> "SparsitySchedule":
        """From a KV budget in tokens (one int, or one per bin).

        topk = budget // page_size - reserved_first - reserved_last: the largest top-k whose
        budget does not exceed ``budget`` (e.g. 2560 tokens -> 157 pages of 16).
        """
        budgets = (budget,) if _is_int(budget) else _int_tuple("budget", budget)
        if not _is_int(page_size) or page_size <= 0:
            raise ValueError(f"page_size: expected an int > 0, got {page_size!r}")
        reserved = reserved_first + reserved_last
        topk = []
        for b in budgets:
            k = b // page_size - reserved
            if k < 0:
                raise ValueError(
                    f"budget: {b} tokens is below the reserved pages alone "
                    f"({reserved} x {page_size} = {reserved * page_size} tokens)")
            topk.append(k)
        return cls(topk=tuple(topk), page_size=page_size, reserved_first=reserved_first,
                   reserved_last=reserved_last, **kw)

    @classmethod
    def from_preset(cls, name: str) -> "SparsitySchedule":
        """A paper preset such as ``"qwen3-4b-0.86"`` (model-target p5 acceptance rate)."""
        data = _load_presets()
        return _from_paper_data(cls, data, name, source="package presets")

    @classmethod
    def from_json(cls, path: str | os.PathLike, name: str | None = None,
                  expected_page_size: int | None = None) -> "SparsitySchedule":
        """Load a ``sparrow-schedule/v1`` file, or preset ``name`` from a paper-presets file.

        Raises FileNotFoundError for a missing file and ValueError for bad JSON, an unknown
        format, a missing or unknown key, an invalid field or a page size other than
        ``expected_page_size``.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"schedule file not found: {path}")
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: bad JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
        try:
            if "presets" in data:
                if name is None:
                    raise ValueError(
                        f"a paper-presets file needs name=..., one of {sorted(data['presets'])}")
                sched = _from_paper_data(cls, data, name, source=path)
            elif data.get("format") == FORMAT:
                if name is not None and data.get("name", "") != name:
                    raise ValueError(f"name: asked for {name!r}, file holds {data.get('name', '')!r}")
                missing = [k for k in _REQUIRED_KEYS if k not in data]
                if missing:
                    raise ValueError(f"missing key(s) {missing}")
                unknown = sorted(set(data) - set(_REQUIRED_KEYS) - set(_OPTIONAL_KEYS))
                if unknown:
                    raise ValueError(f"unknown key(s) {unknown}")
                sched = cls(**{k: data[k] for k in _REQUIRED_KEYS},
                            name=data.get("name", ""), meta=data.get("meta"))
            else:
                raise ValueError(
                    f"unknown format {data.get('format')!r}: expected {FORMAT!r} "
                    f"or a paper-presets file with a 'presets' key")
        except (ValueError, TypeError) as e:
            raise type(e)(f"{path}: {e}") from e
        if expected_page_size is not None and sched.page_size != expected_page_size:
            raise ValueError(f"{path}: page_size {sched.page_size} does not match the expected "
                             f"page size {expected_page_size}")
        return sched

    def to_dict(self) -> dict[str, Any]:
        """The ``sparrow-schedule/v1`` JSON object."""
        d: dict[str, Any] = {
            "format": FORMAT,
            "topk": list(self.topk),
            "bin_width": self.bin_width,
            "page_size": self.page_size,
            "reserved_first": self.reserved_first,
            "reserved_last": self.reserved_last,
            "dense_layers": list(self.dense_layers),
            "selector": self.selector,
            "name": self.name,
        }
        if self.meta is not None:
            d["meta"] = dict(self.meta)
        return d

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the ``sparrow-schedule/v1`` JSON file (meta included when set)."""
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")


# ---------------------------------------------------------------------- pytree
_LAYOUT = ("bin_width", "page_size", "reserved_first", "reserved_last", "dense_layers", "selector")


def _flatten(s: SparsitySchedule):
    # Static: the layout and the k_max bucket (the table's length is static via its shape).
    return (np.asarray(s.topk, np.int32) if isinstance(s.topk, tuple) else s.topk,), \
        (tuple(getattr(s, f) for f in _LAYOUT), s.k_max)


def _unflatten(aux, children) -> SparsitySchedule:
    layout, k_max = aux
    s = object.__new__(SparsitySchedule)  # no validation: topk may be a tracer
    for f, v in zip(_LAYOUT, layout):
        object.__setattr__(s, f, v)
    object.__setattr__(s, "topk", children[0])
    object.__setattr__(s, "name", "")
    object.__setattr__(s, "meta", None)
    object.__setattr__(s, "_k_max", k_max)
    return s


jax.tree_util.register_pytree_node(SparsitySchedule, _flatten, _unflatten)


def position_bins(positions: Any, bin_width: int, num_bins: int) -> Any:
    """Bin index of absolute ``positions`` (int, any shape): ``positions // bin_width`` clipped
    to ``[0, num_bins - 1]``, so the last bin covers every later position. numpy in, numpy
    out; jax in (traced too), jax out. The one binning rule of schedules and statistics."""
    xp = jnp if isinstance(positions, jax.Array) else np
    return xp.clip(positions // bin_width, 0, num_bins - 1).astype(xp.int32)


# ---------------------------------------------------------------------- presets
def _load_presets() -> dict[str, Any]:
    return paper_presets()


def available_presets() -> list[str]:
    """Sorted names of the packaged paper presets, e.g. ``"qwen3-4b-0.86"``."""
    return sorted(_load_presets()["presets"])


SparsitySchedule.available_presets = staticmethod(available_presets)  # type: ignore[attr-defined]


def _from_paper_data(cls: type[SparsitySchedule], data: Mapping[str, Any], name: str,
                     source: str) -> SparsitySchedule:
    for key in ("presets", "page_size", "bin_width_tokens", "reserved_first_pages",
                "reserved_last_pages", "dense_layers"):
        if key not in data:
            raise ValueError(f"{source}: missing key {key!r}")
    presets = data["presets"]
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(presets)}")
    model, _, tau = name.rpartition("-")
    meta: dict[str, Any] = {"source": "Sparrow paper release (arXiv 2606.08446)", "model": model}
    try:
        meta["tau"] = float(tau)
    except ValueError:
        pass
    return cls(topk=presets[name], bin_width=data["bin_width_tokens"],
               page_size=data["page_size"], reserved_first=data["reserved_first_pages"],
               reserved_last=data["reserved_last_pages"], dense_layers=data["dense_layers"],
               selector=PRESET_SELECTOR, name=name, meta=meta)
