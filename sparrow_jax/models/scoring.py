"""Teacher-forced per-token scoring helpers: sequence chunking and next-token log-probs.

Index convention (same as :class:`sparrow_jax.rollout.Rollout`): the statistic stored at
``[b, t]`` concerns the distribution that produced ``tokens[b, t]``, i.e. the model's
output at position ``t - 1``; index 0 holds zeros.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def shift_to_next_token(x: jax.Array) -> jax.Array:
    """Stats of positions 0..T-2 -> stored at 1..T-1 (index 0 gets 0)."""
    return jnp.pad(x, [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2))


def chunked_over_sequence(fn, *arrays, seq_chunk: int):
    """Apply ``fn`` to [B, c, ...] slices of [B, T, ...] arrays; concatenate along T."""
    t = arrays[0].shape[1]
    c = min(seq_chunk, t)
    pad = (-t) % c
    padded = [jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in arrays]
    n = (t + pad) // c
    split = [a.reshape(a.shape[0], n, c, *a.shape[2:]).swapaxes(0, 1) for a in padded]
    out = jax.lax.map(lambda xs: fn(*xs), tuple(split))
    return jax.tree.map(lambda o: o.swapaxes(0, 1).reshape(o.shape[1], n * c, *o.shape[3:])[:, :t], out)


def token_logprobs(hidden: jax.Array, unembed: jax.Array, tokens: jax.Array, temperature: float = 1.0,
                   seq_chunk: int = 128):
    """Differentiable log-prob and entropy of each next token. -> (logp [B, T], entropy [B, T]).

    hidden [B, T, H] final hidden states, unembed [H, V], tokens int32 [B, T]. Output at
    ``t`` is about ``tokens[:, t]`` given ``tokens[:, :t]``; index 0 is 0. Logits exist
    one sequence chunk at a time ([B, seq_chunk, V]), rematerialised in the backward pass.
    """
    @jax.checkpoint
    def chunk(h, tok):
        logits = jnp.dot(h, unembed.astype(h.dtype), preferred_element_type=jnp.float32) / temperature
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        logp = jnp.take_along_axis(logp_all, tok[..., None], -1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
        return logp, entropy

    logp, ent = chunked_over_sequence(chunk, hidden[:, :-1], tokens[:, 1:], seq_chunk=seq_chunk)
    return shift_to_next_token(logp), shift_to_next_token(ent)
