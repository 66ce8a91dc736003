"""Pointer tracing: follow pointers until a terminal record, writing every hop (long generated traces).

The prompt is a line of shuffled ``key=value`` records, then ``start K``. Following the
pointers from ``K`` reaches, after ``hops`` records, the one record whose value is the
terminal ``##``. The completion writes every record it visits, one ``key=value`` line each
(``hops + 1`` lines, the terminal one included), then ``answer: X`` with the last key.
With tens of hops the trace is hundreds of generated tokens, and every line needs one
record from anywhere in the prompt: a value sits at a random depth, so a sparse actor whose
page selection misses that record writes a wrong value. Stopping needs no counting (the
terminal value is in the record itself), so a model trained on short chains can write long
ones. Keys are 2 symbols by default: a record is 6 tokens, a hop line 6, so a 1K-token
prompt holds ~170 records.

Example (``hops=3``; prompt then the reference the warm-up trains on)::

    k3=a9;b2=k3;a9=b2;...;b2=q1;q1=##;...
    start k3
    k3=a9
    a9=b2
    b2=q1
    q1=##
    answer: q1

Records other than the chain's point at random keys; a share (``distractor_frac``) of their
keys are one symbol away from a chain key (see :mod:`sparrow_jax.data.tasks.pointer_chase`,
whose generator this task reuses).

``preamble_tokens`` puts a block of unrelated text (uppercase words, never a record) before the
records: more context at the same number of records, as when the data sits after a long
document. Every line still needs one record, now past the preamble; a sparse actor that keeps
the records' pages and skips the preamble's reads a smaller share of its context.

Reward (:func:`score`), in [0, 1]: the share of the trace's steps done right before the first
wrong one, the ``answer:`` line being the last step (it counts only after every record line is
right). A model that gets the first few hops right earns a signal before it can finish a chain,
and a right answer reached through a wrong line (a lucky jump onto the chain) earns nothing
beyond the lines before it.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from sparrow_jax.data.tasks import pointer_chase
from sparrow_jax.data.tasks.pointer_chase import DEFAULT_ALPHABET, DEFAULT_EOS_MARKERS, extract_answer

if TYPE_CHECKING:
    from sparrow_jax.models.tokenizer import Tokenizer

NAME = "pointer_trace"
_PREAMBLE_STREAM = 0x70726561  # rng stream of the preamble, apart from pointer_chase's draws
TERMINAL = "##"  # the value of the chain's last record; never a key (keys are letters and digits)


def query_line(start: str) -> str:
    return f"start {start}\n"


def reference(chain: Sequence[str]) -> str:
    """Every visited record as a line, the terminal one last, then the answer (the last key)."""
    lines = [f"{a}={b}" for a, b in zip(chain, list(chain[1:]) + [TERMINAL])]
    return "\n".join(lines) + f"\nanswer: {chain[-1]}"


PREAMBLE_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # never in a key ([a-z0-9]) nor in a word token


def preamble(n_tokens: int, rng: np.random.Generator) -> str:
    """Exactly ``n_tokens`` builtin-tokenizer tokens (one per character): uppercase words of 2-6
    letters separated by spaces, ending in a newline ("" for 0)."""
    if n_tokens <= 0:
        return ""
    words, length = [], 0
    while length < n_tokens - 1:
        word = "".join(rng.choice(list(PREAMBLE_LETTERS), size=int(rng.integers(2, 7))))
        words.append(word)
        length += len(word) + 1
    text = " ".join(words)[:n_tokens - 1].rstrip(" ")  # no space before the newline: pad with a letter
    return text.ljust(n_tokens - 1, PREAMBLE_LETTERS[0]) + "\n"


def generate(n: int, seed: int, context_tokens: int = 1024, hops: "int | tuple[int, int]" = 96,
             distractor_frac: float = 0.5, key_len: int = 2, alphabet: str = DEFAULT_ALPHABET,
             tokenizer: "Tokenizer | None" = None, isolate_chain: bool = False,
             preamble_tokens: int = 0) -> list[dict[str, Any]]:
    """``n`` examples: dicts with ``prompt``, ``reference`` (``hops + 1`` record lines + the
    answer line), ``answer`` (the chain's last key) and ``meta`` (pointer_chase's, ``task`` set
    to ``"pointer_trace"``).

    Args as :func:`sparrow_jax.data.tasks.pointer_chase.generate`: ``context_tokens`` sets the
    prompt length through the number of records (the prompt is at most 12 tokens shorter; a
    chain needs ``hops + 1`` distinct records, so a prompt grows past ``context_tokens`` when
    that is too short for them); ``hops`` is a
    count or an inclusive ``(lo, hi)`` range. Example ``i`` depends only on ``(seed, i)``.
    ``isolate_chain``: records off the chain point only off the chain, so a trace that takes a
    wrong record walks among them (and may loop) instead of skipping ahead to the terminal
    record and ending the trace. ``preamble_tokens``: that many tokens of unrelated text before
    the records (:func:`preamble`); the records, chain and reference are those of the same
    ``(seed, i)`` without it.
    """
    if int(preamble_tokens) < 0:
        raise ValueError(f"pointer_trace: preamble_tokens must be >= 0, got {preamble_tokens}")
    out = pointer_chase.generate(n, seed, context_tokens=context_tokens, hops=hops,
                                 distractor_frac=distractor_frac, key_len=key_len, alphabet=alphabet,
                                 tokenizer=tokenizer, isolate_chain=isolate_chain)
    from sparrow_jax.models.tokenizer import BuiltinTokenizer

    tokenizer = tokenizer or BuiltinTokenizer()
    for i, ex in enumerate(out):
        chain, meta = ex["meta"]["chain"], ex["meta"]
        records_line = ex["prompt"].split("\n", 1)[0]  # pointer_chase's prompt: records, then the query
        last = chain[-1]  # a random-value record in pointer_chase: here the terminal one
        records_line = re.sub(rf"(^|;){last}=[^;]*;", rf"\g<1>{last}={TERMINAL};", records_line, count=1)
        text = preamble(int(preamble_tokens), np.random.default_rng([seed, i, _PREAMBLE_STREAM]))
        ex["prompt"] = text + records_line + "\n" + query_line(chain[0])
        ex["reference"] = reference(chain)
        meta.update(task=NAME, trace_lines=len(chain), prompt_tokens=len(tokenizer.encode(ex["prompt"])))
    return out


def hop_lines(text: str) -> list[str]:
    """The reference's or a completion's lines before the ``answer:`` line (stripped)."""
    lines = []
    for line in text.split("\n"):
        line = line.strip()
        if line.startswith("answer"):
            break
        lines.append(line)
    return lines


def correct_prefix(completion: str, reference: str,
                   eos_markers: Sequence[str] = DEFAULT_EOS_MARKERS) -> tuple[int, int]:
    """(record lines of ``completion`` equal to the reference's before the first difference,
    record lines in the reference). Text after an end-of-sequence marker is ignored; a line
    must match exactly (``key=value``, surrounding spaces aside)."""
    for marker in eos_markers:
        cut = completion.find(marker)
        if cut >= 0:
            completion = completion[:cut]
    want, got = hop_lines(reference), hop_lines(completion)
    n = 0
    while n < len(want) and n < len(got) and got[n] == want[n]:
        n += 1
    return n, len(want)


def score(completion: str, example: dict[str, Any]) -> float:
    """(correct record lines before the first error + 1 if they are all right and the final
    answer is exact) / (record lines + 1).

    Text after an end-of-sequence marker (``<eos>``, ``<|im_end|>``, ``<|endoftext|>``) is ignored.
    """
    for field in ("answer", "reference"):
        if field not in example:
            raise KeyError(f"pointer_trace.score: example has no {field!r} field (fields: {sorted(example)})")
    prefix, hops = correct_prefix(completion, example["reference"])
    got = extract_answer(completion)
    exact = got is not None and got == str(example["answer"]).strip()
    return (prefix + float(exact and prefix == hops)) / (hops + 1)


__all__ = ["NAME", "TERMINAL", "PREAMBLE_LETTERS", "preamble", "generate", "reference", "query_line", "hop_lines",
           "correct_prefix", "score"]
