"""Where one decode step's time goes: cache append, attention, page selection, the whole step.

Run: ``python -m experiments.bench_decode_parts [--batch 4 --context 8192 --hlo_dir DIR]``

Uses the rollout benchmark's model (:data:`experiments.bench_rollout.BENCH_MODEL`) and full
random caches of ``--context`` tokens per row, then times, per decode step over all layers:

* ``append``: :func:`append_token` into every layer's cache (caches donated, as in the loop);
* ``dense_attention`` / ``sparse_attention``: :func:`dense_decode` / score + select +
  :func:`sparse_decode` on every layer's cache;
* ``select``: score + select alone;
* ``step_dense`` / ``step_sparse``: one jitted :func:`decode_step` (caches donated);
* ``loop_dense`` / ``loop_sparse``: the sampler's jitted while loop, per step;
* ``generate_dense`` / ``generate_sparse``: :func:`generate` (decode time only), per step.

Every part but ``generate_*`` runs twice untimed, then the parts alternate ``--repeats`` times
(:func:`sparrow_jax.run.speed.alternate`); each figure is its median. ``generate_*``: one
timed run each after an untimed one.

``--hlo_dir`` writes the optimised HLO of the jitted steps and loops (look for ``copy`` of the cache
to find accidental whole-cache copies). The last stdout line is JSON (milliseconds per step).
"""
from __future__ import annotations

import functools
import json
import os
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments.bench_rollout import BENCH_MODEL
from sparrow_jax.attention import (PagedKVCache, append_token, dense_decode, group_mean_query, page_metadata,
                                   score_pages, select_pages, sparse_decode)
from sparrow_jax.models import decode_step, init_params
from sparrow_jax.rollout import SamplingParams, SparsitySchedule, generate
from sparrow_jax.rollout.sampler import _decode_segment, _LoopState
from sparrow_jax.run.cli import parse_flags
from sparrow_jax.run.speed import alternate, seconds


def full_caches(batch: int, context: int, page_size: int, seed: int = 0) -> tuple:
    """One random, completely filled cache per layer of BENCH_MODEL (with exact centroids)."""
    cfg = BENCH_MODEL
    pages = -(-(context + 1) // page_size)
    shape = (batch, cfg.num_key_value_heads, pages, page_size, cfg.head_dim)
    caches = []
    for layer in range(cfg.num_hidden_layers):
        kk, kv = jax.random.split(jax.random.PRNGKey(seed + layer))
        k = jax.random.normal(kk, shape, jnp.float32)
        centroid, _, _ = page_metadata(k, jnp.full((batch,), context, jnp.int32), with_minmax=False)
        caches.append(PagedKVCache(k=k, v=jax.random.normal(kv, shape, jnp.float32), centroid=centroid))
    return tuple(caches)


def call_timer(fn: Callable, make_args: Callable[[], tuple]) -> Callable[[], float]:
    """A run for :func:`alternate`: seconds of ``fn(*make_args())``, the arguments made (anew: the
    call may donate them) and ready before the clock starts."""
    def run() -> float:
        args = make_args()
        jax.block_until_ready(args)
        return seconds(lambda: fn(*args))
    return run


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("batch", 4, "rows", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("context", 8192, "tokens already in every row's cache", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("budget_tokens", 1024, "sparse KV budget incl. reserved pages", flag_values=fv)
    flags.DEFINE_integer("page_size", 16, "tokens per page", lower_bound=1, flag_values=fv)
    flags.DEFINE_string("impl", "auto", "attention implementation", flag_values=fv)
    flags.DEFINE_integer("repeats", 10, "timed calls per part (alternating)", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("loop_steps", 32, "decode steps per timed loop / generate call", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_string("hlo_dir", None, "write the optimised HLO of the jitted steps here", flag_values=fv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args, _ = parse_flags(define_flags, argv, __doc__)
    cfg = BENCH_MODEL
    params = init_params(cfg, seed=0)
    schedule = SparsitySchedule.from_budget_tokens(args.budget_tokens, page_size=args.page_size, dense_layers=())
    k_max = int(schedule.topk[-1])
    b = args.batch
    positions = jnp.full((b,), args.context, jnp.int32)  # the next token goes right after the context
    budget = jnp.full((b,), k_max, jnp.int32)
    caches = full_caches(b, args.context, args.page_size)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, cfg.num_attention_heads, cfg.head_dim), np.float32))
    kv1 = jnp.asarray(rng.standard_normal((b, cfg.num_key_value_heads, cfg.head_dim), np.float32))
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, b), jnp.int32)
    fresh = lambda: jax.tree.map(jnp.copy, caches)  # noqa: E731  (donated inputs need new buffers)

    def select(cache):
        scores = score_pages(group_mean_query(q, cfg.num_key_value_heads), cache.centroid)
        return select_pages(scores, positions[:, None], budget[:, None], k_max, args.page_size,
                            schedule.reserved_first, schedule.reserved_last)

    # Each part: (jitted fn, its arguments' maker, decode steps per call).
    parts = {
        "append": (jax.jit(lambda cs: [append_token(c, kv1, kv1, positions) for c in cs], donate_argnums=0),
                   lambda: (fresh(),), 1),
        "dense_attention": (jax.jit(lambda cs: [dense_decode(q, c.k, c.v, positions) for c in cs]),
                            lambda: (caches,), 1),
        "select": (jax.jit(lambda cs: [select(c) for c in cs]), lambda: (caches,), 1),
        "sparse_attention": (jax.jit(lambda cs: [sparse_decode(q, c.k, c.v, *select(c), positions, impl=args.impl)
                                                 for c in cs]), lambda: (caches,), 1),
    }
    for name, sched in (("step_dense", None), ("step_sparse", schedule)):
        step = jax.jit(lambda p, cs, s=sched: decode_step(cfg, p, tokens, positions, cs, schedule=s, k_max=k_max,
                                                          budget=budget if s else None, impl=args.impl),
                       donate_argnums=1)
        parts[name] = (step, lambda: (params, fresh()), 1)

    # The sampler's jitted while loop, ``--loop_steps`` steps per call.
    sampling = SamplingParams(max_new_tokens=10 ** 6, temperature=0.0)
    buf = caches[0].k.shape[2] * args.page_size

    def make_state():
        return (_LoopState(step=jnp.zeros((), jnp.int32), tokens=jnp.zeros((b, buf), jnp.int32),
                           logprobs=jnp.zeros((b, buf), jnp.float32), pos=positions - args.loop_steps,
                           done=jnp.zeros((b,), bool), key=jax.random.PRNGKey(0), caches=fresh()),)

    for name, sched in (("loop_dense", None), ("loop_sparse", schedule)):
        loop = functools.partial(
            _decode_segment, params=params, step_limit=jnp.int32(args.loop_steps), max_pos=jnp.int32(buf - 1),
            end_pos=jnp.full((b,), buf - 1, jnp.int32), config=cfg, schedule=sched, k_max=k_max, impl=args.impl,
            sampling=sampling)
        parts[name] = (loop, make_state, args.loop_steps)

    times = alternate({name: call_timer(fn, make) for name, (fn, make, _) in parts.items()}, args.repeats,
                      warmup=2)
    result = {name: round(float(np.median(times[name])) * 1e3 / per_call, 4)
              for name, (_, _, per_call) in parts.items()}

    # The sampler end to end (prefill excluded): what bench_rollout measures.
    prompts = [list(rng.integers(3, cfg.vocab_size, args.context)) for _ in range(b)]
    gen = SamplingParams(max_new_tokens=args.loop_steps, temperature=0.0)
    runs = {name: functools.partial(generate, cfg, params, prompts, jax.random.PRNGKey(0), gen, schedule=sched,
                                    impl=args.impl)
            for name, sched in (("generate_dense", None), ("generate_sparse", schedule))}
    for name, (out,) in alternate(runs, repeats=1).items():  # the untimed first call compiles
        result[name] = round(out.stats["decode_s"] * 1e3 / out.stats["decode_steps"], 4)
        result[name + "_compiles"] = out.stats["compiles"]

    if args.hlo_dir:
        write_hlo(args.hlo_dir, {name: fn for name, (fn, _, _) in parts.items() if name.startswith(("step", "loop"))},
                  make_state, params, caches)
    kv_bytes = sum(c.k.nbytes + c.v.nbytes for c in caches)
    summary = {"ms_per_step": result, "kv_bytes_per_step_dense": kv_bytes,
               "dense_attention_GBps": round(kv_bytes / result["dense_attention"] / 1e6, 1),
               "setup": dict(batch=b, context=args.context, budget_tokens=args.budget_tokens, k_max=k_max,
                             backend=jax.default_backend(), impl=args.impl)}
    print(json.dumps(summary))
    return summary


def write_hlo(hlo_dir: str, steps: dict[str, Callable], make_state: Callable, params, caches) -> None:
    """The optimised HLO of each jitted step (``step_*``) and decode loop (``loop_*``) as ``<name>.hlo.txt``."""
    os.makedirs(hlo_dir, exist_ok=True)
    for name, fn in steps.items():
        if name.startswith("loop"):
            lowered = _decode_segment.lower(*make_state(), **fn.keywords)
        else:
            lowered = fn.lower(params, caches)
        with open(os.path.join(hlo_dir, f"{name}.hlo.txt"), "w") as f:
            f.write(lowered.compile().as_text())


if __name__ == "__main__":
    main()
