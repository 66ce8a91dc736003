"""Training batches of the warm-up: rows of examples laid out with their loss masks.

Training data, generated on the fly (fresh examples every step, seeds disjoint from the
evaluation and RL prompts): one row per example, ``prompt + reference + <eos>`` followed by
``queries_per_example - 1`` more questions about the same records (``start K hops n`` +
reference + ``<eos>`` each). Context lengths are uniform in ``[min_context, max_train_context]``
and hops in ``[1, max(hops, train_hops)]``. Why (measured on 2 CPU cores, 2-layer d=128 model):
with one question per row and contexts up to 256 tokens the retrieval had not emerged
after 400-500 steps (0% accuracy); more questions per context and contexts up to 128 tokens
make it emerge within ~300 steps, and the model then generalises to 2x longer contexts.
Rows are right-padded to one fixed length, so the jitted train step compiles once.

Imports :mod:`examples`, :mod:`settings` and :mod:`recurrence_rows`.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from sparrow_jax.sft import recurrence_rows
from sparrow_jax.sft.examples import (TRAIN_STREAM, extra_queries, generate_examples, max_reference_tokens,
                                      prompt_ids, sequence_length)
from sparrow_jax.sft.settings import WarmupSettings


def example_segments(example: dict[str, Any], task_name: str, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(context ids, target ids) pairs of one example: the prompt and ``reference + <eos>``, then
    each of its optional ``extra_queries`` (query line, reference + <eos>)."""
    if "reference" not in example:
        raise KeyError(f"example has no 'reference' field (fields: {sorted(example)})")
    pairs = [(prompt_ids(example, task_name, tokenizer), example["reference"])]
    pairs += [(tokenizer.encode(q), r) for q, r in example.get("extra_queries", ())]
    return [(p, tokenizer.encode(r) + [tokenizer.eos_id]) for p, r in pairs]


def make_batch(examples: Sequence[dict[str, Any]], task_name: str, tokenizer,
               seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One example per row: ``prompt + reference + <eos>`` (then its ``extra_queries``, each
    ``query + reference + <eos>``), right-padded with ``pad_id``.

    Returns (tokens int32 [B, seq_len], reference_mask bool [B, seq_len], prompt_mask bool
    [B, seq_len]): reference_mask is True at the reference tokens and their <eos>;
    prompt_mask at the other tokens from index 1 on (index 0 has no prefix to be predicted from).
    """
    tokens = np.full((len(examples), seq_len), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(examples), seq_len), bool)
    prompt_mask = np.zeros((len(examples), seq_len), bool)
    for b, ex in enumerate(examples):
        segments = example_segments(ex, task_name, tokenizer)
        n = sum(len(p) + len(r) for p, r in segments)
        if n > seq_len:
            raise ValueError(f"example {b}: {n} tokens (prompt, references, queries) exceed seq_len {seq_len}")
        pos = 0
        for p, r in segments:
            tokens[b, pos:pos + len(p)] = p
            prompt_mask[b, max(pos, 1):pos + len(p)] = True
            pos += len(p)
            tokens[b, pos:pos + len(r)] = r
            mask[b, pos:pos + len(r)] = True
            pos += len(r)
    return tokens, mask, prompt_mask


def train_hops(knobs: dict[str, Any], settings: WarmupSettings) -> int:
    """Most hops a training question may have (before the final phase; recurrence_trace: most
    ``min_lines`` of a training trace, the task's without ``max_train_hops``)."""
    if settings.max_train_hops > 0:
        return int(settings.max_train_hops)
    if knobs["name"] == recurrence_rows.NAME:
        return int(knobs["min_lines"])
    return max(int(knobs["hops"]), int(settings.train_hops))


def row_knobs(knobs: dict[str, Any], settings: WarmupSettings) -> dict[str, Any]:
    """The knobs training rows are drawn with: the task's, with recurrence_trace's ``far_every``
    replaced by ``settings.lookup_every`` when that is set (denser look-ups while they are learned)."""
    if not settings.lookup_every:
        return knobs
    if knobs["name"] != recurrence_rows.NAME:
        raise ValueError(f"warmup lookup_every={settings.lookup_every} is a recurrence_trace setting; task "
                         f"{knobs['name']!r} has no look-up rate")
    return dict(knobs, far_every=int(settings.lookup_every))


def train_context(knobs: dict[str, Any], settings: WarmupSettings) -> int:
    """Longest context of a training example: the task's, capped at ``max_train_context``."""
    return min(int(knobs["context_tokens"]), int(settings.max_train_context))


def training_batch(knobs: dict[str, Any], settings: WarmupSettings, step: int, tokenizer,
                   seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch ``step`` (deterministic in (seed, step)), laid out as :func:`make_batch`.

    Row ``b``: a fresh example with a context length uniform in ``[min_context, train_context]``
    (short contexts make the retrieval quick to discover) and hops uniform in ``[1, train_hops]``,
    then ``queries_per_example - 1`` extra questions about its records (:func:`extra_queries`).
    """
    if settings.queries_per_example > 1 and knobs["name"] != "pointer_chase":
        raise ValueError(f"warmup queries_per_example={settings.queries_per_example}: extra questions exist only "
                         f"for pointer_chase prompts, not {knobs['name']!r}; set it to 1")
    rows_knobs = row_knobs(knobs, settings)  # fails fast on a look-up rate for a task without one
    rng = np.random.default_rng([settings.seed, TRAIN_STREAM, step])
    hi = train_context(knobs, settings)
    if knobs["name"] == recurrence_rows.NAME:  # tables of [min_context, hi] tokens, traces up to train_hops lines
        rows = recurrence_rows.stage_rows(rows_knobs, settings.batch_size, rng, settings.min_context, hi,
                                          train_hops(knobs, settings))
        return make_batch(rows, knobs["name"], tokenizer, seq_len)
    lo = min(settings.min_context, hi)
    h = train_hops(knobs, settings)
    examples = []
    for _ in range(settings.batch_size):
        seed = int(rng.integers(0, 2 ** 31 - 1))  # draw order: seed, context length, hops
        length, hops = int(rng.integers(lo, hi + 1)), int(rng.integers(1, h + 1))
        ex = generate_examples(knobs, 1, seed, context_tokens=length, hops=hops)[0]
        if settings.queries_per_example > 1:
            ex["extra_queries"] = extra_queries(ex, settings.queries_per_example - 1, h, rng)
        examples.append(ex)
    return make_batch(examples, knobs["name"], tokenizer, seq_len)


def final_batch(knobs: dict[str, Any], settings: WarmupSettings, step: int, tokenizer,
                seq_len: int, slip: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch ``step`` of the final phase: ``final_batch_size`` fresh examples exactly as the task
    poses them (its context and hops), laid out as :func:`make_batch`; ``slip`` > 0: recurrence_trace
    references that slip look-up keys (:func:`recurrence_rows.slip_reference`)."""
    rng = np.random.default_rng([settings.seed, TRAIN_STREAM, step])
    if knobs["name"] == recurrence_rows.NAME:
        return make_batch(recurrence_rows.task_rows(knobs, settings.final_batch_size, rng, slip), knobs["name"],
                          tokenizer, seq_len)
    if slip:
        raise ValueError(f"slipped references are recurrence_trace's; task {knobs['name']!r} has none")
    seeds = rng.integers(0, 2 ** 31 - 1, size=settings.final_batch_size)
    examples = [generate_examples(knobs, 1, int(seed))[0] for seed in seeds]
    return make_batch(examples, knobs["name"], tokenizer, seq_len)


def training_length(knobs: dict[str, Any], settings: WarmupSettings) -> int:
    """Fixed padded length of training rows: the longest prompt and answer plus the extra questions."""
    h = train_hops(knobs, settings)
    if knobs["name"] == recurrence_rows.NAME:
        return recurrence_rows.row_length(row_knobs(knobs, settings), train_context(knobs, settings), h)
    query = 2 * knobs["key_len"] + len(str(h)) + 6  # "start " key " hops " n "\n" (word tokens count 1)
    extra = (settings.queries_per_example - 1) * (query + max_reference_tokens(knobs, h))
    longest = sequence_length(dict(knobs, context_tokens=train_context(knobs, settings)), h) + extra
    return -(-longest // 32) * 32
