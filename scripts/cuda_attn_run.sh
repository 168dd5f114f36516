#!/usr/bin/env bash
# The tensor-core attention's device run (docs/cuda.md, "Attention"), one call: builds
# test_cuda_kernels, test_cuda_backend and strata (scripts/cuda_env.sh); runs the attention
# tests, the attention timings (Simt and Mma side by side), test_cuda_backend, then
# `strata bench --backend cuda` on a LAYERS-layer cut (default 4) of the 30B shape with the Simt
# kernel (STRATA_CUDA_ATTN=simt) and the default (Mma), both under STRATA_CUDA_PROFILE=1.
# Every step has its own timeout; BENCH_AFTER: skip the benches when more seconds have passed.
set -u
. "$(dirname "$0")/cuda_env.sh"
t0=$(date +%s)
ts() { echo "[$(($(date +%s) - t0)) s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
strata_build -- test_cuda_kernels test_cuda_backend strata > "$OUT/build.log" 2>&1 ||
  { tail -30 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
ts built
timeout 60 "$B/tests/test_cuda_kernels" --gtest_filter='*Attention*' > "$OUT/attn_tests.log" 2>&1
ts "attention tests rc $?"
grep -E "^\[  (FAILED|PASSED) |^\[       OK|^attention|Failure|Expected|Which|mismatch|rror" "$OUT/attn_tests.log" | head -40
STRATA_CUDA_BENCH=1 timeout 40 "$B/tests/test_cuda_kernels" --gtest_filter='*AttentionTimings*' > "$OUT/timings.log" 2>&1
ts "timings rc $?"
grep "timing attention" "$OUT/timings.log"
timeout "${BACKEND_S:-80}" "$B/tests/test_cuda_backend" > "$OUT/backend.log" 2>&1
ts "test_cuda_backend rc $?"
grep -E "^\[  (FAILED|PASSED) |^\[       OK|max \||Failure" "$OUT/backend.log" | head -30
[ $(($(date +%s) - t0)) -lt "${BENCH_AFTER:-150}" ] || { ts "no time left for the benches"; exit 0; }
M=/tmp/q30b-l${LAYERS:-4}.gguf
timeout 40 "$B/strata" synth --like qwen3moe-30b-a3b --type Q8_0 --layers "${LAYERS:-4}" -q -o "$M" \
  --tokenizer-from "$MODELS/qwen3moe-code-Q8_0.gguf" > "$OUT/synth.log" 2>&1 || tail -5 "$OUT/synth.log"
ts synth
for attn in simt mma; do
  STRATA_CUDA_ATTN=$attn STRATA_CUDA_PROFILE=1 timeout 40 "$B/strata" bench -m "$M" --backend cuda --prompt-tokens 2048 \
    --prompt-chunk 2048 --gen 32 -c 4096 --ssd-seconds 1 > "$OUT/bench_$attn.txt" 2> "$OUT/bench_$attn.err"
  ts "bench $attn rc $?"
  grep -iE "prefill|decode" "$OUT/bench_$attn.txt" | head -4
  grep -E "attention" "$OUT/bench_$attn.err" | head -6
done
