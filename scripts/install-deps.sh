#!/usr/bin/env bash
# Installs the Debian 12 packages strata needs to build, test and benchmark.
# Idempotent: apt-get skips what is already installed. Run as root (or via sudo).
set -euo pipefail
PKGS=(
  build-essential cmake pkg-config
  libpcre2-dev        # Unicode regexes of the GGUF pre-tokenizers
  liburing-dev        # io_uring for the expert stream
  nlohmann-json3-dev  # JSON output, test references
  libcli11-dev        # command-line parsing
  libfmt-dev          # formatting
  libgtest-dev libgmock-dev libbenchmark-dev  # tests and benchmarks
  python3 python3-jinja2  # test oracle for chat templates
  libcpp-httplib-dev  # HTTP server of `strata serve`
  clang libclang-rt-dev  # the GGUF parser's libFuzzer target (fuzz/, run by scripts/test.sh)
  clang-format        # scripts/format.sh
  chromium            # the chat page's real-browser test (tests/server/browser.test.mjs)
)
# The server tests use Node.js and npm (tests/server); a Node.js from elsewhere is kept.
command -v node >/dev/null 2>&1 || PKGS+=(nodejs)
command -v npm >/dev/null 2>&1 || PKGS+=(npm)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
