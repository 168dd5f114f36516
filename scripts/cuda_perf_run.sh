#!/usr/bin/env bash
# One device call for the CUDA compute work (issue 13): builds strata and the CUDA tests against
# the carried -dev package root (as scripts/cuda_device_run.sh), runs test_cuda_kernels (all of
# it, then the kernel timings), test_cuda_backend, and scripts/cuda_bench_30b.sh with the same
# build (30B shape Q8_0: all experts in VRAM, then a 6.5 GiB arena from NVMe). Logs in $OUT.
# test_host_tier (its CUDA case; HOST_TIER_TEST=0 skips it) and `strata ssdbw` (the pinned
# host-to-device probe) run too. The tensor-core kernel timings run with both stagings
# (STRATA_CUDA_MMA=1 and 2, docs/cuda.md).
#   RUNS: the bench sets of cuda_bench_30b.sh (basic, tiers, nvme, mma2, vram, vram-mma2, next80b; several: space-separated).
#   SRC source tree (default: the repository root); DEPS, GTEST, MODELS as cuda_device_run.sh.
set -u
. "$(dirname "$0")/cuda_env.sh"
t0=$(date +%s)
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  strata_build -- strata test_cuda_backend test_cuda_kernels test_host_tier
} > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
echo "== test_cuda_kernels"
timeout 120 "$B/tests/test_cuda_kernels" > "$OUT/kernels.log" 2>&1
rc=$?; echo "rc $rc"; grep -E "^\[  (FAILED|PASSED) |mma matmul|Failure|Expected|Which|mismatches" "$OUT/kernels.log" | head -30
if [ $rc -ne 0 ] && [ "${MMA_FALLBACK:-0}" = 1 ]; then
  # MMA_FALLBACK=1: when the default staging fails, test the other one and use it for the rest
  echo "== test_cuda_kernels with STRATA_CUDA_MMA=2 (the ldmatrix staging)"
  export STRATA_CUDA_MMA=2
  timeout 120 "$B/tests/test_cuda_kernels" > "$OUT/kernels_mma2.log" 2>&1
  echo "rc $?"; grep -E "^\[  (FAILED|PASSED) |Failure|Expected|mismatches" "$OUT/kernels_mma2.log" | head -20
fi
for v in 1 2; do  # the tensor-core kernels' two stagings side by side (cuda::mma_kernel_version)
  STRATA_CUDA_MMA=$v STRATA_CUDA_BENCH=1 timeout 60 "$B/tests/test_cuda_kernels" --gtest_filter='*Timings*' 2>&1 |
    grep "timing matmul \(BF16\|Q8_0\|Q4_K\|Q6_K\)" | sed "s/^/mma v$v: /" | tee -a "$OUT/timings.log"
done
echo "== test_cuda_backend at $(( $(date +%s) - t0 )) s"
timeout 150 "$B/tests/test_cuda_backend" > "$OUT/backend.log" 2>&1
echo "rc $?"; grep -E "^\[  (FAILED|PASSED) |max \||bit-identical|Failure|Expected|differ" "$OUT/backend.log" | head -30
if [ "${HOST_TIER_TEST:-1}" = 1 ]; then  # HOST_TIER_TEST=0 skips it (a run about compute only)
  echo "== test_host_tier at $(( $(date +%s) - t0 )) s"
  timeout 120 "$B/tests/test_host_tier" > "$OUT/host_tier.log" 2>&1
  echo "rc $?"; grep -E "^\[  (FAILED|PASSED|SKIPPED) |Failure|Expected" "$OUT/host_tier.log" | head -20
fi
echo "== ssdbw (drive and pinned host-to-device probe)"
timeout 60 "$B/strata" ssdbw -f "$MODELS/qwen3moe-code-Q8_0.gguf" --threads 8 --seconds 1 2>&1 | tee "$OUT/ssdbw.txt" | tail -6
echo "== bench at $(( $(date +%s) - t0 )) s"
REPO=$SRC DEPS=$DEPS GTEST=$GTEST MODELS=$MODELS BUILD=$B OUT=$OUT MODEL=${MODEL:-/tmp/q30b-q8.gguf} \
  bash "$SRC/scripts/cuda_bench_30b.sh" --no-build
