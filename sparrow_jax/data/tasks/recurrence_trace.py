"""Recurrence tracing: a long trace of mostly local steps with a minority of look-ups far back.

Why this shape: real chains of thought are mostly local (each line follows from the last few),
with a tail of long-range reads of a fact stated far back. A sparse actor keeps the recent
pages and a few selected ones, so the local lines cost it nothing and the far reads are where
its mismatch lives; ``pointer_trace``, by contrast, makes *every* line a far read (its worst
case). Here the share of far reads and their distance are knobs, and every line is exactly
checkable.

The prompt is a table of two-letter constants, then the two starting digits::

    ad=7;kq=2;ja=#;...;ce=4;
    start 38

The trace writes one numbered line per step (indices two digits, modulo 100). Most lines are
the local recurrence ``v[i] = (v[i-1] + v[i-2]) mod 10``. Every ``far_every``-th index is a
look-up line instead: it writes the key spelled by the last two digits (``0..9`` -> ``a..j``,
``v[i-1]`` first) and that key's constant from the table. The first look-up past ``min_lines``
whose key the trace has not looked up before reads the table's one terminal constant ``#``, and
the trace ends there, so stopping needs no counting (as in ``pointer_trace``)::

    00:3
    01:8
    02:1
    03:9
    04:jb=6     <- look-up line (far_every=4): key of (9, 1), constant from the table
    05:5
    ...
    40:cf=#     <- the terminal look-up ends the trace

Tokens (builtin tokenizer, one per character): a local line is 5 tokens, a look-up line 8.
Only the constant on a look-up line needs the table; everything else needs the last two lines.
Keys made only of the letters ``k..z`` are distractor constants that pad the table to
``context_tokens``; ``gap_tokens`` of unrelated uppercase words between the table and the
``start`` line push every far read further back.

``key_letters=1`` makes every key one letter of ``a..t``: the look-up line reads the letter of
``(v[i-1] + v[i-2] + the index's tens digit) mod 20`` (a table of 20 keys, one-letter
distractors ``u..z``, entries of 4 tokens, look-up lines of 7). Why: matching one key token is
the copy a 2-layer induction circuit learns; a two-letter key needs the conjunction of two
tokens, which tiny models learned only on tables of a handful of entries (docs/results.md). The
key is still computed from the last lines alone; the tens digit keeps the trace from cycling
through a few keys, and 20 keys (not 10) leave one fresh for the terminal past ``min_lines``
(34% of random tables at 240 lines, every 10th a look-up).

Reward (:func:`score`), in [0, 1]: the share of the reference's lines written right before the
first wrong one (a model that gets the first lines right earns a signal before it can finish).
"""
from __future__ import annotations

import string
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from sparrow_jax.data.tasks.pointer_chase import DEFAULT_EOS_MARKERS
from sparrow_jax.data.tasks.pointer_trace import preamble

if TYPE_CHECKING:
    from sparrow_jax.models.tokenizer import Tokenizer

NAME = "recurrence_trace"
TERMINAL = "#"
DIGIT_LETTERS = "abcdefghij"  # digit d is spelled DIGIT_LETTERS[d] in a look-up key
DISTRACTOR_LETTERS = string.ascii_lowercase[10:]  # two-letter keys of these letters are never looked up
ONE_LETTER_KEYS = string.ascii_lowercase[:20]  # key_letters=1: the keys look-ups read
ONE_LETTER_DISTRACTORS = string.ascii_lowercase[20:]
_GAP_STREAM = 0x67617073  # rng stream of the gap text, apart from the table's draws


def lookup_key(prev: int, prev2: int, key_letters: int = 2, index: int = 0) -> str:
    """The key look-up line ``index`` reads: ``v[i-1]`` then ``v[i-2]`` as letters ``a..j``
    (``key_letters=2``), or the letter of ``(v[i-1] + v[i-2] + the index's tens digit) mod 20``
    in ``a..t`` (``key_letters=1``)."""
    if key_letters == 1:
        return ONE_LETTER_KEYS[(prev + prev2 + (index % 100) // 10) % 20]
    return DIGIT_LETTERS[prev] + DIGIT_LETTERS[prev2]


def entry_tokens(key_letters: int = 2) -> int:
    """Tokens of one table entry, ``key=c;``."""
    return key_letters + 3


def read_keys(key_letters: int = 2) -> list[str]:
    """Every key a look-up can read (all must be in the table)."""
    if key_letters == 1:
        return list(ONE_LETTER_KEYS)
    return [a + b for a in DIGIT_LETTERS for b in DIGIT_LETTERS]


def distractor_keys(key_letters: int = 2) -> list[str]:
    """Keys never looked up, that pad the table."""
    if key_letters == 1:
        return list(ONE_LETTER_DISTRACTORS)
    return [a + b for a in DISTRACTOR_LETTERS for b in DISTRACTOR_LETTERS]


def is_lookup(index: int, far_every: int) -> bool:
    """Whether line ``index`` (>= 2) is a look-up line: its two-digit index is a multiple of
    ``far_every`` (a divisor of 100, so the rule holds across the index's wrap at 100)."""
    return index >= 2 and (index % 100) % far_every == 0


def neighbour_key(key: str, step: int, key_letters: int = 2) -> str:
    """The key ``step`` (+-1) places from ``key``: the next or previous letter of ``a..t``
    (``key_letters=1``), or of the second letter's digit (``key_letters=2``)."""
    if key_letters == 1:
        return ONE_LETTER_KEYS[(ONE_LETTER_KEYS.index(key) + step) % len(ONE_LETTER_KEYS)]
    return key[0] + DIGIT_LETTERS[(DIGIT_LETTERS.index(key[1]) + step) % 10]


def trace_lines(table: dict[str, str], start: tuple[int, int], far_every: int, min_lines: int,
                max_lines: int, key_letters: int = 2, slip: float = 0.0,
                rng: np.random.Generator | None = None) -> list[str] | None:
    """The reference lines for ``table`` and ``start``: local lines, look-up lines, and the
    terminal look-up as the last line; None when no terminal look-up happens by ``max_lines``.
    (The table's terminal key must not be looked up before ``min_lines``: see :func:`generate`.)

    ``slip`` > 0 (with ``rng``): each non-terminal look-up reads a neighbouring key
    (:func:`neighbour_key`, +-1 at random) with this probability, unless that key holds the
    terminal, and the trace goes on from the constant it read, so the trace stays consistent with
    its own lines and may end earlier or later (a warm-up's deliberately imperfect rows)."""
    values = [start[0], start[1]]
    lines = [f"00:{start[0]}", f"01:{start[1]}"]
    for i in range(2, max_lines):
        tag = f"{i % 100:02d}:"
        if not is_lookup(i, far_every):
            values.append((values[-1] + values[-2]) % 10)
            lines.append(f"{tag}{values[-1]}")
            continue
        key = lookup_key(values[-1], values[-2], key_letters, i)
        if slip > 0.0 and table[key] != TERMINAL and rng.random() < slip:
            other = neighbour_key(key, int(rng.choice((-1, 1))), key_letters)
            key = other if table.get(other, TERMINAL) != TERMINAL else key
        constant = table[key]
        lines.append(f"{tag}{key}={constant}")
        if constant == TERMINAL:
            return lines
        values.append(int(constant))
    return None


def _check_knobs(context_tokens: int, min_lines: Any, far_every: int, gap_tokens: int, key_letters: int):
    lo, hi = (min_lines, min_lines) if isinstance(min_lines, (int, np.integer)) else tuple(min_lines)
    if not 2 <= lo <= hi:
        raise ValueError(f"recurrence_trace: min_lines must be an int >= 2 or a (lo, hi) range with 2 <= lo <= hi, "
                         f"got {min_lines}")
    if far_every < 2 or 100 % far_every:
        raise ValueError(f"recurrence_trace: far_every must be a divisor of 100 >= 2 (the line index wraps at 100), "
                         f"got {far_every}")
    if int(gap_tokens) < 0:
        raise ValueError(f"recurrence_trace: gap_tokens must be >= 0, got {gap_tokens}")
    if key_letters not in (1, 2):
        raise ValueError(f"recurrence_trace: key_letters must be 1 or 2, got {key_letters}")
    max_entries = len(read_keys(key_letters)) + len(distractor_keys(key_letters))
    if int(context_tokens) > max_entries * entry_tokens(key_letters) + 16:
        raise ValueError(f"recurrence_trace: context_tokens={context_tokens} needs more table entries than the "
                         f"{max_entries} keys of {key_letters} letter(s); use gap_tokens for longer prompts")
    return int(lo), int(hi)


def _random_table(rng: np.random.Generator, key_letters: int, min_lines: int,
                  far_every: int) -> tuple[dict[str, str], tuple[int, int], str]:
    """(table, start, terminal key): random tables, redrawn until the trace's first fresh look-up
    past ``min_lines`` exists (it becomes the terminal)."""
    keys = read_keys(key_letters)
    while True:
        table = {k: str(int(rng.integers(10))) for k in keys}
        start = (int(rng.integers(10)), int(rng.integers(10)))
        seen: set[str] = set()
        values = [start[0], start[1]]
        for i in range(2, min_lines + 100 * far_every):
            if not is_lookup(i, far_every):
                values.append((values[-1] + values[-2]) % 10)
                continue
            key = lookup_key(values[-1], values[-2], key_letters, i)
            if i + 1 >= min_lines and key not in seen:
                return table, start, key
            seen.add(key)
            if len(seen) == len(keys):
                break  # no fresh key left for the terminal: redraw
            values.append(int(table[key]))


def _one_example(rng: np.random.Generator, context_tokens: int, min_lines: int, far_every: int,
                 gap: str, key_letters: int) -> dict[str, Any]:
    """One example whose trace ends at its first fresh look-up past ``min_lines``."""
    table, start, terminal_key = _random_table(rng, key_letters, min_lines, far_every)
    table[terminal_key] = TERMINAL
    n_distractors = max(0, (context_tokens - 16) // entry_tokens(key_letters) - len(read_keys(key_letters)))
    pool = distractor_keys(key_letters)
    for k in rng.choice(pool, size=n_distractors, replace=False):
        table[str(k)] = str(int(rng.integers(10)))
    order = rng.permutation(len(table))
    items = list(table.items())
    records = "".join(f"{items[j][0]}={items[j][1]};" for j in order)
    lines = trace_lines(table, start, far_every, min_lines, min_lines + 100 * far_every, key_letters)
    return {"prompt": f"{records}\n{gap}start {start[0]}{start[1]}\n", "reference": "\n".join(lines),
            "answer": lines[-1], "meta": {"task": NAME, "trace_lines": len(lines), "far_every": far_every,
                                          "lookups": sum(is_lookup(i, far_every) for i in range(2, len(lines))),
                                          "key_letters": key_letters}}


def generate(n: int, seed: int, context_tokens: int = 512, min_lines: "int | tuple[int, int]" = 100,
             far_every: int = 10, gap_tokens: int = 0, tokenizer: "Tokenizer | None" = None,
             key_letters: int = 2) -> list[dict[str, Any]]:
    """``n`` examples: dicts with ``prompt``, ``reference`` (the trace's lines), ``answer`` (the
    terminal look-up line) and ``meta`` (``trace_lines``, ``lookups``, ``prompt_tokens``).

    ``context_tokens``: the table's length in tokens (at least the 100 looked-up keys, ~500
    tokens; distractor keys pad it). ``min_lines``: the trace ends at the first fresh look-up at
    or past this line count (a count or an inclusive ``(lo, hi)`` range drawn per example).
    ``far_every``: one line in ``far_every`` is a look-up (a divisor of 100). ``gap_tokens``:
    unrelated text between the table and the ``start`` line. ``key_letters``: a look-up's key
    spells the last two digits (100 keys) or is one letter (20 keys, tables of 4-token entries).
    Example ``i`` depends only on ``(seed, i)``.
    """
    lo, hi = _check_knobs(context_tokens, min_lines, far_every, gap_tokens, key_letters)
    from sparrow_jax.models.tokenizer import BuiltinTokenizer

    tokenizer = tokenizer or BuiltinTokenizer()
    out = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        gap = preamble(int(gap_tokens), np.random.default_rng([seed, i, _GAP_STREAM]))
        ex = _one_example(rng, int(context_tokens), int(rng.integers(lo, hi + 1)), far_every, gap, key_letters)
        ex["meta"]["prompt_tokens"] = len(tokenizer.encode(ex["prompt"]))
        out.append(ex)
    return out


def parse_prompt(prompt: str) -> tuple[dict[str, str], tuple[int, int]]:
    """(table, start digits) of a prompt :func:`generate` wrote (table entries ``key=c;`` on its
    first line, then ``start XY``); a ValueError names what is missing."""
    records, _, rest = prompt.partition("\n")
    entries = [item.split("=") for item in records.split(";") if item]
    cut = rest.rfind("start ")
    if not entries or any(len(e) != 2 for e in entries) or cut < 0 or not rest[cut + 6:cut + 8].isdigit():
        raise ValueError(f"recurrence_trace.parse_prompt: not a recurrence_trace prompt (a table line of key=c; "
                         f"entries, then 'start XY'): {prompt[:80]!r}...")
    return dict(entries), (int(rest[cut + 6]), int(rest[cut + 7]))


def correct_prefix(completion: str, reference: str,
                   eos_markers: Sequence[str] = DEFAULT_EOS_MARKERS) -> tuple[int, int]:
    """(lines of ``completion`` equal to the reference's before the first difference, lines in
    the reference). Text after an end-of-sequence marker is ignored; surrounding spaces too."""
    for marker in eos_markers:
        cut = completion.find(marker)
        if cut >= 0:
            completion = completion[:cut]
    want = [line.strip() for line in reference.split("\n")]
    got = [line.strip() for line in completion.split("\n")]
    n = 0
    while n < len(want) and n < len(got) and got[n] == want[n]:
        n += 1
    return n, len(want)


def reward_horizon(completion: str, example: dict[str, Any]) -> Optional[int]:
    """Characters of ``completion`` that decide its :func:`score`: through its first wrong line
    (that line's newline included), or None when every reference line is right (all of it
    counts). Tokens past the horizon cannot change the reward, so their policy-gradient terms
    have zero mean: leaving them out of the loss (``train.reward_horizon_mask``) only removes noise."""
    right, total = correct_prefix(completion, example["reference"])
    if right >= total:
        return None
    return min(len(completion), sum(len(line) + 1 for line in completion.split("\n")[:right + 1]))


def score(completion: str, example: dict[str, Any]) -> float:
    """Share of the reference's lines right before the first wrong one (1.0: the whole trace,
    terminal look-up included)."""
    if "reference" not in example:
        raise KeyError(f"recurrence_trace.score: example has no 'reference' field (fields: {sorted(example)})")
    prefix, total = correct_prefix(completion, example["reference"])
    return prefix / total


__all__ = ["NAME", "TERMINAL", "lookup_key", "neighbour_key", "entry_tokens", "read_keys", "distractor_keys",
           "is_lookup", "trace_lines", "generate", "parse_prompt", "correct_prefix", "reward_horizon", "score"]
