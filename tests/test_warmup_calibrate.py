"""Warm-up SFT (cache, batches, loss) and schedule calibration (table, derived schedule, CLI)."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

from configs.common import base_config
from sparrow_jax.run.specs import parse_spec
from sparrow_jax.sft.batches import make_batch, training_batch, training_length
from sparrow_jax.sft.cache import META_FILE, is_complete, read_warmup_meta, warmup_key
from sparrow_jax.sft.examples import extra_queries, task_knobs
from sparrow_jax.sft.settings import WarmupSettings, warmup_architecture, warmup_settings
from sparrow_jax.sft.train_loop import sft_loss
from sparrow_jax.sft.warmup import warmup_model
from sparrow_jax.sft import train_loop as sft_train_loop
from sparrow_jax.mismatch import calibrate as C
from sparrow_jax.models import dense_logits, init_params, load_hf, tiny_config
from sparrow_jax.models.tokenizer import BuiltinTokenizer
from sparrow_jax.rollout import SamplingParams, SparsitySchedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_ARCH = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, intermediate_size=64, tie_word_embeddings=True, rope_theta=10000.0,
                 max_position_embeddings=1024)


def _model_cfg(**warmup):
    cfg = base_config()
    cfg.model.tiny = ConfigDict(dict(TINY_ARCH))
    if warmup:
        cfg.model.warmup = ConfigDict(warmup)
    return parse_spec(cfg).model


def _task_cfg(context_tokens=64, hops=1, name="pointer_chase"):
    cfg = base_config()
    cfg.task.context_tokens, cfg.task.hops, cfg.task.name = context_tokens, hops, name
    return parse_spec(cfg).task


# ---------------------------------------------------------------- warm-up: data and loss

def test_make_batch_layout_by_hand():
    tok = BuiltinTokenizer()
    ex = dict(prompt="ab=cd;cd=ab;\nstart ab hops 1\n", reference="1:ab=cd\nanswer: cd")
    tokens, ref_mask, prompt_mask = make_batch([ex], "pointer_chase", tok, seq_len=64)
    p, r = tok.encode(ex["prompt"]), tok.encode(ex["reference"]) + [tok.eos_id]
    assert tokens.shape == (1, 64) and tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens[0, :len(p) + len(r)], p + r)
    assert (tokens[0, len(p) + len(r):] == tok.pad_id).all()
    assert np.flatnonzero(ref_mask[0]).tolist() == list(range(len(p), len(p) + len(r)))
    assert np.flatnonzero(prompt_mask[0]).tolist() == list(range(1, len(p)))
    assert tok.decode(tokens[0][ref_mask[0]]) == ex["reference"] + "<eos>"
    with pytest.raises(ValueError, match="exceed seq_len 20"):
        make_batch([ex], "pointer_chase", tok, seq_len=20)
    with pytest.raises(KeyError, match="reference"):
        make_batch([dict(prompt="x")], "pointer_chase", tok, seq_len=64)


def test_extra_queries_follow_the_records():
    ex = dict(prompt="ab1=cd2;cd2=ab1;ef3=ef3;\nstart ab1 hops 1\n", reference="1:ab1=cd2\nanswer: cd2")
    qs = extra_queries(ex, 20, 3, np.random.default_rng(0))
    table = {"ab1": "cd2", "cd2": "ab1", "ef3": "ef3"}
    for query, ref in qs:
        start, hops = query.split()[1], int(query.split()[3])
        chain = [start]
        for _ in range(hops):
            chain.append(table[chain[-1]])
        want = "\n".join(f"{i + 1}:{chain[i]}={chain[i + 1]}" for i in range(hops)) + f"\nanswer: {chain[-1]}"
        assert query == f"start {start} hops {hops}\n" and ref == want
    assert {int(q.split()[3]) for q, _ in qs} == {1, 2, 3}
    with pytest.raises(ValueError, match="not pointer-chase records"):
        extra_queries(dict(prompt="no records here\n"), 1, 1, np.random.default_rng(0))


def test_training_batch_rows():
    knobs = dict(name="pointer_chase", context_tokens=256, hops=1, distractor_frac=0.5, key_len=3)
    settings = WarmupSettings(batch_size=8, min_context=32, max_train_context=96, train_hops=3,
                              queries_per_example=3)
    tok = BuiltinTokenizer()
    seq_len = training_length(knobs, settings)
    tokens, ref_mask, prompt_mask = training_batch(knobs, settings, 3, tok, seq_len)
    assert tokens.shape == (8, seq_len) and not (ref_mask & prompt_mask).any()
    hops = set()
    for b in range(8):
        text = tok.decode(tokens[b][tokens[b] != tok.pad_id])
        pieces = text.split("<eos>")[:-1]
        assert len(pieces) == 3  # the task's question, then 2 more about the same records
        records = dict(r.split("=") for r in text.split("\n", 1)[0].split(";") if r)
        assert 2 <= len(records) and len(records) * 8 <= 96  # contexts in [min_context, max_train_context]
        for piece in pieces:  # every answer follows the records from its start key
            query = piece[piece.rindex("start "):]
            start, n = query.split()[1], int(query.split()[3])
            key = start
            for _ in range(n):
                key = records[key]
            assert piece.endswith(f"answer: {key}")
            hops.add(n)
        assert tok.decode(tokens[b][ref_mask[b]]).count("<eos>") == 3
    assert hops == {1, 2, 3}  # train_hops above the task's 1
    # deterministic in (seed, step); another step differs
    np.testing.assert_array_equal(tokens, training_batch(knobs, settings, 3, tok, seq_len)[0])
    assert not np.array_equal(tokens, training_batch(knobs, settings, 4, tok, seq_len)[0])


def test_sft_loss_matches_numpy_log_softmax():
    config = tiny_config(num_hidden_layers=1)
    params = init_params(config, seed=1)
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, config.vocab_size, (2, 12)).astype(np.int32)
    mask = np.zeros((2, 12), bool)
    mask[0, 5:9] = mask[1, 2:4] = True
    prompt_mask = np.zeros((2, 12), bool)
    prompt_mask[:, 1:5] = True
    logits = np.asarray(dense_logits(config, params, jnp.asarray(tokens)), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -logp[:, :-1][np.arange(2)[:, None], np.arange(11)[None], tokens[:, 1:]]  # predicts token t+1
    want_ref = nll[mask[:, 1:]].mean()
    want = want_ref + 0.5 * nll[prompt_mask[:, 1:]].mean()
    loss, ref = sft_loss(config, params, jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(prompt_mask), 0.5)
    np.testing.assert_allclose(float(ref), want_ref, rtol=1e-5)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_warmup_settings_from_config_block_and_errors():
    s = warmup_settings(_model_cfg(steps=7, lr=1e-3, cache_dir="x"), batch_size=5)
    assert (s.steps, s.lr, s.batch_size) == (7, 1e-3, 5)
    with pytest.raises(ValueError, match="unknown field"):
        warmup_settings(_model_cfg(stepz=3))
    with pytest.raises(ValueError, match="steps must be positive"):
        WarmupSettings(steps=0)


# ---------------------------------------------------------------- warm-up: training and cache

def test_warmup_trains_saves_and_caches(tmp_path, monkeypatch):
    m, t = _model_cfg(), _task_cfg(context_tokens=64)
    kw = dict(cache_dir=str(tmp_path), steps=3, batch_size=4, lr=1e-3, progress=False, eval_lengths=[48],
              eval_prompts=2)
    path = warmup_model(m, t, **kw)
    assert os.path.basename(path).startswith("warmup-") and is_complete(path)
    meta = read_warmup_meta(path)
    assert meta["tokenizer"] == "builtin" and meta["task"]["context_tokens"] == 64 and meta["train"]["steps"] == 3
    assert set(meta["accuracy_by_length"]) == {"48"} and 0.0 <= meta["accuracy"] <= 1.0
    config, params = load_hf(path)
    assert config.vocab_size == BuiltinTokenizer().vocab_size and config.hidden_size == TINY_ARCH["hidden_size"]
    assert config == warmup_architecture(m).replace(param_dtype=config.param_dtype)
    assert not np.allclose(np.asarray(params["embed_tokens"]),
                           np.asarray(init_params(config, seed=0)["embed_tokens"]))  # it trained

    def boom(*a, **k):
        raise AssertionError("a cached warm-up must not train again")
    monkeypatch.setattr(sft_train_loop, "make_train_step", boom)
    assert warmup_model(m, t, **kw) == path  # cache hit: no training
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]
    # any training setting or task knob changes the cache key
    assert warmup_key(warmup_architecture(m), task_knobs(t), WarmupSettings(steps=3, batch_size=4, lr=2e-3)) \
        != os.path.basename(path)[len("warmup-"):]
    # an incomplete directory under the final name is not a cache hit
    os.remove(os.path.join(path, META_FILE))
    assert not is_complete(path)
    with pytest.raises(AssertionError, match="must not train again"):
        warmup_model(m, t, **kw)


def test_task_knobs_reject_a_task_without_generator():
    t = _task_cfg(name="math")
    with pytest.raises(ValueError, match="has no generator"):
        task_knobs(t)


# ---------------------------------------------------------------- calibration: derived schedule rule

CFG = tiny_config(num_hidden_layers=2)
BASE = SparsitySchedule(topk=(0,), bin_width=64, page_size=8, dense_layers=(0,))


def _derive(p5, count, budgets=(1, 2, 4), tau=0.86, min_count=10):
    return C.derive_topk(CFG, budgets, np.array(p5, float), np.array(count), tau, BASE, min_count=min_count,
                         num_samples=4, prompt_len=8, gen_len=4 * 64)


def test_derived_schedule_on_a_hand_made_table():
    nan = np.nan
    # bins:      0     1     2     3 (too few tokens)
    p5 = [[0.95, 0.80, 0.70, nan],    # top-k 1
          [0.97, 0.90, 0.80, 0.1],    # top-k 2
          [0.99, 0.95, 0.90, 0.1]]    # top-k 4
    count = [[50, 50, 50, 0], [50, 50, 50, 3], [50, 50, 50, 3]]
    d = _derive(p5, count)
    assert d["topk"] == [1, 2, 4, 4] and d["flagged_bins"] == [] and d["inherited_bins"] == [3]


def test_derived_schedule_skips_an_infeasible_middle_budget():
    # bin 1: top-k 2 misses tau (noise) while 1 and 4 meet it. Non-decreasing after bin 0's 2 -> 4,
    # where "the running max of each bin's smallest feasible budget" would pick the failing 2.
    p5 = [[0.50, 0.90], [0.90, 0.80], [0.95, 0.95]]
    d = _derive(p5, [[50, 50]] * 3)
    assert d["topk"] == [2, 4]


def test_derived_schedule_flags_unreachable_bins_and_fills_leading_gaps():
    nan = np.nan
    p5 = [[nan, 0.90, 0.50, 0.95], [nan, 0.95, 0.60, 0.96], [nan, 0.99, 0.70, 0.99]]
    count = [[0, 50, 50, 50]] * 3
    d = _derive(p5, count)
    assert d["flagged_bins"] == [2] and d["inherited_bins"] == [0]
    assert d["topk"] == [1, 1, 4, 4]  # bin 0 takes bin 1's budget; after the flag, the largest stays
    # a cell with too few tokens never meets tau, even with a high p5
    d = _derive([[0.99, 0.99], [0.99, 0.99], [0.99, 0.99]], [[5, 50], [50, 50], [50, 50]])
    assert d["topk"] == [2, 2]


def test_derive_rejects_bad_input():
    with pytest.raises(ValueError, match="increasing order"):
        _derive([[0.9]] * 3, [[50]] * 3, budgets=(2, 1, 4))
    with pytest.raises(ValueError, match="expected shape"):
        _derive([[0.9]] * 2, [[50]] * 2)
    with pytest.raises(ValueError, match="no bin has"):
        _derive([[0.9]] * 3, [[1]] * 3)


def test_spread_context_lengths():
    assert C.spread_context_lengths(512, 5) == [64, 176, 288, 400, 512]
    assert C.spread_context_lengths(100, 1) == [100]


# ---------------------------------------------------------------- calibration: measured end to end

def _sharp(params, factor=3.0, logit_scale=30.0):
    """Peaky attention (q/k norm weights x factor) and peaky next-token distributions (final norm x
    logit_scale), so dropped pages change the output distribution of a random model."""
    def f(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if "q_norm" in name or "k_norm" in name:
            return x * factor
        return x * logit_scale if name == "norm/weight" else x
    return jax.tree_util.tree_map_with_path(f, params)


def test_calibrate_random_tiny_model(tmp_path):
    config = tiny_config(num_hidden_layers=2, vocab_size=64)
    params = _sharp(init_params(config, seed=3))
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(3, 64, n)) for n in (20, 40, 60, 80, 100, 120)]
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0)
    budgets = (0, 1, 32)  # 32 pages of 8 cover every position here: sparse == dense
    res = C.calibrate(config, params, prompts, budgets, 0.9, BASE, sampling, 2,
                      jax.random.PRNGKey(0), min_count=10)
    table, sched = res["table"], res["schedule"]
    p5, count = np.array(table["p5"], dtype=float), np.array(table["count"])
    assert table["budgets"] == list(budgets) and table["bin_starts"] == [0, 64, 128]
    # every completion token counted once per budget: 12 rows x 24 tokens (none stop: no stop ids)
    assert (count.sum(axis=1) == 12 * 24).all()
    # a budget covering every page is dense attention: alpha == 1 up to rounding
    np.testing.assert_allclose(p5[2][count[2] > 0], 1.0, atol=1e-4)
    assert np.nanmin(p5[0]) < 0.9  # the smallest budget really loses mass somewhere
    # the schedule: non-decreasing, and where a measured budget meets tau the chosen one does
    topk = list(sched.topk)
    assert topk == sorted(topk) and len(topk) == 3
    for b, k in enumerate(topk):
        if count[:, b].max() >= 10 and b not in res["flagged_bins"]:
            i = table["budgets"].index(k)
            assert count[i, b] >= 10 and p5[i, b] >= 0.9
            cheaper = [j for j in range(i) if count[j, b] >= 10 and p5[j, b] >= 0.9 and
                       (b == 0 or table["budgets"][j] >= topk[b - 1])]
            assert not cheaper, f"bin {b}: a cheaper feasible budget {cheaper} was skipped"
    assert sched.meta["tau"] == 0.9 and sched.meta["table"] == table
    # one sparse layer (layer 0 dense): the scorer reproduces the sampler's sparse log-probs
    assert all(v["scorer_logp_max_err"] < 1e-3 for v in res["per_budget"].values())
    sched.to_json(tmp_path / "s.json")
    back = SparsitySchedule.from_json(tmp_path / "s.json")
    assert back == sched and back.meta["table"]["p5"] == table["p5"]


def test_cli_end_to_end(tmp_path):
    workdir = tmp_path / "cal"
    cmd = [sys.executable, "-m", "experiments.calibrate", "--config", "configs/calibrate_tiny.py",
           f"--config.workdir={workdir}", "--config.model.source=tiny", "--config.model.tiny.hidden_size=32",
           "--config.model.tiny.head_dim=16", "--config.model.tiny.intermediate_size=64",
           "--config.task.context_tokens=96", "--config.task.hops=1", "--config.calibration.budgets=(0,2)",
           "--config.calibration.num_prompts=4", "--config.calibration.validate_prompts=2",
           "--config.calibration.samples_per_prompt=1", "--config.calibration.min_count=2",
           "--config.rollout.max_new_tokens=8", "--config.schedule.bin_width=32", "--config.schedule.page_size=8"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    sched = SparsitySchedule.from_json(workdir / "schedule.json")
    assert list(sched.topk) == summary["schedule_topk"] and list(sched.topk) == sorted(sched.topk)
    assert sched.page_size == 8 and sched.bin_width == 32 and sched.dense_layers == (0,)
    table = json.loads((workdir / "calibration.json").read_text())
    assert table["budgets"] == [0, 2] and len(table["p5"][0]) == len(table["bin_starts"])
    assert "p5" in table["validation"] and table["schedule_topk"] == list(sched.topk)
    assert (workdir / "p5_by_position.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
