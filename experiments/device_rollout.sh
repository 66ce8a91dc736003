#!/usr/bin/env bash
# Prepared GPU run for the rollout engine (issue scope 5): the ragged rollout benchmark at a
# Qwen3-1.7B-shaped random bf16 model with the paper's qwen3-1.7b-0.86 schedule, batch 8 and
# 64, ~1K-token prompts, completions up to 8K (lognormal, median 2K), next to the paper's
# Table 2 (2.21x rollout speedup); then the attention benchmark at batch 64 (best dense vs
# sparse, per-step fixed cost of scoring + top-k + compaction). Each step has a time limit.
#
#   OUT=runs/device bash experiments/device_rollout.sh
#
# Sized for one 10-minute call; raise --gen_len to 16384 / 32768 when there is time left.
# On GPU the engine's page-pool attention runs on a per-row view gathered through the page
# table (no paged Pallas kernel yet), so new-vs-fixed there also measures that gather.
set -uo pipefail
OUT=${OUT:-runs/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^WARNING\|^I0000\|^W0000" | tail -n 20
  echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t0))s"
}

nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee "$OUT/env.txt"
COMMON=(--ragged --model Qwen3-1.7B --preset qwen3-1.7b-0.86 --prompt_len 1024 --gen_len 8192 --median_len 2048
        --sigma 0.8)
step ragged_b8 240 python3 -m experiments.bench_rollout "${COMMON[@]}" --batch 8 --prompts 2 --group 8 \
  --out "$OUT/ragged_b8.json"
step ragged_b64 240 python3 -m experiments.bench_rollout "${COMMON[@]}" --batch 64 --prompts 16 --group 8 \
  --out "$OUT/ragged_b64.json"
step bench_attention_b64 90 python3 -m experiments.bench_attention --batch 64 --contexts 8192 32768 --repeats 10 \
  --out "$OUT/bench_attention_b64.json"
