#!/usr/bin/env bash
# Install, build, and run every test (CTest), then the GGUF parser tests again under
# AddressSanitizer and UBSan, then the GGUF parser's libFuzzer target for 60 s.
# Tests that need ../shared/fixtures say so when they skip.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
jobs=$(nproc)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs"
# Node modules of the server tests (tests/server: the openai client, playwright-core), from the committed lock file.
(cd tests/server && npm ci --no-audit --no-fund --loglevel=error)
# Here the real-browser test of the chat page must run: a missing chromium fails it, not skips it.
STRATA_REQUIRE_BROWSER=1 ctest --test-dir build --output-on-failure -j"$jobs"
# The file parser faces untrusted input: run its tests (corrupt files, random mutations) under ASan.
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_ASAN=ON -DSTRATA_BENCH=OFF -DSTRATA_CUDA=OFF >/dev/null
cmake --build build-asan -j"$jobs" --target test_gguf
ASAN_OPTIONS=detect_leaks=1 build-asan/tests/test_gguf
# Coverage-guided fuzzing of the parser (libFuzzer with ASan and UBSan, clang; fuzz/), bounded
# to 60 s, from seeds written now (fuzz/make_seeds.cpp) plus what earlier runs kept in
# build-fuzz/corpus. A crash, a sanitizer report or a broken invariant fails the script; the
# input that did it is left in build-fuzz/ (crash-*, oom-*, timeout-*) and the log in
# build-fuzz/fuzz.log. Replay one with: build-fuzz/fuzz/fuzz_gguf build-fuzz/crash-...
cmake -S . -B build-fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_FUZZ=ON -DSTRATA_CUDA=OFF \
  -DSTRATA_TESTS=OFF -DSTRATA_BENCH=OFF >/dev/null
cmake --build build-fuzz -j"$jobs" --target fuzz_gguf fuzz_gguf_seeds
rm -rf build-fuzz/seeds
build-fuzz/fuzz/fuzz_gguf_seeds build-fuzz/seeds models/*.gguf
mkdir -p build-fuzz/corpus
if ! build-fuzz/fuzz/fuzz_gguf -max_total_time=60 -timeout=10 -print_final_stats=1 -artifact_prefix=build-fuzz/ \
  build-fuzz/corpus build-fuzz/seeds >build-fuzz/fuzz.log 2>&1; then
  tail -n 60 build-fuzz/fuzz.log
  echo "fuzz_gguf failed: see build-fuzz/fuzz.log and the crash input in build-fuzz/" >&2
  exit 1
fi
grep -E '^(Done|stat::number_of_executed_units)' build-fuzz/fuzz.log
