"""The study's final evaluation, paired: every arm's final dense policy (each seed) and the policy
the arms started from, sampled densely with one key on the same ``study.final_eval_prompts``
held-out prompts, rewards kept per prompt.

Validation during training (``val/dense/*``) gives each arm's reward with a standard error over
its prompts; an arm's change and its gap to the dense arm then get unpaired errors, which count
the prompt-to-prompt spread (some prompts are hard for every policy) twice. Here every policy meets
the same prompts with the same sampling key (common random numbers), so the per-prompt differences
(end - start, arm - dense) cancel what the prompts share, and their standard errors are those of
the differences (:func:`sparrow_jax.run.final_eval_figures.paired_figures`). Kept in
``<workdir>/final_eval.json``, one entry per policy written as soon as it is evaluated: an
interrupted evaluation resumes where it stopped, and a finished study gains the evaluation when
rerun with ``study.final_eval_prompts`` set.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Callable

import jax
import numpy as np

from sparrow_jax.data.registry import Task
from sparrow_jax.io import atomic_write_json
from sparrow_jax.io.checkpoint import CheckpointManager, run_policy_params
from sparrow_jax.rl.trainer import evaluate_per_prompt
from sparrow_jax.run.context import build_examples, build_run_context
from sparrow_jax.run.final_eval_figures import FINAL_EVAL_FILE, START, run_name, setting_value
from sparrow_jax.run.specs import RunSpec
from sparrow_jax.sft.model_source import build_model

FINAL_EVAL_KEY = 10**6 + 1  # folded into PRNGKey(seed): a key no training step or validation draws


def final_eval_rows(spec: RunSpec, task: Task) -> list[dict]:
    """The ``study.final_eval_prompts`` held-out prompts: the task's held-out rows as validation
    draws them, more of them (the validation prompts come first; a generated task holds out rows
    after its training rows, a dataset its first ``task.num_eval``), from held-out row
    ``study.final_eval_offset`` on."""
    first = spec.study.final_eval_offset
    held_out = dataclasses.replace(spec.task, num_eval=first + spec.study.final_eval_prompts)
    return build_examples(held_out, task)[1][first:]


def start_name(spec: RunSpec, seed: int) -> str:
    """The start policy's entry: one for every seed, except a tiny model drawn with each seed."""
    return run_name(START, seed) if spec.model.source == "tiny" else START


def final_eval_pending(spec: RunSpec, report: dict) -> bool:
    """Whether a finished study's ``report`` lacks the final evaluation its spec asks for (of as many
    prompts, after as many steps: a study continued to more steps is evaluated anew)."""
    wanted = spec.study is not None and spec.study.final_eval_prompts > 0
    done = report.get("final_eval") or {}
    return wanted and (done.get("prompts"), done.get("steps"), setting_value(done, "offset")) != (
        spec.study.final_eval_prompts, spec.steps, spec.study.final_eval_offset)


def _check_finished(workdir: str, steps: int) -> None:
    """Raise ValueError unless the run in ``workdir`` holds the checkpoint of its last step."""
    directory = os.path.join(workdir, "checkpoints")
    latest = None
    if os.path.isdir(directory):
        with CheckpointManager(directory) as ckpt:
            latest = ckpt.latest_step()
    if latest != steps:
        found = "none" if latest is None else f"step {latest}"
        raise ValueError(f"{workdir}: the final evaluation needs the checkpoint of its last step {steps}, found "
                         f"{found} (has the arm finished?)")


def _load(path: str, setting: dict) -> dict:
    """``final_eval.json`` if it was made with ``setting`` (prompts, k, seed, steps, offset: arms
    continued to more steps are evaluated anew), else a fresh record; a record made with another
    setting is moved aside to ``final_eval.replaced-<n>.json`` first, not lost."""
    if not os.path.exists(path):
        return {**setting, "runs": {}}
    with open(path) as f:
        data = json.load(f)
    if all(setting_value(data, k) == v for k, v in setting.items()):
        return data
    n = 0
    while os.path.exists(aside := path.replace(".json", f".replaced-{n}.json")):
        n += 1
    os.replace(path, aside)
    print(f"[final eval] {path} was made with another setting; kept as {aside}", flush=True)
    return {**setting, "runs": {}}


def evaluate_final(spec: RunSpec, arm_workdirs: dict[str, dict[int, str]]) -> dict:
    """Evaluate, densely on :func:`final_eval_rows` with ``spec.eval_k`` samples per prompt, the start
    policy (:func:`start_name`) and every arm's final policy (``arm_workdirs``: arm -> seed -> the
    run's workdir, finished), skipping those already in ``<workdir>/final_eval.json``.
    -> that file's content: ``{"prompts", "k", "seed", "steps", "runs": {name: {metric: [P] per prompt}},
    "seconds": {name: its evaluation's wall time}}``
    (metrics of :func:`~sparrow_jax.rl.trainer.evaluate_per_prompt`)."""
    n, k = spec.study.final_eval_prompts, spec.eval_k
    path = os.path.join(spec.workdir, FINAL_EVAL_FILE)
    data = _load(path, {"prompts": n, "k": k, "seed": spec.seed, "steps": spec.steps,
                        "offset": spec.study.final_eval_offset})
    ctx = build_run_context(spec, None)
    rows = final_eval_rows(spec, ctx.task)
    key = jax.random.fold_in(jax.random.PRNGKey(spec.seed), FINAL_EVAL_KEY)
    seeds = sorted({s for by_seed in arm_workdirs.values() for s in by_seed})
    policies: dict[str, Callable] = {}
    for seed in seeds:
        initial = (lambda s=seed: build_model(spec.model, spec.task, ctx.tokenizer, s)[1]) \
            if spec.model.source == "tiny" else (lambda: ctx.params)
        policies.setdefault(start_name(spec, seed), initial)
    for arm, by_seed in arm_workdirs.items():
        for seed, workdir in by_seed.items():
            if run_name(arm, seed) not in data["runs"]:
                _check_finished(workdir, spec.steps)  # every arm before the first evaluation
            policies[run_name(arm, seed)] = lambda w=workdir: run_policy_params(w, ctx.params, spec.steps)[0]
    for name, params in policies.items():
        if name in data["runs"]:
            continue
        t0 = time.perf_counter()
        per_prompt = evaluate_per_prompt(ctx, params(), None, rows, k, key)
        data["runs"][name] = {m: v.tolist() for m, v in per_prompt.items()}
        data.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)
        atomic_write_json(path, data)
        print(f"[final eval] {name}: reward_mean@{k} {np.mean(per_prompt[f'reward_mean@{k}']):.3f} on {n} prompts "
              f"({data['seconds'][name]:.0f} s)", flush=True)
    return data
