#!/usr/bin/env bash
# Install, build, and run every test (CTest), then the GGUF parser tests again under
# AddressSanitizer and UBSan. Tests that need ../shared/fixtures say so when they skip.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
jobs=$(nproc)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$jobs"
# Node modules of the server tests (tests/server: the openai client), from the committed lock file.
(cd tests/server && npm ci --no-audit --no-fund --loglevel=error)
ctest --test-dir build --output-on-failure -j"$jobs"
# The file parser faces untrusted input: run its tests (corrupt files, random mutations) under ASan.
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_ASAN=ON -DSTRATA_BENCH=OFF >/dev/null
cmake --build build-asan -j"$jobs" --target test_gguf
ASAN_OPTIONS=detect_leaks=1 build-asan/tests/test_gguf
