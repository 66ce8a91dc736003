"""Task examples for the warm-up: the task knobs that shape them, generation, prompt ids,
reference and padded row lengths, and the extra questions a pointer-chase row asks.

Imports data and models (and :mod:`recurrence_rows`, the recurrence_trace rows).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from sparrow_jax.data.registry import get_task
from sparrow_jax.models.tokenizer import BuiltinTokenizer
from sparrow_jax.sft import recurrence_rows

if TYPE_CHECKING:
    from sparrow_jax.run.specs import TaskSpec

# Seed offsets of the three example streams: training, held-out evaluation (the RL and
# calibration prompts use task.seed itself, so none of them overlap).
TRAIN_STREAM, EVAL_STREAM = 0x5EED_0001, 0x5EED_0002


def task_knobs(task: TaskSpec) -> dict[str, Any]:
    """The task fields that change the warm-up data: name, context_tokens, hops, distractor_frac,
    key_len, and preamble_tokens when set (absent at 0: the keys of warm-ups without one stay).

    ``task.isolate_chain`` is not one: it changes only where off-chain records point, which no
    reference trace visits, so the warm-up trains the same lookups either way.
    recurrence_trace has knobs of its own (:func:`recurrence_rows.task_knobs`)."""
    if task.name == recurrence_rows.NAME:
        return recurrence_rows.task_knobs(task)
    knobs = dict(name=str(task.name), context_tokens=int(task.context_tokens),
                 hops=int(task.hops), distractor_frac=float(task.distractor_frac),
                 key_len=int(task.key_len))
    if int(task.preamble_tokens):
        knobs["preamble_tokens"] = int(task.preamble_tokens)
    task = get_task(knobs["name"])
    if task.generate is None:
        raise ValueError(f"task.name={knobs['name']!r} has no generator; the warm-up needs a synthetic "
                         f"task with reference traces (e.g. 'pointer_chase')")
    if knobs["hops"] < 1:
        raise ValueError(f"task.hops must be >= 1, got {knobs['hops']}")
    return knobs


def generate_examples(knobs: dict[str, Any], n: int, seed: int, context_tokens: int | None = None,
                      hops: "int | tuple[int, int] | None" = None) -> list[dict[str, Any]]:
    """``n`` task examples with the knobs (context length and hops overridable; recurrence_trace:
    ``hops`` is its ``min_lines``)."""
    if knobs["name"] == recurrence_rows.NAME:
        return recurrence_rows.generate(dict(knobs, context_tokens=int(context_tokens or knobs["context_tokens"])),
                                        n, seed, min_lines=hops)
    task = get_task(knobs["name"])
    preamble = dict(preamble_tokens=knobs["preamble_tokens"]) if knobs.get("preamble_tokens") else {}
    return task.generate(n, seed, context_tokens=int(context_tokens or knobs["context_tokens"]),
                         hops=knobs["hops"] if hops is None else hops,
                         distractor_frac=knobs["distractor_frac"], key_len=knobs["key_len"], **preamble)


def prompt_ids(example: dict[str, Any], task_name: str, tokenizer) -> list[int]:
    """Token ids of an example's prompt as the sampler sees it (the task's prompt format)."""
    return tokenizer.encode(get_task(task_name).format_prompt(example, tokenizer))


def max_reference_tokens(knobs: dict[str, Any], hops: int | None = None) -> int:
    """Reference + <eos> tokens of a ``hops``-hop example (the task's line formats fix it: one
    token per key symbol), measured on a generated example. recurrence_trace: the most of a
    kept trace drawn at ``hops`` (its ``min_lines``) lines (:mod:`recurrence_rows`)."""
    if knobs["name"] == recurrence_rows.NAME:
        return recurrence_rows.reference_tokens(knobs, recurrence_rows.max_lines(knobs, hops or knobs["min_lines"]))
    return _reference_tokens(knobs["name"], int(knobs["key_len"]), float(knobs["distractor_frac"]),
                             int(hops or knobs["hops"]))


@functools.lru_cache(maxsize=64)
def _reference_tokens(name: str, key_len: int, distractor_frac: float, hops: int) -> int:
    knobs = dict(name=name, key_len=key_len, distractor_frac=distractor_frac, hops=hops)
    example = generate_examples(knobs, 1, seed=0, context_tokens=1, hops=hops)[0]
    return len(BuiltinTokenizer().encode(example["reference"])) + 1


def sequence_length(knobs: dict[str, Any], hops: int | None = None) -> int:
    """Fixed padded training length: longest prompt (preamble included) + longest reference, rounded up to 32."""
    if knobs["name"] == recurrence_rows.NAME:
        return recurrence_rows.row_length(knobs, recurrence_rows.table_tokens(knobs), hops or knobs["min_lines"])
    k = knobs["key_len"]
    prompt = knobs.get("preamble_tokens", 0) + knobs["context_tokens"] + 2 * k + 2  # may overshoot a record
    longest = prompt + max_reference_tokens(knobs, hops)
    return -(-longest // 32) * 32


def extra_queries(example: dict[str, Any], n: int, max_hops: int,
                  rng: np.random.Generator) -> list[tuple[str, str]]:
    """``n`` more (query line, reference) pairs about the same records of a pointer-chase prompt.

    Starts are random record keys, hops uniform in ``[1, max_hops]``; every value is a key,
    so every chain exists. Appended after the first answer's <eos>, they multiply the
    retrievals a row teaches for ~30 tokens each instead of a whole new context.
    """
    from sparrow_jax.data.tasks.pointer_chase import _query_line, _reference  # the task's own formats

    line = example["prompt"].split("\n", 1)[0]
    try:
        table = dict(r.split("=") for r in line.split(";") if r)
    except ValueError as e:
        raise ValueError(f"extra_queries: the prompt's first line is not pointer-chase records: {line[:60]!r}") from e
    keys = list(table)
    out = []
    for _ in range(n):
        hops = int(rng.integers(1, max_hops + 1))
        chain = [keys[int(rng.integers(len(keys)))]]
        for _ in range(hops):
            chain.append(table[chain[-1]])
        out.append((_query_line(chain[0], hops), _reference(chain)))
    return out
