#!/usr/bin/env bash
# Formats the C++ sources of src/ tests/ bench/ fuzz/ in place with clang-format and the
# repository's .clang-format. Generated files (first line says GENERATED) are left alone.
#   scripts/format.sh           format every file
#   scripts/format.sh --check   change nothing; list the files that differ from the style and
#                               exit 1 if there are any (0 when all are formatted)
#   scripts/format.sh [--check] FILE...   only these files
# CLANG_FORMAT=/path/to/clang-format picks the binary (default: clang-format, Debian 12: 14).
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
if [ "${1:-}" = "--check" ]; then check=1; shift; fi
CLANG_FORMAT=${CLANG_FORMAT:-clang-format}
command -v "$CLANG_FORMAT" >/dev/null || { echo "format.sh: $CLANG_FORMAT not found (scripts/install-deps.sh installs it)" >&2; exit 2; }
if (($#)); then
  files=("$@")
else
  mapfile -t files < <(find src tests bench fuzz -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.hpp' -o -name '*.cc' \) 2>/dev/null | sort)
fi
differ=0 checked=0
for f in "${files[@]}"; do
  head -n 1 "$f" | grep -q 'GENERATED' && continue
  checked=$((checked + 1))
  if ((check)); then
    if ! "$CLANG_FORMAT" --style=file "$f" | cmp -s - "$f"; then
      echo "$f"
      differ=$((differ + 1))
    fi
  else
    "$CLANG_FORMAT" --style=file -i "$f"
  fi
done
if ((check)) && ((differ)); then
  echo "format.sh: $differ of $checked files differ from .clang-format (run scripts/format.sh)" >&2
  exit 1
fi
