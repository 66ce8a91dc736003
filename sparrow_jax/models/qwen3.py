"""Qwen3 causal LM in Flax NNX with pluggable attention.

The module tree mirrors Hugging Face names (``embed_tokens``, ``layers[i].self_attn.q_proj``,
...) so checkpoint I/O is a rename plus a transpose. Parameters travel as a **pure dict
pytree** (``params``); :func:`bind` merges them into a module inside a traced function
(split once, merge inside jit: no Python object crosses the jit boundary).

Attention is a callable passed at call time, ``attention(layer, q, k, v) -> out`` with
``q [B, T, H, D]``, ``k, v [B, T, Hkv, D]`` after q/k-norm and RoPE, so the same
parameters serve teacher-forced forward, prefill into a cache and one-token decode, dense
or block-sparse (see :mod:`sparrow_jax.models.attention_modes`). A forward that needs final
hidden states only from position S on (``outputs_from``) gives the last layer's callback query
rows of zeros below S, whose outputs it does not read (the callback may skip them).
"""
from __future__ import annotations

import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.linear import linear
from sparrow_jax.models.swiglu import swiglu

Params = dict[str, Any]


class AttentionFn(Protocol):
    def __call__(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array: ...


_init = nnx.initializers.normal(0.02)


class Linear(nnx.Module):
    """Bias-free linear layer; ``kernel`` is [in, out] (HF stores the transpose)."""

    def __init__(self, d_in: int, d_out: int, config: Qwen3Config, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_init(rngs.params(), (d_in, d_out), config.weight_dtype))
        self.dtype = config.compute_dtype

    def __call__(self, x):
        return linear(x.astype(self.dtype), self.kernel[...].astype(self.dtype))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, config: Qwen3Config):
        self.weight = nnx.Param(jnp.ones((dim,), config.weight_dtype))
        self.eps = config.rms_norm_eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * xf).astype(x.dtype)


def rotary(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) of the rotary angles, each [B, T, 1, D] for positions [B, T] (B may be 1): computed once per
    forward and shared by every layer's q and k (XLA would otherwise evaluate the transcendentals
    once per consumer: four times per layer, several percent of a tiny model's CPU decode step)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)  # the halves repeat: evaluated once, then concatenated
    return jnp.concatenate([cos, cos], -1)[:, :, None], jnp.concatenate([sin, sin], -1)[:, :, None]


def rope(x: jax.Array, cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotary embedding, HF "rotate_half" layout. x: [B, T, N, D]; cos_sin: :func:`rotary`."""
    cos, sin = cos_sin
    d = x.shape[-1]
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., d // 2:], xf[..., : d // 2]], -1)
    return (xf * cos + rotated * sin).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: Qwen3Config, rngs: nnx.Rngs):
        h, d = config.hidden_size, config.head_dim
        self.q_proj = Linear(h, config.num_attention_heads * d, config, rngs)
        self.k_proj = Linear(h, config.num_key_value_heads * d, config, rngs)
        self.v_proj = Linear(h, config.num_key_value_heads * d, config, rngs)
        self.o_proj = Linear(config.num_attention_heads * d, h, config, rngs)
        self.q_norm = RMSNorm(d, config)
        self.k_norm = RMSNorm(d, config)
        self.config = config

    def __call__(self, layer: int, x, cos_sin, attention: AttentionFn, outputs_from: int = 0):
        """x [B, T, hidden] -> [B, T - outputs_from, hidden] (positions outputs_from..; every key)."""
        c = self.config
        b, t, _ = x.shape
        s = outputs_from
        q = self.q_norm(self.q_proj(x[:, s:]).reshape(b, t - s, c.num_attention_heads, c.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim))
        v = self.v_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim)
        q, k = rope(q, tuple(a[:, s:] for a in cos_sin)), rope(k, cos_sin)
        if s:  # query rows below s: zeros, outputs not read
            q = jnp.pad(q, ((0, 0), (s, 0), (0, 0), (0, 0)))
        out = attention(layer, q, k, v)[:, s:]
        return self.o_proj(out.reshape(b, t - s, -1))


class MLP(nnx.Module):
    def __init__(self, config: Qwen3Config, rngs: nnx.Rngs):
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(h, i, config, rngs)
        self.up_proj = Linear(h, i, config, rngs)
        self.down_proj = Linear(i, h, config, rngs)

    def __call__(self, x):
        dtype = self.down_proj.dtype
        weight = lambda linear: linear.kernel[...].astype(dtype)
        return swiglu(x.astype(dtype), weight(self.gate_proj), weight(self.up_proj), weight(self.down_proj))


class DecoderLayer(nnx.Module):
    def __init__(self, config: Qwen3Config, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config)
        self.self_attn = Attention(config, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config)
        self.mlp = MLP(config, rngs)

    def __call__(self, layer, x, cos_sin, attention, outputs_from: int = 0):
        """x [B, T, hidden] -> [B, T - outputs_from, hidden]: positions outputs_from.. only."""
        x = x[:, outputs_from:] + self.self_attn(layer, self.input_layernorm(x), cos_sin, attention, outputs_from)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3(nnx.Module):
    """Qwen3ForCausalLM. ``__call__`` returns final hidden states; :meth:`logits` unembeds."""

    def __init__(self, config: Qwen3Config, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = nnx.Param(_init(rngs.params(), (config.vocab_size, config.hidden_size),
                                            config.weight_dtype))
        self.layers = nnx.List([DecoderLayer(config, rngs) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, config, rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array, attention: AttentionFn,
                 remat: bool = False, outputs_from: int = 0) -> jax.Array:
        """tokens int32 [B, T], positions int32 [B or 1, T] -> final-norm hidden states [B, T - outputs_from, hidden]
        of positions outputs_from.. (the last layer computes only those; every earlier one all)."""
        x = self.embed_tokens[...].astype(self.config.compute_dtype)[tokens]
        cos_sin = rotary(positions, self.config.head_dim, self.config.rope_theta)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            s = outputs_from if i == last else 0
            if remat:  # recompute activations in the backward pass: long sequences fit
                x = jax.checkpoint(lambda x_, r_, l_=layer, i_=i, s_=s: l_(i_, x_, r_, attention, s_))(x, cos_sin)
            else:
                x = layer(i, x, cos_sin, attention, s)
        return self.norm(x)

    def unembedding(self) -> jax.Array:
        """[hidden, V] matrix mapping final hidden states to logits."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens[...].T
        return self.lm_head.kernel[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., hidden] -> float32 logits [..., V]."""
        w = self.unembedding()
        return jnp.dot(hidden.astype(self.config.compute_dtype), w.astype(self.config.compute_dtype),
                       preferred_element_type=jnp.float32)


@functools.lru_cache(maxsize=32)
def _graph(config: Qwen3Config):
    abstract = nnx.eval_shape(lambda: Qwen3(config, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    return graphdef, state


def init_params(config: Qwen3Config, seed: int = 0) -> Params:
    """Randomly initialised parameters (normal(0.02) weights, unit norms) as a pure dict."""
    model = Qwen3(config, nnx.Rngs(seed))
    return nnx.to_pure_dict(nnx.state(model))


def param_shapes(config: Qwen3Config) -> Params:
    """Pure dict of jax.ShapeDtypeStruct describing every parameter."""
    _, state = _graph(config)
    return nnx.to_pure_dict(state)


def bind(config: Qwen3Config, params: Params) -> Qwen3:
    """Merge a params pytree into a Qwen3 module (cheap; meant to run inside jit)."""
    graphdef, abstract = _graph(config)
    state = jax.tree.map(lambda x: x, abstract)  # fresh copy: replace_by_pure_dict mutates
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
