"""Rollout throughput: dense vs block-sparse sampler vs HF transformers ``generate`` (torch CPU).

``--ragged``: a GRPO-like batch with long-tailed completion lengths (see :func:`ragged_main`):
the fixed-batch sampler vs the continuous-batching engine, dense and sparse, vs HF and tunix.

One random-weight Qwen3-architecture model sized so attention dominates decode, one long
prompt per row, measured side by side in one process. Decode tokens/s are the figures;
prefill is timed and reported separately. Final stdout line is JSON, also written to
``--out`` (default ``runs/bench/bench_rollout.json``).

    python -m experiments.bench_rollout [--batch 4 --prompt_len 8192 --gen_len 1024]

Method: dense then sparse ``generate`` back to back (so machine load hits both alike), each
rerun until a run compiles nothing (the first compiles; its timing is discarded), then HF.
HF is timed per decode step inside ``generate`` (see :func:`_hf`), not as the difference of
two separately timed runs, which a noisy prefill can swamp. The JSON also records the 1-minute
load average at the start and end and the wall time.
"""
from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from typing import Optional, Sequence

import jax
import numpy as np
from absl import flags

from sparrow_jax.attention import IMPLEMENTATIONS, resolve_impl
from sparrow_jax.io import atomic_write_json
from sparrow_jax.models import Qwen3Config, init_params, save_hf
from sparrow_jax.rollout import SamplingParams, SparsitySchedule, generate, generate_continuous
from sparrow_jax.run.cli import parse_flags
from sparrow_jax.run.speed import alternate

BENCH_MODEL = Qwen3Config(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=64, intermediate_size=768,
                          tie_word_embeddings=False, rope_theta=1_000_000.0, max_position_embeddings=40960)


def _ours(params, prompts, gen_len, schedule, impl="auto"):
    """One greedy ``generate``: (decode tok/s, prefill seconds, Rollout)."""
    sampling = SamplingParams(max_new_tokens=gen_len, temperature=0.0)
    out = generate(BENCH_MODEL, params, prompts, jax.random.PRNGKey(0), sampling, schedule=schedule, impl=impl)
    return out.stats["decode_tokens"] / out.stats["decode_s"], out.stats["prefill_s"], out


def _measured(params, prompts, gen_len, schedule, impl="auto"):
    """``_ours`` rerun until a run compiles nothing (at most 3 runs): a run that compiled is not a
    measurement. (On an H200 with jax 0.11 the first Pallas GPU lowering made every earlier jit
    miss its cache once.)"""
    for _ in range(3):
        tok_s, prefill_s, out = _ours(params, prompts, gen_len, schedule, impl)
        if out.stats["compiles"] == 0:
            break
    return tok_s, prefill_s, out


def _hf(params, prompts, gen_len, threads, device="cpu", block=32, probe_blocks=2, skip_steps=4):
    """HF ``generate`` (greedy, sdpa, float32) decode tokens/s, timed per step on ``device``.

    A logits processor stamps the time of every decode step, so the decode figure is
    ``batch / mean step time``: no subtraction of a separately timed (and noisy) prefill.
    torch's thread count is a fairness knob on a shared machine: its OpenMP pool can be
    several times slower with 2 threads than with 1 when other processes hold the cores.
    So the first ``probe_blocks`` blocks of ``block`` steps per setting alternate between
    the values of ``threads`` (same contexts for all), the rest of the run uses the faster
    one, and HF is credited with the fastest setting. On CUDA every stamp synchronises the
    device first (threads then only affect the host side).
    Returns (tok/s of the best setting, prefill seconds, {threads: tok/s}).
    """
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as d:
        save_hf(d, BENCH_MODEL, params)
        model = transformers.Qwen3ForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval().to(device)
    ids = torch.tensor(np.asarray(prompts)).to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    stamps, used = [], []
    probe_steps = block * probe_blocks * len(threads)

    def step_times(th):
        step_s = np.diff(stamps)[skip_steps:]  # step i ran with used[i] threads
        return step_s[np.asarray(used[skip_steps:len(stamps) - 1]) == th]

    class _Stamp(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            sync()
            stamps.append(time.perf_counter())
            i = len(stamps)
            if i < probe_steps:
                th = threads[(i // block) % len(threads)]
            else:  # keep the faster setting
                th = min(threads, key=lambda t: np.mean(step_times(t)) if len(step_times(t)) else np.inf)
            torch.set_num_threads(th)  # the thread count of the next decode step
            used.append(th)
            return scores

    torch.set_num_threads(threads[0])
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False,
                       eos_token_id=None, pad_token_id=0, logits_processor=[_Stamp()])
    prefill_s = stamps[0] - t0
    per_threads = {th: len(prompts) / float(np.mean(step_times(th))) for th in threads if len(step_times(th))}
    return max(per_threads.values()), prefill_s, per_threads


def define_flags(fv: flags.FlagValues) -> None:
    def integer(name, default, help_text):
        flags.DEFINE_integer(name, default, help_text, lower_bound=1, flag_values=fv)

    integer("batch", None, "rows at a time (default 4; --ragged 8)")
    integer("prompt_len", None, "default 8192; --ragged 2048")
    integer("gen_len", None, "default 1024; --ragged: the longest completion, 768")
    integer("budget_tokens", None, "sparse KV budget incl. reserved pages (default 1024; --ragged 512)")
    integer("page_size", 16, "tokens per page")
    flags.DEFINE_bool("skip_hf", False, "do not time HF transformers", flag_values=fv)
    flags.DEFINE_enum("impl", "auto", IMPLEMENTATIONS, "sparse attention implementation "
                      "(auto: Pallas on GPU/TPU; on CPU the C++ kernel, XLA without a compiler)", flag_values=fv)
    flags.DEFINE_string("hf_device", "auto", "torch device for HF (auto: cuda when JAX runs on GPU)", flag_values=fv)
    flags.DEFINE_string("out", "runs/bench/bench_rollout.json", "where to write the JSON summary", flag_values=fv)
    flags.DEFINE_bool("ragged", False, "long-tailed completion lengths, both engines, peers", flag_values=fv)
    integer("prompts", 8, "--ragged: distinct prompts")
    integer("group", 4, "--ragged: samples per prompt (G)")
    integer("median_len", 96, "--ragged: median completion length")
    flags.DEFINE_float("sigma", 1.0, "--ragged: lognormal sigma of completion lengths", flag_values=fv)
    flags.DEFINE_bool("skip_tunix", False, "--ragged: do not time tunix's sampler", flag_values=fv)
    flags.DEFINE_string("model", "bench", "--ragged: 'bench' or a Qwen3 preset (random bf16 weights)",
                        flag_values=fv)
    flags.DEFINE_string("preset", None, "--ragged: a paper schedule preset instead of --budget_tokens",
                        flag_values=fv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args, _ = parse_flags(define_flags, argv, __doc__)
    defaults = dict(batch=8, prompt_len=2048, gen_len=768, budget_tokens=512) if args.ragged else dict(
        batch=4, prompt_len=8192, gen_len=1024, budget_tokens=1024)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.ragged:
        return ragged_main(args)

    params = init_params(BENCH_MODEL, seed=0)
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(3, BENCH_MODEL.vocab_size, args.prompt_len)) for _ in range(args.batch)]
    schedule = SparsitySchedule.from_budget_tokens(args.budget_tokens, page_size=args.page_size,
                                                   dense_layers=(), name=f"fixed-{args.budget_tokens}")
    load_start = os.getloadavg()[0]
    t_start = time.perf_counter()
    sides = {name: functools.partial(_measured, params, prompts, args.gen_len, mode, args.impl)
             for name, mode in (("dense", None), ("sparse", schedule))}
    timed = alternate(sides, repeats=1, warmup=0)  # _measured's reruns are the warm-up
    for name, ((tok_s, prefill_s, out),) in timed.items():
        print(f"{name}: {tok_s:.1f} tok/s decode, prefill {prefill_s:.2f}s, {out.stats}", flush=True)
    ((dense_tok_s, dense_prefill_s, dense_out),), ((sparse_tok_s, sparse_prefill_s, sparse_out),) = timed.values()
    agree = float(np.mean(dense_out.tokens[dense_out.completion_mask] == sparse_out.tokens[sparse_out.completion_mask]))
    result = {"dense_tok_s": round(dense_tok_s, 2), "sparse_tok_s": round(sparse_tok_s, 2),
              "compiles_in_measured_runs": dense_out.stats["compiles"] + sparse_out.stats["compiles"]}
    if not args.skip_hf:
        hf_device = args.hf_device
        if hf_device == "auto":
            hf_device = "cuda" if jax.default_backend() == "gpu" else "cpu"
        threads = sorted({1, os.cpu_count() or 1}) if hf_device == "cpu" else [os.cpu_count() or 1]
        hf_tok_s, hf_prefill_s, hf_by_threads = _hf(params, prompts, args.gen_len, threads, hf_device)
        print(f"hf: {hf_tok_s:.1f} tok/s decode (by torch threads: "
              f"{ {k: round(v, 1) for k, v in hf_by_threads.items()} }), prefill {hf_prefill_s:.2f}s", flush=True)
        result["hf_tok_s"] = round(hf_tok_s, 2)
        result["hf_tok_s_by_threads"] = {str(k): round(v, 2) for k, v in hf_by_threads.items()}
    result["sparse_over_dense"] = round(sparse_tok_s / dense_tok_s, 3)
    if "hf_tok_s" in result:
        result["dense_over_hf"] = round(dense_tok_s / result["hf_tok_s"], 3)
        result["sparse_over_hf"] = round(sparse_tok_s / result["hf_tok_s"], 3)
    result.update(prefill_s={"dense": round(dense_prefill_s, 2), "sparse": round(sparse_prefill_s, 2),
                             **({"hf": round(hf_prefill_s, 2)} if not args.skip_hf else {})},
                  greedy_token_agreement_sparse_vs_dense=round(agree, 4),
                  wall_s=round(time.perf_counter() - t_start, 1),
                  load_avg_1min={"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
                  setup=dict(batch=args.batch, prompt_len=args.prompt_len, gen_len=args.gen_len,
                             budget_tokens=args.budget_tokens, page_size=args.page_size,
                             backend=jax.default_backend(), impl=resolve_impl(args.impl),
                             hf_device=None if args.skip_hf else hf_device, model=BENCH_MODEL.to_hf_dict()))
    _write_result(args.out, result)
    return result


def _write_result(path: str, result: dict) -> None:
    """``result`` to ``path`` (atomically) and, without its setup, as the last stdout line."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write_json(path, result)
    print(json.dumps({k: v for k, v in result.items() if k != "setup"}))


def ragged_lengths(num: int, median: int, sigma: float, max_len: int, seed: int = 0) -> np.ndarray:
    """Completion lengths ~ lognormal(log(median), sigma), rounded, clipped to [8, max_len]."""
    rng = np.random.RandomState(seed)
    return np.clip(np.round(median * np.exp(sigma * rng.randn(num))), 8, max_len).astype(np.int32)


def cache_bytes(config: Qwen3Config, batch: int, max_len: int, page: int, with_minmax: bool = False) -> int:
    """Bytes of the fixed-batch sampler's caches: every row holds ``max_len`` tokens, all layers."""
    pages = -(-max_len // page)
    kv = 2 * batch * config.num_key_value_heads * pages * page * config.head_dim * np.dtype(config.compute_dtype).itemsize
    meta = (3 if with_minmax else 1) * batch * config.num_key_value_heads * pages * config.head_dim * 4
    return config.num_hidden_layers * (kv + meta)


def _fixed_batches(config, params, prompts, lengths, batch, schedule, impl):
    """The fixed-batch sampler over ``batch``-row chunks, each run until its longest request.

    Returns (seconds, {"peak_cache_bytes"}). A row's useful tokens are its own length; the steps
    it runs past it are the waste this engine pays.
    """
    seconds, peak = 0.0, 0
    for i in range(0, len(prompts), batch):
        chunk, steps = prompts[i:i + batch], int(lengths[i:i + batch].max())
        start = time.perf_counter()
        out = generate(config, params, chunk, jax.random.PRNGKey(0),
                       SamplingParams(max_new_tokens=steps, temperature=0.0), schedule=schedule, impl=impl)
        seconds += time.perf_counter() - start
        peak = max(peak, cache_bytes(config, len(chunk), out.tokens.shape[1],
                                     schedule.page_size if schedule is not None else 16))
    return seconds, {"peak_cache_bytes": peak}


def _new_engine(config, params, prompts, lengths, batch, schedule, impl):
    """The continuous-batching engine over all requests. Returns (seconds, stats)."""
    start = time.perf_counter()
    out = generate_continuous(config, params, prompts, jax.random.PRNGKey(0),
                              SamplingParams(max_new_tokens=int(lengths.max()), temperature=0.0),
                              schedule=schedule, impl=impl, max_slots=batch, max_new_per_request=lengths)
    seconds = time.perf_counter() - start
    if not np.array_equal(out.lengths - out.prompt_lens, lengths):
        raise RuntimeError("the engine did not generate the requested lengths")
    return seconds, out.stats


def _fixed_steps(lengths: np.ndarray, batch: int) -> int:
    """Decode steps of fixed batches of ``batch`` requests, each run to its longest request."""
    return int(sum(lengths[i:i + batch].max() for i in range(0, len(lengths), batch)))


def _ragged_peers(args, params, prompts, lengths) -> dict:
    """HF's and tunix's useful tokens/s on the ragged batch (unless skipped): fixed batches as the
    ``fixed`` engine pays them, each chunk costing a prefill plus its longest request's decode
    steps, from a measured prefill and step time (HF: per-step stamps over chunk 0; tunix: two
    warm runs of different lengths, its decode attends the whole cache every step)."""
    chunks, useful = -(-len(prompts) // args.batch), int(lengths.sum())

    def peer_tok_s(prefill_s, step_s):
        return useful / (chunks * prefill_s + _fixed_steps(lengths, args.batch) * step_s)

    out = {}
    if not args.skip_hf:
        hf_tok_s, hf_prefill_s, _ = _hf(params, prompts[:args.batch], int(lengths[:args.batch].max()),
                                        sorted({1, os.cpu_count() or 1}))
        out["hf_tok_s"] = round(peer_tok_s(hf_prefill_s, args.batch / hf_tok_s), 2)
        print(f"hf: {out['hf_tok_s']} useful tok/s (prefill {hf_prefill_s:.2f}s, decode {hf_tok_s:.1f} tok/s)")
    if not args.skip_tunix:
        from experiments.tunix_peer import TunixPeer

        peer = TunixPeer(BENCH_MODEL, params, args.batch, args.prompt_len + 8 + int(lengths.max()))
        prefill_s, step_s = peer.timing(prompts[:args.batch], 8, 8 + min(64, int(lengths.max())))
        out["tunix_tok_s"] = round(peer_tok_s(prefill_s, step_s), 2)
        out["tunix_timing"] = {"prefill_s": round(prefill_s, 3), "step_ms": round(step_s * 1e3, 3)}
        print(f"tunix: {out['tunix_tok_s']} useful tok/s (prefill {prefill_s:.2f}s, step {step_s * 1e3:.1f} ms)")
    return out


def ragged_main(args) -> dict:
    """Useful (non-padding) generated tokens/s on a GRPO-like batch with long-tailed lengths.

    ``--prompts`` prompts of ``--prompt_len`` random tokens, each sampled ``--group`` times;
    completion lengths drawn per request from a lognormal (median ``--median_len``, sigma
    ``--sigma``, clipped to [8, ``--gen_len``]) and forced as per-request caps (a random model
    has no natural ends). Greedy decoding, ``--batch`` rows at a time:

    * fixed: ``generate`` on consecutive chunks of ``--batch`` requests, each chunk running to
      its longest request (what a fixed-batch sampler pays for stop tokens at those places);
    * new: ``generate_continuous`` with ``max_slots=--batch`` (refills, group prefill shared,
      pooled pages);
    * HF ``generate`` and tunix's sampler (:func:`_ragged_peers`).

    Every timed engine ran once before (compiles excluded; :func:`alternate`). Useful tokens = sum of lengths.
    ``--model Qwen3-1.7B`` (random bf16 weights) and ``--preset`` (a paper schedule) are the
    accelerator setting; peers then run only with ``--model bench``.
    """
    bench_model = args.model == "bench"
    config = BENCH_MODEL if bench_model else Qwen3Config.preset(args.model, dtype="bfloat16", param_dtype="bfloat16")
    params = init_params(config, seed=0)
    rng = np.random.RandomState(0)
    distinct = [list(rng.randint(3, config.vocab_size, args.prompt_len)) for _ in range(args.prompts)]
    prompts = [p for p in distinct for _ in range(args.group)]
    lengths = ragged_lengths(len(prompts), args.median_len, args.sigma, args.gen_len)
    useful = int(lengths.sum())
    if args.preset:
        schedule = SparsitySchedule.from_preset(args.preset)
    else:
        schedule = SparsitySchedule.from_budget_tokens(args.budget_tokens, page_size=args.page_size,
                                                       dense_layers=(), name=f"fixed-{args.budget_tokens}")
    load_start = os.getloadavg()[0]
    t_start = time.perf_counter()
    engines = {"fixed": _fixed_batches, "new": _new_engine}
    sides = {f"{engine_name}_{mode_name}": functools.partial(run, config, params, prompts, lengths, args.batch,
                                                             mode, args.impl)
             for mode_name, mode in (("dense", None), ("sparse", schedule)) for engine_name, run in engines.items()}
    result = {"useful_tokens": useful}
    for name, ((seconds, stats),) in alternate(sides, repeats=1).items():  # the untimed first runs compile
        result[f"{name}_tok_s"] = round(useful / seconds, 2)
        for key in ("peak_cache_bytes", "peak_live_cache_bytes", "slot_steps"):
            if key in stats:
                result.setdefault(key, {})[name] = stats[key]
        print(f"{name}: {useful / seconds:.1f} useful tok/s ({seconds:.1f}s)", flush=True)
    if bench_model:  # the peers are built for BENCH_MODEL
        result.update(_ragged_peers(args, params, prompts, lengths))
    result["new_over_fixed"] = {m: round(result[f"new_{m}_tok_s"] / result[f"fixed_{m}_tok_s"], 3)
                                for m in ("dense", "sparse")}
    result["sparse_over_dense"] = {e: round(result[f"{e}_sparse_tok_s"] / result[f"{e}_dense_tok_s"], 3)
                                   for e in engines}
    for peer in ("hf", "tunix"):
        if f"{peer}_tok_s" in result:
            result[f"ours_over_{peer}"] = {
                "new_dense": round(result["new_dense_tok_s"] / result[f"{peer}_tok_s"], 3),
                "fixed_dense": round(result["fixed_dense_tok_s"] / result[f"{peer}_tok_s"], 3)}
    result.update(wall_s=round(time.perf_counter() - t_start, 1),
                  load_avg_1min={"start": round(load_start, 2), "end": round(os.getloadavg()[0], 2)},
                  setup=dict(requests=len(prompts), group=args.group, prompt_len=args.prompt_len, batch=args.batch,
                             lengths=dict(dist="lognormal", median=args.median_len, sigma=args.sigma,
                                          max=args.gen_len, mean=round(float(lengths.mean()), 1),
                                          fixed_steps=_fixed_steps(lengths, args.batch)),
                             budget_tokens=args.budget_tokens, schedule=schedule.name, model=args.model,
                             backend=jax.default_backend(), impl=resolve_impl(args.impl)))
    _write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
