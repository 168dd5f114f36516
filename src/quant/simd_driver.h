#pragma once
// The matmul driver shared by the SIMD families; included only by *_avx2.cpp / *_avx512.cpp,
// each with its own vector traits `V` (see the bottom of those files).
//
// Shape of the computation (one call, rows [r0, r1), tokens [0, n_tok)):
//
//   for each panel of P rows:              P = 3 (decode) .. ~256 KiB of fp32 (prefill)
//     decode the P weight rows to fp32    (each weight block decoded once per call)
//     for each tile of TB tokens:
//       for each group of RB rows:         micro-kernel: RB x TB (row, token) pairs
//         for k in steps of 2*V::W columns, in order:
//           acc[r][t][0] += w[r][k   .. k+W)  * x[t][k   .. k+W)     (one FMA per lane)
//           acc[r][t][1] += w[r][k+W .. k+2W) * x[t][k+W .. k+2W)
//         y[t][r] = hsum(acc[r][t][0] + acc[r][t][1])   (fixed reduction tree)
//
// Invariance: the value of y[t][r] depends only on row r of W, row t of x and `cols`: lane l
// of accumulator j of every pair sees exactly the products k = j*W + l (mod 2W), in increasing
// k, whatever the tile sizes, the panel, the row range or n_tok; the reduction tree is fixed.
// So prompt chunking and thread splits (over rows) cannot change a bit.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "quant/quant_impl.h"

namespace strata::quant::detail::simd {

/// Decodes one row of `cols` weights (bytes at `src`) to `cols` floats at `dst` (64-byte aligned).
using DecodeFn = void (*)(const uint8_t* src, float* dst, int64_t cols);

namespace {  // internal linkage: each SIMD translation unit gets its own copy (see quant_impl.h)

/// A growable, 64-byte aligned, per-thread scratch buffer of floats.
float* scratch(size_t n) {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<float, Free> buf;
  thread_local size_t cap = 0;
  if (n > cap) {
    const size_t want = std::max(n, cap * 2);
    buf.reset(static_cast<float*>(std::aligned_alloc(64, (want * sizeof(float) + 63) / 64 * 64)));
    if (!buf) throw std::bad_alloc();
    cap = want;
  }
  return buf.get();
}

/// RB rows x TB tokens micro-kernel over decoded rows `w` (ldw floats apart, zero-padded to a
/// multiple of 2*V::W) and activations x (ldx apart). Writes y[t*ldy + r].
template <class V, int RB, int TB>
void micro(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t cols, float* y, int64_t ldy) {
  using vec = typename V::vec;
  constexpr int W = V::W;
  vec acc[RB][TB][2];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TB; ++t) acc[r][t][0] = acc[r][t][1] = V::zero();
  int64_t k = 0;
  for (; k + 2 * W <= cols; k += 2 * W) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      vec wv[RB];
#pragma GCC unroll 16
      for (int r = 0; r < RB; ++r) wv[r] = V::load(w + r * ldw + k + h * W);
#pragma GCC unroll 16
      for (int t = 0; t < TB; ++t) {
        const vec xv = V::loadu(x + t * ldx + k + h * W);
#pragma GCC unroll 16
        for (int r = 0; r < RB; ++r) acc[r][t][h] = V::fma(wv[r], xv, acc[r][t][h]);
      }
    }
  }
  if (k < cols) {  // ragged tail (plain types only): weights are zero-padded, x is masked
    const int rem = static_cast<int>(cols - k);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const int n = std::clamp(rem - h * W, 0, W);
      vec wv[RB];
#pragma GCC unroll 16
      for (int r = 0; r < RB; ++r) wv[r] = V::load(w + r * ldw + k + h * W);
#pragma GCC unroll 16
      for (int t = 0; t < TB; ++t) {
        const vec xv = V::loadu_n(x + t * ldx + k + h * W, n);
#pragma GCC unroll 16
        for (int r = 0; r < RB; ++r) acc[r][t][h] = V::fma(wv[r], xv, acc[r][t][h]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TB; ++t) y[t * ldy + r] = V::hsum(V::add(acc[r][t][0], acc[r][t][1]));
}

template <class V, int RB, int TB>
struct MicroTable {
  using Fn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);
  Fn fn[RB][TB];
  constexpr MicroTable() : fn{} { fill<0, 0>(); }
  template <int R, int T>
  constexpr void fill() {
    if constexpr (R < RB) {
      if constexpr (T < TB) {
        fn[R][T] = &micro<V, R + 1, T + 1>;
        fill<R, T + 1>();
      } else {
        fill<R + 1, 0>();
      }
    }
  }
};

/// Runs one matmul call with decoder `dec` (see the diagram at the top of this file).
template <class V>
void run(DecodeFn dec, const MatmulArgs& a) {
  constexpr int RB = V::RB, TB = V::TB, STEP = 2 * V::W;
  static constexpr MicroTable<V, RB, TB> table{};
  const int64_t cols = a.cols;
  const int64_t ldw = (cols + STEP - 1) / STEP * STEP;
  const int64_t rows = a.row_end - a.row_begin;
  // Decode-sized calls keep the panel in L1; prefill-sized calls decode a panel of ~256 KiB
  // (L2) that every token tile then reuses.
  int64_t panel = RB;
  if (a.n_tok > TB) panel = std::clamp<int64_t>((256 * 1024 / 4) / ldw / RB * RB, RB, 64 * RB);
  panel = std::min(panel, rows);
  float* buf = scratch(static_cast<size_t>(panel * ldw));
  for (int64_t p = a.row_begin; p < a.row_end; p += panel) {
    const int64_t np = std::min(panel, a.row_end - p);
    for (int64_t i = 0; i < np; ++i) {
      float* wr = buf + i * ldw;
      dec(a.W + static_cast<size_t>(p + i) * a.row_bytes, wr, cols);
      std::memset(wr + cols, 0, static_cast<size_t>(ldw - cols) * sizeof(float));
    }
    for (int64_t t = 0; t < a.n_tok; t += TB) {
      const int64_t nt = std::min<int64_t>(TB, a.n_tok - t);
      for (int64_t i = 0; i < np; i += RB) {
        const int64_t nr = std::min<int64_t>(RB, np - i);
        table.fn[nr - 1][nt - 1](buf + i * ldw, ldw, a.x + t * a.ldx, a.ldx, cols, a.y + t * a.ldy + p + i, a.ldy);
      }
    }
  }
}

}  // namespace
}  // namespace strata::quant::detail::simd
