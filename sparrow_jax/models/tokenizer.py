"""Tokenizers: one interface, two implementations.

* ``HFTokenizer``: a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library) with special
  tokens from ``tokenizer_config.json`` / ``generation_config.json`` and the chat template rendered
  with jinja2 the way ``transformers`` renders it (no ``transformers`` import needed).
* ``BuiltinTokenizer``: a fixed, tiny vocabulary (< 128 ids) for the synthetic tasks and tiny
  models. Greedy longest match over a few word tokens, otherwise one token per character;
  ``decode(encode(text)) == text`` exactly for any printable-ASCII text.

``load_tokenizer("builtin")`` or ``load_tokenizer("/path/to/model_dir")`` picks one.
"""
from __future__ import annotations

import json
import os
import re
from datetime import datetime
from typing import Any, Protocol, Sequence, runtime_checkable

Message = dict[str, Any]


@runtime_checkable
class Tokenizer(Protocol):
    """What the sampler, the trainer and the data pipeline need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...          # number of token ids the tokenizer can produce

    @property
    def eos_id(self) -> int: ...              # the id generation appends / stops on

    @property
    def stop_ids(self) -> tuple[int, ...]: ...  # every id that ends a generation (eos_id included)

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...       # None when the model has no BOS token (Qwen3)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...


# --------------------------------------------------------------------------------------------
# Built-in tokenizer
# --------------------------------------------------------------------------------------------

BUILTIN_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
# Multi-character tokens. Words are >= 4 lowercase letters or contain symbols, so random 3-symbol
# keys of the synthetic tasks ([a-z0-9]) never contain one and always tokenize one char per token.
BUILTIN_WORD_TOKENS = ("answer", "start", "hops", "follow", "records", "query", "value", "steps",
                       "->", "<think>", "</think>", "\\boxed{")
BUILTIN_CHARS = ("\n",) + tuple(chr(c) for c in range(32, 127))  # newline + printable ASCII


class BuiltinTokenizer:
    """Fixed vocabulary: ids 0..2 = <pad>, <bos>, <eos>; then newline and printable ASCII (one
    token per character); then a few word tokens. vocab_size = 111.

    Encoding is greedy longest match (special-token strings such as ``"<eos>"`` in the text
    become their id). Text with any other character raises ``ValueError`` naming it.
    """

    def __init__(self):
        self._vocab: tuple[str, ...] = BUILTIN_SPECIAL_TOKENS + BUILTIN_CHARS + BUILTIN_WORD_TOKENS
        self._ids = {tok: i for i, tok in enumerate(self._vocab)}
        if len(self._ids) != len(self._vocab):
            raise AssertionError("BuiltinTokenizer vocabulary has duplicate tokens")
        multi = sorted((t for t in self._vocab if len(t) > 1), key=len, reverse=True)
        # Alternation is leftmost-first in `re`, so longest tokens first gives longest match;
        # the final `.` (DOTALL) catches single characters, unknown ones included (checked below).
        self._pattern = re.compile("|".join(re.escape(t) for t in multi) + "|.", re.DOTALL)
        self._special_ids = frozenset(self._ids[t] for t in BUILTIN_SPECIAL_TOKENS)

    vocab_size = property(lambda self: len(self._vocab))
    pad_id = property(lambda self: self._ids["<pad>"])
    bos_id = property(lambda self: self._ids["<bos>"])
    eos_id = property(lambda self: self._ids["<eos>"])
    stop_ids = property(lambda self: (self._ids["<eos>"],))
    pad_token = property(lambda self: "<pad>")
    bos_token = property(lambda self: "<bos>")
    eos_token = property(lambda self: "<eos>")

    @property
    def vocab(self) -> tuple[str, ...]:
        """Token strings by id."""
        return self._vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids; ``add_special_tokens`` prepends <bos>."""
        ids = [self.bos_id] if add_special_tokens else []
        get = self._ids.get
        for m in self._pattern.finditer(text):
            tid = get(m.group())
            if tid is None:
                ch = m.group()
                raise ValueError(f"BuiltinTokenizer: character {ch!r} (U+{ord(ch):04X}) at position "
                                 f"{m.start()} is not in the vocabulary (newline and printable ASCII only)")
            ids.append(tid)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Ids -> text (exact inverse of ``encode``)."""
        out = []
        n = len(self._vocab)
        for pos, i in enumerate(ids):
            i = int(i)
            if not 0 <= i < n:
                raise ValueError(f"BuiltinTokenizer.decode: id {i} at position {pos} is outside [0, {n})")
            if skip_special_tokens and i in self._special_ids:
                continue
            out.append(self._vocab[i])
        return "".join(out)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Identity template: the message contents concatenated (no role markers, no BOS).

        The synthetic tasks put everything the model needs in the prompt text itself.
        """
        del add_generation_prompt, kwargs
        return "".join(_message_content(m, i) for i, m in enumerate(messages))

    def __repr__(self) -> str:
        return f"BuiltinTokenizer(vocab_size={self.vocab_size})"


def _message_content(message: Message, index: int) -> str:
    if not isinstance(message, dict) or "content" not in message:
        raise ValueError(f"messages[{index}] must be a dict with a 'content' field, got {message!r}")
    content = message["content"]
    if not isinstance(content, str):
        raise ValueError(f"messages[{index}]['content'] must be a str, got {type(content).__name__}")
    return content


# --------------------------------------------------------------------------------------------
# Hugging Face tokenizer
# --------------------------------------------------------------------------------------------

def _token_str(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a str or as an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, dict):
        return value.get("content")
    return str(value)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e


def _pick_chat_template(template: Any, path: str) -> str | None:
    """``chat_template`` is a str, or a list of {"name", "template"} (the "default" one is used)."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        raise ValueError(f"{path}: chat_template list has no 'default' entry (names: {sorted(named)})")
    raise ValueError(f"{path}: chat_template must be a str or a list, got {type(template).__name__}")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` plus the special-token facts and chat template of a model dir."""

    def __init__(self, tokenizer: Any, *, eos_token: str | None = None, pad_token: str | None = None,
                 bos_token: str | None = None, extra_stop_ids: Sequence[int] = (),
                 pad_id: int | None = None, chat_template: str | None = None, name: str = "<memory>"):
        self._tok = tokenizer
        self._name = name
        self.chat_template = chat_template

        def tid(token: str | None, field: str) -> int | None:
            if token is None:
                return None
            i = tokenizer.token_to_id(token)
            if i is None:
                raise ValueError(f"{name}: {field} {token!r} is not in the tokenizer vocabulary")
            return i

        stop = list(extra_stop_ids)
        eos_id = tid(eos_token, "eos_token")
        if eos_id is None:
            if not stop:
                raise ValueError(f"{name}: no eos token (set eos_token in tokenizer_config.json or "
                                 f"eos_token_id in generation_config.json)")
            eos_id = int(stop[0])
        self._eos_id = eos_id
        self._stop_ids = tuple(dict.fromkeys([eos_id] + [int(s) for s in stop]))  # ordered, unique
        self._bos_id = tid(bos_token, "bos_token")
        pid = tid(pad_token, "pad_token")
        # Fallback chain: explicit pad token, generation_config pad id, eos (common HF convention).
        self._pad_id = pid if pid is not None else (int(pad_id) if pad_id is not None else eos_id)
        self.eos_token = self._tok.id_to_token(self._eos_id)
        self.bos_token = bos_token
        self.pad_token = self._tok.id_to_token(self._pad_id)

    @classmethod
    def from_dir(cls, path: str) -> "HFTokenizer":
        """Load ``tokenizer.json`` (required), ``tokenizer_config.json``, ``generation_config.json``
        and ``chat_template.jinja`` (optional; preferred over the config's template, as in
        transformers) from a local directory."""
        from tokenizers import Tokenizer as _RawTokenizer

        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            present = sorted(os.listdir(path))
            raise FileNotFoundError(f"{tok_file} not found (only fast tokenizers in tokenizer.json format "
                                    f"are supported); files present: {present}")
        raw = _RawTokenizer.from_file(tok_file)
        cfg_file = os.path.join(path, "tokenizer_config.json")
        cfg = _read_json(cfg_file)
        gen = _read_json(os.path.join(path, "generation_config.json"))

        eos_gen = gen.get("eos_token_id")
        eos_gen = [] if eos_gen is None else ([eos_gen] if isinstance(eos_gen, int) else list(eos_gen))
        template = _pick_chat_template(cfg.get("chat_template"), cfg_file)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        bos = _token_str(cfg.get("bos_token"))
        if bos is None and gen.get("bos_token_id") is not None:
            bos = raw.id_to_token(int(gen["bos_token_id"]))
        return cls(raw, eos_token=_token_str(cfg.get("eos_token")), pad_token=_token_str(cfg.get("pad_token")),
                   bos_token=bos, extra_stop_ids=eos_gen, pad_id=gen.get("pad_token_id"),
                   chat_template=template, name=path)

    vocab_size = property(lambda self: self._tok.get_vocab_size(with_added_tokens=True))
    eos_id = property(lambda self: self._eos_id)
    stop_ids = property(lambda self: self._stop_ids)
    pad_id = property(lambda self: self._pad_id)
    bos_id = property(lambda self: self._bos_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids. Default ``add_special_tokens=False``: chat-templated text already carries
        its special tokens (as ``apply_chat_template(tokenize=True)`` does in transformers)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render the model's jinja chat template (transformers-compatible variables: ``messages``,
        ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``pad_token`` + ``kwargs``, e.g.
        ``enable_thinking=False`` for Qwen3)."""
        if self.chat_template is None:
            raise ValueError(f"{self._name}: no chat template (neither tokenizer_config.json 'chat_template' "
                             f"nor chat_template.jinja); format the prompt text yourself")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        variables = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                         pad_token=self.pad_token or "")
        variables.update(kwargs)
        return _compiled_template(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)

    def __repr__(self) -> str:
        return f"HFTokenizer({self._name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


_TEMPLATE_CACHE: dict[str, Any] = {}


def _compiled_template(source: str):
    """Compile like transformers: sandboxed, trim_blocks/lstrip_blocks, loop controls, a ``tojson``
    filter that keeps non-ASCII, ``raise_exception`` and ``strftime_now`` globals."""
    if source in _TEMPLATE_CACHE:
        return _TEMPLATE_CACHE[source]
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    compiled = env.from_string(source)
    _TEMPLATE_CACHE[source] = compiled
    return compiled


def load_tokenizer(spec: "str | Tokenizer") -> Tokenizer:
    """``"builtin"`` -> ``BuiltinTokenizer()``; a directory -> ``HFTokenizer.from_dir``; an object
    implementing ``Tokenizer`` is returned unchanged."""
    if not isinstance(spec, str):
        if isinstance(spec, Tokenizer):
            return spec
        raise TypeError(f"tokenizer spec must be 'builtin', a directory path or a Tokenizer, got {type(spec).__name__}")
    if spec == "builtin":
        return BuiltinTokenizer()
    if os.path.isdir(spec):
        return HFTokenizer.from_dir(spec)
    raise ValueError(f"tokenizer spec {spec!r} is neither 'builtin' nor an existing directory "
                     f"holding tokenizer.json")
