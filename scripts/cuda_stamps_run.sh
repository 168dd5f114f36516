#!/usr/bin/env bash
# In-chain kernel times of CUDA decode (issue 13), from a profiling build (CMake
# STRATA_CUDA_STAMPS=ON: every kernel stamps %globaltimer after its dependency wait; docs/cuda.md
# "Stamps"). Unlike Nsight Compute, which replays each kernel alone, this times the kernels as they
# run in the stream, with programmatic dependent launch and the host's gaps: kernel i's time is its
# stamp to kernel i + 1's. Builds strata into $STAMPS_BUILD (default /tmp/strata-stamps-build),
# then `strata run --backend cuda --preload` on MODEL (default: the 30B shape, written by synth if
# absent) with PROMPT_TOKENS prompt ids (1) and N decode tokens (64); prints the table (kernel,
# grid, block threads: launches, average and total us; largest first) and the per-token sum.
# Extra environment for the run: RUN_ENV (e.g. "STRATA_CUDA_ROUTER_EARLY=0"). Logs in $OUT.
set -u
. "$(dirname "$0")/cuda_env.sh"
SB=${STAMPS_BUILD:-/tmp/strata-stamps-build}
if [ ! -x "$SB/strata" ]; then
  B=$SB strata_build -DSTRATA_TESTS=OFF -DSTRATA_CUDA=ON -DSTRATA_CUDA_STAMPS=ON -- strata > "$OUT/stamps_build.log" 2>&1 ||
    { tail -20 "$OUT/stamps_build.log"; echo "STAMPS BUILD FAILED"; exit 1; }
fi
M=${MODEL:-/tmp/q30b-q8.gguf}
[ -f "$M" ] || timeout 300 "$SB/strata" synth --like qwen3moe-30b-a3b --type Q8_0 -q -o "$M" \
  --tokenizer-from "$MODELS/qwen3moe-code-Q8_0.gguf" > "$OUT/stamps_synth.log" 2>&1 || { tail -5 "$OUT/stamps_synth.log"; exit 1; }
N=${N:-64}
ids=$(python3 -c "print(','.join(str(100 + 7 * i) for i in range(${PROMPT_TOKENS:-1})))")
tag=${TAG:-default}
# shellcheck disable=SC2086
env ${RUN_ENV:-} STRATA_CUDA_STAMPS_OUT="$OUT/stamps_$tag.txt" timeout "${STAMPS_TIMEOUT:-200}" "$SB/strata" run -m "$M" \
  --backend cuda --preload --no-direct-io --prompt-ids "$ids" -n "$N" --temp 0 -c "${CTX:-1024}" > "$OUT/stamps_$tag.run" 2>&1
echo "stamps run ($tag) rc $?"
python3 - "$OUT/stamps_$tag.txt" "$N" <<'PY'
import sys
rows = []
for l in open(sys.argv[1]):
    if l.startswith("#"):
        print(l.rstrip()); continue
    p = l.split(None, 3)
    if len(p) == 4: rows.append((float(p[0]), int(p[1]), float(p[2]), p[3].rstrip()))
n = int(sys.argv[2])
# decode's kernels: the rows launched a multiple of N times (per token or per layer and token)
dec = [r for r in rows if r[1] >= n]
tot = sum(r[0] for r in dec)
print(f"rows launched >= {n} times: {tot:.3f} ms, {tot / n * 1e3:.1f} us per decode token")
for r in rows[:40]:
    print(f"{r[0]:9.3f} ms n={r[1]:6d} avg {r[2]:8.2f} us  per token {r[0] / n * 1e3:8.1f} us  {r[3][:150]}")
PY
