"""Warm-up SFT: teach a tiny Qwen3, from scratch, to solve a synthetic task (pointer chasing).

RL needs a policy that already solves the task sometimes; a random tiny model never does.
:func:`warmup_model` trains one on the task's reference traces and caches the result as a
Hugging Face checkpoint, so every later run (calibration, RL, tests) loads it in a second.

The parts, by role: :mod:`settings` (training settings, architecture), :mod:`examples` and
:mod:`batches` (what is trained on), :mod:`curriculum` (which rows each step, learning-rate
schedules), :mod:`train_loop` (loss, step, phases), :mod:`evaluate` (greedy accuracy tables),
:mod:`cache` (cache key, shipped checkpoints, the atomic write).

The retrieval is only possible through attention: each record key is random, a hop's value
sits at a random depth of the context, and distractor keys differ from the chain's keys by
one symbol. Greedy accuracy is reported by context length (the sampler's dense decode).

A run whose settings hash to a shipped key loads the shipped checkpoint instead of training, so
every machine gets the same model; ``use_shipped=False`` retrains from the settings
(deterministic in them) into the cache.

Imports models and the other :mod:`sparrow_jax.sft` modules.
"""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Sequence

import jax
import numpy as np

from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.hf_io import load_hf
from sparrow_jax.sft.cache import (DEFAULT_CACHE_DIR, FORMAT, TOKENIZER_NAME, find_warmup, read_warmup_meta,
                                   warmup_key, write_warmup)
from sparrow_jax.sft.curriculum import continued_warmup
from sparrow_jax.sft.evaluate import accuracy_tables, check_eval_examples
from sparrow_jax.sft.examples import task_knobs
from sparrow_jax.sft.settings import WarmupSettings, warmup_architecture, warmup_settings
from sparrow_jax.sft.train_loop import LossLog, continued_phase, main_phase

if TYPE_CHECKING:
    from sparrow_jax.run.specs import ModelSpec, TaskSpec


def warmup_model(model: ModelSpec, task: TaskSpec, cache_dir: str | None = None,
                 steps: int | None = None, batch_size: int | None = None, lr: float | None = None,
                 seed: int | None = None, progress: bool = True, min_context: int | None = None,
                 eval_lengths: Sequence[int] | None = None, eval_prompts: int | None = None,
                 use_shipped: bool = True) -> str:
    """Train (or find in the cache) a tiny Qwen3 that solves the task; returns its HF directory.

    Args:
      model: the run's model spec; ``model.tiny`` is the architecture (vocab_size is
        replaced by the builtin tokenizer's). Its ``warmup`` block (fields of
        :class:`WarmupSettings` and ``cache_dir``; the config's optional ``model.warmup``)
        sets the training; the run context calls ``warmup_model(spec.model, spec.task)``,
        so that block is how a run config chooses its warm-up.
      task: the run's task spec (name, context_tokens, hops, distractor_frac, key_len).
      cache_dir: parent of the ``warmup-<hash>`` directories (default: ``model.warmup.cache_dir``
        or ``runs/cache``).
      steps, batch_size, lr, seed, min_context: override the settings (None: config / default).
      eval_lengths: context lengths of the final greedy-accuracy table (default:
        ``model.warmup.eval_lengths`` or :func:`evaluate.default_eval_lengths`); eval_prompts: held-out
        prompts per entry (default ``model.warmup.eval_prompts`` or 64). ``model.warmup.eval_hops``
        adds a table by trace length at the task's context (:func:`evaluate.accuracy_by_hops`).
      use_shipped: return a shipped checkpoint with the same settings hash (see :mod:`cache`)
        instead of training.
    A complete cached (or shipped) directory is returned at once, without training or evaluating.
    With ``refine_steps > 0`` the main phase is a warm-up of its own (the same settings with
    ``refine_steps=0``), found shipped or cached or trained first, and the refine run continues it;
    the meta file names it (``base_key``) and counts its seconds in ``train_seconds``. A slip phase
    (``slip_steps > 0``) likewise continues the warm-up of the same settings without it.
    """
    config = warmup_architecture(model)
    knobs = task_knobs(task)
    settings = warmup_settings(model, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                               min_context=min_context)
    block = model.warmup
    cache_dir = block.get("cache_dir", DEFAULT_CACHE_DIR) if cache_dir is None else cache_dir
    eval_lengths = eval_lengths if eval_lengths is not None else (list(block.get("eval_lengths", ())) or None)
    eval_prompts = int(eval_prompts if eval_prompts is not None else block.get("eval_prompts", 64))
    evals = dict(lengths=eval_lengths, hops=list(block.get("eval_hops", ())), prompts=eval_prompts)
    return _warmup(config, knobs, settings, cache_dir, evals, progress, use_shipped)


def _warmup(config: Qwen3Config, knobs: dict[str, Any], settings: WarmupSettings, cache_dir: str,
            evals: dict[str, Any], progress: bool, use_shipped: bool) -> str:
    """:func:`warmup_model` on resolved settings. With a refine phase, the main phase is its own
    warm-up (settings with ``refine_steps=0``: its own key, shipped, cached or trained here) and
    only the refine steps are trained on top of it; a slip or preamble phase continues its own base
    the same way (:func:`curriculum.continued_warmup`)."""
    key = warmup_key(config, knobs, settings)
    path = os.path.join(cache_dir, f"warmup-{key}")
    found = find_warmup(key, path, use_shipped, progress)
    if found:
        return found

    check_eval_examples(knobs, evals)
    log, base_meta = LossLog(progress), None
    continued = continued_warmup(knobs, settings)
    if continued is not None:  # a run of its own on the task's rows on top of another warm-up's model
        phase, base_knobs, base_settings = continued
        base_path = _warmup(config, base_knobs, base_settings, cache_dir, evals, progress, use_shipped)
        base_meta = read_warmup_meta(base_path)
        log.losses += [tuple(v) for v in base_meta["loss_curve"]]
        params = continued_phase(config, knobs, settings, phase, base_settings, load_hf(base_path)[1], log, progress,
                                 f"{base_path} -> {path}")
        seq_lens = base_meta["seq_lens"]
    else:
        params, seq_lens = main_phase(config, knobs, settings, log, path, progress)
    jax.block_until_ready(params)
    train_s, train_cpu_s = log.seconds()
    acc, by_hops, eval_s = accuracy_tables(config, params, knobs, evals, settings.seed, progress)

    # Seconds from scratch: the main phase's (when it was reused) plus this run's.
    before = dict(train_seconds=0.0, train_cpu_seconds=0.0) if base_meta is None else base_meta
    losses = log.losses
    meta = dict(format=FORMAT, complete=True, key=key, tokenizer=TOKENIZER_NAME, task=knobs,
                train=dataclasses.asdict(settings), seq_lens=sorted(seq_lens), num_params=config.num_params(),
                train_seconds=round(before["train_seconds"] + train_s, 1),
                train_cpu_seconds=round(before["train_cpu_seconds"] + train_cpu_s, 1), eval_seconds=round(eval_s, 1),
                final_loss=losses[-1][1] if losses else None, loss_curve=losses,
                accuracy_by_length={str(k): v for k, v in acc.items()},
                accuracy_by_hops={str(k): v for k, v in by_hops.items()},
                accuracy=acc.get(knobs["context_tokens"], float(np.mean(list(acc.values())))),
                eval_prompts=evals["prompts"])
    if base_meta is not None:
        meta.update(base_key=base_meta["key"], **{f"{continued[0]}_seconds": round(train_s, 1)},
                    base_accuracy_by_hops=base_meta.get("accuracy_by_hops", {}))
    write_warmup(path, config, params, meta)
    return path
