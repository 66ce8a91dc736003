"""Reward functions and a process pool that keeps a slow or hung verifier from stalling training.

* ``math_reward(completion, answer)``: 1.0 iff the last ``\\boxed{}`` of the completion is
  mathematically equal to ``answer`` (``math-verify``), else 0.0.
* ``RewardPool(fn, num_workers, timeout_s)``: runs ``fn(completion, example) -> float`` in
  spawned worker processes; a call past ``timeout_s`` scores 0.0, its worker is killed and
  replaced. ``num_workers=0`` runs in-process (cheap synthetic verifiers, no timeout).
* ``symbol_overlap_credit``: a dense partial credit for synthetic tasks.

This module imports nothing heavy at top level, so spawned workers start fast.
"""
from __future__ import annotations

import logging
import math
import multiprocessing as mp
import multiprocessing.connection
import threading
import time
import weakref
from collections import Counter, deque
from typing import Any, Callable, Sequence

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

def _worker_main(fn: RewardFn, initializer: Callable[[], None] | None, conn) -> None:
    """Worker loop: receive (task_id, completion, example), send (task_id, ok, value_or_error)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and shuts us down
    if initializer is not None:
        initializer()
    conn.send(("ready", True, None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task_id, completion, example = msg
        try:
            conn.send((task_id, True, float(fn(completion, example))))
        except Exception as e:  # a verifier bug or a garbage completion: report, keep serving
            conn.send((task_id, False, f"{type(e).__name__}: {e}"))


class _Worker:
    """One spawned process and its pipe. ``task`` is the task id in flight (None when idle)."""

    def __init__(self, ctx, fn, initializer, startup_timeout_s: float):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(fn, initializer, child), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.task: int | None = None
        self.deadline = time.monotonic() + startup_timeout_s

    def kill(self) -> None:
        try:
            self.conn.close()
        finally:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=5)

    def stop(self) -> None:
        """Polite shutdown, then kill."""
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(timeout=1)
        self.kill()


def _shutdown(workers: list) -> None:
    for i, w in enumerate(workers):
        if w is not None:
            w.stop()
            workers[i] = None


class RewardPool:
    """Score ``fn(completion, example)`` in ``num_workers`` spawned processes with a per-call timeout.

    A call that runs past ``timeout_s`` scores 0.0 (``num_timeouts`` += 1) and its worker is
    killed and replaced; a call that raises scores 0.0 (``num_errors`` += 1, ``last_error``).
    ``fn`` and ``initializer`` must be picklable (module-level functions). Workers start on the
    first ``score_batch``; ``close()`` (or ``with RewardPool(...)``) stops them.
    ``num_workers=0`` calls ``fn`` in-process (no timeout, exceptions propagate).
    """

    def __init__(self, fn: RewardFn, num_workers: int = 2, timeout_s: float = 5.0,
                 initializer: Callable[[], None] | None = None, startup_timeout_s: float = 120.0):
        if num_workers < 0:
            raise ValueError(f"RewardPool: num_workers must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardPool: timeout_s must be > 0, got {timeout_s}")
        self.fn = fn
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self.initializer = initializer
        self.startup_timeout_s = float(startup_timeout_s)
        self.num_timeouts = 0
        self.num_errors = 0
        self.last_error: str | None = None
        self._ctx = mp.get_context("spawn")  # fork is unsafe once jax / XLA threads exist
        self._workers: list[_Worker | None] = [None] * self.num_workers
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)

    def _spawn(self, slot: int) -> _Worker:
        w = _Worker(self._ctx, self.fn, self.initializer, self.startup_timeout_s)
        self._workers[slot] = w
        return w

    def score_batch(self, completions: Sequence[str], examples: Sequence[dict]) -> list[float]:
        """Rewards for ``completions[i]`` against ``examples[i]``, in order."""
        if len(completions) != len(examples):
            raise ValueError(f"RewardPool.score_batch: {len(completions)} completions but {len(examples)} examples")
        if self.num_workers == 0:
            return [float(self.fn(c, e)) for c, e in zip(completions, examples)]
        if not self._finalizer.alive:
            raise RuntimeError("RewardPool.score_batch: the pool is closed")
        results = [0.0] * len(completions)
        pending = deque(range(len(completions)))
        for slot, w in enumerate(self._workers):
            if w is None or not w.proc.is_alive():
                if w is not None:
                    w.kill()
                self._spawn(slot)
        while pending or any(w.task is not None for w in self._workers):
            now = time.monotonic()
            for w in self._workers:      # dispatch to ready, idle workers
                if w.ready and w.task is None and pending:
                    task = pending.popleft()
                    try:
                        w.conn.send((task, completions[task], examples[task]))
                    except OSError:               # it died while idle: requeue, replace
                        pending.appendleft(task)
                        w.kill()
                        self._spawn(self._workers.index(w))
                        continue
                    w.task, w.deadline = task, now + self.timeout_s
            waiting = [w for w in self._workers if w.task is not None or not w.ready]
            wait_s = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
            ready_conns = set(mp.connection.wait([w.conn for w in waiting], timeout=wait_s))
            for slot, w in enumerate(self._workers):
                if w.conn in ready_conns:
                    try:
                        task_id, ok, value = w.conn.recv()
                    except (EOFError, OSError):   # the worker died (e.g. a segfault in fn)
                        self._replace_dead(slot, w)
                        continue
                    if task_id == "ready":
                        w.ready = True
                    elif ok:
                        results[task_id] = value
                        w.task = None
                    else:
                        self.num_errors += 1
                        self.last_error = value
                        log.warning("reward fn failed on item %d (scored 0.0): %s", task_id, value)
                        w.task = None
                elif w in waiting and time.monotonic() >= w.deadline:
                    if not w.ready:
                        raise RuntimeError(f"RewardPool: a worker did not start within {self.startup_timeout_s} s")
                    self.num_timeouts += 1        # results[task] stays 0.0
                    w.kill()
                    self._spawn(slot)
        return results

    def _replace_dead(self, slot: int, w: _Worker) -> None:
        if not w.ready:
            w.kill()
            raise RuntimeError(f"RewardPool: a worker exited during start-up (exit code {w.proc.exitcode}); "
                               f"is fn {self.fn!r} importable (a module-level function)?")
        w.kill()
        if w.task is not None:
            self.num_errors += 1
            self.last_error = f"worker exited with code {w.proc.exitcode} while scoring item {w.task}"
            log.warning("reward worker died (scored 0.0): %s", self.last_error)
        self._spawn(slot)

    def stats(self) -> dict[str, Any]:
        return dict(num_timeouts=self.num_timeouts, num_errors=self.num_errors, last_error=self.last_error)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
