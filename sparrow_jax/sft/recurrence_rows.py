"""Warm-up rows of ``recurrence_trace``: its task knobs, examples with a pruned table, and
fixed row lengths.

The warm-up curriculum's stages ``(steps, max_context, max_hops, batch_size)`` mean, for this
task: ``max_context`` caps the prompt's table (tokens, 5 an entry (4 with one-letter keys): the keys the trace reads
plus random others, pruned from the task's table; the task's table once it is that long) and
``max_hops`` caps the trace (the rows' ``min_lines``, drawn in ``[max_hops // 2, max_hops]``).
Why a pruned table: a look-up is learned only when a row holds a handful of records (as the
pointer tasks measured); the task's table always holds all 100 digit-pair keys, ~500 tokens,
so short rows need fewer records, and later stages grow the table back to the task's.

A trace ends at the first look-up at or past ``min_lines`` whose key it has not read before, so
its length varies; rows longer than ``min_lines + (EXTRA_LOOKUPS + 1) * far_every`` lines are
redrawn (deterministically), which bounds the padded row length.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from sparrow_jax.data.tasks import recurrence_trace as rt

if TYPE_CHECKING:
    from sparrow_jax.run.specs import TaskSpec

NAME = rt.NAME
DEFAULT_MIN_LINES, DEFAULT_FAR_EVERY, DEFAULT_KEY_LETTERS = 100, 10, 2  # recurrence_trace.generate's defaults
EXTRA_LOOKUPS = 1  # already-read keys a kept row may pass before its terminal look-up
START_LINE_TOKENS = 6  # "\n" after the table, then "start", " ", two digits, "\n"


def task_knobs(task: TaskSpec) -> dict[str, Any]:
    """The task fields that change the warm-up data: name, context_tokens, min_lines, far_every,
    gap_tokens and (when not the default 2) key_letters (unset knobs resolved to the generator's
    defaults, so the key names them; key_letters=2 left out so earlier cache keys hold)."""
    knobs = dict(name=NAME, context_tokens=int(task.context_tokens),
                 min_lines=int(task.min_lines or DEFAULT_MIN_LINES),
                 far_every=int(task.far_every or DEFAULT_FAR_EVERY), gap_tokens=int(task.gap_tokens))
    key_letters = int(task.key_letters or DEFAULT_KEY_LETTERS)
    return knobs if key_letters == DEFAULT_KEY_LETTERS else dict(knobs, key_letters=key_letters)


def _key_letters(knobs: dict[str, Any]) -> int:
    return knobs.get("key_letters", DEFAULT_KEY_LETTERS)


def generate(knobs: dict[str, Any], n: int, seed: int, min_lines: "int | tuple[int, int] | None" = None
             ) -> list[dict[str, Any]]:
    """``n`` task examples with the knobs (``min_lines`` overridable)."""
    return rt.generate(n, seed, context_tokens=knobs["context_tokens"],
                       min_lines=knobs["min_lines"] if min_lines is None else min_lines,
                       far_every=knobs["far_every"], gap_tokens=knobs["gap_tokens"], key_letters=_key_letters(knobs))


def table_tokens(knobs: dict[str, Any]) -> int:
    """Tokens of the task's full table (``recurrence_trace`` pads it to ``context_tokens``)."""
    size = rt.entry_tokens(_key_letters(knobs))
    entries = max(len(rt.read_keys(_key_letters(knobs))), (knobs["context_tokens"] - 16) // size)
    return entries * size


def max_lines(knobs: dict[str, Any], min_lines: int) -> int:
    """Most lines of a kept trace drawn at ``min_lines``."""
    return int(min_lines) - 1 + (EXTRA_LOOKUPS + 1) * knobs["far_every"]


def reference_tokens(knobs: dict[str, Any], lines: int) -> int:
    """Most reference + <eos> tokens of a trace of ``lines`` lines: 5 a line (newline included,
    the last line's replaced by <eos>), 1 + key_letters more a look-up line (indices 2.. that
    ``far_every`` divides)."""
    f = knobs["far_every"]
    lookups = len([i for i in range(2, lines) if rt.is_lookup(i, f)])
    return 5 * lines + (1 + _key_letters(knobs)) * lookups


def row_length(knobs: dict[str, Any], table: int, min_lines: int) -> int:
    """Padded length (a multiple of 32) of a row whose table has at most ``table`` tokens and
    whose trace was drawn at most at ``min_lines``."""
    longest = min(table, table_tokens(knobs)) + knobs["gap_tokens"] + START_LINE_TOKENS \
        + reference_tokens(knobs, max_lines(knobs, min_lines))
    return -(-longest // 32) * 32


def prune_table(example: dict[str, Any], table: int, rng: np.random.Generator) -> dict[str, Any]:
    """``example`` with its table cut to at most ``table`` tokens: every key the reference reads,
    then random others, in the table's order (the whole table when it fits)."""
    records, rest = example["prompt"].split("\n", 1)
    entries = [r for r in records.split(";") if r]
    size = rt.entry_tokens(example["meta"].get("key_letters", DEFAULT_KEY_LETTERS))
    if len(entries) * size <= table:
        return example
    read = {line.split(":", 1)[1].split("=")[0] for line in example["reference"].split("\n") if "=" in line}
    others = [i for i, r in enumerate(entries) if r.split("=")[0] not in read]
    room = max(0, table // size - (len(entries) - len(others)))
    dropped = set(rng.permutation(others)[room:].tolist()) if room < len(others) else set()
    kept = "".join(f"{r};" for i, r in enumerate(entries) if i not in dropped)
    return dict(example, prompt=f"{kept}\n{rest}")


def draw_rows(knobs: dict[str, Any], n: int, rng: np.random.Generator, table: tuple[int, int],
              lines: tuple[int, int]) -> list[dict[str, Any]]:
    """``n`` fresh examples: ``min_lines`` uniform in ``lines``, the table pruned to a length
    uniform in ``table`` (tokens); traces longer than :func:`max_lines` are redrawn."""
    out = []
    while len(out) < n:
        seed = int(rng.integers(0, 2 ** 31 - 1))  # draw order: seed, trace length, table length
        m, t = int(rng.integers(lines[0], lines[1] + 1)), int(rng.integers(table[0], table[1] + 1))
        ex = generate(knobs, 1, seed, min_lines=m)[0]
        if ex["meta"]["trace_lines"] <= max_lines(knobs, m):
            out.append(prune_table(ex, t, rng))
    return out


def stage_rows(knobs: dict[str, Any], n: int, rng: np.random.Generator, min_table: int, max_table: int,
               max_hops: int) -> list[dict[str, Any]]:
    """Rows of a curriculum stage: tables of ``[min_table, max_table]`` tokens (capped at the
    task's), traces drawn at ``[max_hops // 2, max_hops]`` lines (at least 2)."""
    hi_table = min(int(max_table), table_tokens(knobs))
    hi = max(2, int(max_hops))
    return draw_rows(knobs, n, rng, (min(int(min_table), hi_table), hi_table), (max(2, hi // 2), hi))


def task_rows(knobs: dict[str, Any], n: int, rng: np.random.Generator, slip: float = 0.0) -> list[dict[str, Any]]:
    """``n`` rows exactly as the task poses them (its table and ``min_lines``; long traces redrawn);
    ``slip`` > 0: their references slip look-up keys (:func:`slip_reference`)."""
    full = table_tokens(knobs)
    rows = draw_rows(knobs, n, rng, (full, full), (knobs["min_lines"], knobs["min_lines"]))
    return [slip_reference(knobs, row, slip, rng) for row in rows] if slip > 0.0 else rows


SLIP_TRIES = 64


def slip_reference(knobs: dict[str, Any], example: dict[str, Any], slip: float,
                   rng: np.random.Generator) -> dict[str, Any]:
    """``example`` with a reference whose look-ups each read a neighbouring key with probability
    ``slip`` (``recurrence_trace.trace_lines``), redrawn until the trace ends within
    :func:`max_lines` of the task's ``min_lines`` (the row's padded length); the clean reference
    after ``SLIP_TRIES`` draws. Why: a warm-up that copies these rows keeps a share of its
    probability on the neighbouring key at every look-up, a flaw its own samples expose and RL can
    remove (the clean warm-up's errors need skills RL barely moves, docs/results.md)."""
    table, start = rt.parse_prompt(example["prompt"])
    f, limit = knobs["far_every"], max_lines(knobs, knobs["min_lines"])
    for _ in range(SLIP_TRIES):
        lines = rt.trace_lines(table, start, f, knobs["min_lines"], limit, _key_letters(knobs), slip=slip, rng=rng)
        if lines is not None:
            return dict(example, reference="\n".join(lines))
    return example
