"""configs/qwen3_math.py end to end at the tiny scale: a random Qwen3 saved as a Hugging Face
directory with a BPE tokenizer and a Qwen-style chat template, a parquet of word problems in
verl's schema, math-verify rewards in the reward pool; two RL steps, metrics, a checkpoint, a
resume; the memory plan's refusal and dry run; the prompt / answer columns a dataset may use."""
import json
import os

import pytest

from configs.qwen3_math import get_config
from experiments.make_tiny_qwen3 import INSTRUCTION, TINY_OVERRIDES, make_tiny_qwen3, word_problems
from sparrow_jax.run.specs import ConfigError, parse_spec

# one xdist worker runs the whole module: its module-scoped fixtures are built once (pytest.ini)
pytestmark = [pytest.mark.xdist_group("test_qwen3_math"), pytest.mark.heavy]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, parquet path) of the tiny stand-ins."""
    return make_tiny_qwen3(str(tmp_path_factory.mktemp("tiny_qwen3")))


def tiny_spec(tiny, workdir, **fields):
    """The shipped config with the tiny overrides (those of the docs' command) and ``fields``."""
    model, data = tiny
    cfg = get_config()
    for key, value in {"model.hf_dir": model, "task.dataset": data, "workdir": str(workdir), **TINY_OVERRIDES,
                       **fields}.items():
        node, *path = key.split(".")[::-1]
        parent = cfg
        for part in reversed(path):
            parent = parent[part]
        parent[node] = value
    return parse_spec(cfg)


def chatml_user_turn(content):
    """What a Qwen chat template renders for one user message with the generation prompt (by hand)."""
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def test_prompts_answers_and_rewards_follow_the_config(tiny, tmp_path):
    """The run's rows carry verl's ground truth as the answer, its prompts are the chat template's
    rendering of the messages, and the reward pool scores the right answer 1 and a wrong one 0."""
    from sparrow_jax.rl.trainer import reward_pool, score
    from sparrow_jax.run.context import build_run_context

    spec = tiny_spec(tiny, tmp_path / "run")
    ctx = build_run_context(spec)
    rows = ctx.eval_rows + ctx.train_rows
    problems = word_problems(16)
    assert len(ctx.eval_rows) == 4 and len(rows) == 16
    for row in rows:
        want = problems[row["extra_info"]["index"]]
        assert row["answer"] == want["answer"]
        assert ctx.encode(row) == ctx.tokenizer.encode(chatml_user_turn(f"{want['question']} {INSTRUCTION}"))
    assert ctx.tokenizer.decode(ctx.encode(rows[0])[:1]) == "<|im_start|>"
    pool = reward_pool(ctx, spec.task.reward_workers, spec.task.reward_timeout_s)
    try:
        answers = [r["answer"] for r in rows[:3]]
        completions = [f"so it is \\boxed{{{answers[0]}}}<|im_end|>", f"\\boxed{{{int(answers[1]) + 1}}}",
                       f"{answers[2]} without a box"]
        assert score(ctx, completions, rows[:3], pool).tolist() == [1.0, 0.0, 0.0]
        assert (pool.num_errors, pool.num_timeouts) == (0, 0)
    finally:
        pool.close()


def test_two_rl_steps_write_metrics_and_a_checkpoint_then_resume(tiny, tmp_path, capsys):
    from experiments.run import main

    workdir = tmp_path / "run"
    main(tiny_spec(tiny, workdir))
    out = capsys.readouterr().out
    assert "[memory] train" in out and "[memory] decode" in out
    logged = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [m["step"] for m in logged] == [0, 1, 2] and "val/dense/reward_greedy" in logged[0]  # step 0: validation
    steps = logged[1:]
    for m in steps:  # every rollout was scored by math-verify in the pool, none failed
        assert (m["reward/errors"], m["reward/timeouts"]) == (0.0, 0.0)
        assert 0.0 <= m["reward_mean"] <= 1.0 and m["response_length/max"] <= 16
        assert m["schedule/topk/bin_0"] == 29  # the published qwen3-1.7b-0.86 schedule
    assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2"]
    report = json.load(open(workdir / "report.json"))
    assert report["steps"] == 2 and report["schedule"]["name"] == "qwen3-1.7b-0.86"

    main(tiny_spec(tiny, workdir, steps=3))
    assert "resumed from checkpoint at step 2" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")] == [0, 1, 2, 3]
    assert "3" in os.listdir(workdir / "checkpoints")


@pytest.fixture()
def qwen3_8b_dir(tiny, tmp_path):
    """A snapshot of Qwen3-8B's architecture without weights (config.json + the tiny tokenizer)."""
    import shutil

    from sparrow_jax.models import Qwen3Config

    path = tmp_path / "Qwen3-8B"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(Qwen3Config.preset("Qwen3-8B").to_hf_dict()))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(tiny[0], name), path)
    return str(path)


def test_memory_plan_refuses_what_cannot_fit_and_names_the_fields(tiny, qwen3_8b_dir, tmp_path, capsys):
    """Qwen3-8B at 32K on 4 devices of 95 GB (a v5p-8): the train step does not fit; 8 of 141 GB do."""
    from sparrow_jax.models.tokenizer import load_tokenizer
    from sparrow_jax.run.memory_check import check_run_memory

    cfg = get_config()
    cfg.model.hf_dir, cfg.task.dataset, cfg.workdir = qwen3_8b_dir, tiny[1], str(tmp_path / "run")
    cfg.mesh.fsdp, cfg.dry_run = 4, True
    spec = parse_spec(cfg)
    with pytest.raises(ConfigError, match=r"the train step needs 1[0-9]{2}\.[0-9] GB per device, the devices have "
                                          r"95\.0 GB; change --config\.train\.micro_batches \(now 4.*max_new_tokens"):
        check_run_memory(spec, device_bytes=95e9)
    plan = capsys.readouterr().out
    tok = load_tokenizer(qwen3_8b_dir)
    longest = max(len(tok.encode(chatml_user_turn(f"{p['question']} {INSTRUCTION}"))) for p in word_problems(16))
    assert f"64 rows x ({longest} prompt + 32768 generated) tokens" in plan
    cfg.mesh.fsdp = 8
    assert check_run_memory(parse_spec(cfg), device_bytes=141e9) is True  # fits; a dry run stops here
    assert not os.path.exists(tmp_path / "run")


def test_decode_plan_covers_the_widest_rollout_of_the_run(tiny, qwen3_8b_dir, tmp_path):
    """The held-out evaluation decodes num_eval x eval_k rows at once: the KV cache is planned for
    them when they outnumber a step's rows (by hand: layers x rows per device x KV heads x head dim
    x page-rounded tokens x (bf16 k and v + a float32 centroid per page))."""
    from sparrow_jax.models import Qwen3Config
    from sparrow_jax.run.memory_check import decode_rows, memory_plan, plan_settings

    cfg = get_config()
    cfg.model.hf_dir, cfg.task.dataset, cfg.workdir = qwen3_8b_dir, tiny[1], str(tmp_path / "run")
    cfg.task.num_eval, cfg.eval_k = 32, 4
    spec = parse_spec(cfg)
    assert decode_rows(spec) == 128 and plan_settings(spec, 100).batch == 64
    plan = memory_plan(Qwen3Config.preset("Qwen3-8B"), plan_settings(spec, 100), dict(data=1, fsdp=8, tensor=1),
                       decode_rows(spec))
    tokens = -(-(100 + 32768) // 16) * 16
    assert plan["decode"]["kv_cache"] == pytest.approx(36 * (128 / 8) * 8 * 128 * tokens * (2 * 2 + 4 / 16))


def test_missing_snapshot_or_columns_are_named(tiny, tmp_path):
    from sparrow_jax.run.memory_check import check_run_memory

    with pytest.raises(ConfigError, match=r"--config\.model\.hf_dir='/nonexistent/Qwen3': is not a directory holding a Hugging Face config\.json"):
        check_run_memory(tiny_spec(tiny, tmp_path / "run", **{"model.hf_dir": "/nonexistent/Qwen3"}))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "1+1?", "solution": "2"}) + "\n")
    with pytest.raises(ConfigError, match=r"--config\.task\.dataset=.*bad\.jsonl.*no prompt column.*'text'"):
        check_run_memory(tiny_spec(tiny, tmp_path / "run", **{"task.dataset": str(bad)}))


def test_dataset_columns_ours_verl_and_raw(tmp_path):
    from sparrow_jax.data.datasets import load_examples

    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in ({"question": "1+1?", "answer": 2},
                                                            {"question": "2+3?", "answer": 5})))
    assert [(r["prompt"], r["answer"]) for r in load_examples(str(plain))] == [("1+1?", "2"), ("2+3?", "5")]
    verl = tmp_path / "verl.jsonl"
    verl.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}],
                                "reward_model": {"style": "rule", "ground_truth": "2"}}) + "\n")
    (row,) = load_examples(str(verl))
    assert row["prompt"] == [{"role": "user", "content": "1+1?"}] and row["answer"] == "2"
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"problem": "", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 has an empty 'problem' \(prompt\)"):
        load_examples(str(empty))


def test_the_docs_command_is_the_tests_overrides():
    doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "real_models.md")).read()
    command = " ".join(doc.split("python -m experiments.make_tiny_qwen3 runs/tiny_qwen3\n", 1)[1].split("```")[0].split())
    for key, value in TINY_OVERRIDES.items():
        assert f"--config.{key}={value} " in command + " ", key
