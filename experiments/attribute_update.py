"""Where an RL run's change went, by parameter group: the start policy with one group's trained
values swapped in, and the trained policy with that group's start values swapped back, each sampled
densely and through the sparse actor at the config's schedule.

    python -m experiments.attribute_update --config configs/headline_sparse.py \
        --run runs/headline_sparse/dense/seed_0 [--step 100] [--prompts 96] [--samples 2]

``--config`` gives the model, the start policy (its warm-up), the task and the schedule (a study's
``<workdir>/schedule.json`` when calibrated); ``--run`` the RL run whose checkpoint (``--step``,
default its newest) is the trained policy; ``--groups`` picks the groups swapped (default every
one of :data:`PARAM_GROUPS`). Every variant meets the same ``--prompts`` held-out
prompts with one sampling key (common random numbers), so its paired change against the start
policy has the standard error of per-prompt differences. Per variant: the dense policy's sampled
reward (``--samples`` a prompt, the rollout temperature), and with a sparse schedule the sparse
actor's sampled and greedy rewards. The last stdout line is JSON.

Why: a dense policy trained on sparse rollouts can lag one trained on dense rollouts while the
schedule holds p5 in every bin. Swapping groups separates what carries the dense gain from what
breaks the sparse actor (a group whose trained values leave the dense reward where it was and drop
the sparse actor's is pure drift for the sparse rollouts; docs/results.md).
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Optional, Sequence

import jax
import numpy as np
from absl import flags

from sparrow_jax.optim import param_name
from sparrow_jax.run.cli import config_main, define_config_flag
from sparrow_jax.stats import mean_and_se

# name -> regex over dotted parameter names (layers.0.self_attn.q_proj.kernel, norm.weight, ...)
PARAM_GROUPS = {
    "final_norm": r"^norm\.",
    "attention": r"\.self_attn\.",
    "mlp": r"\.mlp\.",
    "layer_norms": r"layernorm\.",
    "embeddings": r"^embed_tokens",
}


def swap_matching(base, other, pattern: str):
    """``base`` with every leaf whose dotted name ``re.search``-matches ``pattern`` taken from
    ``other`` (same tree). Raises ValueError when the pattern matches no leaf: a misspelt group
    would silently leave ``base`` as it is."""
    regex = re.compile(pattern)
    if not any(regex.search(param_name(p)) for p, _ in jax.tree_util.tree_flatten_with_path(base)[0]):
        raise ValueError(f"parameter group {pattern!r} matches no parameter of the model")
    return jax.tree_util.tree_map_with_path(lambda p, a, b: b if regex.search(param_name(p)) else a, base, other)


def ungrouped(params, groups: dict[str, str]) -> list[str]:
    """The dotted names of ``params``' leaves that no group's pattern matches (reported, not swapped)."""
    regexes = [re.compile(g) for g in groups.values()]
    names = [param_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    return [n for n in names if not any(r.search(n) for r in regexes)]


def variants(start, trained, groups: dict[str, str]) -> dict:
    """``{"start", "trained", "start+<group>", "trained-<group>"}`` -> params: the start policy with
    one group's trained values, and the trained policy with that group's start values."""
    out = {"start": start, "trained": trained}
    for name, pattern in groups.items():
        out[f"start+{name}"] = swap_matching(start, trained, pattern)
        out[f"trained-{name}"] = swap_matching(trained, start, pattern)
    return out


def figure(per_prompt: np.ndarray, start: Optional[np.ndarray]) -> dict:
    """Mean and standard error over prompts of ``per_prompt`` [P], and its paired change vs ``start``."""
    mean, se = mean_and_se(per_prompt)
    out = {"mean": mean, "se": se}
    if start is not None:
        out["change"], out["change_se"] = mean_and_se(per_prompt - start)
    return out


def main(spec, run: str, step: Optional[int], prompts: int, samples: int,
         groups: Sequence[str] = tuple(PARAM_GROUPS)) -> dict:
    """The table of :func:`variants` over ``groups`` (names of :data:`PARAM_GROUPS`); see the module doc."""
    unknown = [g for g in groups if g not in PARAM_GROUPS]
    if unknown or not groups:
        raise ValueError(f"--groups {list(groups)}: each must be one of {list(PARAM_GROUPS)}")
    chosen = {g: PARAM_GROUPS[g] for g in groups}
    from sparrow_jax.io.checkpoint import run_policy_params
    from sparrow_jax.rl.trainer import sample
    from sparrow_jax.run.context import build_examples, build_run_context

    ctx = build_run_context(spec)
    loaded = run_policy_params(run, ctx.params, step)
    if loaded is None:
        raise ValueError(f"--run {run}: no checkpoint under {run}/checkpoints")
    trained, step = loaded
    rows = build_examples(dataclasses.replace(spec.task, num_eval=prompts), ctx.task)[1]
    greedy = dataclasses.replace(ctx, sampling=dataclasses.replace(ctx.sampling, temperature=0.0))
    key = jax.random.PRNGKey(spec.seed)

    def per_prompt(params, context, repeats, schedule) -> np.ndarray:
        return np.asarray(sample(context, params, rows, key, repeats, schedule)[1], np.float64).reshape(
            len(rows), repeats).mean(axis=1)

    measures = {"dense_sampled": lambda p: per_prompt(p, ctx, samples, None)}
    if ctx.schedule is not None:
        measures["sparse_sampled"] = lambda p: per_prompt(p, ctx, samples, ctx.schedule)
        measures["sparse_greedy"] = lambda p: per_prompt(p, greedy, 1, ctx.schedule)
    table, start_values = {}, {}
    for name, params in variants(ctx.params, trained, chosen).items():
        table[name] = {}
        for measure, fn in measures.items():
            values = fn(params)
            start_values.setdefault(measure, values)  # "start" comes first
            table[name][measure] = figure(values, None if name == "start" else start_values[measure])
        print(f"{name:>22}  " + "  ".join(f"{m} {f['mean']:.3f}" + (f" ({f['change']:+.3f}±{f['change_se']:.3f})"
                                                                     if "change" in f else "")
                                          for m, f in table[name].items()), flush=True)
    summary = {"run": run, "step": step, "prompts": len(rows), "samples": samples,
               "schedule_topk": None if ctx.schedule is None else [int(k) for k in np.asarray(ctx.schedule.topk)],
               "groups": chosen, "ungrouped": ungrouped(ctx.params, chosen), "variants": table}
    print(json.dumps(summary), flush=True)
    return summary


def _cli() -> None:
    config = define_config_flag()
    run = flags.DEFINE_string("run", None, "the RL run's workdir (its checkpoints/ holds the trained policy)",
                              required=True)
    step = flags.DEFINE_integer("step", None, "the checkpoint's step (default: the newest)")
    prompts = flags.DEFINE_integer("prompts", 96, "held-out prompts, the same for every variant")
    samples = flags.DEFINE_integer("samples", 2, "sampled completions per prompt")
    groups = flags.DEFINE_list("groups", list(PARAM_GROUPS), f"parameter groups swapped, of {list(PARAM_GROUPS)}")
    config_main(config, lambda spec: main(spec, run.value, step.value, prompts.value, samples.value, groups.value))


if __name__ == "__main__":
    _cli()
