"""Rollout engine for long, ragged generations: continuous batching over a shared page pool.

:func:`generate_continuous` is a drop-in for :func:`sparrow_jax.rollout.sampler.generate`
(same arguments, same :class:`Rollout`) that stops paying for finished rows:

* **Slots.** At most ``max_slots`` rows decode at once. Between decode segments (a jitted
  ``while_loop`` of up to ``segment_steps`` steps that also returns early once enough rows
  have finished), finished rows leave, waiting requests are prefilled into the freed
  slots, and once nothing waits the live rows are compacted into the next smaller
  power-of-two batch. Shapes are static per (batch bucket, ``k_max`` bucket, pool size), so
  compiles are bounded by their product (pool sizes double, so there are few); the
  schedule's top-k table is data, as in the sampler.
* **Prompt sharing.** A prompt that appears G times (GRPO groups) is prefilled once; its
  full pages are shared by the G rows through their page tables and only the partial last
  page is copied per row.
* **Memory follows the tokens.** KV pages come from a pool (:mod:`.page_pool`) as rows grow
  (reserved one segment ahead) and go back when a row finishes; the pool grows on a grid of
  sizes (``pool_size``: powers of two and 1.5x powers of two) when full.

Per-request PRNG keys (``request_keys``) and per-token keys (``token_keys``) are those of the
fixed-batch sampler, so both engines draw the same tokens for the same request: greedy
outputs are token-identical and sampled log-probs have the same semantics. The engine draws
the Gumbel noise of those keys for a block of steps at once (:func:`.sampler.gumbel_noise`),
the same values the sampler draws step by step.

Layout: this module holds the device side (the pooled decode step, the jitted segment, prefill
into pages) and the loop that joins the parts; :mod:`.slots` the host scheduling between
segments (a value passed through the loop), :mod:`.engine_stats` the counters and the output
rows. May import :mod:`sparrow_jax.models` and the rollout modules.
"""
from __future__ import annotations

import functools
import time
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.forward import init_caches, prefill, unembedding
from sparrow_jax.models.qwen3 import Params, bind
from sparrow_jax.rollout.engine_stats import Tally, count_segment, engine_stats, rows_in_prompt_order
from sparrow_jax.rollout.page_pool import (SCRATCH_PAGE, PageAllocator, PoolLayer, append_and_decode, copy_pages,
                                           grow_pool, init_pool, pool_size, reserve_pages, store_prefill)
from sparrow_jax.rollout.sampler import (Rollout, SamplingParams, checked_prompt_lens, draws_ahead, record_draws,
                                        request_keys, round_up, sample_logits, segment_noise)
from sparrow_jax.rollout.schedule import SparsitySchedule, k_max_bucket
from sparrow_jax.rollout.slots import (HostState, Pools, PromptPages, SegmentPlan, compact, free_slots, group_requests,
                                      initial_state, live_slots, plan_segment, pow2, retire, seat)


def pooled_decode_step(config: Qwen3Config, params: Params, tokens: jax.Array, positions: jax.Array,
                       pools: Sequence[PoolLayer], page_table: jax.Array, schedule=None, k_max: int = 0,
                       impl: str = "auto", unembed: Optional[jax.Array] = None):
    """:func:`sparrow_jax.models.forward.decode_step` on a page pool. tokens, positions int32 [B],
    page_table int32 [B, W] -> (logits float32 [B, V], new pools). ``unembed``: the output
    projection as its own [hidden, V] array (:func:`row_major_unembedding`), else the model's."""
    model = bind(config, params)
    new_pools = list(pools)
    dense_layers = set(schedule.dense_layers) if schedule is not None else set()
    budget = None if schedule is None else schedule.topk_at(positions)

    def attention(layer, q, k, v):
        layer_schedule = None if layer in dense_layers else schedule
        out, new_pools[layer] = append_and_decode(q[:, 0], k[:, 0], v[:, 0], pools[layer], page_table, positions,
                                                  layer_schedule, budget, k_max, impl)
        return out[:, None]

    hidden = model(tokens[:, None], positions[:, None], attention)
    if unembed is None:
        return model.logits(hidden[:, 0]), tuple(new_pools)
    logits = jnp.dot(hidden[:, 0].astype(config.compute_dtype), unembed, preferred_element_type=jnp.float32)
    return logits, tuple(new_pools)


def row_major_unembedding(config: Qwen3Config, params: Params) -> Optional[jax.Array]:
    """On XLA:CPU, a tied embedding transposed into its own row-major [hidden, V] array (compute
    dtype) for the decode loop, else None (the model's own output projection).

    Read transposed inside the loop, the tied embedding made the output projection the slowest
    matmul of the quickstart's CPU decode step (~20 us of ~130 us of matmuls at 16 rows); the copy
    costs one embedding's memory for the rollout. Untied heads are row-major already, and GPU /
    TPU matmuls read either layout at the same speed."""
    if not config.tie_word_embeddings or jax.default_backend() != "cpu":
        return None
    return unembedding(config, params).astype(config.compute_dtype)


class _SegmentState(NamedTuple):
    step: jax.Array
    tok: jax.Array  # [B] token fed at the next step
    pos: jax.Array  # [B] its position
    gen: jax.Array  # [B] tokens generated so far by the slot's request
    done: jax.Array  # [B] finished or idle
    pools: tuple
    out_tokens: jax.Array  # [R + 1, max_new] completions by request (last row: idle slots' writes)
    out_logprobs: jax.Array


@functools.partial(jax.jit, static_argnames=("config", "k_max", "impl", "sampling", "ahead"),
                   donate_argnames=("state",))
def _decode_segment(state: _SegmentState, params: Params, unembed: Optional[jax.Array], page_table: jax.Array,
                    keys: jax.Array, request: jax.Array, end_pos: jax.Array, step_limit: jax.Array,
                    exit_after: jax.Array, schedule: Optional[SparsitySchedule], *, config: Qwen3Config,
                    k_max: int, impl: str, sampling: SamplingParams, ahead: int) -> _SegmentState:
    """Decode until ``step_limit`` steps, every slot done, or ``exit_after`` slots newly done.

    ``schedule`` is a pytree argument (top-k table traced, layout static), as in the sampler.
    Sampling noise is drawn ``ahead`` steps at a time (:func:`segment_noise`).
    """
    live_at_start = ~state.done
    stop_ids = jnp.asarray(sampling.stop_ids or (-1,), jnp.int32)
    last = state.out_tokens.shape[1] - 1

    def cond(carry):
        s = carry[0]
        newly_done = jnp.sum(s.done & live_at_start)
        return (s.step < step_limit) & ~jnp.all(s.done) & (newly_done < exit_after)

    def body(carry):
        s, noise = carry
        logits, pools = pooled_decode_step(config, params, s.tok, s.pos, s.pools, page_table, schedule, k_max, impl,
                                           unembed)
        if sampling.temperature == 0.0:
            tok, logp = sample_logits(logits, keys, sampling)
        else:
            step_noise, noise = segment_noise(keys, s.gen, s.step, noise)
            tok, logp = sample_logits(logits, None, sampling, noise=step_noise)
        write = ~s.done
        nxt = s.pos + 1
        at = (request, jnp.minimum(s.gen, last))
        out_tokens, out_logprobs, done = record_draws(s.out_tokens, s.out_logprobs, at, tok, logp, s.done, stop_ids,
                                                      nxt >= end_pos)
        return _SegmentState(s.step + 1, jnp.where(write, tok, s.tok), jnp.where(write, nxt, s.pos),
                             jnp.where(write, s.gen + 1, s.gen), done, pools, out_tokens, out_logprobs), noise

    drawn = ahead if sampling.temperature > 0.0 else 0  # greedy draws no noise: carry nothing
    noise = jnp.zeros((state.tok.shape[0], drawn, config.vocab_size), jnp.float32)
    return jax.lax.while_loop(cond, body, (state, noise))[0]


def _compiled(fns) -> int:
    return sum(f._cache_size() for f in fns)


_JITTED = (_decode_segment, prefill, store_prefill, copy_pages, grow_pool)


class _Run(NamedTuple):
    """What one :func:`generate_continuous` call fixes before its loop."""

    config: Qwen3Config
    params: Params
    unembed: Optional[jax.Array]  # row_major_unembedding
    schedule: Optional[SparsitySchedule]
    sampling: SamplingParams
    impl: str
    pad_id: int
    prompts: Sequence[Sequence[int]]
    prompt_lens: np.ndarray  # int32 [R]
    end_pos: np.ndarray  # int32 [R] the last position each request may reach
    keys: np.ndarray  # [R] request_keys
    group_of: np.ndarray  # int32 [R] prompt group (slots.group_requests)
    page: int  # page size
    bucket: int  # prefill and buffer lengths are multiples of this
    buf_len: int  # T of the output
    segment_steps: int


def _setup(config: Qwen3Config, params: Params, prompts: Sequence[Sequence[int]], key: jax.Array,
           sampling: SamplingParams, schedule, impl: str, pad_id: int, max_total_len: Optional[int],
           length_bucket: int, max_slots: int, segment_steps: int, max_new_per_request: Optional[Sequence[int]],
           first_request: int) -> _Run:
    """Check the arguments (ValueError naming the bad one) and fix the call's layout."""
    if max_slots < 1 or segment_steps < 1:
        raise ValueError(f"max_slots and segment_steps must be >= 1, got {max_slots} and {segment_steps}")
    prompt_lens, cap = checked_prompt_lens(config, prompts, max_total_len)
    num = len(prompts)
    page = schedule.page_size if schedule is not None else 16
    max_new = sampling.max_new_tokens
    buf_len = round_up(min(int(prompt_lens.max()) + max_new, cap) + 1, max(length_bucket, page))
    caps = np.full(num, max_new) if max_new_per_request is None else np.asarray(max_new_per_request)
    if caps.shape != (num,) or caps.min() < 1 or caps.max() > max_new:
        raise ValueError(f"max_new_per_request must hold {num} values in [1, {max_new}], got shape {caps.shape}")
    end_pos = np.minimum(prompt_lens + caps - 1, cap - 1).astype(np.int32)
    keys = np.asarray(request_keys(key, num, first_request))
    return _Run(config, params, row_major_unembedding(config, params), schedule, sampling, impl, pad_id, prompts,
                prompt_lens, end_pos, keys, group_requests(prompts), page, max(length_bucket, page), buf_len,
                segment_steps)


def _initial_state(run: _Run, batch: int) -> tuple[PageAllocator, _SegmentState]:
    """The allocator and the device state (empty pools and outputs) for a first batch of ``batch`` slots.

    First guess of the pool: the prompts of the first ``batch`` requests (each group once) and every
    slot's pages for one segment; the pool grows on the pool_size grid when that is short."""
    config, page, num, max_new = run.config, run.page, len(run.prompts), run.sampling.max_new_tokens
    first_prompts = {tuple(int(t) for t in p) for p in run.prompts[:batch]}
    allocator = PageAllocator(pool_size(1 + batch * (-(-run.segment_steps // page) + 1) + sum(
        -(-len(p) // page) for p in first_prompts)))
    pools = init_pool(config.num_hidden_layers, allocator.num_pages, config.num_key_value_heads, page,
                      config.head_dim, config.compute_dtype, None if run.schedule is None else run.schedule.selector)
    outputs = (num + 1, max_new)  # completions by request; the last row takes idle slots' writes
    state = _SegmentState(jnp.zeros((), jnp.int32), None, None, None, None, pools,
                          jnp.full(outputs, run.pad_id, jnp.int32), jnp.zeros(outputs, jnp.float32))
    return allocator, state


def _prefill_prompt(run: _Run, allocator: PageAllocator, pools: Pools,
                    prompt: np.ndarray) -> tuple[Pools, PromptPages, float]:
    """Prefill one prompt (int32 [P]) into fresh pages: (pools, its pages, seconds taken).

    ``prompt[:-1]`` goes to the cache; the last token is the first decode input."""
    start = time.perf_counter()
    n = len(prompt) - 1
    length = round_up(max(n, 1), run.bucket)
    tokens = np.full((1, length), run.pad_id, np.int32)
    tokens[0, :n] = prompt[:-1]
    with_minmax = run.schedule is not None and run.schedule.selector == "quest"
    caches = init_caches(run.config, 1, length, page_size=run.page, with_minmax=with_minmax)
    caches = prefill(run.config, run.params, jnp.asarray(tokens), jnp.asarray([n], jnp.int32), caches)
    full, partial = divmod(n, run.page)
    pools = reserve_pages(allocator, pools, full + (partial > 0))
    shared = allocator.alloc(full)
    template = allocator.alloc(1)[0] if partial else None
    dest = np.full(length // run.page, SCRATCH_PAGE, np.int32)
    dest[:full] = shared
    if template is not None:
        dest[full] = template
    pools = store_prefill(pools, caches, jnp.asarray(dest))
    jax.block_until_ready(pools)
    return pools, PromptPages(tuple(shared), template), time.perf_counter() - start


def _admit(run: _Run, h: HostState, allocator: PageAllocator, pools: Pools) -> tuple[HostState, Pools, float]:
    """Waiting requests into the free slots: a group is prefilled on first use and each row gets its own
    copy of the partial prompt page. Returns (state, pools, prefill seconds)."""
    src, dst, released, prefill_s = [], [], [], 0.0
    for slot, r in free_slots(h):
        group = int(run.group_of[r])
        if group not in h.prompt_pages:
            pools, pages, seconds = _prefill_prompt(run, allocator, pools, np.asarray(run.prompts[r], np.int32))
            h, prefill_s = h._replace(prompt_pages={**h.prompt_pages, group: pages}), prefill_s + seconds
        h, pools, copy, done_with = seat(h, allocator, pools, slot, r, group, run.prompts[r])
        if copy is not None:
            src.append(copy[0])
            dst.append(copy[1])
        released += done_with
    if src:
        pad = [SCRATCH_PAGE] * (len(h.slots) - len(src))
        pools = copy_pages(pools, jnp.asarray(src + pad, jnp.int32), jnp.asarray(dst + pad, jnp.int32))
    allocator.release(released)  # after the copies read the templates
    return h, pools, prefill_s


def _decode(run: _Run, h: HostState, state: _SegmentState, plan: SegmentPlan) -> tuple[HostState, _SegmentState]:
    """One decode segment of the batch ``h`` under ``plan``; the rows' progress comes back to the host."""
    batch, num = len(h.slots), len(run.prompts)
    k_max = 0
    if run.schedule is not None:
        live = [s is not None for s in h.slots]
        k_max = k_max_bucket(int(max(run.schedule.topk_at(plan.horizon[live]))))
    row_keys = run.keys[np.where(plan.request < num, plan.request, 0)]
    state = state._replace(step=jnp.zeros((), jnp.int32), tok=jnp.asarray(h.tok), pos=jnp.asarray(h.pos),
                           gen=jnp.asarray(h.gen), done=jnp.asarray(h.done))
    state = _decode_segment(state, run.params, run.unembed, jnp.asarray(plan.table), jnp.asarray(row_keys),
                            jnp.asarray(plan.request), jnp.asarray(plan.row_end), jnp.int32(run.segment_steps),
                            jnp.int32(plan.exit_after), run.schedule, config=run.config, k_max=k_max, impl=run.impl,
                            sampling=run.sampling, ahead=draws_ahead(batch, run.config.vocab_size, run.segment_steps))
    tok, pos, gen, done = (np.array(x) for x in (state.tok, state.pos, state.gen, state.done))
    return h._replace(tok=tok, pos=pos, gen=gen, done=done), state


def generate_continuous(config: Qwen3Config, params: Params, prompts: Sequence[Sequence[int]], key: jax.Array,
                        sampling: SamplingParams, schedule=None, impl: str = "auto", pad_id: int = 0,
                        max_total_len: Optional[int] = None, length_bucket: int = 128, max_slots: int = 64,
                        segment_steps: int = 256, max_new_per_request: Optional[Sequence[int]] = None,
                        progress: bool = False, first_request: int = 0) -> Rollout:
    """Sample completions like :func:`sparrow_jax.rollout.sampler.generate`, with continuous batching.

    Same arguments and output (``Rollout`` rows in prompt order, tokens [R, T] with the same T),
    plus ``max_slots`` (rows decoded at once, rounded up to a power of two),
    ``segment_steps`` (decode steps between scheduling rounds; pages are reserved this far
    ahead; a segment also returns once enough rows finish, so a long one delays no refill or
    compaction, while each round costs ~6 ms on CPU: at 64 steps a third of the quickstart's
    per-step work outside attention), ``max_new_per_request`` (a per-request cap on new tokens,
    at most ``sampling.max_new_tokens``; e.g. per-prompt budgets, or forced ragged lengths) and
    ``first_request`` (the first prompt's request index: its PRNG key). ``stats`` adds
    ``peak_pages``, ``pool_pages``, ``peak_cache_bytes`` (the pool's allocated bytes),
    ``peak_live_cache_bytes`` (pages in use at the peak), ``segments``
    and ``slot_steps`` (decode steps x batch size actually run).
    """
    run = _setup(config, params, prompts, key, sampling, schedule, impl, pad_id, max_total_len, length_bucket,
                 max_slots, segment_steps, max_new_per_request, first_request)
    batch = pow2(min(len(prompts), max_slots))
    allocator, state = _initial_state(run, batch)
    h, tally = initial_state(batch, run.group_of), Tally()
    compiles_before = _compiled(_JITTED)
    t0 = time.perf_counter()
    while True:
        h = retire(h, allocator)
        if not live_slots(h) and h.next_request >= len(prompts):
            break
        h, pools, prefill_s = _admit(run, compact(h), allocator, state.pools)
        h, pools, plan = plan_segment(h, allocator, pools, run.end_pos, run.buf_len // run.page, run.page,
                                      segment_steps)
        h, state = _decode(run, h, state._replace(pools=pools), plan)
        tally = count_segment(tally._replace(prefill_s=tally.prefill_s + prefill_s), h, int(state.step), allocator,
                              t0, progress)
    out_tokens, out_logprobs = (np.asarray(x)[:len(prompts)] for x in (state.out_tokens, state.out_logprobs))
    stats = engine_stats(tally, allocator, state.pools, time.perf_counter() - t0, int(h.generated.sum()),
                         _compiled(_JITTED) - compiles_before)
    return rows_in_prompt_order(prompts, run.prompt_lens, out_tokens, out_logprobs, h.generated, run.buf_len, pad_id,
                                sampling.stop_ids, stats)
