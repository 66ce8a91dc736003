"""Tokenizers: builtin round trips and ids, HF tokenizer from a locally built tokenizer.json,
special tokens from the config files, chat templates (checked against transformers)."""
import json
import os

import pytest

from sparrow_jax.models.tokenizer import (BUILTIN_WORD_TOKENS, BuiltinTokenizer, HFTokenizer, Tokenizer,
                                          load_tokenizer)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% set ns = namespace(n=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + message['role']) }}{% endif %}"
    "{% set ns.n = ns.n + 1 %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


# ---------------------------------------------------------------------------------------------
# Builtin
# ---------------------------------------------------------------------------------------------

def test_builtin_vocab_layout():
    tok = BuiltinTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.stop_ids == (2,)
    assert tok.vocab_size <= 128
    assert len(set(tok.vocab)) == tok.vocab_size          # no duplicate token strings
    assert isinstance(tok, Tokenizer)


def test_builtin_chars_are_one_token_each():
    tok = BuiltinTokenizer()
    text = "k3f=a9x;b2c=k3f;\n"
    # Independent reference: index of each character in the published vocabulary.
    assert tok.encode(text) == [tok.vocab.index(c) for c in text]


def test_builtin_word_tokens_longest_match():
    tok = BuiltinTokenizer()
    ids = tok.encode("answer: q1z")
    assert ids[0] == tok.vocab.index("answer")
    assert len(ids) == 1 + len(": q1z")
    assert tok.encode("a->b") == [tok.vocab.index("a"), tok.vocab.index("->"), tok.vocab.index("b")]
    # "<eos>" in text is the eos id; "<e" alone is two characters.
    assert tok.encode("x<eos>") == [tok.vocab.index("x"), tok.eos_id]
    assert tok.encode("<e") == [tok.vocab.index("<"), tok.vocab.index("e")]


def test_builtin_round_trip_all_printable_and_words():
    tok = BuiltinTokenizer()
    text = "".join(chr(c) for c in range(32, 127)) + "\n" + " ".join(BUILTIN_WORD_TOKENS) + "<bos><pad>"
    assert tok.decode(tok.encode(text)) == text
    # Fewer tokens than characters: the words (and specials) were merged.
    assert len(tok.encode(text)) < len(text)


def test_builtin_specials_and_skip():
    tok = BuiltinTokenizer()
    ids = tok.encode("ab", add_special_tokens=True) + [tok.eos_id, tok.pad_id]
    assert ids[0] == tok.bos_id
    assert tok.decode(ids) == "<bos>ab<eos><pad>"
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_builtin_errors():
    tok = BuiltinTokenizer()
    with pytest.raises(ValueError, match=r"'é'.*position 3"):
        tok.encode("abcé")
    with pytest.raises(ValueError, match=r"id 111 at position 1"):
        tok.decode([3, tok.vocab_size])
    with pytest.raises(ValueError, match="content"):
        tok.apply_chat_template([{"role": "user"}])


def test_builtin_chat_template_is_identity():
    tok = BuiltinTokenizer()
    msgs = [{"role": "user", "content": "k3f=a9x;\n"}, {"role": "user", "content": "start k3f hops 1\n"}]
    assert tok.apply_chat_template(msgs) == "k3f=a9x;\nstart k3f hops 1\n"


# ---------------------------------------------------------------------------------------------
# Hugging Face tokenizer, built locally
# ---------------------------------------------------------------------------------------------

def _build_tokenizer_json(path):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["the answer is 42", "follow the pointer to the next key", "what is one half? 1/2",
              "reason step by step and box the answer"] * 5
    raw.train_from_iterator(corpus, trainer)
    raw.save(os.path.join(path, "tokenizer.json"))
    return raw


@pytest.fixture()
def hf_dir(tmp_path):
    raw = _build_tokenizer_json(tmp_path)
    ids = {t: raw.token_to_id(t) for t in SPECIALS}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(
        eos_token={"__type": "AddedToken", "content": "<|im_end|>", "special": True},  # dict form
        pad_token="<|endoftext|>", bos_token=None, chat_template=CHATML)))
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"])))
    return tmp_path, ids


def test_hf_special_ids_from_configs(hf_dir):
    path, ids = hf_dir
    tok = HFTokenizer.from_dir(str(path))
    assert tok.eos_id == ids["<|im_end|>"]
    assert tok.stop_ids == (ids["<|im_end|>"], ids["<|endoftext|>"])
    assert tok.pad_id == ids["<|endoftext|>"]
    assert tok.bos_id is None
    assert tok.vocab_size == 300
    assert isinstance(tok, Tokenizer)


def test_hf_round_trip_and_specials(hf_dir):
    path, ids = hf_dir
    tok = load_tokenizer(str(path))
    text = "the answer is \\boxed{1/2} — ünïcode ok\n"
    enc = tok.encode(text)
    assert tok.decode(enc) == text
    assert len(enc) < len(text.encode("utf-8"))         # merges learned from the corpus were used
    enc = tok.encode("hi<|im_end|>")
    assert enc[-1] == ids["<|im_end|>"]
    assert tok.decode(enc, skip_special_tokens=True) == "hi"


def test_hf_chat_template_matches_hand_and_transformers(hf_dir):
    path, _ = hf_dir
    tok = HFTokenizer.from_dir(str(path))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " 1+1? "}]
    expected = ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert tok.apply_chat_template(msgs) == expected
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == expected[:-len("<|im_start|>assistant\n")]
    assert tok.apply_chat_template(msgs, enable_thinking=False) == expected + "<think>\n\n</think>\n\n"
    with pytest.raises(Exception, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])

    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    for kwargs in ({}, {"add_generation_prompt": False}, {"enable_thinking": False}):
        want = ref.apply_chat_template(msgs, tokenize=False, **{"add_generation_prompt": True, **kwargs})
        assert tok.apply_chat_template(msgs, **kwargs) == want, kwargs
    assert tok.encode(expected) == list(ref.encode(expected, add_special_tokens=False))


def test_hf_chat_template_jinja_file_preferred(hf_dir):
    path, _ = hf_dir
    (path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ eos_token }}")
    tok = HFTokenizer.from_dir(str(path))
    assert tok.apply_chat_template([{"role": "user", "content": "a"}]) == "[a]<|im_end|>"


def test_hf_defaults_without_configs(tmp_path):
    raw = _build_tokenizer_json(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(dict(eos_token_id=raw.token_to_id("<|endoftext|>"))))
    tok = HFTokenizer.from_dir(str(tmp_path))
    assert tok.eos_id == raw.token_to_id("<|endoftext|>")
    assert tok.pad_id == tok.eos_id                      # pad falls back to eos
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_hf_errors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json not found.*config.json"):
        HFTokenizer.from_dir(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFTokenizer.from_dir(str(tmp_path / "nope"))
    _build_tokenizer_json(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(eos_token="<|missing|>")))
    with pytest.raises(ValueError, match=r"eos_token '<\|missing\|>' is not in the tokenizer vocabulary"):
        HFTokenizer.from_dir(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no eos token"):
        HFTokenizer.from_dir(str(tmp_path))


def test_load_tokenizer_dispatch(tmp_path):
    assert isinstance(load_tokenizer("builtin"), BuiltinTokenizer)
    tok = BuiltinTokenizer()
    assert load_tokenizer(tok) is tok
    with pytest.raises(ValueError, match="neither 'builtin' nor an existing directory"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(TypeError, match="tokenizer spec"):
        load_tokenizer(3)
