"""Prompt datasets from local files (HF ``datasets``) and a resumable, deterministic batch iterator."""
from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterator, Sequence

import numpy as np

_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


def write_task_dataset(path: str, examples: Sequence[dict[str, Any]]) -> str:
    """Write task examples (prompt, reference, answer, meta, ...) to one parquet file.

    ``meta`` dicts are stored as a JSON string column (their shape may vary between examples);
    ``read_task_dataset`` decodes it back. Returns ``path``.
    """
    import datasets

    if not examples:
        raise ValueError(f"write_task_dataset({path!r}): no examples to write")
    if not path.endswith(".parquet"):
        raise ValueError(f"write_task_dataset: path must end with .parquet, got {path!r}")
    rows = []
    for i, ex in enumerate(examples):
        if "prompt" not in ex:
            raise ValueError(f"write_task_dataset: examples[{i}] has no 'prompt' (fields: {sorted(ex)})")
        row = dict(ex)
        if "meta" in row and not isinstance(row["meta"], str):
            row["meta"] = json.dumps(row["meta"], sort_keys=True)
        rows.append(row)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(path)
    return path


def read_task_dataset(path: str) -> list[dict[str, Any]]:
    """Inverse of ``write_task_dataset``: rows as dicts, ``meta`` decoded from JSON."""
    ds = load_prompt_dataset(path, answer_column=None)
    rows = ds.to_list()
    for row in rows:
        if isinstance(row.get("meta"), str):
            row["meta"] = json.loads(row["meta"])
    return rows


def _data_files(path: str) -> tuple[str, list[str]]:
    """(builder name, files) for a file or a directory of files of one format."""
    if os.path.isdir(path):
        for ext, builder in _FORMATS.items():
            files = sorted(glob.glob(os.path.join(path, f"*{ext}")))
            if files:
                return builder, files
        raise FileNotFoundError(f"prompt dataset directory {path!r} holds no {sorted(_FORMATS)} files "
                                f"(present: {sorted(os.listdir(path))[:20]})")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt dataset file {path!r} does not exist")
    ext = os.path.splitext(path)[1].lower()
    if ext not in _FORMATS:
        raise ValueError(f"prompt dataset {path!r}: unsupported extension {ext!r}, expected one of {sorted(_FORMATS)}")
    return _FORMATS[ext], [path]


def load_prompt_dataset(path: str, prompt_column: str | None = "prompt", answer_column: str | None = "answer",
                        split: str | None = None):
    """Load a local parquet / jsonl / json file (or a directory of them) as a ``datasets.Dataset``.

    ``prompt_column`` / ``answer_column`` are renamed to ``prompt`` / ``answer`` so task code
    reads one schema; a column of None is not looked for (``answer_column=None``: no answer needed).
    ``split`` is passed to ``datasets.load_dataset`` (default ``"train"``, the only split of local
    files; slicing such as ``"train[:100]"`` works).
    """
    import datasets

    builder, files = _data_files(path)
    ds = datasets.load_dataset(builder, data_files=files, split=split or "train")
    columns = list(ds.column_names)
    renames = {}
    for role, col in (("prompt", prompt_column), ("answer", answer_column)):
        if col is None:
            continue
        if col not in columns:
            raise KeyError(f"prompt dataset {path!r}: {role} column {col!r} not found; columns present: {columns}")
        if col != role:
            if role in columns:
                raise ValueError(f"prompt dataset {path!r}: cannot rename {col!r} to {role!r}, "
                                 f"a column {role!r} already exists; columns present: {columns}")
            renames[col] = role
    return ds.rename_columns(renames) if renames else ds


# Column names of the prompt and the answer, in the order they are looked for: ours, verl's data
# preprocessors (``prompt`` as chat messages, ``reward_model.ground_truth``), and common raw schemas.
PROMPT_COLUMNS = ("prompt", "question", "problem")
ANSWER_COLUMNS = ("answer", "reward_model.ground_truth", "ground_truth")


def _column_value(row: dict[str, Any], column: str) -> Any:
    """``row[column]``, a dotted column reading a field of a struct column (``reward_model.ground_truth``)."""
    value: Any = row
    for part in column.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def load_examples(path: str) -> list[dict[str, Any]]:
    """Rows of a local prompt file as task examples with ``prompt`` and ``answer`` keys.

    ``prompt``: the first of :data:`PROMPT_COLUMNS` present (a string, or verl's list of chat
    messages ``[{"role", "content"}]``); ``answer``: the first of :data:`ANSWER_COLUMNS` present
    (a dotted name reads a struct column). The other columns are kept as they are. A file with
    neither column, or a row whose value is empty, raises naming the file, the row and the columns.
    """
    ds = load_prompt_dataset(path, prompt_column=None, answer_column=None)
    columns = list(ds.column_names)
    rows = [dict(r) for r in ds]
    picked = {}
    for role, names in (("prompt", PROMPT_COLUMNS), ("answer", ANSWER_COLUMNS)):
        found = [n for n in names if n.split(".")[0] in columns and (
            "." not in n or rows and _column_value(rows[0], n) is not None)]
        if not found:
            raise KeyError(f"prompt dataset {path!r}: no {role} column (looked for {list(names)}); "
                           f"columns present: {columns}")
        picked[role] = found[0]
    for i, row in enumerate(rows):
        for role, column in picked.items():
            value = _column_value(row, column)
            if value is None or (isinstance(value, (str, list)) and not value):
                raise ValueError(f"prompt dataset {path!r}: row {i} has an empty {column!r} ({role})")
            row[role] = value if role == "prompt" else str(value)
    return rows


class PromptIterator:
    """Infinite (or ``num_epochs``-long) iterator over batches of rows (lists of dicts).

    Epoch ``e`` visits the rows in ``permutation(seed, e)`` order (identity when
    ``shuffle=False``); a batch that runs past the end of an epoch continues into the next, so
    every batch is full and every row is seen once per epoch. ``state()`` is a small JSON-able
    dict; ``restore(state)`` continues exactly where that state was taken.
    """

    def __init__(self, dataset: Any, batch_size: int, seed: int = 0, shuffle: bool = True,
                 num_epochs: int | None = None):
        n = len(dataset)
        if n == 0:
            raise ValueError("PromptIterator: dataset is empty")
        if int(batch_size) <= 0:
            raise ValueError(f"PromptIterator: batch_size must be positive, got {batch_size}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.num_epochs = num_epochs
        self._n = n
        self._epoch = 0
        self._index = 0           # position inside the current epoch's order
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(self._n) if self.shuffle
                           else np.arange(self._n))
            self._order_epoch = epoch
        return self._order

    def next_indices(self) -> list[int]:
        """Row indices of the next batch (advances the position)."""
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        out: list[int] = []
        while len(out) < self.batch_size:
            if self.num_epochs is not None and self._epoch >= self.num_epochs:
                break  # last, partial batch of a finite run
            order = self._epoch_order(self._epoch)
            take = min(self.batch_size - len(out), self._n - self._index)
            out.extend(int(i) for i in order[self._index:self._index + take])
            self._index += take
            if self._index == self._n:
                self._epoch, self._index = self._epoch + 1, 0
        return out

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        return self

    def __next__(self) -> list[dict[str, Any]]:
        idx = self.next_indices()
        if isinstance(self.dataset, (list, tuple)):
            return [self.dataset[i] for i in idx]
        cols = self.dataset[idx]   # datasets.Dataset: dict of columns
        return [{k: v[j] for k, v in cols.items()} for j in range(len(idx))]

    @property
    def epoch(self) -> int:
        return self._epoch

    def state(self) -> dict[str, Any]:
        return dict(epoch=self._epoch, index=self._index, seed=self.seed, shuffle=self.shuffle,
                    num_examples=self._n, batch_size=self.batch_size)

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the dataset, seed and shuffle flag must match the ones it was
        taken with (a different batch size is allowed: the position is counted in rows)."""
        for field, mine in (("seed", self.seed), ("shuffle", self.shuffle), ("num_examples", self._n)):
            if field not in state:
                raise KeyError(f"PromptIterator.restore: state has no {field!r} (got keys {sorted(state)})")
            if state[field] != mine:
                raise ValueError(f"PromptIterator.restore: state {field}={state[field]!r} but this iterator "
                                 f"has {field}={mine!r}")
        index = int(state["index"])
        if not 0 <= index < self._n or int(state["epoch"]) < 0:
            raise ValueError(f"PromptIterator.restore: position epoch={state['epoch']} index={index} is out of "
                             f"range for {self._n} examples")
        self._epoch, self._index = int(state["epoch"]), index
