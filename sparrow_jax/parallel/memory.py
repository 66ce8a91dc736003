"""Memory planning: per-device bytes of compiled programs, a closed-form estimate, a measured peak.

``sparrow_jax.rl.memory_plan`` compiles the real train and decode steps ahead of time on
abstract sharded inputs (no weights) and reads their ``memory_analysis()`` with
:func:`compiled_bytes`; the estimate here (:func:`analytic_train`, :func:`analytic_decode`)
is the same bill in closed form, so a surprise in either shows; on CPU,
:func:`measured_run_bytes` checks a compiled figure against the process's resident peak.

The compile runs on the backend at hand (fake CPU devices when planning from a laptop):
XLA:CPU fuses and schedules differently from XLA:TPU / XLA:GPU, so the temp figure is an
indication; the argument bytes (params, optimizer, caches) are exact for any backend.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

GB = 1e9
# HBM per device (GB, vendor figures).
HBM_GB = {"h100": 80.0, "h200": 141.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0}


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


# ---- closed-form estimate ---------------------------------------------------------------

def analytic_train(config: Any, settings: PlanSettings, mesh_shape: dict[str, int]) -> dict[str, float]:
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


def analytic_decode(config: Any, settings: PlanSettings, mesh_shape: dict[str, int]) -> dict[str, float]:
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
