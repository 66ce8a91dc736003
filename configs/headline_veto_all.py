"""headline_veto.py with each group's advantage baseline over all of its rows: the veto takes the
sparse actor's own errors out of the update without taking the comparison away from the rows kept.

    python -m experiments.run --config configs/headline_veto_all.py "--config.study.arms=('dense','calibrated')" \
        "--config.study.seeds=(0,1,2)"

Why: in headline_veto.py the veto rejects about half of the rows, and each group's advantages are
recomputed over its kept rows. With 4 rows a group, a group left with one kept row gives that row no
advantage, so the rows whose update carries a comparison fall well below the rows kept. Here
(``train.tis_veto_baseline="all"``) each group's mean and std are over all of its rows, as without the
veto, and only the rejected rows get advantage 0: a lone kept row that solved its trace is still
reinforced against its group. The rejected rows' rewards stay in the baseline: they are the rewards
the group's prompt gave this step's rollouts.

Measured (docs/results.md; 128 held-out prompts x 4, paired, +- SE over prompts and seeds): over seeds 0-2 the
4-page rollouts train the dense policy to +0.145 +- 0.013, **+0.004 +- 0.011 against dense rollouts**
(+0.005 / +0.019 / -0.011 per seed), inside the bound of max(1 SE, 20% of the dense gain) = 0.028, and
0.050 +- 0.012 above headline_veto.py's kept-rows baseline (every seed). Pooled p5 >= 0.96 in every bin,
39% of the visible pages kept, rollouts 1.72x dense (paired). About half of the rows are vetoed; 41-57% of
the rows carry an advantage (``rollout_corr/rows_with_advantage``).
"""
from configs.headline_veto import get_config as headline_veto_config


def get_config():
    c = headline_veto_config()
    c.workdir = "runs/headline_veto_all"
    c.train.tis_veto_baseline = "all"  # a group's mean and std over all its rows; the vetoed rows get 0
    return c
