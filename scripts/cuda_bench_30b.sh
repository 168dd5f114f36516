#!/usr/bin/env bash
# The issue-13 benchmark on the GPU machine, end to end: builds strata with CUDA against a
# `dpkg -x` root of Debian's -dev packages (.devdeps, see scripts/cuda_device_run.sh), writes the
# Qwen3-30B-A3B shape (strata synth, Q8_0, 48 layers, 128 experts top-8, random weights) and runs
# `strata bench --backend cuda` (a) with every expert in VRAM and (b) with a 6.5 GiB arena fed from
# NVMe (no host tier), 2048-token prompt in one chunk, 32 decode tokens. Logs and JSON in $OUT.
set -u
REPO=${REPO:-$(pwd)}
DEPS=${DEPS:-$REPO/.devdeps/root}
GTEST=${GTEST:-$REPO/.devdeps/googletest}
OUT=${OUT:-$REPO/cuda-bench}
B=${BUILD:-/tmp/strata-cuda-build}
M=${MODEL:-/tmp/q30b-q8.gguf}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
L=$DEPS/usr
t0=$(date +%s)
# --no-build: $BUILD already holds a strata built from this tree (scripts/cuda_perf_run.sh)
[ "${1:-}" = "--no-build" ] || {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  cmake -S "$REPO" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_WERROR=OFF -DSTRATA_BENCH=OFF -DSTRATA_TESTS=OFF \
    -DSTRATA_DEPS_ROOT="$DEPS" -DSTRATA_GTEST_SOURCE="$GTEST" -Dfmt_DIR=$L/lib/x86_64-linux-gnu/cmake/fmt \
    -DCLI11_DIR=$L/share/cmake/CLI11 -Dnlohmann_json_DIR=$L/share/cmake/nlohmann_json &&
  cmake --build "$B" -j"$(nproc)" --target strata
} > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
[ -f "$M" ] || timeout 240 "$B/strata" synth --like qwen3moe-30b-a3b --type Q8_0 -q -o "$M" --tokenizer-from "${MODELS:-$REPO/models}/qwen3moe-code-Q8_0.gguf" --json | tee "$OUT/synth.json"
echo "synth done at $(( $(date +%s) - t0 )) s"
run() {  # name, extra flags
  local name=$1; shift
  timeout 200 "$B/strata" bench -m "$M" --backend cuda --prompt-tokens "${PT:-2048}" --prompt-chunk "${PC:-2048}" --gen 32 -c "${CTX:-4096}" \
    --ssd-seconds 2 "$@" --json > "$OUT/bench_$name.json" 2> "$OUT/bench_$name.err"
  echo "== $name ($*): rc $? at $(( $(date +%s) - t0 )) s"
  python3 - "$OUT/bench_$name.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no json:", e); sys.exit()
for ph in ("prefill", "decode"):
    p = d.get(ph, {})
    print(f"{ph:8s} {p.get('tokens_per_s', 0):10.1f} tok/s  {p.get('seconds', 0):7.3f} s  needed {p.get('needed')} missed {p.get('missed')} "
          f"read {p.get('bytes_read', 0)/2**30:.2f} GiB  wait {p.get('exposed_wait_s', 0):.3f} s  io floor {p.get('io_floor_s', 0):.3f} s  "
          f"compute floor {p.get('compute_floor_s', 0):.3f} s  ratio {p.get('ratio_to_floor', 0):.2f}")
print("arena", d.get("arena_bytes", 0) / 2**30, "GiB, ssd", d.get("ssd_gbps"), "GB/s")
PY
  tail -3 "$OUT/bench_$name.err"
}
# RUNS picks the set: basic (default), tiers (the three tiers), nvme (prediction and chunk size
# with experts from the drive, as the reference system reported them).
case "${RUNS:-basic}" in
  basic)
    run vram
    run arena6.5g --arena-mb 6656 --cold ;;
  tiers)
    run vram
    run host6.5g --arena-mb 6656 --host-cache-mb 32768  # warm prefill fills the host tier first
    run nvme6.5g --arena-mb 6656 --host-cache-mb 0 --cold ;;
  nvme)
    run nvme-predict-off --arena-mb 6656 --host-cache-mb 0 --cold --predict off
    PT=4096 PC=1024 CTX=8192 run nvme-chunk1024 --arena-mb 6656 --host-cache-mb 0 --cold
    PT=4096 PC=2048 CTX=8192 run nvme-chunk2048 --arena-mb 6656 --host-cache-mb 0 --cold
    PT=4096 PC=4096 CTX=8192 run nvme-chunk4096 --arena-mb 6656 --host-cache-mb 0 --cold ;;
esac
