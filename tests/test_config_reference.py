"""docs/configs.md is the generator's output (a new field without a comment, or a stale doc,
fails here); comments come from the source as written; the optional blocks' defaults are the
code's."""
import dataclasses

import pytest

from configs import common
from experiments import config_reference as ref
from sparrow_jax.run import specs


def test_committed_doc_is_generated():
    with open(ref.DOC, encoding="utf-8") as f:
        committed = f.read()
    new = ref.render()
    assert committed == new, ("docs/configs.md is stale (" + ref.first_difference(committed, new)
                              + "); run python -m experiments.config_reference")


def test_every_field_has_a_comment():
    fields = [e for e in ref.entries() if not e.is_block]
    assert len(fields) > 100 and {"steps", "schedule.online.margin", "model.warmup.steps", "study.arms"} <= {
        e.path for e in fields}
    assert [e.path for e in fields if not e.comment.strip()] == []


def test_comments_as_written():
    by_path = {e.path: e.comment for e in ref.entries()}
    # trailing comment plus its aligned continuation line
    assert by_path["schedule.online.start"] == (
        "first schedule: calibrated | preset | fixed (schedule.preset / topk) | "
        "dense (per bin, the top-k covering the bin's whole context)")
    assert by_path["train.seq_mean_rows"].startswith("seq-mean loss divisor: valid")  # the comment line above it
    assert by_path["rollout.engine"].startswith("auto | continuous | fixed — auto: continuous batching")
    assert by_path["train.tis_mask_high"] == "upper ratio bound of the rejection mask"  # the block above is low's


SOURCE = '''
def base_config():
    c = ConfigDict()
    c.a = 1  # first
    #          and more
    # about b
    c.b = 2
    c.blk = ConfigDict(dict(  # a block
        x=1,  # ex
        y=2,
    ))
    c.sub = sub_config()
    return c


def sub_config():
    return ConfigDict(dict(
        z=3,  # zed
    ))
'''


def test_source_entries_on_a_small_source():
    got = [(e.path, e.comment, e.is_block) for e in ref.source_entries(SOURCE, "base_config")]
    assert got == [("a", "first and more", False), ("b", "about b", False), ("blk", "a block", True),
                   ("blk.x", "ex", False), ("blk.y", "", False), ("sub", "", True), ("sub.z", "zed", False)]
    with pytest.raises(ValueError, match=r"common.py:4: fields \['p', 'q'\] share a line"):
        ref.source_entries("def base_config():\n    return ConfigDict(dict(\n\n        p=1, q=2,  # both\n    ))\n",
                           "base_config")


def test_a_field_missing_from_the_source_is_named(monkeypatch):
    base = common.base_config

    def with_extra():
        c = base()
        c.rollout.extra = 1  # set outside the builders: no comment to document it with
        return c
    monkeypatch.setattr(common, "base_config", with_extra)
    with pytest.raises(ValueError, match=r"config field rollout.extra: not found in configs/common.py"):
        ref.entries()


def test_check_exits_1_naming_the_difference(tmp_path, capsys):
    out = tmp_path / "configs.md"
    assert ref.main(["--check", "--out", str(out)]) == 1
    assert "is missing" in capsys.readouterr().err
    assert ref.main(["--out", str(out)]) == 0
    assert ref.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text().replace("| RL steps |", "| RL stepz |"))
    assert ref.main(["--check", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "is stale (line " in err and "RL stepz" in err and "RL steps" in err


def test_probes_give_their_fields_error():
    assert ref.probe_error("steps", 0, {}) == "--config.steps=0: must be > 0"
    assert ref.probe_error("model.hf_dir", "", {"model.source": "hf"}) == (
        "--config.model.hf_dir='': is required when model.source='hf'")
    with pytest.raises(RuntimeError, match="the config parses"):
        ref.probe_error("steps", 3, {})
    with pytest.raises(RuntimeError, match="names another field"):
        ref.probe_error("train.mini_batches", 1, {"rollout.group_size": 1})


def test_optional_blocks_defaults_are_the_codes():
    from sparrow_jax.sft.cache import DEFAULT_CACHE_DIR
    from sparrow_jax.sft.settings import _NOT_HASHED, WarmupSettings
    block = common.warmup_config()
    settings = {f.name: f.default for f in dataclasses.fields(WarmupSettings)}
    assert set(block) == set(settings) | set(_NOT_HASHED)
    assert {k: block[k] for k in settings} == settings
    assert block.cache_dir == DEFAULT_CACHE_DIR and not block.eval_lengths and not block.eval_hops
    study = {f.name: f.default for f in dataclasses.fields(specs.StudySpec)}
    assert common.study_config().arms == study["arms"]
