"""Which tokens of a recurrence_trace completion the sparse actor gets wrong: the acceptance rate
per token kind.

    python -m experiments.acceptance_by_kind --config configs/headline.py [--prompts 32] [--samples 2] \
        [--from_position 1280]

The run's initial policy samples ``--samples`` dense completions of each of the first
``--prompts`` held-out prompts; the sparse actor at the run's schedule (``<workdir>/schedule.json``
when calibrated) scores them teacher-forced against the dense policy (the train step's exact
per-token acceptance rate ``sum_v min(p_dense, p_sparse)``). Each completion token gets a kind
from its place in its line (``NN:d`` local lines, ``NN:k=c`` look-ups): ``index`` (the line
number's digits), ``colon``, ``local`` (a local line's digit), ``key`` (a look-up's key letter),
``equals``, ``constant`` (the looked-up constant), ``newline``, ``other``. Per kind: its share of
the tokens, the mean and 5th percentile of the acceptance rate, and the share of its tokens
below 0.5; ``--from_position`` counts only the tokens at that position or later (positions as the
schedule's bins count them, the prompt included: 1280 is the headline's last bin). The last stdout
line is JSON.

Why: the schedule holds the 5th percentile of every position bin at tau, and yet on this task
the sparse actor's samples score less than half the dense ones (docs/results.md). A kind that is
a few percent of the tokens can sit wholly below the 5th percentile and still end most traces.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from sparrow_jax.run.cli import config_main, define_config_flag

KINDS = ("index", "colon", "local", "key", "equals", "constant", "newline", "other")


def token_kinds(text: str) -> list[str]:
    """One kind per character of a recurrence_trace completion (the builtin tokenizer's tokens are
    characters): by column within its line, a look-up line being one with ``=`` at column 4."""
    kinds = []
    for line in text.split("\n"):
        lookup = len(line) > 4 and line[4] == "="
        for col, ch in enumerate(line):
            if col < 2 and ch.isdigit():
                kinds.append("index")
            elif col == 2 and ch == ":":
                kinds.append("colon")
            elif col == 3:
                kinds.append("key" if lookup else "local" if ch.isdigit() else "other")
            elif lookup and col == 4:
                kinds.append("equals")
            elif lookup and col == 5:
                kinds.append("constant")
            else:
                kinds.append("other")
        kinds.append("newline")
    return kinds[:len(text)]  # the last line has no newline of its own


def kind_table(alpha: np.ndarray, kinds: np.ndarray) -> dict[str, dict]:
    """``alpha`` [N] and ``kinds`` [N] (strings) -> per kind: share of the N tokens, mean, p5, share below 0.5."""
    out = {}
    for kind in KINDS:
        a = alpha[kinds == kind]
        if a.size:
            out[kind] = {"share": a.size / alpha.size, "mean": float(a.mean()), "p5": float(np.percentile(a, 5)),
                         "below_0.5": float((a < 0.5).mean()), "tokens": int(a.size)}
    return out


def main(spec, prompts: int, samples: int, from_position: int = 0) -> dict:
    from sparrow_jax.mismatch.scorers import score_rollout
    from sparrow_jax.rl.trainer import sample
    from sparrow_jax.run.context import build_run_context

    if spec.task.name != "recurrence_trace":
        raise ValueError(f"acceptance_by_kind reads recurrence_trace lines; the config's task is {spec.task.name!r}")
    ctx = build_run_context(spec)
    if ctx.schedule is None:
        raise ValueError("acceptance_by_kind needs a sparse schedule; the config's schedule.kind is 'dense'")
    rollout, rewards = sample(ctx, ctx.params, ctx.eval_rows[:prompts], jax.random.PRNGKey(0), samples, None)
    scored = score_rollout(ctx.model_config, ctx.params, ctx.params, jnp.asarray(rollout.tokens),
                           jnp.asarray(rollout.prompt_lens), schedule=ctx.schedule,
                           temperature=ctx.sampling.temperature, top_k=0)
    alpha = np.asarray(scored["alpha"])
    all_alpha, all_kinds = [], []
    for b in range(len(rollout.tokens)):
        ids = rollout.tokens[b, rollout.prompt_lens[b]:rollout.lengths[b]].tolist()
        # the builtin tokenizer: one character a token, but for its named tokens (<eos>, start, ...)
        pieces = [ctx.tokenizer.decode([i]) for i in ids]
        chars = iter(token_kinds("".join(p for p in pieces if len(p) == 1)))
        kinds = [next(chars) if len(p) == 1 else "other" for p in pieces]
        counted = max(from_position - int(rollout.prompt_lens[b]), 0)  # generated tokens before from_position
        all_kinds += kinds[counted:]
        all_alpha.append(alpha[b, rollout.prompt_lens[b] + counted:rollout.lengths[b]])
    alpha_flat, kinds_flat = np.concatenate(all_alpha), np.asarray(all_kinds)
    if alpha_flat.size == 0:
        raise ValueError(f"acceptance_by_kind: no generated token at position >= --from_position={from_position}")
    summary = {"prompts": prompts, "samples": samples, "from_position": from_position,
               "reward_mean": float(np.mean(rewards)),
               "schedule_topk": [int(k) for k in np.asarray(ctx.schedule.topk)],
               "all": {"p5": float(np.percentile(alpha_flat, 5)), "mean": float(alpha_flat.mean()),
                       "tokens": int(alpha_flat.size)},
               "kinds": kind_table(alpha_flat, kinds_flat)}
    print(json.dumps(summary), flush=True)
    return summary


def _cli() -> None:
    config = define_config_flag()
    prompts = flags.DEFINE_integer("prompts", 32, "held-out prompts sampled")
    samples = flags.DEFINE_integer("samples", 2, "dense completions per prompt")
    from_position = flags.DEFINE_integer("from_position", 0, "count only the tokens at this position or later")
    config_main(config, lambda spec: main(spec, prompts.value, samples.value, from_position.value))


if __name__ == "__main__":
    _cli()
