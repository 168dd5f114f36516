#!/usr/bin/env bash
# The issue-13 benchmark on the GPU machine, end to end: builds strata with CUDA against a
# `dpkg -x` root of Debian's -dev packages (.devdeps, see scripts/cuda_device_run.sh), writes the
# Qwen3-30B-A3B shape (strata synth, Q8_0, 48 layers, 128 experts top-8, random weights) and runs
# `strata bench --backend cuda` (a) with every expert in VRAM and (b) with a 6.5 GiB arena fed from
# NVMe (no host tier), 2048-token prompt in one chunk, 32 decode tokens (PT, PC, GEN, CTX change
# them). Logs and JSON in $OUT.
set -u
OUT=${OUT:-${REPO:-$(pwd)}/cuda-bench}
. "$(dirname "$0")/cuda_env.sh"
M=${MODEL:-/tmp/q30b-q8.gguf}
t0=$(date +%s)
# --no-build: $BUILD already holds a strata built from this tree (scripts/cuda_perf_run.sh)
[ "${1:-}" = "--no-build" ] || {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  strata_build -DSTRATA_TESTS=OFF -- strata
} > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
[ -f "$M" ] || [ "${RUNS:-basic}" = next80b ] || timeout 240 "$B/strata" synth --like qwen3moe-30b-a3b --type Q8_0 -q -o "$M" --tokenizer-from "$MODELS/qwen3moe-code-Q8_0.gguf" --json | tee "$OUT/synth.json"
echo "synth done at $(( $(date +%s) - t0 )) s"
run() {  # name, extra flags
  local name=$1; shift
  timeout 200 "$B/strata" bench -m "$M" --backend cuda --prompt-tokens "${PT:-2048}" --prompt-chunk "${PC:-2048}" --gen "${GEN:-32}" -c "${CTX:-4096}" \
    --ssd-seconds 2 "$@" --json > "$OUT/bench_$name.json" 2> "$OUT/bench_$name.err"
  echo "== $name ($*): rc $? at $(( $(date +%s) - t0 )) s"
  bench_summary "$OUT/bench_$name.json"
  tail -3 "$OUT/bench_$name.err"
}
# RUNS picks the sets (space-separated, run in order): basic (default: every expert in VRAM, then
# a cold 6.5 GiB arena), tiers (the three tiers), nvme (prediction and chunk size with experts
# from the drive, as the reference system reported them), mma2 (every expert in VRAM with the
# ldmatrix tensor-core staging, STRATA_CUDA_MMA=2, and STRATA_CUDA_PROFILE=1: docs/cuda.md "Profile"),
# vram (every expert in VRAM only), vram-mma2 (the same with the ldmatrix staging, no profiler),
# next80b (the Qwen3-Next-80B-A3B shape, Q2_K, 6.5 GiB arena from NVMe, prediction on and off),
# hostmoe (every expert in VRAM, STRATA_CUDA_HOST_MOE=1: decode's MoE layers driven from the host),
# prof (every expert in VRAM with STRATA_CUDA_PROFILE=1), mvold (every expert in VRAM, the
# q8 mat-vec without the 16-byte staging: STRATA_CUDA_MV16=0), fdold (every expert in VRAM, decode
# attention on fa_kernel: STRATA_CUDA_FA_DECODE=0), pdloff (every expert in VRAM, launches
# without programmatic dependent launch: STRATA_CUDA_PDL=0), mv2off (every expert in VRAM, the
# q8 mat-vec of before mv2_q8_kernel: STRATA_CUDA_MV16_V2=0), faoff (every expert in VRAM, prefill
# attention on fa_kernel: STRATA_CUDA_FA_PREFILL=0), qkv (every expert in VRAM, decode's q, k and v
# in one launch: STRATA_CUDA_QKV_ONE_LAUNCH=1), x1off (every expert in VRAM, decode's mat-vecs
# after a quantizer launch: STRATA_CUDA_Q8_X1=0), routeoff (decode routing in two launches:
# STRATA_CUDA_FUSED_ROUTE=0), fdfuseoff (decode attention's fold in fa_combine: STRATA_CUDA_FA_FUSED=0),
# alloff (all three off: the decode of before this stop), tg128 (llama-bench's pp512 and tg128),
# l2pf (the next-kernel L2 prefetch, STRATA_CUDA_L2_PREFETCH=1 / 2), peer (llama.cpp's
# llama-bench on the same file and card, LLAMA_BENCH=path: every layer on the GPU, then the
# experts on the CPU).
vram_done=0
vram() { [ $vram_done = 1 ] || run vram; vram_done=1; }
for set in ${RUNS:-basic}; do
  case "$set" in
    basic)
      vram
      run arena6.5g --arena-mb 6656 --cold ;;
    tiers)
      vram
      run host6.5g --arena-mb 6656 --host-cache-mb 32768  # warm prefill fills the host tier first
      run nvme6.5g --arena-mb 6656 --host-cache-mb 0 --cold ;;
    nvme)
      run nvme-predict-off --arena-mb 6656 --host-cache-mb 0 --cold --predict off
      PT=4096 PC=1024 CTX=8192 run nvme-chunk1024 --arena-mb 6656 --host-cache-mb 0 --cold
      PT=4096 PC=2048 CTX=8192 run nvme-chunk2048 --arena-mb 6656 --host-cache-mb 0 --cold
      PT=4096 PC=4096 CTX=8192 run nvme-chunk4096 --arena-mb 6656 --host-cache-mb 0 --cold ;;
    mma2)
      STRATA_CUDA_MMA=2 STRATA_CUDA_PROFILE=1 run vram-mma2
      grep "cuda profile" "$OUT/bench_vram-mma2.err" | head -24 ;;
    vram) vram ;;
    vram-mma2)
      STRATA_CUDA_MMA=2 run vram-mma2-noprof ;;
    hostmoe)  # every expert in VRAM, each decode MoE layer driven from the host (the path before moe_on_device)
      STRATA_CUDA_HOST_MOE=1 run vram-hostmoe ;;
    mvold)  # every expert in VRAM with the q8 mat-vec of before the 16-byte staging
      STRATA_CUDA_MV16=0 run vram-mvold ;;
    fdold)  # every expert in VRAM with decode attention on fa_kernel (before fa_decode_kernel)
      STRATA_CUDA_FA_DECODE=0 run vram-fdold ;;
    pdloff)  # every expert in VRAM, kernels launched without programmatic dependent launch
      STRATA_CUDA_PDL=0 run vram-pdloff ;;
    mv2off)  # every expert in VRAM, the q8 mat-vec of before mv2_q8_kernel (STRATA_CUDA_MV16_V2=0)
      STRATA_CUDA_MV16_V2=0 run vram-mv2off ;;
    faoff)  # every expert in VRAM, prefill attention on fa_kernel (STRATA_CUDA_FA_PREFILL=0)
      STRATA_CUDA_FA_PREFILL=0 run vram-faoff ;;
    qkv)  # every expert in VRAM, decode's q, k and v in one launch (STRATA_CUDA_QKV_ONE_LAUNCH=1)
      STRATA_CUDA_QKV_ONE_LAUNCH=1 run vram-qkv ;;
    x1off)  # every expert in VRAM, decode's q8 mat-vecs after a quantizer launch (STRATA_CUDA_Q8_X1=0)
      STRATA_CUDA_Q8_X1=0 run vram-x1off ;;
    routeoff)  # every expert in VRAM, decode routing as router mat-vec + select_topk (STRATA_CUDA_FUSED_ROUTE=0)
      STRATA_CUDA_FUSED_ROUTE=0 run vram-routeoff ;;
    fdfuseoff)  # every expert in VRAM, decode attention's segment fold in fa_combine (STRATA_CUDA_FA_FUSED=0)
      STRATA_CUDA_FA_FUSED=0 run vram-fdfuseoff ;;
    alloff)  # every expert in VRAM, the three above off together
      STRATA_CUDA_Q8_X1=0 STRATA_CUDA_FUSED_ROUTE=0 STRATA_CUDA_FA_FUSED=0 run vram-alloff ;;
    tg128)  # every expert in VRAM, llama-bench's pp512 and tg128 tests: a 512-token prompt, and 128
      # decode tokens after a 1-token prompt (llama-bench decodes from an empty cache: positions 0..127)
      PT=512 PC=512 GEN=1 run vram-pp512
      PT=1 PC=1 GEN=128 run vram-tg128 ;;
    l2pf)  # every expert in VRAM, decode's next-kernel L2 prefetch (STRATA_CUDA_L2_PREFETCH 1 and 2),
      # at depth 2048 and as tg128
      STRATA_CUDA_L2_PREFETCH=1 run vram-l2pf1
      STRATA_CUDA_L2_PREFETCH=2 run vram-l2pf2
      STRATA_CUDA_L2_PREFETCH=2 PT=1 PC=1 GEN=128 run vram-tg128-l2pf2 ;;
    quick)  # every expert in VRAM: depth 2048 and tg128, each without and with STRATA_CUDA_L2_PREFETCH=2
      vram
      STRATA_CUDA_L2_PREFETCH=2 run vram-l2pf2
      PT=1 PC=1 GEN=128 run vram-tg128
      STRATA_CUDA_L2_PREFETCH=2 PT=1 PC=1 GEN=128 run vram-tg128-l2pf2 ;;
    peer)  # llama.cpp's llama-bench on the same file and card, when LLAMA_BENCH names a llama-bench
      # binary (built elsewhere: nothing here builds or ships llama.cpp): every layer on the GPU
      # with flash attention (pp512, pp2048, tg128), then the experts on the CPU (--n-cpu-moe,
      # PEER_THREADS threads, default every core), as the issue's llama.cpp figures were taken
      if [ -z "${LLAMA_BENCH:-}" ] || [ ! -x "$LLAMA_BENCH" ]; then
        echo "== peer: skipped (set LLAMA_BENCH to a llama-bench binary)"
      else
        NL=${PEER_CPU_MOE:-48}  # the 30B shape's layers: every layer's experts on the CPU
        echo "== peer: $LLAMA_BENCH, all layers on the GPU, flash attention on"
        timeout 240 "$LLAMA_BENCH" -m "$M" -ngl 99 -fa 1 -p 512,2048 -n 128 -r "${PEER_REPS:-2}" -o md 2>&1 |
          tee "$OUT/peer_vram.md" | grep -E "^\|" || tail -5 "$OUT/peer_vram.md"
        echo "== peer: experts on the CPU (--n-cpu-moe $NL -t ${PEER_THREADS:-$(nproc)})"
        timeout 300 "$LLAMA_BENCH" -m "$M" -ngl 99 -fa 1 --n-cpu-moe "$NL" -t "${PEER_THREADS:-$(nproc)}" \
          -p 512,2048 -n 128 -r 1 -o md 2>&1 | tee "$OUT/peer_cpumoe.md" | grep -E "^\|" || tail -5 "$OUT/peer_cpumoe.md"
      fi ;;
    prof)  # every expert in VRAM with STRATA_CUDA_PROFILE=1 (per-call device time, host waits)
      STRATA_CUDA_PROFILE=1 run vram-prof
      grep -A40 "cuda profile" "$OUT/bench_vram-prof.err" | head -60 ;;
    next80b)  # the Qwen3-Next-80B-A3B shape, Q2_K experts, 6.5 GiB arena from NVMe: prediction on / off
      N80=${NEXT80B:-/tmp/next80b-q2k.gguf}
      [ -f "$N80" ] || timeout 200 "$B/strata" synth --like qwen3-next-80b-a3b --type Q2_K -q -o "$N80" \
        --tokenizer-from "$MODELS/qwen3moe-code-Q8_0.gguf" --json | tee "$OUT/synth80b.json"
      M=$N80 run next80b-predict-on --arena-mb 6656 --host-cache-mb 0 --cold
      M=$N80 run next80b-predict-off --arena-mb 6656 --host-cache-mb 0 --cold --predict off ;;
    *) echo "unknown RUNS set '$set' (basic, tiers, nvme, mma2, vram, vram-mma2, next80b, hostmoe, prof, mvold, fdold, pdloff, mv2off, faoff, qkv, x1off, routeoff, fdfuseoff, alloff, tg128, l2pf, quick, peer)"; exit 2 ;;
  esac
done
