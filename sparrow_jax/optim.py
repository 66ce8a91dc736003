"""The optimiser chain the RL step and the warm-up SFT share: global-norm clipping, then Adam(W);
and the transforms that freeze parameters by name or scale their rate.

A utility leaf: imports jax and optax only, so every layer may import it.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax


def param_name(path) -> str:
    """A pytree key path as a dotted name: ``layers.0.self_attn.q_proj.kernel``."""
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def names_matching(tree, pattern: str) -> tuple[list[str], list[str]]:
    """(the dotted names of ``tree``'s leaves that ``re.search``-match ``pattern``, every leaf's name)."""
    names = [param_name(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    regex = re.compile(pattern)
    return [n for n in names if regex.search(n)], names


def _map_matching(pattern: str, fn) -> optax.GradientTransformation:
    """A stateless transform applying ``fn`` to the update of every parameter whose dotted name
    (:func:`param_name`) ``re.search``-matches ``pattern``; the others pass unchanged."""
    regex = re.compile(pattern)

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(
            lambda path, u: fn(u) if regex.search(param_name(path)) else u, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def zero_matching(pattern: str) -> optax.GradientTransformation:
    """Zero the gradient of every parameter whose dotted name ``re.search``-matches ``pattern``:
    placed before Adam, those parameters never move (Adam's moments of them stay 0, and
    0 / (sqrt(0) + eps) = 0) and global-norm clipping sees only the others."""
    return _map_matching(pattern, jnp.zeros_like)


def scale_matching(pattern: str, factor: float) -> optax.GradientTransformation:
    """Multiply the update of every parameter whose dotted name ``re.search``-matches ``pattern`` by
    ``factor``: placed after Adam, those parameters move at ``factor`` times the rate."""
    return _map_matching(pattern, lambda u: u * factor)


def clipped_adam(learning_rate: optax.ScalarOrSchedule, max_grad_norm: float, weight_decay: float | None = None,
                 b2: float = 0.999) -> optax.GradientTransformation:
    """Clip the global gradient norm to ``max_grad_norm`` (no clipping when <= 0), then Adam
    (``weight_decay`` None) or AdamW with that decay; ``b1`` 0.9, ``b2`` as given.

    Adam and AdamW at decay 0 update alike but hold different states, so a caller keeps the one
    its checkpoints were written with."""
    chain = [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm > 0 else []
    if weight_decay is None:
        return optax.chain(*chain, optax.adam(learning_rate, b1=0.9, b2=b2))
    return optax.chain(*chain, optax.adamw(learning_rate, b1=0.9, b2=b2, weight_decay=weight_decay))
