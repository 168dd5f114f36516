#!/usr/bin/env bash
# The main job: install, build, then generate with the shipped model while its experts
# stream from disk through an arena of about a quarter of their bytes.
#
# Arguments go to `strata run` and override the defaults below: a default flag is added only
# when the user gave none of its spellings (`scripts/demo.sh -n 5`, `--temp 0.7`, `-p TEXT`
# instead of the shipped prompt file, `-m OTHER.gguf`).
# STRATA_BIN=PATH skips the install and the build and runs that binary (the tests use it).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${STRATA_BIN:-}" ]]; then
  ./scripts/install-deps.sh
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build -j"$(nproc)" --target strata
  STRATA_BIN=build/strata
fi

# gave SPELLING...: whether any argument is one of the spellings, alone or as --flag=value
# (the text after -p/--prompt is the prompt, not a flag).
gave() {
  local a s skip=0
  for a in "${user_args[@]}"; do
    if ((skip)); then
      skip=0
      continue
    fi
    for s in "$@"; do
      [[ "$a" == "$s" || "$a" == "$s="* ]] && return 0
    done
    [[ "$a" == -p || "$a" == --prompt ]] && skip=1
  done
  return 1
}
user_args=("$@")
defaults=()
gave -m --model || defaults+=(-m models/qwen3moe-code-Q8_0.gguf)
gave -p --prompt -f --file --prompt-ids || defaults+=(-f models/prompt.py)
gave -n --n-predict || defaults+=(-n 96)
gave --temp || defaults+=(--temp 0)
gave --arena-mb || defaults+=(--arena-mb 8)
exec "$STRATA_BIN" run "${defaults[@]}" "$@"
