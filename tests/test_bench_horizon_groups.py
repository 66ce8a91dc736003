"""experiments.bench_horizon_groups: both sides timed on the run's own batch, the JSON line's
ratios those of the paired timings, and a config with nothing to cut refused."""
import json

import pytest

from configs.headline import get_config
from experiments.bench_horizon_groups import main
from sparrow_jax.run.specs import parse_spec


def _spec(tmp_path, **train):
    cfg = get_config()  # the shipped warm-up (its task knobs unchanged), short traces, one small batch
    cfg.workdir, cfg.schedule.kind = str(tmp_path), "dense"
    cfg.task.num_train, cfg.task.num_eval = 8, 2
    cfg.rollout.max_new_tokens, cfg.rollout.prompts_per_step, cfg.rollout.group_size = 600, 2, 4
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return parse_spec(cfg)


@pytest.mark.heavy
def test_bench_times_both_sides_and_prints_the_json_line(tmp_path, capsys):
    summary = main(_spec(tmp_path), groups=[2], batches=1, repeats=1)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == json.loads(json.dumps(summary))
    assert line["rows"] == 8 and 0 < line["reward_horizon_token_share"] < 1
    side = line["groups_2"]
    assert side["speedup"] == pytest.approx(line["whole"]["median_s"] / side["median_s"])  # one batch, one round
    assert 0 < side["update_position_share"] < 1


def test_bench_refuses_a_config_without_the_reward_horizon(tmp_path):
    with pytest.raises(ValueError, match="reward_horizon_mask is off"):
        main(_spec(tmp_path, reward_horizon_mask=False, horizon_groups=0), groups=[2], batches=1, repeats=1)
