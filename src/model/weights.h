#pragma once
// Dense (resident) weights: bound by GGUF tensor name with the expected shape, read
// once into aligned memory. Expert tensors are never loaded here; they go through the
// expert stream (src/stream/).
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf.h"
#include "io/file.h"

namespace strata::model {

/// Thrown when a model file lacks a tensor or has one of the wrong shape or type.
class ModelError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A resident tensor. Shape ne[] as in GGUF (ne[0] contiguous).
struct DenseTensor {
  const gguf::TensorInfo* info = nullptr;
  io::AlignedBuffer data;  ///< the raw bytes as stored in the file (info->n_bytes)
  std::vector<float> f32;  ///< dequantized copy, filled only for small vectors (norms, biases)

  /// Host view in the file type: ne[1]*ne[2]*... rows of ne[0] columns, row_bytes apart.
  backend::Tensor tensor() const;
  /// fp32 values (requires f32 to have been filled by WeightLoader::vector()).
  const float* values() const { return f32.data(); }
};

/// Binds tensors of one GGUF file by name, checking shapes, and reads them.
class WeightLoader {
 public:
  explicit WeightLoader(const gguf::File& gguf);

  /// The tensor `name` with exactly the shape `ne` (ne[0] contiguous); throws ModelError
  /// "tensor 'x': expected shape [a, b], got [c, d]" or "missing tensor 'x'".
  const gguf::TensorInfo& expect(const std::string& name, const std::vector<int64_t>& ne) const;
  /// Whether the file has a tensor of this name.
  bool has(const std::string& name) const { return gguf_.find_tensor(name) != nullptr; }

  /// Reads a matrix tensor (any supported type) of shape ne, keeping its file type.
  /// Throws ModelError for types the kernels do not support.
  DenseTensor matrix(const std::string& name, const std::vector<int64_t>& ne);
  /// Reads a 1-D (or small) tensor of shape ne and dequantizes it to fp32.
  DenseTensor vector(const std::string& name, const std::vector<int64_t>& ne);

  /// Bytes read so far (resident dense weights).
  uint64_t bytes_loaded() const { return bytes_loaded_; }

 private:
  const gguf::File& gguf_;
  std::unique_ptr<io::File> file_;
  uint64_t bytes_loaded_ = 0;
};

}  // namespace strata::model
