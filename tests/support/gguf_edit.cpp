#include "support/gguf_edit.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "backend/cpu/cpu_backend.h"
#include "gguf/gguf_writer.h"
#include "model/model.h"
#include "model/weights.h"

namespace strata::test {

std::string write_edited_gguf(const std::string& src_path, const GgufEdit& ed, const std::string& tag) {
  const gguf::File src = gguf::File::open(src_path);
  gguf::Writer w(src.alignment());
  std::vector<bool> used(ed.set_kv.size(), false);
  for (const auto& [key, value] : src.metadata()) {
    if (key == "general.alignment") continue;
    bool replaced = false;
    for (size_t i = 0; i < ed.set_kv.size(); ++i)
      if (ed.set_kv[i].first == key) {
        w.add_kv(key, ed.set_kv[i].second);
        used[i] = replaced = true;
      }
    if (!replaced) w.add_kv(key, value);
  }
  for (size_t i = 0; i < ed.set_kv.size(); ++i)
    if (!used[i]) w.add_kv(ed.set_kv[i].first, ed.set_kv[i].second);
  std::ifstream in(src_path, std::ios::binary);
  auto bytes_of = [&](const gguf::TensorInfo& t) {
    std::vector<uint8_t> data(t.n_bytes);
    in.seekg(std::streamoff(t.offset));
    in.read(reinterpret_cast<char*>(data.data()), std::streamsize(data.size()));
    return data;
  };
  for (const auto& t : src.tensors()) {
    if (std::find(ed.drop.begin(), ed.drop.end(), t.name) != ed.drop.end()) continue;
    std::vector<uint8_t> data = bytes_of(t);
    std::vector<uint64_t> ne = t.ne;
    if (t.name == ed.reshape) {
      ne = ed.ne;
      data.resize(gguf::Writer::tensor_bytes(t.type, ne));
    }
    w.add_tensor(t.name, t.type, ne, std::move(data));
  }
  for (const auto& [name, from] : ed.copies) {
    const gguf::TensorInfo* t = src.find_tensor(from);
    if (!t) throw std::runtime_error("write_edited_gguf: no tensor " + from);
    w.add_tensor(name, t->type, t->ne, bytes_of(*t));
  }
  const auto path =
      std::filesystem::temp_directory_path() / ("strata-edit-" + tag + "-" + std::to_string(::getpid()) + ".gguf");
  w.write(path.string());
  return path.string();
}

std::string model_load_error(const std::string& path) {
  try {
    cpu::CpuBackend be(cpu::CpuOptions{1, cpu::kernels::resolve_kernels()});
    ::strata::model::load_model(gguf::File::open(path), be);
  } catch (const ::strata::model::ModelError& e) {
    return e.what();
  }
  return "<no exception>";
}

std::string edited_load_error(const std::string& src, const GgufEdit& ed, const std::string& tag) {
  const std::string path = write_edited_gguf(src, ed, tag);
  std::string msg = model_load_error(path);
  std::filesystem::remove(path);
  return msg;
}

}  // namespace strata::test
