#include "model/weights.h"

#include <fmt/format.h>

#include "quant/quant.h"

namespace strata::model {

backend::Tensor DenseTensor::tensor() const {
  return backend::Tensor::matrix(info->type, data.data(), int64_t(info->ne[0]), int64_t(info->n_elements / info->ne[0]),
                                 info->row_bytes);
}

WeightLoader::WeightLoader(const gguf::File& gguf) : gguf_(gguf), file_(io::File::open(gguf.path(), false)) {}

static std::string shape_of(const std::vector<int64_t>& ne) {
  std::string s = "[";
  for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
  return s + "]";
}

const gguf::TensorInfo& WeightLoader::expect(const std::string& name, const std::vector<int64_t>& ne) const {
  const gguf::TensorInfo* t = gguf_.find_tensor(name);
  if (!t)
    throw ModelError(fmt::format("{}: missing tensor '{}' (expected shape {})", gguf_.path(), name, shape_of(ne)));
  bool ok = t->ne.size() == ne.size();
  for (size_t i = 0; ok && i < ne.size(); ++i) ok = int64_t(t->ne[i]) == ne[i];
  if (!ok)
    throw ModelError(
        fmt::format("{}: tensor '{}': expected shape {}, got {}", gguf_.path(), name, shape_of(ne), t->shape_str()));
  if (!quant::is_supported(t->type))
    throw ModelError(
        fmt::format("{}: unsupported type {} in tensor '{}'", gguf_.path(), ggml_type_name(t->type), name));
  return *t;
}

DenseTensor WeightLoader::matrix(const std::string& name, const std::vector<int64_t>& ne) {
  DenseTensor d;
  d.info = &expect(name, ne);
  d.data = io::AlignedBuffer(d.info->n_bytes);
  file_->read_at(d.info->offset, d.info->n_bytes, d.data.data());
  bytes_loaded_ += d.info->n_bytes;
  return d;
}

DenseTensor WeightLoader::vector(const std::string& name, const std::vector<int64_t>& ne) {
  DenseTensor d = matrix(name, ne);
  d.f32.resize(d.info->n_elements);
  quant::dequantize_row(d.info->type, d.data.data(), d.f32.data(), int64_t(d.info->n_elements));
  return d;
}

}  // namespace strata::model
