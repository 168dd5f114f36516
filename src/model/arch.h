#pragma once
// An architecture = its hyper-parameter keys, its tensor table, and one forward (a Model).
//
// The tables drive everything that knows a model's shape: the loader binds the table's tensors
// by name and shape (dense ones read into memory, expert parts left on disk for the stream), and
// `strata synth` writes a file from the same table, `info` and `pack` read it. Each
// architecture is one file in src/model/arch/ that ends with STRATA_ARCHITECTURE(name) { ... };
// CMake generates the registry from the files in that folder (docs/adding-an-architecture.md).
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "backend/backend.h"
#include "gguf/gguf.h"
#include "model/hparams.h"
#include "model/model.h"
#include "model/weights.h"

namespace strata::gguf {
class Writer;
}

namespace strata::model {

/// One GGUF key `<arch>.<suffix>` and the ModelHParams field it sets.
struct KeySpec {
  enum class Need : uint8_t {
    Required,  ///< missing: error; an integer must be in [1, 2^30]
    Positive,  ///< missing: a default derived from other keys (read_hparams); present: in [1, 2^30]
    Optional,  ///< missing: the field keeps its default; an integer must be in [0, 2^30]
  };
  const char* suffix;  ///< e.g. "ssm.conv_kernel"
  std::variant<int ModelHParams::*, int64_t ModelHParams::*, double ModelHParams::*, float ModelHParams::*> field;
  Need need = Need::Required;
};

/// The keys every transformer architecture shares (gguf.md "LLM" keys), read for all.
const std::vector<KeySpec>& common_keys();

/// What a tensor of the table is to the engine.
enum class TensorRole : uint8_t {
  Matrix,  ///< resident, kept in its file type (projections, embeddings, output head, routers)
  Vector,  ///< resident, dequantized to fp32 (norms, biases, small per-channel tensors)
  Expert,  ///< a routed expert part [cols, rows, n_expert]: left on disk, read through the stream
  Skip,    ///< in the file, not used by the forward pass (e.g. NextN/MTP blocks)
};

/// What `synth` fills a tensor with (the value distribution of a trained model's tensor).
enum class TensorInit : uint8_t { Weight, Norm, Router, Conv, SsmA, DtBias };

/// One row of an architecture's tensor table.
struct TensorSpec {
  std::string name;         ///< full GGUF name, e.g. "blk.3.attn_q.weight"
  std::vector<int64_t> ne;  ///< expected shape, ggml ne order (ne[0] contiguous)
  TensorRole role = TensorRole::Matrix;
  TensorInit init = TensorInit::Weight;
  std::vector<int64_t> alt_ne;  ///< a second accepted shape (e.g. [n_embd] for [n_embd, 1]); empty = none
  /// May be absent from the file (llama.cpp's TENSOR_NOT_REQUIRED, e.g. glm4moe's q/k norm and
  /// attention biases): BoundWeights skips it and maybe() returns an empty tensor. Present, its
  /// shape is checked like any other.
  bool optional = false;

  TensorSpec(std::string name_, std::vector<int64_t> ne_, TensorRole role_, TensorInit init_,
             std::vector<int64_t> alt_ne_ = {}, bool optional_ = false)
      : name(std::move(name_)),
        ne(std::move(ne_)),
        role(role_),
        init(init_),
        alt_ne(std::move(alt_ne_)),
        optional(optional_) {}
};

/// An architecture's description, registered once per file in src/model/arch/.
struct Architecture {
  std::string name;  ///< general.architecture it reads (and synth writes)
  /// True if this architecture handles the file (usually: general.architecture == name; a
  /// family sharing a name, e.g. Mixtral's "llama" with ffn_*_exps, tests more).
  std::function<bool(const gguf::File&)> matches;
  std::vector<KeySpec> keys;  ///< keys beyond common_keys()
  /// The tensor table for these hyper-parameters, in the order llama.cpp's converter writes it.
  std::function<std::vector<TensorSpec>(const ModelHParams&)> tensors;
  /// Builds the model from the bound tensors (shapes already checked against the table).
  std::function<std::unique_ptr<Model>(const gguf::File&, const ModelHParams&, const class BoundWeights&,
                                       backend::Backend&, const LoadOptions&)>
      load;
  /// Checks of key values beyond ranges (ModelError naming the keys); may be empty.
  std::function<void(const gguf::File&, const ModelHParams&)> validate;
};

/// Registers an architecture (called by STRATA_ARCHITECTURE's generated registry).
void register_architecture(Architecture a);
/// Every registered architecture, in file-name order.
const std::vector<Architecture>& architectures();
/// The architecture for `f` (the first whose matches() is true). Throws ModelError naming the
/// file's general.architecture and the supported ones.
const Architecture& architecture_for(const gguf::File& f);
/// The registered architecture named `name`, or null.
const Architecture* find_architecture(const std::string& name);

/// Reads common_keys() and a.keys from `f` into hyper-parameters, checks ranges and the
/// relations every family needs (heads divisible, top-k <= experts, rope dims), sets n_vocab
/// from token_embd and tied_output from the absence of output.weight. Throws gguf::GgufError for
/// malformed keys, ModelError for missing or out-of-range ones (naming the key and the value).
ModelHParams read_hparams(const gguf::File& f, const Architecture& a);
/// Writes general.architecture's keys (common ones and a.keys) from `hp` (synth). Optional keys
/// whose value is 0 are left out.
void write_hparams(gguf::Writer& w, const ModelHParams& hp, const Architecture& a);

/// The tensors of one file bound to an architecture's table: dense ones read and made
/// available to the backend, expert parts checked and located.
class BoundWeights {
 public:
  /// Checks every table entry against the file (missing or mis-shaped: ModelError naming the
  /// tensor, its expected and actual shape, or an unsupported type), reads the Matrix and Vector
  /// ones, and hands them to `be` (Backend::weights). File tensors the table does not list are
  /// not read (load_model refuses those of a layer beyond block_count).
  BoundWeights(const gguf::File& f, const std::vector<TensorSpec>& table, backend::Backend& be);

  /// The backend tensor of a Matrix or Vector entry. Throws ModelError if the table has no such
  /// entry (a bug in the architecture file).
  backend::Tensor get(const std::string& name) const;
  /// Like get(), or an empty tensor when the table does not list it.
  backend::Tensor maybe(const std::string& name) const;
  /// The file's record of an Expert entry.
  const gguf::TensorInfo& expert(const std::string& name) const;
  /// Bytes of the resident tensors read.
  uint64_t dense_bytes() const { return dense_bytes_; }

 private:
  struct Entry {
    DenseTensor host;
    backend::Tensor dev;
  };
  const gguf::File& f_;
  std::vector<std::pair<std::string, Entry>> entries_;  // sorted by name
  uint64_t dense_bytes_ = 0;
  const Entry* find(const std::string& name) const;
};

/// Where each layer's routed experts live in `f`, from the Expert entries of `a`'s table
/// (blk.N.ffn_{gate,up,down}_exps: parts 0, 1, 2; n_expert 0 for layers without). Throws
/// ModelError as read_hparams does, or for an Expert entry the file lacks.
std::vector<stream::LayerExperts> expert_layout(const gguf::File& f, const Architecture& a);

/// "blk.<l>.<suffix>": the name of a layer's tensor.
std::string blk(int layer, const char* suffix);

}  // namespace strata::model

/// Defines the architecture of this file: `STRATA_ARCHITECTURE(qwen3moe) { return Architecture{...}; }`.
/// The identifier must be the file's stem (CMake generates the registry from the file names).
#define STRATA_ARCHITECTURE(id)                                            \
  static ::strata::model::Architecture strata_arch_##id();                 \
  namespace strata::model {                                                \
  void register_arch_##id() { register_architecture(strata_arch_##id()); } \
  }                                                                        \
  static ::strata::model::Architecture strata_arch_##id()
