"""Pointer chasing over a long list of key=value records: a long-context, exactly verifiable task.

Every record maps a key to another record's key, so following ``hops`` pointers from a start key
needs ``hops`` look-ups of specific records anywhere in the context. Records are shuffled, so
the records a hop needs sit at random depths; near-miss keys (one symbol changed) make sloppy
matching fail.

Prompt (one line of records, then the query)::

    k3f=a9x;b2c=k3f;a9x=b2c;...;q1z=m0p;
    start k3f hops 3

Reference (the chain of thought the SFT warm-up trains on; the answer is the last value)::

    1:k3f=a9x
    2:a9x=b2c
    3:b2c=q1z
    answer: q1z

With the builtin tokenizer a record is ``2 * key_len + 2`` tokens (8 for 3-symbol keys): one
token per symbol, so the model copies symbols one by one (an induction-head pattern).
"""
from __future__ import annotations

import re
import string
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:  # the tokenizer module's package imports jax; keep `score` importable without it
    from sparrow_jax.models.tokenizer import Tokenizer

NAME = "pointer_chase"
DEFAULT_ALPHABET = string.ascii_lowercase + string.digits
# Ends of a completion: anything after the first of these is ignored by `score`.
DEFAULT_EOS_MARKERS = ("<eos>", "<|im_end|>", "<|endoftext|>")
_ANSWER_RE = re.compile(r"answer:\s*([A-Za-z0-9_]+)")


def _query_line(start: str, hops: int) -> str:
    return f"start {start} hops {hops}\n"


def _reference(chain: Sequence[str]) -> str:
    lines = [f"{i + 1}:{chain[i]}={chain[i + 1]}" for i in range(len(chain) - 1)]
    return "\n".join(lines) + f"\nanswer: {chain[-1]}"


def _check_knobs(context_tokens: int, hops: Any, key_len: int, alphabet: str, distractor_frac: float):
    if int(context_tokens) <= 0:
        raise ValueError(f"pointer_chase: context_tokens must be positive, got {context_tokens}")
    lo, hi = (hops, hops) if isinstance(hops, (int, np.integer)) else tuple(hops)
    if not 1 <= lo <= hi:
        raise ValueError(f"pointer_chase: hops must be an int >= 1 or a (lo, hi) range with 1 <= lo <= hi, got {hops}")
    if key_len < 1:
        raise ValueError(f"pointer_chase: key_len must be >= 1, got {key_len}")
    bad = sorted(set(alphabet) - set(DEFAULT_ALPHABET + string.ascii_uppercase))
    if bad or len(set(alphabet)) < 2:
        raise ValueError(f"pointer_chase: alphabet must hold >= 2 distinct letters/digits, got {alphabet!r}")
    if not 0.0 <= distractor_frac <= 1.0:
        raise ValueError(f"pointer_chase: distractor_frac must be in [0, 1], got {distractor_frac}")
    return int(lo), int(hi)


def _generate_one(rng: np.random.Generator, context_tokens: int, hops: int, key_len: int,
                  alphabet: str, distractor_frac: float, tokenizer: "Tokenizer",
                  isolate_chain: bool = False) -> dict[str, Any]:
    from sparrow_jax.models.tokenizer import BUILTIN_WORD_TOKENS

    symbols = np.array(list(alphabet))
    record_tokens = 2 * key_len + 2           # builtin tokenizer: one token per symbol, '=', ';'
    used: set[str] = set()
    forbidden = [w for w in BUILTIN_WORD_TOKENS if len(w) <= key_len]  # keep keys 1 token/symbol

    def admissible(key: str) -> bool:
        return key not in used and not any(w in key for w in forbidden)

    def random_key() -> str:
        for _ in range(1000):
            key = "".join(rng.choice(symbols, size=key_len))
            if admissible(key):
                used.add(key)
                return key
        raise ValueError(f"pointer_chase: cannot find a new key: key space {len(alphabet)}^{key_len} "
                         f"too small for {len(used)} records; raise key_len or lower context_tokens")

    chain = [random_key() for _ in range(hops + 1)]
    # Records are derived from the target prompt length: the query line costs a few tokens.
    overhead = len(tokenizer.encode(_query_line(chain[0], hops))) + 1  # + the newline after records
    num_records = max(hops + 1, (int(context_tokens) - overhead) // record_tokens)
    capacity = len(alphabet) ** key_len
    if num_records > capacity // 2:
        raise ValueError(f"pointer_chase: {num_records} records need more keys than {len(alphabet)}^{key_len}/2; "
                         f"raise key_len or lower context_tokens ({context_tokens})")

    # Distractors: keys one symbol away from a chain key (shared prefix or suffix).
    n_extra = num_records - len(chain)
    n_distract = int(round(distractor_frac * n_extra))
    distractors: list[str] = []
    attempts = 0
    while len(distractors) < n_distract and attempts < 20 * max(n_distract, 1):
        attempts += 1
        base = list(chain[rng.integers(len(chain))])
        pos = int(rng.integers(key_len))
        base[pos] = str(rng.choice(symbols[symbols != base[pos]]))
        key = "".join(base)
        if admissible(key):
            used.add(key)
            distractors.append(key)
    fillers = [random_key() for _ in range(n_extra - len(distractors))]
    keys = chain + distractors + fillers

    # Values: the chain links c_i -> c_{i+1}; every other record points at a random key (with
    # isolate_chain, a random non-chain key: a wrong turn never leads back into the chain).
    value = {chain[i]: chain[i + 1] for i in range(hops)}
    targets = keys[hops + 1:] if isolate_chain and n_extra > 0 else keys
    for key in keys[hops:]:
        value[key] = targets[int(rng.integers(len(targets)))]
    order = rng.permutation(len(keys))
    records = [f"{keys[j]}={value[keys[j]]};" for j in order]
    prompt = "".join(records) + "\n" + _query_line(chain[0], hops)

    # Depth facts for analysis: where each hop's record sits (record index and token offset).
    index_of = {keys[j]: r for r, j in enumerate(order)}
    hop_records = [index_of[chain[i]] for i in range(hops)]
    meta = dict(task=NAME, hops=hops, num_records=len(keys), num_distractors=len(distractors),
                key_len=key_len, chain=list(chain), hop_record_index=hop_records,
                hop_token_offset=[r * record_tokens for r in hop_records],
                prompt_tokens=len(tokenizer.encode(prompt)))
    return dict(prompt=prompt, reference=_reference(chain), answer=chain[-1], meta=meta)


def generate(n: int, seed: int, context_tokens: int = 1024, hops: "int | tuple[int, int]" = 2,
             distractor_frac: float = 0.5, key_len: int = 3, alphabet: str = DEFAULT_ALPHABET,
             tokenizer: "Tokenizer | None" = None, isolate_chain: bool = False) -> list[dict[str, Any]]:
    """``n`` pointer-chasing examples: dicts with ``prompt``, ``reference`` (CoT + answer line),
    ``answer`` and ``meta``.

    Args:
      n: number of examples. Example ``i`` depends only on ``(seed, i)``, so
        ``generate(5, s)[:3] == generate(3, s)``.
      context_tokens: target prompt length in tokens (builtin tokenizer); the number of records
        is derived from it (``meta['prompt_tokens']`` is the exact count, within one record).
      hops: number of pointer hops, or an inclusive ``(lo, hi)`` range sampled per example.
      distractor_frac: fraction of the non-chain records whose key is one symbol away from a
        chain key.
      key_len, alphabet: key shape (default 3 symbols from [a-z0-9]).
      tokenizer: used only to count prompt tokens (default: the builtin tokenizer).
      isolate_chain: records off the chain point only at keys off the chain (default: at any
        key), so following a wrong record never rejoins the chain.
    """
    from sparrow_jax.models.tokenizer import BuiltinTokenizer

    lo, hi = _check_knobs(context_tokens, hops, key_len, alphabet, distractor_frac)
    tokenizer = tokenizer or BuiltinTokenizer()
    out = []
    for i in range(int(n)):
        rng = np.random.default_rng([int(seed), i])
        h = int(rng.integers(lo, hi + 1))
        out.append(_generate_one(rng, context_tokens, h, key_len, alphabet, distractor_frac, tokenizer,
                                 isolate_chain))
    return out


def extract_answer(completion: str, eos_markers: Sequence[str] = DEFAULT_EOS_MARKERS) -> str | None:
    """The value of the last ``answer: X`` before the first end-of-sequence marker, else None."""
    for marker in eos_markers:
        cut = completion.find(marker)
        if cut >= 0:
            completion = completion[:cut]
    matches = _ANSWER_RE.findall(completion)
    return matches[-1] if matches else None


def score(completion: str, example: dict[str, Any]) -> float:
    """1.0 iff the final ``answer: X`` of ``completion`` equals ``example['answer']``, else 0.0.

    Text after an end-of-sequence marker (``<eos>``, ``<|im_end|>``, ``<|endoftext|>``) is ignored.
    """
    if "answer" not in example:
        raise KeyError(f"pointer_chase.score: example has no 'answer' field (fields: {sorted(example)})")
    got = extract_answer(completion)
    return 1.0 if got is not None and got == str(example["answer"]).strip() else 0.0
