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
//   for each block of TT = 64 tokens:        its activations stay in L2
//     for each panel of P = 4*RB rows:
//       decode the P weight rows to fp32     (once per token block)
//       for each chunk of KC = 512 columns:  panel chunk + token tile chunk in L1
//         for each tile of TB tokens:
//           for each group of RB rows:       micro-kernel: RB x TB (row, token) pairs
//             for k in the chunk, in steps of 2*V::W columns, in order:
//               acc[r][t][0] += w[r][k   .. k+W)  * x[t][k   .. k+W)     (one FMA per lane)
//               acc[r][t][1] += w[r][k+W .. k+2W) * x[t][k+W .. k+2W)
//     y[t][r] = hsum(acc[r][t][0] + acc[r][t][1])   (fixed reduction tree, after the last chunk)
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

#include "backend/cpu/kernels/kernels_impl.h"

namespace strata::cpu::kernels::detail::simd {

namespace {  // internal linkage: each SIMD translation unit gets its own copy (see quant_impl.h)

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

/// RB rows x TB tokens micro-kernel over columns [0, len) of fp32 rows `w` (ldw floats apart)
/// and activations x (ldx apart). The 2*RB*TB accumulators live in `acc` between calls (layout
/// acc[(r * acc_rs + t) * 2W + j*W + lane]); `first` starts them at zero instead of loading them,
/// `last` reduces them into y[t*ldy + r] instead of storing them. Storing and reloading a vector
/// is exact, so splitting the columns into chunks does not change any lane's sum.
template <class V, int RB, int TB>
void micro(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t len, float* acc, int64_t acc_rs,
           bool first, bool last, float* y, int64_t ldy) {
  using vec = typename V::vec;
  constexpr int W = V::W;
  vec a[RB][TB][2];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TB; ++t)
#pragma GCC unroll 2
      for (int j = 0; j < 2; ++j) a[r][t][j] = first ? V::zero() : V::loadu(acc + (r * acc_rs + t) * 2 * W + j * W);
  int64_t k = 0;
  for (; k + 2 * W <= len; k += 2 * W) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      vec wv[RB];
#pragma GCC unroll 16
      for (int r = 0; r < RB; ++r) wv[r] = V::loadu(w + r * ldw + k + h * W);
#pragma GCC unroll 16
      for (int t = 0; t < TB; ++t) {
        const vec xv = V::loadu(x + t * ldx + k + h * W);
#pragma GCC unroll 16
        for (int r = 0; r < RB; ++r) a[r][t][h] = V::fma(wv[r], xv, a[r][t][h]);
      }
    }
  }
  if (k < len) {  // ragged tail (plain types only): masked loads, lanes past len read as 0
    const int rem = static_cast<int>(len - k);
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
        for (int r = 0; r < RB; ++r) a[r][t][h] = V::fma(wv[r], xv, a[r][t][h]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 16
    for (int t = 0; t < TB; ++t) {
      if (last) {
        y[t * ldy + r] = V::hsum(V::add(a[r][t][0], a[r][t][1]));
      } else {
        V::storeu(acc + (r * acc_rs + t) * 2 * W, a[r][t][0]);
        V::storeu(acc + (r * acc_rs + t) * 2 * W + W, a[r][t][1]);
      }
    }
}

template <class V, int RB, int TB>
struct MicroTable {
  using Fn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, bool, bool, float*,
                      int64_t);
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

/// Blocking of the panel path (floats): KC columns per chunk, so that one chunk of the panel's
/// rows (PANEL x KC) and of a token tile (TB x KC) stay in L1 while the micro-kernels sweep them;
/// TT tokens per block: their activations (TT x cols) stay in L2 while all panels pass.
inline constexpr int64_t kKC = 512;
inline constexpr int64_t kTT = 64;

/// Computes y for `np` consecutive fp32 rows `w` (ldw apart; rows r0.. of the output) and the
/// tokens [tb, te) of `a` (te - tb <= kTT), blocked over columns (see kKC).
template <class V>
void panel(const float* w, int64_t ldw, int64_t np, int64_t r0, int64_t tb, int64_t te, const MatmulArgs& a,
           float* acc) {
  constexpr int RB = V::RB, TB = V::TB, W = V::W;
  static constexpr MicroTable<V, RB, TB> table{};
  for (int64_t kc = 0; kc < a.cols; kc += kKC) {
    const int64_t len = std::min(kKC, a.cols - kc);
    const bool first = kc == 0, last = kc + len == a.cols;
    for (int64_t t = tb; t < te; t += TB) {
      const int64_t nt = std::min<int64_t>(TB, te - t);
      for (int64_t i = 0; i < np; i += RB) {
        const int64_t nr = std::min<int64_t>(RB, np - i);
        table.fn[nr - 1][nt - 1](w + i * ldw + kc, ldw, a.x + t * a.ldx + kc, a.ldx, len,
                                 acc + (i * kTT + (t - tb)) * 2 * W, kTT, first, last, a.y + t * a.ldy + r0 + i, a.ldy);
      }
    }
  }
}

/// Rows per panel: a multiple of RB, about 4 micro-kernel groups.
template <class V>
constexpr int64_t panel_rows() {
  return 4 * V::RB;
}

/// Panel path over rows that are already fp32 in memory (F32 weights: no copy).
template <class V>
void run_direct(const MatmulArgs& a) {
  const int64_t P = panel_rows<V>();
  float* acc = scratch(static_cast<size_t>(P * kTT * 2 * V::W));
  const auto* w = reinterpret_cast<const float*>(a.W);
  const int64_t ldw = static_cast<int64_t>(a.row_bytes / sizeof(float));
  for (int64_t tb = 0; tb < a.n_tok; tb += kTT)
    for (int64_t p = a.row_begin; p < a.row_end; p += P)
      panel<V>(w + p * ldw, ldw, std::min(P, a.row_end - p), p, tb, std::min(a.n_tok, tb + kTT), a, acc);
}

/// Panel path: for each block of kTT tokens (its activations stay in L2), decodes panels of P
/// rows with `dec(src, dst, cols)` and runs the micro-kernels over them. Blocks are decoded
/// once per token block: ~n_tok/64 times per call, a few percent of the FMA work.
template <class V, class Dec>
void run(Dec dec, const MatmulArgs& a) {
  const int64_t P = panel_rows<V>();
  const int64_t ldw = (a.cols + 2 * V::W - 1) / (2 * V::W) * (2 * V::W) + 16;  // +16: avoid 4K aliasing
  float* acc = scratch(static_cast<size_t>(P * kTT * 2 * V::W + P * ldw));
  float* buf = acc + P * kTT * 2 * V::W;
  for (int64_t tb = 0; tb < a.n_tok; tb += kTT) {
    for (int64_t p = a.row_begin; p < a.row_end; p += P) {
      const int64_t np = std::min(P, a.row_end - p);
      for (int64_t i = 0; i < np; ++i) dec(a.W + static_cast<size_t>(p + i) * a.row_bytes, buf + i * ldw, a.cols);
      panel<V>(buf, ldw, np, p, tb, std::min(a.n_tok, tb + kTT), a, acc);
    }
  }
}

// ---- the family driver: F32/F16/BF16 decoders and the path choice, written once ----
// The traits V also provide V::load_f16(p) / V::load_bf16(p): the V::W halves / bfloat16 at p
// (bytes) as floats, exactly.

/// A decoder that hands a row's weights to a sink S (Store, Fused), V::W at a time, in order.
template <class S>
using SinkFn = void (*)(const uint8_t* src, S& out, int64_t cols);

template <class V>
void dec_f32(const uint8_t* s, float* o, int64_t n) {
  std::memcpy(o, s, static_cast<size_t>(n) * 4);
}
template <class V>
void dec_f16(const uint8_t* s, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + V::W <= n; i += V::W) V::store(o + i, V::load_f16(s + 2 * i));
  for (; i < n; ++i) o[i] = half_to_float(load_u16(s + 2 * i));
}
template <class V>
void dec_bf16(const uint8_t* s, float* o, int64_t n) {
  int64_t i = 0;
  for (; i + V::W <= n; i += V::W) V::store(o + i, V::load_bf16(s + 2 * i));
  for (; i < n; ++i) o[i] = bf16_to_float(load_u16(s + 2 * i));
}

/// The row decoder of a plain type (F32/F16/BF16; any cols), or nullptr.
template <class V>
DecodeFn plain_decoder(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return dec_f32<V>;
    case GgmlType::F16: return dec_f16<V>;
    case GgmlType::BF16: return dec_bf16<V>;
    default: return nullptr;
  }
}

// F32/F16/BF16 as sink decoders (n % V::W == 0), so that decode-sized calls can use the fused path.
template <class V, class S>
void sink_f32(const uint8_t* b, S& out, int64_t n) {
  S o = out;
  for (int64_t i = 0; i < n; i += V::W) o.put(V::loadu(reinterpret_cast<const float*>(b) + i));
  out = o;
}
template <class V, class S>
void sink_f16(const uint8_t* b, S& out, int64_t n) {
  S o = out;
  for (int64_t i = 0; i < n; i += V::W) o.put(V::load_f16(b + 2 * i));
  out = o;
}
template <class V, class S>
void sink_bf16(const uint8_t* b, S& out, int64_t n) {
  S o = out;
  for (int64_t i = 0; i < n; i += V::W) o.put(V::load_bf16(b + 2 * i));
  out = o;
}

/// The sink decoder of type t: the plain types here, the block types from the family
/// (Blocks::template get<S>(t), nullptr where it has none).
template <class V, class Blocks, class S>
SinkFn<S> sink_decoder(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return sink_f32<V, S>;
    case GgmlType::F16: return sink_f16<V, S>;
    case GgmlType::BF16: return sink_bf16<V, S>;
    default: return Blocks::template get<S>(t);
  }
}

/// Decodes n elements of type t at src to floats at dst with the family's decoders (the test
/// hook decode_row_avx2/avx512). False if the family has no decoder for t.
template <class V, class Blocks>
bool decode_row(GgmlType t, const void* src, float* dst, int64_t n) {
  const auto* s = static_cast<const uint8_t*>(src);
  float* tmp = scratch(static_cast<size_t>(n) + 16);  // decoders store aligned
  if (const DecodeFn f = plain_decoder<V>(t)) {
    f(s, tmp, n);
  } else if (const auto dec = Blocks::template get<Store<V>>(t)) {  // block types only here
    Store<V> sink{tmp};
    dec(s, sink, n);
  } else {
    return false;
  }
  std::memcpy(dst, tmp, static_cast<size_t>(n) * sizeof(float));
  return true;
}

template <class V, class Blocks, int NT>
bool fused(const MatmulArgs& a) {
  const auto dec = sink_decoder<V, Blocks, Fused<V, NT>>(a.type);
  if (!dec) return false;
  run_fused<V, NT>(dec, a);
  return true;
}

/// One f32-activation matmul call of a SIMD family (traits V, block decoders Blocks): ragged
/// plain rows take the panel path (the only one with tails), decode-sized calls (1-4 tokens) the
/// fused path, F32 prefill the panel path on the weights in place, the rest the panel path on
/// decoded panels. False (nothing done) for a type the family has no decoder for.
template <class V, class Blocks>
bool matmul_family(const MatmulArgs& a) {
  static_assert(V::FUSED_MAX == 4);
  const DecodeFn plain = plain_decoder<V>(a.type);
  if (plain && a.cols % (2 * V::W) != 0) {
    run<V>(plain, a);
    return true;
  }
  switch (a.n_tok) {
    case 1: return fused<V, Blocks, 1>(a);
    case 2: return fused<V, Blocks, 2>(a);
    case 3: return fused<V, Blocks, 3>(a);
    case 4: return fused<V, Blocks, 4>(a);
    default: break;
  }
  if (a.type == GgmlType::F32 && a.row_bytes % sizeof(float) == 0) {  // prefill on F32: no copy
    run_direct<V>(a);
    return true;
  }
  if (plain) {
    run<V>(plain, a);
    return true;
  }
  const auto dec = Blocks::template get<Store<V>>(a.type);
  if (!dec) return false;
  run<V>(
      [dec](const uint8_t* src, float* dst, int64_t cols) {
        Store<V> sink{dst};
        dec(src, sink, cols);
      },
      a);
  return true;
}

}  // namespace
}  // namespace strata::cpu::kernels::detail::simd
