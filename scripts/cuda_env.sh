# Sourced by the GPU-machine scripts (cuda_device_run.sh, cuda_perf_run.sh, cuda_bench_30b.sh,
# cuda_profile_run.sh, cuda_family_run.sh):
# the paths, the environment and the configure/build step against the carried -dev package root.
#   REPO  repository root (default: the working directory); SRC: source tree to build (default REPO)
#   DEPS  the -dev package root (default: $REPO/.devdeps/root); GTEST: a googletest source tree
#   MODELS folder of the models (default: $REPO/models); OUT: logs (default: $REPO/cuda-run)
#   BUILD build folder (default: /tmp/strata-cuda-build), exported as B
REPO=${REPO:-$(pwd)}
SRC=${SRC:-$REPO}
DEPS=${DEPS:-$REPO/.devdeps/root}
GTEST=${GTEST:-$REPO/.devdeps/googletest}
MODELS=${MODELS:-$REPO/models}
OUT=${OUT:-$REPO/cuda-run}
B=${BUILD:-/tmp/strata-cuda-build}
L=$DEPS/usr
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$DEPS/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export STRATA_MODELS_DIR=$MODELS
# A -dev root without the static libpcre2-8.a / liburing.a (the build links them statically): a
# private copy whose .a names link the shared objects (ld reads the file's format, not its name;
# LD_LIBRARY_PATH finds them at run time).
if [ ! -e "$DEPS/usr/lib/x86_64-linux-gnu/libpcre2-8.a" ] || [ ! -e "$DEPS/usr/lib/x86_64-linux-gnu/liburing.a" ]; then
  rm -rf /tmp/strata-deps && cp -a "$DEPS" /tmp/strata-deps && DEPS=/tmp/strata-deps && L=$DEPS/usr
  for x in pcre2-8 uring; do
    [ -e "$L/lib/x86_64-linux-gnu/lib$x.a" ] ||
      ln -sf "$(readlink -f "$L/lib/x86_64-linux-gnu/lib$x.so")" "$L/lib/x86_64-linux-gnu/lib$x.a"
  done
  export LD_LIBRARY_PATH=$L/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH
fi

# bench_summary FILE: one line per phase of a `strata bench --json` file (tok/s, seconds, expert
# counts, bytes read, exposed wait, the floors and time / max(floors)), then the arena, drive and
# activation mode.
bench_summary() {
  python3 - "$1" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no json:", e); sys.exit()
for ph in ("prefill", "decode"):
    p = d.get(ph, {})
    print(f"{ph:8s} {p.get('tokens_per_s', 0):10.1f} tok/s  {p.get('seconds', 0):7.3f} s  needed {p.get('needed')} missed {p.get('missed')} (late {p.get('ahead_late')}) "
          f"ahead {p.get('streamed_ahead')} (in flight {p.get('ahead_in_flight')}) "
          f"read {p.get('bytes_read', 0)/2**30:.2f} GiB  wait {p.get('exposed_wait_s', 0):.3f} s  io floor {p.get('io_floor_s', 0):.3f} s  "
          f"compute floor {p.get('compute_floor_s', 0):.3f} s  ratio {p.get('ratio_to_floor', 0):.2f}")
print("arena", d.get("arena_bytes", 0) / 2**30, "GiB, ssd", d.get("ssd_gbps"), "GB/s, act_quant", d.get("act_quant"))
PY
}

# strata_build [cmake -D flags...] -- targets...: configures $SRC into $B (Release, Ninja) and
# builds the targets with every core. Returns cmake's status.
strata_build() {
  local flags=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do flags+=("$1"); shift; done
  [ "${1:-}" = "--" ] && shift
  cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_WERROR=OFF -DSTRATA_BENCH=OFF \
    -DSTRATA_DEPS_ROOT="$DEPS" -DSTRATA_GTEST_SOURCE="$GTEST" -Dfmt_DIR=$L/lib/x86_64-linux-gnu/cmake/fmt \
    -DCLI11_DIR=$L/share/cmake/CLI11 -Dnlohmann_json_DIR=$L/share/cmake/nlohmann_json "${flags[@]}" &&
    cmake --build "$B" -j"$(nproc)" --target "$@"
}
