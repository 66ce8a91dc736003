"""Greedy evaluation of a warm-up model on held-out task prompts: reward per example, accuracy
by context length and by trace length (the sampler's dense decode, or a sparse actor with a
schedule).

Imports data, models, rollout, :mod:`examples` and :mod:`recurrence_rows`.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import numpy as np

from sparrow_jax.data.registry import get_task
from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.qwen3 import Params
from sparrow_jax.models.tokenizer import BuiltinTokenizer
from sparrow_jax.rollout.sampler import SamplingParams, generate
from sparrow_jax.sft import recurrence_rows
from sparrow_jax.sft.examples import EVAL_STREAM, generate_examples, max_reference_tokens, prompt_ids


def greedy_rewards(config: Qwen3Config, params: Params, examples: Sequence[dict[str, Any]],
                   task_name: str, tokenizer, max_new_tokens: int, batch_size: int = 32,
                   schedule=None) -> np.ndarray:
    """Task reward of each example's greedy completion, float [n] (dense, or sparse with ``schedule``)."""
    task = get_task(task_name)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=tokenizer.stop_ids)
    rewards = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        prompts = [prompt_ids(ex, task_name, tokenizer) for ex in chunk]
        out = generate(config, params, prompts, jax.random.PRNGKey(0), sampling, schedule=schedule,
                       pad_id=tokenizer.pad_id)
        for b, ex in enumerate(chunk):
            text = tokenizer.decode(out.tokens[b, out.prompt_lens[b]:out.lengths[b]])
            rewards.append(task.reward(text, ex))
    return np.asarray(rewards, np.float64)


def greedy_accuracy(config: Qwen3Config, params: Params, examples: Sequence[dict[str, Any]],
                    task_name: str, tokenizer, max_new_tokens: int, batch_size: int = 32,
                    schedule=None) -> float:
    """Mean task reward of greedy completions (pointer_chase: the share answered exactly)."""
    return float(np.mean(greedy_rewards(config, params, examples, task_name, tokenizer, max_new_tokens,
                                        batch_size, schedule)))


def default_eval_lengths(context_tokens: int) -> list[int]:
    """Quarter, half, full context, and twice it (length extrapolation)."""
    return sorted({max(32, context_tokens // 4), max(32, context_tokens // 2), context_tokens, 2 * context_tokens})


def eval_new_tokens(knobs: dict[str, Any], examples: Sequence[dict[str, Any]], hops: int | None = None) -> int:
    """Generation budget of an evaluation: the longest reference + <eos> + 4 (recurrence_trace's
    traces vary in length, so its examples' own; the pointer tasks' is fixed by ``hops``)."""
    if knobs["name"] == recurrence_rows.NAME:
        return max(len(BuiltinTokenizer().encode(ex["reference"])) for ex in examples) + 5
    return max_reference_tokens(knobs, hops) + 4


def accuracy_by_length(config: Qwen3Config, params: Params, knobs: dict[str, Any], lengths: Sequence[int],
                       num_prompts: int = 64, seed: int = 0, schedule=None) -> dict[int, float]:
    """Greedy accuracy on held-out prompts at ``knobs['hops']`` hops, per context length
    (dense, or a sparse actor with ``schedule``)."""
    tok = BuiltinTokenizer()
    out = {}
    for length in lengths:
        examples = generate_examples(knobs, num_prompts, seed=int(EVAL_STREAM + 7919 * seed + int(length)),
                                     context_tokens=int(length))
        out[int(length)] = greedy_accuracy(config, params, examples, knobs["name"], tok,
                                           max_new_tokens=eval_new_tokens(knobs, examples), schedule=schedule)
    return out


def accuracy_by_hops(config: Qwen3Config, params: Params, knobs: dict[str, Any], hops: Sequence[int],
                     num_prompts: int = 32, seed: int = 0) -> dict[int, dict[str, float]]:
    """Greedy dense quality at the task's context per trace length (hops): ``reward`` (mean task
    reward, partial credit for pointer_trace) and ``solved`` (share with reward 1)."""
    tok = BuiltinTokenizer()
    out = {}
    for h in hops:
        examples = generate_examples(knobs, num_prompts, seed=int(EVAL_STREAM + 7919 * seed + 104_729 * int(h)),
                                     hops=int(h))
        r = greedy_rewards(config, params, examples, knobs["name"], tok,
                           max_new_tokens=eval_new_tokens(knobs, examples, int(h)))
        out[int(h)] = dict(reward=float(r.mean()), solved=float((r >= 1.0).mean()))
    return out


def check_eval_examples(knobs: dict[str, Any], evals: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming ``model.warmup.eval_lengths`` / ``eval_hops`` when the task
    cannot pose the evaluation's prompts (one example of each): checked before training, so a
    bad evaluation setting does not cost a finished warm-up."""
    lengths = list(evals["lengths"]) if evals["lengths"] is not None else default_eval_lengths(knobs["context_tokens"])
    for field, values, arg in (("eval_lengths", lengths, "context_tokens"), ("eval_hops", evals["hops"], "hops")):
        for value in values:
            try:
                generate_examples(knobs, 1, seed=0, **{arg: int(value)})
            except ValueError as e:
                raise ValueError(f"model.warmup.{field}={tuple(values)}: the task cannot pose {value}: {e}") from e


def accuracy_tables(config: Qwen3Config, params: Params, knobs: dict[str, Any], evals: dict[str, Any], seed: int,
                    progress: bool) -> tuple[dict[int, float], dict[int, dict[str, float]], float]:
    """The warm-up's final tables: (accuracy by context length, reward and solved by hops, seconds).
    ``evals``: ``lengths`` (None: :func:`default_eval_lengths`), ``hops`` and ``prompts`` per entry."""
    lengths = list(evals["lengths"]) if evals["lengths"] is not None else default_eval_lengths(knobs["context_tokens"])
    t1 = time.perf_counter()
    acc = accuracy_by_length(config, params, knobs, lengths, num_prompts=evals["prompts"], seed=seed)
    by_hops = accuracy_by_hops(config, params, knobs, evals["hops"], num_prompts=evals["prompts"], seed=seed)
    eval_s = time.perf_counter() - t1
    if progress:
        print("[warmup] greedy accuracy by context length: "
              + ", ".join(f"{k}: {v:.2f}" for k, v in acc.items()), flush=True)
        if by_hops:
            print("[warmup] greedy reward / solved by hops: "
                  + ", ".join(f"{h}: {v['reward']:.2f}/{v['solved']:.2f}" for h, v in by_hops.items()), flush=True)
    return acc, by_hops, eval_s
