// The AVX-512 Q8_0, Q4_K and IQ4_XS GEMMs with the tokens in the lanes (act_q8.h "Tokens in the lanes";
// the layout is ActQ8::xg / dxg / xsg, kernels.h), and their mat-vecs for decode. Q8_0: no
// weight repack: the rows stay in GGUF order, and the 4 weight codes 4j..4j+3 of (row r, block b)
// are one embedded broadcast, multiplied by run j of a group of 16 tokens (their codes 4j..4j+3
// plus 128, unsigned). After the 8 runs of a block, int32 lane l holds S' = sum_k (qx_k + 128) qw_k
// of token 16g + l; it starts from -128 sum_k qw_k (per row and block, computed once per weight
// tile), so it ends at S_b exactly. Then per (row, block, group) one conversion, one product
// dw_b * dx (16 tokens) and one FMA: acc = fma(float(S_b), dw_b * dx_b, acc), block after block
// (matmul_q8_scalar_avx512). Q4_K: the 4-bit codes of a 4-row weight tile are unpacked once per
// block of token groups into bytes (32 per 32-block, in L1) with dw_b = d * sc_s and
// gm_b = -(dmin * m_s) per block, then the same loop runs with one more FMA per (row, block,
// group): acc = fma(gm_b, xs_b, acc), xs the tokens' scaled code sums (ActQ8::xsg). IQ4_XS: the
// codes become their kvalues_iq4nl values (vpshufb) at unpack time, dw_b = d * (ls - 32), and
// the loop is Q8_0's.
//
// Every token's lane runs that sequence whatever the tile, the group or the number of tokens
// (padding lanes hold code 0 and scale 0 and are never stored), so results are batch
// invariant and equal the scalar definition bit for bit.
//
// Loop order: blocks of token groups whose codes fit in ~512 KiB (L2), then tiles of 4 rows
// (the weight tile, with its fp32 scales and code sums, stays in L1 while the block's groups
// pass), then 3 groups at a time: 4 x 3 register tile of int32 sums and fp32 accumulators.
#include "backend/cpu/kernels/simd_intrin.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "backend/cpu/kernels/act_q8.h"
#include "backend/cpu/kernels/tok16_unpack.h"

namespace strata::cpu::kernels::detail {

namespace {

constexpr int kRows = 4;                         // rows per register tile
constexpr int kGroups = 3;                       // token groups (of 16) per register tile
constexpr int64_t kXBytes = int64_t{512} << 10;  // token codes per block of groups (L2)

/// acc + per int32 lane the sum of its 4 products u * s (u unsigned, s signed bytes), exactly:
/// vpdpbusd, or (without VNNI) vpmaddwd on the even and odd bytes widened to 16 bits (u up to
/// 255 would saturate vpmaddubsw). The non-VNNI form takes s already split (se, so).
template <bool VNNI>
inline __m512i dot4(__m512i acc, __m512i u, __m512i s, __m512i se, __m512i so) {
  if constexpr (VNNI) {
    (void)se;
    (void)so;
    return _mm512_dpbusd_epi32(acc, u, s);
  } else {
    (void)s;
    const __m512i ue = _mm512_and_si512(u, _mm512_set1_epi16(0x00ff)), uo = _mm512_srli_epi16(u, 8);
    return _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(ue, se), _mm512_madd_epi16(uo, so)));
  }
}

/// Per row of a tile and block b: dw[b] = the fp16 scale as fp32, nc[b] = -128 * (sum of the
/// 32 signed codes), for blocks [0, nb) of the row at w.
inline void row_factors(const uint8_t* w, int64_t nb, float* dw, int32_t* nc) {
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + 34 * b;
    dw[b] = _cvtsh_ss(load_u16(wb));
    // sum (qw + 128) by vpsadbw, minus 32 * 128
    const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 2)), bias);
    const __m256i sad = _mm256_sad_epu8(v, _mm256_setzero_si256());
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
    const int64_t sum = _mm_cvtsi128_si64(_mm_add_epi64(h, _mm_unpackhi_epi64(h, h))) - 32 * 128;
    nc[b] = static_cast<int32_t>(-128 * sum);
  }
}

/// The weight tile of the GEMM: per row r (at r * nb) and block b the codes' address w[r] + WB * b
/// (32 signed bytes), dw = the block's fp32 factor, nc = -128 * (sum of its codes), and with MIN
/// (Q4_K) gm = -(dmin * m) of the block's sub-block.
struct WTile {
  const uint8_t* w[4];
  const float* dw;
  const int32_t* nc;
  const float* gm;
};

/// R rows x G groups of 16 tokens over all nb blocks (weights: WTile, blocks WB bytes apart);
/// x/dx/xs: the first group's runs, scales and (MIN) scaled code sums (groups nb*512 bytes /
/// nb*16 floats apart). Writes y[(16 g + l) * ldy + r] for the `valid` first tokens of the tiles'
/// groups (tokens counted from the first group's first).
template <int R, int G, bool VNNI, int WB, bool MIN>
void tile(const WTile& wt, int64_t nb, const uint8_t* x, const float* dx, const float* xs, int64_t valid, float* y,
          int64_t ldy) {
  const uint8_t* const* w = wt.w;
  const float* dw = wt.dw;
  const int32_t* nc = wt.nc;
  __m512 acc[R][G];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  const int64_t gx = nb * 512, gd = nb * 16;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i s[R][G];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i c = _mm512_set1_epi32(nc[r * nb + b]);
#pragma GCC unroll 3
      for (int g = 0; g < G; ++g) s[r][g] = c;
    }
    const uint8_t* xb = x + b * 512;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i xr[G];
#pragma GCC unroll 3
      for (int g = 0; g < G; ++g) xr[g] = _mm512_loadu_si512(xb + g * gx + 64 * j);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512i wv = _mm512_set1_epi32(static_cast<int>(load_u32(w[r] + WB * b + 4 * j)));
        __m512i se = wv, so = wv;
        if constexpr (!VNNI) {
          se = _mm512_srai_epi16(_mm512_slli_epi16(wv, 8), 8);
          so = _mm512_srai_epi16(wv, 8);
        }
#pragma GCC unroll 3
        for (int g = 0; g < G; ++g) s[r][g] = dot4<VNNI>(s[r][g], xr[g], wv, se, so);
      }
    }
#pragma GCC unroll 3
    for (int g = 0; g < G; ++g) {
      const __m512 d = _mm512_loadu_ps(dx + g * gd + 16 * b);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 f = _mm512_mul_ps(_mm512_set1_ps(dw[r * nb + b]), d);  // dw_b * dx_b, rounded
        acc[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][g]), f, acc[r][g]);
      }
      if constexpr (MIN) {
        const __m512 xv = _mm512_loadu_ps(xs + g * gd + 16 * b);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(wt.gm[r * nb + b]), xv, acc[r][g]);
      }
    }
  }
  alignas(64) float out[16];
#pragma GCC unroll 3
  for (int g = 0; g < G; ++g) {
    const int64_t n = std::min<int64_t>(16, valid - 16 * g);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(out, acc[r][g]);
      for (int64_t l = 0; l < n; ++l) y[(16 * g + l) * ldy + r] = out[l];
    }
  }
}

template <int R, bool VNNI, int WB, bool MIN>
void tile_groups(int G, const WTile& wt, int64_t nb, const uint8_t* x, const float* dx, const float* xs, int64_t valid,
                 float* y, int64_t ldy) {
  if (G == 3) tile<R, 3, VNNI, WB, MIN>(wt, nb, x, dx, xs, valid, y, ldy);
  if (G == 2) tile<R, 2, VNNI, WB, MIN>(wt, nb, x, dx, xs, valid, y, ldy);
  if (G == 1) tile<R, 1, VNNI, WB, MIN>(wt, nb, x, dx, xs, valid, y, ldy);
}

// ---- mat-vec (decode: few tokens, memory-bound) ---------------------------------------------
// 16 rows at a time, one token's codes in a register: per block, rows i and i + 8 share a zmm
// (their 32 codes in the two halves, plus 128: unsigned), one vpdpbusd against the token's signed
// codes in both halves gives per row 8 lane sums of S_b + 128 sum x; a transpose-add tree turns the
// 8 zmm into one with the 16 rows' sums (in the lane order kRowOfLane), the token's 128 sum x is
// removed, and the float part runs with the 16 rows in the lanes, block after block, as defined.

/// The transpose-add tree: z[i] = [8 lanes of row i | 8 lanes of row i + 8] -> lane L holds the
/// sum of row row_of_lane()[L]'s 8 lanes.
inline __m512i reduce_rows(const __m512i (&z)[8]) {
  __m512i p[4], q[2];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    p[i] =
        _mm512_add_epi32(_mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]), _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    q[i] =
        _mm512_add_epi32(_mm512_unpacklo_epi64(p[2 * i], p[2 * i + 1]), _mm512_unpackhi_epi64(p[2 * i], p[2 * i + 1]));
  // 128-bit lanes: q[i] lane k holds row-quarter sums; add lanes (0, 1) and (2, 3) of both
  return _mm512_add_epi32(_mm512_shuffle_i64x2(q[0], q[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i64x2(q[0], q[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/// The 16 rows' exact int32 sums of one 32-column block against one token's codes q (32 bytes):
/// wz[i] holds rows i and i + 8 (their codes, as the caller prepared them), dot4 per row pair,
/// then reduce_rows. Shared by the Q8_0 and the Q4_K / IQ4_XS mat-vecs.
template <bool VNNI>
inline __m512i block_sums16(const int8_t* q, const __m512i (&wz)[8]) {
  const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  __m512i xe = x, xo = x;
  if constexpr (!VNNI) {
    xe = _mm512_srai_epi16(_mm512_slli_epi16(x, 8), 8);
    xo = _mm512_srai_epi16(x, 8);
  }
  __m512i z[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) z[i] = dot4<VNNI>(_mm512_setzero_si512(), wz[i], x, xe, xo);
  return reduce_rows(z);
}

/// Which row of the 16 each lane of reduce_rows' result holds (found by running it on row tags).
const std::array<int, 16>& row_of_lane() {
  static const std::array<int, 16> map = [] {
    __m512i z[8];
    for (int i = 0; i < 8; ++i)
      z[i] = _mm512_inserti64x4(_mm512_set1_epi32(1 << i), _mm256_set1_epi32(1 << (i + 8)), 1);
    alignas(64) int32_t v[16];
    _mm512_store_si512(v, reduce_rows(z));
    std::array<int, 16> m{};
    for (int L = 0; L < 16; ++L) m[static_cast<size_t>(L)] = __builtin_ctz(static_cast<unsigned>(v[L] / 8));
    return m;
  }();
  return map;
}

/// 16 rows (`w[i]`, rows i of the tile; rows past the range repeat the last one) against TB
/// tokens (codes q + t * cols, scales d + t * nb, 16-sums s + t * nb * 2); out[t][L] = the output
/// of row row_of_lane()[L].
template <int TB, bool VNNI>
void matvec16(const uint8_t* const* w, int64_t nb, const int8_t* q, const float* d, const int16_t* s, int64_t cols,
              const uint8_t* const* wl, const uint8_t* next, float (*out)[16]) {
  __m512 acc[TB];
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    // the next tile (16 rows further, contiguous) into L2 as one sequential stream: 544 bytes per block
    for (int o = 0; o < 544; o += 64) _mm_prefetch(reinterpret_cast<const char*>(next) + 544 * b + o, _MM_HINT_T1);
    // the 16 rows' fp16 scales in lane order (wl[L]: row row_of_lane()[L]), read here so that
    // their cache misses overlap with the work (a table made first, or a gather, was slower)
    alignas(32) uint16_t h[16];
#pragma GCC unroll 16
    for (int L = 0; L < 16; ++L) h[L] = load_u16(wl[L] + 34 * b);
    const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h)));
    __m512i wz[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i] + 34 * b + 2));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[i + 8] + 34 * b + 2));
      wz[i] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), bias);
    }
#pragma GCC unroll 4
    for (int t = 0; t < TB; ++t) {
      // S_b = sum (qw + 128) qx - 128 sum qx
      const int sx = s[t * 2 * nb + 2 * b] + s[t * 2 * nb + 2 * b + 1];
      const __m512i S = _mm512_sub_epi32(block_sums16<VNNI>(q + t * cols + 32 * b, wz), _mm512_set1_epi32(128 * sx));
      const __m512 f = _mm512_mul_ps(dw, _mm512_set1_ps(d[t * nb + b]));  // dw_b * dx_b, rounded
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), f, acc[t]);
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t) _mm512_storeu_ps(out[t], acc[t]);
}

/// The Q4_K and IQ4_XS mat-vec: 16 rows (`w[i]` as in matvec16; `off[L]`: the byte offset of row
/// row_of_lane()[L] from w[0]) against TB tokens (codes q + t * cols, scales d + t * nb, 16-sums
/// s16 + t * 2 nb; Q4_K: each block's token_xs at xs + t * nb), nsb super-blocks. Per super-block the 16 rows'
/// factors are decoded in lane order from gathers (Q4_K: d/dmin and the 12 scale bytes, giving
/// d * sc and -(dmin * m) per sub-block; IQ4_XS: d/scales_h and scales_l, giving d * (ls - 32));
/// per 32-block rows i and i + 8 share a zmm of unsigned codes (Q4_K: 0..15; IQ4_XS:
/// kvalues_iq4nl + 128), one vpdpbusd against the token's 32 codes in both halves gives 8 lane
/// sums per row, the tree gives the rows' sums (IQ4_XS: minus 128 * the block's code sum: S_b),
/// and acc = fma(float(S_b), f * dx, acc) (Q4_K: then acc = fma(-(dmin m), xs, acc)) as defined.
template <GgmlType T, int TB, bool VNNI>
void matvec16_sb(const uint8_t* const* w, __m512i off, int64_t nsb, const int8_t* q, const float* d, const int16_t* s16,
                 const float* xs, int64_t cols, const uint8_t* next, float (*out)[16]) {
  constexpr bool Q4K = T == GgmlType::Q4_K;
  constexpr int kBytes = Q4K ? 144 : 136;  // bytes per super-block
  __m512 acc[TB];
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t nb = 8 * nsb;
  const __m512i low = _mm512_set1_epi8(0x0f), m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(15),
                m2 = _mm512_set1_epi32(3);
  // kvalues_iq4nl + 128 (unsigned bytes), one table per 128-bit lane
  const __m512i kv =
      _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tables::kvalues_iq4nl))),
                       _mm512_set1_epi8(static_cast<char>(0x80)));
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t i = 0; i < nsb; ++i) {
    for (int o = 0; o < 16 * kBytes; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next) + 16 * kBytes * i + o, _MM_HINT_T1);
    const __m512i oi = _mm512_add_epi32(off, _mm512_set1_epi32(static_cast<int>(kBytes * i)));
    const __m512i H = _mm512_i32gather_epi32(oi, w[0], 1);
    const __m512i A = _mm512_i32gather_epi32(oi, w[0] + 4, 1);
    const __m512 dd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(H, _mm512_set1_epi32(0xffff))));
    alignas(64) float fs[8][16], gs[8][16];
    if constexpr (Q4K) {
      const __m512i B = _mm512_i32gather_epi32(oi, w[0] + 8, 1);
      const __m512i C = _mm512_i32gather_epi32(oi, w[0] + 12, 1);
      const __m512 dm = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(H, 16)));
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {  // k4_scale_min: s < 4 from bytes s, s + 4; s + 4 from s + 8, s, s + 4
        const __m512i sc = _mm512_and_si512(_mm512_srli_epi32(A, 8 * s), m6);
        const __m512i mn = _mm512_and_si512(_mm512_srli_epi32(B, 8 * s), m6);
        const __m512i sc2 =
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(C, 8 * s), m4),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(A, 8 * s + 6), m2), 4));
        const __m512i mn2 =
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(C, 8 * s + 4), m4),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(B, 8 * s + 6), m2), 4));
        _mm512_store_ps(fs[s], _mm512_mul_ps(dd, _mm512_cvtepi32_ps(sc)));
        _mm512_store_ps(gs[s], _mm512_xor_ps(_mm512_mul_ps(dm, _mm512_cvtepi32_ps(mn)), sign));
        _mm512_store_ps(fs[s + 4], _mm512_mul_ps(dd, _mm512_cvtepi32_ps(sc2)));
        _mm512_store_ps(gs[s + 4], _mm512_xor_ps(_mm512_mul_ps(dm, _mm512_cvtepi32_ps(mn2)), sign));
      }
    } else {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {  // iq4xs_scale: nibble g of scales_l (bits 4g..), 2 bits 2g of scales_h
        const __m512i ls =
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(A, 4 * g), m4),
                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(H, 16 + 2 * g), m2), 4));
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_sub_epi32(ls, _mm512_set1_epi32(32)));
        _mm512_store_ps(fs[g], _mm512_mul_ps(dd, sc));
      }
    }
    // sub-blocks in pairs (2j, 2j + 1): Q4_K's are the low and high nibbles of one 32-byte run,
    // IQ4_XS's two consecutive 16-byte runs; the rows' bytes are loaded once per pair
    for (int j = 0; j < 4; ++j) {
      __m512i raw[8];
#pragma GCC unroll 8
      for (int p = 0; p < 8; ++p) {
        if constexpr (Q4K) {
          const size_t o = static_cast<size_t>(kBytes * i + 16 + 32 * j);
          raw[p] =
              _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[p] + o))),
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[p + 8] + o)), 1);
        } else {  // per half: the 32 bytes of the pair, 128-bit lanes (g 2j, g 2j + 1)
          const size_t o = static_cast<size_t>(kBytes * i + 8 + 32 * j);
          raw[p] =
              _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[p] + o))),
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[p + 8] + o)), 1);
        }
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int s = 2 * j + h;
        const int64_t b = 8 * i + s;
        __m512i wz[8];
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) {
          if constexpr (Q4K) {
            wz[p] = _mm512_and_si512(h ? _mm512_srli_epi16(raw[p], 4) : raw[p], low);
          } else {
            // the run of g = s (128-bit lane h of each half) twice: low nibbles, then high ones
            const __m512i v =
                _mm512_shuffle_i64x2(raw[p], raw[p], h ? _MM_SHUFFLE(3, 3, 1, 1) : _MM_SHUFFLE(2, 2, 0, 0));
            const __m512i idx = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xff00ff00u, v, 4), low);
            wz[p] = _mm512_shuffle_epi8(kv, idx);
          }
        }
        const __m512 fv = _mm512_load_ps(fs[s]);
#pragma GCC unroll 4
        for (int t = 0; t < TB; ++t) {
          __m512i S = block_sums16<VNNI>(q + t * cols + 32 * b, wz);
          if constexpr (!Q4K)
            S = _mm512_sub_epi32(S, _mm512_set1_epi32(128 * (s16[t * 2 * nb + 2 * b] + s16[t * 2 * nb + 2 * b + 1])));
          const __m512 f = _mm512_mul_ps(fv, _mm512_set1_ps(d[t * nb + b]));  // (d sc) * dx, rounded
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), f, acc[t]);
          if constexpr (Q4K) acc[t] = _mm512_fmadd_ps(_mm512_load_ps(gs[s]), _mm512_set1_ps(xs[t * nb + b]), acc[t]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int t = 0; t < TB; ++t) _mm512_storeu_ps(out[t], acc[t]);
}

template <GgmlType T, bool VNNI>
void matvec_sb(const MatmulArgs& m, const ActQ8& a) {
  const int64_t nsb = m.cols / 256, nb = m.cols / 32;
  // Q4_K: the tokens' xs (token_xs per block) once per call, not once per 16-row tile
  thread_local std::vector<float> xs;
  if constexpr (T == GgmlType::Q4_K) {
    xs.resize(static_cast<size_t>(m.n_tok * nb));
    for (int64_t t = 0; t < m.n_tok; ++t)
      for (int64_t b = 0; b < nb; ++b)
        xs[static_cast<size_t>(t * nb + b)] = token_xs(a.dt(t)[b], a.st(t)[2 * b], a.st(t)[2 * b + 1]);
  }
  const std::array<int, 16>& row = row_of_lane();
  for (int64_t r0 = m.row_begin; r0 < m.row_end; r0 += 16) {
    const int64_t n = std::min<int64_t>(16, m.row_end - r0);
    const uint8_t* w[16];
    for (int i = 0; i < 16; ++i) w[i] = m.W + static_cast<size_t>(r0 + std::min<int64_t>(i, n - 1)) * m.row_bytes;
    alignas(64) int32_t o[16];  // < 2^31: matmul_tok16_avx512 checks 16 * row_bytes
    for (int L = 0; L < 16; ++L) o[L] = static_cast<int32_t>(w[row[static_cast<size_t>(L)]] - w[0]);
    const __m512i off = _mm512_load_si512(o);
    const uint8_t* next = w[0] + 16 * m.row_bytes;  // as in matvec: one sequential prefetch stream
    for (int64_t t0 = 0; t0 < m.n_tok; t0 += 4) {
      const int TB = static_cast<int>(std::min<int64_t>(4, m.n_tok - t0));
      alignas(64) float out[4][16];
      const int8_t* q = a.qt(t0);
      const float* d = a.dt(t0);
      const int16_t* s = a.st(t0);
      const float* x = T == GgmlType::Q4_K ? xs.data() + t0 * nb : nullptr;
      switch (TB) {
        case 4: matvec16_sb<T, 4, VNNI>(w, off, nsb, q, d, s, x, m.cols, next, out); break;
        case 3: matvec16_sb<T, 3, VNNI>(w, off, nsb, q, d, s, x, m.cols, next, out); break;
        case 2: matvec16_sb<T, 2, VNNI>(w, off, nsb, q, d, s, x, m.cols, next, out); break;
        default: matvec16_sb<T, 1, VNNI>(w, off, nsb, q, d, s, x, m.cols, next, out); break;
      }
      for (int t = 0; t < TB; ++t)
        for (int L = 0; L < 16; ++L)
          if (row[static_cast<size_t>(L)] < n) m.y[(t0 + t) * m.ldy + r0 + row[static_cast<size_t>(L)]] = out[t][L];
    }
  }
}

template <bool VNNI>
void matvec(const MatmulArgs& m, const ActQ8& a) {
  const int64_t nb = m.cols / 32;
  const std::array<int, 16>& row = row_of_lane();
  for (int64_t r0 = m.row_begin; r0 < m.row_end; r0 += 16) {
    const int64_t n = std::min<int64_t>(16, m.row_end - r0);
    const uint8_t* w[16];
    for (int i = 0; i < 16; ++i) w[i] = m.W + static_cast<size_t>(r0 + std::min<int64_t>(i, n - 1)) * m.row_bytes;
    const uint8_t* wl[16];
    for (int L = 0; L < 16; ++L) wl[L] = w[row[static_cast<size_t>(L)]];
    // the next 16 rows start 16 rows on (prefetch only, never read, so past the matrix is harmless;
    // with padded rows the stream only approximates them). Per-row prefetches of 64 B to 8 KiB
    // ahead left DRAM mat-vec at 11-13 GB/s (16 strided streams); this one stream gives ~22.
    const uint8_t* next = w[0] + 16 * m.row_bytes;
    for (int64_t t0 = 0; t0 < m.n_tok; t0 += 4) {
      const int TB = static_cast<int>(std::min<int64_t>(4, m.n_tok - t0));
      alignas(64) float out[4][16];
      const int8_t* q = a.qt(t0);
      const float* d = a.dt(t0);
      const int16_t* s = a.st(t0);
      switch (TB) {
        case 4: matvec16<4, VNNI>(w, nb, q, d, s, m.cols, wl, next, out); break;
        case 3: matvec16<3, VNNI>(w, nb, q, d, s, m.cols, wl, next, out); break;
        case 2: matvec16<2, VNNI>(w, nb, q, d, s, m.cols, wl, next, out); break;
        default: matvec16<1, VNNI>(w, nb, q, d, s, m.cols, wl, next, out); break;
      }
      for (int t = 0; t < TB; ++t)
        for (int L = 0; L < 16; ++L)
          if (row[static_cast<size_t>(L)] < n) m.y[(t0 + t) * m.ldy + r0 + row[static_cast<size_t>(L)]] = out[t][L];
    }
  }
}

template <bool VNNI, GgmlType T>
void gemm(const MatmulArgs& m, const ActQ8& a) {
  constexpr bool Q4K = T == GgmlType::Q4_K, SB = T != GgmlType::Q8_0;  // SB: codes unpacked per tile
  const TokenLanes tl = token_lanes_of(a, Q4K);
  const int64_t nb = m.cols / 32;
  thread_local std::vector<float> dw, gm;
  thread_local std::vector<int32_t> nc;
  thread_local std::vector<uint8_t> codes;
  dw.resize(static_cast<size_t>(kRows * nb));
  nc.resize(static_cast<size_t>(kRows * nb));
  if (Q4K) gm.resize(static_cast<size_t>(kRows * nb));
  if (SB) codes.resize(static_cast<size_t>(kRows * nb * 32));
  constexpr int WB = SB ? 32 : 34;  // bytes from one block's codes to the next
  // groups per block: as many as fit kXBytes, a multiple of the register tile
  const int64_t per_group = nb * (Q4K ? 640 : 576);
  const int64_t fit = std::max<int64_t>(kGroups, kXBytes / per_group / kGroups * kGroups);
  for (int64_t g0 = 0; g0 < tl.groups; g0 += fit) {
    const int64_t g1 = std::min(tl.groups, g0 + fit);
    for (int64_t r0 = m.row_begin; r0 < m.row_end; r0 += kRows) {
      const int R = static_cast<int>(std::min<int64_t>(kRows, m.row_end - r0));
      WTile wt{{}, dw.data(), nc.data(), Q4K ? gm.data() : nullptr};
      for (int r = 0; r < R; ++r) {
        const uint8_t* row = m.W + static_cast<size_t>(r0 + r) * m.row_bytes;
        uint8_t* c = SB ? codes.data() + r * nb * 32 : nullptr;
        if constexpr (Q4K) {
          unpack_q4_k_row(row, nb / 8, c, 32, dw.data() + r * nb, gm.data() + r * nb, 1, nc.data() + r * nb);
        } else if constexpr (SB) {
          unpack_iq4_xs_row(row, nb / 8, c, 32, dw.data() + r * nb, 1, nc.data() + r * nb);
        } else {
          row_factors(row, nb, dw.data() + r * nb, nc.data() + r * nb);
        }
        wt.w[r] = SB ? c : row + 2;
      }
      for (int64_t g = g0; g < g1; g += kGroups) {
        const int G = static_cast<int>(std::min<int64_t>(kGroups, g1 - g));
        const uint8_t* x = tl.x + g * nb * 512;
        const float* dx = tl.dx + g * nb * 16;
        const float* xs = Q4K ? tl.xs + g * nb * 16 : nullptr;
        const int64_t valid = m.n_tok - 16 * g;
        float* y = m.y + 16 * g * m.ldy + r0;
        switch (R) {
          case 4: tile_groups<4, VNNI, WB, Q4K>(G, wt, nb, x, dx, xs, valid, y, m.ldy); break;
          case 3: tile_groups<3, VNNI, WB, Q4K>(G, wt, nb, x, dx, xs, valid, y, m.ldy); break;
          case 2: tile_groups<2, VNNI, WB, Q4K>(G, wt, nb, x, dx, xs, valid, y, m.ldy); break;
          default: tile_groups<1, VNNI, WB, Q4K>(G, wt, nb, x, dx, xs, valid, y, m.ldy); break;
        }
      }
    }
  }
}

template <GgmlType T, bool VNNI>
void run(const MatmulArgs& m, const ActQ8& a) {
  if (m.n_tok > kQ8_0MatVecMax) {
    gemm<VNNI, T>(m, a);
  } else if constexpr (T == GgmlType::Q8_0) {
    matvec<VNNI>(m, a);
  } else {
    matvec_sb<T, VNNI>(m, a);
  }
}

}  // namespace

void matmul_tok16_avx512(const MatmulArgs& m, const ActQ8& a, bool vnni) {
  // the mat-vec gathers with int32 offsets of up to 15 rows
  if (m.n_tok <= kQ8_0MatVecMax && m.type != GgmlType::Q8_0 && m.row_bytes > (size_t{1} << 27))
    throw std::runtime_error("cpu::kernels: AVX-512 mat-vec rows over 128 MiB are not supported");
  using G = GgmlType;
  switch (m.type) {
    case G::Q8_0: vnni ? run<G::Q8_0, true>(m, a) : run<G::Q8_0, false>(m, a); break;
    case G::Q4_K: vnni ? run<G::Q4_K, true>(m, a) : run<G::Q4_K, false>(m, a); break;
    case G::IQ4_XS: vnni ? run<G::IQ4_XS, true>(m, a) : run<G::IQ4_XS, false>(m, a); break;
    default: throw std::runtime_error("cpu::kernels: no tokens-in-the-lanes kernel for this type");
  }
}

}  // namespace strata::cpu::kernels::detail
