#!/usr/bin/env bash
# The main job: install, build, then generate with the shipped model while its experts
# stream from disk through an arena of about a quarter of their bytes.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target strata
exec build/strata run -m models/qwen3moe-code-Q8_0.gguf -f models/prompt.py -n 96 --temp 0 --arena-mb 8 "$@"
