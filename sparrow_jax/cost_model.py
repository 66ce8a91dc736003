"""Rollout cost model: dense vs block-sparse decode, speedup, page-size Pareto, schedule optimiser.

Two models live here.

1. **The paper's eFLOPs formulas** (sparrow-notes §5), implemented literally in
   :func:`paper_dense_cost` / :func:`paper_sparse_cost`: compute plus ``I`` x memory elements,
   ``D`` = key width per token summed over layers, every layer sparse, no weight traffic.

2. **Our refined model** (:func:`dense_rollout_cost`, :func:`sparse_rollout_cost`), used for every
   prediction. It integrates a per-decode-step roofline over absolute positions. Refinements of the
   paper's formulas, each a deliberate correction:

   - *Per-layer accounting.* Key/value bytes and attention FLOPs are counted per layer from the
     config (layers x KV heads x head_dim), so layers that stay dense (``dense_layers``, the released
     ``[0, 1]``) pay full attention while the others pay the budget.
   - *Weight traffic amortised by batch.* Each decode step reads the weights once for the whole
     batch of ``num_samples`` sequences (the paper drops weight traffic entirely; at batch 8 on an
     H200 it is a third to a half of the dense step, which is what caps the speedup).
   - *KV traffic per sequence.* Each sequence reads its own KV (paged kernels do not share the
     prompt prefix across samples; the paper's ``2*Lin*Lout*D`` term counts the prompt once).
   - *Reserved pages and partial pages.* A sparse step reads the first page, the top-k pages and the
     last two pages, the last one only partly filled; when the context is shorter than the budget the
     step is simply dense. The paper's ``B`` is a constant; here it follows the schedule's bins.
   - *Page scoring.* Centroids of all non-reserved pages are read (one vector per page and KV head;
     two for Quest min/max) and scored with one dot product each, plus f32 scores written and read by
     top-k. The paper's prompt-scoring terms ``2*N*Lin*D*Lout`` miss the ``/S`` (prompt pages are
     scored by centroid too); we divide by the page size.
   - *Attention FLOPs.* ``4 * heads * head_dim`` per attended token (QK and PV); the paper's
     ``r*(2*Lin+Lout)*Lout*N*D`` is half of that (it is the compute side, negligible when memory-bound).
   - *Step time* = ``max(FLOPs / peak, bytes / bandwidth) + step_overhead`` per decode step (roofline:
     at decode batch sizes every kernel is memory-bound and its arithmetic hides under its loads;
     summing would charge both). ``combine="sum"`` gives the paper-style sum. ``step_overhead`` (scheduler,
     sampling, launches) is 0 in the presets: we did not measure it, and adding it only lowers
     predicted speedups.
   - *Prefill* of the prompt is dense in both rollouts and counted once per sequence.

Units: FLOPs, bytes, seconds. Hardware peaks are the vendors' dense bf16 numbers (f32 for the CPU).

How it compares (``python -m experiments.cost_report``; H200, batch 8, prompt 150, 32K generated,
tau = 0.86 presets): predicted 2.46 / 2.03 / 1.68 / 1.38 vs the paper's measured 2.21 / 2.41 / 2.06 /
1.49 for 1.7B / 4B / 8B / 14B (ratios 0.82-1.11); the literal paper formula gives 4.4 / 3.9 / 3.8 / 2.7
because it has no weight traffic. Effects not modelled: the per-device batch (not stated in the
paper; predictions rise with it: at 16 they are 2.89 / 2.46 / 2.08 / 1.62), responses ending before
the 32K cutoff, kernel efficiencies below peak bandwidth (different for GEMMs, dense and sparse
attention) and fixed per-step costs (they lower the small model's speedup most).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sparrow_jax.models.config import Qwen3Config
from sparrow_jax.rollout.schedule import SparsitySchedule

# ------------------------------------------------------------------------------------------------
# Hardware


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator: peak FLOP/s, memory bandwidth (bytes/s), bytes per stored element."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    bytes_per_element: int = 2  # bf16 weights and KV on accelerators
    step_overhead_s: float = 0.0  # fixed cost per decode step (launch, sampling, scheduler)

    def __post_init__(self):
        for f in ("peak_flops", "mem_bandwidth", "bytes_per_element"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Hardware.{f} must be positive, got {getattr(self, f)}")
        if self.step_overhead_s < 0:
            raise ValueError(f"Hardware.step_overhead_s must be >= 0, got {self.step_overhead_s}")

    @property
    def flops_per_element_load(self) -> float:
        """The paper's ``I``: FLOPs the chip could do in the time it loads one element."""
        return self.peak_flops * self.bytes_per_element / self.mem_bandwidth


def cpu_hardware(peak_flops: float = 100e9, mem_bandwidth: float = 20e9, bytes_per_element: int = 4,
                 step_overhead_s: float = 0.0) -> Hardware:
    """A user-given CPU (defaults: 2 AVX2 cores ~100 GFLOP/s f32, ~20 GB/s DRAM), f32 storage."""
    return Hardware("cpu", peak_flops, mem_bandwidth, bytes_per_element, step_overhead_s)


# Vendor datasheet numbers: dense (not 2:4 sparse) bf16 matmul peak and HBM bandwidth, one chip.
HARDWARE: dict[str, Hardware] = {
    "H200": Hardware("H200", 989e12, 4.8e12),
    "H100": Hardware("H100", 989e12, 3.35e12),
    "TPU v5e": Hardware("TPU v5e", 197e12, 0.819e12),
    "TPU v6e": Hardware("TPU v6e", 918e12, 1.64e12),
    "cpu": cpu_hardware(),
}


def get_hardware(hw: str | Hardware) -> Hardware:
    if isinstance(hw, Hardware):
        return hw
    if hw not in HARDWARE:
        raise ValueError(f"unknown hardware {hw!r}; known: {sorted(HARDWARE)} (or pass a Hardware)")
    return HARDWARE[hw]


# ------------------------------------------------------------------------------------------------
# Schedules: the sampler's own SparsitySchedule (one concept, one place)


def fixed_budget_schedule(topk: int, *, page_size: int = 16, dense_layers: Sequence[int] = (0, 1),
                          reserved_first: int = 1, reserved_last: int = 2) -> SparsitySchedule:
    """A constant top-k at every position."""
    return SparsitySchedule.fixed(topk, page_size=page_size, reserved_first=reserved_first,
                                  reserved_last=reserved_last, dense_layers=tuple(dense_layers))


def paper_schedule(name: str) -> SparsitySchedule:
    """A published preset, e.g. ``paper_schedule("qwen3-4b-0.86")`` (the package's copy of the tables)."""
    return SparsitySchedule.from_preset(name)


# ------------------------------------------------------------------------------------------------
# Model facts used by the cost model


def matmul_params(cfg: Qwen3Config) -> int:
    """Parameters touched by matmuls per token (= weights read per decode step).

    All layer weights plus the LM head. An untied input embedding is a row lookup (N rows read,
    no FLOPs), so it is excluded; a tied one is the LM head and is counted.
    """
    p = cfg.num_params()
    if not cfg.tie_word_embeddings:
        p -= cfg.vocab_size * cfg.hidden_size
    return p


def kv_width(cfg: Qwen3Config) -> int:
    """Key elements stored per token per layer (= value elements): ``kv_heads * head_dim``."""
    return cfg.num_key_value_heads * cfg.head_dim


def _check_run(num_samples: int, prompt_len: int, gen_len: int) -> None:
    for name, v, lo in (("num_samples", num_samples, 1), ("prompt_len", prompt_len, 1), ("gen_len", gen_len, 1)):
        if int(v) != v or v < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {v}")


def _num_dense_sparse_layers(cfg: Qwen3Config, dense_layers: Sequence[int]) -> tuple[int, int]:
    L = cfg.num_hidden_layers
    bad = [i for i in dense_layers if not 0 <= i < L]
    if bad:
        raise ValueError(f"dense_layers {list(dense_layers)} has indices outside [0, {L}): {bad}")
    n_dense = len(set(dense_layers))
    return n_dense, L - n_dense


# ------------------------------------------------------------------------------------------------
# Refined per-step roofline model


@dataclasses.dataclass(frozen=True)
class RolloutCost:
    """Totals for one batch of ``num_samples`` sequences (prefill + ``gen_len`` decode steps)."""

    flops: float
    bytes: float
    weight_bytes: float
    kv_bytes: float
    score_bytes: float
    compute_time_s: float  # sum over decode steps of flops / peak
    memory_time_s: float  # sum over decode steps of bytes / bandwidth
    decode_time_s: float  # sum over decode steps of the combined step time (+ overhead)
    prefill_time_s: float  # dense prompt prefill, identical in dense and sparse rollouts
    tokens: int  # generated tokens (num_samples * gen_len)

    @property
    def time_s(self) -> float:
        return self.decode_time_s + self.prefill_time_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s

    def as_dict(self) -> dict[str, float]:
        d = dataclasses.asdict(self)
        d["time_s"], d["tokens_per_s"] = self.time_s, self.tokens_per_s
        return d


def _decode_positions(prompt_len: int, gen_len: int) -> np.ndarray:
    """Absolute position of the query token of each decode step [gen_len - 1].

    Prefill over the prompt yields generated token 0; decode step j (1 <= j < gen_len) feeds token
    j-1 at position ``prompt_len + j - 1`` and attends over ``prompt_len + j`` tokens (itself included).
    """
    return np.arange(prompt_len, prompt_len + gen_len - 1, dtype=np.int64)


def _step_times(flops: np.ndarray, nbytes: np.ndarray, hw: Hardware, combine: str) -> np.ndarray:
    """Time of each decode step [T]: roofline max (or sum) of compute and memory, plus overhead."""
    t_c, t_m = flops / hw.peak_flops, nbytes / hw.mem_bandwidth
    if combine == "max":
        t = np.maximum(t_c, t_m)
    elif combine == "sum":
        t = t_c + t_m
    else:
        raise ValueError(f"combine must be 'max' or 'sum', got {combine!r}")
    return t + hw.step_overhead_s


def _sum_steps(flops: np.ndarray, nbytes: np.ndarray, hw: Hardware, combine: str) -> tuple[float, float, float]:
    """(compute time, memory time, step time) summed over decode steps."""
    t = _step_times(flops, nbytes, hw, combine)
    return float((flops / hw.peak_flops).sum()), float((nbytes / hw.mem_bandwidth).sum()), float(t.sum())


def _prefill(cfg: Qwen3Config, num_samples: int, prompt_len: int, hw: Hardware) -> tuple[float, float, float]:
    """Dense prefill of every sequence's prompt: (flops, bytes, time). Same in both rollouts."""
    n, e = num_samples, hw.bytes_per_element
    L, H, dh = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
    # causal attention: sum_{c=1..Lin} 4*H*dh*c per layer per sequence
    flops = n * (2 * matmul_params(cfg) * prompt_len + 4 * H * dh * L * prompt_len * (prompt_len + 1) / 2)
    nbytes = matmul_params(cfg) * e + n * prompt_len * 2 * kv_width(cfg) * L * e  # weights + KV write
    return flops, nbytes, max(flops / hw.peak_flops, nbytes / hw.mem_bandwidth)


def _step_common(cfg: Qwen3Config, num_samples: int, hw: Hardware) -> tuple[float, float]:
    """Per decode step, independent of context: (matmul flops, weight + KV-write bytes)."""
    e = hw.bytes_per_element
    flops = 2.0 * matmul_params(cfg) * num_samples
    nbytes = matmul_params(cfg) * e + num_samples * (cfg.hidden_size * e  # embedding row
                                                     + 2 * kv_width(cfg) * cfg.num_hidden_layers * e)  # KV write
    return flops, nbytes


def dense_rollout_cost(cfg: Qwen3Config, *, num_samples: int, prompt_len: int, gen_len: int,
                       hardware: str | Hardware = "H200", combine: str = "max") -> RolloutCost:
    """Cost of generating ``gen_len`` tokens for ``num_samples`` sequences with full attention.

    Per decode step with context ``c`` (per layer, per sequence): read ``2*c*kv_heads*head_dim``
    KV elements, ``4*heads*head_dim*c`` attention FLOPs; weights read once per step for the batch.
    """
    _check_run(num_samples, prompt_len, gen_len)
    hw = get_hardware(hardware)
    e, n, L = hw.bytes_per_element, num_samples, cfg.num_hidden_layers
    ctx = (_decode_positions(prompt_len, gen_len) + 1).astype(np.float64)  # attended tokens [T]
    f0, b0 = _step_common(cfg, n, hw)
    kv = n * L * 2 * kv_width(cfg) * ctx * e
    flops = f0 + n * L * 4 * cfg.num_attention_heads * cfg.head_dim * ctx
    nbytes = b0 + kv
    tc, tm, t = _sum_steps(flops, nbytes, hw, combine)
    pf, pb, pt = _prefill(cfg, n, prompt_len, hw)
    return RolloutCost(flops=float(flops.sum() + pf), bytes=float(nbytes.sum() + pb),
                       weight_bytes=float(gen_len * matmul_params(cfg) * e), kv_bytes=float(kv.sum()),
                       score_bytes=0.0, compute_time_s=tc, memory_time_s=tm, decode_time_s=t, prefill_time_s=pt,
                       tokens=n * gen_len)


def sparse_tokens_read(schedule: SparsitySchedule, positions: np.ndarray) -> np.ndarray:
    """KV tokens a sparse layer reads for queries at ``positions`` [T] -> [T].

    Context ``c = pos + 1`` in ``n = ceil(c / S)`` pages, the last one holding ``c - (n-1)*S``. If the
    top-k plus reserved pages cover every page the step is dense (``c``); otherwise it reads the
    first ``reserved_first`` and ``topk`` full pages, ``reserved_last - 1`` full trailing pages and
    the partial last page.
    """
    S = schedule.page_size
    c = np.asarray(positions, dtype=np.int64) + 1
    n = -(-c // S)
    k = schedule.topk_at(positions)
    last_fill = c - (n - 1) * S
    full_pages = schedule.reserved_first + k + max(schedule.reserved_last - 1, 0)
    partial = last_fill if schedule.reserved_last > 0 else 0
    sparse = full_pages * S + partial
    return np.where(n <= k + schedule.reserved, c, np.minimum(sparse, c))


def scored_pages(schedule: SparsitySchedule, positions: np.ndarray) -> np.ndarray:
    """Pages whose centroids are scored at ``positions`` [T] -> [T]: non-reserved pages, 0 if all fit."""
    c = np.asarray(positions, dtype=np.int64) + 1
    n = -(-c // schedule.page_size)
    k = schedule.topk_at(positions)
    return np.where(n <= k + schedule.reserved, 0, n - schedule.reserved)


def sparse_rollout_cost(cfg: Qwen3Config, schedule: SparsitySchedule, *, num_samples: int, prompt_len: int,
                        gen_len: int, hardware: str | Hardware = "H200", combine: str = "max",
                        selector: str = "centroid") -> RolloutCost:
    """Cost with block top-k attention in all layers except ``schedule.dense_layers``.

    Per sparse layer, per sequence, per step at position ``p``: KV read of
    :func:`sparse_tokens_read` tokens; scoring reads ``m`` metadata vectors (``m = 1`` centroid,
    ``m = 2`` Quest min/max) of ``kv_heads*head_dim`` per scored page, ``2*m*kv_heads*head_dim``
    FLOPs per page, and writes + reads one f32 score per page and KV head (top-k).
    """
    _check_run(num_samples, prompt_len, gen_len)
    hw = get_hardware(hardware)
    pos = _decode_positions(prompt_len, gen_len)
    flops, nbytes, kv, score_bytes = _sparse_steps(cfg, schedule, pos, num_samples, hw, selector)
    tc, tm, t = _sum_steps(flops, nbytes, hw, combine)
    pf, pb, pt = _prefill(cfg, num_samples, prompt_len, hw)
    return RolloutCost(flops=float(flops.sum() + pf), bytes=float(nbytes.sum() + pb),
                       weight_bytes=float(gen_len * matmul_params(cfg) * hw.bytes_per_element),
                       kv_bytes=float(kv.sum()), score_bytes=float(score_bytes.sum()), compute_time_s=tc,
                       memory_time_s=tm, decode_time_s=t, prefill_time_s=pt, tokens=num_samples * gen_len)


def _sparse_steps(cfg: Qwen3Config, sched: SparsitySchedule, pos: np.ndarray, n: int, hw: Hardware,
                  selector: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per decode step [T]: (flops, bytes, KV bytes, scoring bytes) of the sparse rollout."""
    if selector not in ("centroid", "quest"):
        raise ValueError(f"selector must be 'centroid' or 'quest', got {selector!r}")
    e, kvw = hw.bytes_per_element, kv_width(cfg)
    n_dense, n_sparse = _num_dense_sparse_layers(cfg, sched.dense_layers)
    m = 1 if selector == "centroid" else 2
    ctx = (pos + 1).astype(np.float64)
    read = sparse_tokens_read(sched, pos).astype(np.float64)
    pages = scored_pages(sched, pos).astype(np.float64)
    kv_tok = n_dense * ctx + n_sparse * read  # attended tokens summed over layers
    f0, b0 = _step_common(cfg, n, hw)
    kv = n * 2 * kvw * e * kv_tok
    score_bytes = n * n_sparse * pages * (m * kvw * e + 2 * 4 * cfg.num_key_value_heads)
    flops = (f0 + n * 4 * cfg.num_attention_heads * cfg.head_dim * kv_tok
             + n * n_sparse * pages * 2 * m * kvw)
    return flops, b0 + kv + score_bytes, kv, score_bytes


def step_time_s(cfg: Qwen3Config, schedule: SparsitySchedule | None, positions: Sequence[int] | np.ndarray, *,
                num_samples: int, hardware: str | Hardware = "H200", combine: str = "max",
                selector: str = "centroid") -> np.ndarray:
    """Predicted time (s) of one decode step for queries at absolute ``positions`` [T] -> [T].

    ``schedule=None`` is dense attention. Comparable to a measured ms-per-decode-step benchmark.
    """
    hw = get_hardware(hardware)
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    _check_run(num_samples, 1, 1)
    if schedule is None:
        schedule = SparsitySchedule((0,), dense_layers=tuple(range(cfg.num_hidden_layers)))
    flops, nbytes, _, _ = _sparse_steps(cfg, schedule, pos, num_samples, hw, selector)
    return _step_times(flops, nbytes, hw, combine)


def predicted_speedup(cfg: Qwen3Config, schedule: SparsitySchedule, *, num_samples: int, prompt_len: int,
                      gen_len: int, hardware: str | Hardware = "H200", combine: str = "max",
                      selector: str = "centroid", include_prefill: bool = True) -> float:
    """Rollout throughput ratio sparse / dense (= dense time / sparse time, same tokens).

    ``include_prefill=False`` compares decode loops only (what a decode tok/s benchmark times).
    """
    kw = dict(num_samples=num_samples, prompt_len=prompt_len, gen_len=gen_len, hardware=hardware,
              combine=combine)
    d, s = dense_rollout_cost(cfg, **kw), sparse_rollout_cost(cfg, schedule, selector=selector, **kw)
    if include_prefill:
        return d.time_s / s.time_s
    return d.decode_time_s / s.decode_time_s


def relative_rollout_cost(cfg: Qwen3Config, schedule: SparsitySchedule | None, *, num_samples: int,
                          prompt_len: int, gen_len: int, hardware: str | Hardware = "H200",
                          combine: str = "max", selector: str = "centroid") -> float:
    """Predicted rollout time (prefill + decode) of ``schedule`` relative to dense; ``None`` (dense) is 1.

    The inverse of :func:`predicted_speedup`: below 1 the sparse rollout is cheaper.
    """
    if schedule is None:
        _check_run(num_samples, prompt_len, gen_len)
        return 1.0
    return 1.0 / predicted_speedup(cfg, schedule, num_samples=num_samples, prompt_len=prompt_len, gen_len=gen_len,
                                   hardware=hardware, combine=combine, selector=selector)


# ------------------------------------------------------------------------------------------------
# The paper's formulas, literally (sparrow-notes §5)


def _paper_dims(cfg: Qwen3Config, hardware: str | Hardware) -> tuple[float, float, float, float]:
    """(P, D, r, I) as the paper uses them: D = key width per token summed over layers."""
    hw = get_hardware(hardware)
    return (float(cfg.num_params()), float(kv_width(cfg) * cfg.num_hidden_layers),
            float(cfg.gqa_ratio), hw.flops_per_element_load)


def paper_dense_cost(cfg: Qwen3Config, *, num_samples: int, prompt_len: int, gen_len: int,
                     hardware: str | Hardware = "H200") -> float:
    """``C_comp + I*C_mem``, ``C_comp = 2PNLout + r(2Lin+Lout)Lout N D``, ``C_mem = 2 Lin Lout D + N Lout^2 D``."""
    _check_run(num_samples, prompt_len, gen_len)
    P, D, r, I = _paper_dims(cfg, hardware)
    N, Lin, Lout = float(num_samples), float(prompt_len), float(gen_len)
    comp = 2 * P * N * Lout + r * (2 * Lin + Lout) * Lout * N * D
    mem = 2 * Lin * Lout * D + N * Lout ** 2 * D
    return comp + I * mem


def paper_sparse_cost(cfg: Qwen3Config, schedule: SparsitySchedule | None = None, *, num_samples: int,
                      prompt_len: int, gen_len: int, hardware: str | Hardware = "H200",
                      budget_tokens: int | None = None, page_size: int | None = None) -> float:
    """``C_sparse_noscore + C_scoring`` with a fixed budget ``B`` (tokens) and page size ``S``.

    ``C_sparse_noscore = 2NPLout + 2rNDB Lout + 2INDB Lout``;
    ``C_scoring = 2N Lin D Lout + rND Lout^2/(2S) + 2I Lin D Lout + IND Lout^2/(2S)``.
    With a ``schedule``, ``B*Lout`` becomes the sum of the schedule's nominal budgets over decode
    positions (the only generalisation; dense layers and reserved-page details are ignored as in
    the paper).
    """
    _check_run(num_samples, prompt_len, gen_len)
    P, D, r, I = _paper_dims(cfg, hardware)
    N, Lin, Lout = float(num_samples), float(prompt_len), float(gen_len)
    if schedule is not None:
        if budget_tokens is not None:
            raise ValueError("give either schedule or budget_tokens, not both")
        B_Lout = float(schedule.budget_tokens_at(_decode_positions(prompt_len, gen_len)).sum())
        S = float(page_size or schedule.page_size)
    else:
        if budget_tokens is None or page_size is None:
            raise ValueError("paper_sparse_cost needs a schedule, or budget_tokens and page_size")
        B_Lout, S = float(budget_tokens) * Lout, float(page_size)
    noscore = 2 * N * P * Lout + 2 * r * N * D * B_Lout + 2 * I * N * D * B_Lout
    scoring = (2 * N * Lin * D * Lout + r * N * D * Lout ** 2 / (2 * S)
               + 2 * I * Lin * D * Lout + I * N * D * Lout ** 2 / (2 * S))
    return noscore + scoring


def paper_predicted_speedup(cfg: Qwen3Config, schedule: SparsitySchedule, *, num_samples: int,
                            prompt_len: int, gen_len: int, hardware: str | Hardware = "H200") -> float:
    kw = dict(num_samples=num_samples, prompt_len=prompt_len, gen_len=gen_len, hardware=hardware)
    return paper_dense_cost(cfg, **kw) / paper_sparse_cost(cfg, schedule, **kw)


# ------------------------------------------------------------------------------------------------
# Schedule optimiser and page-size Pareto analysis


def _as_table(table: Mapping[int, Sequence[float]], name: str = "table") -> tuple[list[int], np.ndarray]:
    """Calibration table {topk: p5 per bin} -> (sorted topk list, [K, bins] array)."""
    if not table:
        raise ValueError(f"{name} is empty; expected {{topk: [p5 per bin]}}")
    ks = sorted(int(k) for k in table)
    rows = [np.asarray(table[k], dtype=np.float64) for k in sorted(table, key=int)]
    nb = {r.shape for r in rows}
    if len(nb) != 1 or rows[0].ndim != 1 or rows[0].size == 0:
        raise ValueError(f"{name}: every topk needs the same number of bins (1-D), got shapes "
                         f"{ {k: r.shape for k, r in zip(ks, rows)} }")
    if min(ks) < 0:
        raise ValueError(f"{name}: topk keys must be >= 0, got {ks}")
    return ks, np.stack(rows)


def bin_costs(cfg: Qwen3Config, topks: Sequence[int], num_bins: int, *, num_samples: int, prompt_len: int,
              gen_len: int, hardware: str | Hardware = "H200", bin_width: int = 2000, page_size: int = 16,
              dense_layers: Sequence[int] = (0, 1), reserved_first: int = 1, reserved_last: int = 2,
              combine: str = "max", selector: str = "centroid") -> np.ndarray:
    """Decode time (s) spent in each bin for each constant top-k: [len(topks), num_bins].

    The step time depends only on that step's budget, so a schedule's cost is the sum of its bins'
    entries; this makes the optimiser exact. Prefill is excluded (same for every schedule).
    """
    _check_run(num_samples, prompt_len, gen_len)
    hw = get_hardware(hardware)
    pos = _decode_positions(prompt_len, gen_len)
    b = np.minimum(pos // bin_width, num_bins - 1)
    out = np.zeros((len(topks), num_bins))
    for i, k in enumerate(topks):
        sched = SparsitySchedule((int(k),), bin_width=bin_width, page_size=page_size,
                               reserved_first=reserved_first, reserved_last=reserved_last,
                               dense_layers=tuple(dense_layers))
        flops, nbytes, _, _ = _sparse_steps(cfg, sched, pos, num_samples, hw, selector)
        out[i] = np.bincount(b, weights=_step_times(flops, nbytes, hw, combine), minlength=num_bins)
    return out


def optimise_schedule(cfg: Qwen3Config, table: Mapping[int, Sequence[float]], tau: float, *, num_samples: int,
                      prompt_len: int, gen_len: int, hardware: str | Hardware = "H200", bin_width: int = 2000,
                      page_size: int = 16, dense_layers: Sequence[int] = (0, 1), reserved_first: int = 1,
                      reserved_last: int = 2, combine: str = "max",
                      selector: str = "centroid") -> tuple[SparsitySchedule, float]:
    """Minimum-cost schedule with ``p5 >= tau`` in every bin and top-k non-decreasing with position.

    ``table[topk][b]`` is the measured p5 acceptance rate of a constant ``topk`` in bin ``b``. Exact
    dynamic programme over bins (cost is additive over bins, see :func:`bin_costs`):
    ``best[b][k] = cost[k][b] + min_{k' <= k} best[b-1][k']``. Returns (schedule, decode time s).
    Raises ``ValueError`` naming the bin when no candidate reaches ``tau`` there.
    """
    ks, p5 = _as_table(table)
    K, nb = p5.shape
    ok = p5 >= tau
    for b in range(nb):
        if not ok[:, b].any():
            raise ValueError(f"no top-k in the table reaches p5 >= {tau} in bin {b} "
                             f"(best p5 there {p5[:, b].max():.4f} at topk {ks[int(p5[:, b].argmax())]})")
    cost = bin_costs(cfg, ks, nb, num_samples=num_samples, prompt_len=prompt_len, gen_len=gen_len,
                     hardware=hardware, bin_width=bin_width, page_size=page_size, dense_layers=dense_layers,
                     reserved_first=reserved_first, reserved_last=reserved_last, combine=combine,
                     selector=selector)
    cost = np.where(ok, cost, np.inf)
    best = np.empty((nb, K))
    arg = np.zeros((nb, K), dtype=np.int64)  # argmin predecessor index
    best[0] = cost[:, 0]
    for b in range(1, nb):
        run_min = np.minimum.accumulate(best[b - 1])
        run_arg = np.zeros(K, dtype=np.int64)
        for j in range(1, K):  # index of the running minimum (ties: smallest topk)
            run_arg[j] = j if best[b - 1][j] < run_min[j - 1] else run_arg[j - 1]
        best[b] = cost[:, b] + run_min
        arg[b] = run_arg
    j = int(np.argmin(best[-1]))
    if not np.isfinite(best[-1][j]):
        raise ValueError(f"no non-decreasing schedule reaches p5 >= {tau} in every bin "
                         f"(a bin needs a smaller top-k than an earlier one allows)")
    total = float(best[-1][j])
    path = [j]
    for b in range(nb - 1, 0, -1):
        j = int(arg[b][j])
        path.append(j)
    topk = tuple(ks[i] for i in reversed(path))
    return (SparsitySchedule(topk, bin_width=bin_width, page_size=page_size, reserved_first=reserved_first,
                           reserved_last=reserved_last, dense_layers=tuple(dense_layers)), total)


def _pareto_mask(cost: np.ndarray, quality: np.ndarray) -> np.ndarray:
    """True where no other point has cost <= and quality >= with one strict."""
    out = np.ones(len(cost), dtype=bool)
    for i in range(len(cost)):
        dom = (cost <= cost[i]) & (quality >= quality[i]) & ((cost < cost[i]) | (quality > quality[i]))
        out[i] = not dom.any()
    return out


def pareto_page_sizes(cfg: Qwen3Config, calibration: Mapping[int, Mapping[int, Sequence[float]]], *,
                      num_samples: int, prompt_len: int, gen_len: int, hardware: str | Hardware = "H200",
                      taus: Sequence[float] = (), bin_width: int = 2000, dense_layers: Sequence[int] = (0, 1),
                      reserved_first: int = 1, reserved_last: int = 2, combine: str = "max",
                      selector: str = "centroid") -> dict[str, Any]:
    """Mismatch-vs-cost analysis across page sizes.

    ``calibration[page_size][topk]`` = p5 per bin for a constant ``topk`` at that page size. Each
    (page size, topk) is a point (decode time, worst-bin p5); the Pareto front is computed over all
    page sizes together. For each ``tau`` the optimal schedule's time per page size is reported too.

    Returns ``{"points": [{page_size, topk, budget_tokens, time_s, p5_min, pareto}], "dominant": S or
    None (the page size owning every front point), "by_tau": {tau: {"time_s": {S: t or None},
    "best": S or None, "topk": {S: [..] or None}}}}``.
    """
    if not calibration:
        raise ValueError("calibration is empty; expected {page_size: {topk: [p5 per bin]}}")
    common = dict(num_samples=num_samples, prompt_len=prompt_len, gen_len=gen_len, hardware=hardware,
                  bin_width=bin_width, dense_layers=dense_layers, reserved_first=reserved_first,
                  reserved_last=reserved_last, combine=combine, selector=selector)
    points = []
    for S in sorted(calibration):
        if int(S) <= 0:
            raise ValueError(f"calibration page size must be positive, got {S}")
        ks, p5 = _as_table(calibration[S], name=f"calibration[{S}]")
        cost = bin_costs(cfg, ks, p5.shape[1], page_size=int(S), **common).sum(axis=1)
        for i, k in enumerate(ks):
            points.append(dict(page_size=int(S), topk=k, budget_tokens=(k + reserved_first + reserved_last) * int(S),
                               time_s=float(cost[i]), p5_min=float(p5[i].min())))
    mask = _pareto_mask(np.array([p["time_s"] for p in points]), np.array([p["p5_min"] for p in points]))
    for p, m in zip(points, mask):
        p["pareto"] = bool(m)
    owners = {p["page_size"] for p in points if p["pareto"]}
    by_tau = {}
    for tau in taus:
        times, topks = {}, {}
        for S in sorted(calibration):
            try:
                sched, t = optimise_schedule(cfg, calibration[S], tau, page_size=int(S), **common)
                times[int(S)], topks[int(S)] = t, list(sched.topk)
            except ValueError:
                times[int(S)], topks[int(S)] = None, None
        feasible = {S: t for S, t in times.items() if t is not None}
        by_tau[float(tau)] = dict(time_s=times, topk=topks,
                                  best=min(feasible, key=feasible.get) if feasible else None)
    return dict(points=points, dominant=owners.pop() if len(owners) == 1 else None, by_tau=by_tau)
