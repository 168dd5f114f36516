#!/usr/bin/env bash
# MoCE side by side (docs/tools.md, "MoCE"): for each arena (% of all experts) and each bonus,
# decode tok/s and misses of a greedy run, and the teacher-forced KLD / same top-1 against
# bonus 0 (perplexity --decode), plus the bonus --moce-kld-budget calibrates.
#   scripts/moce_bench.sh MODEL TEXT CTX N_GEN BUDGET PCT... (env: ARENA_ALL_MB = the arena of
# every expert in MiB, STRATA=build/strata, EXTRA="--predict off", CAL_FILE = --moce-calibrate FILE)
set -euo pipefail
model=$1 text=$2 ctx=$3 gen=$4 budget=$5
shift 5
S=${STRATA:-build/strata}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common="-m $model -t 2 --prompt-chunk 4 ${EXTRA:-}"
$S perplexity $common -f "$text" -c "$ctx" --decode --kl-divergence-base "$tmp/base.kld" >/dev/null 2>&1
echo "| arena | bonus | decode tok/s | decode misses | hit % | substituted | misses avoided | mean KLD | same top-1 |"
echo "|---|---|---|---|---|---|---|---|---|"
for pct in "$@"; do
  arena=$(python3 -c "print(max(1, round($pct / 100 * $ARENA_ALL_MB)))")
  cal=$($S run $common --arena-mb "$arena" -p 'def fibonacci(n):' -n 1 --temp 0 --moce-kld-budget "$budget" ${CAL_FILE:+--moce-calibrate "$CAL_FILE"} 2>&1 |
        sed -n 's/.*chose --moce-bonus \([0-9.]*\).*/\1/p')
  for b in 0 0.25 0.5 0.85 "$cal"; do
    r=$($S run $common --arena-mb "$arena" -p 'def fibonacci(n):' -n "$gen" --temp 0 --moce-bonus "$b" --json 2>/dev/null |
        python3 -c 'import json,sys; d=json.load(sys.stdin)["stats"]["decode"]; print("%.1f | %d | %.1f | %d | %d" % (d["tokens_per_s"], d["missed"], 100.0*d["hit"]/max(1,d["needed"]), d["moce_substituted"], d["moce_misses_avoided"]))')
    k=$($S perplexity $common --arena-mb "$arena" -f "$text" --decode --moce-bonus "$b" --kl-divergence-base "$tmp/base.kld" --kl-divergence --json 2>/dev/null |
        python3 -c 'import json,sys; d=json.load(sys.stdin)["kld"]; print("%.5f +/- %.5f | %.2f %%" % (d["mean"]["value"], d["mean"]["error"], 100*d["same_top1"]["value"]))')
    label=$b; [ "$b" = "$cal" ] && label="$b (calibrated, budget $budget)"
    echo "| $pct % ($arena MiB) | $label | $r | $k |"
  done
done
