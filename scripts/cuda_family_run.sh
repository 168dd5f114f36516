#!/usr/bin/env bash
# The issue-14 families on the GPU machine, end to end (docs/cuda.md, "Model families"): builds
# strata and the CUDA tests against the carried -dev packages (as scripts/cuda_device_run.sh),
# makes small models of each family's real shape with `strata synth` (the fixtures cannot travel),
# runs test_cuda_kernels and test_cuda_backend (CUDA vs CPU per family), then the issue-14 GPU
# benchmark on layer cuts of the real shapes (STEPS picks: "build tests bench"). Logs in $OUT.
# Paths and the build step come from scripts/cuda_env.sh (OUT defaults to $REPO/cuda-family here).
#   SRC     source tree to build (default: the repository root); REPO: the checkout with models/
#   BUDGET  seconds after which the remaining steps are skipped (default 400)
#   FAMILIES  which bench models (default: "gpt-oss glm4moe qwen35moe deepseek2")
set -u
REPO=${REPO:-$(pwd)}
OUT=${OUT:-$REPO/cuda-family}
. "$(dirname "$0")/cuda_env.sh"  # SRC DEPS GTEST MODELS OUT B, LD_LIBRARY_PATH, STRATA_MODELS_DIR, strata_build
FAM=${FAMDIR:-/tmp/strata-families}
BUDGET=${BUDGET:-400}
STEPS=${STEPS:-build tests bench}
FAMILIES=${FAMILIES:-gpt-oss glm4moe qwen35moe deepseek2}
mkdir -p "$FAM"
export STRATA_CUDA_FAMILY_DIR=$FAM
t0=$(date +%s)
el() { echo $(($(date +%s) - t0)); }
left() { [ $(($(date +%s) - t0)) -lt "$BUDGET" ]; }
has() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }
TOK=$MODELS/qwen3moe-code-Q8_0.gguf
[ -d "$SRC/tests/data" ] || cp -r "$REPO/tests/data" "$SRC/tests/" 2>/dev/null
if has build; then
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    strata_build -- strata test_cuda_backend test_cuda_kernels
  } > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
  echo "built at $(el) s"
fi
S=$B/strata
synth() {  # file, flags...
  local f=$1; shift
  [ -f "$f" ] || timeout 120 "$S" synth "$@" -q --vocab 8192 --tokenizer-from "$TOK" -o "$f" >> "$OUT/synth.log" 2>&1 ||
    echo "synth $f failed: $(tail -2 "$OUT/synth.log")"
}
if has tests && left; then
  # test models: real widths, fewer layers and experts (tests/test_cuda_backend.cpp)
  synth "$FAM/gpt-oss.gguf" --like gpt-oss-120b --layers 2 --experts 16 --type Q8_0
  synth "$FAM/glm4moe.gguf" --like glm-4.5-air --layers 2 --experts 16 --type Q8_0
  synth "$FAM/qwen35moe.gguf" --like qwen3.5-122b-a10b --layers 4 --experts 16 --type Q8_0
  synth "$FAM/deepseek2.gguf" --like deepseek-v3 --layers 4 --experts 16 --type Q8_0  # 3 leading dense + 1 MoE
  synth "$FAM/minimax-m2.gguf" --like minimax-m2 --layers 2 --experts 16 --type Q8_0
  echo "test models at $(el) s"
  timeout 120 "$B/tests/test_cuda_kernels" --gtest_filter='-*Timings*' > "$OUT/test_cuda_kernels.log" 2>&1
  echo "test_cuda_kernels rc $? at $(el) s"
  grep -E "^\[  (FAILED|PASSED) |max \||rel err|Failure|Expected|Which|differ" "$OUT/test_cuda_kernels.log" | head -30
  timeout 240 "$B/tests/test_cuda_backend" > "$OUT/test_cuda_backend.log" 2>&1
  echo "test_cuda_backend rc $? at $(el) s"
  grep -E "^\[  (FAILED|PASSED) |^\[ +(OK|FAILED) |max \||bit-identical|Failure|Expected|Which|differ|what|error" \
    "$OUT/test_cuda_backend.log" | head -40
fi
# The benchmark: layer cuts of the real shapes (all experts of each layer), experts streamed from
# NVMe through a 2 GiB arena (6.5 GiB for deepseek-v3, whose layer of 256 experts must fit; no host
# tier), 512-token prompt in one chunk, 16 decode tokens.
bench_one() {  # name, file, predict
  local name=$1 f=$2 pr=$3
  left || { echo "skip bench $name predict $pr (budget)"; return; }
  timeout 100 "$S" bench -m "$f" --backend cuda --prompt-tokens 512 --prompt-chunk 512 --gen 16 -c 1024 \
    --arena-mb "${ARENA:-2048}" --host-cache-mb 0 --cold --predict "$pr" --ssd-seconds 1 --json > "$OUT/b.json" 2> "$OUT/b.err"
  local rc=$?
  python3 - "$OUT/b.json" "$name" "$pr" "$rc" <<'PY' | tee -a "$OUT/bench.txt"
import json, sys
name, pr, rc = sys.argv[2], sys.argv[3], sys.argv[4]
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"{name} predict {pr}: rc {rc}, no json ({e})"); sys.exit()
for ph in ("prefill", "decode"):
    p = d.get(ph, {})
    print(f"{name:10s} predict {pr:3s} {ph:7s} {p.get('tokens_per_s', 0):9.1f} tok/s {p.get('seconds', 0):7.3f} s "
          f"needed {p.get('needed')} missed {p.get('missed')} ahead {p.get('streamed_ahead', p.get('ahead'))} "
          f"read {p.get('bytes_read', 0)/2**30:.2f} GiB wait {p.get('exposed_wait_s', 0):.3f} s "
          f"io floor {p.get('io_floor_s', 0):.3f} s recall {p.get('prediction_recall')}")
PY
  [ -s "$OUT/b.json" ] || tail -3 "$OUT/b.err"
}
if has bench; then
  for fam in $FAMILIES; do
    left || break
    ARENA=2048
    case $fam in
      gpt-oss) f=$FAM/b-gpt-oss.gguf; synth "$f" --like gpt-oss-120b --layers 3 --type MXFP4 ;;
      glm4moe) f=$FAM/b-glm4moe.gguf; synth "$f" --like glm-4.5-air --layers 4 --type Q4_K ;;
      qwen35moe) f=$FAM/b-qwen35moe.gguf; synth "$f" --like qwen3.5-122b-a10b --layers 4 --type Q4_K ;;
      deepseek2) f=$FAM/b-deepseek2.gguf; synth "$f" --like deepseek-v3 --layers 4 --type Q4_K
        ARENA=6656 ;;  # a layer of 256 x 24 MiB experts at once for a 512-token chunk
    esac
    echo "$fam: $(du -h "$f" 2>/dev/null | cut -f1) at $(el) s"
    bench_one "$fam" "$f" on
    bench_one "$fam" "$f" off
    rm -f "$f"
  done
fi
echo "done at $(el) s"
