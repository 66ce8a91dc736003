"""experiments.attribute_update: group swaps on a small tree by hand, a misspelt group refused, and
a tiny run whose trained policy differs from its start only in the final norm (common random
numbers: a variant with the start's params changes by exactly 0, one with the trained params
scores as the trained policy)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.attribute_update import PARAM_GROUPS, figure, swap_matching, ungrouped, variants
from sparrow_jax.io.checkpoint import CheckpointManager


def _tree(scale):
    return {"norm": {"weight": jnp.full((2,), scale)},
            "layers": [{"self_attn": {"q_proj": {"kernel": jnp.full((2, 2), scale)}},
                        "mlp": {"up_proj": {"kernel": jnp.full((2, 3), scale)}}}],
            "embed_tokens": jnp.full((4, 2), scale)}


def test_swaps_take_the_matching_leaves_from_the_other_tree():
    start, trained = _tree(1.0), _tree(2.0)
    got = swap_matching(start, trained, PARAM_GROUPS["final_norm"])
    assert float(got["norm"]["weight"][0]) == 2.0
    assert float(got["layers"][0]["self_attn"]["q_proj"]["kernel"][0, 0]) == 1.0 and float(got["embed_tokens"][0, 0]) == 1.0
    v = variants(start, trained, {"attention": PARAM_GROUPS["attention"], "mlp": PARAM_GROUPS["mlp"]})
    assert set(v) == {"start", "trained", "start+attention", "trained-attention", "start+mlp", "trained-mlp"}
    assert float(v["start+attention"]["layers"][0]["self_attn"]["q_proj"]["kernel"][0, 0]) == 2.0
    assert float(v["start+attention"]["layers"][0]["mlp"]["up_proj"]["kernel"][0, 0]) == 1.0
    assert float(v["trained-mlp"]["layers"][0]["mlp"]["up_proj"]["kernel"][0, 0]) == 1.0
    assert float(v["trained-mlp"]["norm"]["weight"][0]) == 2.0
    assert ungrouped(start, {"final_norm": PARAM_GROUPS["final_norm"], "mlp": PARAM_GROUPS["mlp"]}) == [
        "embed_tokens", "layers.0.self_attn.q_proj.kernel"]
    assert ungrouped(start, PARAM_GROUPS) == []


def test_a_group_that_matches_nothing_is_refused():
    with pytest.raises(ValueError, match="'lm_head' matches no parameter"):
        swap_matching(_tree(1.0), _tree(2.0), "lm_head")


def test_figure_pairs_the_change_prompt_by_prompt():
    start, now = np.asarray([0.2, 0.5, 0.9]), np.asarray([0.3, 0.7, 0.9])
    got = figure(now, start)
    assert got["mean"] == pytest.approx(np.mean(now)) and got["change"] == pytest.approx(0.1)
    assert got["change_se"] == pytest.approx(np.std(now - start, ddof=1) / np.sqrt(3))
    assert set(figure(now, None)) == {"mean", "se"}


def test_a_tiny_run_attributes_its_change_to_the_final_norm(tmp_path, capsys):
    from configs.grpo_tiny import get_config
    from experiments.attribute_update import main
    from sparrow_jax.run.context import build_run_context
    from sparrow_jax.run.specs import parse_spec

    cfg = get_config()  # a fixed sparse schedule: every variant also sampled by the sparse actor
    cfg.workdir, cfg.rollout.max_new_tokens = str(tmp_path), 6
    spec = parse_spec(cfg)
    start = build_run_context(spec).params
    trained = jax.tree_util.tree_map_with_path(
        lambda p, x: x * 3.0 if "norm" == getattr(p[0], "key", None) else x, start)  # the final norm alone
    with CheckpointManager(tmp_path / "run" / "checkpoints") as ckpt:
        ckpt.save(7, {"loop": {"train": {"params": trained}}})
    with pytest.raises(ValueError, match="no checkpoint"):
        main(spec, str(tmp_path / "missing"), None, prompts=3, samples=1)
    with pytest.raises(ValueError, match="each must be one of"):
        main(spec, str(tmp_path / "run"), None, prompts=3, samples=1, groups=["heads"])
    summary = main(spec, str(tmp_path / "run"), None, prompts=3, samples=1, groups=["final_norm", "mlp"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(summary))
    assert summary["step"] == 7 and summary["prompts"] == 3 and summary["schedule_topk"]
    table = summary["variants"]
    assert set(table["start"]) == {"dense_sampled", "sparse_sampled", "sparse_greedy"}
    assert set(table) == {"start", "trained", "start+final_norm", "trained-final_norm", "start+mlp", "trained-mlp"}
    assert summary["groups"] == {"final_norm": r"^norm\.", "mlp": r"\.mlp\."} and "embed_tokens" in summary["ungrouped"]
    for name in ("start+mlp", "trained-final_norm"):
        for f in table[name].values():  # the start's params: the same samples, prompt by prompt
            assert (f["change"], f["change_se"]) == (0.0, 0.0)
    for measure, f in table["start+final_norm"].items():  # the trained params: the trained policy's figures
        assert f == table["trained"][measure]
        assert table["trained-mlp"][measure] == f
