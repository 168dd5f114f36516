#include "support/synth_model.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "support/paths.h"

namespace strata::test {

std::string run_command(const std::string& cmd, int* rc) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) {
    *rc = -1;
    return out;
  }
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  *rc = ::pclose(p);
  return out;
}

SynthModel::SynthModel(const std::string& like) {
  path = (std::filesystem::temp_directory_path() / ("strata-" + like + "-" + std::to_string(::getpid()) + ".gguf"))
             .string();
  int rc = 0;
  const std::string out =
      run_command(strata_binary() + " synth --like " + like + " --type F32 -q --force -o " + path + " 2>&1", &rc);
  EXPECT_EQ(rc, 0) << out;
}

SynthModel::~SynthModel() { std::filesystem::remove(path); }

}  // namespace strata::test
