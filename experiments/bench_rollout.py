"""Rollout throughput: dense vs block-sparse sampler vs HF transformers ``generate`` (torch CPU).

One random-weight Qwen3-architecture model sized so attention dominates decode, one long
prompt per row, measured side by side in one process. Decode tokens/s are the figures;
prefill is timed and reported separately. Final stdout line is JSON, also written to
``--out`` (default ``runs/bench/bench_rollout.json``).

    python -m experiments.bench_rollout [--batch 4 --prompt_len 8192 --gen_len 1024]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import numpy as np

from sparrow_jax.io import atomic_write_json
from sparrow_jax.models import Qwen3Config, init_params, save_hf
from sparrow_jax.rollout import SamplingParams, SparsitySchedule, generate

BENCH_MODEL = Qwen3Config(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=64, intermediate_size=768,
                          tie_word_embeddings=False, rope_theta=1_000_000.0, max_position_embeddings=40960)


def _ours(params, prompts, gen_len, schedule):
    sampling = SamplingParams(max_new_tokens=gen_len, temperature=0.0)
    generate(BENCH_MODEL, params, prompts, jax.random.PRNGKey(0), sampling, schedule=schedule)  # compile
    out = generate(BENCH_MODEL, params, prompts, jax.random.PRNGKey(0), sampling, schedule=schedule)
    return out.stats["decode_tokens"] / out.stats["decode_s"], out.stats["prefill_s"], out


def _hf(params, prompts, gen_len, threads):
    import torch
    import transformers

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as d:
        save_hf(d, BENCH_MODEL, params)
        model = transformers.Qwen3ForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    ids = torch.tensor(np.asarray(prompts))

    def run(n):
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - t

    run(2)  # warm-up
    prefill_s = run(1)
    total_s = run(gen_len)
    return len(prompts) * (gen_len - 1) / (total_s - prefill_s), prefill_s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt_len", type=int, default=8192)
    ap.add_argument("--gen_len", type=int, default=1024)
    ap.add_argument("--budget_tokens", type=int, default=1024, help="sparse KV budget incl. reserved pages")
    ap.add_argument("--page_size", type=int, default=16)
    ap.add_argument("--skip_hf", action="store_true")
    ap.add_argument("--out", default="runs/bench/bench_rollout.json")
    args = ap.parse_args(argv)

    params = init_params(BENCH_MODEL, seed=0)
    rng = np.random.RandomState(0)
    prompts = [list(rng.randint(3, BENCH_MODEL.vocab_size, args.prompt_len)) for _ in range(args.batch)]
    schedule = SparsitySchedule.from_budget_tokens(args.budget_tokens, page_size=args.page_size,
                                                   dense_layers=(), name=f"fixed-{args.budget_tokens}")
    dense_tok_s, dense_prefill_s, dense_out = _ours(params, prompts, args.gen_len, None)
    print(f"dense: {dense_tok_s:.1f} tok/s decode, prefill {dense_prefill_s:.2f}s", flush=True)
    sparse_tok_s, sparse_prefill_s, sparse_out = _ours(params, prompts, args.gen_len, schedule)
    print(f"sparse: {sparse_tok_s:.1f} tok/s decode, prefill {sparse_prefill_s:.2f}s", flush=True)
    agree = float(np.mean(dense_out.tokens[dense_out.completion_mask] == sparse_out.tokens[sparse_out.completion_mask]))
    result = {"dense_tok_s": round(dense_tok_s, 2), "sparse_tok_s": round(sparse_tok_s, 2)}
    if not args.skip_hf:
        hf_tok_s, hf_prefill_s = _hf(params, prompts, args.gen_len, threads=os.cpu_count() or 1)
        print(f"hf: {hf_tok_s:.1f} tok/s decode, prefill {hf_prefill_s:.2f}s", flush=True)
        result["hf_tok_s"] = round(hf_tok_s, 2)
    result["sparse_over_dense"] = round(sparse_tok_s / dense_tok_s, 3)
    if "hf_tok_s" in result:
        result["dense_over_hf"] = round(dense_tok_s / result["hf_tok_s"], 3)
        result["sparse_over_hf"] = round(sparse_tok_s / result["hf_tok_s"], 3)
    result.update(prefill_s={"dense": round(dense_prefill_s, 2), "sparse": round(sparse_prefill_s, 2),
                             **({"hf": round(hf_prefill_s, 2)} if not args.skip_hf else {})},
                  greedy_token_agreement_sparse_vs_dense=round(agree, 4),
                  setup=dict(batch=args.batch, prompt_len=args.prompt_len, gen_len=args.gen_len,
                             budget_tokens=args.budget_tokens, page_size=args.page_size,
                             backend=jax.default_backend(), model=BENCH_MODEL.to_hf_dict()))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    atomic_write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "setup"}))
    return result


if __name__ == "__main__":
    main()
