"""headline_norm.py's study with the token veto on the sparse rollouts: a row whose first wrong line holds a
token the dense policy rates below half the sparse actor's probability leaves the update.

    python -m experiments.run --config configs/headline_veto.py "--config.study.arms=('dense','calibrated')"

Why: in headline_norm.py's study the dense policy that 4-page rollouts trained gained 0.080 less than the
one dense rollouts trained, with p5 held in every bin and the sparse actor held near its calibrated start.
The sparse rollouts' failures are more often the sparse actor's own (a wrong line number or local digit in
71 of 256 rows against the dense actor's 39), and a row that fails on such a token pushes its correct
prefix down: the gradient does not sharpen the dense policy as dense rollouts' does. The veto
(``train.tis_veto``, verl's rollout_token_veto_threshold) rejects those rows; reading only each row's first
wrong line (``train.tis_veto_tokens="horizon_line"``) never rejects a row with nothing wrong, and each
group's advantages are recomputed over the rows kept. Dense rollouts are never vetoed (their ratio is 1),
so the dense arm is headline_norm.py's.

Measured (docs/results.md; 128 held-out prompts x 4, paired): veto at 0.5 rejects ~48% of the rows and
trains the dense policy to +0.095 +- 0.013, **0.046 +- 0.011 below dense** over seeds 0-2 (0.031 / 0.050 /
0.057 per seed; ``"--config.study.seeds=(0,1,2)"``), against 0.080 without it at seeds 0 and 1 (+0.040 +-
0.015 over the unvetoed arm, paired); at seeds 0 and 1, 0.1 (24% rejected)
0.055 +- 0.012 below, at 0.9 (65% rejected) 0.054 +- 0.009. The bound, max(1 SE, 20% of the dense gain) =
0.028, is not met. The veto's dense pass takes ~1.1 s of the ~4.6 s RL step. With every weight trained
(headline_sparse.py plus the same veto) the sparse actor drifts and the veto costs 0.053 +- 0.017 instead:
it helps only while the sparse actor holds. headline_veto_all.py keeps each group's baseline over all of its
rows (a group the veto leaves with one row still trains it) and ends 0.004 +- 0.011 above dense.
"""
from configs.headline_norm import get_config as headline_norm_config


def get_config():
    c = headline_norm_config()
    c.workdir = "runs/headline_veto"
    c.train.tis_veto = 0.5  # a row leaves the update where a token of its first wrong line has p_dense / p_sparse < 0.5
    c.train.tis_veto_tokens = "horizon_line"
    return c
