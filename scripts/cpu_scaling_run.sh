#!/usr/bin/env bash
# CPU prefill thread scaling (issue 18 "threading that scales"), for a many-core machine (the
# 16-core GPU machine; no GPU is used): builds strata with scripts/cuda_env.sh (STRATA_CUDA as
# CUDA says, default OFF: the CPU backend is what runs), writes the Qwen3-30B-A3B shape cut to
# LAYERS layers with `strata synth --like qwen3moe-30b-a3b --type Q8_0 --layers N` (the
# per-layer work is the full model's; every expert fits in RAM), then runs
# `strata bench --backend cpu` at each of THREADS threads: a PT-token random prompt in one
# chunk, GEN decode tokens, no drive probe (all in RAM). Prints per thread count prefill and
# decode tok/s, user CPU seconds, the speedup over the first thread count and the roofline
# probe lines; logs and JSON under $OUT.
#   LAYERS (8)  THREADS ("1 4 16")  PT (512)  GEN (16)  CTX (1024)  MODEL (/tmp/q30b-q8-l$LAYERS.gguf)
#   STRATA_BIN: use this strata binary instead of building (e.g. a local build)
#   CUDA=ON: build with the CUDA backend too (the same binary as the device scripts)
#   LLAMA_BENCH: a llama-bench binary (built elsewhere; nothing here builds llama.cpp): after
#     strata's runs, llama.cpp on the same file at each thread count, CPU only (no GPU visible):
#     its pp$PT and tg128 tests, for the side-by-side ratios
# Local check on the 2-core VM: STRATA_BIN=build/strata LAYERS=2 THREADS="1 2" PT=64 GEN=4 \
#   MODELS=models OUT=/tmp/cpu-scaling bash scripts/cpu_scaling_run.sh
set -u
OUT=${OUT:-${REPO:-$(pwd)}/cpu-scaling}
. "$(dirname "$0")/cuda_env.sh"
LAYERS=${LAYERS:-8}
THREADS=${THREADS:-1 4 16}
PT=${PT:-512}
GEN=${GEN:-16}
CTX=${CTX:-1024}
M=${MODEL:-/tmp/q30b-q8-l${LAYERS}.gguf}
t0=$(date +%s)
if [ -n "${STRATA_BIN:-}" ]; then
  S=$STRATA_BIN
else
  strata_build -DSTRATA_TESTS=OFF -DSTRATA_CUDA="${CUDA:-OFF}" -- strata > "$OUT/build.log" 2>&1 ||
    { tail -30 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
  S=$B/strata
  echo "built in $(( $(date +%s) - t0 )) s"
fi
"$S" --version 2>/dev/null | head -1
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores; avx512: $(grep -c -m1 avx512f /proc/cpuinfo)"
[ -f "$M" ] || timeout 600 "$S" synth --like qwen3moe-30b-a3b --type Q8_0 --layers "$LAYERS" -q -o "$M" \
  --tokenizer-from "$MODELS/qwen3moe-code-Q8_0.gguf" > "$OUT/synth.log" 2>&1 || { tail -5 "$OUT/synth.log"; echo "SYNTH FAILED"; exit 1; }
echo "model $M ($(( $(stat -c %s "$M") / 1048576 )) MiB), synth done at $(( $(date +%s) - t0 )) s"

base_pre="" base_dec=""
for t in $THREADS; do
  j=$OUT/bench_t$t.json
  # user/sys/wall seconds of the whole process (warm-up prefill, prefill, decode, the
  # --fake-stream compute floor and the probes) in $OUT/time_t$t.txt
  TIMEFORMAT="%U %S %R"
  { time timeout 900 "$S" bench -m "$M" --backend cpu -t "$t" --prompt-tokens "$PT" --prompt-chunk "$PT" \
      --gen "$GEN" -c "$CTX" --no-ssdbw --json > "$j" 2> "$OUT/bench_t$t.err"; } 2> "$OUT/time_t$t.txt"
  rc=$?
  line=$(python3 - "$j" "$t" "$OUT/time_t$t.txt" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no json:", e); sys.exit()
pre, dec = d.get("prefill", {}), d.get("decode", {})
try:
    u, s, e = open(sys.argv[3]).read().split()[-3:]
except Exception:
    u = s = e = "?"
print(f"{pre.get('tokens_per_s', 0):.2f} {dec.get('tokens_per_s', 0):.2f} {u} {s} {e}")
PY
)
  read -r pre dec user sys wall <<< "$line"
  [ -z "$base_pre" ] && { base_pre=$pre; base_dec=$dec; base_t=$t; }
  ratio=$(python3 -c "import sys; p,d,bp,bd=map(float,sys.argv[1:]); print(f'{p/bp:.2f}x prefill, {d/bd:.2f}x decode')" \
    "$pre" "$dec" "$base_pre" "$base_dec" 2>/dev/null || echo "?")
  echo "== $t threads (rc $rc): prefill $pre tok/s, decode $dec tok/s; user $user s, sys $sys s, wall $wall s; vs $base_t thread(s): $ratio"
  python3 - "$j" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception:
    sys.exit()
r = d.get("roofline")
if not r:
    sys.exit()
p = r.get("peak", {})
print(f"   roofline: int8 peak {p.get('int8_gops', 0):.1f} GOPS ({p.get('int8_how')}, {p.get('threads')} threads; "
      f"bare vpmaddubsw {p.get('maddubs_gops', 0):.1f}), memory read {p.get('read_gbps', 0):.1f} GB/s")
for ph in ("prefill", "decode"):
    q = r.get(ph)
    if q:
        print(f"   {ph:<8} matmul {q['gflops']:.1f} GFLOP/s ({q['pct_int8_peak']:.0f} % of the int8 peak), "
              f"weights {q['gbps']:.2f} GB/s ({q['pct_read']:.0f} % of read)")
PY
  [ $rc = 0 ] || tail -5 "$OUT/bench_t$t.err"
done
if [ -n "${LLAMA_BENCH:-}" ] && [ -x "$LLAMA_BENCH" ]; then
  for t in $THREADS; do
    echo "== llama.cpp, $t threads, CPU only"
    CUDA_VISIBLE_DEVICES="" timeout 600 "$LLAMA_BENCH" -m "$M" -ngl 0 -t "$t" -p "$PT" -n 128 -r 1 -o md \
      > "$OUT/llama_t$t.md" 2>&1
    grep -E "^\|" "$OUT/llama_t$t.md" || tail -5 "$OUT/llama_t$t.md"
  done
fi
echo "done at $(( $(date +%s) - t0 )) s"
