#!/usr/bin/env bash
# One device call for the CUDA compute work (issue 13): builds strata and the CUDA tests against
# the carried -dev package root (as scripts/cuda_device_run.sh), runs test_cuda_kernels (all of
# it, then the kernel timings), test_cuda_backend, and scripts/cuda_bench_30b.sh with the same
# build (30B shape Q8_0: all experts in VRAM, then a 6.5 GiB arena from NVMe). Logs in $OUT.
# test_host_tier (its CUDA case) and `strata ssdbw` (the pinned host-to-device probe) run too.
#   RUNS: the bench set of cuda_bench_30b.sh (basic, tiers, nvme).
#   SRC source tree (default: the repository root); DEPS, GTEST, MODELS as cuda_device_run.sh.
set -u
REPO=${REPO:-$(pwd)}
SRC=${SRC:-$REPO}
DEPS=${DEPS:-$REPO/.devdeps/root}
GTEST=${GTEST:-$REPO/.devdeps/googletest}
MODELS=${MODELS:-$REPO/models}
OUT=${OUT:-$REPO/cuda-run}
B=${BUILD:-/tmp/strata-cuda-build}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export STRATA_MODELS_DIR=$MODELS
L=$DEPS/usr
t0=$(date +%s)
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_WERROR=OFF -DSTRATA_BENCH=OFF \
    -DSTRATA_DEPS_ROOT="$DEPS" -DSTRATA_GTEST_SOURCE="$GTEST" -Dfmt_DIR=$L/lib/x86_64-linux-gnu/cmake/fmt \
    -DCLI11_DIR=$L/share/cmake/CLI11 -Dnlohmann_json_DIR=$L/share/cmake/nlohmann_json &&
  cmake --build "$B" -j"$(nproc)" --target strata test_cuda_backend test_cuda_kernels test_host_tier
} > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
echo "== test_cuda_kernels"
timeout 120 "$B/tests/test_cuda_kernels" > "$OUT/kernels.log" 2>&1
echo "rc $?"; grep -E "^\[  (FAILED|PASSED) |mma matmul|Failure|Expected|Which|mismatches" "$OUT/kernels.log" | head -30
STRATA_CUDA_BENCH=1 timeout 60 "$B/tests/test_cuda_kernels" --gtest_filter='*Timings*' 2>&1 | grep timing | tee "$OUT/timings.log"
echo "== test_cuda_backend at $(( $(date +%s) - t0 )) s"
timeout 200 "$B/tests/test_cuda_backend" > "$OUT/backend.log" 2>&1
echo "rc $?"; grep -E "^\[  (FAILED|PASSED) |max \||bit-identical|Failure|Expected|differ" "$OUT/backend.log" | head -30
echo "== test_host_tier at $(( $(date +%s) - t0 )) s"
timeout 120 "$B/tests/test_host_tier" > "$OUT/host_tier.log" 2>&1
echo "rc $?"; grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|Expected" "$OUT/host_tier.log" | head -20
echo "== ssdbw (drive and pinned host-to-device probe)"
timeout 60 "$B/strata" ssdbw -f "$MODELS/qwen3moe-code-Q8_0.gguf" --threads 8 --seconds 1 2>&1 | tee "$OUT/ssdbw.txt" | tail -6
echo "== bench at $(( $(date +%s) - t0 )) s"
REPO=$SRC BUILD=$B OUT=$OUT MODEL=${MODEL:-/tmp/q30b-q8.gguf} bash "$SRC/scripts/cuda_bench_30b.sh" --no-build
