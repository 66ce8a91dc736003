"""A tiny stand-in for a real run's inputs: a random Qwen3 as a Hugging Face directory and a
parquet of arithmetic word problems in verl's preprocessed schema.

    python -m experiments.make_tiny_qwen3 runs/tiny_qwen3
    # -> runs/tiny_qwen3/model/  (config.json, model.safetensors, tokenizer.json,
    #                             tokenizer_config.json with a Qwen-style chat template,
    #                             generation_config.json)
    #    runs/tiny_qwen3/math.parquet  (16 rows: prompt as chat messages, reward_model.ground_truth)

It prints the command that runs ``configs/qwen3_math.py`` on them at the tiny scale
(:data:`TINY_OVERRIDES`, the ones ``tests/test_qwen3_math.py`` and ``docs/real_models.md`` use).
The tokenizer is a byte-level BPE trained here on the problems and the template's text, with
Qwen3's special tokens.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from absl import flags

from sparrow_jax.run.cli import parse_flags

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Qwen3's template reduced to what a math prompt uses: system / user / assistant turns, the
# generation prompt, and enable_thinking=False's empty think block.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")
INSTRUCTION = "Let's think step by step and put the final answer within \\boxed{}."
NAMES = ("Ann", "Bob", "Cleo", "Dev")
ITEMS = ("apples", "pens", "coins", "books")
# configs/qwen3_math.py at the tiny scale: two RL steps of 2 prompts x 4 samples of 16 tokens on
# one device, one verifier process (the test and docs/real_models.md use exactly these).
TINY_OVERRIDES = {"steps": 2, "checkpoint_every": 1, "eval_k": 2, "task.num_eval": 4, "task.reward_workers": 1,
                  "rollout.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 16,
                  "train.micro_batches": 1, "mesh.fsdp": 1}
MODEL_SHAPE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=2048)


def word_problems(n: int = 16) -> list[dict]:
    """``n`` problems ``{"question", "answer"}``: a sum or a difference of two small numbers."""
    out = []
    for i in range(n):
        name, item = NAMES[i % len(NAMES)], ITEMS[(i // len(NAMES)) % len(ITEMS)]
        a, b = 3 + (7 * i) % 11, 1 + (5 * i) % 7
        if i % 2:
            out.append(dict(question=f"{name} has {a + b} {item} and gives away {b}. How many {item} are left?",
                            answer=str(a)))
        else:
            out.append(dict(question=f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have?",
                            answer=str(a + b)))
    return out


def verl_rows(problems: list[dict]) -> list[dict]:
    """verl's preprocessed schema (``examples/data_preprocess``): chat messages and a ground truth."""
    return [dict(data_source="tiny_arithmetic", ability="math",
                 prompt=[dict(role="user", content=f"{p['question']} {INSTRUCTION}")],
                 reward_model=dict(style="rule", ground_truth=p["answer"]),
                 extra_info=dict(split="train", index=i)) for i, p in enumerate(problems)]


def write_parquet(path: str, n: int = 16) -> str:
    """``n`` word problems in verl's schema as one parquet file; returns ``path``."""
    import datasets

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    datasets.Dataset.from_list(verl_rows(word_problems(n))).to_parquet(path)
    return path


def write_tokenizer(path: str, corpus: list[str], vocab_size: int = 384) -> int:
    """Byte-level BPE with Qwen3's special tokens and chat template in ``path``; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(corpus, trainer)
    os.makedirs(path, exist_ok=True)
    raw.save(os.path.join(path, "tokenizer.json"))
    ids = {t: raw.token_to_id(t) for t in SPECIAL_TOKENS}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None,
                       chat_template=CHAT_TEMPLATE), f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(dict(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"]),
                  f, indent=2)
    return raw.get_vocab_size(with_added_tokens=True)


def write_model(path: str, seed: int = 0) -> str:
    """A random tiny Qwen3 with its tokenizer as a Hugging Face directory; returns ``path``."""
    from sparrow_jax.models import Qwen3Config, init_params, save_hf

    problems = word_problems(64)
    corpus = [f"{p['question']} {INSTRUCTION} The answer is \\boxed{{{p['answer']}}}." for p in problems]
    corpus += ["user assistant system think step by step 0 1 2 3 4 5 6 7 8 9 + - = ."] * 4
    vocab = write_tokenizer(path, corpus)
    config = Qwen3Config(vocab_size=vocab, **MODEL_SHAPE)
    save_hf(path, config, init_params(config, seed))
    return path


def make_tiny_qwen3(out_dir: str, rows: int = 16, seed: int = 0) -> tuple[str, str]:
    """(model directory, parquet path) under ``out_dir``."""
    return write_model(os.path.join(out_dir, "model"), seed), write_parquet(os.path.join(out_dir, "math.parquet"), rows)


def run_command(model: str, data: str, workdir: str) -> str:
    """The ``experiments.run`` command of ``configs/qwen3_math.py`` on the tiny model and data."""
    fields = {"model.hf_dir": model, "task.dataset": data, "workdir": workdir, **TINY_OVERRIDES}
    return "python -m experiments.run --config configs/qwen3_math.py " + " ".join(
        f"--config.{k}={v}" for k, v in fields.items())


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("rows", 16, "word problems in the parquet", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("seed", 0, "seed of the random weights", flag_values=fv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``make_tiny_qwen3 OUT_DIR [--rows N --seed S]``: OUT_DIR receives model/ and math.parquet."""
    args, (out_dir,) = parse_flags(define_flags, argv, __doc__, positionals=1)
    model, data = make_tiny_qwen3(out_dir, args.rows, args.seed)
    print(f"model: {model}\ndata: {data}\nrun it:\n{run_command(model, data, os.path.join(out_dir, 'run'))}")


if __name__ == "__main__":
    main()
