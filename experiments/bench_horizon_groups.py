"""The RL update cut at the reward horizon (``train.horizon_groups``) vs the whole-row update, on
the run's own batches.

    python -m experiments.bench_horizon_groups --config configs/headline.py [--groups 2,4,8] [--batches 3] [--repeats 3]

From the run's initial policy, ``--batches`` rollout batches as the run samples them (its
prompts, ``prompts_per_step x group_size`` rows, its schedule, the loss cut at each completion's
reward horizon); on each, the trainer's update (:func:`sparrow_jax.rl.trainer.update`: the KL
reference, forward + backward, the optimiser, the statistics) from the same fresh state, once
with whole rows and once per ``--groups`` value, alternated ``--repeats`` times after one
untimed call per side and batch (compilation). The ratio of a side is the median over batches and
rounds of the paired ratio whole / grouped. The last stdout line is JSON with both sides.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from sparrow_jax.run.cli import config_main, define_config_flag
from sparrow_jax.run.speed import alternate, seconds


def main(spec, groups: Sequence[int], batches: int, repeats: int) -> dict:
    from sparrow_jax.rl import trainer as T
    from sparrow_jax.rl.train_step import init_train_state
    from sparrow_jax.run.context import build_run_context

    if not spec.train.reward_horizon_mask:
        raise ValueError("bench_horizon_groups: the config's train.reward_horizon_mask is off (nothing to cut)")
    ctx = build_run_context(spec)
    with_groups = lambda g: dataclasses.replace(spec, train=dataclasses.replace(spec.train, horizon_groups=g))
    loops = {"whole": T.make_loop(with_groups(0), ctx), **{f"groups_{g}": T.make_loop(with_groups(g), ctx)
                                                           for g in groups}}
    state = T.init_state(loops["whole"])
    start = jax.tree.map(np.asarray, state.train.params)
    fresh = lambda loop: state._replace(train=init_train_state(jax.tree.map(jnp.asarray, start), loop.optimizer))
    times = {name: [] for name in loops}
    shares = {"reward_horizon_token_share": [], **{f"groups_{g}": [] for g in groups}}
    for i in range(batches):
        batch, metrics, data = T.collect(loops["whole"], state, jax.random.PRNGKey(1000 + i))
        state = state._replace(data=data)
        shares["reward_horizon_token_share"].append(metrics["actor/reward_horizon_token_share"])

        def timed_update(loop, batch=batch):
            s = fresh(loop)
            out = {}

            def run():
                out["metrics"] = T.update(loop, s, batch)[1]
                return out["metrics"]["loss"]
            return seconds(run), out["metrics"]

        runs = {name: (lambda loop=loop: timed_update(loop)) for name, loop in loops.items()}
        for name, results in alternate(runs, repeats).items():
            times[name].append([t for t, _ in results])
            if name != "whole":
                shares[name].append(results[0][1]["actor/update_position_share"])
    whole = np.asarray(times["whole"])
    summary = {"config_workdir": spec.workdir, "rows": spec.rollout.prompts_per_step * spec.rollout.group_size,
               "batches": batches, "repeats": repeats,
               "reward_horizon_token_share": float(np.mean(shares["reward_horizon_token_share"])),
               "whole": {"median_s": float(np.median(whole))}}
    for g in groups:
        name = f"groups_{g}"
        side = np.asarray(times[name])
        summary[name] = {"median_s": float(np.median(side)), "speedup": float(np.median(whole / side)),
                         "update_position_share": float(np.mean(shares[name]))}
    print(json.dumps(summary), flush=True)
    return summary


def _cli() -> None:
    config = define_config_flag()
    groups = flags.DEFINE_list("groups", ["2", "4", "8"], "train.horizon_groups values to time against whole rows")
    batches = flags.DEFINE_integer("batches", 3, "rollout batches (each the config's prompts_per_step x group_size)")
    repeats = flags.DEFINE_integer("repeats", 3, "alternated timed rounds per batch")
    config_main(config, lambda spec: main(spec, [int(g) for g in groups.value], batches.value, repeats.value))


if __name__ == "__main__":
    _cli()
