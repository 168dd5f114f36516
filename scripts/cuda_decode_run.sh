#!/usr/bin/env bash
# One device call for decode work on the CUDA backend (issue 13), end to end: builds strata and the
# CUDA tests and runs them on the family test models (scripts/cuda_family_run.sh STEPS="build
# tests"), the q8 mat-vec timings with the default kernels and with STRATA_CUDA_MV16=0 (the
# kernel of before the 16-byte staging) and the attention timings with and without
# fa_decode_kernel (STRATA_CUDA_FA_DECODE=0) side by side, the 30B-shape bench with every expert in
# VRAM with and without programmatic dependent launch (scripts/cuda_bench_30b.sh RUNS="vram pdloff"), then per-kernel times from Nsight
# Compute (scripts/cuda_ncu_run.sh; DETAIL: a kernel-name regex for its stall sections). Logs in $OUT.
#   STEPS  any of "tests timings bench ncu" (default: all); BUDGET: seconds for the build and tests
set -u
REPO=${REPO:-$(pwd)}
OUT=${OUT:-$REPO/cuda-decode}
mkdir -p "$OUT"
export BUILD=${BUILD:-/tmp/strata-cuda-build}
STEPS=${STEPS:-tests timings bench ncu}
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
t0=$(date +%s)
T="build"; has tests && T="build tests"
OUT=$OUT/fam STEPS="$T" BUDGET=${BUDGET:-330} bash "$REPO/scripts/cuda_family_run.sh" || exit 1
. "$REPO/scripts/cuda_env.sh"
if has timings; then
  for mv in auto old; do
    env $([ $mv = old ] && echo STRATA_CUDA_MV16=0) STRATA_CUDA_BENCH=1 timeout 60 "$B/tests/test_cuda_kernels" \
      --gtest_filter='CudaKernels.Timings' 2>&1 | grep "timing matmul \(Q8_0\|BF16\)" | sed "s/^/mv $mv: /" | tee -a "$OUT/timings.log"
  done
  for fd in auto old; do
    env $([ $fd = old ] && echo STRATA_CUDA_FA_DECODE=0) STRATA_CUDA_BENCH=1 timeout 60 "$B/tests/test_cuda_kernels" \
      --gtest_filter='*AttentionTimings*' 2>&1 | grep "timing attention" | sed "s/^/fa $fd: /" | tee -a "$OUT/timings.log"
  done
fi
echo "== bench at $(( $(date +%s) - t0 )) s"
has bench && OUT=$OUT/bench RUNS="${RUNS:-vram pdloff}" bash "$REPO/scripts/cuda_bench_30b.sh" --no-build
echo "== ncu at $(( $(date +%s) - t0 )) s"
has ncu && OUT=$OUT/ncu bash "$REPO/scripts/cuda_ncu_run.sh"
echo "done at $(( $(date +%s) - t0 )) s"
# one archive of every log (the device tool brings back a limited number of files)
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")" 2>/dev/null
