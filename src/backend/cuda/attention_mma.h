#pragma once
// The tensor-core attention kernel (attention_mma.cu), behind cuda::attention (kernels.h,
// AttentionPath). Internal to src/backend/cuda.
#include "backend/cuda/kernels.h"

namespace strata::cuda::detail {

/// Cache positions per segment of the tensor-core kernel (its softmax state starts fresh at
/// every multiple of this; kernels.h, AttentionPath::Mma).
inline constexpr int kAttnMmaSegment = 128;

/// True if the tensor-core kernel takes these arguments: head_dim 64 or 128, q, k, v 16-byte
/// aligned, q_stride and kv_stride multiples of 4 floats. The other checks are cuda::attention's.
bool attention_mma_takes(const AttentionArgs& a);

/// Launches the tensor-core kernel on `stream` (a cudaStream_t); the arguments must already
/// have passed cuda::attention's checks and attention_mma_takes.
void attention_mma(const AttentionArgs& a, void* stream);

}  // namespace strata::cuda::detail
