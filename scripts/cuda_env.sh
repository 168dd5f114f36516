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
