#!/usr/bin/env bash
# One device call for CUDA decode switches (issue 13), end to end: builds strata with the CUDA
# tests and, beside it, the stamps build (scripts/cuda_stamps_run.sh); runs test_cuda_kernels and
# test_cuda_backend; writes the 30B shape (synth --like qwen3moe-30b-a3b --type Q8_0) while the
# tests run; then the in-chain kernel table of decode with the default switches and with OFF (a
# list of VAR=value that restores the code of before), and ROUNDS alternating tg128 runs of each
# (`bench --backend cuda --prompt-tokens 1 --prompt-chunk 1 --gen 128 -c 1024`), stopping before
# BUDGET seconds. Logs and tables under $OUT.
#   OFF      e.g. "STRATA_CUDA_ROUTER_EARLY=0 STRATA_CUDA_FD_ONE_SEG=0" (default: empty, no A/B)
#   ON       the same for the "on" runs, for a change that is opt-in (e.g. "STRATA_CUDA_NORM_REGS=1")
#   ROUNDS   2;  BUDGET 540;  MODEL /tmp/q30b-q8.gguf;  STAMPS=0: no stamps build or table (a short call)
set -u
REPO=${REPO:-$(pwd)}
. "$REPO/scripts/cuda_env.sh"
t0=$(date +%s)
el() { echo $(($(date +%s) - t0)); }
OFF=${OFF:-}
ON=${ON:-}
ROUNDS=${ROUNDS:-2}
BUDGET=${BUDGET:-540}
M=${MODEL:-/tmp/q30b-q8.gguf}
SB=${STAMPS_BUILD:-/tmp/strata-stamps-build}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
(strata_build -- strata test_cuda_backend test_cuda_kernels > "$OUT/build.log" 2>&1; echo "build rc $? at $(el) s") &
STAMPS=${STAMPS:-1}
[ "$STAMPS" = 0 ] || (B=$SB strata_build -DSTRATA_TESTS=OFF -DSTRATA_CUDA_STAMPS=ON -- strata > "$OUT/stamps_build.log" 2>&1
 echo "stamps build rc $? at $(el) s") &
wait
[ -x "$B/strata" ] || { tail -20 "$OUT/build.log"; exit 1; }
if [ ! -f "$M" ]; then
  (timeout 300 "$B/strata" synth --like qwen3moe-30b-a3b --type Q8_0 -q -o "$M" \
    --tokenizer-from "$MODELS/qwen3moe-code-Q8_0.gguf" > "$OUT/synth.log" 2>&1; echo "synth rc $? at $(el) s") &
fi
timeout 150 "$B/tests/test_cuda_kernels" --gtest_filter='-*Timings*' > "$OUT/test_cuda_kernels.log" 2>&1
echo "test_cuda_kernels rc $? at $(el) s"
grep -E "^\[  (FAILED|PASSED) |Failure" "$OUT/test_cuda_kernels.log" | head
timeout 200 "$B/tests/test_cuda_backend" > "$OUT/test_cuda_backend.log" 2>&1
echo "test_cuda_backend rc $? at $(el) s"
grep -E "^\[  (FAILED|PASSED) |Failure" "$OUT/test_cuda_backend.log" | head
wait
for v in on ${OFF:+off}; do
  [ "$(el)" -lt "$BUDGET" ] && [ "$STAMPS" != 0 ] || break
  MODEL=$M N=64 TAG=$v RUN_ENV="$([ $v = off ] && echo "$OFF" || echo "$ON")" bash "$REPO/scripts/cuda_stamps_run.sh" 2>&1 | head -30
  echo "stamps $v at $(el) s"
done
tok_s() { python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['decode']['tokens_per_s'], 1))" "$1" 2>/dev/null; }
for r in $(seq "$ROUNDS"); do
  for v in on ${OFF:+off}; do
    [ "$(el)" -lt "$BUDGET" ] || break 2
    # shellcheck disable=SC2046
    env $([ $v = off ] && echo "$OFF" || echo "$ON") timeout 60 "$B/strata" bench -m "$M" --backend cuda --prompt-tokens 1 --prompt-chunk 1 \
      --gen 128 -c 1024 --no-ssdbw --no-direct-io --json > "$OUT/tg_$v$r.json" 2> "$OUT/tg_$v$r.err"
    echo "tg128 $v round $r rc $?: $(tok_s "$OUT/tg_$v$r.json") tok/s at $(el) s"
  done
done
echo "done at $(el) s"
