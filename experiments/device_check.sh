#!/usr/bin/env bash
# One prepared run on a GPU machine: the Pallas GPU kernel (compiled, not interpreted) against a
# float64 reference, then the attention and rollout benchmarks on the GPU, then the test
# suite under that machine's jax on its CPU backend (checks the newer jax; CI covers the
# older one). Every step has its own time limit, so one slow step cannot hide the rest.
#
#   OUT=runs/device bash experiments/device_check.sh
#
# Then the rollout engine at a Qwen3-1.7B-shaped random bf16 model: the
# ragged rollout benchmark with the paper's qwen3-1.7b-0.86 schedule, batch 8 and 64, ~1K
# prompts, completions up to 8K (lognormal, median 2K), next to the paper's Table 2 (2.21x
# rollout speedup); and the attention benchmark at batch 64. Sized for a second 10-minute
# call: `STAGE=rollout bash experiments/device_check.sh`. On GPU the engine's page-pool
# attention runs on a per-row view gathered through the page table (no paged Pallas kernel
# yet), so new-vs-fixed there also measures that gather. Raise --gen_len to 16384 / 32768
# when time is left.
#
# The train step's whole-sequence attention, reference (chunked XLA) vs fast (cuDNN flash) on one
# Qwen3-1.7B-shaped bf16 layer, forward + backward at 8K and 32K tokens per row (32K tokens a
# step): `STAGE=train_step bash experiments/device_check.sh` (sized for one ~5-minute call).
#
# Wheels of packages the GPU image lacks may sit in .whl/ (see docs/gpu_checks.md).
set -uo pipefail
OUT=${OUT:-runs/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())"
  nproc; } 2>&1 | tee "$OUT/env.txt"

step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^WARNING\|^I0000\|^W0000" | tail -n 40
  echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t0))s"
}

if [ "${STAGE:-check}" = rollout ]; then
  COMMON=(--ragged --model Qwen3-1.7B --preset qwen3-1.7b-0.86 --prompt_len 1024 --gen_len 8192 --median_len 2048
          --sigma 0.8)
  step ragged_b8 240 python3 -m experiments.bench_rollout "${COMMON[@]}" --batch 8 --prompts 2 --group 8 \
    --out "$OUT/ragged_b8.json"
  step ragged_b64 240 python3 -m experiments.bench_rollout "${COMMON[@]}" --batch 64 --prompts 16 --group 8 \
    --out "$OUT/ragged_b64.json"
  step bench_attention_b64 90 python3 -m experiments.bench_attention --batch 64 --contexts 8192 32768 --repeats 10 \
    --out "$OUT/bench_attention_b64.json"
  exit 0
fi

if [ "${STAGE:-check}" = train_step ]; then
  step bench_train_step_1p7b 300 python3 -m experiments.bench_train_step --model Qwen3-1.7B --layers 1 \
    --lengths 8192 32768 --tokens_per_step 32768 --repeats 3 --peak_size 8192
  grep '^{' "$OUT/bench_train_step_1p7b.log" | tail -n 1 > "$OUT/bench_train_step_1p7b.json"
  exit 0
fi

step check_kernels 120 python3 -m experiments.check_kernels --impls pallas_gpu xla triton reference
step bench_attention 120 python3 -m experiments.bench_attention --repeats 20 --out "$OUT/bench_attention.json"
step bench_rollout 180 python3 -m experiments.bench_rollout --out "$OUT/bench_rollout.json"
step pytest_cpu 150 env JAX_PLATFORMS=cpu python3 -m pytest -n 8 -q -p no:cacheprovider tests \
  --ignore=tests/test_notebooks.py
