// libFuzzer entry point for the GGUF reader: every input must either parse or throw GgufError.
// Not built by the default CMake build. Build and run (from the repository root):
//
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -Isrc \
//     tools/fuzz_gguf.cpp src/gguf/gguf.cpp src/gguf/ggml_types.cpp -lfmt -o fuzz_gguf
//   mkdir -p corpus && cp models/qwen3moe-code-Q8_0.gguf corpus/ && ./fuzz_gguf -max_len=65536 corpus
//
// (A small Writer-made file is a better seed than the 31 MB model: libFuzzer truncates inputs to -max_len.)
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "gguf/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = [] {
    const char* dir = std::getenv("TMPDIR");
    return std::string(dir && *dir ? dir : "/tmp") + "/fuzz_gguf_" + std::to_string(::getpid()) + ".gguf";
  }();
  std::FILE* fp = std::fopen(path.c_str(), "wb");
  if (!fp) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, fp) != size) std::abort();
  std::fclose(fp);
  try {
    strata::gguf::File f = strata::gguf::File::open(path);
    for (const auto& t : f.tensors())
      if (t.offset + t.n_bytes > f.file_size()) std::abort();  // the reader's own guarantee
  } catch (const strata::gguf::GgufError&) {
  }
  return 0;
}
