"""Long-trace pieces: the sparse token share of a rollout, the report's per-bin table, the warm-up's
long-trace settings and the shipped checkpoint."""
import dataclasses
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.sft.batches import final_batch, make_batch, training_batch, training_length
from sparrow_jax.sft.cache import FORMAT, SHIPPED_DIR, read_warmup_meta, shipped_checkpoint, warmup_key
from sparrow_jax.sft.curriculum import continued_warmup, final_phase_start, make_optimizer, stage_settings
from sparrow_jax.sft.examples import generate_examples, max_reference_tokens, sequence_length, task_knobs
from sparrow_jax.sft.settings import WarmupSettings, warmup_architecture, warmup_settings
from sparrow_jax.sft.warmup import warmup_model
from sparrow_jax.sft import cache as sft_cache
from sparrow_jax.mismatch.calibrate import sparse_token_fraction
from sparrow_jax.rollout import SparsitySchedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sparse_token_fraction_by_hand():
    # pages of 4 tokens, 1 + 1 reserved pages; top-k 1 below position 16, then 3
    s = SparsitySchedule(topk=(1, 3), bin_width=16, page_size=4, reserved_first=1, reserved_last=1,
                         dense_layers=(0,))
    # row 0 generates tokens 8..11: queries 7..10 see 8..11 tokens = 2..3 pages, budget 3 pages: none sparse
    # row 1 generates tokens 12..19: queries 11..18 see 12..19 tokens = 3,4,4,4,4,5,5,5 pages;
    #   budget 3 pages for queries < 16 (tokens 12..16: 3,4,4,4,4 -> 4 sparse), 5 pages after (none)
    got = sparse_token_fraction(s, np.array([8, 12]), np.array([12, 20]))
    assert got == pytest.approx(4 / 12)
    assert sparse_token_fraction(None, np.array([8]), np.array([12])) == 0.0
    assert sparse_token_fraction(s, np.array([8]), np.array([8])) == 0.0


def test_calibration_prompt_lengths_spread_or_constant():
    from configs.long_trace import get_config
    from sparrow_jax.run.calibration import context_lengths
    from sparrow_jax.run.specs import parse_spec

    spec = parse_spec(get_config())
    assert spec.calibration.spread_prompts is False and spec.task.key_len == 2
    assert context_lengths(spec.task, 3, spread=False) == [spec.task.context_tokens] * 3
    got = context_lengths(spec.task, 3, spread=True)
    assert got[-1] == spec.task.context_tokens and got[0] < got[1] < got[2]


def test_warmup_long_trace_rows_and_final_phase():
    from configs.common import base_config

    from sparrow_jax.models.tokenizer import BuiltinTokenizer
    from sparrow_jax.run.specs import parse_spec

    tok = BuiltinTokenizer()
    knobs = dict(name="pointer_trace", context_tokens=300, hops=40, distractor_frac=0.5, key_len=2)
    settings = WarmupSettings(steps=10, batch_size=3, min_context=32, max_train_context=64, max_train_hops=6,
                              queries_per_example=1, final_frac=0.2, final_batch_size=2)
    assert max_reference_tokens(knobs) == 41 * 6 + 5 + 1       # 41 lines of 6 tokens, answer, <eos>
    seq_len = training_length(knobs, settings)
    tokens, ref_mask, _ = training_batch(knobs, settings, 0, tok, seq_len)
    for b in range(3):                                            # short rows: <= 6 hops -> <= 7 lines
        lines = tok.decode(tokens[b][ref_mask[b]]).split("\n")
        assert 2 <= len(lines) - 1 <= 7 and lines[-1].startswith("answer: ")
    assert final_phase_start(settings) == 8
    final = final_batch(knobs, settings, 8, tok, sequence_length(knobs))[1]
    assert final.shape[0] == 2 and (final.sum(axis=1) == 41 * 6 + 5 + 1).all()  # the task's own 40 hops
    with pytest.raises(ValueError, match="final_frac"):
        WarmupSettings(final_frac=1.0)
    with pytest.raises(ValueError, match="refine_steps"):
        WarmupSettings(refine_steps=-1)
    # no refine phase: the cache key of settings from before the refine fields existed
    config = warmup_architecture(parse_spec(base_config()).model)
    plain = warmup_key(config, knobs, settings)
    assert warmup_key(config, knobs, dataclasses.replace(settings, refine_lr=5e-4)) == plain
    assert warmup_key(config, knobs, dataclasses.replace(settings, refine_steps=3)) != plain
    # the refine run: its own warm-up and peak, decaying to 10% of refine_lr over refine_steps
    refine = dataclasses.replace(settings, refine_steps=40, refine_lr=1e-3)
    opt = make_optimizer(refine, "refine")
    params, state, lrs = {"w": jnp.zeros(1)}, None, []
    state = opt.init(params)
    for _ in range(40):  # a constant unit gradient: Adam's step is the learning rate itself
        updates, state = opt.update({"w": jnp.ones(1)}, state, params)
        lrs.append(-float(updates["w"][0]))
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(1e-3, rel=1e-3) and int(np.argmax(lrs)) == 2
    assert lrs[-1] == pytest.approx(1e-4, rel=0.05)


def _tiny_trace_config(preamble_tokens=0, preamble_steps=0):
    from configs.common import base_config
    from ml_collections import ConfigDict

    cfg = base_config()
    cfg.model.tiny = ConfigDict(dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=16, intermediate_size=64,
                                     tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=1024))
    cfg.model.warmup = ConfigDict(dict(steps=2, batch_size=2, min_context=32, max_train_context=48, max_train_hops=3,
                                       queries_per_example=1, final_frac=0.5, final_batch_size=1, eval_hops=(2,),
                                       refine_steps=1, refine_batch_size=2, preamble_steps=preamble_steps,
                                       preamble_batch_size=1))
    cfg.task.name, cfg.task.context_tokens, cfg.task.hops, cfg.task.key_len = "pointer_trace", 48, 4, 2
    cfg.task.preamble_tokens = preamble_tokens
    return cfg


def test_warmup_preamble_phase_continues_the_warmup_without_it(tmp_path, monkeypatch):
    from sparrow_jax.models.tokenizer import BuiltinTokenizer
    from sparrow_jax.run.specs import parse_spec

    monkeypatch.setattr(sft_cache, "SHIPPED_DIR", str(tmp_path / "shipped"))
    plain, padded = (parse_spec(_tiny_trace_config(*args)) for args in ((0, 0), (40, 2)))
    plain_key = warmup_key(warmup_architecture(plain.model), task_knobs(plain.task),
                           warmup_settings(plain.model))
    path = warmup_model(padded.model, padded.task, cache_dir=str(tmp_path / "cache"), progress=False,
                        eval_lengths=[48], eval_prompts=1)
    meta = read_warmup_meta(path)
    assert meta["task"]["preamble_tokens"] == 40 and "preamble_tokens" not in task_knobs(plain.task)
    assert meta["base_key"] == plain_key != meta["key"]      # the warm-up without the preamble, as its own key
    assert os.path.isdir(tmp_path / "cache" / f"warmup-{plain_key}") and meta["preamble_seconds"] > 0
    # logged: every 25th step and each phase's last; main 0-1, refine 2, preamble 3-4
    assert [step for step, _ in meta["loss_curve"]] == [0, 1, 2, 4]
    # the preamble phase's rows: the task's own, preamble first
    knobs, tok = task_knobs(padded.task), BuiltinTokenizer()
    tokens, ref_mask, _ = final_batch(knobs, warmup_settings(padded.model), 3, tok, sequence_length(knobs))
    row = tok.decode(tokens[0])
    assert row[:39].replace(" ", "").isupper() and row[39] == "\n" and row[40:].split("\n")[0].count("=") >= 5
    # preamble 40 + records <= 48 + 2 * 2 + 2 + reference 5 lines * 6 + "answer: xx" 5 + <eos>: 130 -> 160
    assert max_reference_tokens(knobs) == 36 and sequence_length(knobs) == 160
    assert sequence_length(task_knobs(plain.task)) == 96
    with pytest.raises(ValueError, match="needs model.warmup.preamble_steps"):
        warmup_model(parse_spec(_tiny_trace_config(40, 0)).model, padded.task, cache_dir=str(tmp_path / "c2"))
    with pytest.raises(ValueError, match="needs task.preamble_tokens"):
        warmup_model(padded.model, plain.task, cache_dir=str(tmp_path / "c2"))


def test_warmup_on_pointer_trace_then_found_as_shipped(tmp_path, monkeypatch):
    import shutil

    from sparrow_jax.models.hf_io import load_hf
    from sparrow_jax.run.specs import parse_spec

    spec = parse_spec(_tiny_trace_config())
    m, t = spec.model, spec.task
    monkeypatch.setattr(sft_cache, "SHIPPED_DIR", str(tmp_path / "shipped"))
    path = warmup_model(m, t, cache_dir=str(tmp_path / "cache"), progress=False, eval_lengths=[48],
                        eval_prompts=1)
    meta = read_warmup_meta(path)
    assert meta["task"] == dict(name="pointer_trace", context_tokens=48, hops=4, distractor_frac=0.5, key_len=2)
    assert set(meta["accuracy_by_hops"]["2"]) == {"reward", "solved"}
    assert meta["key"] == os.path.basename(path).split("-", 1)[1]
    assert [step for step, _ in meta["loss_curve"]] == [0, 1, 2]  # 2 main steps, then the refine step
    base = tmp_path / "cache" / f"warmup-{meta['base_key']}"       # the main phase: its own warm-up
    assert read_warmup_meta(str(base))["train"]["refine_steps"] == 0 and meta["refine_seconds"] > 0
    shutil.copytree(path, tmp_path / "shipped" / "tiny_trace")
    shutil.rmtree(path)                                       # not cached any more: found shipped, not retrained
    found = warmup_model(m, t, cache_dir=str(tmp_path / "cache"), progress=False)
    assert found == str(tmp_path / "shipped" / "tiny_trace") and not os.path.exists(path)
    assert shipped_checkpoint("0" * 16, str(tmp_path / "shipped")) is None
    # deterministic: retraining the same settings elsewhere writes bit-identical weights
    again = warmup_model(m, t, cache_dir=str(tmp_path / "again"), progress=False, eval_lengths=[],
                         eval_prompts=1, use_shipped=False)
    first, second = (jax.tree_util.tree_leaves(load_hf(p)[1]) for p in (found, again))
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(first, second))



@pytest.mark.parametrize("key_len", [2, 3])
def test_rl_and_calibration_prompts_use_the_configured_key_len(key_len):
    """The warm-up trains on task.key_len; the RL rows and calibration prompts must use it too."""
    import re

    from configs.long_trace import get_config
    from sparrow_jax.data.registry import get_task
    from sparrow_jax.run.calibration import task_prompts
    from sparrow_jax.run.context import build_examples
    from sparrow_jax.run.specs import parse_spec

    cfg = get_config()
    cfg.task.key_len, cfg.task.context_tokens, cfg.task.hops = key_len, 120, 3
    cfg.task.num_train, cfg.task.num_eval = 2, 1
    spec = parse_spec(cfg)
    train_rows, eval_rows = build_examples(spec.task, get_task(spec.task.name))

    class Ctx:  # the two fields task_prompts reads
        task = get_task(spec.task.name)
        encode = staticmethod(lambda ex: [0])

    calib_rows, _ = task_prompts(spec.task, Ctx, 2, seed=1, spread=False)
    for ex in train_rows + eval_rows + calib_rows:
        keys = re.findall(r"(?:^|;)([a-z0-9]+)=", ex["prompt"].split("\n", 1)[0])
        assert keys and {len(k) for k in keys} == {key_len}


def test_extra_questions_are_refused_outside_pointer_chase():
    from sparrow_jax.models.tokenizer import BuiltinTokenizer

    knobs = dict(name="pointer_trace", context_tokens=120, hops=4, distractor_frac=0.5, key_len=2)
    settings = WarmupSettings(steps=2, batch_size=1, queries_per_example=2)
    with pytest.raises(ValueError, match="queries_per_example=2.*only for pointer_chase"):
        training_batch(knobs, settings, 0, BuiltinTokenizer(), 512)


def test_warmup_curriculum_stages_set_rows_contexts_and_hops():
    from sparrow_jax.models.tokenizer import BuiltinTokenizer

    tok = BuiltinTokenizer()
    knobs = dict(name="pointer_trace", context_tokens=300, hops=40, distractor_frac=0.5, key_len=2)
    settings = WarmupSettings(steps=10, min_context=16, queries_per_example=1, final_frac=0.2,
                              curriculum=[[3, 48, 2, 4], [5, 128, 9, 2]])
    assert settings.curriculum == ((3, 48, 2, 4), (5, 128, 9, 2))  # lists from a config: hashable
    for step, (rows, context, hops) in [(0, (4, 48, 2)), (2, (4, 48, 2)), (3, (2, 128, 9)), (7, (2, 128, 9))]:
        stage = stage_settings(settings, step)
        assert (stage.batch_size, stage.max_train_context, stage.max_train_hops) == (rows, context, hops)
        tokens, ref_mask, _ = training_batch(knobs, stage, step, tok, training_length(knobs, stage))
        assert tokens.shape[0] == rows
        for b in range(rows):
            lines = tok.decode(tokens[b][ref_mask[b]]).split("\n")
            assert 2 <= len(lines) - 1 <= hops + 1                     # <= hops + 1 record lines
            prompt = tok.decode(tokens[b][~ref_mask[b] & (tokens[b] != tok.pad_id)]).split("\n")[0]
            assert len(tok.encode(prompt)) <= max(context, 6 * (hops + 1)) + 6
    assert training_length(knobs, stage_settings(settings, 0)) < training_length(knobs, stage_settings(settings, 3))
    # a curriculum enters the cache key; no curriculum leaves the key as it was before the field existed
    config = Qwen3Config(vocab_size=111, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=1024)
    plain = dataclasses.replace(settings, curriculum=())
    assert warmup_key(config, knobs, settings) != warmup_key(config, knobs, plain)
    legacy = {k: v for k, v in dataclasses.asdict(plain).items()  # nor do the refine, slip and preamble fields, unused
              if k not in ("curriculum", "lookup_every", "lookup_weight")
              and not k.startswith(("refine_", "slip_", "preamble_"))}
    blob = json.dumps(dict(format=FORMAT, arch=dataclasses.asdict(config), task=knobs, train=legacy), sort_keys=True)
    assert warmup_key(config, knobs, plain) == hashlib.sha256(blob.encode()).hexdigest()[:16]
    with pytest.raises(ValueError, match="add up to 7, but the phase before the final one has 8"):
        WarmupSettings(steps=10, final_frac=0.2, curriculum=((3, 48, 2, 4), (4, 128, 9, 2)))
    with pytest.raises(ValueError, match="positive ints"):
        WarmupSettings(steps=10, final_frac=0.2, curriculum=((8, 48, 0, 4),))


def _trained_with(train: dict) -> dict:
    """A meta file's (or ``dataclasses.asdict``'s) training settings as JSON, without the fields
    of phases it has no steps of and a ``lookup_every`` left at 0 (files written before those
    fields existed lack them)."""
    train = json.loads(json.dumps(train))  # tuples as JSON lists
    for name in ("lookup_every", "lookup_weight"):
        if not train.get(name):
            train.pop(name, None)
    for phase in ("refine", "preamble"):
        if not train.get(f"{phase}_steps"):
            train = {k: v for k, v in train.items() if not k.startswith(f"{phase}_")}
    return train


@pytest.mark.parametrize("name", ["long_trace", "long_preamble"])
def test_shipped_checkpoint_is_the_configs_warmup_and_looks_up_values(name):
    """The config's warm-up ships: found by its settings' hash, trained with exactly the config's
    settings on top of a shipped base (long_trace: its main phase; long_preamble: long_trace's
    warm-up, the same task without the preamble), small, loads, and its greedy traces are right
    on held-out prompts."""
    import importlib

    from sparrow_jax.models.hf_io import load_hf
    from sparrow_jax.run.specs import parse_spec

    spec = parse_spec(importlib.import_module(f"configs.{name}").get_config())
    config, knobs = warmup_architecture(spec.model), task_knobs(spec.task)
    settings = warmup_settings(spec.model)
    path = shipped_checkpoint(warmup_key(config, knobs, settings))
    assert path is not None and os.path.dirname(path) == SHIPPED_DIR
    meta = read_warmup_meta(path)
    assert meta["task"] == knobs and meta["tokenizer"] == "builtin"
    assert _trained_with(meta["train"]) == _trained_with(dataclasses.asdict(settings))
    # its base ships too: the warm-up command retrains only the last phase
    _, base_knobs, base_settings = continued_warmup(knobs, settings)
    base = shipped_checkpoint(meta["base_key"])
    assert base is not None and base != path and meta["base_key"] == warmup_key(config, base_knobs, base_settings)
    assert _trained_with(read_warmup_meta(base)["train"]) == _trained_with(dataclasses.asdict(base_settings))
    assert sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) <= 5 * 2 ** 20
    loaded, params = load_hf(path)
    assert (loaded.num_hidden_layers, loaded.hidden_size, loaded.vocab_size) == (
        config.num_hidden_layers, config.hidden_size, config.vocab_size)
    # quality as shipped, teacher-forced on 2 fresh task rows (896 tokens of records, 104 hops): the
    # symbols each line looks up (2 per line) are predicted right >= 95% of the time (long_trace:
    # measured 99.8%, 90% before the refine run)
    from sparrow_jax.models.forward import dense_hidden, unembedding
    from sparrow_jax.models.tokenizer import BuiltinTokenizer

    rows = generate_examples(knobs, 2, seed=987_654)
    length = sequence_length(knobs)
    tokens, ref_mask, _ = make_batch(rows, knobs["name"], BuiltinTokenizer(), length)
    hidden = dense_hidden(loaded, params, jnp.asarray(tokens), chunk=length)
    predicted = np.asarray(jnp.argmax(hidden @ unembedding(loaded, params), axis=-1))
    right = []
    for b in range(2):
        at = np.nonzero(ref_mask[b])[0][:6 * knobs["hops"]]          # the record lines 'k1k2=v1v2\n'
        values = at.reshape(-1, 6)[:, 3:5].ravel()                     # the looked-up symbols
        right += list(predicted[b, values - 1] == tokens[b, values])
    assert np.mean(right) >= 0.95, np.mean(right)


def _records(example: dict) -> dict:
    return dict(r.split("=") for r in example["prompt"].split("\n", 1)[0].strip(";").split(";"))


@pytest.mark.parametrize("name", ["pointer_trace", "pointer_chase"])
def test_isolate_chain_keeps_wrong_turns_off_the_chain(name):
    """With isolate_chain no off-chain record points into the chain; the chain, keys, record order
    and prompt length are those of the default task, only off-chain values differ."""
    from sparrow_jax.data.registry import get_task

    gen = get_task(name).generate
    plain = gen(6, 5, context_tokens=300, hops=20, key_len=2)
    isolated = gen(6, 5, context_tokens=300, hops=20, key_len=2, isolate_chain=True)
    rejoin = 0
    for a, b in zip(plain, isolated):
        chain = a["meta"]["chain"]
        assert b["meta"]["chain"] == chain and b["reference"] == a["reference"]
        ra, rb = _records(a), _records(b)
        assert list(ra) == list(rb) and len(a["prompt"]) == len(b["prompt"])
        off = [k for k in ra if k not in chain[:-1]]          # chain[-1] is the terminal / answer record
        assert all(ra[k] == rb[k] for k in chain[:-1])
        assert not any(rb[k] in chain for k in off)
        rejoin += sum(ra[k] in chain for k in off)
    assert rejoin > 0  # the default task does let wrong turns rejoin the chain


def test_isolate_chain_reaches_rl_rows_and_calibration_prompts_not_the_warmup_key():
    """isolate_chain shapes the RL and calibration prompts; the warm-up (whose references never
    visit an off-chain record) and its cache key are the same with and without it."""
    from configs.long_trace import get_config
    from sparrow_jax.data.registry import get_task
    from sparrow_jax.run.calibration import task_prompts
    from sparrow_jax.run.context import build_examples
    from sparrow_jax.run.specs import parse_spec

    cfg = get_config()
    cfg.task.context_tokens, cfg.task.hops, cfg.task.num_train, cfg.task.num_eval = 200, 12, 3, 1
    spec = parse_spec(cfg)
    assert spec.task.isolate_chain
    cfg.task.isolate_chain = False
    assert task_knobs(spec.task) == task_knobs(parse_spec(cfg).task)

    class Ctx:  # what task_prompts reads from a run context
        task = get_task(spec.task.name)

        @staticmethod
        def encode(ex):
            return [0]

    train, held_out = build_examples(spec.task, get_task(spec.task.name))
    calib, _ = task_prompts(spec.task, Ctx, 2, seed=1, spread=False)
    for ex in train + held_out + calib:
        rec, chain = _records(ex), ex["meta"]["chain"]
        assert not any(v in chain for k, v in rec.items() if k not in chain)
