"""Warm-up SFT: teach a tiny Qwen3, from scratch, to solve a synthetic task (pointer chasing).

RL needs a policy that already solves the task sometimes; a random tiny model never does.
:func:`warmup_model` trains one on the task's reference traces and caches the result as a
Hugging Face checkpoint, so every later run (calibration, RL, tests) loads it in a second.

Training data, generated on the fly (fresh examples every step, seeds disjoint from the
evaluation and RL prompts): one row per example, ``prompt + reference + <eos>`` followed by
``queries_per_example - 1`` more questions about the same records (``start K hops n`` +
reference + ``<eos>`` each). Context lengths are uniform in ``[min_context, max_train_context]``
and hops in ``[1, max(hops, train_hops)]``. Why (measured on 2 CPU cores, 2-layer d=128 model):
with one question per row and contexts up to 256 tokens the retrieval had not emerged
after 400-500 steps (0% accuracy); more questions per context and contexts up to 128 tokens
make it emerge within ~300 steps, and the model then generalises to 2x longer contexts.
Rows are right-padded to one fixed length, so the jitted train step compiles once. The loss
is the mean negative log-likelihood of the reference tokens and their ``<eos>``
(``prompt_weight`` > 0 adds the prompt tokens' NLL; off by default).

The retrieval is only possible through attention: each record key is random, a hop's value
sits at a random depth of the context, and distractor keys differ from the chain's keys by
one symbol. Greedy accuracy is reported by context length (the sampler's dense decode).

Shipped checkpoints: ``sparrow_jax/sft/checkpoints/<name>/`` holds warm-up directories (same
layout, ``key`` in the meta file) trained by this code; a run whose settings hash to a shipped
key loads it instead of training, so every machine gets the same model. ``use_shipped=False``
retrains from the settings (deterministic in them) into the cache.

Cache layout (``cache_dir/warmup-<hash>/``): ``config.json`` + ``model.safetensors`` (see
:func:`sparrow_jax.models.save_hf`) and ``sparrow_warmup.json`` (tokenizer name, task knobs,
training settings, accuracy table, ``"complete": true``). The hash covers the architecture,
the task knobs and every training setting; a directory is built under a temporary name and
renamed when complete, so an interrupted warm-up is never mistaken for a finished one.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import time
from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sparrow_jax.data.registry import get_task
from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.forward import dense_hidden, unembedding
from sparrow_jax.models.hf_io import load_hf, save_hf
from sparrow_jax.models.qwen3 import Params, init_params
from sparrow_jax.models.scoring import token_logprobs
from sparrow_jax.models.tokenizer import BuiltinTokenizer
from sparrow_jax.rollout.sampler import SamplingParams, generate
from sparrow_jax.sft import recurrence_rows

if TYPE_CHECKING:
    from sparrow_jax.run.specs import ModelSpec, TaskSpec

META_FILE = "sparrow_warmup.json"
DEFAULT_CACHE_DIR = "runs/cache"
TOKENIZER_NAME = "builtin"
FORMAT = "sparrow-warmup/v1"
# Seed offsets of the three example streams: training, held-out evaluation (the RL and
# calibration prompts use task.seed itself, so none of them overlap).
_TRAIN_STREAM, _EVAL_STREAM = 0x5EED_0001, 0x5EED_0002


@dataclasses.dataclass(frozen=True)
class WarmupSettings:
    """Training settings of the warm-up (all of them enter the cache hash).

    steps, batch_size, lr: optimisation length, rows per step, peak AdamW learning rate.
    warmup_frac: share of steps of linear learning-rate warm-up before the cosine decay.
    weight_decay, max_grad_norm: AdamW decay and global-norm clipping.
    min_context: shortest context drawn for training rows (tokens).
    train_hops: training rows draw their hop count from ``[1, max(task hops, train_hops)]``:
      every hop is one more retrieval to learn from in the same row, at ~10 tokens each.
    queries_per_example: questions per training example about its records (the task's own
      first, then ``queries_per_example - 1`` from :func:`extra_queries`).
    max_train_context: longest training context (tokens); evaluation also runs past it (the
      model has to generalise to the task's longer contexts).
    prompt_weight: weight of the prompt tokens' NLL next to the reference's (0: reference only).
    seed: parameter init and training-data seed.
    max_train_hops: > 0 caps training hop counts at this (rows stay short; a task whose lines
      need no counting, like pointer_trace, extends to longer chains); 0: no cap.
    final_frac, final_batch_size: the last ``final_frac`` of the steps train on the task's own
      context and hops (its longest distances), ``final_batch_size`` rows each (0: no such phase).
    curriculum: stages ``((steps, max_context, max_hops, batch_size), ...)`` that replace the
      single phase before the final one (their steps must add up to it); each stage is the
      settings above with ``max_train_context``, ``max_train_hops`` and ``batch_size`` replaced.
      Why: the lookup emerges within a few hundred steps only when a row holds a handful of
      records (measured on pointer_trace: contexts <= 48 tokens and <= 4 hops reach a reference
      NLL of 0.3 by step 325, values then ~40-50% right, while contexts <= 64-256 with up to 20-48
      hops stayed on the uniform-over-records plateau for 1500 steps); later stages grow the rows
      toward the task's (without them the model fails past the positions it was trained on).
    refine_steps, refine_lr, refine_batch_size: after ``steps``, a second run of the optimiser
      (fresh AdamW state, linear warm-up over ``warmup_frac`` of it, cosine decay to 10% of
      ``refine_lr``) of ``refine_steps`` steps on the task's own rows, ``refine_batch_size``
      each, drawn past the main phase's steps (0: none). Why a warm restart rather than a longer
      final phase: the main schedule meets the task's full-length rows near the end of its decay,
      and long_trace's reference NLL was still falling fast there (0.57 -> 0.10 in its last 75
      steps); 300 refine steps at 1e-3 took it to 0.005 and the greedy reward at 104 hops from
      0.04 to 0.72.
    preamble_steps, preamble_lr, preamble_batch_size: for a task with ``preamble_tokens`` (required
      there, else 0): the warm-up of the same task without the preamble (all the settings above;
      found shipped, cached or trained by its own key), then a run of its own like the refine one
      on the task's rows with the preamble. Why a phase of its own: the rows grow past the
      positions the model has seen (greedy 104-hop reward of long_trace's model 0.68 at 888-token
      prompts, 0.00 at 1770), and the lookups it learned on short rows carry over; the curriculum
      never sees a preamble.
    """

    steps: int = 800
    batch_size: int = 32
    lr: float = 3e-3
    warmup_frac: float = 0.05
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    min_context: int = 32
    train_hops: int = 3
    queries_per_example: int = 4
    max_train_context: int = 128
    prompt_weight: float = 0.0
    seed: int = 0
    max_train_hops: int = 0
    final_frac: float = 0.0
    final_batch_size: int = 4
    curriculum: tuple = ()
    refine_steps: int = 0
    refine_lr: float = 1e-3
    refine_batch_size: int = 4
    preamble_steps: int = 0
    preamble_lr: float = 1e-3
    preamble_batch_size: int = 4

    def __post_init__(self):
        for name in ("steps", "batch_size", "min_context", "train_hops", "queries_per_example", "max_train_context"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"warmup {name} must be positive, got {getattr(self, name)}")
        if not self.lr > 0 or not self.refine_lr > 0 or not self.preamble_lr > 0:
            raise ValueError(f"warmup lr, refine_lr and preamble_lr must be positive, got {self.lr}, {self.refine_lr} "
                             f"and {self.preamble_lr}")
        if int(self.preamble_steps) < 0 or int(self.preamble_batch_size) <= 0:
            raise ValueError(f"warmup preamble_steps must be >= 0 and preamble_batch_size positive, got "
                             f"{self.preamble_steps} and {self.preamble_batch_size}")
        if int(self.refine_steps) < 0 or int(self.refine_batch_size) <= 0:
            raise ValueError(f"warmup refine_steps must be >= 0 and refine_batch_size positive, got "
                             f"{self.refine_steps} and {self.refine_batch_size}")
        if int(self.max_train_hops) < 0 or int(self.final_batch_size) <= 0:
            raise ValueError(f"warmup max_train_hops must be >= 0 and final_batch_size positive, got "
                             f"{self.max_train_hops} and {self.final_batch_size}")
        if not 0.0 <= self.final_frac < 1.0:
            raise ValueError(f"warmup final_frac must be in [0, 1), got {self.final_frac}")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"warmup warmup_frac must be in [0, 1), got {self.warmup_frac}")
        stages = [tuple(stage) for stage in self.curriculum]
        if any(len(st) != 4 or not all(isinstance(v, int) and v > 0 for v in st) for st in stages):
            raise ValueError(f"warmup curriculum stages must be (steps, max_context, max_hops, batch_size) of "
                             f"positive ints, got {self.curriculum}")
        first_final = self.steps - int(round(self.final_frac * self.steps))
        if stages and sum(st[0] for st in stages) != first_final:
            raise ValueError(f"warmup curriculum steps add up to {sum(st[0] for st in stages)}, but the phase "
                             f"before the final one has {first_final} steps (steps {self.steps}, final_frac "
                             f"{self.final_frac})")
        object.__setattr__(self, "curriculum", tuple(stages))  # lists from a config become hashable tuples


# ---- what is trained on ---------------------------------------------------------------

def warmup_architecture(model: ModelSpec) -> Qwen3Config:
    """Qwen3Config of the warm-up model: ``model.tiny`` with the builtin tokenizer's vocab."""
    arch = dict(model.tiny)
    arch["vocab_size"] = BuiltinTokenizer().vocab_size  # the tokenizer decides, not the config
    return Qwen3Config(**arch, dtype=model.dtype, param_dtype=model.param_dtype)


def task_knobs(task: TaskSpec) -> dict[str, Any]:
    """The task fields that change the warm-up data: name, context_tokens, hops, distractor_frac,
    key_len, and preamble_tokens when set (absent at 0: the keys of warm-ups without one stay).

    ``task.isolate_chain`` is not one: it changes only where off-chain records point, which no
    reference trace visits, so the warm-up trains the same lookups either way.
    recurrence_trace has knobs of its own (:func:`recurrence_rows.task_knobs`)."""
    if task.name == recurrence_rows.NAME:
        return recurrence_rows.task_knobs(task)
    knobs = dict(name=str(task.name), context_tokens=int(task.context_tokens),
                 hops=int(task.hops), distractor_frac=float(task.distractor_frac),
                 key_len=int(task.key_len))
    if int(task.preamble_tokens):
        knobs["preamble_tokens"] = int(task.preamble_tokens)
    task = get_task(knobs["name"])
    if task.generate is None:
        raise ValueError(f"task.name={knobs['name']!r} has no generator; the warm-up needs a synthetic "
                         f"task with reference traces (e.g. 'pointer_chase')")
    if knobs["hops"] < 1:
        raise ValueError(f"task.hops must be >= 1, got {knobs['hops']}")
    return knobs


def generate_examples(knobs: dict[str, Any], n: int, seed: int, context_tokens: int | None = None,
                      hops: "int | tuple[int, int] | None" = None) -> list[dict[str, Any]]:
    """``n`` task examples with the knobs (context length and hops overridable; recurrence_trace:
    ``hops`` is its ``min_lines``)."""
    if knobs["name"] == recurrence_rows.NAME:
        return recurrence_rows.generate(dict(knobs, context_tokens=int(context_tokens or knobs["context_tokens"])),
                                        n, seed, min_lines=hops)
    task = get_task(knobs["name"])
    preamble = dict(preamble_tokens=knobs["preamble_tokens"]) if knobs.get("preamble_tokens") else {}
    return task.generate(n, seed, context_tokens=int(context_tokens or knobs["context_tokens"]),
                         hops=knobs["hops"] if hops is None else hops,
                         distractor_frac=knobs["distractor_frac"], key_len=knobs["key_len"], **preamble)


def prompt_ids(example: dict[str, Any], task_name: str, tokenizer) -> list[int]:
    """Token ids of an example's prompt as the sampler sees it (the task's prompt format)."""
    return tokenizer.encode(get_task(task_name).format_prompt(example, tokenizer))


def max_reference_tokens(knobs: dict[str, Any], hops: int | None = None) -> int:
    """Reference + <eos> tokens of a ``hops``-hop example (the task's line formats fix it: one
    token per key symbol), measured on a generated example. recurrence_trace: the most of a
    kept trace drawn at ``hops`` (its ``min_lines``) lines (:mod:`recurrence_rows`)."""
    if knobs["name"] == recurrence_rows.NAME:
        return recurrence_rows.reference_tokens(knobs, recurrence_rows.max_lines(knobs, hops or knobs["min_lines"]))
    return _reference_tokens(knobs["name"], int(knobs["key_len"]), float(knobs["distractor_frac"]),
                             int(hops or knobs["hops"]))


@functools.lru_cache(maxsize=64)
def _reference_tokens(name: str, key_len: int, distractor_frac: float, hops: int) -> int:
    knobs = dict(name=name, key_len=key_len, distractor_frac=distractor_frac, hops=hops)
    example = generate_examples(knobs, 1, seed=0, context_tokens=1, hops=hops)[0]
    return len(BuiltinTokenizer().encode(example["reference"])) + 1


def sequence_length(knobs: dict[str, Any], hops: int | None = None) -> int:
    """Fixed padded training length: longest prompt (preamble included) + longest reference, rounded up to 32."""
    if knobs["name"] == recurrence_rows.NAME:
        return recurrence_rows.row_length(knobs, recurrence_rows.table_tokens(knobs), hops or knobs["min_lines"])
    k = knobs["key_len"]
    prompt = knobs.get("preamble_tokens", 0) + knobs["context_tokens"] + 2 * k + 2  # may overshoot a record
    longest = prompt + max_reference_tokens(knobs, hops)
    return -(-longest // 32) * 32


def extra_queries(example: dict[str, Any], n: int, max_hops: int,
                  rng: np.random.Generator) -> list[tuple[str, str]]:
    """``n`` more (query line, reference) pairs about the same records of a pointer-chase prompt.

    Starts are random record keys, hops uniform in ``[1, max_hops]``; every value is a key,
    so every chain exists. Appended after the first answer's <eos>, they multiply the
    retrievals a row teaches for ~30 tokens each instead of a whole new context.
    """
    from sparrow_jax.data.tasks.pointer_chase import _query_line, _reference  # the task's own formats

    line = example["prompt"].split("\n", 1)[0]
    try:
        table = dict(r.split("=") for r in line.split(";") if r)
    except ValueError as e:
        raise ValueError(f"extra_queries: the prompt's first line is not pointer-chase records: {line[:60]!r}") from e
    keys = list(table)
    out = []
    for _ in range(n):
        hops = int(rng.integers(1, max_hops + 1))
        chain = [keys[int(rng.integers(len(keys)))]]
        for _ in range(hops):
            chain.append(table[chain[-1]])
        out.append((_query_line(chain[0], hops), _reference(chain)))
    return out


def example_segments(example: dict[str, Any], task_name: str, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(context ids, target ids) pairs of one example: the prompt and ``reference + <eos>``, then
    each of its optional ``extra_queries`` (query line, reference + <eos>)."""
    if "reference" not in example:
        raise KeyError(f"example has no 'reference' field (fields: {sorted(example)})")
    pairs = [(prompt_ids(example, task_name, tokenizer), example["reference"])]
    pairs += [(tokenizer.encode(q), r) for q, r in example.get("extra_queries", ())]
    return [(p, tokenizer.encode(r) + [tokenizer.eos_id]) for p, r in pairs]


def make_batch(examples: Sequence[dict[str, Any]], task_name: str, tokenizer,
               seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One example per row: ``prompt + reference + <eos>`` (then its ``extra_queries``, each
    ``query + reference + <eos>``), right-padded with ``pad_id``.

    Returns (tokens int32 [B, seq_len], reference_mask bool [B, seq_len], prompt_mask bool
    [B, seq_len]): reference_mask is True at the reference tokens and their <eos>;
    prompt_mask at the other tokens from index 1 on (index 0 has no prefix to be predicted from).
    """
    tokens = np.full((len(examples), seq_len), tokenizer.pad_id, np.int32)
    mask = np.zeros((len(examples), seq_len), bool)
    prompt_mask = np.zeros((len(examples), seq_len), bool)
    for b, ex in enumerate(examples):
        segments = example_segments(ex, task_name, tokenizer)
        n = sum(len(p) + len(r) for p, r in segments)
        if n > seq_len:
            raise ValueError(f"example {b}: {n} tokens (prompt, references, queries) exceed seq_len {seq_len}")
        pos = 0
        for p, r in segments:
            tokens[b, pos:pos + len(p)] = p
            prompt_mask[b, max(pos, 1):pos + len(p)] = True
            pos += len(p)
            tokens[b, pos:pos + len(r)] = r
            mask[b, pos:pos + len(r)] = True
            pos += len(r)
    return tokens, mask, prompt_mask


def train_hops(knobs: dict[str, Any], settings: WarmupSettings) -> int:
    """Most hops a training question may have (before the final phase; recurrence_trace: most
    ``min_lines`` of a training trace, the task's without ``max_train_hops``)."""
    if settings.max_train_hops > 0:
        return int(settings.max_train_hops)
    if knobs["name"] == recurrence_rows.NAME:
        return int(knobs["min_lines"])
    return max(int(knobs["hops"]), int(settings.train_hops))


def train_context(knobs: dict[str, Any], settings: WarmupSettings) -> int:
    """Longest context of a training example: the task's, capped at ``max_train_context``."""
    return min(int(knobs["context_tokens"]), int(settings.max_train_context))


def training_batch(knobs: dict[str, Any], settings: WarmupSettings, step: int, tokenizer,
                   seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch ``step`` (deterministic in (seed, step)), laid out as :func:`make_batch`.

    Row ``b``: a fresh example with a context length uniform in ``[min_context, train_context]``
    (short contexts make the retrieval quick to discover) and hops uniform in ``[1, train_hops]``,
    then ``queries_per_example - 1`` extra questions about its records (:func:`extra_queries`).
    """
    if settings.queries_per_example > 1 and knobs["name"] != "pointer_chase":
        raise ValueError(f"warmup queries_per_example={settings.queries_per_example}: extra questions exist only "
                         f"for pointer_chase prompts, not {knobs['name']!r}; set it to 1")
    rng = np.random.default_rng([settings.seed, _TRAIN_STREAM, step])
    hi = train_context(knobs, settings)
    if knobs["name"] == recurrence_rows.NAME:  # tables of [min_context, hi] tokens, traces up to train_hops lines
        rows = recurrence_rows.stage_rows(knobs, settings.batch_size, rng, settings.min_context, hi,
                                          train_hops(knobs, settings))
        return make_batch(rows, knobs["name"], tokenizer, seq_len)
    lo = min(settings.min_context, hi)
    h = train_hops(knobs, settings)
    examples = []
    for _ in range(settings.batch_size):
        seed = int(rng.integers(0, 2 ** 31 - 1))  # draw order: seed, context length, hops
        length, hops = int(rng.integers(lo, hi + 1)), int(rng.integers(1, h + 1))
        ex = generate_examples(knobs, 1, seed, context_tokens=length, hops=hops)[0]
        if settings.queries_per_example > 1:
            ex["extra_queries"] = extra_queries(ex, settings.queries_per_example - 1, h, rng)
        examples.append(ex)
    return make_batch(examples, knobs["name"], tokenizer, seq_len)


def stage_settings(settings: WarmupSettings, step: int) -> WarmupSettings:
    """The settings a pre-final ``step`` trains with: its curriculum stage's context, hops and
    rows (the settings themselves without a curriculum)."""
    start = 0
    for steps, context, hops, rows in settings.curriculum:
        if step < start + steps:
            return dataclasses.replace(settings, max_train_context=context, max_train_hops=hops, batch_size=rows,
                                       curriculum=())
        start += steps
    return dataclasses.replace(settings, curriculum=())


def final_phase_start(settings: WarmupSettings) -> int:
    """First step of the final phase (rows at the task's own context and hops)."""
    return settings.steps - int(round(settings.final_frac * settings.steps))


def final_batch(knobs: dict[str, Any], settings: WarmupSettings, step: int, tokenizer,
                seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch ``step`` of the final phase: ``final_batch_size`` fresh examples exactly as the task
    poses them (its context and hops), laid out as :func:`make_batch`."""
    rng = np.random.default_rng([settings.seed, _TRAIN_STREAM, step])
    if knobs["name"] == recurrence_rows.NAME:
        return make_batch(recurrence_rows.task_rows(knobs, settings.final_batch_size, rng), knobs["name"],
                          tokenizer, seq_len)
    seeds = rng.integers(0, 2 ** 31 - 1, size=settings.final_batch_size)
    examples = [generate_examples(knobs, 1, int(seed))[0] for seed in seeds]
    return make_batch(examples, knobs["name"], tokenizer, seq_len)


def training_length(knobs: dict[str, Any], settings: WarmupSettings) -> int:
    """Fixed padded length of training rows: the longest prompt and answer plus the extra questions."""
    h = train_hops(knobs, settings)
    if knobs["name"] == recurrence_rows.NAME:
        return recurrence_rows.row_length(knobs, train_context(knobs, settings), h)
    query = 2 * knobs["key_len"] + len(str(h)) + 6  # "start " key " hops " n "\n" (word tokens count 1)
    extra = (settings.queries_per_example - 1) * (query + max_reference_tokens(knobs, h))
    longest = sequence_length(dict(knobs, context_tokens=train_context(knobs, settings)), h) + extra
    return -(-longest // 32) * 32


# ---- training ---------------------------------------------------------------------------

def sft_loss(config: Qwen3Config, params: Params, tokens: jax.Array, mask: jax.Array,
             prompt_mask: jax.Array | None = None, prompt_weight: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """(loss, reference NLL). tokens int32 [B, L]; mask, prompt_mask bool [B, L].

    reference NLL = mean NLL over ``mask`` tokens; loss = it + ``prompt_weight`` x the mean
    NLL over ``prompt_mask`` tokens.
    """
    # One query chunk covering the row: no padded queries (training rows are short).
    hidden = dense_hidden(config, params, tokens, chunk=tokens.shape[1])
    logp, _ = token_logprobs(hidden, unembedding(config, params), tokens, seq_chunk=128)
    def mean_nll(m):
        m = m.astype(jnp.float32)
        return -jnp.sum(logp * m) / jnp.maximum(jnp.sum(m), 1.0)

    ref = mean_nll(mask)
    if prompt_mask is None or prompt_weight == 0.0:
        return ref, ref
    return ref + prompt_weight * mean_nll(prompt_mask), ref


def phase_steps_lr(settings: WarmupSettings, phase: str) -> tuple[int, float]:
    """(steps, peak learning rate) of the ``main``, ``refine`` or ``preamble`` phase."""
    return {"main": (settings.steps, settings.lr), "refine": (settings.refine_steps, settings.refine_lr),
            "preamble": (settings.preamble_steps, settings.preamble_lr)}[phase]


def make_optimizer(settings: WarmupSettings, phase: str = "main") -> optax.GradientTransformation:
    """AdamW with linear warm-up then cosine decay to 10% of the peak; global-norm clipping.
    ``phase``: ``main``, or the ``refine`` / ``preamble`` phase's own run (its steps and peak)."""
    steps, lr = phase_steps_lr(settings, phase)
    warm = max(1, int(settings.warmup_frac * steps))
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warm, max(steps, warm + 1), end_value=0.1 * lr)
    chain = [optax.clip_by_global_norm(settings.max_grad_norm)] if settings.max_grad_norm > 0 else []
    return optax.chain(*chain, optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=settings.weight_decay))


def make_train_step(config: Qwen3Config, optimizer: optax.GradientTransformation, prompt_weight: float = 0.0):
    """One jitted step ``(params, opt_state, tokens, mask, prompt_mask) -> (params, opt_state, ref_nll)``."""
    def step(params, opt_state, tokens, mask, prompt_mask):
        (_, ref), grads = jax.value_and_grad(
            lambda p: sft_loss(config, p, tokens, mask, prompt_mask, prompt_weight), has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ref
    return jax.jit(step, donate_argnums=(0, 1))


# ---- evaluation -------------------------------------------------------------------------

def greedy_rewards(config: Qwen3Config, params: Params, examples: Sequence[dict[str, Any]],
                   task_name: str, tokenizer, max_new_tokens: int, batch_size: int = 32,
                   schedule=None) -> np.ndarray:
    """Task reward of each example's greedy completion, float [n] (dense, or sparse with ``schedule``)."""
    task = get_task(task_name)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_ids=tokenizer.stop_ids)
    rewards = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i:i + batch_size]
        prompts = [prompt_ids(ex, task_name, tokenizer) for ex in chunk]
        out = generate(config, params, prompts, jax.random.PRNGKey(0), sampling, schedule=schedule,
                       pad_id=tokenizer.pad_id)
        for b, ex in enumerate(chunk):
            text = tokenizer.decode(out.tokens[b, out.prompt_lens[b]:out.lengths[b]])
            rewards.append(task.reward(text, ex))
    return np.asarray(rewards, np.float64)


def greedy_accuracy(config: Qwen3Config, params: Params, examples: Sequence[dict[str, Any]],
                    task_name: str, tokenizer, max_new_tokens: int, batch_size: int = 32,
                    schedule=None) -> float:
    """Mean task reward of greedy completions (pointer_chase: the share answered exactly)."""
    return float(np.mean(greedy_rewards(config, params, examples, task_name, tokenizer, max_new_tokens,
                                        batch_size, schedule)))


def default_eval_lengths(context_tokens: int) -> list[int]:
    """Quarter, half, full context, and twice it (length extrapolation)."""
    return sorted({max(32, context_tokens // 4), max(32, context_tokens // 2), context_tokens, 2 * context_tokens})


def eval_new_tokens(knobs: dict[str, Any], examples: Sequence[dict[str, Any]], hops: int | None = None) -> int:
    """Generation budget of an evaluation: the longest reference + <eos> + 4 (recurrence_trace's
    traces vary in length, so its examples' own; the pointer tasks' is fixed by ``hops``)."""
    if knobs["name"] == recurrence_rows.NAME:
        return max(len(BuiltinTokenizer().encode(ex["reference"])) for ex in examples) + 5
    return max_reference_tokens(knobs, hops) + 4


def accuracy_by_length(config: Qwen3Config, params: Params, knobs: dict[str, Any], lengths: Sequence[int],
                       num_prompts: int = 64, seed: int = 0, schedule=None) -> dict[int, float]:
    """Greedy accuracy on held-out prompts at ``knobs['hops']`` hops, per context length
    (dense, or a sparse actor with ``schedule``)."""
    tok = BuiltinTokenizer()
    out = {}
    for length in lengths:
        examples = generate_examples(knobs, num_prompts, seed=int(_EVAL_STREAM + 7919 * seed + int(length)),
                                     context_tokens=int(length))
        out[int(length)] = greedy_accuracy(config, params, examples, knobs["name"], tok,
                                           max_new_tokens=eval_new_tokens(knobs, examples), schedule=schedule)
    return out


def accuracy_by_hops(config: Qwen3Config, params: Params, knobs: dict[str, Any], hops: Sequence[int],
                     num_prompts: int = 32, seed: int = 0) -> dict[int, dict[str, float]]:
    """Greedy dense quality at the task's context per trace length (hops): ``reward`` (mean task
    reward, partial credit for pointer_trace) and ``solved`` (share with reward 1)."""
    tok = BuiltinTokenizer()
    out = {}
    for h in hops:
        examples = generate_examples(knobs, num_prompts, seed=int(_EVAL_STREAM + 7919 * seed + 104_729 * int(h)),
                                     hops=int(h))
        r = greedy_rewards(config, params, examples, knobs["name"], tok,
                           max_new_tokens=eval_new_tokens(knobs, examples, int(h)))
        out[int(h)] = dict(reward=float(r.mean()), solved=float((r >= 1.0).mean()))
    return out


# ---- cache --------------------------------------------------------------------------------

def warmup_key(config: Qwen3Config, knobs: dict[str, Any], settings: WarmupSettings) -> str:
    """Hex digest naming the cache directory: architecture, task knobs and training settings."""
    train = dataclasses.asdict(settings)
    if not train["curriculum"]:  # settings from before the field existed keep their cache key
        del train["curriculum"]
    for phase in ("refine", "preamble"):  # likewise without a refine or preamble phase
        if not train[f"{phase}_steps"]:
            for name in ("steps", "lr", "batch_size"):
                del train[f"{phase}_{name}"]
    blob = json.dumps(dict(format=FORMAT, arch=dataclasses.asdict(config), task=knobs, train=train), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")


def shipped_checkpoint(key: str, root: str = SHIPPED_DIR) -> str | None:
    """The shipped warm-up directory whose meta ``key`` is ``key``, else None."""
    if not os.path.isdir(root):
        return None
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if is_complete(path) and read_warmup_meta(path).get("key") == key:
            return path
    return None


def is_complete(path: str) -> bool:
    """True when ``path`` holds a finished warm-up (weights, config and a complete meta file)."""
    meta = os.path.join(path, META_FILE)
    if not (os.path.isfile(meta) and os.path.isfile(os.path.join(path, "config.json"))):
        return False
    if not (os.path.isfile(os.path.join(path, "model.safetensors"))
            or os.path.isfile(os.path.join(path, "model.safetensors.index.json"))):
        return False
    try:
        with open(meta) as f:
            return bool(json.load(f).get("complete"))
    except (OSError, json.JSONDecodeError):
        return False


def read_warmup_meta(path: str) -> dict[str, Any]:
    """The ``sparrow_warmup.json`` of a warm-up directory."""
    with open(os.path.join(path, META_FILE)) as f:
        return json.load(f)


# model.warmup fields that are not training settings (not in the cache hash): where the cache lives
# and what the final evaluation measures (context lengths, trace lengths, prompts per entry).
_NOT_HASHED = ("cache_dir", "eval_lengths", "eval_hops", "eval_prompts")


def warmup_settings(model: ModelSpec, **overrides: Any) -> WarmupSettings:
    """Settings from the ``model.warmup`` block (may be empty), then ``overrides`` that are not None."""
    fields = {f.name for f in dataclasses.fields(WarmupSettings)}
    block = model.warmup
    unknown = sorted(set(block) - fields - set(_NOT_HASHED))
    if unknown:
        raise ValueError(f"model.warmup has unknown field(s) {unknown}; known: {sorted(fields | set(_NOT_HASHED))}")
    kw = {k: v for k, v in dict(block).items() if k in fields}
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return WarmupSettings(**kw)


def warmup_model(model: ModelSpec, task: TaskSpec, cache_dir: str | None = None,
                 steps: int | None = None, batch_size: int | None = None, lr: float | None = None,
                 seed: int | None = None, progress: bool = True, min_context: int | None = None,
                 eval_lengths: Sequence[int] | None = None, eval_prompts: int | None = None,
                 use_shipped: bool = True) -> str:
    """Train (or find in the cache) a tiny Qwen3 that solves the task; returns its HF directory.

    Args:
      model: the run's model spec; ``model.tiny`` is the architecture (vocab_size is
        replaced by the builtin tokenizer's). Its ``warmup`` block (fields of
        :class:`WarmupSettings` and ``cache_dir``; the config's optional ``model.warmup``)
        sets the training; the run context calls ``warmup_model(spec.model, spec.task)``,
        so that block is how a run config chooses its warm-up.
      task: the run's task spec (name, context_tokens, hops, distractor_frac, key_len).
      cache_dir: parent of the ``warmup-<hash>`` directories (default: ``model.warmup.cache_dir``
        or ``runs/cache``).
      steps, batch_size, lr, seed, min_context: override the settings (None: config / default).
      eval_lengths: context lengths of the final greedy-accuracy table (default:
        ``model.warmup.eval_lengths`` or :func:`default_eval_lengths`); eval_prompts: held-out
        prompts per entry (default ``model.warmup.eval_prompts`` or 64). ``model.warmup.eval_hops``
        adds a table by trace length at the task's context (:func:`accuracy_by_hops`).
      use_shipped: return a shipped checkpoint with the same settings hash (see the module
        docstring) instead of training.
    A complete cached (or shipped) directory is returned at once, without training or evaluating.
    With ``refine_steps > 0`` the main phase is a warm-up of its own (the same settings with
    ``refine_steps=0``), found shipped or cached or trained first, and the refine run continues it;
    the meta file names it (``base_key``) and counts its seconds in ``train_seconds``.
    """
    config = warmup_architecture(model)
    knobs = task_knobs(task)
    settings = warmup_settings(model, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                               min_context=min_context)
    block = model.warmup
    cache_dir = block.get("cache_dir", DEFAULT_CACHE_DIR) if cache_dir is None else cache_dir
    eval_lengths = eval_lengths if eval_lengths is not None else (list(block.get("eval_lengths", ())) or None)
    eval_prompts = int(eval_prompts if eval_prompts is not None else block.get("eval_prompts", 64))
    evals = dict(lengths=eval_lengths, hops=list(block.get("eval_hops", ())), prompts=eval_prompts)
    return _warmup(config, knobs, settings, cache_dir, evals, progress, use_shipped)


def _warmup(config: Qwen3Config, knobs: dict[str, Any], settings: WarmupSettings, cache_dir: str,
            evals: dict[str, Any], progress: bool, use_shipped: bool) -> str:
    """:func:`warmup_model` on resolved settings. With a refine phase, the main phase is its own
    warm-up (settings with ``refine_steps=0``: its own key, shipped, cached or trained here) and
    only the refine steps are trained on top of it."""
    key = warmup_key(config, knobs, settings)
    path = os.path.join(cache_dir, f"warmup-{key}")
    shipped = shipped_checkpoint(key, SHIPPED_DIR) if use_shipped else None
    for found in (shipped, path if is_complete(path) else None):
        if found:
            if progress:
                print(f"[warmup] {'shipped' if found == shipped else 'cached'}: {found}", flush=True)
            return found

    tok = BuiltinTokenizer()
    final_len = sequence_length(knobs)
    base_meta = None
    t0, c0 = time.perf_counter(), time.process_time()
    losses = []

    def log_loss(step: int, loss: jax.Array, last: bool) -> None:
        if step % 25 == 0 or last:
            losses.append((step, round(float(loss), 4)))
            if progress:
                print(f"[warmup] step {step} loss {float(loss):.4f} ({time.perf_counter() - t0:.0f}s wall, "
                      f"{time.process_time() - c0:.0f}s CPU)", flush=True)

    continued = continued_warmup(knobs, settings)
    if continued is not None:  # a run of its own on the task's rows on top of another warm-up's model
        phase, base_knobs, base_settings = continued
        base_path = _warmup(config, base_knobs, base_settings, cache_dir, evals, progress, use_shipped)
        base_meta = read_warmup_meta(base_path)
        params = load_hf(base_path)[1]
        losses += [tuple(v) for v in base_meta["loss_curve"]]
        n_steps, lr = phase_steps_lr(settings, phase)
        rows = dataclasses.replace(settings, final_batch_size=getattr(settings, f"{phase}_batch_size"))
        if progress:
            print(f"[warmup] {phase}: {n_steps} x {rows.final_batch_size} task rows of {final_len} tokens (peak lr "
                  f"{lr:g}) on {base_path} -> {path}", flush=True)
        optimizer = make_optimizer(settings, phase)
        train_step = make_train_step(config, optimizer, settings.prompt_weight)
        opt_state = optimizer.init(params)
        first = base_settings.steps + base_settings.refine_steps  # rows past the base's
        for step in range(first, first + n_steps):
            tokens, mask, prompt_mask = final_batch(knobs, rows, step, tok, final_len)
            params, opt_state, loss = train_step(params, opt_state, jnp.asarray(tokens), jnp.asarray(mask),
                                                 jnp.asarray(prompt_mask))
            log_loss(step, loss, step == first + n_steps - 1)
        seq_lens = base_meta["seq_lens"]
    else:
        params, seq_lens = _main_phase(config, knobs, settings, tok, final_len, log_loss, path, progress)
    jax.block_until_ready(params)
    train_s, train_cpu_s = time.perf_counter() - t0, time.process_time() - c0

    lengths = list(evals["lengths"]) if evals["lengths"] is not None else default_eval_lengths(knobs["context_tokens"])
    t1 = time.perf_counter()
    acc = accuracy_by_length(config, params, knobs, lengths, num_prompts=evals["prompts"], seed=settings.seed)
    by_hops = accuracy_by_hops(config, params, knobs, evals["hops"], num_prompts=evals["prompts"], seed=settings.seed)
    eval_s = time.perf_counter() - t1
    if progress:
        print("[warmup] greedy accuracy by context length: "
              + ", ".join(f"{k}: {v:.2f}" for k, v in acc.items()), flush=True)
        if by_hops:
            print("[warmup] greedy reward / solved by hops: "
                  + ", ".join(f"{h}: {v['reward']:.2f}/{v['solved']:.2f}" for h, v in by_hops.items()), flush=True)

    # Build under a temporary name, rename when complete: never a half-written cache entry.
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(tmp, config, params)
    # Seconds from scratch: the main phase's (when it was reused) plus this run's.
    before = dict(train_seconds=0.0, train_cpu_seconds=0.0) if base_meta is None else base_meta
    meta = dict(format=FORMAT, complete=True, key=key, tokenizer=TOKENIZER_NAME, task=knobs,
                train=dataclasses.asdict(settings), seq_lens=sorted(seq_lens), num_params=config.num_params(),
                train_seconds=round(before["train_seconds"] + train_s, 1),
                train_cpu_seconds=round(before["train_cpu_seconds"] + train_cpu_s, 1), eval_seconds=round(eval_s, 1),
                final_loss=losses[-1][1] if losses else None, loss_curve=losses,
                accuracy_by_length={str(k): v for k, v in acc.items()},
                accuracy_by_hops={str(k): v for k, v in by_hops.items()},
                accuracy=acc.get(knobs["context_tokens"], float(np.mean(list(acc.values())))),
                eval_prompts=evals["prompts"])
    if base_meta is not None:
        meta.update(base_key=base_meta["key"], **{f"{continued[0]}_seconds": round(train_s, 1)},
                    base_accuracy_by_hops=base_meta.get("accuracy_by_hops", {}))
    with open(os.path.join(tmp, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)  # an incomplete leftover under the final name
    os.replace(tmp, path)
    return path


def continued_warmup(knobs: dict[str, Any], settings: WarmupSettings
                     ) -> tuple[str, dict[str, Any], WarmupSettings] | None:
    """(phase, task knobs, settings) of the warm-up the last phase continues, None from scratch:
    ``preamble`` continues the same task without its preamble, ``refine`` the main phase."""
    if knobs.get("preamble_tokens"):
        if not settings.preamble_steps:
            raise ValueError(f"task.preamble_tokens={knobs['preamble_tokens']} needs model.warmup.preamble_steps > 0: "
                             f"the preamble is learned in a phase of its own, on top of the warm-up without it")
        return "preamble", {k: v for k, v in knobs.items() if k != "preamble_tokens"}, \
            dataclasses.replace(settings, preamble_steps=0)
    if settings.preamble_steps:
        raise ValueError(f"model.warmup.preamble_steps={settings.preamble_steps} needs task.preamble_tokens > 0")
    if settings.refine_steps:
        return "refine", knobs, dataclasses.replace(settings, refine_steps=0)
    return None


def _main_phase(config: Qwen3Config, knobs: dict[str, Any], settings: WarmupSettings, tok, final_len: int,
                log_loss, path: str, progress: bool) -> tuple[Params, list[int]]:
    """The curriculum (or single phase) and the final phase from a fresh init: (params, padded row lengths)."""
    seq_lens = {}  # one padded length (one compile) per curriculum stage
    final_start = final_phase_start(settings)
    optimizer = make_optimizer(settings)
    train_step = make_train_step(config, optimizer, settings.prompt_weight)
    params = init_params(config, seed=settings.seed)
    opt_state = optimizer.init(params)
    stages = settings.curriculum or ((final_start, train_context(knobs, settings), train_hops(knobs, settings),
                                      settings.batch_size),)
    if progress:
        plan = ", ".join(f"{n} x {rows} rows (contexts <= {ctx}, <= {hops} hops)" for n, ctx, hops, rows in stages)
        print(f"[warmup] training {config.num_params():,} params, {settings.steps} steps: {plan}, then "
              f"{settings.steps - final_start} x {settings.final_batch_size} task rows of {final_len} tokens -> {path}",
              flush=True)
    for step in range(settings.steps):
        if step < final_start:
            stage = stage_settings(settings, step)
            if stage not in seq_lens:  # computed once per stage, not every step
                seq_lens[stage] = training_length(knobs, stage)
            seq_len = seq_lens[stage]
            tokens, mask, prompt_mask = training_batch(knobs, stage, step, tok, seq_len)
        else:  # a second compiled shape: the task's own rows
            tokens, mask, prompt_mask = final_batch(knobs, settings, step, tok, final_len)
        params, opt_state, loss = train_step(params, opt_state, jnp.asarray(tokens), jnp.asarray(mask),
                                             jnp.asarray(prompt_mask))
        log_loss(step, loss, step == settings.steps - 1)
    return params, list(seq_lens.values())
