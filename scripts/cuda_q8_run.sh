#!/usr/bin/env bash
# The q8-activation device run (docs/cuda.md "q8 activations"), one call on a bare GPU machine:
# builds strata and the CUDA tests (scripts/cuda_env.sh), runs test_cuda_kernels, test_cuda_backend,
# the kernel timings (q8 next to the fp32 and bf16x3 paths), the Qwen3-30B-A3B shape cut to
# LAYERS layers (default 4; strata synth, Q8_0) with every expert in VRAM, --act-quant f32 and q8
# side by side, then test_cuda_backend (filter BF, default all; timeout BT s, default what is left of
# DEADLINE = 250 s since the start). Logs in $OUT: build.log, kernels.log, backend.log, timings.log, bench_*.json/err.
set -u
. "$(dirname "$0")/cuda_env.sh"
t0=$(date +%s)
since() { echo "[$(( $(date +%s) - t0 )) s]"; }
strata_build -DSTRATA_BENCH=OFF -- strata test_cuda_kernels test_cuda_backend > "$OUT/build.log" 2>&1 ||
  { tail -30 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "built $(since)"
timeout ${KT:-60} "$B/tests/test_cuda_kernels" > "$OUT/kernels.log" 2>&1
echo "test_cuda_kernels rc $? $(since)"
grep -E "^\[  (FAILED|PASSED) |Failure|Expected|Which|actual|mism|worst" "$OUT/kernels.log" | head -30
STRATA_CUDA_BENCH=1 timeout 40 "$B/tests/test_cuda_kernels" --gtest_filter='*Timings*' > "$OUT/timings.log" 2>&1
echo "timings rc $? $(since)"
grep -E "timing" "$OUT/timings.log" | grep -E "Q8_0|BF16|attention"
M=/tmp/q30b-q8-l${LAYERS:-4}.gguf
timeout 60 "$B/strata" synth --like qwen3moe-30b-a3b --type Q8_0 --layers "${LAYERS:-4}" -q -o "$M" \
  --tokenizer-from "$MODELS/qwen3moe-code-Q8_0.gguf" > /dev/null 2>&1
echo "synth rc $? $(since)"
for act in ${ACTS:-f32 q8}; do
  timeout 40 "$B/strata" bench -m "$M" --backend cuda --prompt-tokens 2048 --prompt-chunk 2048 --gen 32 -c 4096 \
    --ssd-seconds 1 --act-quant $act --json > "$OUT/bench_$act.json" 2> "$OUT/bench_$act.err"
  echo "bench act-quant $act rc $? $(since)"
  bench_summary "$OUT/bench_$act.json"
  tail -2 "$OUT/bench_$act.err"
done
BT=${BT:-$(( ${DEADLINE:-250} - ($(date +%s) - t0) ))}; [ "$BT" -gt 10 ] || BT=10
timeout $BT "$B/tests/test_cuda_backend" --gtest_filter="${BF:-*}" > "$OUT/backend.log" 2>&1
echo "test_cuda_backend rc $? $(since)"
grep -E "^\[  (FAILED|PASSED) |^\[ *(OK|FAILED) |Failure|Expected|Which|q8 act|max \||differ" "$OUT/backend.log" | head -40
