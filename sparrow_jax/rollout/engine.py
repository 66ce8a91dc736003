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
from sparrow_jax.rollout.page_pool import (SCRATCH_PAGE, PageAllocator, PoolLayer, append_and_decode, copy_pages,
                                           grow_pool, init_pool, pool_bytes, pool_size, store_prefill)
from sparrow_jax.rollout.sampler import (Rollout, SamplingParams, checked_prompt_lens, draws_ahead, request_keys,
                                        round_up, sample_logits, segment_noise)
from sparrow_jax.rollout.schedule import SparsitySchedule, k_max_bucket


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
        at = (request, jnp.minimum(s.gen, last))
        out_tokens = s.out_tokens.at[at].set(jnp.where(write, tok, s.out_tokens[at]))
        out_logprobs = s.out_logprobs.at[at].set(jnp.where(write, logp, s.out_logprobs[at]))
        nxt = s.pos + 1
        stopped = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
        done = s.done | (write & (stopped | (nxt >= end_pos)))
        return _SegmentState(s.step + 1, jnp.where(write, tok, s.tok), jnp.where(write, nxt, s.pos),
                             jnp.where(write, s.gen + 1, s.gen), done, pools, out_tokens, out_logprobs), noise

    drawn = ahead if sampling.temperature > 0.0 else 0  # greedy draws no noise: carry nothing
    noise = jnp.zeros((state.tok.shape[0], drawn, config.vocab_size), jnp.float32)
    return jax.lax.while_loop(cond, body, (state, noise))[0]


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class _Slot(NamedTuple):
    request: int
    pages: list  # physical pages, logical order


class _Group(NamedTuple):
    shared: list  # physical pages of the prompt's full pages
    template: Optional[int]  # its partial last page (copied to each row), or None
    waiting: list  # requests of the group not yet admitted


def _compiled(fns) -> int:
    return sum(f._cache_size() for f in fns)


_JITTED = (_decode_segment, prefill, store_prefill, copy_pages, grow_pool)


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
    if max_slots < 1 or segment_steps < 1:
        raise ValueError(f"max_slots and segment_steps must be >= 1, got {max_slots} and {segment_steps}")
    prompt_lens, cap = checked_prompt_lens(config, prompts, max_total_len)
    num = len(prompts)
    page = schedule.page_size if schedule is not None else 16
    max_new = sampling.max_new_tokens
    buf_len = round_up(min(int(prompt_lens.max()) + max_new, cap) + 1, max(length_bucket, page))
    width = buf_len // page
    caps = np.full(num, max_new) if max_new_per_request is None else np.asarray(max_new_per_request)
    if caps.shape != (num,) or caps.min() < 1 or caps.max() > max_new:
        raise ValueError(f"max_new_per_request must hold {num} values in [1, {max_new}], got shape {caps.shape}")
    end_pos = np.minimum(prompt_lens + caps - 1, cap - 1).astype(np.int32)
    keys = np.asarray(request_keys(key, num, first_request))
    unembed = row_major_unembedding(config, params)
    with_minmax = schedule is not None and schedule.selector == "quest"

    groups: dict[tuple, _Group] = {}
    group_of = []
    for r, p in enumerate(prompts):
        group = groups.setdefault(tuple(int(t) for t in p), _Group([], None, []))
        group.waiting.append(r)
        group_of.append(group)
    prefilled: dict[int, _Group] = {}  # id(group) -> group with its pages

    batch = _pow2(min(num, max_slots))
    # First guess: the prompts of the first batch of requests (each group once) and every
    # slot's pages for one segment; the pool grows on the pool_size grid when that is short.
    first_prompts = {tuple(int(t) for t in p) for p in prompts[:batch]}
    allocator = PageAllocator(pool_size(1 + batch * (-(-segment_steps // page) + 1) + sum(
        -(-len(p) // page) for p in first_prompts)))
    pools = init_pool(config.num_hidden_layers, allocator.num_pages, config.num_key_value_heads, page,
                      config.head_dim, config.compute_dtype, None if schedule is None else schedule.selector)
    state = _SegmentState(jnp.zeros((), jnp.int32), None, None, None, None, pools,
                          jnp.full((num + 1, max_new), pad_id, jnp.int32), jnp.zeros((num + 1, max_new), jnp.float32))
    slots: list[Optional[_Slot]] = [None] * batch
    tok = np.zeros(batch, np.int32)
    pos = np.zeros(batch, np.int32)
    gen = np.zeros(batch, np.int32)
    done = np.ones(batch, bool)
    generated = np.zeros(num, np.int32)
    next_request = 0
    compiles_before = _compiled(_JITTED)
    prefill_s, segments, slot_steps, steps, grows = 0.0, 0, 0, 0, 0
    t0 = time.perf_counter()

    def reserve(n: int):
        """Grow the pool (doubling) until ``n`` more pages fit."""
        nonlocal state, grows
        if n > len(allocator.free):
            size = pool_size(max(allocator.in_use + 1 + n, allocator.num_pages + 1))
            state = state._replace(pools=grow_pool(state.pools, num_pages=size))
            allocator.grow(size)
            grows += 1

    def prefill_group(group: _Group, prompt: np.ndarray) -> _Group:
        nonlocal state, prefill_s
        start = time.perf_counter()
        n = len(prompt) - 1  # prompt[:-1] goes to the cache; the last token is the first decode input
        length = round_up(max(n, 1), max(length_bucket, page))
        tokens = np.full((1, length), pad_id, np.int32)
        tokens[0, :n] = prompt[:-1]
        caches = init_caches(config, 1, length, page_size=page, with_minmax=with_minmax)
        caches = prefill(config, params, jnp.asarray(tokens), jnp.asarray([n], jnp.int32), caches)
        full, partial = divmod(n, page)
        reserve(full + (partial > 0))
        shared = allocator.alloc(full)
        template = allocator.alloc(1)[0] if partial else None
        dest = np.full(length // page, SCRATCH_PAGE, np.int32)
        dest[:full] = shared
        if template is not None:
            dest[full] = template
        state = state._replace(pools=store_prefill(state.pools, caches, jnp.asarray(dest)))
        jax.block_until_ready(state.pools)
        prefill_s += time.perf_counter() - start
        return group._replace(shared=shared, template=template)

    while True:
        # Finished rows leave (their pages go back); then compact and shrink once nothing waits.
        for i, slot in enumerate(slots):
            if slot is not None and done[i]:
                generated[slot.request] = gen[i]
                allocator.release(slot.pages)
                slots[i] = None
                pos[i] = tok[i] = 0  # an idle slot attends only the scratch page at position 0
        live = [i for i, s in enumerate(slots) if s is not None]
        waiting = num - next_request
        if not live and not waiting:
            break
        new_batch = max(batch if waiting else 1, _pow2(len(live)))
        if new_batch < batch:
            order = live + [i for i in range(batch) if slots[i] is None]
            slots = [slots[i] for i in order][:new_batch]
            tok, pos, gen, done = (x[order][:new_batch] for x in (tok, pos, gen, done))
            batch = new_batch

        # Waiting requests into free slots (group prefill on first use, partial page copied).
        src, dst, released = [], [], []
        for i in range(batch):
            if slots[i] is not None or next_request >= num:
                continue
            r = next_request
            next_request += 1
            group = group_of[r]
            if id(group) not in prefilled:
                prefilled[id(group)] = prefill_group(group, np.asarray(prompts[r], np.int32))
            group = prefilled[id(group)]
            allocator.share(group.shared)
            pages = list(group.shared)
            if group.template is not None:
                reserve(1)
                pages += allocator.alloc(1)
                src.append(group.template)
                dst.append(pages[-1])
            group.waiting.remove(r)
            if not group.waiting:  # every row holds its own references now (released after the copies)
                released += group.shared + ([group.template] if group.template is not None else [])
            slots[i] = _Slot(r, pages)
            tok[i], pos[i], gen[i], done[i] = prompts[r][-1], prompt_lens[r] - 1, 0, False
        if src:
            pad = batch - len(src)
            state = state._replace(pools=copy_pages(state.pools, jnp.asarray(src + [SCRATCH_PAGE] * pad, jnp.int32),
                                                    jnp.asarray(dst + [SCRATCH_PAGE] * pad, jnp.int32)))
        allocator.release(released)

        # Pages for the next segment's positions; page table, request ids, ends, keys.
        table = np.full((batch, width), SCRATCH_PAGE, np.int32)
        request = np.full(batch, num, np.int32)
        row_end = np.zeros(batch, np.int32)
        horizon = np.zeros(batch, np.int32)
        for i, slot in enumerate(slots):
            if slot is None:
                continue
            horizon[i] = min(int(pos[i]) + segment_steps - 1, int(end_pos[slot.request]))
            need = horizon[i] // page + 1 - len(slot.pages)
            if need > 0:
                reserve(need)
                slot.pages.extend(allocator.alloc(need))
            table[i, :len(slot.pages)] = slot.pages
            request[i], row_end[i] = slot.request, end_pos[slot.request]
        k_max = 0
        if schedule is not None:
            k_max = k_max_bucket(int(max(schedule.topk_at(horizon[[s is not None for s in slots]]))))
        live_now = sum(s is not None for s in slots)
        if num - next_request:
            exit_after = max(1, batch // 8)  # refill soon: free slots idle until then
        elif batch > 1:
            exit_after = max(1, live_now - batch // 2)  # shrink to the next bucket
        else:
            exit_after = batch + 1
        row_keys = keys[np.where(request < num, request, 0)]
        state = state._replace(step=jnp.zeros((), jnp.int32), tok=jnp.asarray(tok), pos=jnp.asarray(pos),
                               gen=jnp.asarray(gen), done=jnp.asarray(done))
        state = _decode_segment(state, params, unembed, jnp.asarray(table), jnp.asarray(row_keys), jnp.asarray(request),
                                jnp.asarray(row_end), jnp.int32(segment_steps), jnp.int32(exit_after), schedule,
                                config=config, k_max=k_max, impl=impl, sampling=sampling,
                                ahead=draws_ahead(batch, config.vocab_size, segment_steps))
        tok, pos, gen, done = (np.array(x) for x in (state.tok, state.pos, state.gen, state.done))
        seg_steps = int(state.step)
        segments += 1
        steps += seg_steps
        slot_steps += seg_steps * batch
        if progress:
            elapsed = time.perf_counter() - t0
            print(f"[engine] segment {segments} batch {batch} live {live_now} waiting {num - next_request} "
                  f"pages {allocator.in_use}/{allocator.num_pages} {int(generated.sum() + gen.sum())} tokens "
                  f"in {elapsed:.1f}s", flush=True)

    out_tokens, out_logprobs = np.asarray(state.out_tokens)[:num], np.asarray(state.out_logprobs)[:num]
    total_s = time.perf_counter() - t0
    tokens = np.full((num, buf_len), pad_id, np.int32)
    logprobs = np.zeros((num, buf_len), np.float32)
    for r, p in enumerate(prompts):
        n, g = prompt_lens[r], generated[r]
        tokens[r, :n] = p
        tokens[r, n:n + g] = out_tokens[r, :g]
        logprobs[r, n:n + g] = out_logprobs[r, :g]
    lengths = (prompt_lens + generated).astype(np.int32)
    positions = np.arange(buf_len)[None]
    mask = (positions >= prompt_lens[:, None]) & (positions < lengths[:, None])
    finished = np.isin(tokens[np.arange(num), lengths - 1], sampling.stop_ids) & (generated > 0)
    stats = dict(prefill_s=prefill_s, decode_s=total_s - prefill_s, decode_steps=steps,
                 decode_tokens=int(generated.sum()), compiles=_compiled(_JITTED) - compiles_before,
                 segments=segments, slot_steps=slot_steps, peak_pages=allocator.peak, pool_grows=grows,
                 pool_pages=allocator.num_pages, peak_cache_bytes=pool_bytes(state.pools),
                 peak_live_cache_bytes=pool_bytes(state.pools, allocator.peak + 1))
    return Rollout(tokens, prompt_lens, lengths, mask, logprobs, finished, stats)
