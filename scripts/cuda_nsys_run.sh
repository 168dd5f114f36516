#!/usr/bin/env bash
# Per-kernel device times of decode and prefill on the 30B shape (issue 13), from Nsight Systems
# when the GPU machine has it: `strata synth --like qwen3moe-30b-a3b --type Q8_0 --layers N`
# (LAYERS, default 4), every expert in VRAM, `strata bench --backend cuda` under `nsys profile`,
# then nsys's kernel summary (total and average time, launches per kernel). Needs a built strata
# in $BUILD (scripts/cuda_family_run.sh STEPS=build). Logs in $OUT.
set -u
. "$(dirname "$0")/cuda_env.sh"
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
[ -n "$NSYS" ] || { echo "no nsys on this machine (PATH, /usr/local/cuda/bin, /opt/nvidia)"; exit 0; }
M=${MODEL:-/tmp/q30b-q8-l${LAYERS:-4}.gguf}
[ -f "$M" ] || timeout 120 "$B/strata" synth --like qwen3moe-30b-a3b --type Q8_0 --layers "${LAYERS:-4}" -q -o "$M" \
  --tokenizer-from "$MODELS/qwen3moe-code-Q8_0.gguf" > "$OUT/nsys_synth.log" 2>&1 || { tail -5 "$OUT/nsys_synth.log"; exit 1; }
# The two phases apart: decode (a 64-token prompt, GEN tokens) and prefill (one 2048-token chunk,
# 1 token). nsys's kernel summary per run, the top kernels by device time.
prof() {  # name, bench flags...
  local name=$1; shift
  timeout 150 "$NSYS" profile -o "$OUT/nsys_$name" -f true -t cuda --stats=false "$B/strata" bench -m "$M" \
    --backend cuda -c 4096 --no-ssdbw "$@" > "$OUT/nsys_${name}_bench.txt" 2>&1
  echo "== nsys $name ($*): rc $?"
  grep -E "^(prefill|decode)" "$OUT/nsys_${name}_bench.txt" | head -4
  timeout 120 "$NSYS" stats -r cuda_gpu_kern_sum -f csv -o "$OUT/nsys_$name" "$OUT/nsys_$name.nsys-rep" > /dev/null 2>&1
  local f
  f=$(ls "$OUT"/nsys_"$name"*kern_sum*.csv 2>/dev/null | head -1)
  [ -n "$f" ] && python3 - "$f" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
tot = sum(float(r["Total Time (ns)"]) for r in rows)
print(f"kernels: {len(rows)} names, {tot/1e6:.1f} ms in all")
for r in rows[:40]:
    print(f'{float(r["Time (%)"]):5.1f} %  {float(r["Total Time (ns)"])/1e6:8.2f} ms  n={r["Instances"]:>7}  avg {float(r["Avg (ns)"])/1e3:8.2f} us  med {float(r["Med (ns)"])/1e3:8.2f} us  {r["Name"][:110]}')
PY
  rm -f "$OUT/nsys_$name.nsys-rep" "$OUT/nsys_$name.sqlite"
}
prof decode --prompt-tokens 64 --prompt-chunk 64 --gen "${GEN:-64}"
prof prefill --prompt-tokens 2048 --prompt-chunk 2048 --gen 1
