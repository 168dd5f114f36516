#pragma once
// The loop nest shared by the AVX2 family's two Q8_0 GEMMs with the tokens in the lanes
// (matmul_q8_0_avx2.cpp: the sign trick; matmul_q8_0_avxvnni.cpp: vpdpbusd), which differ only in
// how a register tile forms S_b and in what they prepare per row tile and per block of groups.
// Everything here is in an anonymous namespace on purpose: each including file is compiled with
// its own instruction set (-mavx2 or -mavxvnni), so each must get its own copy of these templates
// (a shared inline definition could be linked from the wider-ISA file into the other's callers).
#include "backend/cpu/kernels/simd_intrin.h"

#include <algorithm>
#include <cstdint>

#include "backend/cpu/kernels/act_q8.h"

namespace strata::cpu::kernels::detail {
namespace {

/// Rows per register tile (x 2 halves of 8 tokens) of both kernels.
constexpr int kQ8_0LaneRows = 2;
/// Bytes of token codes per block of groups, sized for L2 (512 bytes per group and block).
constexpr int64_t kQ8_0LaneXBytes = int64_t{256} << 10;

/// Stores acc[r][h] (8 tokens of half h, row r) to y[(8 h + l) * ldy + r] for tokens 8h + l < valid.
template <int R, int H>
inline void store_lane_tile(__m256 (&acc)[R][H], int64_t valid, float* y, int64_t ldy) {
#pragma GCC unroll 2
  for (int h = 0; h < H; ++h) {
    const int64_t n = std::min<int64_t>(8, valid - 8 * h);
    if (n <= 0) break;
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      alignas(32) float o[8];
      _mm256_store_ps(o, acc[r][h]);
      for (int64_t l = 0; l < n; ++l) y[(8 * h + l) * ldy + r] = o[l];
    }
  }
}

/// The GEMM's loop nest over m's rows and a's token groups (token_lanes_of(a)): blocks of groups
/// of at most kQ8_0LaneXBytes codes, within each row tiles of kQ8_0LaneRows rows, within each the
/// groups. K supplies:
///   const void* groups(const uint8_t* x, int64_t bytes): the block's codes as the tiles read them
///     (x: ActQ8's unsigned codes of the block's first group);
///   void rows(const uint8_t* row, int r, int64_t nb): prepares row r of the tile (GGUF row bytes);
///   template <int R, int H> void tile(const uint8_t* const* w, int64_t nb, const void* x,
///     const float* dx, int64_t valid, float* y, int64_t ldy): one group (w[r]: row r's first code).
template <class K>
void q8_0_lanes_gemm(const MatmulArgs& m, const ActQ8& a, K& k) {
  const TokenLanes tl = token_lanes_of(a, false);
  const int64_t nb = m.cols / 32;
  const int64_t per_group = nb * 512;
  const int64_t fit = std::max<int64_t>(1, kQ8_0LaneXBytes / per_group);
  for (int64_t g0 = 0; g0 < tl.groups; g0 += fit) {
    const int64_t g1 = std::min(tl.groups, g0 + fit);
    const auto* xs = static_cast<const uint8_t*>(k.groups(tl.x + g0 * per_group, (g1 - g0) * per_group));
    for (int64_t r0 = m.row_begin; r0 < m.row_end; r0 += kQ8_0LaneRows) {
      const int R = static_cast<int>(std::min<int64_t>(kQ8_0LaneRows, m.row_end - r0));
      const uint8_t* w[kQ8_0LaneRows];
      for (int r = 0; r < R; ++r) {
        const uint8_t* row = m.W + static_cast<size_t>(r0 + r) * m.row_bytes;
        w[r] = row + 2;
        k.rows(row, r, nb);
      }
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t valid = m.n_tok - 16 * g;
        const uint8_t* x = xs + (g - g0) * per_group;
        const float* dx = tl.dx + g * nb * 16;
        float* y = m.y + 16 * g * m.ldy + r0;
        if (R == 2 && valid > 8) {
          k.template tile<2, 2>(w, nb, x, dx, valid, y, m.ldy);
        } else if (R == 2) {
          k.template tile<2, 1>(w, nb, x, dx, valid, y, m.ldy);
        } else if (valid > 8) {
          k.template tile<1, 2>(w, nb, x, dx, valid, y, m.ldy);
        } else {
          k.template tile<1, 1>(w, nb, x, dx, valid, y, m.ldy);
        }
      }
    }
  }
}

}  // namespace
}  // namespace strata::cpu::kernels::detail
