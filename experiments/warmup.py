"""Warm-up SFT of the tiny model: ``python -m experiments.warmup --config configs/quickstart.py``.

Trains (or finds shipped or in the cache; ``--noshipped`` retrains a shipped one) the tiny
Qwen3 of ``model.tiny`` on the task's reference traces (settings: the optional ``model.warmup`` block, see
:func:`sparrow_jax.sft.warmup.warmup_model`), then prints the checkpoint directory, the
greedy accuracy by context length (and by trace length with ``model.warmup.eval_hops``) and,
with ``--sparse_check``, the greedy accuracy of
sparse actors (fixed top-k from ``calibration.budgets``, the config's page size and dense
layers) at the task's context: a too-sparse actor must fail. The last stdout line is JSON.
"""
from __future__ import annotations

import json

from absl import flags

from sparrow_jax.run.cli import config_main, define_config_flag

def main(spec, sparse_check: bool = True, shipped: bool = True) -> None:
    import dataclasses

    from sparrow_jax.run.context import build_run_context, schedule_layout  # deferred: keeps --help fast
    from sparrow_jax.sft.cache import read_warmup_meta
    from sparrow_jax.sft.evaluate import accuracy_by_length
    from sparrow_jax.sft.warmup import warmup_model

    spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, source="warmup"))
    # Train (or find shipped / cached) first, so --noshipped retrains even when a checkpoint ships.
    path = warmup_model(spec.model, spec.task, use_shipped=shipped)
    ctx = build_run_context(spec, schedule=None)  # the run's model (for the sparse check)
    meta = read_warmup_meta(path)
    print(f"checkpoint: {path}")
    length = f"{meta['task']['hops']} hops" if "hops" in meta["task"] else f"{meta['task']['min_lines']} lines"
    print(f"greedy accuracy by context length ({meta['eval_prompts']} held-out prompts each, "
          f"{length}; trained on contexts <= {meta['train']['max_train_context']}):")
    print("  context  accuracy")
    for length, acc in meta["accuracy_by_length"].items():
        print(f"  {int(length):>7d}  {acc:.3f}")
    if meta.get("accuracy_by_hops"):
        print(f"greedy dense reward and share solved by trace length (hops; recurrence_trace: lines), context "
              f"{meta['task']['context_tokens']}:")
        print("     hops  reward  solved")
        for hops, v in meta["accuracy_by_hops"].items():
            print(f"  {int(hops):>7d}  {v['reward']:.3f}   {v['solved']:.3f}")
    later = "".join(f" + {meta['train'][f'{p}_steps']} {p} steps"
                    + (f" ({meta[f'{p}_seconds']}s wall)" if f"{p}_seconds" in meta else "")
                    for p in ("refine", "preamble") if meta["train"].get(f"{p}_steps"))
    print(f"training: {meta['train']['steps']} steps{later}, {meta['train_seconds']}s wall, "
          f"{meta['train_cpu_seconds']}s CPU, final reference NLL {meta['final_loss']}")
    summary = dict(path=path, accuracy_by_length=meta["accuracy_by_length"], accuracy=meta["accuracy"],
                   accuracy_by_hops=meta.get("accuracy_by_hops", {}),
                   train_seconds=meta["train_seconds"], train_cpu_seconds=meta["train_cpu_seconds"])
    if sparse_check:
        s = spec.schedule
        knobs, context = meta["task"], int(meta["task"]["context_tokens"])
        sparse = {}
        for k in spec.calibration.budgets:
            sched = schedule_layout(s, int(k))
            sparse[str(k)] = accuracy_by_length(ctx.model_config, ctx.params, knobs, [context],
                                                schedule=sched)[context]
        print(f"sparse actor accuracy at context {context} by top-k pages of {s.page_size} "
              f"(+{s.reserved_first + s.reserved_last} reserved; dense layers {list(s.dense_layers)}); "
              f"dense {meta['accuracy_by_length'].get(str(context))}:")
        for k, acc in sparse.items():
            print(f"  top-k {int(k):>3d} ({(int(k) + s.reserved_first + s.reserved_last) * s.page_size:>4d} tokens)  "
                  f"{acc:.3f}")
        summary["sparse_accuracy_by_topk"] = sparse
    print(json.dumps(summary))


def _cli() -> None:
    # flags defined at the start, not at import (define_config_flag says why)
    config = define_config_flag()
    sparse_check = flags.DEFINE_bool("sparse_check", True, "also measure sparse actors' accuracy per top-k budget")
    shipped = flags.DEFINE_bool("shipped", True, "use a shipped checkpoint trained with the same settings "
                                "(--noshipped: train from scratch into the cache, e.g. to reproduce it)")
    config_main(config, lambda spec: main(spec, sparse_check.value, shipped.value))


if __name__ == "__main__":
    _cli()
