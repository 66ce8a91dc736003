"""headline_sparse.py's study with RL training the final norm alone: is the sparse arm's lag the sparse
actor drifting under the updates, or the sparse rollouts' gradient itself?

    python -m experiments.run --config configs/headline_norm.py "--config.study.arms=('dense','calibrated')"

Why: in headline_sparse.py's study the dense policy that sparse rollouts trained gained 0.075 less than
the one dense rollouts trained, while the 4-page schedule held p5 in every bin. Two things moved
there. The RL updates broke the sparse actor: its greedy reward at 4 pages fell from 0.871 to 0.67-0.75
by step 25, and the dense arm's trained policy drops it from 0.838 to 0.664 on 96 held-out prompts,
mostly through the weights other than the final norm (``python -m experiments.attribute_update
--config configs/headline_sparse.py --run runs/headline_sparse/dense/seed_0 --groups
final_norm,attention,mlp``). The final norm alone carries most of the dense gain there: +0.132 of
+0.160. Here every weight but the final norm is frozen, so the sparse actor stays near its calibrated
start.

Measured (docs/results.md; seeds 0 and 1, 61.9 min on 2 cores for both arms): the sparse actor holds
(validation greedy reward 0.84 / 0.78 at step 100, from 0.87), and the gap stays: dense rollouts
gain 0.138 +- 0.012, the 4-page rollouts 0.058 +- 0.008, **0.080 +- 0.010 below dense** (0.084 /
0.076 per seed). Trained on dense rollouts the policy sharpens (mean entropy of the sampled tokens
0.0057 / 0.0047 over the first 10 steps -> 0.0031 / 0.0033 over the last 10); on sparse rollouts it
barely does (0.0048 / 0.0047 -> 0.0045 / 0.0045). The lag is not drift: the sparse rollouts' own
gradient sharpens the policy less.
"""
from configs.headline_sparse import get_config as headline_sparse_config


def get_config():
    c = headline_sparse_config()
    c.workdir = "runs/headline_norm"
    # every parameter but the final norm (norm.weight, which scales every logit) gets no update
    c.train.frozen_params = r"^(?!norm\.)"
    return c
