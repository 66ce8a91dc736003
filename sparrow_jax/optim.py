"""The optimiser chain the RL step and the warm-up SFT share: global-norm clipping, then Adam(W).

A utility leaf: imports optax only, so every layer may import it.
"""
from __future__ import annotations

import optax


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
