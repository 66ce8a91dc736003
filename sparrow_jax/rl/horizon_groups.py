"""The single on-policy update cut at the reward horizon: rows sorted by where their loss ends, in
groups that each stop at their longest loss row.

With ``train.reward_horizon_mask`` the policy loss ends at each completion's first wrong line, so
the update's forward and backward past a row's last loss token compute nothing the gradient
reads (causal attention: a position's log-prob does not depend on later tokens). Sorting the rows
by that end and running the update in ``G`` equal row groups, each cut at its own longest loss
row (rounded up to a multiple of 128, so few programs compile), removes most of that work: the
gradient is the same sum, weighted by each group's share of the loss's denominator exactly as
:func:`train_step`'s micro-batches are. :func:`timed_grouped_train_step` is
:func:`sparrow_jax.rl.train_step.timed_train_step` for such a step.

What changes: without a sparse schedule no pass covers the positions past a group's cut, so the
``rollout_corr/`` metrics (sampler vs trainer log-probs) cover the positions the groups compute
(every loss token), not every completion token. With a schedule the sparse scorer needs the dense
pass over whole rows: one no-grad pass runs first (``timing_s/old_log_prob``) and gives the
metrics over every completion token as before.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.rl.train_step import (Batch, DistillOptions, StepOptions, TrainState, _accumulated_grads,
                                       _apply_update_jit, _check_step, _merge_rows, _micro_batch_weights,
                                       _old_policy_jit, _on_policy_loss, _OnPolicyRows, _ref_logprobs_jit, PhaseTimer,
                                       _sparse_actor_jit, _split_rows, _step_metrics_jit, _tis, on_policy,
                                       policy_loss_mask, tail_mask)

WIDTH_MULTIPLE = 128  # group cuts are multiples of this: at most T / 128 compiled shapes per group size


class RowGroup(NamedTuple):
    rows: np.ndarray  # int [b] the batch rows of the group
    width: int  # the group's tokens are [:, :width]; every loss token of its rows is below it


def horizon_row_groups(loss_mask: np.ndarray, groups: int, multiple: int = WIDTH_MULTIPLE) -> list[RowGroup]:
    """``loss_mask`` [B, T] -> ``groups`` groups of B / groups rows, sorted by the position after
    each row's last loss token; each group's width is its largest such end rounded up to
    ``multiple`` (at most T; at least ``multiple`` or T). Rows with no loss token sort first."""
    loss_mask = np.asarray(loss_mask)
    b, t = loss_mask.shape
    if groups < 1 or b % groups:
        raise ValueError(f"horizon_row_groups: {b} rows do not split into groups={groups} equal groups")
    any_loss = loss_mask.any(axis=1)
    ends = np.where(any_loss, t - np.argmax(loss_mask[:, ::-1] > 0, axis=1), 0)
    order = np.argsort(ends, kind="stable")
    out = []
    for rows in np.split(order, groups):
        width = -(-max(int(ends[rows].max()), 1) // multiple) * multiple
        out.append(RowGroup(np.sort(rows), min(width, t)))
    return out


def _loss_and_logp(params, config: Qwen3Config, mb: _OnPolicyRows, opts: StepOptions):
    """:func:`_on_policy_loss` keeping only the log-probs as its aux (no dense pass to carry)."""
    loss, (metrics, (logp_old, _)) = _on_policy_loss(params, config, mb, opts)
    return loss, (metrics, logp_old)


@functools.partial(jax.jit, static_argnames=("config", "opts"))
def _group_grads(params, rows: _OnPolicyRows, *, config: Qwen3Config, opts: StepOptions):
    """One group's gradient (its loss's own denominator), accumulated over ``opts.micro_batches``.
    -> (grads float32, loss, weighted metrics, logp_old [b, w])"""
    micros = jax.tree.map(lambda x: _split_rows(x, opts.micro_batches), rows)
    weights = _micro_batch_weights(micros.mask, opts.loss_agg, opts.global_rows)
    grads, loss, metrics, logp_old = _accumulated_grads(_loss_and_logp, params, micros, weights, config, opts)
    return jax.tree.map(lambda g: g.astype(jnp.float32), grads), loss, metrics, _merge_rows(logp_old)


@jax.jit
def _add_weighted(total, part, weight):
    return jax.tree.map(lambda a, b: a + b * weight, total, part)


@functools.partial(jax.jit, static_argnames=("opts",))
def _rollout_corr_metrics(logp_old, logp_sampler, mask, *, opts: StepOptions) -> dict:
    return _tis(logp_old, logp_sampler, mask, opts)[2]


def _cut(x: jax.Array, group: RowGroup) -> jax.Array:
    rows = x[jnp.asarray(group.rows)]
    return rows[:, :group.width] if rows.ndim == 2 else rows


def timed_grouped_train_step(state: TrainState, batch: Batch, groups: list[RowGroup], ref_params=None, *,
                             config: Qwen3Config, optimizer: optax.GradientTransformation, schedule=None,
                             opts: StepOptions = StepOptions(), shared_prefix: int = 0):
    """The single on-policy update (:func:`on_policy`) run group by group (:func:`horizon_row_groups`),
    each group cut at its width; the same gradient as :func:`train_step`'s (up to float summation
    order). -> (new_state, None, metrics fetched to the host, {part: seconds} for ``TIMING_PARTS``),
    as :func:`timed_train_step`; ``state`` is consumed (donated). Metrics add
    ``actor/update_position_share``: the positions the groups compute over the batch's B x T.
    """
    if not on_policy(opts) or opts.tis_mask_bounds is not None:
        raise ValueError("timed_grouped_train_step: needs a single on-policy update (ppo_epochs = mini_batches = 1) "
                         f"without ratio masking (the groups' shares are fixed before their forwards); got {opts}")
    chunks = _check_step(batch, ref_params, opts, None, None, shared_prefix)
    b, t = batch.tokens.shape
    if sum(len(g.rows) for g in groups) != b or any(len(g.rows) % opts.micro_batches for g in groups):
        raise ValueError(f"timed_grouped_train_step: the groups must cover the batch's {b} rows, each a multiple of "
                         f"micro_batches={opts.micro_batches} rows; got sizes {[len(g.rows) for g in groups]}")
    timed = PhaseTimer()

    alpha = kl = out = None
    sparse_metrics = {}
    if schedule is not None:  # the scorer reads the dense pass over whole rows, before the update donates params
        _, dense, _, _, out = timed("old_log_prob", _old_policy_jit, state.params, batch, config=config, opts=opts,
                                    chunks=chunks, keep_hidden=True, shared_prefix=shared_prefix)
        alpha, kl, _, sparse_metrics = timed("scoring", _sparse_actor_jit, state.params, batch, dense, None, None,
                                             config=config, schedule=schedule, opts=opts, lora_cfg=None,
                                             lora_optimizer=None, distill=DistillOptions())
    loss_mask = policy_loss_mask(batch)
    shares = _micro_batch_weights(jnp.stack([loss_mask[jnp.asarray(g.rows)] for g in groups]), opts.loss_agg,
                                  opts.global_rows)
    grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    loss, metrics = 0.0, {}
    logp_old = jnp.zeros((b, t), jnp.float32)
    covered = np.zeros((b, t), np.float32)
    for group, share in zip(groups, shares):
        tokens = _cut(batch.tokens, group)
        logp_ref = None
        if ref_params is not None:
            logp_ref = timed("ref", _ref_logprobs_jit, ref_params, tokens, config=config, opts=opts,
                             chunks=opts.micro_batches)
        rows = _OnPolicyRows(tokens, _cut(loss_mask, group), _cut(batch.logp_sampler, group),
                             _cut(batch.advantages, group), logp_ref)
        g, g_loss, g_metrics, g_logp = timed("forward_backward", _group_grads, state.params, rows, config=config,
                                             opts=opts)
        grads = timed("forward_backward", _add_weighted, grads, g, share)
        loss = loss + g_loss * share
        metrics = {k: metrics.get(k, 0.0) + v * share for k, v in g_metrics.items()}
        logp_old = logp_old.at[jnp.asarray(group.rows), :group.width].set(g_logp)
        covered[group.rows, :group.width] = 1.0
    if out is None:
        out = timed("statistics", _rollout_corr_metrics, logp_old, batch.logp_sampler, batch.mask * covered, opts=opts)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    params, opt_state, update_metrics, ok = timed("optimizer", _apply_update_jit, state.params, state.opt_state, grads,
                                                  loss, metrics, optimizer=optimizer)

    def fetch():
        m = _step_metrics_jit(out, [update_metrics], [ok], sparse_metrics, alpha, kl, tail_mask(batch, opts),
                          opts=opts)
        return jax.device_get(m)

    host = timed("statistics", fetch)
    host["actor/update_position_share"] = float(covered.mean())
    return TrainState(state.step + 1, params, opt_state), None, host, timed.seconds

