#!/usr/bin/env bash
# One device call that profiles the 30B shape (issue 13): builds strata (scripts/cuda_env.sh),
# writes `strata synth --like qwen3moe-30b-a3b --type Q8_0` (LAYERS=N cuts it to N layers; the
# per-layer work is the same) and runs `strata bench --backend cuda` with every expert in VRAM
# under STRATA_CUDA_PROFILE=1 (device time per backend call and phase, device idle between
# calls, host waits: docs/cuda.md "Profile"). PT/PC: prompt tokens and chunk (2048/2048).
set -u
. "$(dirname "$0")/cuda_env.sh"
M=${MODEL:-/tmp/q30b-q8-l${LAYERS:-48}.gguf}
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
strata_build -DSTRATA_TESTS=OFF -- strata > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"
[ -f "$M" ] || timeout 240 "$B/strata" synth --like qwen3moe-30b-a3b --type Q8_0 ${LAYERS:+--layers $LAYERS} -q -o "$M" \
  --tokenizer-from "$MODELS/qwen3moe-code-Q8_0.gguf" > "$OUT/synth.log" 2>&1 || { tail -5 "$OUT/synth.log"; exit 1; }
echo "synth done at $(( $(date +%s) - t0 )) s"
STRATA_CUDA_PROFILE=1 timeout 200 "$B/strata" bench -m "$M" --backend cuda --prompt-tokens "${PT:-2048}" \
  --prompt-chunk "${PC:-2048}" --gen "${GEN:-32}" -c 4096 --ssd-seconds 1 "$@" > "$OUT/profile_bench.txt" 2> "$OUT/profile.err"
echo "bench rc $? at $(( $(date +%s) - t0 )) s"
grep -iE "prefill|decode|tok/s" "$OUT/profile_bench.txt" | head -12
grep "cuda profile" "$OUT/profile.err" | head -40
