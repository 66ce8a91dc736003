"""Is one GRPO step's signal above its noise? ``python -m experiments.probe_rl_signal --config configs/headline.py``.

From the run's initial policy (its warm-up), with the run's own rollout, reward and loss:

1. ``--batches`` batches of the config's rollouts (fresh prompts each), and each batch's
   gradient of the RL loss; each batch's cosine with the mean of the others (leave-one-out:
   near 0 means a step follows that batch's noise, not a direction the batches share);
2. the held-out reference log-probability (the eval rows' reference tokens, teacher-forced;
   on recurrence_trace also its look-up keys alone, the tokens its samples first get wrong)
   after a plain step of L2 length ``s`` along the mean gradient, for each ``--step_sizes``;
3. on recurrence_trace, where the batches' samples first leave their reference: the key letter,
   the constant or a local line (:func:`first_error_kinds`), and how many key errors are one
   letter off.

``--rollouts sparse`` samples the batches with the sparse actor at the config's schedule (the
sparse arm's signal, with its TIS weights); ``--params_from <run workdir>`` starts from that run's
checkpoint (``--params_step``, default its newest) instead of the warm-up, e.g. a policy RL has
already sharpened. With a final norm (``norm.weight``), each batch's ``sharpening``: the descent
direction's component along that norm's weights, ``-g . w``, i.e. how fast the step would scale every
logit up (RL's gain on recurrence_trace is mostly that, docs/results.md).

The last stdout line is JSON with every figure.
"""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags

from sparrow_jax.run.cli import config_main, define_config_flag
from sparrow_jax.stats import mean_and_se


def flat(tree) -> np.ndarray:
    """A pytree's leaves as one float64 vector (leaf order of ``jax.tree.leaves``)."""
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def unflat(vector: np.ndarray, like):
    """:func:`flat`'s inverse: ``vector`` in the shapes and dtypes of ``like``'s leaves."""
    leaves, treedef = jax.tree.flatten(like)
    out, at = [], 0
    for leaf in leaves:
        out.append(jnp.asarray(vector[at:at + leaf.size].reshape(leaf.shape), leaf.dtype))
        at += leaf.size
    return jax.tree.unflatten(treedef, out)


def leave_one_out_cosines(grads: np.ndarray) -> list[float]:
    """grads [n, P] -> each row's cosine with the mean of the other rows."""
    n = len(grads)
    out = []
    for i in range(n):
        rest = grads[np.arange(n) != i].mean(axis=0)
        out.append(float(grads[i] @ rest / (np.linalg.norm(grads[i]) * np.linalg.norm(rest))))
    return out


def batch_gradients(spec, ctx, batches: int) -> tuple[np.ndarray, list[float], list]:
    """([batches, P] gradients of the RL loss at the initial policy, sampled reward per batch,
    (train-step batch, its prompts, group size) per batch). Each batch takes the next prompts of the run's
    prompt order and its own key; the update is one plain SGD step of rate 1 from the same
    params, so params - new params is the gradient the run's optimiser would see."""
    from sparrow_jax.rl import trainer as T
    from sparrow_jax.rl.train_step import init_train_state

    loop = dataclasses.replace(T.make_loop(spec, ctx), optimizer=optax.sgd(1.0))
    state = T.init_state(loop)
    start = jax.tree.map(np.asarray, state.train.params)
    grads, rewards, samples = [], [], []
    for i in range(batches):
        fresh = state._replace(train=init_train_state(jax.tree.map(jnp.asarray, start), loop.optimizer))
        examples, _ = T.next_examples(loop, fresh)
        batch, metrics, data = T.collect(loop, fresh, jax.random.PRNGKey(1000 + i))
        after, _ = T.update(loop, fresh, batch)
        grads.append(flat(start) - flat(after.train.params))
        rewards.append(metrics["reward_mean"])
        samples.append((jax.tree.map(np.asarray, batch), examples, spec.rollout.group_size))
        state = state._replace(data=data)
    return np.stack(grads), rewards, samples


def reference_logprobs(ctx, params, rows: Sequence[dict]) -> dict[str, Optional[float]]:
    """Mean log-probability of the rows' reference tokens (teacher-forced, dense) and, on
    recurrence_trace, of their look-up keys alone (``keys``; None on other tasks)."""
    from sparrow_jax.models.forward import dense_logits

    logits = jax.jit(lambda p, t: jax.nn.log_softmax(dense_logits(ctx.model_config, p, t), axis=-1))
    every, keys = [], []
    for row in rows:
        prompt, ref = ctx.encode(row), ctx.tokenizer.encode(row["reference"])
        lp = np.asarray(logits(params, jnp.asarray([prompt + ref])))[0]
        n = len(prompt)
        every += [lp[n + j - 1, t] for j, t in enumerate(ref)]
        if ctx.task.name == "recurrence_trace":
            at = 0
            for line in row["reference"].split("\n"):
                if "=" in line:  # the key letter, after "NN:"
                    keys.append(lp[n + at + 2, ref[at + 3]])
                at += len(line) + 1
    return {"all": float(np.mean(every)), "keys": float(np.mean(keys)) if keys else None}


def first_error_kinds(completion: str, reference: str) -> tuple[str, Optional[int]]:
    """Where a recurrence_trace completion first leaves its reference: ``key`` (a look-up line's
    key letter), ``constant`` (its looked-up constant), ``local`` (a local line's digit),
    ``index`` (a line number), ``format`` (anything else) or ``none``; and for a one-letter
    key, how many letters off it is (mod 20), else None."""
    from sparrow_jax.data.tasks.recurrence_trace import ONE_LETTER_KEYS

    got, want = completion.split("\n"), reference.split("\n")
    for g, w in zip(got, want):
        if g == w:
            continue
        col = next((c for c in range(min(len(g), len(w))) if g[c] != w[c]), min(len(g), len(w)))
        if col < 3:
            return ("index" if col < 2 else "format"), None
        if "=" not in w:
            return "local", None
        if col == 3 and col < len(g) and g[3] in ONE_LETTER_KEYS and w[3] in ONE_LETTER_KEYS:
            return "key", (ONE_LETTER_KEYS.index(g[3]) - ONE_LETTER_KEYS.index(w[3])) % len(ONE_LETTER_KEYS)
        return ("key" if col == 3 else "constant" if col == w.index("=") + 1 else "format"), None
    return ("none" if len(got) >= len(want) else "format"), None


def error_breakdown(ctx, samples) -> dict:
    """Counts of :func:`first_error_kinds` over the batches' samples (recurrence_trace)."""
    from sparrow_jax.data.rewards import before_eos
    from sparrow_jax.data.tasks.recurrence_trace import ONE_LETTER_KEYS

    kinds, offsets = Counter(), Counter()
    for batch, examples, group in samples:
        for b in range(len(batch.tokens)):
            completion = before_eos(ctx.tokenizer.decode(batch.tokens[b][batch.mask[b] > 0].tolist()))
            kind, off = first_error_kinds(completion, examples[b // group]["reference"])
            kinds[kind] += 1
            if off is not None:
                offsets[min(off, len(ONE_LETTER_KEYS) - off)] += 1  # letters off, either way
    return {"first_error": dict(kinds), "key_letters_off": {str(k): v for k, v in sorted(offsets.items())}}


def sharpening(grads: np.ndarray, params) -> Optional[list[float]]:
    """grads [n, P] (flat, :func:`flat`'s order) -> each row's ``-g . w`` over the final norm's
    weights ``w`` (``norm.weight``): the rate a plain step along ``-g`` scales every logit up. None
    for a model without that parameter."""
    from sparrow_jax.optim import param_name

    at = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if param_name(path) == "norm.weight":
            w = np.asarray(leaf, np.float64).ravel()
            return [float(-g[at:at + w.size] @ w) for g in grads]
        at += leaf.size
    return None


def start_params(ctx, params_from: Optional[str], params_step: Optional[int]):
    """The probe's policy: ``ctx.params`` (the warm-up), or the checkpoint of the run in ``params_from``."""
    from sparrow_jax.io.checkpoint import run_policy_params

    if not params_from:
        return ctx.params
    loaded = run_policy_params(params_from, ctx.params, params_step)
    if loaded is None:
        raise ValueError(f"--params_from {params_from}: no checkpoint under {params_from}/checkpoints")
    return loaded[0]


def probe(spec, batches: int, step_sizes: Sequence[float], eval_rows: int, rollouts: str = "dense",
          params_from: Optional[str] = None, params_step: Optional[int] = None) -> dict:
    from sparrow_jax.run.context import build_run_context

    if rollouts not in ("dense", "sparse"):
        raise ValueError(f"--rollouts {rollouts!r}: dense | sparse")
    ctx = build_run_context(spec, schedule=None) if rollouts == "dense" else build_run_context(spec)
    if ctx.schedule is None and rollouts == "sparse":
        raise ValueError("--rollouts sparse needs a sparse schedule; the config's schedule.kind is 'dense'")
    ctx = dataclasses.replace(ctx, params=start_params(ctx, params_from, params_step))
    grads, rewards, samples = batch_gradients(spec, ctx, batches)
    cosines = leave_one_out_cosines(grads)
    start, mean_grad = flat(ctx.params), grads.mean(axis=0)
    direction = mean_grad / np.linalg.norm(mean_grad)
    rows = ctx.eval_rows[:eval_rows]
    along = {str(s): reference_logprobs(ctx, unflat(start - s * direction, ctx.params), rows)
             for s in [0.0] + list(step_sizes)}
    out = {"batches": batches, "rows_per_batch": spec.rollout.prompts_per_step * spec.rollout.group_size,
           "reward_per_batch": rewards, "grad_norms": [float(np.linalg.norm(g)) for g in grads],
           "loo_cosines": cosines, "mean_grad_norm": float(np.linalg.norm(mean_grad)),
           "reference_logp_along_mean_grad": along, "rollouts": rollouts, "params_from": params_from,
           "sharpening": sharpening(grads, ctx.params)}
    if ctx.task.name == "recurrence_trace":
        out.update(error_breakdown(ctx, samples))
    return out


def main(spec, batches: int, step_sizes: Sequence[float], eval_rows: int, rollouts: str = "dense",
         params_from: Optional[str] = None, params_step: Optional[int] = None) -> None:
    out = probe(spec, batches, step_sizes, eval_rows, rollouts, params_from, params_step)
    print(f"sampled reward per batch: {' '.join(f'{r:.3f}' for r in out['reward_per_batch'])}")
    print(f"leave-one-out cosines:    {' '.join(f'{c:+.3f}' for c in out['loo_cosines'])}")
    if out["sharpening"] is not None:
        mean, se = mean_and_se(out["sharpening"])
        print(f"sharpening per batch:     {' '.join(f'{v:.5f}' for v in out['sharpening'])} "
              f"(mean {mean:.5f} +- {se if se is not None else float('nan'):.5f})")
    for s, lp in out["reference_logp_along_mean_grad"].items():
        keys = "" if lp["keys"] is None else f", look-up keys {lp['keys']:.4f}"
        print(f"step {float(s):<6g} along the mean gradient: reference log-prob {lp['all']:.5f}{keys}")
    if "first_error" in out:
        print(f"first error: {out['first_error']}; key letters off: {out['key_letters_off']}")
    print(json.dumps(out))


def _cli() -> None:
    config = define_config_flag()
    batches = flags.DEFINE_integer("batches", 8, "rollout batches (each the config's prompts_per_step x group_size)")
    sizes = flags.DEFINE_list("step_sizes", ["0.003", "0.01", "0.03", "0.1"], "L2 lengths of the steps tried")
    rows = flags.DEFINE_integer("eval_rows", 16, "held-out rows the reference log-probability is measured on")
    rollouts = flags.DEFINE_enum("rollouts", "dense", ["dense", "sparse"],
                                 "who samples the batches: the dense policy, or the sparse actor at the config's schedule")
    params_from = flags.DEFINE_string("params_from", None, "an RL run's workdir: probe its checkpoint, not the warm-up")
    params_step = flags.DEFINE_integer("params_step", None, "that checkpoint's step (default: the newest)")
    config_main(config, lambda spec: main(spec, batches.value, [float(s) for s in sizes.value], rows.value,
                                          rollouts.value, params_from.value, params_step.value))


if __name__ == "__main__":
    _cli()
