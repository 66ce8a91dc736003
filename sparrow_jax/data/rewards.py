"""Reward functions and a process pool that keeps a slow or hung verifier from stalling training.

* ``math_reward(completion, answer)``: 1.0 iff the last ``\\boxed{}`` of the completion is
  mathematically equal to ``answer`` (``math-verify``), else 0.0.
* ``RewardPool(fn, num_workers, timeout_s)``: runs ``fn(completion, example) -> float`` in
  spawned worker processes (``pebble.ProcessPool``); a call past ``timeout_s`` scores 0.0, its
  worker is killed and replaced. ``num_workers=0`` runs in-process (cheap synthetic verifiers,
  no timeout).
* ``symbol_overlap_credit``: a dense partial credit for synthetic tasks.

This module imports nothing heavy at top level (the standard library and pebble), so spawned
workers start fast.
"""
from __future__ import annotations

import logging
import math
import multiprocessing as mp
import pickle
import threading
import weakref
from collections import Counter
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Sequence

from pebble import ProcessExpired, ProcessPool

log = logging.getLogger(__name__)

RewardFn = Callable[[str, dict], float]
EOS_MARKERS = ("<|im_end|>", "<|endoftext|>", "<eos>")


def before_eos(text: str) -> str:
    """``text`` up to its first end-of-sequence marker."""
    for marker in EOS_MARKERS:
        cut = text.find(marker)
        if cut >= 0:
            text = text[:cut]
    return text


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x``) in ``text``;
    None when there is none or its braces never close."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if i < len(text) and text[i] == " ":       # "\boxed 5": up to the next space or '$'
        rest = text[i + 1:]
        end = min([j for j in (rest.find(" "), rest.find("$"), rest.find("\n")) if j >= 0] or [len(rest)])
        return rest[:end] or None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def math_reward(completion: str, answer: str, timeout_s: float = 5.0) -> float:
    """1.0 iff the last ``\\boxed{}`` answer of ``completion`` equals ``answer`` per math-verify.

    Text after an end-of-sequence marker is ignored. ``timeout_s`` bounds math-verify's own
    parse / verify (signal alarms, whole seconds, main thread only); ``RewardPool`` is the hard
    bound.
    """
    pred = last_boxed(before_eos(completion))
    if pred is None or not pred.strip():
        return 0.0
    from math_verify import parse, verify

    # signal.alarm only works in the main thread; elsewhere rely on the pool's timeout.
    t = max(1, math.ceil(timeout_s)) if threading.current_thread() is threading.main_thread() else 0
    answer = str(answer)
    gold = parse(answer if "\\boxed" in answer else f"\\boxed{{{answer}}}", parsing_timeout=t)
    target = parse(f"\\boxed{{{pred}}}", parsing_timeout=t)
    if not gold or not target:
        return 0.0
    return 1.0 if verify(gold, target, timeout_seconds=t) else 0.0


def math_reward_fn(completion: str, example: dict) -> float:
    """``math_reward`` with the ``(completion, example)`` signature of task reward functions."""
    return math_reward(completion, example["answer"])


def warm_math_verify() -> None:
    """Worker initializer: import math-verify / sympy before the first timed call."""
    from math_verify import parse, verify

    verify(parse("\\boxed{1/2}"), parse("\\boxed{0.5}"))


# --------------------------------------------------------------------------------------------
# Worker pool
# --------------------------------------------------------------------------------------------

class RewardPool:
    """Score ``fn(completion, example)`` in ``num_workers`` spawned processes with a per-call timeout.

    A call that runs past ``timeout_s`` scores 0.0 (``num_timeouts`` += 1) and its worker is
    killed and replaced; a call that raises, or whose worker dies, scores 0.0 (``num_errors`` += 1,
    ``last_error``). ``fn`` and ``initializer`` must be picklable (module-level functions). Workers
    (a ``pebble.ProcessPool``) start on the first ``score_batch``; ``close()`` (or
    ``with RewardPool(...)``) stops them. ``num_workers=0`` calls ``fn`` in-process (no timeout,
    exceptions propagate).
    """

    def __init__(self, fn: RewardFn, num_workers: int = 2, timeout_s: float = 5.0,
                 initializer: Callable[[], None] | None = None):
        if num_workers < 0:
            raise ValueError(f"RewardPool: num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardPool: timeout_s must be > 0, got {timeout_s}")
        self.fn = fn
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self.initializer = initializer
        self.num_timeouts = 0
        self.num_errors = 0
        self.last_error: str | None = None
        self._pool: ProcessPool | None = None
        self._finalizer: weakref.finalize | None = None  # stops the workers once: close() or a dropped pool
        self._closed = False

    def _workers(self) -> ProcessPool:
        if self._closed:
            raise RuntimeError("RewardPool.score_batch: the pool is closed")
        if self._pool is None:
            pickle.dumps((self.fn, self.initializer))  # the workers get both pickled: fail here, not as 0.0 rewards
            # spawn: fork is unsafe once jax / XLA threads exist
            self._pool = ProcessPool(self.num_workers, initializer=self.initializer, context=mp.get_context("spawn"))
            self._finalizer = weakref.finalize(self, _stop, self._pool)
        return self._pool

    def score_batch(self, completions: Sequence[str], examples: Sequence[dict]) -> list[float]:
        """Rewards for ``completions[i]`` against ``examples[i]``, in order."""
        if len(completions) != len(examples):
            raise ValueError(f"RewardPool.score_batch: {len(completions)} completions but {len(examples)} examples")
        if self.num_workers == 0:
            return [float(self.fn(c, e)) for c, e in zip(completions, examples)]
        pool = self._workers()
        futures = [pool.schedule(self.fn, args=(c, e), timeout=self.timeout_s) for c, e in zip(completions, examples)]
        return [self._reward(item, future) for item, future in enumerate(futures)]

    def _reward(self, item: int, future) -> float:
        """The item's reward; 0.0, counted, when it timed out, raised or killed its worker."""
        try:
            return float(future.result())
        except BrokenProcessPool as e:  # every worker died before taking a task
            raise RuntimeError(f"RewardPool: the workers exit on start-up; does the initializer fail, is fn "
                               f"{self.fn!r} importable (a module-level function)?") from e
        except TimeoutError as e:
            if e.__cause__ is None:  # the pool's own: it killed the worker and started another
                self.num_timeouts += 1
                return 0.0
            error = f"{type(e).__name__}: {e}"  # raised by fn (it arrives with fn's remote traceback)
        except ProcessExpired as e:  # e.g. a segfault in fn; the pool started another worker
            error = f"worker exited with code {e.exitcode} while scoring item {item}"
        except Exception as e:  # a verifier bug or a garbage completion
            error = f"{type(e).__name__}: {e}"
        self.num_errors += 1
        self.last_error = error
        log.warning("reward fn failed on item %d (scored 0.0): %s", item, error)
        return 0.0

    def stats(self) -> dict[str, Any]:
        return dict(num_timeouts=self.num_timeouts, num_errors=self.num_errors, last_error=self.last_error)

    def close(self) -> None:
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop(pool: ProcessPool) -> None:
    pool.stop()
    pool.join()


# --------------------------------------------------------------------------------------------
# Partial credit
# --------------------------------------------------------------------------------------------

def symbol_overlap_credit(completion: str, reference: str) -> float:
    """Share of ``reference``'s letters and digits (as a multiset) that ``completion`` also holds,
    in [0, 1]: a dense partial credit that even random completions sometimes earn."""
    want = Counter(ch for ch in reference if ch.isalnum())
    got = Counter(ch for ch in completion if ch.isalnum())
    total = sum(want.values())
    return sum((want & got).values()) / total if total else 0.0
