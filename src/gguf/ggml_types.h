#pragma once
// ggml tensor types as stored in GGUF files: the type ids and block geometry.
// Source: ggml/include/ggml.h (enum ggml_type) and ggml/src/ggml.c (type_traits),
// which define the on-disk format. Geometry only; kernels live in src/quant/.
#include <cstdint>
#include <optional>
#include <string>

namespace strata {

/// ggml type ids as written in the GGUF tensor table (uint32 on disk).
enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
};

/// Block geometry of one ggml type: a row of n elements occupies
/// (n / block_elems) * block_bytes bytes; n must be a multiple of block_elems.
struct GgmlTypeInfo {
  GgmlType type;
  const char* name;      ///< as llama.cpp prints it, e.g. "Q8_0"
  uint32_t block_elems;  ///< elements per block (1 for plain types)
  uint32_t block_bytes;  ///< bytes per block
};

/// Geometry of a type id read from a file; std::nullopt for ids this build does not know.
std::optional<GgmlTypeInfo> ggml_type_info(uint32_t type_id);

/// Name of a type ("Q8_0"), or "type#<id>" for unknown ids.
std::string ggml_type_name(uint32_t type_id);
inline std::string ggml_type_name(GgmlType t) { return ggml_type_name(static_cast<uint32_t>(t)); }

}  // namespace strata
