"""experiments.acceptance_by_kind: token kinds by column, the per-kind table by hand, and a small
run whose table covers every completion token."""
import json

import numpy as np
import pytest

from experiments.acceptance_by_kind import kind_table, token_kinds


def test_token_kinds_follow_the_columns_of_local_and_look_up_lines():
    text = "09:4\n10:g=7\n11:1"
    want = (["index", "index", "colon", "local", "newline"]
            + ["index", "index", "colon", "key", "equals", "constant", "newline"]
            + ["index", "index", "colon", "local"])
    assert token_kinds(text) == want
    assert token_kinds("1x") == ["index", "other"] and token_kinds("") == []


def test_kind_table_by_hand():
    alpha = np.asarray([1.0, 0.9, 0.2, 0.4, 1.0])
    kinds = np.asarray(["local", "local", "constant", "constant", "newline"])
    table = kind_table(alpha, kinds)
    assert set(table) == {"local", "constant", "newline"}
    assert table["constant"] == pytest.approx({"share": 0.4, "mean": 0.3, "p5": 0.21, "below_0.5": 1.0, "tokens": 2})
    assert table["local"]["below_0.5"] == 0.0 and table["local"]["p5"] == pytest.approx(0.905)


@pytest.mark.heavy
def test_a_small_run_scores_every_completion_token(tmp_path, capsys):
    from configs.headline import get_config
    from experiments.acceptance_by_kind import main
    from sparrow_jax.run.specs import parse_spec

    cfg = get_config()  # the shipped warm-up; a fixed schedule instead of the calibration
    cfg.workdir, cfg.schedule.kind, cfg.schedule.topk = str(tmp_path), "fixed", 4
    cfg.task.num_train, cfg.task.num_eval, cfg.rollout.max_new_tokens = 8, 2, 120
    summary = main(parse_spec(cfg), prompts=2, samples=2)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(summary))
    kinds = summary["kinds"]
    assert sum(k["tokens"] for k in kinds.values()) == summary["all"]["tokens"] > 0
    assert sum(k["share"] for k in kinds.values()) == pytest.approx(1.0)
    assert {"index", "colon", "local", "newline"} <= set(kinds)
    assert all(0 <= k["p5"] <= 1 + 1e-6 and 0 <= k["mean"] <= 1 + 1e-6 for k in kinds.values())
    # --from_position: the same samples (one key), only the tokens at that position or later
    late = main(parse_spec(cfg), prompts=2, samples=2, from_position=150)
    assert late["from_position"] == 150 and 0 < late["all"]["tokens"] < summary["all"]["tokens"]
    assert sum(k["tokens"] for k in late["kinds"].values()) == late["all"]["tokens"]
    with pytest.raises(ValueError, match="no generated token at position >= --from_position=10000"):
        main(parse_spec(cfg), prompts=2, samples=2, from_position=10_000)


def test_another_task_is_refused(tmp_path):
    from configs.grpo_tiny import get_config
    from experiments.acceptance_by_kind import main
    from sparrow_jax.run.specs import parse_spec

    cfg = get_config()
    cfg.workdir = str(tmp_path)
    with pytest.raises(ValueError, match="reads recurrence_trace lines; the config's task is 'pointer_chase_partial'"):
        main(parse_spec(cfg), prompts=1, samples=1)
