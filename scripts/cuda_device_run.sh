#!/usr/bin/env bash
# The CUDA backend's device run, end to end, on a bare GPU machine (docs/cuda.md): builds strata
# and the CUDA tests against a `dpkg -x` root of Debian's -dev packages, runs the tests, the
# kernel timings and `strata bench` on the shipped model with --backend cuda and cpu, and
# leaves every log in $OUT (default ./cuda-run).
#   SRC   source tree to build (default: the repository root)
#   DEPS  the -dev package root (default: $REPO/.devdeps/root); GTEST: a googletest source tree
#   MODELS folder of the models (default: $REPO/models)
set -u
. "$(dirname "$0")/cuda_env.sh"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  cmake --version | head -1; c++ --version | head -1; nvcc --version | tail -1
  strata_build -- strata test_cuda_backend test_cuda_kernels
} > "$OUT/build.log" 2>&1
rc=$?
tail -25 "$OUT/build.log"
[ $rc -eq 0 ] || { echo "BUILD FAILED ($rc)"; exit $rc; }
echo "== test_cuda_backend"
timeout 300 "$B/tests/test_cuda_backend" 2>&1 | tee "$OUT/test_cuda_backend.log" | grep -E "^\[|max \||bit-identical|backend:|MiB|Failure|Expected|Which|differ" | head -60
echo "== kernel timings"
STRATA_CUDA_BENCH=1 timeout 120 "$B/tests/test_cuda_kernels" --gtest_filter='*Timings*' > "$OUT/kernels.log" 2>&1
grep -vE "^\[ *(RUN|OK) " "$OUT/kernels.log" | tail -25
for be in cuda cpu; do
  echo "== bench --backend $be"
  timeout 150 "$B/strata" bench -m "$MODELS/qwen3moe-code-Q8_0.gguf" --backend $be --ssd-seconds 2 > "$OUT/bench_$be.txt" 2>&1
  tail -8 "$OUT/bench_$be.txt"
done
echo "== run --backend cuda"
timeout 60 "$B/strata" run -m "$MODELS/qwen3moe-code-Q8_0.gguf" -f "$MODELS/prompt.py" -n 64 --temp 0 --backend cuda \
  > "$OUT/run_cuda.txt" 2>&1
tail -6 "$OUT/run_cuda.txt"
