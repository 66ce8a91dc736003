"""recurrence_trace: the reference follows the stated rule from the prompt alone, knobs do what
they say, bad knobs are refused, and the reward gives partial credit."""
import pytest
from task_refs import solve_recurrence_prompt

from sparrow_jax.data.registry import get_task
from sparrow_jax.data.tasks import recurrence_trace as rt
from sparrow_jax.models.tokenizer import BuiltinTokenizer


@pytest.mark.parametrize("far_every,min_lines", [(10, 60), (5, (30, 50)), (20, 130)])
def test_reference_is_the_rule_applied_to_the_prompt(far_every, min_lines):
    examples = rt.generate(6, seed=3, context_tokens=700, min_lines=min_lines, far_every=far_every)
    lo, hi = (min_lines, min_lines) if isinstance(min_lines, int) else min_lines
    for ex in examples:
        lines = ex["reference"].split("\n")
        assert lines == solve_recurrence_prompt(ex["prompt"], far_every)
        assert lo <= len(lines) < hi + 2 * far_every  # ends at the first fresh look-up past min_lines
        assert ex["answer"] == lines[-1] and lines[-1].endswith("=#")
        assert ex["meta"]["lookups"] == sum(1 for line in lines[2:] if "=" in line)
        assert ex["prompt"].count("=#;") == 1  # one terminal constant in the table


@pytest.mark.parametrize("far_every,min_lines", [(10, 240), (5, (40, 80))])
def test_one_letter_keys_follow_the_rule_from_a_twenty_key_table(far_every, min_lines):
    tok = BuiltinTokenizer()
    examples = rt.generate(6, seed=4, context_tokens=104, min_lines=min_lines, far_every=far_every, key_letters=1)
    lo = min_lines if isinstance(min_lines, int) else min_lines[0]
    for ex in examples:
        lines = ex["reference"].split("\n")
        assert lines == solve_recurrence_prompt(ex["prompt"], far_every, key_letters=1)
        assert len(lines) >= lo and lines[-1].endswith("=#") and ex["prompt"].count("=#;") == 1
        records = [r for r in ex["prompt"].split("\n")[0].split(";") if r]
        assert len(records) == (104 - 16) // 4 and {r[0] for r in records} >= set("abcdefghijklmnopqrst")
        assert all(len(tok.encode(r + ";")) == 4 for r in records)
        assert {len(tok.encode(line)) for line in lines} == {4, 6}  # + newline: 5 and 7 tokens a line
        keys = {line.split(":")[1][0] for line in lines[2:-1] if "=" in line}
        assert len(keys) >= 4  # the trace does not cycle through one or two keys


def test_lookup_share_and_token_shape():
    ex = rt.generate(1, seed=0, context_tokens=600, min_lines=200, far_every=10)[0]
    lines = ex["reference"].split("\n")
    lookups = [line for line in lines[2:] if "=" in line]
    assert abs(len(lookups) / len(lines) - 0.1) < 0.02
    tok = BuiltinTokenizer()
    assert {len(tok.encode(line)) for line in lines} == {4, 7}  # + newline: 5 and 8 tokens a line


def test_knobs_set_prompt_length_and_distance():
    tok = BuiltinTokenizer()
    short = rt.generate(2, seed=1, context_tokens=520, min_lines=40)
    long = rt.generate(2, seed=1, context_tokens=1200, min_lines=40)
    gapped = rt.generate(2, seed=1, context_tokens=520, min_lines=40, gap_tokens=300)
    for s, l, g in zip(short, long, gapped):
        assert abs(len(tok.encode(l["prompt"])) - 1200) <= 16
        assert len(tok.encode(g["prompt"])) == len(tok.encode(s["prompt"])) + 300
        assert g["reference"] == s["reference"]  # the gap moves the table back, the trace is the same
    assert [e["prompt"] for e in rt.generate(2, seed=1, context_tokens=520, min_lines=40)] == [e["prompt"] for e in short]


@pytest.mark.parametrize("kwargs,match", [
    ({"far_every": 7}, "far_every must be a divisor of 100"),
    ({"min_lines": 1}, "min_lines"),
    ({"min_lines": (50, 40)}, "min_lines"),
    ({"gap_tokens": -1}, "gap_tokens"),
    ({"context_tokens": 10 ** 6}, "context_tokens"),
    ({"context_tokens": 124, "key_letters": 1}, "context_tokens=124 needs more table entries than the 26 keys"),
    ({"key_letters": 3}, "key_letters must be 1 or 2"),
])
def test_bad_knobs_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rt.generate(1, seed=0, **kwargs)


def test_score_partial_credit_and_registry():
    ex = rt.generate(1, seed=2, min_lines=50)[0]
    lines = ex["reference"].split("\n")
    task = get_task("recurrence_trace")
    assert task.reward(ex["reference"] + "<eos>junk", ex) == 1.0
    wrong = lines[:10] + ["99:0"] + lines[11:]
    assert task.reward("\n".join(wrong), ex) == pytest.approx(10 / len(lines))
    assert task.reward("", ex) == 0.0
    with pytest.raises(KeyError, match="reference"):
        task.reward("00:1", {"prompt": "x"})
    assert task.format_prompt(ex, BuiltinTokenizer()).endswith(ex["prompt"])  # the tiny model reads it raw


def test_reward_horizon_ends_at_the_first_wrong_line():
    example = {"reference": "00 ab\n01 cd\n02 ef"}
    reward_horizon, score = rt.reward_horizon, rt.score
    assert reward_horizon("00 ab\n01 cX\n02 ef<eos>", example) == len("00 ab\n01 cX\n")
    assert reward_horizon("0X ab\n01 cd", example) == len("0X ab\n")
    assert reward_horizon("00 ab\n01 cd", example) == len("00 ab\n01 cd")  # stopped early: all of it counts
    assert reward_horizon("00 ab\n01 cd\n02 ef<eos>", example) is None  # every line right
    assert get_task("recurrence_trace").reward_horizon is reward_horizon
    assert get_task("pointer_trace").reward_horizon is None
    # the score agrees: nothing after the horizon changes it
    wrong = "00 ab\n01 cX\n"
    assert score(wrong + "02 ef", example) == score(wrong + "zz zz\nqq", example)


def test_the_loss_mask_keeps_each_completion_through_its_horizon():
    """trainer.reward_horizon_mask on a rollout of three rows: a wrong second line, every line right,
    and a token (the word token ``<eos>``) spanning the horizon's end; trainer.horizon_line_mask: the
    tokens of each row's first wrong line."""
    from types import SimpleNamespace

    import numpy as np

    from sparrow_jax.rl.trainer import horizon_line_mask, reward_horizon_mask

    tok = BuiltinTokenizer()
    example = {"reference": "00 ab\n01 cd"}
    completions = ["00 ab\n01 cX\n02 zz", "00 ab\n01 cd<eos>", "00 aX<eos>"]
    prompt = tok.encode("p:")
    rows = [prompt + tok.encode(c) for c in completions]
    width = max(map(len, rows)) + 3
    tokens = np.zeros((3, width), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    rollout = SimpleNamespace(tokens=tokens, prompt_lens=np.full(3, len(prompt)),
                              lengths=np.array(list(map(len, rows))))
    ctx = SimpleNamespace(tokenizer=tok, task=get_task("recurrence_trace"))
    mask = reward_horizon_mask(ctx, rollout, [example] * 3, width)
    kept = mask.sum(axis=1).astype(int).tolist()
    assert kept == [len(tok.encode(c)) for c in ("00 ab\n01 cX\n", "00 ab\n01 cd<eos>", "00 aX<eos>")]
    assert (mask[:, :len(prompt)] == 0).all() and (mask[0, len(prompt):len(prompt) + kept[0]] == 1).all()
    # the line the horizon falls in: the first wrong line, none where every line is right
    line = horizon_line_mask(ctx, rollout, [example] * 3, width)
    first = [len(prompt) + len(tok.encode(c)) for c in ("00 ab\n", "", "")]
    assert line.sum(axis=1).astype(int).tolist() == [len(tok.encode("01 cX\n")), 0, len(tok.encode("00 aX<eos>"))]
    assert (line[0, first[0]:first[0] + 6] == 1).all() and (line * (1 - mask) == 0).all()
