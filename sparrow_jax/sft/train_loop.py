"""The warm-up's training: the SFT loss, the jitted step, and the loops of its phases (the main
phase from a fresh init, and a refine or preamble run on top of another warm-up's params).

The loss is the mean negative log-likelihood of the reference tokens and their ``<eos>``
(``prompt_weight`` > 0 adds the prompt tokens' NLL; off by default).

Imports models and :mod:`batches`, :mod:`curriculum`, :mod:`examples`, :mod:`settings`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.forward import dense_hidden, sparse_hidden, unembedding
from sparrow_jax.models.qwen3 import Params, init_params
from sparrow_jax.models.scoring import token_logprobs
from sparrow_jax.models.tokenizer import BuiltinTokenizer
from sparrow_jax.rollout.schedule import SparsitySchedule
from sparrow_jax.sft.batches import final_batch, train_context, train_hops, training_batch, training_length
from sparrow_jax.sft.curriculum import final_phase_start, make_optimizer, phase_steps_lr, stage_settings
from sparrow_jax.sft.examples import sequence_length
from sparrow_jax.sft.settings import WarmupSettings


def sft_loss(config: Qwen3Config, params: Params, tokens: jax.Array, mask: jax.Array,
             prompt_mask: jax.Array | None = None, prompt_weight: float = 0.0, lookup_weight: float = 0.0,
             lookup_after: int = -1, sparse: SparsitySchedule | None = None,
             sparse_weight: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """(loss, reference NLL). tokens int32 [B, L]; mask, prompt_mask bool [B, L].

    reference NLL = mean NLL over ``mask`` tokens; loss = it + ``prompt_weight`` x the mean
    NLL over ``prompt_mask`` tokens + ``lookup_weight`` x the mean NLL over the reference tokens
    right after a ``lookup_after`` token (the looked-up constants) + ``sparse_weight`` x the
    reference NLL of the sparse actor's teacher-forced pass under ``sparse`` (its prompt, the
    tokens before the first ``mask`` token, prefilled densely as the sampler does).
    """
    # One query chunk covering the row: no padded queries (training rows are short).
    hidden = dense_hidden(config, params, tokens, chunk=tokens.shape[1])
    logp, _ = token_logprobs(hidden, unembedding(config, params), tokens, seq_chunk=128)
    def mean_nll(m, lp=logp):
        m = m.astype(jnp.float32)
        return -jnp.sum(lp * m) / jnp.maximum(jnp.sum(m), 1.0)

    ref = mean_nll(mask)
    loss = ref
    if prompt_mask is not None and prompt_weight != 0.0:
        loss = loss + prompt_weight * mean_nll(prompt_mask)
    if lookup_weight != 0.0:
        after = jnp.pad(tokens[:, :-1] == lookup_after, ((0, 0), (1, 0)))  # [B, L]: the previous token is it
        loss = loss + lookup_weight * mean_nll(mask & after)
    if sparse is not None and sparse_weight != 0.0:
        prompt_lens = jnp.argmax(mask, axis=1).astype(jnp.int32)
        h_sparse = sparse_hidden(config, params, tokens, sparse, prompt_lens=prompt_lens)
        logp_sparse, _ = token_logprobs(h_sparse, unembedding(config, params), tokens, seq_chunk=128)
        loss = loss + sparse_weight * mean_nll(mask, logp_sparse)
    return loss, ref


def warmup_sparse_layout(config: Qwen3Config, topk: int, reserved_first: int = 1,
                         selector: str = "centroid") -> SparsitySchedule:
    """The sparse actor of the refine (or slip) phase's sparse loss: every layer sparse, ``topk``
    pages selected by ``selector`` everywhere, pages of 16 tokens, the first ``reserved_first`` and the
    last two kept (by default the sampler's layout)."""
    return SparsitySchedule(topk=(int(topk),), bin_width=config.max_position_embeddings, dense_layers=(),
                            name=f"warmup-topk{int(topk)}", reserved_first=int(reserved_first), selector=selector)


def make_train_step(config: Qwen3Config, optimizer: optax.GradientTransformation, prompt_weight: float = 0.0,
                    lookup_weight: float = 0.0, sparse_topk: int = 0, sparse_weight: float = 0.0,
                    sparse_reserved_first: int = 1, sparse_selector: str = "centroid"):
    """One jitted step ``(params, opt_state, tokens, mask, prompt_mask) -> (params, opt_state, ref_nll)``
    (``lookup_weight``: extra weight of the tokens after ``=``; ``sparse_weight`` > 0: the sparse
    actor's NLL at ``sparse_topk`` pages (``sparse_selector``'s) with the first ``sparse_reserved_first`` kept, see
    :func:`sft_loss`)."""
    eq = BuiltinTokenizer().encode("=")[0]
    sparse = (warmup_sparse_layout(config, sparse_topk, sparse_reserved_first, sparse_selector)
              if sparse_weight else None)

    def step(params, opt_state, tokens, mask, prompt_mask):
        (_, ref), grads = jax.value_and_grad(
            lambda p: sft_loss(config, p, tokens, mask, prompt_mask, prompt_weight, lookup_weight, eq, sparse,
                               sparse_weight),
            has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ref
    return jax.jit(step, donate_argnums=(0, 1))


class LossLog:
    """The loss curve: ``(step, reference NLL)`` every 25th step and at each phase's last, printed
    with the wall and CPU seconds since the log was made when ``progress``."""

    def __init__(self, progress: bool):
        self.progress = progress
        self.losses: list[tuple[int, float]] = []
        self.t0, self.c0 = time.perf_counter(), time.process_time()

    def __call__(self, step: int, loss: jax.Array, last: bool) -> None:
        if step % 25 == 0 or last:
            self.losses.append((step, round(float(loss), 4)))
            if self.progress:
                print(f"[warmup] step {step} loss {float(loss):.4f} ({time.perf_counter() - self.t0:.0f}s wall, "
                      f"{time.process_time() - self.c0:.0f}s CPU)", flush=True)

    def seconds(self) -> tuple[float, float]:
        """(wall, CPU) seconds since the log was made."""
        return time.perf_counter() - self.t0, time.process_time() - self.c0


def _train_on(train_step, params: Params, opt_state: Any, batch: tuple[np.ndarray, ...]) -> tuple[Params, Any, jax.Array]:
    """One step on a (tokens, mask, prompt_mask) batch from :mod:`batches`."""
    return train_step(params, opt_state, *(jnp.asarray(x) for x in batch))


def main_phase(config: Qwen3Config, knobs: dict[str, Any], settings: WarmupSettings, log: LossLog,
               path: str, progress: bool) -> tuple[Params, list[int]]:
    """The curriculum (or single phase) and the final phase from a fresh init, training toward the
    warm-up at ``path``: (params, padded row lengths)."""
    tok, final_len = BuiltinTokenizer(), sequence_length(knobs)
    seq_lens = {}  # one padded length (one compile) per curriculum stage
    final_start = final_phase_start(settings)
    optimizer = make_optimizer(settings)
    train_step = make_train_step(config, optimizer, settings.prompt_weight, settings.lookup_weight)
    params = init_params(config, seed=settings.seed)
    opt_state = optimizer.init(params)
    stages = settings.curriculum or ((final_start, train_context(knobs, settings), train_hops(knobs, settings),
                                      settings.batch_size, settings.lookup_every),)
    if progress:
        plan = ", ".join(f"{n} x {rows} rows (contexts <= {ctx}, <= {hops} hops"
                         + (f", look-ups every {every[0]} lines)" if every and every[0] else ")")
                         for n, ctx, hops, rows, *every in stages)
        print(f"[warmup] training {config.num_params():,} params, {settings.steps} steps: {plan}, then "
              f"{settings.steps - final_start} x {settings.final_batch_size} task rows of {final_len} tokens -> {path}",
              flush=True)
    for step in range(settings.steps):
        if step < final_start:
            stage = stage_settings(settings, step)
            if stage not in seq_lens:  # computed once per stage, not every step
                seq_lens[stage] = training_length(knobs, stage)
            batch = training_batch(knobs, stage, step, tok, seq_lens[stage])
        else:  # a second compiled shape: the task's own rows
            batch = final_batch(knobs, settings, step, tok, final_len)
        params, opt_state, loss = _train_on(train_step, params, opt_state, batch)
        log(step, loss, step == settings.steps - 1)
    return params, list(seq_lens.values())


def slip_sparse_loss(settings: WarmupSettings) -> dict[str, Any]:
    """:func:`make_train_step`'s sparse-loss arguments for the slip run: its own top-k and weight where
    set (else the refine's), its kept first pages and its page selector."""
    return dict(sparse_topk=settings.slip_sparse_topk or settings.refine_sparse_topk,
                sparse_weight=settings.slip_sparse_weight or settings.refine_sparse_weight,
                sparse_reserved_first=settings.slip_reserved_first, sparse_selector=settings.slip_selector)


def continued_phase(config: Qwen3Config, knobs: dict[str, Any], settings: WarmupSettings, phase: str,
                    base_settings: WarmupSettings, params: Params, log: LossLog, progress: bool,
                    where: str) -> Params:
    """The ``refine``, ``slip`` or ``preamble`` run (fresh optimiser state, its own steps and peak) on the
    task's rows, on top of ``params`` of the warm-up trained with ``base_settings``; its rows are
    drawn past the base's steps. ``where``: the base and target directories, for the progress line."""
    tok, final_len = BuiltinTokenizer(), sequence_length(knobs)
    n_steps, lr = phase_steps_lr(settings, phase)
    rows = dataclasses.replace(settings, final_batch_size=getattr(settings, f"{phase}_batch_size"))
    if progress:
        print(f"[warmup] {phase}: {n_steps} x {rows.final_batch_size} task rows of {final_len} tokens (peak lr "
              f"{lr:g}) on {where}", flush=True)
    optimizer = make_optimizer(settings, phase)
    if phase == "slip":  # a sparse loss (the refine's unless its own is set): the sparse actor stays trained
        sparse = slip_sparse_loss(settings)
    elif phase == "refine":
        sparse = dict(sparse_topk=settings.refine_sparse_topk, sparse_weight=settings.refine_sparse_weight)
    else:
        sparse = {}
    train_step = make_train_step(config, optimizer, settings.prompt_weight, settings.lookup_weight, **sparse)
    opt_state = optimizer.init(params)
    first = base_settings.steps + base_settings.refine_steps + base_settings.slip_steps  # rows past the base's
    slip = settings.slip_prob if phase == "slip" else 0.0
    for step in range(first, first + n_steps):
        batch = final_batch(knobs, rows, step, tok, final_len, slip=slip)
        params, opt_state, loss = _train_on(train_step, params, opt_state, batch)
        log(step, loss, step == first + n_steps - 1)
    return params
