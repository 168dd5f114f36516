#!/usr/bin/env bash
# Per-kernel device durations of CUDA decode (issue 13) from Nsight Compute, which replays each
# kernel alone (so launch gaps and host time are excluded): `strata run --backend cuda --preload`
# on a layer cut of the 30B shape (LAYERS, default 4; every expert resident, so decode's MoE layers
# run on the device), PROMPT_TOKENS prompt ids (64), N decode tokens (8) and context CTX (1024). Prints, per kernel
# name and grid, the launches and average / total microseconds, largest total first. Needs a
# built strata in $BUILD. Logs in $OUT.
set -u
. "$(dirname "$0")/cuda_env.sh"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 0; }
M=${MODEL:-/tmp/q30b-q8-l${LAYERS:-4}.gguf}
[ -f "$M" ] || timeout 120 "$B/strata" synth --like qwen3moe-30b-a3b --type Q8_0 --layers "${LAYERS:-4}" -q -o "$M" \
  --tokenizer-from "$MODELS/qwen3moe-code-Q8_0.gguf" > "$OUT/ncu_synth.log" 2>&1 || { tail -5 "$OUT/ncu_synth.log"; exit 1; }
ids=$(python3 -c "print(','.join(str(100 + 7 * i) for i in range(${PROMPT_TOKENS:-64})))")
timeout "${NCU_TIMEOUT:-240}" "$NCU" --csv --print-units base --clock-control none --cache-control none --metrics gpu__time_duration.sum "$B/strata" run -m "$M" \
  --backend cuda --preload --prompt-ids "$ids" -n "${N:-8}" --temp 0 -c "${CTX:-1024}" > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu rc $?"
python3 - "$OUT/ncu.csv" <<'PY'
import csv, sys, collections
# the CSV follows the generated text on stdout: start at its header line
lines = open(sys.argv[1], errors="replace").read().splitlines()
start = next((i for i, l in enumerate(lines) if l.startswith('"ID","Process ID"')), len(lines))
rows = list(csv.DictReader([l for l in lines[start:] if l.startswith('"')]))
rows = [r for r in rows if r.get("Metric Name") == "gpu__time_duration.sum"]
print(f"{len(rows)} kernel launches profiled")
g = collections.OrderedDict()
for r in rows:
    k = (r["Kernel Name"].replace("(anonymous namespace)::", "")[:80], r["Grid Size"], r["Block Size"])
    g.setdefault(k, []).append(float(r["Metric Value"].replace(",", "")) / 1e3)
tot = sum(sum(v) for v in g.values())
print(f"all kernels: {tot/1e3:.2f} ms")
for k, v in sorted(g.items(), key=lambda kv: -sum(kv[1]))[:45]:
    print(f"{sum(v)/1e3:8.3f} ms  n={len(v):5d}  avg {sum(v)/len(v):8.2f} us  grid {k[1]:>14} block {k[2]:>12}  {k[0]}")
PY
# DETAIL=regex: Nsight Compute's speed-of-light, occupancy and warp-stall sections for the first
# decode launches of the kernels whose names match (e.g. DETAIL=fa_kernel), as text.
if [ -n "${DETAIL:-}" ]; then
  timeout 120 "$NCU" -k "regex:$DETAIL" --launch-skip "${DETAIL_SKIP:-12}" -c "${DETAIL_COUNT:-2}" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section MemoryWorkloadAnalysis ${DETAIL_SECTIONS:-} "$B/strata" run -m "$M" --backend cuda --preload --prompt-ids "$ids" -n 4 --temp 0 \
    -c "${CTX:-1024}" > "$OUT/ncu_detail.txt" 2>&1
  echo "ncu detail rc $?"
  grep -vE '^\s*$' "$OUT/ncu_detail.txt" | grep -vE '^(==PROF==|strata:)' | tail -120
fi
