"""Warm-up SFT of the tiny model: ``python -m experiments.warmup --config configs/quickstart.py``.

Trains (or finds in the cache) the tiny Qwen3 of ``model.tiny`` on the task's reference
traces (settings: the optional ``model.warmup`` block, see
:func:`sparrow_jax.sft.warmup.warmup_model`), then prints the checkpoint directory, the
greedy accuracy by context length and, with ``--sparse_check``, the greedy accuracy of
sparse actors (fixed top-k from ``calibration.budgets``, the config's page size and dense
layers) at the task's context: a too-sparse actor must fail. The last stdout line is JSON.
"""
from __future__ import annotations

import json

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "run config file (configs/*.py)", lock_config=True)
_SPARSE_CHECK = flags.DEFINE_bool("sparse_check", True, "also measure sparse actors' accuracy per top-k budget")


def main(argv):
    del argv
    from sparrow_jax.sft import warmup as W  # deferred: keeps --help fast

    cfg = _CONFIG.value
    path = W.warmup_model(cfg.model, cfg.task)
    meta = W.read_warmup_meta(path)
    print(f"checkpoint: {path}")
    print(f"greedy accuracy by context length ({meta['eval_prompts']} held-out prompts each, "
          f"{meta['task']['hops']} hops; trained on contexts <= {meta['train']['max_train_context']}):")
    print("  context  accuracy")
    for length, acc in meta["accuracy_by_length"].items():
        print(f"  {int(length):>7d}  {acc:.3f}")
    print(f"training: {meta['train']['steps']} steps, {meta['train_seconds']}s wall, "
          f"{meta['train_cpu_seconds']}s CPU, final reference NLL {meta['final_loss']}")
    summary = dict(path=path, accuracy_by_length=meta["accuracy_by_length"], accuracy=meta["accuracy"],
                   train_seconds=meta["train_seconds"], train_cpu_seconds=meta["train_cpu_seconds"])
    if _SPARSE_CHECK.value:
        from sparrow_jax.models import load_hf
        from sparrow_jax.rollout import SparsitySchedule

        s = cfg.schedule
        config, params = load_hf(path)
        knobs, ctx = meta["task"], int(meta["task"]["context_tokens"])
        sparse = {}
        for k in cfg.calibration.budgets:
            sched = SparsitySchedule.fixed(int(k), page_size=s.page_size, bin_width=s.bin_width,
                                           reserved_first=s.reserved_first, reserved_last=s.reserved_last,
                                           dense_layers=tuple(s.dense_layers), selector=s.selector)
            sparse[str(k)] = W.accuracy_by_length(config, params, knobs, [ctx], schedule=sched)[ctx]
        print(f"sparse actor accuracy at context {ctx} by top-k pages of {s.page_size} "
              f"(+{s.reserved_first + s.reserved_last} reserved; dense layers {list(s.dense_layers)}); "
              f"dense {meta['accuracy_by_length'].get(str(ctx))}:")
        for k, acc in sparse.items():
            print(f"  top-k {int(k):>3d} ({(int(k) + s.reserved_first + s.reserved_last) * s.page_size:>4d} tokens)  "
                  f"{acc:.3f}")
        summary["sparse_accuracy_by_topk"] = sparse
    print(json.dumps(summary))


if __name__ == "__main__":
    app.run(main)
