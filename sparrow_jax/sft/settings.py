"""The warm-up's training settings and the architecture it trains.

:class:`WarmupSettings` holds every training setting (all enter the cache key, see
:mod:`sparrow_jax.sft.cache`); :func:`warmup_settings` reads them from a run's ``model.warmup``
block. Imports models and the attention's selector names only (and the run specs for type hints).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from sparrow_jax.attention.selection import SELECTORS
from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.models.tokenizer import BuiltinTokenizer

if TYPE_CHECKING:
    from sparrow_jax.run.specs import ModelSpec

# model.warmup fields that are not training settings (not in the cache hash): where the cache lives
# and what the final evaluation measures (context lengths, trace lengths, prompts per entry).
_NOT_HASHED = ("cache_dir", "eval_lengths", "eval_hops", "eval_prompts")
# the slip run's own sparse loss at its defaults: the refine's loss, the sampler's kept first page
SLIP_LAYOUT_DEFAULTS = dict(slip_sparse_topk=0, slip_sparse_weight=0.0, slip_reserved_first=1, slip_selector="centroid")


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
      first, then ``queries_per_example - 1`` from :func:`examples.extra_queries`).
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
      A stage may have a 5th element, its ``lookup_every`` (replacing the setting below).
    lookup_every: recurrence_trace only: > 0 makes the curriculum (or single-phase) rows look up
      every ``lookup_every``-th line (a divisor of 100) instead of every ``task.far_every``-th;
      0: the task's. The final, refine and preamble phases and the evaluation keep the task's.
      Why: at far_every=10 the look-up constants are ~1% of a row's loss, and a 3-layer model
      learned every local line while its look-ups against tables of >= 12 entries stayed at
      chance (docs/results.md); rows dense in look-ups give that skill a larger share.
    lookup_weight: weight of an extra loss term, the mean NLL of the reference tokens right after
      a ``=`` (recurrence_trace's and pointer_trace's looked-up symbols); 0: none. Why: when the
      local tokens are learned and the look-ups are not, it keeps the look-ups' share of the gradient.
    refine_steps, refine_lr, refine_batch_size: after ``steps``, a second run of the optimiser
      (fresh AdamW state, linear warm-up over ``warmup_frac`` of it, cosine decay to 10% of
      ``refine_lr``) of ``refine_steps`` steps on the task's own rows, ``refine_batch_size``
      each, drawn past the main phase's steps (0: none). Why a warm restart rather than a longer
      final phase: the main schedule meets the task's full-length rows near the end of its decay,
      and long_trace's reference NLL was still falling fast there (0.57 -> 0.10 in its last 75
      steps); 300 refine steps at 1e-3 took it to 0.005 and the greedy reward at 104 hops from
      0.04 to 0.72.
    refine_sparse_topk, refine_sparse_weight: the refine phase's loss adds ``refine_sparse_weight`` x
      the reference NLL of the sparse actor's teacher-forced pass (every layer sparse, pages of 16,
      the first page and the last two always kept, centroid selection, ``refine_sparse_topk``
      selected pages: the sampler's default layout); 0 weight: none. Why: a tiny model trained
      densely reads its line numbers through diffuse attention over the whole trace (its dense
      outputs there are confident, the sparse actor's are not: p5 of the acceptance rate ~0 past
      position 1000 at 32 pages, docs/results.md), where a pretrained LLM's chain of thought keeps
      its mass on a few pages; training both passes on the same rows teaches the local reading
      that the method assumes, and RL then trains the dense policy as usual.
    slip_steps, slip_lr, slip_batch_size, slip_prob: recurrence_trace only: after the refine phase
      (or the main one), a run of its own like the refine one (its sparse loss included) on task rows
      whose references read a neighbouring key at each look-up with probability ``slip_prob``
      (the trace then goes on consistently from what it read); 0 steps: none. Why: the clean
      warm-up's sampled errors are look-up keys one letter off, which its 3 layers cannot compute
      more reliably, and RL barely moves them (docs/results.md); a warm-up that keeps
      ``slip_prob`` of its mass on the neighbouring key has a flaw its own samples expose, so the
      dense policy has room to learn, as a pretrained model's pass@k exceeds its pass@1.
    slip_sparse_topk, slip_sparse_weight, slip_reserved_first, slip_selector: the slip run's sparse loss, where it
      differs from the refine's: ``slip_sparse_topk`` selected pages (0: ``refine_sparse_topk``) at
      weight ``slip_sparse_weight`` (0: ``refine_sparse_weight``), with the first
      ``slip_reserved_first`` pages always kept (1: the sampler's default; a calibrated schedule's
      ``schedule.reserved_first``, e.g. the pages of a key table, trains the layout it samples
      with). Why: the refine's 8 pages with one kept taught a sparse actor that still needed
      ~90% of the pages late in the headline's traces; a slip run at a tiny ``slip_prob`` (0.2%:
      a second refine, in effect) at 4 pages, the table's 6 kept and weight 2 brings top-k 4's
      p5 to >= 0.87 in every bin (docs/results.md). ``slip_selector`` is the page scoring rule of that
      sparse actor (``"centroid"``, the refine's, or ``"quest"``): a layout whose rollouts select the
      key table's pages instead of keeping them trains with the selector that finds them.
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
    lookup_every: int = 0
    lookup_weight: float = 0.0
    refine_steps: int = 0
    refine_lr: float = 1e-3
    refine_batch_size: int = 4
    refine_sparse_topk: int = 0
    refine_sparse_weight: float = 0.0
    slip_steps: int = 0
    slip_lr: float = 3e-4
    slip_batch_size: int = 4
    slip_prob: float = 0.0
    slip_sparse_topk: int = 0
    slip_sparse_weight: float = 0.0
    slip_reserved_first: int = 1
    slip_selector: str = "centroid"
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
        if int(self.refine_sparse_topk) < 0 or not self.refine_sparse_weight >= 0.0 or \
                (self.refine_sparse_weight > 0.0 and not (self.refine_steps and self.refine_sparse_topk)):
            raise ValueError(f"warmup refine_sparse_weight > 0 needs refine_steps > 0 and refine_sparse_topk > 0 (both "
                             f">= 0), got weight {self.refine_sparse_weight}, top-k {self.refine_sparse_topk}, "
                             f"refine_steps {self.refine_steps}")
        if int(self.slip_steps) < 0 or int(self.slip_batch_size) <= 0 or not self.slip_lr > 0 or \
                not 0.0 <= self.slip_prob < 1.0 or (self.slip_steps > 0) != (self.slip_prob > 0.0):
            raise ValueError(f"warmup slip_steps must be >= 0, slip_batch_size and slip_lr positive, and slip_prob in "
                             f"[0, 1), > 0 exactly when slip_steps > 0; got steps {self.slip_steps}, batch size "
                             f"{self.slip_batch_size}, lr {self.slip_lr}, prob {self.slip_prob}")
        if int(self.slip_sparse_topk) < 0 or not self.slip_sparse_weight >= 0.0 or int(self.slip_reserved_first) < 1:
            raise ValueError(f"warmup slip_sparse_topk and slip_sparse_weight must be >= 0 and slip_reserved_first >= 1, "
                             f"got {self.slip_sparse_topk}, {self.slip_sparse_weight} and {self.slip_reserved_first}")
        if self.slip_selector not in SELECTORS:
            raise ValueError(f"warmup slip_selector must be one of {SELECTORS}, got {self.slip_selector!r}")
        slip_layout = any(getattr(self, name) != default for name, default in SLIP_LAYOUT_DEFAULTS.items())
        if slip_layout and not self.slip_steps:
            raise ValueError(f"warmup slip_sparse_topk / slip_sparse_weight / slip_reserved_first / slip_selector set "
                             f"the slip run's sparse loss and need slip_steps > 0, got slip_steps {self.slip_steps}")
        if self.slip_steps and (self.slip_sparse_weight or self.refine_sparse_weight) and \
                not (self.slip_sparse_topk or self.refine_sparse_topk):
            raise ValueError(f"warmup slip run: a sparse loss weight needs a top-k (slip_ or refine_), got "
                             f"slip_sparse_weight {self.slip_sparse_weight}, slip_sparse_topk {self.slip_sparse_topk}, "
                             f"refine_sparse_weight {self.refine_sparse_weight}, refine_sparse_topk "
                             f"{self.refine_sparse_topk}")
        if int(self.max_train_hops) < 0 or int(self.final_batch_size) <= 0:
            raise ValueError(f"warmup max_train_hops must be >= 0 and final_batch_size positive, got "
                             f"{self.max_train_hops} and {self.final_batch_size}")
        if not 0.0 <= self.final_frac < 1.0:
            raise ValueError(f"warmup final_frac must be in [0, 1), got {self.final_frac}")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"warmup warmup_frac must be in [0, 1), got {self.warmup_frac}")
        stages = [tuple(stage) for stage in self.curriculum]
        if any(len(st) not in (4, 5) or not all(isinstance(v, int) and v > 0 for v in st[:4]) for st in stages):
            raise ValueError(f"warmup curriculum stages must be (steps, max_context, max_hops, batch_size) of "
                             f"positive ints (and optionally lookup_every), got {self.curriculum}")
        for every in [self.lookup_every] + [st[4] for st in stages if len(st) == 5]:
            if not isinstance(every, int) or every < 0 or every == 1 or (every and 100 % every):
                raise ValueError(f"warmup lookup_every (setting or a curriculum stage's 5th element) must be 0 (the "
                                 f"task's far_every) or a divisor of 100 >= 2, got {every}")
        first_final = self.steps - int(round(self.final_frac * self.steps))
        if stages and sum(st[0] for st in stages) != first_final:
            raise ValueError(f"warmup curriculum steps add up to {sum(st[0] for st in stages)}, but the phase "
                             f"before the final one has {first_final} steps (steps {self.steps}, final_frac "
                             f"{self.final_frac})")
        object.__setattr__(self, "curriculum", tuple(stages))  # lists from a config become hashable tuples


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


def warmup_architecture(model: ModelSpec) -> Qwen3Config:
    """Qwen3Config of the warm-up model: ``model.tiny`` with the builtin tokenizer's vocab."""
    arch = dict(model.tiny)
    arch["vocab_size"] = BuiltinTokenizer().vocab_size  # the tokenizer decides, not the config
    return Qwen3Config(**arch, dtype=model.dtype, param_dtype=model.param_dtype)
