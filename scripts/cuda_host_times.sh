#!/usr/bin/env bash
# Host-bound or device-bound decode (issue 13): `strata run --backend cuda --preload` on the 30B
# shape (MODEL, default /tmp/q30b-q8.gguf as scripts/cuda_bench_30b.sh makes it) with
# STRATA_CUDA_HOST_TIMES=1, a PROMPT_TOKENS-id prompt (16) and N decode tokens (64); prints the
# median, over the decode tokens, of the host time between two synchronizations (enqueueing a
# token) and of the time the host then waits for the device. Host time >> wait: host-bound.
# --build first builds strata. Extra environment (e.g. STRATA_CUDA_PDL=0) passes through.
set -u
OUT=${OUT:-${REPO:-$(pwd)}/cuda-host-times}
. "$(dirname "$0")/cuda_env.sh"
if [ "${1:-}" = "--build" ]; then
  strata_build -DSTRATA_TESTS=OFF -- strata > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
M=${MODEL:-/tmp/q30b-q8.gguf}
[ -f "$M" ] || timeout 240 "$B/strata" synth --like qwen3moe-30b-a3b --type Q8_0 -q -o "$M" \
  --tokenizer-from "$MODELS/qwen3moe-code-Q8_0.gguf" > "$OUT/synth.log" 2>&1 || exit 1
ids=$(python3 -c "print(','.join(str(100 + 7 * i) for i in range(${PROMPT_TOKENS:-16})))")
STRATA_CUDA_HOST_TIMES=1 timeout 200 "$B/strata" run -m "$M" --backend cuda --preload --prompt-ids "$ids" \
  -n "${N:-64}" --temp 0 -c 4096 > "$OUT/run.out" 2> "$OUT/run.err"
echo "run rc $?"
python3 - "$OUT/run.err" "${N:-64}" <<'PY'
import re, statistics, sys
rows = [tuple(map(float, m.groups())) for m in
        (re.search(r"host times: ([0-9.]+) us on the host since the last sync, ([0-9.]+) us waiting", l)
         for l in open(sys.argv[1], errors="replace")) if m]
n = int(sys.argv[2])
dec = rows[-(n - 1):] if len(rows) >= n else rows  # the decode tokens' syncs (one per token)
if not dec:
    sys.exit("no host-time lines")
h = statistics.median(r[0] for r in dec)
w = statistics.median(r[1] for r in dec)
print("last syncs (host us, wait us):", " ".join(f"{a:.0f}/{b:.0f}" for a, b in rows[-8:]))
print(f"{len(rows)} syncs; decode (last {len(dec)}): host {h:.0f} us, wait {w:.0f} us per sync (median)")
PY
