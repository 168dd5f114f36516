#!/usr/bin/env bash
# One device call for the routing on the device (docs/cuda.md "Routing on the device"): builds
# strata and the two CUDA test binaries (scripts/cuda_env.sh), runs the route tests and the
# bit-identity tests of test_cuda_kernels and test_cuda_backend, then profiles a cut of the 30B
# shape (`strata synth --like qwen3moe-30b-a3b --type Q8_0 --layers $LAYERS`, every expert in
# VRAM, a PT-token prompt in one chunk, GEN decode tokens) under STRATA_CUDA_PROFILE=1, with the
# device selection and with STRATA_CUDA_HOST_ROUTE=1 (the host selection), in the same call.
# Every step has its own timeout and the whole stays within BUDGET seconds (default 205).
set -u
. "$(dirname "$0")/cuda_env.sh"
t0=$(date +%s)
BUDGET=${BUDGET:-205}
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
LAYERS=${LAYERS:-4}
M=/tmp/q30b-q8-l$LAYERS.gguf
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
timeout $(( $(left) - 60 )) bash -c ". '$(dirname "$0")/cuda_env.sh'; strata_build -- strata test_cuda_kernels test_cuda_backend" \
  > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
# The 30B cut is written in the background while the tests run (CPU work; the tests use the GPU).
( timeout 60 "$B/strata" synth --like qwen3moe-30b-a3b --type Q8_0 --layers "$LAYERS" -q -o "$M" \
    --tokenizer-from "$MODELS/qwen3moe-code-Q8_0.gguf" > "$OUT/synth.log" 2>&1; echo "synth rc $?" >> "$OUT/synth.log" ) &
synth_pid=$!
timeout 30 "$B/tests/test_cuda_kernels" --gtest_filter='*Route*:*BatchInvariance*' > "$OUT/kernels.log" 2>&1
echo "test_cuda_kernels rc $? at $(( $(date +%s) - t0 )) s"
grep -E "^\[  (FAILED|PASSED|  OK) |route select|Failure|Expected|Which|ulp" "$OUT/kernels.log" | head -30
wait $synth_pid
tail -2 "$OUT/synth.log"
for mode in device host; do
  tp=${BENCH_S:-30}
  [ $tp -lt 5 ] && { echo "no time left for $mode"; continue; }
  hr=0
  [ "$mode" = host ] && hr=1
  STRATA_CUDA_HOST_ROUTE=$hr STRATA_CUDA_PROFILE=1 \
    timeout $tp "$B/strata" bench -m "$M" --backend cuda --prompt-tokens "${PT:-2048}" --prompt-chunk "${PC:-2048}" \
    --gen "${GEN:-32}" -c 4096 --ssd-seconds 1 > "$OUT/bench_$mode.txt" 2> "$OUT/profile_$mode.err"
  echo "== $mode selection: bench rc $? at $(( $(date +%s) - t0 )) s"
  grep -iE "prefill|decode" "$OUT/bench_$mode.txt" | head -6
  grep -E "cuda profile: .*(route|router|busy|idle|host wait|experts grouped \(all\)|attention \(all\)|moe_combine)" \
    "$OUT/profile_$mode.err" | head -24
done
# The rest of the time: test_cuda_backend (the route test and the bit-identity tests first).
tb=$(( $(left) - 2 ))
[ $tb -gt 5 ] && timeout $tb "$B/tests/test_cuda_backend" --gtest_filter="${BACKEND_FILTER:-*Route*:*Invariant*:*BitIdentical*:*MatchesCpu*}" \
  > "$OUT/backend.log" 2>&1
echo "test_cuda_backend rc $? (timeout $tb) at $(( $(date +%s) - t0 )) s"
grep -E "^\[  (FAILED|PASSED|  OK) |route variant|Failure|Expected|Which|differ" "$OUT/backend.log" | head -40
