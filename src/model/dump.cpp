// GCC 12 reports a false -Wmaybe-uninitialized inside libstdc++'s <regex> (std::function in the
// NFA states) when optimizing with sanitizers (the ASan build of scripts/test.sh); it is not in
// this file's code.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "model/dump.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace strata::model {

Dumper::Dumper(std::string dir, const std::string& filter) : dir_(std::move(dir)), all_(filter.empty()) {
  if (!all_) filter_ = std::regex(filter, std::regex::ECMAScript);
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) throw std::runtime_error(fmt::format("--dump: cannot create directory {}: {}", dir_, ec.message()));
  const std::string index = dir_ + "/index.tsv";
  index_ = std::fopen(index.c_str(), "w");
  if (!index_) throw std::runtime_error(fmt::format("--dump: cannot write {}: {}", index, std::strerror(errno)));
  const std::string calls = dir_ + "/calls.tsv";
  calls_ = std::fopen(calls.c_str(), "w");
  if (!calls_) {
    std::fclose(index_);
    index_ = nullptr;
    throw std::runtime_error(fmt::format("--dump: cannot write {}: {}", calls, std::strerror(errno)));
  }
}

Dumper::~Dumper() {
  if (index_) std::fclose(index_);
  if (calls_) std::fclose(calls_);
}

void Dumper::begin_call(std::span<const int32_t> ids) {
  ++call_;
  std::string line = fmt::format("{}\t{}\t", call_, phase_);
  for (size_t i = 0; i < ids.size(); ++i) line += fmt::format("{}{}", i ? "," : "", ids[i]);
  line += '\n';
  if (std::fputs(line.c_str(), calls_) < 0 || std::fflush(calls_) != 0)
    throw std::runtime_error(fmt::format("--dump: cannot write {}/calls.tsv", dir_));
}

bool Dumper::wants(const std::string& name) const { return all_ || std::regex_match(name, filter_); }

void Dumper::write(const std::string& name, const std::vector<float>& values, int64_t ne0, int64_t ne1) {
  const std::string file = fmt::format("{:05d}-{}.f32", call_ < 0 ? 0 : call_, name);
  const std::string path = dir_ + "/" + file;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw std::runtime_error(fmt::format("--dump: cannot write {}: {}", path, std::strerror(errno)));
  const size_t n = std::fwrite(values.data(), sizeof(float), values.size(), f);
  const bool ok = std::fclose(f) == 0 && n == values.size();
  if (!ok) throw std::runtime_error(fmt::format("--dump: short write to {}", path));
  fmt::print(index_, "{}\t{}\t{}\t{}\t{}\n", file, name, call_ < 0 ? 0 : call_, ne0, ne1);
  std::fflush(index_);
  ++written_;
}

}  // namespace strata::model
