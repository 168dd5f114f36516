#pragma once
// The matmul driver shared by the SIMD families; included only by *_avx2.cpp / *_avx512.cpp,
// each with its own vector traits `V` (see the bottom of those files).
//
// Shape of the computation (one call, rows [r0, r1), tokens [0, n_tok)):
//
// Decode-sized calls (n_tok <= V::FUSED_MAX) take the fused path instead: each row's blocks are
// decoded in registers and FMA'd straight into the (row, token) accumulators (struct Fused),
// so the weight stream from memory never pauses. Larger calls take the panel path:
//
//   for each panel of P rows:              P = ~256 KiB of fp32 (L2)
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

/// Sink of the decoders (simd_decoders.h) that stores the weights to a float buffer.
template <class V>
struct Store {
  float* o;
  void put(typename V::vec w) {
    V::store(o, w);
    o += V::W;
  }
};

/// Sink of the decoders that multiplies each group of V::W weights into the accumulators of
/// NT tokens right away. The weights arrive in order, W at a time, so chunk c goes to
/// accumulator c % 2: `a` is always the accumulator of the next chunk (the two swap roles after
/// each put). Rows have an even number of chunks (cols % 2W == 0), so at the end a = acc[0],
/// b = acc[1]: exactly the lanes and order of micro(), hence bit-identical results.
template <class V, int NT>
struct Fused {
  using vec = typename V::vec;
  const float* x;
  int64_t ldx;
  int64_t k = 0;
  vec a[NT], b[NT];
  Fused(const float* x_, int64_t ldx_) : x(x_), ldx(ldx_) {
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) a[t] = b[t] = V::zero();
  }
  void put(vec w) {
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      const vec n = V::fma(w, V::loadu(x + t * ldx + k), a[t]);
      a[t] = b[t];
      b[t] = n;
    }
    k += V::W;
  }
  void finish(float* y, int64_t ldy) {
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) y[t * ldy] = V::hsum(V::add(a[t], b[t]));
  }
};

/// Fused path: rows one at a time, decoded by `dec` (a block decoder taking a Fused<V, NT>&).
template <class V, int NT, class Dec>
void run_fused(Dec dec, const MatmulArgs& a) {
  for (int64_t r = a.row_begin; r < a.row_end; ++r) {
    Fused<V, NT> s(a.x, a.ldx);
    dec(a.W + static_cast<size_t>(r) * a.row_bytes, s, a.cols);
    s.finish(a.y + r, a.ldy);
  }
}

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

/// RB rows x TB tokens micro-kernel over fp32 rows `w` (ldw floats apart) and activations x
/// (ldx apart). Writes y[t*ldy + r].
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
      for (int r = 0; r < RB; ++r) wv[r] = V::loadu(w + r * ldw + k + h * W);
#pragma GCC unroll 16
      for (int t = 0; t < TB; ++t) {
        const vec xv = V::loadu(x + t * ldx + k + h * W);
#pragma GCC unroll 16
        for (int r = 0; r < RB; ++r) acc[r][t][h] = V::fma(wv[r], xv, acc[r][t][h]);
      }
    }
  }
  if (k < cols) {  // ragged tail (plain types only): masked loads, lanes past cols read as 0
    const int rem = static_cast<int>(cols - k);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const int n = std::clamp(rem - h * W, 0, W);
      vec wv[RB];
#pragma GCC unroll 16
      for (int r = 0; r < RB; ++r) wv[r] = V::loadu_n(w + r * ldw + k + h * W, n);
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

/// Runs the micro-kernels over rows that are already fp32 in memory (F32 weights: no copy).
template <class V>
void run_direct(const MatmulArgs& a) {
  constexpr int RB = V::RB, TB = V::TB;
  static constexpr MicroTable<V, RB, TB> table{};
  const auto* w = reinterpret_cast<const float*>(a.W);
  const int64_t ldw = static_cast<int64_t>(a.row_bytes / sizeof(float));
  // Row groups outside, token tiles inside: for prefill, a ~256 KiB panel of rows stays in L2.
  const int64_t panel = std::max<int64_t>(RB, (256 * 1024 / 4) / std::max<int64_t>(a.cols, 1) / RB * RB);
  for (int64_t p = a.row_begin; p < a.row_end; p += panel) {
    const int64_t pe = std::min(a.row_end, p + panel);
    for (int64_t t = 0; t < a.n_tok; t += TB) {
      const int64_t nt = std::min<int64_t>(TB, a.n_tok - t);
      for (int64_t r = p; r < pe; r += RB) {
        const int64_t nr = std::min<int64_t>(RB, pe - r);
        table.fn[nr - 1][nt - 1](w + r * ldw, ldw, a.x + t * a.ldx, a.ldx, a.cols, a.y + t * a.ldy + r, a.ldy);
      }
    }
  }
}

/// Panel path: decodes panels of rows with `dec(src, dst, cols)` (see the diagram at the top).
template <class V, class Dec>
void run(Dec dec, const MatmulArgs& a) {
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
    for (int64_t i = 0; i < np; ++i) dec(a.W + static_cast<size_t>(p + i) * a.row_bytes, buf + i * ldw, cols);
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
