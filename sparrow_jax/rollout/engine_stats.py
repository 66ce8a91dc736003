"""Bookkeeping of the continuous-batching engine (:mod:`.engine`): its counters and progress line,
its ``stats``, and its completions by request put back into rows in prompt order (a :class:`Rollout`).

May import numpy and the rollout modules :mod:`.page_pool`, :mod:`.sampler` and :mod:`.slots`.
"""
from __future__ import annotations

import time
from typing import NamedTuple, Sequence

import numpy as np

from sparrow_jax.rollout.page_pool import PageAllocator, PoolLayer, pool_bytes
from sparrow_jax.rollout.sampler import Rollout, completion_mask
from sparrow_jax.rollout.slots import HostState, live_slots


class Tally(NamedTuple):
    """Counters of a call: seconds in prefill, decode segments, decode steps and slot steps (steps x batch)."""

    prefill_s: float = 0.0
    segments: int = 0
    steps: int = 0
    slot_steps: int = 0


def count_segment(tally: Tally, h: HostState, steps: int, allocator: PageAllocator, t0: float,
                  progress: bool) -> Tally:
    """The tally after a segment of ``steps`` decode steps over ``h``'s batch; with ``progress``, a line
    (``t0``: the call's start, ``time.perf_counter``)."""
    batch = len(h.slots)
    tally = tally._replace(segments=tally.segments + 1, steps=tally.steps + steps,
                           slot_steps=tally.slot_steps + steps * batch)
    if progress:
        elapsed = time.perf_counter() - t0
        print(f"[engine] segment {tally.segments} batch {batch} live {len(live_slots(h))} "
              f"waiting {len(h.generated) - h.next_request} pages {allocator.in_use}/{allocator.num_pages} "
              f"{int(h.generated.sum() + h.gen.sum())} tokens in {elapsed:.1f}s", flush=True)
    return tally


def engine_stats(tally: Tally, allocator: PageAllocator, pools: Sequence[PoolLayer], total_s: float,
                 decode_tokens: int, compiles: int) -> dict:
    """The ``stats`` of a call that took ``total_s`` seconds (see :func:`.engine.generate_continuous`)."""
    return dict(prefill_s=tally.prefill_s, decode_s=total_s - tally.prefill_s, decode_steps=tally.steps,
                decode_tokens=decode_tokens, compiles=compiles, segments=tally.segments,
                slot_steps=tally.slot_steps, peak_pages=allocator.peak, pool_grows=allocator.grows,
                pool_pages=allocator.num_pages, peak_cache_bytes=pool_bytes(pools),
                peak_live_cache_bytes=pool_bytes(pools, allocator.peak + 1))


def rows_in_prompt_order(prompts: Sequence[Sequence[int]], prompt_lens: np.ndarray, out_tokens: np.ndarray,
                         out_logprobs: np.ndarray, generated: np.ndarray, buf_len: int, pad_id: int,
                         stop_ids: Sequence[int], stats: dict) -> Rollout:
    """Prompts and completions as right-padded rows [R, ``buf_len``]. out_tokens int32, out_logprobs
    float32 [R, N]: each request's completion (its first ``generated[r]`` entries, int32 [R])."""
    num = len(prompts)
    tokens = np.full((num, buf_len), pad_id, np.int32)
    logprobs = np.zeros((num, buf_len), np.float32)
    for r, p in enumerate(prompts):
        n, g = prompt_lens[r], generated[r]
        tokens[r, :n] = p
        tokens[r, n:n + g] = out_tokens[r, :g]
        logprobs[r, n:n + g] = out_logprobs[r, :g]
    lengths = (prompt_lens + generated).astype(np.int32)
    mask = completion_mask(prompt_lens, lengths, buf_len)
    finished = np.isin(tokens[np.arange(num), lengths - 1], stop_ids) & (generated > 0)
    return Rollout(tokens, prompt_lens, lengths, mask, logprobs, finished, stats)
