// The AVX2 family's Q8_0 GEMM on AVX-VNNI: vpdpbusd on ymm registers (VEX encoding), which CPUs
// without AVX-512 have from Alder Lake on (and Sierra Forest, Arrow Lake, Lunar Lake). The same
// serial definition and the same tile order as matmul_q8_0_avx2.cpp's gemm (per (row, token)
// acc = 0, then for each 32-block b in column order acc = fma(float(S_b), dw_b * dx_b, acc)), so
// its bits are the AVX2 family's; only S_b, an exact int32 sum, is formed differently.
//
// The activations stay in ActQ8's token-lane layout with their +128 (unsigned codes u = qx + 128,
// ActQ8::xg): for row r, block b, run j the row's 4 signed codes 4j..4j+3 are one broadcast w and
// per token lane vpdpbusd(s, u, w) adds sum_k u_k * w_k = sum_k qx_k * qw_k + 128 * sum_k qw_k
// (products of u8 and s8 summed in 32 bits: no int16 step, so nothing saturates). After the 8
// runs, S_b = s - 128 * sum(qw over the block), the row's block sum taken once per tile (the sum
// starts at -128 * sum(qw)). Where the
// sign trick of the AVX2 kernel costs four instructions per 8 tokens and run (vpsignb,
// vpmaddubsw, vpmaddwd, vpaddd) and a signed copy of the activations, this costs one.
//
// Register tile: 2 rows x 2 halves of 8 tokens; each (row, half) sum runs as two chains (even and
// odd runs) so that vpdpbusd's latency does not serialize the 8 runs of a block.
#include "backend/cpu/kernels/simd_intrin.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend/cpu/kernels/act_q8.h"
#include "backend/cpu/kernels/q4_k_lanes_tile.h"
#include "backend/cpu/kernels/q8_0_lanes_gemm.h"

namespace strata::cpu::kernels::detail {

namespace {

inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

/// R rows x H halves (8 tokens each) of one group over all nb blocks. w[r]: row r's first code
/// (blocks 34 bytes apart, GGUF order); bias: 128 * the sum of row r's codes of block b at
/// r * nb + b; dw: fp32 scales, row r at r * nb; x: the group's unsigned runs (block b at b * 512,
/// run j at + 64 j, half h at + 32 h); dx: the group's scales (block b at 16 b, half h at + 8 h).
/// Writes y[(8 h + l) * ldy + r] for tokens 8h + l < valid.
template <int R, int H>
void tile(const uint8_t* const* w, const int32_t* bias, const float* dw, int64_t nb, const uint8_t* x, const float* dx,
          int64_t valid, float* y, int64_t ldy) {
  __m256 acc[R][H];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s0[R][H], s1[R][H];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        s0[r][h] = _mm256_set1_epi32(-bias[r * nb + b]);  // the +128's share, taken off up front
        s1[r][h] = _mm256_setzero_si256();
      }
    const uint8_t* xb = x + b * 512;
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        const __m256i x0 = load256(xb + 64 * j + 32 * h), x1 = load256(xb + 64 * (j + 1) + 32 * h);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i w0 = _mm256_set1_epi32(static_cast<int>(load_u32(w[r] + 34 * b + 4 * j)));
          const __m256i w1 = _mm256_set1_epi32(static_cast<int>(load_u32(w[r] + 34 * b + 4 * j + 4)));
          s0[r][h] = _mm256_dpbusd_avx_epi32(s0[r][h], x0, w0);
          s1[r][h] = _mm256_dpbusd_avx_epi32(s1[r][h], x1, w1);
        }
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {
      const __m256 d = _mm256_loadu_ps(dx + 16 * b + 8 * h);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i S = _mm256_add_epi32(s0[r][h], s1[r][h]);
        const __m256 f = _mm256_mul_ps(_mm256_broadcast_ss(dw + r * nb + b), d);  // dw_b * dx_b, rounded
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), f, acc[r][h]);
      }
    }
  }
  store_lane_tile<R, H>(acc, valid, y, ldy);
}

/// 128 * the sum of the 32 signed codes at p (exact).
inline int32_t code_sum_x128(const uint8_t* p) {
  const __m256i s = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), load256(p));
  __m128i q = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  q = _mm_add_epi32(q, _mm_unpackhi_epi64(q, q));
  q = _mm_add_epi32(q, _mm_shuffle_epi32(q, 1));
  return 128 * _mm_cvtsi128_si32(q);
}

// The AVX-VNNI kernel's parts of q8_0_lanes_gemm: the codes are read as they are (no copy); per
// row tile the fp32 scales and each block's 128 * sum of codes.
struct VnniTiles {
  std::vector<int32_t>& bias;
  std::vector<float>& dw;
  const void* groups(const uint8_t* src, int64_t) { return src; }
  void rows(const uint8_t* row, int r, int64_t nb) {
    for (int64_t b = 0; b < nb; ++b) {
      dw[static_cast<size_t>(r * nb + b)] = _cvtsh_ss(load_u16(row + 34 * b));
      bias[static_cast<size_t>(r * nb + b)] = code_sum_x128(row + 34 * b + 2);
    }
  }
  template <int R, int H>
  void tile(const uint8_t* const* w, int64_t nb, const void* x, const float* dx, int64_t valid, float* y, int64_t ldy) {
    detail::tile<R, H>(w, bias.data(), dw.data(), nb, static_cast<const uint8_t*>(x), dx, valid, y, ldy);
  }
};

}  // namespace

void gemm_q8_0_avxvnni(const MatmulArgs& m, const ActQ8& a) {
  thread_local std::vector<int32_t> bias;
  thread_local std::vector<float> dw;
  const int64_t nb = m.cols / 32;
  bias.resize(static_cast<size_t>(kQ8_0LaneRows * nb));
  dw.resize(static_cast<size_t>(kQ8_0LaneRows * nb));
  VnniTiles k{bias, dw};
  q8_0_lanes_gemm(m, a, k);
}

void tile_q4_k_avxvnni(int nt, bool fifth, const uint8_t* w, const LaneTokens& tk, float* y, int64_t ldy) {
  switch (nt * 2 + (fifth ? 1 : 0)) {
    case 2: tile_q4_k<1, false, true>(w, tk, y, ldy); return;
    case 3: tile_q4_k<1, true, true>(w, tk, y, ldy); return;
    case 4: tile_q4_k<2, false, true>(w, tk, y, ldy); return;
    case 5: tile_q4_k<2, true, true>(w, tk, y, ldy); return;
    case 6: tile_q4_k<3, false, true>(w, tk, y, ldy); return;
    case 7: tile_q4_k<3, true, true>(w, tk, y, ldy); return;
    case 8: tile_q4_k<4, false, true>(w, tk, y, ldy); return;
    case 9: tile_q4_k<4, true, true>(w, tk, y, ldy); return;
    default: break;
  }
}

}  // namespace strata::cpu::kernels::detail
