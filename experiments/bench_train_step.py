"""The RL train step with the reference attention vs the fast whole-sequence attention path.

    python -m experiments.bench_train_step [--lengths 1536 4096 8192] [--repeats 3]
    python -m experiments.bench_train_step --model Qwen3-1.7B --lengths 8192 32768   # one layer, bf16 (GPU)

Default: the quickstart's train step (its model, configs/quickstart.py -> long_trace: 2 layers,
both sparse, quest pages of 16, random weights) on ``rows x length`` random tokens (rows =
``--tokens_per_step // length``: 16 rows at 1.5K as in the quickstart), prompts the first 56%
of each row (888 of 1592 in the quickstart), a sparse schedule of ``--topk`` pages. One jitted
``train_step`` per side: ``reference`` (``StepOptions.attention_impl="reference"``, the chunked
XLA attention, the sparse scorer recomputing every position) and ``fast`` (``auto``: the C++
flash kernel on CPU, cuDNN on GPU, Pallas on TPU; the sparse scorer takes the prompt prefix's
keys and values from the dense pass, ``shared_prefix`` as the trainer sets it).
``--model <Qwen3 preset>``: one decoder layer of that shape in bfloat16, forward + backward of
``dense_hidden`` instead (the attention-bound part of the step at long contexts).

Both sides run once untimed (compilation), then alternate ``--repeats`` times; the median
is reported. GFLOP/s count the same useful FLOPs for both sides (:func:`step_flops`: matmuls
of the weights and of causal attention over the keys each query sees, the backward pass twice
the forward; not the work on prompt positions whose outputs no loss or statistic reads, which
the reference does and the fast side mostly skips). ``matmul_peak_gflops``: the best of a
``--peak_size``-square float32 matmul timed in the same run, before and after;
``fast_fraction_of_peak``: the fast side's median GFLOP/s over it. The peak is also timed in
every round, right after the fast side (the best of 3 matmuls): ``fast_fraction_of_peak_paired``
is the median over rounds of the fast step's GFLOP/s over the peak of its own round, which a
machine whose speed drifts within the run (other load) does not bias. The last stdout line is
JSON with both sides, their ratio per length and both fractions.
"""
from __future__ import annotations

import json
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.forward import dense_hidden
from sparrow_jax.models.qwen3 import init_params
from sparrow_jax.rl.train_step import (Batch, StepOptions, init_train_state, make_optimizer, shared_prefix_len,
                                       train_step)
from sparrow_jax.rollout import SparsitySchedule
from sparrow_jax.run.cli import parse_flags
from sparrow_jax.run.speed import alternate, seconds

SIDES = {"reference": "reference", "fast": "auto"}
PROMPT_SHARE = 888 / 1592  # the quickstart's prompt / row length


def quickstart_model() -> tuple[Qwen3Config, dict]:
    """The quickstart's model config and its schedule layout (page size, bin width, selector, dense layers)."""
    from configs.quickstart import get_config

    c = get_config()
    schedule = dict(page_size=c.schedule.page_size, bin_width=c.schedule.bin_width, selector=c.schedule.selector,
                    dense_layers=tuple(c.schedule.dense_layers))
    from sparrow_jax.models.tokenizer import BuiltinTokenizer

    return Qwen3Config(**dict(c.model.tiny, vocab_size=BuiltinTokenizer().vocab_size)), schedule  # the tokenizer's


def forward_flops(config: Qwen3Config, rows: int, length: int, keys_per_query: np.ndarray,
                  unembed: bool = True, outputs_from: int = 0, queries_from: int = 0) -> float:
    """Matmul FLOPs of one forward pass: weights (and the unembedding) per token, plus per layer
    ``4 * H * D`` per (query, key) pair; ``keys_per_query`` [L, T]: the keys each query sees.

    Only the work whose result something reads: positions below ``queries_from`` not at all
    (their keys and values are another pass's), and below ``outputs_from`` only up to the last
    layer's keys and values (no output of theirs is read: no query, MLP or unembedding there)."""
    h, hd, heads, kvh = config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads
    q_o, k_v, mlp = 2 * h * heads * hd, 2 * h * kvh * hd, 3 * h * config.intermediate_size
    layers = config.num_hidden_layers
    read = max(queries_from, outputs_from)  # the first position whose final output is read
    computed, outputs = length - queries_from, length - read
    weights = (layers - 1) * (q_o + k_v + mlp) * computed + k_v * computed + (q_o + mlp) * outputs
    weights += h * config.vocab_size * outputs if unembed else 0
    keys = np.asarray(keys_per_query, np.float64)
    pairs = float(np.sum(keys[:-1, queries_from:]) + np.sum(keys[-1, read:]))
    return rows * (2 * weights + 4 * heads * hd * pairs)


def step_flops(config: Qwen3Config, rows: int, length: int, schedule: SparsitySchedule,
               old_pass: bool = False, prompt: int = 0) -> float:
    """The train step's useful FLOPs: policy forward and backward (3x) with dense attention (plus
    the old policy's forward with ``old_pass``; the default single on-policy update reads its old
    log-probs from its own forward), the sparse scorer's forward (a query sees at most ``topk +
    reserved`` pages) and the dense logits again for the mismatch statistics. With ``prompt``
    tokens a row, positions below ``prompt - 1`` (the sampler's dense prefill) are read by no
    loss or statistic: the dense passes need only their keys and values, the sparse scorer
    nothing of them (they are the dense pass's)."""
    causal = np.arange(1, length + 1, dtype=np.float64)
    layers = config.num_hidden_layers
    first_read = max(prompt - 1, 0)
    dense = forward_flops(config, rows, length, np.broadcast_to(causal, (layers, length)), outputs_from=first_read)
    budget = (np.asarray(schedule.topk_at(np.arange(length))) + schedule.reserved) * schedule.page_size
    sparse_keys = np.stack([causal if i in schedule.dense_layers else np.minimum(causal, budget) for i in range(layers)])
    sparse = forward_flops(config, rows, length, sparse_keys, queries_from=first_read)
    logits = rows * (length - first_read) * 2 * config.hidden_size * config.vocab_size
    return (4 if old_pass else 3) * dense + sparse + logits


def matmul_peak_runner(size: int, repeats: int = 5):
    """A closure returning the best GFLOP/s of ``repeats`` ``size``-square float32 matmuls on this backend."""
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.float32)
    mm = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(mm(a, a))
    return lambda: 2 * size ** 3 / min(seconds(lambda: mm(a, a)) for _ in range(repeats)) / 1e9


def matmul_peak_gflops(size: int, repeats: int = 5) -> float:
    """Best GFLOP/s of a ``size``-square float32 matmul on this backend."""
    return matmul_peak_runner(size, repeats)()


def _train_step_runner(config, schedule, rows, length, impl, seed=0):
    """A closure timing one train step on fresh state (the step donates its input state)."""
    r = np.random.RandomState(seed)
    prompt = int(length * PROMPT_SHARE)
    batch = Batch(tokens=jnp.asarray(r.randint(0, config.vocab_size, (rows, length)), jnp.int32),
                  mask=jnp.asarray(np.broadcast_to(np.arange(length) >= prompt, (rows, length)), jnp.float32),
                  logp_sampler=jnp.asarray(-3 * r.rand(rows, length), jnp.float32),
                  advantages=jnp.asarray(r.randn(rows), jnp.float32),
                  prompt_lens=jnp.full((rows,), prompt, jnp.int32))
    optimizer = make_optimizer(1e-4)
    params = init_params(config, seed)
    opts = StepOptions(attention_impl=impl, bin_width=schedule.bin_width,
                       num_bins=max(1, -(-length // schedule.bin_width)))
    shared_prefix = shared_prefix_len(np.asarray(batch.prompt_lens), opts=opts)  # as the trainer sets it

    def run():
        state = init_train_state(jax.tree.map(jnp.copy, params), optimizer)
        jax.block_until_ready(state)
        return seconds(lambda: train_step(state, batch, config=config, optimizer=optimizer, schedule=schedule,
                                         opts=opts, shared_prefix=shared_prefix)[2])
    return run


def _layer_runner(config, rows, length, impl, seed=0):
    """A closure timing forward + backward of ``dense_hidden`` (no unembedding) on random tokens."""
    r = np.random.RandomState(seed)
    tokens = jnp.asarray(r.randint(0, config.vocab_size, (rows, length)), jnp.int32)
    params = init_params(config, seed)
    grad = jax.jit(jax.grad(lambda p: jnp.sum(dense_hidden(config, p, tokens, impl=impl).astype(jnp.float32))))
    return lambda: seconds(lambda: grad(params))


def measure(lengths, repeats: int, tokens_per_step: int, topk: int, model: str = "", layers: int = 1,
            peak_size: int = 2048) -> dict:
    """Seconds and GFLOP/s of both sides at each length; returns the summary printed as JSON."""
    peak = matmul_peak_gflops(peak_size)
    results = []
    for length in lengths:
        rows = max(1, tokens_per_step // length)
        if model:
            config = Qwen3Config.preset(model, num_hidden_layers=layers, dtype="bfloat16", param_dtype="bfloat16")
            flops = 3 * forward_flops(config, rows, length, np.broadcast_to(np.arange(1.0, length + 1),
                                                                            (layers, length)), unembed=False)
            runners = {side: _layer_runner(config, rows, length, impl) for side, impl in SIDES.items()}
        else:
            config, layout = quickstart_model()
            schedule = SparsitySchedule(topk=(topk,), **layout)
            flops = step_flops(config, rows, length, schedule, prompt=int(length * PROMPT_SHARE))
            runners = {side: _train_step_runner(config, schedule, rows, length, impl) for side, impl in SIDES.items()}
        # the peak is timed in the same rounds too, right after the fast side: this machine's speed
        # moves by 10-20% within minutes, so each fast step is also set against the peak of its moment
        times = alternate(dict(runners, peak=matmul_peak_runner(peak_size, 3)), repeats)  # untimed first calls compile
        peaks = np.asarray(times.pop("peak"))
        entry = {"length": length, "rows": rows, "gflop": flops / 1e9}
        for side, ts in times.items():
            median = float(np.median(ts))
            entry[side] = {"median_s": median, "times_s": ts, "gflops": flops / median / 1e9}
        entry["speedup"] = entry["reference"]["median_s"] / entry["fast"]["median_s"]
        entry["matmul_peak_paired_gflops"] = peaks.tolist()
        entry["fast_fraction_of_peak_paired"] = float(np.median(flops / np.asarray(times["fast"]) / 1e9 / peaks))
        entry["fast_fraction_of_peak"] = entry["fast"]["gflops"] / peak
        results.append(entry)
        print(f"T={length:6d} rows={rows:3d}: reference {entry['reference']['median_s']:8.3f} s "
              f"({entry['reference']['gflops']:6.1f} GFLOP/s), fast {entry['fast']['median_s']:8.3f} s "
              f"({entry['fast']['gflops']:6.1f} GFLOP/s), {entry['speedup']:.2f}x; fast / the peak timed beside "
              f"it {entry['fast_fraction_of_peak_paired']:.1%}", flush=True)
    peak = max(peak, matmul_peak_gflops(peak_size))  # the best of before and after (not the paired ones)
    print(f"matmul peak {peak:.1f} GFLOP/s", flush=True)
    for entry in results:
        entry["fast_fraction_of_peak"] = entry["fast"]["gflops"] / peak
    return {"backend": jax.default_backend(), "model": model or "quickstart", "matmul_peak_gflops": peak,
            "results": results}


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_multi_integer("lengths", [1536, 4096, 8192], "tokens per row (one or more)", flag_values=fv)
    flags.DEFINE_integer("repeats", 3, "timed runs per side (alternating)", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("tokens_per_step", 16 * 1536, "rows = this // length", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("topk", 32, "sparse scorer's top-k pages (quickstart budgets 16-80)", flag_values=fv)
    flags.DEFINE_string("model", "", "a Qwen3 preset (e.g. Qwen3-1.7B): time its layers instead", flag_values=fv)
    flags.DEFINE_integer("layers", 1, "layers of --model", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("peak_size", 2048, "side of the matmul timed for the peak", lower_bound=1, flag_values=fv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args, _ = parse_flags(define_flags, argv, __doc__)
    summary = measure(args.lengths, args.repeats, args.tokens_per_step, args.topk, args.model, args.layers,
                      args.peak_size)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
