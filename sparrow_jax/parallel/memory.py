"""Memory planner: per-device bytes of the real train and decode steps, compiled on abstract shapes.

No weights are allocated: parameters, optimizer state, batch and KV caches are
``jax.ShapeDtypeStruct`` leaves carrying their ``NamedSharding`` on the run's mesh, and
the jitted ``train_step`` / ``decode_step`` are lowered and compiled ahead of time
(``.lower(...).compile().memory_analysis()``). The compiled figures are per device (an
SPMD program is one per-device module). Next to them, a closed-form estimate of the same
terms, so a surprise in either shows.

The compile runs on the backend at hand (fake CPU devices when planning from a laptop):
XLA:CPU fuses and schedules differently from XLA:TPU / XLA:GPU, so the temp figure is an
indication; the argument bytes (params, optimizer, caches) are exact for any backend.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sparrow_jax.models import param_shapes
from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.forward import decode_step, init_caches
from sparrow_jax.parallel.sharding import batch_shardings, cache_shardings, train_state_shardings
from sparrow_jax.rl.train_step import Batch, StepOptions, init_train_state, make_optimizer, train_step

GB = 1e9
# HBM per device (GB, vendor figures).
HBM_GB = {"h100": 80.0, "h200": 141.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0}
MODELS = {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-1.7b": "Qwen3-1.7B", "qwen3-4b": "Qwen3-4B", "qwen3-8b": "Qwen3-8B",
          "qwen3-14b": "Qwen3-14B"}


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """What a run would compile: global batch rows, lengths, and the memory-saving switches."""

    batch: int = 8  # global rows per train step / decode batch
    prompt_len: int = 256  # prompt tokens per row
    gen_len: int = 32768  # generated tokens per row
    remat: bool = True  # recompute each layer's activations in the backward pass
    micro_batches: int = 1  # gradient accumulation steps per train step
    bf16: bool = True  # bfloat16 activations and KV cache (weights and Adam moments stay float32)
    page_size: int = 16  # KV-cache page size

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len


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


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of sharded ``ShapeDtypeStruct`` / arrays (largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape)
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def compiled_bytes(compiled: Any) -> dict[str, int]:
    """Argument / output / temp bytes of a compiled program, and its peak: args + outputs - aliased + temp."""
    m = compiled.memory_analysis()
    out = dict(arguments=int(m.argument_size_in_bytes), outputs=int(m.output_size_in_bytes),
               aliased=int(m.alias_size_in_bytes), temp=int(m.temp_size_in_bytes))
    out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temp"]
    return out


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


# ---- closed-form estimate ---------------------------------------------------------------

def analytic_train(config: Qwen3Config, settings: PlanSettings, mesh_shape: dict[str, int]) -> dict[str, float]:
    """Bytes per device of a train step, from the architecture (weights split fsdp x tensor).

    activations: with remat, every layer's input [b, T, H] is kept plus one layer's working
    set during its backward pass; without remat every layer's working set is kept. A
    layer's working set counts q/k/v/o, the MLP's three [T, I] tensors, norms and residual
    (values and gradients), and one attention query chunk's f32 scores.
    """
    wbytes = 2 if settings.bf16 else 4  # activations
    split = mesh_shape["fsdp"] * mesh_shape["tensor"]
    t = mesh_shape["tensor"]
    params = config.num_params() * 4 / split  # float32 master weights
    rows = settings.batch / (mesh_shape["data"] * mesh_shape["fsdp"]) / settings.micro_batches
    tokens = rows * settings.seq_len
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    per_token = 6 * h + (2 * hq * d + 2 * hkv * d) / t + 3 * i / t  # one layer's stored activations
    layer = 2 * tokens * per_token * wbytes  # values and their gradients
    chunk_scores = rows * (hq / t) * 256 * settings.seq_len * 4 * 2  # causal_attention's chunk, fwd + bwd
    saved = config.num_hidden_layers * tokens * h * wbytes if settings.remat else config.num_hidden_layers * layer
    logits = rows * 128 * config.vocab_size / t * 4 * 3  # token_logprobs' seq_chunk of f32 logits
    hidden_out = settings.micro_batches * tokens * h * 4  # the step returns the dense hidden states
    activations = saved + layer + chunk_scores + logits + hidden_out
    # FSDP all-gathers: one layer's float32 weights, and the [V, H] unembedding with its gradient
    layer_weights = (config.num_params() - config.vocab_size * h * (1 if config.tie_word_embeddings else 2)) \
        / config.num_hidden_layers
    gathered = (layer_weights + 2 * config.vocab_size * h) * 4 / t
    out = dict(params=params, optimizer=2 * params, gradients=2 * params, activations=activations,
               gathered_weights=gathered)
    out["total"] = sum(out.values())
    return out


def analytic_decode(config: Qwen3Config, settings: PlanSettings, mesh_shape: dict[str, int]) -> dict[str, float]:
    """Bytes per device of a decode step: weights, the paged KV cache (+ f32 centroids), logits."""
    wbytes = 2 if settings.bf16 else 4  # KV cache
    params = config.num_params() * 4 / (mesh_shape["fsdp"] * mesh_shape["tensor"])
    rows = settings.batch / (mesh_shape["data"] * mesh_shape["fsdp"])
    heads = config.num_key_value_heads / mesh_shape["tensor"]
    tokens = math.ceil(settings.seq_len / settings.page_size) * settings.page_size
    kv = config.num_hidden_layers * rows * heads * config.head_dim * tokens * (2 * wbytes + 4 / settings.page_size)
    logits = rows * config.vocab_size * 4  # the step returns its rows' logits (f32)
    gathered = config.vocab_size * config.hidden_size * 4 / mesh_shape["tensor"]  # the unembedding, all-gathered
    return dict(params=params, kv_cache=kv, logits=logits, gathered_weights=gathered,
                total=params + kv + logits + gathered)


# ---- measured peak (CPU) ----------------------------------------------------------------

def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def measured_run_bytes(compiled: Any, *args: Any) -> int:
    """Resident-memory growth of this process while ``compiled(*args)`` runs (Linux, CPU backend).

    The peak RSS mark is reset (``/proc/self/clear_refs``) after the inputs are in memory, so
    compile-time peaks do not count; the result is the high-water mark minus the resident size
    before the call: the program's temp buffers and its outputs, as far as pages were touched.
    """
    jax.block_until_ready(args)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current VmRSS
    before = _status_kb("VmRSS")
    jax.block_until_ready(compiled(*args))
    return (_status_kb("VmHWM") - before) * 1024
