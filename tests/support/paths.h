#pragma once
// Where tests find their data. Shipped data lives in tests/data and models/;
// the larger fixtures live in ../shared/fixtures (override with STRATA_FIXTURES).
#include <cstdlib>
#include <filesystem>
#include <string>

namespace strata::test {

/// Path of a file shipped in tests/data.
inline std::string data_path(const std::string& name) { return std::string(STRATA_TEST_DATA) + "/" + name; }

/// Path of the model shipped in the repo (models/qwen3moe-code-Q8_0.gguf).
inline std::string shipped_model() { return std::string(STRATA_REPO_DIR) + "/models/qwen3moe-code-Q8_0.gguf"; }
/// Path of the random-weight qwen3next model shipped in the repo (models/qwen3next-tiny-bf16.gguf).
inline std::string shipped_qwen3next() { return std::string(STRATA_REPO_DIR) + "/models/qwen3next-tiny-bf16.gguf"; }

/// The shared fixtures folder, or "" when it is absent (tests then GTEST_SKIP with a message).
inline std::string shared_fixtures() {
  if (const char* env = std::getenv("STRATA_FIXTURES"); env && *env) return env;
  for (const char* cand : {STRATA_SHARED_FIXTURES, "/work/shared/fixtures"})
    if (std::filesystem::is_directory(cand)) return cand;
  return "";
}

/// The path of the strata binary built alongside the tests.
inline std::string strata_binary() { return STRATA_BINARY; }

}  // namespace strata::test

/// Skip the current test, saying why, when the shared fixtures folder is absent.
#define STRATA_REQUIRE_FIXTURES(var)                                         \
  std::string var = ::strata::test::shared_fixtures();                       \
  if (var.empty())                                                           \
  GTEST_SKIP() << "shared fixtures folder absent (../shared/fixtures); set " \
                  "STRATA_FIXTURES to run this test"
