"""Arms of different studies compared on their paired final evaluations, without rerunning anything:

    python -m experiments.compare runs/headline_norm:dense runs/headline_norm:calibrated=no_veto \\
        runs/headline_veto:calibrated=veto

Each argument is ``<workdir>:<arm>[=<label>]``; the first is the reference every other arm is paired with
(same seeds, same held-out prompts, same sampling key: the studies' ``final_eval.json`` must agree on the
start policy's scores, prompt by prompt). Prints per arm the end and the change from the start policy, the
difference to the reference with its standard error over prompts and seeds and per seed, and per seed the
mean sampled-token entropy, sampled reward and veto fraction over the first and last 10 training steps and
the median RL step seconds; then one JSON line (:func:`sparrow_jax.run.compare.compare_arms`).
``--metric reward_greedy`` compares greedy rewards instead of the sampled mean.
"""
from __future__ import annotations

import json
import sys

from absl import app, flags

from sparrow_jax.run.compare import compare_arms, format_comparison, parse_entry

USAGE = "usage: python -m experiments.compare <workdir>:<arm>[=<label>] <workdir>:<arm>[=<label>] ..."
_METRIC = flags.DEFINE_string("metric", None, "final-evaluation metric (default reward_mean@k)")


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        print(f"error: {USAGE} (at least two arms)", file=sys.stderr)
        sys.exit(2)
    try:
        figures = compare_arms([parse_entry(a) for a in argv[1:]], _METRIC.value)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print("\n".join(format_comparison(figures)))
    print(json.dumps(figures))


if __name__ == "__main__":
    app.run(main)
