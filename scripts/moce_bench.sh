#!/usr/bin/env bash
# MoCE side by side (docs/tools.md, "MoCE"): for each arena (% of all experts), one
# `strata moce-bench` run: per bonus (0, 0.25, 0.5, 0.85 and the one --moce-kld-budget calibrates
# on the built-in greedy sample or CAL_FILE) the first N tokens of TEXT teacher-forced through
# decode from an empty arena: decode tok/s, misses, hit %, substituted, misses avoided, and the
# exact KLD and same top-1 against bonus 0. Prints a markdown table.
#   scripts/moce_bench.sh MODEL TEXT N_TOKENS BUDGET PCT...
# env: ARENA_ALL_MB = the arena of every expert in MiB (required), STRATA=build/strata,
#      EXTRA="--predict off" (more engine flags), CAL_FILE = --moce-calibrate FILE,
#      BONUSES=0,0.25,0.5,0.85
set -euo pipefail
[ $# -ge 5 ] || { echo "usage: ARENA_ALL_MB=M $0 MODEL TEXT N_TOKENS BUDGET PCT..." >&2; exit 2; }
model=$1 text=$2 n=$3 budget=$4
shift 4
: "${ARENA_ALL_MB:?set ARENA_ALL_MB to the arena of every expert in MiB}"
S=${STRATA:-build/strata}
echo "| arena | bonus | decode tok/s | decode misses | hit % | substituted | misses avoided | mean KLD | same top-1 |"
echo "|---|---|---|---|---|---|---|---|---|"
for pct in "$@"; do
  arena=$(python3 -c "print(max(1, round($pct / 100 * $ARENA_ALL_MB)))")
  # shellcheck disable=SC2086
  $S moce-bench -m "$model" -t 2 --arena-mb "$arena" ${EXTRA:-} -f "$text" -n "$n" --bonuses "${BONUSES:-0,0.25,0.5,0.85}" \
    --moce-kld-budget "$budget" ${CAL_FILE:+--moce-calibrate "$CAL_FILE"} --json 2>/dev/null |
    python3 -c '
import json, sys
pct, arena, budget = sys.argv[1:4]
d = json.load(sys.stdin)
cal = d.get("calibration")
for r in d["rows"]:
    label = "%g" % r["bonus"]
    if r["calibrated"]:
        label += " (calibrated, budget %s; calibration KLD %.5f)" % (budget, cal["kld"])
    print("| %s %% (%s MiB) | %s | %.1f | %d | %.1f | %d | %d | %.5f +/- %.5f | %.2f %% |" % (
        pct, arena, label, r["tokens_per_s"], r["misses"], 100 * r["hit_rate"], r["moce_substituted"],
        r["moce_misses_avoided"], r["kld_mean"], r["kld_error"], 100 * r["same_top1"]))
' "$pct" "$arena" "$budget"
done
