// Scalar reference matmul: each weight row is dequantized with the bit-exact reference
// (dequantize_row), then every (row, token) dot product is accumulated in double in column
// order and rounded once to float. It is the ground truth the fast families are tested
// against, and trivially satisfies the invariance contract (one output, one fixed loop).
#include <vector>

#include "backend/cpu/kernels/kernels_impl.h"
#include "quant/quant.h"

namespace strata::cpu::kernels::detail {

void matmul_scalar(const MatmulArgs& a) {
  thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(a.cols));
  for (int64_t r = a.row_begin; r < a.row_end; ++r) {
    quant::dequantize_row(a.type, a.W + static_cast<size_t>(r) * a.row_bytes, row.data(), a.cols);
    for (int64_t t = 0; t < a.n_tok; ++t) {
      const float* xt = a.x + t * a.ldx;
      double acc = 0.0;
      for (int64_t k = 0; k < a.cols; ++k) acc += static_cast<double>(row[static_cast<size_t>(k)]) * xt[k];
      a.y[t * a.ldy + r] = static_cast<float>(acc);
    }
  }
}

}  // namespace strata::cpu::kernels::detail
