"""Batched dense / block-sparse sampler: prefill, then a jitted ``while_loop`` decode.

Layout of a rollout (right-padded rows, absolute positions from 0):

    tokens[b, :prompt_len[b]]            the prompt
    tokens[b, prompt_len[b]:length[b]]   sampled tokens (completion_mask True)
    logprobs[b, t]                       sampler log-prob of tokens[b, t] given tokens[b, :t]

Every sampled token comes from one decode step: prefill writes ``prompt[:-1]`` into the
cache and the first decode step feeds the last prompt token. In sparse mode each row's
top-k budget follows its own position (``schedule.topk_at``). The schedule enters the
decode loop as data (its top-k table is traced); the loop is split into segments with a
static ``k_max`` bucket each (``schedule.decode_segments``), so a rollout compiles at most
once per distinct bucket and layout, and a budget change within the buckets compiles nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.forward import decode_step, init_caches, prefill
from sparrow_jax.models.qwen3 import Params
from sparrow_jax.parallel.distributed import host_array
from sparrow_jax.parallel.kernels import place_kv_caches, place_rows
from sparrow_jax.rollout.schedule import SparsitySchedule


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. ``temperature=0`` is greedy; ``top_k=0`` / ``top_p=1`` disable truncation."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens <= 0:
            raise ValueError(f"SamplingParams.max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))


class Rollout(NamedTuple):
    tokens: np.ndarray  # int32 [B, T] prompt + completion, right-padded with pad_id
    prompt_lens: np.ndarray  # int32 [B]
    lengths: np.ndarray  # int32 [B] prompt + completion
    completion_mask: np.ndarray  # bool [B, T] True at sampled tokens
    logprobs: np.ndarray  # float32 [B, T] sampler log-prob of tokens[b, t] (0 elsewhere)
    finished: np.ndarray  # bool [B] a stop token was sampled
    stats: dict  # timings: prefill_s, decode_s, decode_tokens, compiles


class _LoopState(NamedTuple):
    step: jax.Array
    tokens: jax.Array
    logprobs: jax.Array
    pos: jax.Array  # [B] position of the token fed at the next step
    done: jax.Array  # [B]
    key: jax.Array  # [B] one key per row (request_keys)
    caches: tuple


def request_keys(key: jax.Array, num_requests: int, first_request: int = 0) -> jax.Array:
    """One PRNG key per request, ``fold_in(key, index)`` for indices ``first_request ..``: a
    request's draws do not depend on which other requests share its batch (the fixed sampler
    and the rollout engine agree; a process sampling rows ``first_request ..`` of a global
    batch draws what one process sampling the whole batch would)."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(first_request + jnp.arange(num_requests))


def token_keys(keys: jax.Array, generated: jax.Array) -> jax.Array:
    """The key of each row's next draw: its request key folded with its count of generated tokens."""
    return jax.vmap(jax.random.fold_in)(keys, generated)


# Gumbel noise drawn ahead for a decode segment: at most this many bytes (quickstart: 64 steps
# x 16 rows x 111 tokens = 0.45 MiB; a 152K vocabulary at 64 rows draws step by step).
NOISE_BYTES = 1 << 24


def draws_ahead(batch: int, vocab: int, steps: int) -> int:
    """Decode steps whose sampling noise is drawn in one batch: up to ``steps``, within NOISE_BYTES."""
    return max(1, min(int(steps), NOISE_BYTES // (4 * batch * vocab)))


def gumbel_noise(keys: jax.Array, generated: jax.Array, steps: int, vocab: int) -> jax.Array:
    """The Gumbel noise of each row's next ``steps`` draws. keys [B], generated int32 [B] ->
    float32 [B, steps, V]: ``noise[b, j]`` is the noise ``jax.random.categorical`` adds under
    ``token_keys(keys, generated + j)[b]``.

    Why: drawn step by step inside the decode loop, the two threefry calls and the Gumbel
    transform of [B, V] values are ~15% of a small model's CPU decode step (dozens of tiny
    XLA ops); drawn for a whole segment at once they vectorise. The tokens are the same."""
    offsets = jnp.arange(steps, dtype=jnp.int32)

    def row(key, gen):
        return jax.vmap(lambda i: jax.random.gumbel(jax.random.fold_in(key, i), (vocab,), jnp.float32))(gen + offsets)

    return jax.vmap(row)(keys, generated)


def segment_noise(keys: jax.Array, generated: jax.Array, step: jax.Array,
                  noise: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the noise of a decode loop's current step [B, V], the block [B, C, V] it comes from).

    ``step``: steps since the loop started; ``noise`` [B, C, V]: the block drawn at the last
    multiple of C (``generated`` then held each row's count of generated tokens). At a
    multiple of C a new block is drawn from ``generated``; rows that stop generating
    mid-block draw nothing more, so the block stays theirs."""
    ahead = noise.shape[1]
    j = step % ahead
    if ahead == 1:
        noise = gumbel_noise(keys, generated, 1, noise.shape[2])
    else:
        noise = jax.lax.cond(j == 0, lambda: gumbel_noise(keys, generated, ahead, noise.shape[2]), lambda: noise)
    return jax.lax.dynamic_index_in_dim(noise, j, axis=1, keepdims=False), noise


def _categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """jax.random.categorical over [B, V], with one key for the batch or one key per row."""
    per_row = key.ndim == (1 if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else 2)
    if per_row:
        return jax.vmap(lambda k, l: jax.random.categorical(k, l))(key, logits)
    return jax.random.categorical(key, logits, axis=-1)


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first index of the maximum) for x [B, V] without NaN, as
    a max and a min-index reduction: XLA:CPU runs argmax's paired (value, index) reduce element
    by element, ~4x slower than these two vectorised ones at a decode step's [16, 111]."""
    vocab = x.shape[-1]
    at_max = x == jnp.max(x, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(at_max, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)
    return jnp.minimum(first, vocab - 1)  # a NaN row matches nothing: its last index, not out of range


def sample_logits(logits: jax.Array, key: Optional[jax.Array], sampling: SamplingParams,
                  noise: Optional[jax.Array] = None):
    """Draw one token per row. logits float32 [B, V] -> (tokens int32 [B], logprobs float32 [B]).

    ``key``: one key for the batch, or one per row ([B] keys, e.g. from :func:`token_keys`).
    ``noise`` [B, V] (instead of ``key``): the Gumbel noise of this draw (:func:`gumbel_noise`),
    the token ``jax.random.categorical`` would draw with the key it was drawn from.

    The returned log-prob is that of the distribution actually sampled from: logits
    divided by the temperature, then restricted to the top-k tokens and the top-p nucleus
    and renormalised over what is left. Greedy (temperature 0) returns the untempered
    model log-prob of the argmax token.
    """
    if sampling.temperature == 0.0:
        tok = first_argmax(logits)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return tok.astype(jnp.int32), jnp.take_along_axis(logp, tok[:, None], -1)[:, 0]
    scaled = logits / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(scaled, sampling.top_k)[0][:, -1:]
        scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-scaled, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled, order, -1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        keep_sorted = before < sampling.top_p  # the smallest prefix reaching top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(scaled.shape[0])[:, None], order].set(keep_sorted)
        scaled = jnp.where(keep, scaled, -jnp.inf)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    tok = _categorical(key, scaled) if noise is None else first_argmax(noise + scaled)
    return tok.astype(jnp.int32), jnp.take_along_axis(logp, tok[:, None], -1)[:, 0]


def record_draws(out_tokens: jax.Array, out_logprobs: jax.Array, at: tuple, tok: jax.Array, logp: jax.Array,
                 done: jax.Array, stop_ids: jax.Array, ended: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode step's bookkeeping, shared by the fixed sampler and the rollout engine: write the draws
    (tok int32 [B], logp float32 [B]) at index ``at`` of the output buffers for the rows not ``done``
    (bool [B]) and mark done the rows that drew one of ``stop_ids`` or have ``ended`` (bool [B]: a
    length cap reached). Returns (out_tokens, out_logprobs, done)."""
    write = ~done
    out_tokens = out_tokens.at[at].set(jnp.where(write, tok, out_tokens[at]))
    out_logprobs = out_logprobs.at[at].set(jnp.where(write, logp, out_logprobs[at]))
    stopped = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
    return out_tokens, out_logprobs, done | (write & (stopped | ended))


@functools.partial(jax.jit, static_argnames=("config", "k_max", "impl", "sampling"),
                   donate_argnames=("state",))
def _decode_segment(state: _LoopState, params: Params, step_limit: jax.Array, max_pos: jax.Array,
                    end_pos: jax.Array, schedule: Optional[SparsitySchedule], *, config: Qwen3Config,
                    k_max: int, impl: str, sampling: SamplingParams) -> _LoopState:
    """Run decode steps until ``step_limit`` or every row is done.

    ``schedule`` is a pytree argument: its top-k table is traced, its layout static.
    """
    rows = jnp.arange(state.tokens.shape[0])
    stop_ids = jnp.asarray(sampling.stop_ids or (-1,), jnp.int32)

    def cond(s: _LoopState):
        return (s.step < step_limit) & ~jnp.all(s.done)

    def body(s: _LoopState):
        # Greedy draws no randomness: skip the threefry fold. Every live row has generated
        # ``step`` tokens, so its draw key matches the engine's (request key, tokens so far).
        sub = s.key if sampling.temperature == 0.0 else token_keys(s.key, jnp.broadcast_to(s.step, rows.shape))
        inputs = s.tokens[rows, s.pos]
        logits, caches = decode_step(config, params, inputs, s.pos, s.caches, schedule=schedule,
                                     k_max=k_max, impl=impl)
        tok, logp = sample_logits(logits, sub, sampling)
        nxt = s.pos + 1
        write = ~s.done
        tokens, logprobs, done = record_draws(s.tokens, s.logprobs, (rows, nxt), tok, logp, s.done, stop_ids,
                                              (nxt >= end_pos) | (nxt >= max_pos))
        pos = jnp.where(write, nxt, s.pos)
        return _LoopState(s.step + 1, tokens, logprobs, pos, done, s.key, caches)

    return jax.lax.while_loop(cond, body, state)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` >= ``n`` (buffer lengths: bounded recompiles)."""
    return -(-n // multiple) * multiple


def checked_prompt_lens(config: Qwen3Config, prompts: Sequence[Sequence[int]],
                        max_total_len: Optional[int]) -> tuple[np.ndarray, int]:
    """(prompt lengths int32 [B], total length cap); ValueError naming an empty or too long prompt."""
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    prompt_lens = np.array([len(p) for p in prompts], np.int32)
    if prompt_lens.min() < 1:
        raise ValueError(f"prompt {int(prompt_lens.argmin())} is empty")
    cap = max_total_len or config.max_position_embeddings
    if prompt_lens.max() >= cap:
        bad = int(prompt_lens.argmax())
        raise ValueError(f"prompt {bad} has {prompt_lens[bad]} tokens; it cannot fit with at least one new "
                         f"token under the total length cap of {cap}")
    return prompt_lens, cap


def completion_mask(prompt_lens: np.ndarray, lengths: np.ndarray, buf_len: int) -> np.ndarray:
    """bool [B, T]: True at the sampled positions ``prompt_lens[b] <= t < lengths[b]`` of rows of ``buf_len``."""
    positions = np.arange(buf_len)[None]
    return (positions >= prompt_lens[:, None]) & (positions < lengths[:, None])


def _prefill_rows(config: Qwen3Config, params: Params, tokens: np.ndarray, prompt_lens: np.ndarray,
                  schedule: Optional[SparsitySchedule], page: int, prefill_len: int) -> tuple:
    """Caches of rows of ``tokens`` int32 [B, T] holding ``prompt[:-1]`` (the first ``prefill_len`` columns run).

    Under a mesh the prefill runs per device on its rows (and KV heads), and the caches come
    out split as the sparse kernels read them."""
    caches = init_caches(config, tokens.shape[0], tokens.shape[1], page_size=page,
                         with_minmax=schedule is not None and schedule.selector == "quest")
    caches = place_kv_caches(caches)
    caches = prefill(config, params, *place_rows((tokens[:, :prefill_len], prompt_lens - 1)), caches)
    return place_kv_caches(caches)


def _decode_rows(state: _LoopState, params: Params, segments: Sequence, max_pos: int, end_pos: jax.Array,
                 schedule: Optional[SparsitySchedule], config: Qwen3Config, impl: str, sampling: SamplingParams,
                 progress_every: Optional[int]) -> _LoopState:
    """Run the decode ``segments`` ((first step, steps, k_max) each) until every row is done; with
    ``progress_every``, in chunks of that many steps with a progress line after each."""
    batch, t1 = state.tokens.shape[0], time.perf_counter()
    for first, count, k_max in segments:
        seg_end = first + count
        while True:
            limit = min(seg_end, int(state.step) + (progress_every or count))
            state = _decode_segment(state, params, jnp.int32(limit), jnp.int32(max_pos), end_pos, schedule,
                                    config=config, k_max=int(k_max), impl=impl, sampling=sampling)
            step = int(state.step)
            if progress_every:
                elapsed = time.perf_counter() - t1
                print(f"[generate] step {step}/{sampling.max_new_tokens} len {int(jnp.max(state.pos)) + 1} "
                      f"{batch * step / max(elapsed, 1e-9):.1f} tok/s", flush=True)
            if step >= seg_end or bool(jnp.all(state.done)):
                break
        if bool(jnp.all(state.done)):
            break
    return state


def generate(config: Qwen3Config, params: Params, prompts: Sequence[Sequence[int]], key: jax.Array,
             sampling: SamplingParams, schedule=None, impl: str = "auto", pad_id: int = 0,
             max_total_len: Optional[int] = None, length_bucket: int = 128,
             progress: bool = False, progress_every: int = 256, first_request: int = 0) -> Rollout:
    """Sample completions for a batch of prompts (lists of token ids, different lengths).

    Args:
      params: the sampler's params pytree (e.g. ``with_lora(params, lora, lora_cfg)`` for the sparse
        actor); nothing is copied.
      schedule: ``None`` for dense attention, else a ``SparsitySchedule``.
      max_total_len: hard cap on prompt + completion tokens per row (default: the model's
        ``max_position_embeddings``); a prompt that cannot fit raises ``ValueError``.
      length_bucket: buffer lengths are rounded up to this multiple to bound recompiles.
      progress: print tokens/s and current length every ``progress_every`` steps.
      first_request: index of the first prompt's request (its PRNG key: :func:`request_keys`).
    """
    prompt_lens, cap = checked_prompt_lens(config, prompts, max_total_len)
    batch = len(prompts)
    page = schedule.page_size if schedule is not None else 16
    bucket = max(length_bucket, page)
    total = min(int(prompt_lens.max()) + sampling.max_new_tokens, cap)
    buf_len = round_up(total + 1, bucket)  # +1: a spare slot past the last write
    tokens = np.full((batch, buf_len), pad_id, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = p

    t0 = time.perf_counter()
    prefill_len = round_up(int(prompt_lens.max()), bucket)
    caches = _prefill_rows(config, params, tokens, prompt_lens, schedule, page, prefill_len)
    jax.block_until_ready(caches)
    prefill_s = time.perf_counter() - t0

    start = prompt_lens - 1
    state = _LoopState(step=jnp.zeros((), jnp.int32), tokens=jnp.asarray(tokens),
                       logprobs=jnp.zeros((batch, buf_len), jnp.float32), pos=jnp.asarray(start),
                       done=jnp.zeros((batch,), bool), key=request_keys(key, batch, first_request), caches=caches)
    end_pos = jnp.asarray(np.minimum(prompt_lens + sampling.max_new_tokens - 1, cap - 1), jnp.int32)
    if schedule is None:
        segments = [(0, sampling.max_new_tokens, 0)]
    else:
        segments = schedule.decode_segments(start, sampling.max_new_tokens)
    compiles_before = _decode_segment._cache_size()
    t1 = time.perf_counter()
    state = _decode_rows(state, params, segments, cap - 1, end_pos, schedule, config, impl, sampling,
                         progress_every if progress else None)
    jax.block_until_ready(state.tokens)
    decode_s = time.perf_counter() - t1

    out_tokens = host_array(state.tokens)  # process-spanning arrays: an explicit gather
    lengths = host_array(state.pos) + 1
    mask = completion_mask(prompt_lens, lengths, buf_len)
    out_tokens = np.where(np.arange(buf_len)[None] < lengths[:, None], out_tokens, pad_id).astype(np.int32)
    finished = np.isin(out_tokens[np.arange(batch), lengths - 1], sampling.stop_ids) & (lengths > prompt_lens)
    stats = dict(prefill_s=prefill_s, decode_s=decode_s, decode_steps=int(state.step),
                 decode_tokens=int(mask.sum()), compiles=_decode_segment._cache_size() - compiles_before)
    return Rollout(out_tokens, prompt_lens, lengths.astype(np.int32), mask,
                   np.where(mask, host_array(state.logprobs), 0.0).astype(np.float32), finished, stats)
