#pragma once
// Tiny random-weight models written by `strata synth` for the families without a fixture, and
// the shell runner the tests that call a Python reference use.
#include <string>

namespace strata::test {

/// Runs `cmd` through /bin/sh; returns its standard output and sets *rc to pclose()'s status
/// (0 = success; -1 when the command could not be started).
std::string run_command(const std::string& cmd, int* rc);

/// A temporary all-F32 GGUF written by `strata synth --like LIKE --type F32` (path under the
/// temporary directory, named after `like` and the process id), removed on destruction. A
/// failed synth is a test failure (EXPECT); `path` names the file either way.
struct SynthModel {
  std::string path;
  explicit SynthModel(const std::string& like);
  ~SynthModel();
  SynthModel(const SynthModel&) = delete;
  SynthModel& operator=(const SynthModel&) = delete;
};

}  // namespace strata::test
