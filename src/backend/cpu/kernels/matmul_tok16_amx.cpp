// The AMX int8 GEMMs of the AVX-512 q8 family for Q8_0, Q4_K and IQ4_XS weights (issue 18;
// docs/kernels.md "AMX tiles"): the tile unit gives the exact int32 block sums, AVX-512 folds them
// in the serial order of matmul_q8_scalar_avx512, so the bits are those of the tokens-in-the-lanes
// GEMMs (matmul_q8_0_avx512.cpp) and of the scalar definitions.
//
// One TDPBSSD (Intel SDM vol. 2, "TDPBSSD/TDPBSUD/TDPBUSD/TDPBUUD"; intrinsic _tile_dpbssd) with
// K = 32 bytes is one Q8_0 block for a 16 x 16 tile of (weight rows, tokens):
//   C[m][n] = sum_{k < 8} sum_{i < 4} A[m][4k + i] * B[k][4n + i]      (signed x signed bytes)
// A: 16 weight rows x 32 bytes, the block's codes (per 16-row tile copied (Q8_0) or unpacked
// (Q4_K: codes 0..15; IQ4_XS: kvalues_iq4nl; tok16_unpack.h) into a block-major buffer, 512 bytes
// per block); B: 8 rows x 64 bytes, run k of the token-lane layout (ActQ8::xg:
// per token n its codes 4k..4k+3 plus 128) minus 128, copied per block of token groups, so
// C[m][n] = S_b of (row m, token n) exactly (|S_b| <= 32 * 128 * 128 < 2^24). The tile is stored
// (1 KiB) and each of its 16 rows (one weight row, 16 tokens in the lanes) folded:
//   acc_m = fma(float(C_m), dw_m * dx, acc_m)    (dw_m * dx rounded on its own)
//   Q4_K only: acc_m = fma(gm_m, xs, acc_m)       (gm = -(dmin * m_s), xs: ActQ8::xsg)
// block after block, which is the definition's sequence per (row, token) (dw: Q8_0's fp16 scale,
// Q4_K's d * sc_s, IQ4_XS's d * (ls - 32), each rounded once).
//
// Loop order: blocks of token groups whose codes fit ~512 KiB (L2; copied to signed bytes), then
// 16-row tiles (codes copied block-major, scales made once per call), then the groups, one 16 x
// 16 tile at a time with its 16 fp32 accumulators in zmm registers; inside, block k + 3 is
// multiplied while block k is stored and block k - 1 folded (4 C tiles in rotation).
//
// Compiled with AMX-TILE and AMX-INT8 and only reached where CPUID reports them and the kernel
// granted the tile data permission (amx_int8_usable, matmul_q8_avx512.cpp).
#include "backend/cpu/kernels/simd_intrin.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "backend/cpu/kernels/act_q8.h"
#include "backend/cpu/kernels/tok16_unpack.h"

namespace strata::cpu::kernels::detail {

namespace {

constexpr int64_t kXBytes = int64_t{512} << 10;  // token codes per block of groups (L2)

/// The palette-1 tile configuration (Intel SDM vol. 1, "Tile configuration", 64 bytes):
/// tmm0..tmm3: C, 16 rows x 64 bytes (16 int32 per row: the tokens); tmm4, tmm5: A, 16 rows x
/// 32 bytes (one block of 16 weight rows); tmm6, tmm7: B, 8 rows x 64 bytes (one block of 16
/// tokens in the VNNI layout). Block k multiplies into C tile k % 4 from A tile 4 + k % 2 and B
/// tile 6 + k % 2, three blocks ahead of the fold, so the tile unit's latency and the store of C
/// stay off the fold's path.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 32, 32, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 8, 8};
};
static_assert(sizeof(TileConfig) == 64);

/// Folds one stored C tile (c: 16 rows of 16 int32 S_b, row m = weight row m, lane n = token n)
/// of block b into acc: acc[m] = fma(float(c[m]), dw[m] * dx, acc[m]), and with MIN (Q4_K) then
/// acc[m] = fma(gm[m], xs, acc[m]) (xs: the 16 tokens' scaled code sums of the block).
template <bool MIN>
inline void fold(__m512 (&acc)[16], const int32_t* c, const float* dw, const float* gm, __m512 dx, __m512 xs) {
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m) {
    const __m512 f = _mm512_mul_ps(_mm512_set1_ps(dw[m]), dx);  // dw_b * dx_b, rounded
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * m)), f, acc[m]);
    if constexpr (MIN) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(gm[m]), xs, acc[m]);
  }
}

// Block j's product into C tile j % 4 (the tile numbers of the AMX intrinsics are immediates).
#define STRATA_AMX_ISSUE(CT, AT, BT, j) \
  do {                                  \
    _tile_loadd(AT, A + ab * (j), lda); \
    _tile_loadd(BT, B + 512 * (j), 64); \
    _tile_zero(CT);                     \
    _tile_dpbssd(CT, AT, BT);           \
  } while (0)
#define STRATA_AMX_ISSUE_MOD4(j)                    \
  do {                                              \
    switch ((j)&3) {                                \
      case 0: STRATA_AMX_ISSUE(0, 4, 6, j); break;  \
      case 1: STRATA_AMX_ISSUE(1, 5, 7, j); break;  \
      case 2: STRATA_AMX_ISSUE(2, 4, 6, j); break;  \
      default: STRATA_AMX_ISSUE(3, 5, 7, j); break; \
    }                                               \
  } while (0)

/// 16 weight rows x 16 tokens (one group) over nb blocks. A: the first row's codes of block 0
/// (row m at A + m * lda, block b at + ab * b); B: the group's runs (512 bytes per block);
/// dx: the group's scales (16 per block); dwt: per block the 16 rows' dw; with MIN also xs (the
/// group's scaled code sums, 16 per block) and gmt (per block the 16 rows' -(dmin * m)). Writes
/// out[m][n] = the outputs of row m for token n.
template <bool MIN>
void tile16(const uint8_t* A, int64_t lda, int64_t ab, const uint8_t* B, const float* dx, const float* xs,
            const float* dwt, const float* gmt, int64_t nb, float (*out)[16]) {
  const auto fold_block = [&](__m512(&acc)[16], const int32_t* c, int64_t b) {
    fold<MIN>(acc, c, dwt + 16 * b, MIN ? gmt + 16 * b : nullptr, _mm512_loadu_ps(dx + 16 * b),
              MIN ? _mm512_loadu_ps(xs + 16 * b) : _mm512_setzero_ps());
  };
  __m512 acc[16];
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
  alignas(64) int32_t c[2][256];
  // step k: block k + 3 into the tile unit, C of block k stored, block k - 1 folded
  for (int64_t j = 0; j < 3 && j < nb; ++j) STRATA_AMX_ISSUE_MOD4(j);
  for (int64_t k = 0; k < nb; k += 4) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) {
      const int64_t b = k + u;
      if (b >= nb) break;
      if (b + 3 < nb) {
        // (u is a constant after unrolling, so is (b + 3) % 4 = (u + 3) % 4 because k % 4 == 0)
        switch ((u + 3) & 3) {
          case 0: STRATA_AMX_ISSUE(0, 4, 6, b + 3); break;
          case 1: STRATA_AMX_ISSUE(1, 5, 7, b + 3); break;
          case 2: STRATA_AMX_ISSUE(2, 4, 6, b + 3); break;
          default: STRATA_AMX_ISSUE(3, 5, 7, b + 3); break;
        }
      }
      switch (u) {
        case 0: _tile_stored(0, c[0], 64); break;
        case 1: _tile_stored(1, c[1], 64); break;
        case 2: _tile_stored(2, c[0], 64); break;
        default: _tile_stored(3, c[1], 64); break;
      }
      if (b > 0) fold_block(acc, c[(u + 1) & 1], b - 1);
    }
  }
  fold_block(acc, c[(nb - 1) & 1], nb - 1);
#pragma GCC unroll 16
  for (int m = 0; m < 16; ++m) _mm512_store_ps(out[m], acc[m]);
}
#undef STRATA_AMX_ISSUE_MOD4
#undef STRATA_AMX_ISSUE

template <GgmlType T>
void gemm(const MatmulArgs& m, const ActQ8& a) {
  constexpr bool Q4K = T == GgmlType::Q4_K, SB = T != GgmlType::Q8_0;  // SB: a 256-weight super-block type
  const TokenLanes tl = token_lanes_of(a, Q4K);
  const int64_t nb = m.cols / 32, tiles = (m.row_end - m.row_begin + 15) / 16;
  // per 16-row tile and block the rows' dw (and Q4_K's gm; Q8_0's made on the first block of
  // groups and reused by the others); the current tile's codes (wt, A of TDPBSSD: Q8_0's copied,
  // the others' unpacked); the block of groups' codes as signed bytes (xg - 128: B of TDPBSSD)
  thread_local std::vector<float> dwt, gmt;
  thread_local std::vector<uint8_t> xs, wtile;
  dwt.resize(static_cast<size_t>(tiles * 16 * nb));
  if (Q4K) gmt.resize(static_cast<size_t>(tiles * 16 * nb));
  const int64_t ld = nb * 32 + 64;  // bytes between the tile's rows
  wtile.resize(static_cast<size_t>(16 * ld + 64));
  uint8_t* wt = wtile.data() + (64 - reinterpret_cast<uintptr_t>(wtile.data()) % 64) % 64;
  const int64_t per_group = nb * (512 + (Q4K ? 128 : 64));
  const int64_t fit = std::max<int64_t>(1, kXBytes / per_group);
  xs.resize(static_cast<size_t>(std::min(fit, tl.groups) * nb * 512));
  const TileConfig cfg;
  _tile_loadconfig(&cfg);
  alignas(64) float out[16][16];
  for (int64_t g0 = 0; g0 < tl.groups; g0 += fit) {
    const int64_t g1 = std::min(tl.groups, g0 + fit);
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t i = 0; i < (g1 - g0) * nb * 512; i += 64)
      _mm512_storeu_si512(xs.data() + i, _mm512_xor_si512(_mm512_loadu_si512(tl.x + g0 * nb * 512 + i), bias));
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t r0 = m.row_begin + 16 * i;
      const int R = static_cast<int>(std::min<int64_t>(16, m.row_end - r0));
      const uint8_t* w = m.W + static_cast<size_t>(r0) * m.row_bytes;
      float* dw = dwt.data() + i * 16 * nb;
      float* gm = Q4K ? gmt.data() + i * 16 * nb : nullptr;
      // the tile's codes row-major, 32 bytes per block, rows ld bytes apart (rows >= R zero):
      // written sequentially, read by the tile loads at stride ld (ld is not a multiple of 4 KiB,
      // so the 16 rows do not share one L1 set). A strided tile load straight from the GGUF rows
      // (34-byte blocks, half of them across a cache line) was slower, and so was a block-major
      // copy (its partial-line stores at a 512-byte stride).
      for (int r = 0; r < 16; ++r) {
        const uint8_t* row = w + static_cast<size_t>(r) * m.row_bytes;
        uint8_t* dst = wt + r * ld;
        if (r >= R) {
          std::memset(dst, 0, static_cast<size_t>(nb * 32));
          for (int64_t b = 0; b < nb; ++b) {
            dw[16 * b + r] = 0.0f;
            if (Q4K) gm[16 * b + r] = 0.0f;
          }
        } else if constexpr (Q4K) {
          unpack_q4_k_row(row, nb / 8, dst, 32, dw + r, gm + r, 16, nullptr);
        } else if constexpr (SB) {
          unpack_iq4_xs_row(row, nb / 8, dst, 32, dw + r, 16, nullptr);
        } else {
          for (int64_t b = 0; b < nb; ++b) {
            _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 32 * b),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 34 * b + 2)));
            if (g0 == 0) dw[16 * b + r] = _cvtsh_ss(load_u16(row + 34 * b));
          }
        }
      }
      // the tile loads are asm without a memory operand: the tables and copies must be in memory
      // before them
      __asm__ volatile("" ::: "memory");
      for (int64_t g = g0; g < g1; ++g) {
        tile16<Q4K>(wt, ld, 32, xs.data() + (g - g0) * nb * 512, tl.dx + g * nb * 16,
                    Q4K ? tl.xs + g * nb * 16 : nullptr, dw, gm, nb, out);
        const int64_t n = std::min<int64_t>(16, m.n_tok - 16 * g);
        float* y = m.y + 16 * g * m.ldy + r0;
        for (int64_t t = 0; t < n; ++t)
          for (int r = 0; r < R; ++r) y[t * m.ldy + r] = out[r][t];
      }
    }
  }
  _tile_release();
}

}  // namespace

void matmul_tok16_amx(const MatmulArgs& m, const ActQ8& a) {
  switch (m.type) {
    case GgmlType::Q8_0: gemm<GgmlType::Q8_0>(m, a); break;
    case GgmlType::Q4_K: gemm<GgmlType::Q4_K>(m, a); break;
    case GgmlType::IQ4_XS: gemm<GgmlType::IQ4_XS>(m, a); break;
    default: throw std::runtime_error("cpu::kernels: no AMX kernel for this type");
  }
}

}  // namespace strata::cpu::kernels::detail
