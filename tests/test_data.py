"""Data: pointer-chase generation and verifier, parquet/jsonl datasets, resumable iterator,
math reward, reward pool timeouts, task registry.

Module-level imports stay light: spawned reward workers import this module to find the
test reward functions below.
"""
import json
import os
import pickle
import time

import pytest

from sparrow_jax.data import datasets as ds
from sparrow_jax.data import registry, rewards
from sparrow_jax.data.tasks import pointer_chase as pc


# Reward functions for the pool tests (module level: the spawned workers import them).
def sleepy_reward(completion, example):
    if example.get("raise"):
        raise TimeoutError("the verifier's own")
    time.sleep(example["sleep"])
    return float(example["value"])


def failing_reward(completion, example):
    if example.get("fail"):
        raise ValueError("verifier bug")
    return 1.0


def crashing_reward(completion, example):
    if example.get("crash"):
        os._exit(3)
    return 1.0


def failing_initializer():
    raise ImportError("no verifier here")


def _parse_records(prompt):
    """Independent parser: ({key: value}, the query line's words)."""
    records_line, query_line, tail = prompt.split("\n")
    assert tail == ""
    items = [r for r in records_line.split(";") if r]
    records = dict(item.split("=") for item in items)
    assert len(records) == len(items), "duplicate keys"
    return records, query_line.split(" ")


def _parse_prompt(prompt):
    """Independent parser: ({key: value}, start, hops)."""
    records, (word, start, word2, hops) = _parse_records(prompt)
    assert (word, word2) == ("start", "hops")
    return records, start, int(hops)


# ---------------------------------------------------------------------------------------------
# pointer_chase
# ---------------------------------------------------------------------------------------------

def test_pointer_chase_chain_is_correct():
    for ex in pc.generate(6, seed=3, context_tokens=300, hops=(1, 5)):
        records, start, hops = _parse_prompt(ex["prompt"])
        key, walk = start, []
        for _ in range(hops):            # follow the pointers by hand
            walk.append((key, records[key]))
            key = records[key]
        assert ex["answer"] == key
        lines = ex["reference"].split("\n")
        assert lines[:-1] == [f"{i + 1}:{k}={v}" for i, (k, v) in enumerate(walk)]
        assert lines[-1] == f"answer: {key}"
        assert ex["meta"]["hops"] == hops == len(walk)
        # chain keys are distinct: each hop needs a different record
        assert len({k for k, _ in walk} | {key}) == hops + 1
        # the recorded depths point at the hop records
        order = [r.split("=")[0] for r in ex["prompt"].split("\n")[0].split(";") if r]
        assert [order[i] for i in ex["meta"]["hop_record_index"]] == [k for k, _ in walk]


def test_pointer_chase_deterministic_by_seed():
    a = pc.generate(4, seed=11, context_tokens=256, hops=2)
    assert a == pc.generate(4, seed=11, context_tokens=256, hops=2)
    assert pc.generate(2, seed=11, context_tokens=256, hops=2) == a[:2]     # example i depends on (seed, i)
    b = pc.generate(4, seed=12, context_tokens=256, hops=2)
    assert all(x["prompt"] != y["prompt"] for x, y in zip(a, b))


def test_pointer_chase_context_knob_sets_token_length():
    from sparrow_jax.models.tokenizer import BuiltinTokenizer

    tok = BuiltinTokenizer()
    for target in (256, 1024, 2048):
        ex = pc.generate(1, seed=0, context_tokens=target, hops=3)[0]
        n_tokens = len(tok.encode(ex["prompt"]))
        assert n_tokens == ex["meta"]["prompt_tokens"]
        assert target - 8 < n_tokens <= target                       # within one 8-token record
        records, _, _ = _parse_prompt(ex["prompt"])
        assert len(records) == ex["meta"]["num_records"]
        # every record is exactly 8 tokens (one per symbol, '=', ';')
        assert len(tok.encode(ex["prompt"].split("\n")[0])) == 8 * len(records)


def test_pointer_chase_hops_knob():
    lens = {h: [len(e["reference"].split("\n")) - 1 for e in pc.generate(3, 0, context_tokens=200, hops=h)]
            for h in (1, 4, 7)}
    assert lens == {1: [1, 1, 1], 4: [4, 4, 4], 7: [7, 7, 7]}
    drawn = {e["meta"]["hops"] for e in pc.generate(40, 1, context_tokens=120, hops=(2, 4))}
    assert drawn == {2, 3, 4}


def _near_misses(records, chain):
    """Record keys (not on the chain) one symbol away from some chain key."""
    def dist(a, b):
        return sum(x != y for x, y in zip(a, b))
    return [k for k in records if k not in chain and any(dist(k, c) == 1 for c in chain)]


def test_pointer_chase_distractor_knob():
    ex1 = pc.generate(1, 5, context_tokens=800, hops=3, distractor_frac=1.0)[0]
    ex0 = pc.generate(1, 5, context_tokens=800, hops=3, distractor_frac=0.0)[0]
    n_extra = ex1["meta"]["num_records"] - 4
    rec1, _, _ = _parse_prompt(ex1["prompt"])
    rec0, _, _ = _parse_prompt(ex0["prompt"])
    assert len(_near_misses(rec1, ex1["meta"]["chain"])) == n_extra == ex1["meta"]["num_distractors"]
    assert ex0["meta"]["num_distractors"] == 0
    assert len(_near_misses(rec0, ex0["meta"]["chain"])) < 0.1 * n_extra   # only chance collisions


def test_pointer_chase_knob_errors():
    with pytest.raises(ValueError, match="hops"):
        pc.generate(1, 0, hops=0)
    with pytest.raises(ValueError, match="distractor_frac"):
        pc.generate(1, 0, distractor_frac=1.5)
    with pytest.raises(ValueError, match="key_len"):
        pc.generate(1, 0, context_tokens=4000, key_len=2, alphabet="abcdefgh")


def test_pointer_chase_score():
    ex = pc.generate(1, 2, context_tokens=200, hops=3)[0]
    ans = ex["answer"]
    wrong = "zzzz"
    assert pc.score(ex["reference"], ex) == 1.0
    assert pc.score(ex["reference"] + "<eos>answer: " + wrong + "\n...", ex) == 1.0   # junk after eos
    assert pc.score(ex["reference"] + "<|im_end|>garbage", ex) == 1.0
    assert pc.score(f"answer: {wrong}\nanswer: {ans}", ex) == 1.0                   # the final one counts
    assert pc.score(f"answer: {ans}\nanswer: {wrong}", ex) == 0.0
    assert pc.score(f"answer: {ans}x", ex) == 0.0                                  # longer token is wrong
    assert pc.score(ex["reference"].replace(f"answer: {ans}", f"answer: {wrong}"), ex) == 0.0
    assert pc.score(ex["reference"].rsplit("\n", 1)[0], ex) == 0.0                # no answer line
    assert pc.score("", ex) == 0.0
    with pytest.raises(KeyError, match="answer"):
        pc.score("answer: x", {"prompt": "p"})


# ---------------------------------------------------------------------------------------------
# datasets
# ---------------------------------------------------------------------------------------------

def test_parquet_write_and_load(tmp_path):
    examples = pc.generate(5, 0, context_tokens=100, hops=(1, 3))
    path = ds.write_task_dataset(str(tmp_path / "sub" / "pc.parquet"), examples)
    assert ds.read_task_dataset(path) == examples
    loaded = ds.load_prompt_dataset(path)
    assert len(loaded) == 5
    assert loaded[3]["prompt"] == examples[3]["prompt"] and loaded[3]["answer"] == examples[3]["answer"]
    assert set(loaded.column_names) == {"prompt", "reference", "answer", "meta"}
    # a directory of parquet files loads as one dataset
    ds.write_task_dataset(str(tmp_path / "sub" / "pc2.parquet"), examples[:2])
    assert len(ds.load_prompt_dataset(str(tmp_path / "sub"))) == 7
    assert len(ds.load_prompt_dataset(path, split="train[:2]")) == 2


def test_jsonl_with_renamed_columns(tmp_path):
    rows = [{"problem": f"what is {i}+1?", "solution": str(i + 1), "level": i} for i in range(4)]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    loaded = ds.load_prompt_dataset(str(path), prompt_column="problem", answer_column="solution")
    assert loaded.column_names == ["prompt", "answer", "level"]
    assert [r["answer"] for r in loaded] == ["1", "2", "3", "4"]
    # a dataset that already has 'prompt' and a different prompt column cannot be renamed
    path2 = tmp_path / "c.json"
    path2.write_text(json.dumps([{"prompt": "a", "q": "b", "answer": "c"}]))
    with pytest.raises(ValueError, match="already exists"):
        ds.load_prompt_dataset(str(path2), prompt_column="q")


def test_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        ds.load_prompt_dataset(str(tmp_path / "nope.parquet"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"unsupported extension '.csv'"):
        ds.load_prompt_dataset(str(tmp_path / "x.csv"))
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(KeyError, match=r"prompt column 'prompt' not found; columns present: \['question', 'answer'\]"):
        ds.load_prompt_dataset(str(path))
    with pytest.raises(KeyError, match=r"answer column 'sol' not found"):
        ds.load_prompt_dataset(str(path), prompt_column="question", answer_column="sol")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="holds no"):
        ds.load_prompt_dataset(str(empty))
    with pytest.raises(ValueError, match="no examples"):
        ds.write_task_dataset(str(tmp_path / "e.parquet"), [])


def _rows(n):
    return [{"prompt": f"p{i}", "answer": str(i)} for i in range(n)]


def test_iterator_resume_equals_uninterrupted():
    data = _rows(10)
    full = ds.PromptIterator(data, batch_size=4, seed=3)
    reference = [[r["prompt"] for r in next(full)] for _ in range(8)]       # 32 rows: 3+ epochs

    first = ds.PromptIterator(data, batch_size=4, seed=3)
    head = [[r["prompt"] for r in next(first)] for _ in range(3)]          # stops mid-epoch 1
    state = json.loads(json.dumps(first.state()))                          # survives JSON (checkpoints)
    resumed = ds.PromptIterator(data, batch_size=4, seed=3)
    resumed.restore(state)
    tail = [[r["prompt"] for r in next(resumed)] for _ in range(5)]
    assert head + tail == reference

    flat = [p for b in reference for p in b]
    epochs = [flat[0:10], flat[10:20], flat[20:30]]
    for e in epochs:                                   # each epoch visits every row once
        assert sorted(e) == sorted(r["prompt"] for r in data)
    assert epochs[0] != epochs[1] != epochs[2]         # and reshuffles
    assert flat[:10] != [r["prompt"] for r in data]


def test_iterator_on_hf_dataset_matches_list(tmp_path):
    import datasets

    data = _rows(7)
    a = ds.PromptIterator(datasets.Dataset.from_list(data), batch_size=3, seed=1)
    b = ds.PromptIterator(data, batch_size=3, seed=1)
    for _ in range(4):
        assert next(a) == next(b)


def test_iterator_no_shuffle_finite_and_errors():
    it = ds.PromptIterator(_rows(5), batch_size=2, seed=0, shuffle=False, num_epochs=1)
    assert [[r["answer"] for r in b] for b in it] == [["0", "1"], ["2", "3"], ["4"]]
    it = ds.PromptIterator(_rows(5), batch_size=2, seed=0)
    with pytest.raises(ValueError, match="seed=1"):
        ds.PromptIterator(_rows(5), batch_size=2, seed=1).restore(it.state())
    with pytest.raises(ValueError, match="num_examples"):
        ds.PromptIterator(_rows(6), batch_size=2, seed=0).restore(it.state())
    with pytest.raises(ValueError, match="batch_size"):
        ds.PromptIterator(_rows(5), batch_size=0)
    with pytest.raises(ValueError, match="empty"):
        ds.PromptIterator([], batch_size=1)


# ---------------------------------------------------------------------------------------------
# rewards
# ---------------------------------------------------------------------------------------------

def test_last_boxed():
    assert rewards.last_boxed(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert rewards.last_boxed(r"\boxed{3} then \boxed{4}") == "4"
    assert rewards.last_boxed(r"\boxed 7 done") == "7"
    assert rewards.last_boxed(r"\boxed{unclosed") is None
    assert rewards.last_boxed("no box") is None


@pytest.mark.parametrize("completion, answer, want", [
    (r"The answer is \boxed{1/2}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{2}{4}}", "1/2", 1.0),
    (r"\boxed{1+x^2}", "x^2+1", 1.0),
    (r"\boxed{3}", "4", 0.0),
    (r"\boxed{3} no wait \boxed{4}", "4", 1.0),
    (r"\boxed{3} no wait \boxed{4}", "3", 0.0),
    (r"\boxed{4}<|im_end|> \boxed{5}", "4", 1.0),
    ("the answer is 4", "4", 0.0),                 # no \boxed{}: not accepted
])
def test_math_reward(completion, answer, want):
    assert rewards.math_reward(completion, answer) == want


def test_reward_pool_timeout_replaces_worker():
    examples = [{"sleep": 0.0, "value": 1.0}, {"sleep": 60.0, "value": 1.0}, {"sleep": 0.0, "value": 0.5}]
    with rewards.RewardPool(sleepy_reward, num_workers=2, timeout_s=0.5) as pool:
        t0 = time.monotonic()
        assert pool.score_batch(["a", "b", "c"], examples) == [1.0, 0.0, 0.5]
        assert time.monotonic() - t0 < 20          # worker start-up + one 0.5 s timeout, not 60 s
        assert pool.num_timeouts == 1
        # the pool still serves after losing a worker
        t0 = time.monotonic()
        assert pool.score_batch(["x"] * 4, [{"sleep": 0.0, "value": 0.25}] * 4) == [0.25] * 4
        assert pool.num_timeouts == 1
        # a TimeoutError the verifier raises is its error, not the pool's timeout
        assert pool.score_batch(["y"], [{"raise": True}]) == [0.0]
        assert (pool.num_timeouts, pool.num_errors, pool.last_error) == (1, 1, "TimeoutError: the verifier's own")
    with pytest.raises(RuntimeError, match="closed"):
        pool.score_batch(["x"], [{"sleep": 0.0, "value": 0.25}])


def test_reward_pool_errors_and_crashes_score_zero():
    with rewards.RewardPool(failing_reward, num_workers=1, timeout_s=5.0) as pool:
        assert pool.score_batch(["a", "b", "c"], [{}, {"fail": True}, {}]) == [1.0, 0.0, 1.0]
        assert pool.num_errors == 1 and "verifier bug" in pool.last_error
    with rewards.RewardPool(crashing_reward, num_workers=1, timeout_s=5.0) as pool:
        assert pool.score_batch(["a", "b", "c"], [{}, {"crash": True}, {}]) == [1.0, 0.0, 1.0]
        assert pool.num_errors == 1 and "code 3" in pool.last_error
    with pytest.raises(ValueError, match="2 completions but 1 examples"):
        rewards.RewardPool(failing_reward, num_workers=0).score_batch(["a", "b"], [{}])


def test_reward_pool_start_up_failures_raise_instead_of_scoring_zero():
    with rewards.RewardPool(failing_reward, num_workers=1, initializer=failing_initializer) as pool:
        with pytest.raises(RuntimeError, match="exit on start-up"):
            pool.score_batch(["a"], [{}])
    with rewards.RewardPool(lambda c, e: 1.0, num_workers=1) as pool:  # spawned workers cannot unpickle it
        with pytest.raises((pickle.PicklingError, AttributeError)):
            pool.score_batch(["a"], [{}])


def test_math_task_through_pool():
    task = registry.get_task("math")
    assert task.use_reward_pool
    with rewards.RewardPool(task.reward, num_workers=1, timeout_s=10.0,
                            initializer=task.reward_pool_initializer) as pool:
        got = pool.score_batch([r"\boxed{1/2}", r"\boxed{2}", "no answer"],
                               [{"answer": "0.5"}, {"answer": "3"}, {"answer": "1"}])
    assert got == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------

def test_registry_builtins_and_errors():
    from sparrow_jax.models.tokenizer import BuiltinTokenizer

    tok = BuiltinTokenizer()
    assert {"pointer_chase", "math"} <= set(registry.list_tasks())
    task = registry.get_task("pointer_chase")
    ex = task.generate(1, 0, context_tokens=100, hops=2)[0]
    assert task.format_prompt(ex, tok) == ex["prompt"]      # identity template for the builtin tokenizer
    assert task.reward(ex["reference"], ex) == 1.0
    math_text = registry.get_task("math").format_prompt({"prompt": "1+1?"}, tok)
    assert math_text.startswith("1+1?\n") and "\\boxed{}" in math_text
    with pytest.raises(KeyError, match=r"unknown task 'nope'; known tasks: \[.*'math'.*'pointer_chase'"):
        registry.get_task("nope")
    with pytest.raises(ValueError, match="already registered"):
        registry.register_task("math", task.format_prompt, task.reward)
    with pytest.raises(TypeError, match="reward must be callable"):
        registry.register_task("t_bad", task.format_prompt, None)


def test_register_custom_task():
    name = "test_echo_task"
    registry.register_task(name, lambda ex, tok: ex["prompt"], lambda c, ex: float(c == ex["answer"]),
                           overwrite=True)
    t = registry.get_task(name)
    assert t.reward("x", {"answer": "x"}) == 1.0 and t.reward("y", {"answer": "x"}) == 0.0
    assert t.generate is None


# ---------------------------------------------------------------------------------------------
# pointer_trace: long traces with partial credit
# ---------------------------------------------------------------------------------------------

TRACE_EXAMPLE = {  # hand-written: ab -> cd -> ef -> gh (terminal), a distractor ax=ab
    "prompt": "cd=ef;ax=ab;ab=cd;ef=gh;gh=##;\nstart ab\n",
    "reference": "ab=cd\ncd=ef\nef=gh\ngh=##\nanswer: gh",
    "answer": "gh",
}


@pytest.mark.parametrize("completion, want", [
    ("ab=cd\ncd=ef\nef=gh\ngh=##\nanswer: gh", 1.0),               # all 4 lines and the answer
    ("ab=cd\ncd=ef\nef=gh\ngh=##\nanswer: gh<eos>junk", 1.0),      # text after <eos> ignored
    ("ab=cd\ncd=ef\nef=gx\ngx=##\nanswer: gx", 2 / 5),             # third line wrong: 2 of 4 + answer
    ("ab=cd\ncd=xx\nef=gh\ngh=##\nanswer: gh", 1 / 5),             # right lines and answer after an error: 0
    ("ab=cd\ncd=ef\n", 2 / 5),                                      # stopped early, no answer line
    ("ab=cd\ncd=ef\nef=gh\ngh=##<eos>\nanswer: gh", 4 / 5),        # the answer after <eos> does not count
    ("answer: gh", 0.0),                                              # a guessed answer alone: nothing
    (" ab=cd\ncd=ef \nef=gh\ngh=##\nanswer: gh", 1.0),             # spaces around a line ignored
    ("ab=cd\ncd=ef\nef=gh\ngh=ax\nax=ab\nanswer: ab", 3 / 5),     # missed the terminal: ran on
    ("", 0.0),
])
def test_pointer_trace_score_hand_checked(completion, want):
    from sparrow_jax.data.tasks import pointer_trace as pt

    assert pt.score(completion, TRACE_EXAMPLE) == pytest.approx(want)


def _parse_trace_prompt(prompt):
    """Independent parser: ({key: value}, start)."""
    records, (word, start) = _parse_records(prompt)
    assert word == "start"
    return records, start


def test_pointer_trace_generates_long_traces_with_the_prompt_length_knob():
    from sparrow_jax.data.tasks import pointer_trace as pt
    from sparrow_jax.models.tokenizer import BuiltinTokenizer

    tok = BuiltinTokenizer()
    for context in (400, 900):
        for ex in pt.generate(3, seed=5, context_tokens=context, hops=40):
            records, start = _parse_trace_prompt(ex["prompt"])
            assert all(len(k) == 2 for k in records)                     # default 2-symbol keys
            assert list(records.values()).count("##") == 1               # one terminal record
            key, lines = start, []
            while key != "##":                                           # follow the pointers by hand
                lines.append(f"{key}={records[key]}")
                last, key = key, records[key]
                assert len(lines) <= len(records), "the chain must reach the terminal"
            assert len(lines) == 41 == ex["meta"]["trace_lines"] and ex["answer"] == last
            assert ex["reference"] == "\n".join(lines) + f"\nanswer: {last}"
            assert pt.score(ex["reference"], ex) == 1.0
            assert 0 <= context - len(tok.encode(ex["prompt"])) <= 12   # within two 6-token records
            assert ex["meta"]["prompt_tokens"] == len(tok.encode(ex["prompt"]))
            assert len(tok.encode(ex["reference"])) == 41 * 6 + 5        # 6 tokens a line, 'answer: xx'
    # more hops than the records a context holds: the prompt grows to hold the chain
    ex = pt.generate(1, seed=0, context_tokens=60, hops=30)[0]
    assert len(_parse_trace_prompt(ex["prompt"])[0]) >= 31
    assert pt.generate(2, seed=7, hops=8) == pt.generate(2, seed=7, hops=8)
    with pytest.raises(ValueError, match="hops must be"):
        pt.generate(1, seed=0, hops=0)


def test_pointer_trace_preamble_adds_exactly_its_tokens_before_the_same_records():
    import re

    from sparrow_jax.data.tasks import pointer_trace as pt
    from sparrow_jax.models.tokenizer import BuiltinTokenizer

    tok = BuiltinTokenizer()
    plain = pt.generate(3, seed=5, context_tokens=200, hops=12)
    for n in (1, 2, 7, 150):
        padded = pt.generate(3, seed=5, context_tokens=200, hops=12, preamble_tokens=n)
        for ex, ref in zip(padded, plain):
            head, tail = ex["prompt"][:n], ex["prompt"][n:]
            assert tail == ref["prompt"] and ex["reference"] == ref["reference"] and ex["answer"] == ref["answer"]
            assert re.fullmatch(r"[A-Z ]*\n", head) and not head.startswith(" ")   # uppercase words, then a newline
            assert len(tok.encode(ex["prompt"])) - len(tok.encode(ref["prompt"])) == n == len(tok.encode(head))
            assert ex["meta"]["prompt_tokens"] == len(tok.encode(ex["prompt"]))
            assert pt.score(ex["reference"], ex) == 1.0
    texts = [ex["prompt"][:150] for ex in pt.generate(3, seed=5, context_tokens=200, hops=12, preamble_tokens=150)]
    assert len(set(texts)) == 3                                            # each example its own preamble
    with pytest.raises(ValueError, match="preamble_tokens"):
        pt.generate(1, seed=0, hops=4, preamble_tokens=-1)


def test_pointer_trace_in_registry():
    from sparrow_jax.models.tokenizer import BuiltinTokenizer

    task = registry.get_task("pointer_trace")
    ex = task.generate(1, 3, context_tokens=200, hops=12)[0]
    assert task.format_prompt(ex, BuiltinTokenizer()) == ex["prompt"]
    assert task.reward(ex["reference"], ex) == 1.0
    first_wrong = "zz" + ex["reference"][2:]
    assert task.reward(first_wrong, ex) == 0.0                           # answer right after an error: nothing
    second_wrong = ex["reference"].replace("\n", "\nzz", 1)
    assert task.reward(second_wrong, ex) == pytest.approx(1 / 14)         # 1 of 13 lines + the answer
