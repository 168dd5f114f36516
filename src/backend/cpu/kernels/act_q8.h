#pragma once
// Internal to the CPU kernels (src/backend/cpu/kernels): the int8 activation path ("q8 activations").
//
// Activations x (fp32) are quantized per token in blocks of 32 (the Q8_0 scheme of ggml,
// ggml-quants.c quantize_row_q8_0: d = amax / 127, q = round(x / d)), keeping the int16 sums
// of every 16 codes for the formats whose weights carry an offset. The weight blocks are then
// multiplied with the int8 codes in integer arithmetic (exact), and only the per-block scale
// factors are applied in fp32. This is what llama.cpp does on CPU (it uses Q8_K, blocks of 256,
// for the k- and i-quants; we keep blocks of 32 everywhere, which is more accurate and costs
// one fp32 factor per 32 weights).
//
// The float part of every dot product is fixed here, lane by lane: the scalar family computes
// it with the same lane structure as the AVX-512 family (see matmul_q8_ref.cpp), so in q8 mode
// every family gives bit-identical results and the fast kernels are tested bit for bit; the
// exceptions are Q8_0, Q4_K and IQ4_XS on AVX-512, whose tokens-in-the-lanes GEMMs follow the serial
// definitions of matmul_q8_scalar_avx512 (for Q8_0 the CUDA one), also spelled out in scalar code.
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "backend/cpu/kernels/kernels.h"
#include "backend/cpu/kernels/kernels_impl.h"
#include "quant/quant_tables.h"

namespace strata::cpu::kernels::detail {

/// Quantizes one block of 32 activations: d = amax / 127, q = nearest-even(x * (127 / amax));
/// all zero when amax == 0. A non-finite amax gives d = NaN and q = 0, so that the NaN reaches
/// the output instead of disappearing into integer codes.
static inline float quantize_block_q8(const float* x, int8_t* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int k = 0; k < 32; ++k) {
    const float a = std::fabs(x[k]);
    finite = finite && a <= 3.4028234e38f;  // false for NaN and infinities
    amax = a > amax ? a : amax;
  }
  if (!finite) {
    for (int k = 0; k < 32; ++k) q[k] = 0;
    return std::nanf("");
  }
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  // round to nearest, ties to even: adding 1.5 * 2^23 leaves no fraction bits (|x * id| <= 127.5)
  // (the empty asm keeps the product rounded on its own: no contraction into an FMA)
  for (int k = 0; k < 32; ++k) {
    float v = x[k] * id;
    __asm__("" : "+x"(v));
    q[k] = static_cast<int8_t>(static_cast<int>((v + 0x1.8p23f) - 0x1.8p23f));
  }
  return amax / 127.0f;
}

/// AVX-512 twin of quantize_block_q8 (identical codes and scale); also returns the two 16-sums.
float quantize_block_q8_avx512(const float* x, int8_t* q, int16_t* s16);
/// AVX2 twin of quantize_block_q8 (identical codes and scale); also returns the two 16-sums.
float quantize_block_q8_avx2(const float* x, int8_t* q, int16_t* s16);

// Lane orders. The kernels of the 256-weight super-block types read a token's int8 codes rearranged
// within each 256-block so that every int32 lane of vpdpbusd stays in one 32-block (one
// activation scale) for the whole block: a lane's 16 products are summed in integers and
// scaled once. Position p = 64k + 4L + j of a block (chunk k = 0..3 of 64 codes, lane
// L = 0..15, byte j = 0..3) holds element q4k_ / q6k_ / iq2xs_lane_element(k, L, j); lane L
// stays in 32-block L/2.

/// Q4_K (and Q5_K): the 8 weights of sub-block s = L/2 at offset 8k..8k+7 (elements 32s + 8k + 4(L%2) + j),
/// i.e. chunk k is 64-bit word k of each 32-byte run of quants (one vpermt2q of the block).
static constexpr int q4k_lane_element(int k, int L, int j) { return 32 * (L / 2) + 8 * k + 4 * (L % 2) + j; }

/// Q6_K (and Q2_K, Q3_K, IQ3_S, IQ4_XS): the 4 weights 4k..4k+3 of 16-weight group L (elements 16L + 4k + j),
/// so lane L is group L for the whole block (Q6_K: one int8 scale, sc[L] in ggml's order; IQ3_S:
/// grid entry 4L + k in chunk k).
static constexpr int q6k_lane_element(int k, int L, int j) { return 16 * L + 4 * k + j; }

/// IQ2_XS: elements 4u..4u+3 (u = L%2) of grid entry 4s + k (s = L/2). So the 8 entries of a
/// chunk are word k of each 64-bit word of the codes, in the order a gather returns them; in
/// chunks 0-1 the lane is in 16-weight group 2s, in chunks 2-3 in group 2s+1 (the two nibbles
/// of scale byte s).
static constexpr int iq2xs_lane_element(int k, int L, int j) { return 8 * (4 * (L / 2) + k) + 4 * (L % 2) + j; }

/// Types whose q8 kernels (AVX-512 and AVX2) read the codes in a lane order.
static constexpr bool has_lane_order(GgmlType t) {
  return t == GgmlType::Q2_K || t == GgmlType::Q3_K || t == GgmlType::Q4_K || t == GgmlType::Q5_K ||
         t == GgmlType::Q6_K || t == GgmlType::IQ2_XS || t == GgmlType::IQ3_S || t == GgmlType::IQ4_XS;
}

/// Software prefetch distance of the AVX-512 and AVX2 q8 kernels, in bytes ahead of the weights being
/// decoded: the hardware prefetcher alone left matrix-vector at ~50 % of the read probe
/// (measured 8 KiB: 1 thread 95 %, 2 threads 80-90 %; 1 KiB: 65 %; none: 52 %; docs/kernels.md).
constexpr int kQ8Prefetch = 8192;

/// The 32-weight block types of the q8 path (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4), each
/// written as  w_j = fd * u_j + fc  with u_j an unsigned integer code of the block's weight j
/// (ggml-common.h block layouts; dequant_ref.cpp spells out each). The int8 kernels multiply the
/// u_j with the activation codes in integers and apply fd per 32-block; fc multiplies the
/// block's code sum (the s16 sums of ActQ8), so no per-weight offset is ever formed.
struct B32Format {
  int bytes;             ///< block size in bytes
  int qs;                ///< offset of the codes: 32 int8 (Q8_0) or 16 bytes of nibbles (element
                         ///< j < 16 in the low nibble of byte j, j >= 16 in the high one of j-16)
  int qh;                ///< offset of the uint32 whose bit j is bit 4 of element j's code, or -1
  int min;               ///< offset of the fp16 min m (fc = m), or -1 (fc = -offset * fd)
  int offset;            ///< w_j = fd * (u_j - offset) without a min (Q8_0, IQ4_NL: 128, Q4_0: 8,
                         ///< Q5_0: 16, MXFP4: 12; with a min 0). u_j is the raw code (Q4_0..Q5_1:
                         ///< nibble | fifth bit << 4), values[code] + offset (IQ4_NL, MXFP4) or
                         ///< code + 128 (Q8_0); u_j <= 255, and <= 31 unless offset is 128
  const int8_t* values;  ///< 4-bit codes index this table (IQ4_NL, MXFP4), or null
  bool e8m0;             ///< fd is the E8M0 byte at offset 0 halved (MXFP4), else fp16 at offset 0
  /// values != nullptr, as a constant expression (a comparison of an extern array's address
  /// with null is not one in every build mode: sanitizers make it a run-time check)
  bool table;
};

/// The B32Format of t; bytes == 0 for the types that are not 32-weight block types of the q8 path.
static constexpr B32Format b32_format(GgmlType t) {
  switch (t) {
    case GgmlType::Q8_0: return {34, 2, -1, -1, 128, nullptr, false, false};
    case GgmlType::Q4_0: return {18, 2, -1, -1, 8, nullptr, false, false};
    case GgmlType::Q4_1: return {20, 4, -1, 2, 0, nullptr, false, false};
    case GgmlType::Q5_0: return {22, 6, 2, -1, 16, nullptr, false, false};
    case GgmlType::Q5_1: return {24, 8, 4, 2, 0, nullptr, false, false};
    case GgmlType::IQ4_NL: return {18, 2, -1, -1, 128, tables::kvalues_iq4nl, false, true};
    case GgmlType::MXFP4: return {17, 1, -1, -1, 12, tables::kvalues_fp4, true, true};
    default: return {0, 0, -1, -1, 0, nullptr, false, false};
  }
}

/// Calls fn(std::integral_constant<GgmlType, t>{}) when t is a 32-weight block type (so that a
/// kernel template can be instantiated per type); does nothing otherwise.
template <class Fn>
static void with_b32_type(GgmlType t, Fn&& fn) {
  using G = GgmlType;
  switch (t) {
    case G::Q8_0: fn(std::integral_constant<G, G::Q8_0>{}); break;
    case G::Q4_0: fn(std::integral_constant<G, G::Q4_0>{}); break;
    case G::Q4_1: fn(std::integral_constant<G, G::Q4_1>{}); break;
    case G::Q5_0: fn(std::integral_constant<G, G::Q5_0>{}); break;
    case G::Q5_1: fn(std::integral_constant<G, G::Q5_1>{}); break;
    case G::IQ4_NL: fn(std::integral_constant<G, G::IQ4_NL>{}); break;
    case G::MXFP4: fn(std::integral_constant<G, G::MXFP4>{}); break;
    default: break;
  }
}

/// Weight types with an int8 dot product (the others keep fp32 activations in q8 mode).
static constexpr bool has_q8_kernel(GgmlType t) { return b32_format(t).bytes != 0 || has_lane_order(t); }

/// Tokens [t0, t1) of `a` rewritten for the lane-order kernels of type t (has_lane_order(t);
/// a.cols % 256 == 0), token-major:
///   xp[(t - t0) * cols + 256 i + p] = a.qt(t)[256 i + lane_element(p)]   (int8 codes)
///   dxl[(t - t0) * cols/16 + 16 i + L] = dx[8 i + L/2]                   (lane L's block scale)
///   xs[(t - t0) * cols/32 + b] = dx[b] * float(s16[2b] + s16[2b+1])     (Q4_K, Q5_K; untouched
///                                                                         for the others)
/// with dx = a.dt(t), s16 = a.st(t).
void lane_order(GgmlType t, const ActQ8& a, int64_t t0, int64_t t1, int8_t* xp, float* dxl, float* xs);

/// Tokens in a lane order: codes `cols` apart, lane scales cols/16 apart, xs cols/32 apart, and
/// the 16-sums of the codes in natural order (ActQ8::s16, cols/16 apart).
struct LaneTokens {
  const int8_t* q;
  const float* dxl;
  const float* xs;
  const int16_t* s16;
  int64_t cols;
  /// The same tokens from the t-th on.
  LaneTokens from(int64_t t) const {
    return {q + t * cols, dxl + t * (cols / 16), xs + t * (cols / 32), s16 + t * (cols / 16), cols};
  }
};

/// The codes of consecutive tokens in natural order, from the first: tokens are `cols` codes
/// apart (d: cols/32, s: cols/16 apart).
struct Tokens {
  const int8_t* q;
  const float* d;
  const int16_t* s;
  int64_t cols;
};

/// Rows [row_begin, row_end) of m against tokens [t0, t1): per row, tiles of up to MAXT (<= 4)
/// tokens (every tile size runs the same per-token instructions), fn(tile<TB>, w, t, y).
template <int MAXT = 4, class Fn>
static void rows_by_tiles(const MatmulArgs& m, int64_t t0, int64_t t1, Fn&& fn) {
  static_assert(MAXT >= 1 && MAXT <= 4);
  for (int64_t r = m.row_begin; r < m.row_end; ++r) {
    const uint8_t* w = m.W + static_cast<size_t>(r) * m.row_bytes;
    for (int64_t t = t0; t < t1; t += MAXT) {
      float* y = m.y + t * m.ldy + r;
      const int64_t n = t1 - t < MAXT ? t1 - t : MAXT;
      if constexpr (MAXT >= 4) {
        if (n == 4) {
          fn(std::integral_constant<int, 4>{}, w, t, y);
          continue;
        }
      }
      if constexpr (MAXT >= 3) {
        if (n == 3) {
          fn(std::integral_constant<int, 3>{}, w, t, y);
          continue;
        }
      }
      if constexpr (MAXT >= 2) {
        if (n == 2) {
          fn(std::integral_constant<int, 2>{}, w, t, y);
          continue;
        }
      }
      fn(std::integral_constant<int, 1>{}, w, t, y);
    }
  }
}

/// Calls fn(std::integral_constant<GgmlType, t>{}) when t is a super-block type with a lane
/// order (has_lane_order), so that a kernel template can be instantiated per type.
template <class Fn>
static void with_lane_type(GgmlType t, Fn&& fn) {
  using G = GgmlType;
  switch (t) {
    case G::Q2_K: fn(std::integral_constant<G, G::Q2_K>{}); break;
    case G::Q3_K: fn(std::integral_constant<G, G::Q3_K>{}); break;
    case G::Q4_K: fn(std::integral_constant<G, G::Q4_K>{}); break;
    case G::Q5_K: fn(std::integral_constant<G, G::Q5_K>{}); break;
    case G::Q6_K: fn(std::integral_constant<G, G::Q6_K>{}); break;
    case G::IQ2_XS: fn(std::integral_constant<G, G::IQ2_XS>{}); break;
    case G::IQ3_S: fn(std::integral_constant<G, G::IQ3_S>{}); break;
    case G::IQ4_XS: fn(std::integral_constant<G, G::IQ4_XS>{}); break;
    default: break;
  }
}

/// Tokens [t0, t1) of `a` in the lane order of type t (has_lane_order(t)): the copy kept in `a`
/// when it was quantized for t, else one rearranged now into this thread's buffers (valid until
/// the thread's next call).
LaneTokens lane_tokens(GgmlType t, const ActQ8& a, int64_t t0, int64_t t1);

// Tokens in the lanes (Q8_0, Q4_K and IQ4_XS on AVX-512; ActQ8::tok16, the layout in kernels.h).
// The GEMM keeps Q8_0 weights in GGUF row order (Q4_K and IQ4_XS: unpacked per 4-row tile into
// signed bytes, 32 per block) and puts 16 tokens in the 16 int32 lanes of vpdpbusd: run j of a
// (group, block) holds every token's codes 4j..4j+3 plus 128 (unsigned), and the weight codes
// 4j..4j+3 of (row, block) are one 4-byte broadcast, so 8 vpdpbusd give per token
// S' = sum (qx + 128) qw and S_b = S' - 128 sum qw (exact). The float part is the serial
// definition of matmul_q8_scalar_avx512 (for Q8_0 the CUDA q8 one).

/// The weight types of the AVX-512 tokens-in-the-lanes kernels, which have their own serial
/// definition (matmul_q8_scalar_avx512).
static constexpr bool has_tok16(GgmlType t) {
  return t == GgmlType::Q8_0 || t == GgmlType::Q4_K || t == GgmlType::IQ4_XS;
}

/// xs of a 32-block of one token, as every Q4_K path of the AVX-512 family forms it:
/// dx * float(s0 + s1) (s0, s1: the block's two 16-sums), one fp32 product rounded on its own.
static inline float token_xs(float dx, int16_t s0, int16_t s1) {
  float xs = dx * static_cast<float>(s0 + s1);
  __asm__("" : "+x"(xs));  // rounded here, never contracted into a later FMA
  return xs;
}

/// Writes tokens [t0, t1) of `a` in the token-lane layout of ActQ8::xg / dxg / xsg into xg / dxg
/// and, when xsg is not null, xsg (buffers laid out as those for all of a.n_tok: token t at group
/// t/16, lane t%16); when t1 == a.n_tok also the padding lanes of the last group (code 0, scale 0,
/// xs 0). Thread-safe for disjoint token ranges.
void token_lanes(const ActQ8& a, int64_t t0, int64_t t1, uint8_t* xg, float* dxg, float* xsg);

/// Up to this many tokens the AVX-512 Q8_0, Q4_K and IQ4_XS paths take the mat-vec (16 rows per register,
/// natural code order), from kQ8_0MatVecMax + 1 the tokens-in-the-lanes GEMM; same bits either way.
inline constexpr int64_t kQ8_0MatVecMax = 4;

/// The tokens of `a` with the tokens in the lanes: xg/dxg/xsg as in ActQ8 (xs null when not
/// asked for), `groups` groups of 16.
struct TokenLanes {
  const uint8_t* x;
  const float* dx;
  const float* xs;
  int64_t groups;
};
/// All tokens of `a` in the token-lane layout (with xsg when with_xs): a's own copy when it was
/// kept (a.tok16, and a.tok16_xs if with_xs), else one made now into this thread's buffers (valid
/// until the thread's next call).
TokenLanes token_lanes_of(const ActQ8& a, bool with_xs);

/// The AVX-512 Q8_0, Q4_K and IQ4_XS GEMMs and mat-vecs (matmul_q8_0_avx512.cpp), tokens in the lanes:
/// y[t][r] for rows [row_begin, row_end) and all a.n_tok tokens with the bits of
/// matmul_q8_scalar_avx512 (m.type: has_tok16). VNNI: vpdpbusd; otherwise the same integers from
/// vpmaddwd on 16-bit halves.
void matmul_tok16_avx512(const MatmulArgs& m, const ActQ8& a, bool vnni);

/// Tokens per block of the q8 SIMD driver: their codes stay in L2 while every row passes.
inline constexpr int64_t kQ8TokBlock = 64;

/// The row/token driver of the SIMD q8 families (AVX2 and AVX-512), written once: tokens in
/// blocks of kQ8TokBlock; per block the super-block types read the codes in their lane order
/// (lane_tokens: kept in `a` when it was quantized for m.type, else rearranged here, once per
/// block), the 32-weight block types in natural order; rows are tiled by rows_by_tiles<MAXT>.
/// The family K supplies, per type T (a compile-time constant) and tile of TB tokens:
///   k.template lane_row<T, TB>(w, tk, y, ldy)        one row of a lane-order type, tokens tk
///   k.template b32_row<T, TB>(w, tokens, i, y, ldy)  one row of a 32-weight type; i: the tile's
///                                                    first token within the block
///   k.lane_block(m, t0, t1, tk) -> bool              true if the family did the whole block
///                                                    itself (rows and tokens; e.g. IQ2_XS on AVX-512)
///   k.b32_block(m, a, t0, t1)                        per-block preparation of the 32-weight types
/// Returns false (doing nothing) for types without an int8 kernel.
template <int MAXT, class K>
static bool run_q8_blocks(const MatmulArgs& m, const ActQ8& a, K& k) {
  if (!has_q8_kernel(m.type)) return false;
  for (int64_t t0 = 0; t0 < m.n_tok; t0 += kQ8TokBlock) {
    const int64_t t1 = m.n_tok < t0 + kQ8TokBlock ? m.n_tok : t0 + kQ8TokBlock;
    if (has_lane_order(m.type)) {
      const LaneTokens tk = lane_tokens(m.type, a, t0, t1);
      if (k.lane_block(m, t0, t1, tk)) continue;
      with_lane_type(m.type, [&](auto type) {
        rows_by_tiles<MAXT>(m, t0, t1, [&](auto tb, const uint8_t* w, int64_t t, float* y) {
          k.template lane_row<decltype(type)::value, decltype(tb)::value>(w, tk.from(t - t0), y, m.ldy);
        });
      });
      continue;
    }
    k.b32_block(m, a, t0, t1);
    with_b32_type(m.type, [&](auto type) {
      rows_by_tiles<MAXT>(m, t0, t1, [&](auto tb, const uint8_t* w, int64_t t, float* y) {
        k.template b32_row<decltype(type)::value, decltype(tb)::value>(w, Tokens{a.qt(t), a.dt(t), a.st(t), a.cols},
                                                                       t - t0, y, m.ldy);
      });
    });
  }
  return true;
}

/// Scalar q8 family (the definition of the arithmetic): y[t][r] for rows [row_begin, row_end).
void matmul_q8_scalar(const MatmulArgs& m, const ActQ8& a);

/// The definition of the AVX-512 q8 family: matmul_q8_scalar for every type but Q8_0, Q4_K and
/// IQ4_XS (has_tok16). Q8_0's arithmetic is the serial one of the CUDA q8 path (src/backend/cuda/kernels.h,
/// matmul_q8): per (row, token) acc = 0, then for each 32-block b in column order
///     S_b = sum_k qw_k * qx_k                   (exact int32, |S_b| <= 32 * 128 * 127 < 2^24)
///     acc = fma(float(S_b), dw_b * dx_b, acc)    (the product rounded to fp32 on its own)
/// with dw_b the block's fp16 scale and dx_b the activation's; y = acc. Q4_K's is serial in the
/// same way, per 32-block b = sub-block s of super-block i (scale sc_s, min m_s, codes q 0..15):
///     S_b = sum_k q_k * qx_k                              (exact int32)
///     acc = fma(float(S_b), (d * sc_s) * dx_b, acc)       (each product rounded)
///     acc = fma(-(dmin * m_s), token_xs(dx_b, s16), acc)   (the min times the block's code sum)
/// and IQ4_XS's, per 32-block b = group g of super-block i (kv = kvalues_iq4nl of the codes):
///     S_b = sum_k kv_k * qx_k                             (exact int32)
///     acc = fma(float(S_b), (d * (ls_g - 32)) * dx_b, acc) (each product rounded)
/// (these CPU definitions are not the CUDA ones for Q4_K and IQ4_XS).
void matmul_q8_scalar_avx512(const MatmulArgs& m, const ActQ8& a);

/// The definition of the AVX2 q8 family: matmul_q8_scalar for every type but Q8_0, whose
/// arithmetic is the serial one of matmul_q8_scalar_avx512 (dot_q8_0_serial: per (row, token)
/// S_b exact, acc = fma(float(S_b), dw_b * dx_b, acc) block after block), so the AVX2 and AVX-512
/// families give the same Q8_0 bits.
void matmul_q8_scalar_avx2(const MatmulArgs& m, const ActQ8& a);

/// AVX2 q8 family (+ FMA, F16C, BMI2; the CPU must have them): y[t][r] with the bits of
/// matmul_q8_scalar_avx2. Returns false for types without a kernel (!has_q8_kernel).
bool matmul_q8_avx2(const MatmulArgs& m, const ActQ8& a);

/// The AVX2 Q8_0 kernels with the bits of the serial definition (matmul_q8_scalar_avx2 /
/// matmul_q8_scalar_avx512; matmul_q8_0_avx2.cpp): y[t][r] for rows [row_begin, row_end) and all
/// a.n_tok tokens (m.type must be Q8_0). More than kQ8_0MatVecMax tokens: the tokens-in-the-lanes
/// GEMM (ActQ8::xg / dxg as two ymm halves of 8 tokens, made by the kernel when `a` has none);
/// fewer: the mat-vec, 8 rows per register, natural code order.
void matmul_q8_0_avx2(const MatmulArgs& m, const ActQ8& a);

/// True where the AVX2 family's Q8_0 GEMM runs on AVX-VNNI (gemm_q8_0_avxvnni): the CPU reports
/// AVX-VNNI (CPUID.(7,1):EAX bit 4) and avx_vnni_enabled(). Thread-safe.
bool avx_vnni_usable();
/// Whether AVX-VNNI may be used: true unless the environment variable STRATA_CPU_AVXVNNI is "0"
/// (read on first use; for side-by-side measurements), or set_avx_vnni_enabled changed it.
bool avx_vnni_enabled();
/// Sets avx_vnni_enabled() for later calls (tests compare the two kernels). Thread-safe.
void set_avx_vnni_enabled(bool on);
/// The AVX2 family's Q8_0 GEMM (more than kQ8_0MatVecMax tokens) on AVX-VNNI, with
/// matmul_q8_0_avx2's bits (matmul_q8_0_avxvnni.cpp): y[t][r] for rows [row_begin, row_end) and
/// all a.n_tok tokens. The CPU must have AVX-VNNI (avx_vnni_usable).
void gemm_q8_0_avxvnni(const MatmulArgs& m, const ActQ8& a);
/// The AVX2 family's Q4_K (fifth = false) / Q5_K (true) prefill tile on AVX-VNNI: nt (1-4) tokens
/// of tk against the row at w, y[t * ldy], with the bits of matmul_q8_avx2.cpp's tile_q4_k
/// (q4_k_lanes_tile.h). The CPU must have AVX-VNNI (avx_vnni_usable).
void tile_q4_k_avxvnni(int nt, bool fifth, const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy);

/// Instruction-set levels of the AVX-512 q8 family. All give the same bits.
enum class Q8Isa {
  Avx512,      ///< F/BW/VL/DQ: vpmaddubsw + vpmaddwd
  Avx512Vnni,  ///< + VNNI: vpdpbusd, vpdpwssd
  Avx512Icl,   ///< + VBMI and GFNI (Ice Lake and later): IQ2_XS signs with gf2p8affineqb and vpermb
  Avx512Amx,  ///< + AMX-TILE/AMX-INT8, tile data permitted (Sapphire Rapids and later): Q8_0/Q4_K/IQ4_XS GEMMs on tiles
};
/// The best level this CPU has (only meaningful where AVX-512 F/BW/VL/DQ exist). Avx512Amx only
/// where amx_int8_usable() and the environment variable STRATA_CPU_AMX is not "0" (the switch
/// for side-by-side measurements; the bits are the same either way).
Q8Isa best_q8_isa();
/// True if this CPU has AMX-TILE and AMX-INT8 (CPUID.(7,0):EDX bits 24, 25), the OS enables the
/// tile state (XCR0 bits 17, 18) and the kernel grants this process the tile data permission
/// (Linux: arch_prctl(ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18), requested on the
/// first call, then confirmed with ARCH_GET_XCOMP_PERM). False elsewhere (the AVX-512 kernels
/// run instead). Thread-safe; the answer is computed once per process.
bool amx_int8_usable();
/// The AMX GEMMs of Q8_0, Q4_K and IQ4_XS (matmul_tok16_amx.cpp; the CPU must pass
/// amx_int8_usable()): y[t][r] for rows [row_begin, row_end) and all a.n_tok tokens (m.type:
/// has_tok16, m.n_tok > kQ8_0MatVecMax) with the bits of matmul_q8_scalar_avx512 and of
/// matmul_tok16_avx512. Per 16 rows x 16 tokens and 32-block one TDPBSSD (A: the 16 rows' 32
/// signed codes of the block, 16 x 32 bytes (Q4_K: codes 0..15, IQ4_XS: kvalues_iq4nl, unpacked
/// as for matmul_tok16_avx512); B: the 16 tokens' codes in ActQ8::xg's run order minus 128, 8 x 64
/// bytes) gives the exact block sums S_b; AVX-512 folds them per (row, token) in block order
/// (Q4_K with its second FMA, the min times ActQ8::xsg). Uses this thread's tile configuration
/// and releases it (tilerelease) before returning. Throws std::runtime_error for another type.
void matmul_tok16_amx(const MatmulArgs& m, const ActQ8& a);
/// AVX-512 q8 family at level `isa` (which the CPU must have): the bits of
/// matmul_q8_scalar_avx512. Returns false for types without a kernel.
bool matmul_q8_avx512(const MatmulArgs& m, const ActQ8& a, Q8Isa isa);
/// The IQ2_XS rows of the Icl level (matmul_q8_iq2xs_avx512icl.cpp): rows [r0, r1) of W (rows
/// `row_bytes` apart) against tokens 0..n_tok-1 of `tk`, writing y[t * ldy + r] with the bits of
/// matmul_q8_scalar.
void iq2xs_rows_icl(const uint8_t* W, size_t row_bytes, int64_t r0, int64_t r1, int64_t n_tok, const LaneTokens& tk,
                    float* y, int64_t ldy);

}  // namespace strata::cpu::kernels::detail
