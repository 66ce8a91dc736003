"""The real train and decode steps compiled ahead of time on abstract inputs, for memory planning.

No weights are allocated: parameters, optimizer state, batch and KV caches are
``jax.ShapeDtypeStruct`` leaves carrying their ``NamedSharding`` on the run's mesh, and
the jitted ``train_step`` / ``decode_step`` are lowered and compiled
(``.lower(...).compile()``); ``sparrow_jax.parallel.memory`` reads and estimates the bytes.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from sparrow_jax.models import param_shapes
from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.forward import decode_step, init_caches
from sparrow_jax.parallel.memory import PlanSettings
from sparrow_jax.parallel.sharding import batch_shardings, cache_shardings, train_state_shardings
from sparrow_jax.rl.train_step import Batch, StepOptions, init_train_state, make_optimizer, train_step

MODELS = {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-1.7b": "Qwen3-1.7B", "qwen3-4b": "Qwen3-4B", "qwen3-8b": "Qwen3-8B",
          "qwen3-14b": "Qwen3-14B"}


def model_config(name: str, bf16: bool, num_layers: Optional[int] = None) -> Qwen3Config:
    """The Qwen3 preset ``name`` (e.g. 'qwen3-4b'), bf16 or f32 compute, optionally with fewer layers.

    Weights stay float32 (master weights; ``train_step`` accumulates float32 gradients in a
    carry typed like the params, so bfloat16 params do not compile)."""
    key = name.lower()
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
    dtype = "bfloat16" if bf16 else "float32"
    config = Qwen3Config.preset(MODELS[key], dtype=dtype, param_dtype="float32")
    return config if num_layers is None else config.replace(num_hidden_layers=num_layers)


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _step_options(settings: PlanSettings) -> StepOptions:
    return StepOptions(remat=settings.remat, micro_batches=settings.micro_batches)


def abstract_train_inputs(config: Qwen3Config, settings: PlanSettings, mesh: Mesh):
    """(state, batch) as sharded ShapeDtypeStructs: what the trainer passes to ``train_step``."""
    optimizer = make_optimizer(1e-6)
    state = jax.eval_shape(lambda p: init_train_state(p, optimizer), param_shapes(config))
    state = _abstract(state, train_state_shardings(state, mesh, config))
    b, t = settings.batch, settings.seq_len
    batch = Batch(jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((b, t), jnp.float32),
                  jax.ShapeDtypeStruct((b, t), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.float32),
                  jax.ShapeDtypeStruct((b,), jnp.int32))
    return state, _abstract(batch, batch_shardings(batch, mesh)), optimizer


def compile_train_step(config: Qwen3Config, settings: PlanSettings, mesh: Mesh):
    """The trainer's ``train_step`` (dense-rollout update) compiled for the abstract inputs."""
    state, batch, optimizer = abstract_train_inputs(config, settings, mesh)
    with jax.set_mesh(mesh):
        lowered = train_step.lower(state, batch, config=config, optimizer=optimizer, opts=_step_options(settings))
    return lowered.compile(), state


def abstract_decode_inputs(config: Qwen3Config, settings: PlanSettings, mesh: Mesh):
    """(params, tokens, positions, caches) for one decode step at the full length, sharded."""
    params = _abstract(param_shapes(config), train_state_shardings(
        jax.eval_shape(lambda p: init_train_state(p, make_optimizer(1e-6)), param_shapes(config)),
        mesh, config).params)
    caches = jax.eval_shape(lambda: init_caches(config, settings.batch, settings.seq_len, settings.page_size))
    caches = _abstract(caches, cache_shardings(caches, mesh))
    rows = jax.ShapeDtypeStruct((settings.batch,), jnp.int32)
    rows = _abstract(rows, batch_shardings(rows, mesh))
    return params, rows, caches


def compile_decode_step(config: Qwen3Config, settings: PlanSettings, mesh: Mesh):
    """One dense decode step (the sparse step keeps the same full cache) compiled for the inputs."""
    params, rows, caches = abstract_decode_inputs(config, settings, mesh)
    step = jax.jit(decode_step, static_argnums=(0,), donate_argnums=(4,))
    with jax.set_mesh(mesh):
        lowered = step.lower(config, params, rows, rows, caches)
    return lowered.compile(), params, caches
