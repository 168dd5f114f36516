// The q8-activation path, scalar: activation quantization and the definition of every dot
// product's arithmetic. Integer sums are exact; the fp32 part is spelled out lane by lane with
// the structure the AVX-512 kernels use (matmul_q8_avx512.cpp), so both give identical bits.
// Q8_0, Q4_K and IQ4_XS on AVX-512 have their own, serial definitions (dot_q8_0_serial,
// dot_q4_k_serial, dot_iq4_xs_serial; matmul_q8_scalar_avx512).
//
// Notation per (row, token): qx = int8 codes of the token, dx[b] = scale of its 32-block b,
// s16[g] = sum of its codes 16g..16g+15. "lane L" of a 64-weight chunk covers elements
// 4L..4L+3 of the chunk (one int32 lane of vpdpbusd). fma = one rounding (std::fma).
// hsum8(v) = (v0+v4 + v2+v6) + (v1+v5 + v3+v7) in that tree; hsum16(v) = hsum8(v[l] + v[l+8]).
#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "backend/cpu/kernels/act_q8.h"
#include "quant/quant_tables.h"

namespace strata::cpu::kernels::detail {

namespace {

float hsum8(const float* v) {
  const float a0 = v[0] + v[4], a1 = v[1] + v[5], a2 = v[2] + v[6], a3 = v[3] + v[7];
  return (a0 + a2) + (a1 + a3);
}
float hsum16(const float* v) {
  float h[8];
  for (int l = 0; l < 8; ++l) h[l] = v[l] + v[l + 8];
  return hsum8(h);
}

// The 32-weight block types (b32_format in act_q8.h: w_j = fd * u_j + fc, u_j unsigned):
// f_b = fd * dx[b], g_b = fc * dx[b]. Blocks are taken in pairs (2p, 2p+1): lanes 0-7 hold block
// 2p, lanes 8-15 block 2p+1, each lane the integer sum of u * code_x over its 4 elements, into
// accumulator p % 2: acc = fma(float(sum), f_b, acc). The fc part is accumulated per block
// position b % 8: corr = fma(g_b, float(s16[2b] + s16[2b+1]), corr).
// y = hsum16(acc0 + acc1) + hsum8(corr).
float dot_b32(const B32Format& F, const uint8_t* w, int64_t cols, const int8_t* qx, const float* dx,
              const int16_t* s16) {
  float acc[2][16] = {}, corr[8] = {};
  const int64_t nb = cols / 32;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + static_cast<int64_t>(F.bytes) * b;
    const float fd = F.e8m0 ? e8m0_half(wb[0]) : half_to_float(load_u16(wb));
    const float fc = F.min >= 0 ? half_to_float(load_u16(wb + F.min)) : -static_cast<float>(F.offset) * fd;
    int u[32];
    for (int j = 0; j < 32; ++j) {
      if (F.qs + 32 == F.bytes) {  // Q8_0: 32 int8 codes
        u[j] = static_cast<int8_t>(wb[F.qs + j]) + 128;
        continue;
      }
      int q = (wb[F.qs + j % 16] >> (4 * (j / 16))) & 0xf;
      if (F.qh >= 0) q |= static_cast<int>((load_u32(wb + F.qh) >> j) & 1u) << 4;
      u[j] = F.table ? F.values[q] + F.offset : q;
    }
    const float f = fd * dx[b];
    corr[b % 8] = std::fma(fc * dx[b], static_cast<float>(s16[2 * b] + s16[2 * b + 1]), corr[b % 8]);
    const int64_t p = b / 2;
    for (int l = 0; l < 8; ++l) {
      int s = 0;
      for (int k = 4 * l; k < 4 * l + 4; ++k) s += u[k] * qx[32 * b + k];
      float& a = acc[p & 1][8 * (b & 1) + l];
      a = std::fma(static_cast<float>(s), f, a);
    }
  }
  float s[16];
  for (int l = 0; l < 16; ++l) s[l] = acc[0][l] + acc[1][l];
  return hsum16(s) + hsum8(corr);
}

// Q4_K and Q5_K (FIFTH: the 5th bit, bit s of qh[element % 32]), in the lane order of
// q4k_lane_element (act_q8.h): lane L of a super-block holds 16 weights of sub-block s = L/2
// (scale sc_s, min m_s, activation block 8i+s); their products with the activation codes are
// summed in integers, sum_L, and scaled once: acc = fma(float(sum_L), (d * sc_s) * dx[8i+s], acc).
// The mins: for each sub-block s, accm[s] = fma(dmin * m_s, xs[8i+s], accm[s]) with
// xs = dx * float(code sum of the 32-block). y = hsum16(acc) - hsum8(accm).
template <bool FIFTH>
float dot_q4_k(const uint8_t* w, int64_t cols, const int8_t* qx, const float* dx, const int16_t* s16) {
  constexpr int kBytes = FIFTH ? 176 : 144, kQs = FIFTH ? 48 : 16;
  float acc[16] = {}, accm[8] = {};
  for (int64_t i = 0; i < cols / 256; ++i, w += kBytes) {
    const float d = half_to_float(load_u16(w)), dmin = half_to_float(load_u16(w + 2));
    int sc[8], m[8];
    for (int s = 0; s < 8; ++s) {
      k4_scale_min(w + 4, s, sc[s], m[s]);
      const float xs = dx[8 * i + s] * static_cast<float>(s16[16 * i + 2 * s] + s16[16 * i + 2 * s + 1]);
      accm[s] = std::fma(dmin * static_cast<float>(m[s]), xs, accm[s]);
    }
    const uint8_t* qs = w + kQs;
    for (int L = 0; L < 16; ++L) {
      int sum = 0;
      for (int k = 0; k < 4; ++k) {
        for (int j = 0; j < 4; ++j) {
          const int el = q4k_lane_element(k, L, j), s = el / 32;
          int q = (qs[32 * (s / 2) + el % 32] >> (4 * (s % 2))) & 0xf;
          if constexpr (FIFTH) q |= ((w[16 + el % 32] >> s) & 1) << 4;
          sum += q * qx[256 * i + el];
        }
      }
      const int s = L / 2;
      acc[L] = std::fma(static_cast<float>(sum), (d * static_cast<float>(sc[s])) * dx[8 * i + s], acc[L]);
    }
  }
  return hsum16(acc) - hsum8(accm);
}

// Q6_K, in the lane order of q6k_lane_element (act_q8.h): lane L is 16-weight group L of the
// super-block (int8 scale sc[L], activation block 8i + L/2). The 6-bit codes q (0..63, value
// q - 32) multiply the activation codes in integers: t = sum(q * x) - 32 * s16[16i + L] (the 16-sum
// of the group's codes), S = sc[L] * t (exact int32), acc = fma(float(S), d * dx[8i + L/2], acc).
// y = hsum16(acc).
float dot_q6_k(const uint8_t* w, int64_t cols, const int8_t* qx, const float* dx, const int16_t* s16) {
  float acc[16] = {};
  for (int64_t i = 0; i < cols / 256; ++i, w += 210) {
    const uint8_t* ql = w;
    const uint8_t* qh = w + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(w + 192);
    const float d = half_to_float(load_u16(w + 208));
    for (int L = 0; L < 16; ++L) {
      int sum = 0;
      for (int k = 0; k < 4; ++k) {
        for (int j = 0; j < 4; ++j) {
          const int e = q6k_lane_element(k, L, j), h = e / 128, s = (e / 32) % 4, c = e % 32;
          const int lo = (ql[64 * h + 32 * (s % 2) + c] >> (4 * (s / 2))) & 0xf;
          const int hi = (qh[32 * h + c] >> (2 * s)) & 3;
          sum += (lo | (hi << 4)) * qx[256 * i + e];
        }
      }
      const int S = sc[L] * (sum - 32 * s16[16 * i + L]);
      acc[L] = std::fma(static_cast<float>(S), d * dx[8 * i + L / 2], acc[L]);
    }
  }
  return hsum16(acc);
}

// Q2_K, in Q6_K's lane order (lane L = 16-weight group L, 4-bit scale sc and min m of
// scales[L], activation block 8i + L/2): t = sum(q * x) over the lane (q = 0..3), S = sc * t,
// M = m * s16[16i + L] (the group's code sum), both exact; acc = fma(float(S), d * dx, acc),
// accm = fma(float(M), dmin * dx, accm). y = hsum16(acc) - hsum16(accm).
float dot_q2_k(const uint8_t* w, int64_t cols, const int8_t* qx, const float* dx, const int16_t* s16) {
  float acc[16] = {}, accm[16] = {};
  for (int64_t i = 0; i < cols / 256; ++i, w += 84) {
    const uint8_t* qs = w + 16;
    const float d = half_to_float(load_u16(w + 80)), dmin = half_to_float(load_u16(w + 82));
    for (int L = 0; L < 16; ++L) {
      int t = 0;
      for (int k = 0; k < 4; ++k) {
        for (int j = 0; j < 4; ++j) {
          const int e = q6k_lane_element(k, L, j);
          t += ((qs[32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 3) * qx[256 * i + e];
        }
      }
      const float x = dx[8 * i + L / 2];
      acc[L] = std::fma(static_cast<float>((w[L] & 0xf) * t), d * x, acc[L]);
      accm[L] = std::fma(static_cast<float>((w[L] >> 4) * s16[16 * i + L]), dmin * x, accm[L]);
    }
  }
  return hsum16(acc) - hsum16(accm);
}

// Q3_K, in Q6_K's lane order (lane L = 16-weight group L, six-bit scale sc_L - 32): the 3-bit
// code u = low 2 bits | hmask bit << 2 (0..7, value u - 4) multiplies the activation code in
// integers: t = sum(u * x) - 4 * s16[16i + L], S = (sc_L - 32) * t (exact);
// acc = fma(float(S), d * dx[8i + L/2], acc). y = hsum16(acc).
float dot_q3_k(const uint8_t* w, int64_t cols, const int8_t* qx, const float* dx, const int16_t* s16) {
  float acc[16] = {};
  for (int64_t i = 0; i < cols / 256; ++i, w += 110) {
    const uint8_t* hm = w;
    const uint8_t* qs = w + 32;
    const uint8_t* sc = w + 96;
    const float d = half_to_float(load_u16(w + 108));
    for (int L = 0; L < 16; ++L) {
      int t = 0;
      for (int k = 0; k < 4; ++k) {
        for (int j = 0; j < 4; ++j) {
          const int e = q6k_lane_element(k, L, j);
          const int u =
              ((qs[32 * (e / 128) + e % 32] >> (2 * ((e / 32) % 4))) & 3) | (((hm[e % 32] >> (e / 32)) & 1) << 2);
          t += u * qx[256 * i + e];
        }
      }
      t -= 4 * s16[16 * i + L];
      acc[L] = std::fma(static_cast<float>(q3k_scale(sc, L) * t), d * dx[8 * i + L / 2], acc[L]);
    }
  }
  return hsum16(acc);
}

// IQ4_XS, in Q6_K's lane order (lane L = 16-weight group L, half L%2 of 32-block L/2): the
// codes index kvalues_iq4nl (signed); the kernel multiplies kv + 128 (unsigned) and removes
// 128 * the group's code sum, so t = sum(kv * x) exactly; S = (ls - 32) * t with the block's
// six-bit scale; acc = fma(float(S), d * dx[8i + L/2], acc). y = hsum16(acc).
float dot_iq4_xs(const uint8_t* w, int64_t cols, const int8_t* qx, const float* dx) {
  float acc[16] = {};
  for (int64_t i = 0; i < cols / 256; ++i, w += 136) {
    const float d = half_to_float(load_u16(w));
    const uint8_t* qs = w + 8;
    for (int L = 0; L < 16; ++L) {
      const int g = L / 2;
      int t = 0;
      for (int k = 0; k < 4; ++k) {
        for (int j = 0; j < 4; ++j) {
          const int e = q6k_lane_element(k, L, j), o = e % 32;  // o < 16: low nibble of qs[16g + o]
          const int q = (qs[16 * g + o % 16] >> (4 * (o / 16))) & 0xf;
          t += tables::kvalues_iq4nl[q] * qx[256 * i + e];
        }
      }
      acc[L] = std::fma(static_cast<float>(iq4xs_scale(w, g) * t), d * dx[8 * i + g], acc[L]);
    }
  }
  return hsum16(acc);
}

// IQ3_S, in Q6_K's lane order: lane L holds grid entries 4L..4L+3 (one per chunk), 32-block L/2.
// t = sum over the lane's 16 weights of grid magnitude * activation code (the weight's sign moved
// onto the code); S = (1 + 2*ls) * t with the block's 4-bit scale; acc = fma(float(S),
// d * dx[8i + L/2], acc). y = hsum16(acc).
float dot_iq3_s(const uint8_t* w, int64_t cols, const int8_t* qx, const float* dx) {
  float acc[16] = {};
  for (int64_t i = 0; i < cols / 256; ++i, w += 110) {
    const float d = half_to_float(load_u16(w));
    const uint8_t* qs = w + 2;
    const uint8_t* qh = w + 66;
    const uint8_t* sg = w + 74;
    const uint8_t* sc = w + 106;
    for (int L = 0; L < 16; ++L) {
      const int b = L / 2;
      int t = 0;
      for (int k = 0; k < 4; ++k) {
        for (int j = 0; j < 4; ++j) {
          const int e = q6k_lane_element(k, L, j), n = e / 4;  // grid entry n covers elements 4n..4n+3
          const uint32_t g = tables::iq3s_grid[qs[n] | (((qh[n / 8] >> (n % 8)) & 1) << 8)];
          const int x = qx[256 * i + e];
          t += static_cast<int>((g >> (8 * (e % 4))) & 0xff) * (((sg[e / 8] >> (e % 8)) & 1) ? -x : x);
        }
      }
      const int odd = 1 + 2 * ((sc[b / 2] >> (4 * (b % 2))) & 0xf);
      acc[L] = std::fma(static_cast<float>(odd * t), d * dx[8 * i + b], acc[L]);
    }
  }
  return hsum16(acc);
}

// IQ2_XS, in the lane order of iq2xs_lane_element (act_q8.h): lane L of a super-block stays
// in 32-block s = L/2; its 16 elements in chunks 0-1 (group 2s) and 2-3 (group 2s+1) give
// integer sums sA, sB (grid magnitude times activation code, the weight's sign moved onto the
// code), weighted in integers by the groups' odd scales 2*ls+1 (the nibbles of scale byte s):
// S = (2*lsA+1)*sA + (2*lsB+1)*sB. acc = fma(float(S), (d/8) * dx[8i + s], acc), which is
// ggml's factor d*(0.5+ls)*0.25 = d/8 * (2*ls+1). y = hsum16(acc).
float dot_iq2_xs(const uint8_t* w, int64_t cols, const int8_t* qx, const float* dx) {
  float acc[16] = {};
  for (int64_t i = 0; i < cols / 256; ++i, w += 74) {
    const float dq = half_to_float(load_u16(w)) * 0.125f;
    for (int L = 0; L < 16; ++L) {
      int sum[2] = {0, 0};
      for (int k = 0; k < 4; ++k) {
        for (int j = 0; j < 4; ++j) {
          const int el = iq2xs_lane_element(k, L, j);
          const uint16_t code = load_u16(w + 2 + 2 * (el / 8));
          const uint64_t g = tables::iq2xs_grid[code & 511];
          const uint8_t sg = tables::ksigns_iq2xs[code >> 9];
          const int x = qx[256 * i + el];
          sum[k / 2] += static_cast<int>((g >> (8 * (el % 8))) & 0xff) * (((sg >> (el % 8)) & 1) ? -x : x);
        }
      }
      const int s = L / 2, sc = w[66 + s];
      const int S = (2 * (sc & 0xf) + 1) * sum[0] + (2 * (sc >> 4) + 1) * sum[1];
      acc[L] = std::fma(static_cast<float>(S), dq * dx[8 * i + s], acc[L]);
    }
  }
  return hsum16(acc);
}

// Q8_0 in the serial definition of the AVX-512 family (matmul_q8_scalar_avx512 in act_q8.h,
// the CUDA q8 arithmetic): S_b exact in integers, then acc = fma(float(S_b), dw_b * dx_b, acc)
// block after block, the product rounded on its own.
float dot_q8_0_serial(const uint8_t* w, int64_t cols, const int8_t* qx, const float* dx) {
  float acc = 0.0f;
  for (int64_t b = 0; b < cols / 32; ++b) {
    const uint8_t* wb = w + 34 * b;
    int S = 0;
    for (int k = 0; k < 32; ++k) S += static_cast<int8_t>(wb[2 + k]) * qx[32 * b + k];
    float f = half_to_float(load_u16(wb)) * dx[b];
    __asm__("" : "+x"(f));  // no contraction of the product into the FMA
    acc = std::fma(static_cast<float>(S), f, acc);
  }
  return acc;
}

// Q4_K in the serial definition of the AVX-512 family (matmul_q8_scalar_avx512 in act_q8.h):
// per 32-block b = 8i + s in column order, with sc_s, m_s the 6-bit scale and min of sub-block s
// of super-block i (k4_scale_min) and q_k its 4-bit codes (element 32s + k: nibble s % 2 of
// qs[32 (s/2) + k]):
//   S_b  = sum_k q_k * qx[32b + k]                      (exact int32, |S_b| <= 32 * 15 * 128)
//   f_b  = (d * sc_s) * dx[b]                           (two fp32 products, each rounded)
//   xs_b = dx[b] * float(s16[2b] + s16[2b+1])           (rounded; the block's code sum)
//   acc  = fma(float(S_b), f_b, acc)
//   acc  = fma(-(dmin * m_s), xs_b, acc)                (the product rounded, then negated)
float dot_q4_k_serial(const uint8_t* w, int64_t cols, const int8_t* qx, const float* dx, const int16_t* s16) {
  float acc = 0.0f;
  for (int64_t i = 0; i < cols / 256; ++i, w += 144) {
    const float d = half_to_float(load_u16(w)), dmin = half_to_float(load_u16(w + 2));
    for (int s = 0; s < 8; ++s) {
      const int64_t b = 8 * i + s;
      int sc = 0, m = 0;
      k4_scale_min(w + 4, s, sc, m);
      int S = 0;
      for (int k = 0; k < 32; ++k) S += ((w[16 + 32 * (s / 2) + k] >> (4 * (s % 2))) & 0xf) * qx[32 * b + k];
      float fs = d * static_cast<float>(sc);
      __asm__("" : "+x"(fs));  // each product rounded on its own (no contraction)
      float f = fs * dx[b];
      const float xs = token_xs(dx[b], s16[2 * b], s16[2 * b + 1]);
      float g = dmin * static_cast<float>(m);
      __asm__("" : "+x"(f), "+x"(g));
      acc = std::fma(static_cast<float>(S), f, acc);
      acc = std::fma(-g, xs, acc);
    }
  }
  return acc;
}

// IQ4_XS in the serial definition of the AVX-512 family (matmul_q8_scalar_avx512): per 32-block
// b = 8i + g in column order, with kv_k = kvalues_iq4nl[code k] (code k: nibble k / 16 of
// qs[16g + k % 16]) and ls_g its 6-bit scale (iq4xs_scale: ls - 32):
//   S_b = sum_k kv_k * qx[32b + k]                      (exact int32)
//   acc = fma(float(S_b), (d * (ls_g - 32)) * dx[b], acc)  (two fp32 products, each rounded)
float dot_iq4_xs_serial(const uint8_t* w, int64_t cols, const int8_t* qx, const float* dx) {
  float acc = 0.0f;
  for (int64_t i = 0; i < cols / 256; ++i, w += 136) {
    const float d = half_to_float(load_u16(w));
    for (int g = 0; g < 8; ++g) {
      const int64_t b = 8 * i + g;
      int S = 0;
      for (int k = 0; k < 32; ++k)
        S += tables::kvalues_iq4nl[(w[8 + 16 * g + k % 16] >> (4 * (k / 16))) & 0xf] * qx[32 * b + k];
      float fs = d * static_cast<float>(iq4xs_scale(w, g));
      __asm__("" : "+x"(fs));  // each product rounded on its own (no contraction)
      float f = fs * dx[b];
      __asm__("" : "+x"(f));
      acc = std::fma(static_cast<float>(S), f, acc);
    }
  }
  return acc;
}

}  // namespace

void token_lanes(const ActQ8& a, int64_t t0, int64_t t1, uint8_t* xg, float* dxg, float* xsg) {
  const int64_t nb = a.cols / 32;
  // 4 codes at a time: + 128 on each byte is a flip of its top bit
  const auto put = [&](int64_t t, const int8_t* q, const float* d, const int16_t* s) {
    const int64_t g = t / 16, l = t % 16;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* run = xg + (g * nb + b) * 512 + 4 * l;
      for (int j = 0; j < 8; ++j) {
        uint32_t v = 0;
        if (q) std::memcpy(&v, q + 32 * b + 4 * j, 4);
        v ^= 0x80808080u;
        std::memcpy(run + 64 * j, &v, 4);
      }
      dxg[(g * nb + b) * 16 + l] = d ? d[b] : 0.0f;
      if (xsg) xsg[(g * nb + b) * 16 + l] = d ? token_xs(d[b], s[2 * b], s[2 * b + 1]) : 0.0f;
    }
  };
  for (int64_t t = t0; t < t1; ++t) put(t, a.qt(t), a.dt(t), a.st(t));
  if (t1 == a.n_tok)
    for (int64_t t = a.n_tok; t % 16 != 0; ++t) put(t, nullptr, nullptr, nullptr);
}

TokenLanes token_lanes_of(const ActQ8& a, bool with_xs) {
  const int64_t groups = (a.n_tok + 15) / 16;
  if (a.tok16 && (!with_xs || a.tok16_xs)) return {a.xg.data(), a.dxg.data(), a.xsg.data(), groups};
  thread_local std::vector<uint8_t> xg;
  thread_local std::vector<float> dxg, xsg;
  xg.resize(static_cast<size_t>(groups * 16 * a.cols));
  dxg.resize(static_cast<size_t>(groups * 16 * (a.cols / 32)));
  if (with_xs) xsg.resize(dxg.size());
  token_lanes(a, 0, a.n_tok, xg.data(), dxg.data(), with_xs ? xsg.data() : nullptr);
  return {xg.data(), dxg.data(), with_xs ? xsg.data() : nullptr, groups};
}

void matmul_q8_scalar_avx512(const MatmulArgs& m, const ActQ8& a) {
  if (!has_tok16(m.type)) {
    matmul_q8_scalar(m, a);
    return;
  }
  for (int64_t r = m.row_begin; r < m.row_end; ++r) {
    const uint8_t* w = m.W + static_cast<size_t>(r) * m.row_bytes;
    for (int64_t t = 0; t < m.n_tok; ++t)
      m.y[t * m.ldy + r] = m.type == GgmlType::Q8_0   ? dot_q8_0_serial(w, m.cols, a.qt(t), a.dt(t))
                           : m.type == GgmlType::Q4_K ? dot_q4_k_serial(w, m.cols, a.qt(t), a.dt(t), a.st(t))
                                                      : dot_iq4_xs_serial(w, m.cols, a.qt(t), a.dt(t));
  }
}

void matmul_q8_scalar_avx2(const MatmulArgs& m, const ActQ8& a) {
  if (m.type == GgmlType::Q8_0) {
    matmul_q8_scalar_avx512(m, a);  // dot_q8_0_serial
    return;
  }
  matmul_q8_scalar(m, a);
}

void lane_order(GgmlType type, const ActQ8& a, int64_t t0, int64_t t1, int8_t* xp, float* dxl, float* xs) {
  // source dword of each destination dword of a 256-block (a lane's 4 elements are consecutive)
  using Map = std::array<uint8_t, 64>;
  const auto make = [](int (*element)(int, int, int)) {
    Map s{};
    for (int k = 0; k < 4; ++k)
      for (int L = 0; L < 16; ++L) s[static_cast<size_t>(16 * k + L)] = static_cast<uint8_t>(element(k, L, 0) / 4);
    return s;
  };
  static const Map q4k = make([](int k, int L, int j) { return q4k_lane_element(k, L, j); });
  static const Map q6k = make([](int k, int L, int j) { return q6k_lane_element(k, L, j); });
  static const Map iq2 = make([](int k, int L, int j) { return iq2xs_lane_element(k, L, j); });
  const bool k4 = type == GgmlType::Q4_K || type == GgmlType::Q5_K;  // same order, with xs
  const Map& src = k4 ? q4k : type == GgmlType::IQ2_XS ? iq2 : q6k;  // Q2_K, Q3_K, Q6_K, IQ3_S, IQ4_XS
  const int64_t nsb = a.cols / 256;
  for (int64_t t = t0; t < t1; ++t) {
    const int8_t* q = a.qt(t);
    const float* d = a.dt(t);
    int8_t* o = xp + (t - t0) * a.cols;
    float* f = dxl + (t - t0) * (a.cols / 16);
    for (int64_t i = 0; i < nsb; ++i) {
      for (int p = 0; p < 64; ++p) std::memcpy(o + 256 * i + 4 * p, q + 256 * i + 4 * src[static_cast<size_t>(p)], 4);
      for (int L = 0; L < 16; ++L) f[16 * i + L] = d[8 * i + L / 2];
    }
    if (k4) {
      const int16_t* s = a.st(t);
      float* x = xs + (t - t0) * (a.cols / 32);
      for (int64_t b = 0; b < a.cols / 32; ++b) x[b] = d[b] * static_cast<float>(s[2 * b] + s[2 * b + 1]);
    }
  }
}

LaneTokens lane_tokens(GgmlType t, const ActQ8& a, int64_t t0, int64_t t1) {
  if (a.lanes == t) return LaneTokens{a.ql.data(), a.dxl.data(), a.xs.data(), a.s16.data(), a.cols}.from(t0);
  thread_local std::vector<int8_t> xp;
  thread_local std::vector<float> dxl, xs;
  xp.resize(static_cast<size_t>((t1 - t0) * a.cols));
  dxl.resize(static_cast<size_t>((t1 - t0) * (a.cols / 16)));
  xs.resize(static_cast<size_t>((t1 - t0) * (a.cols / 32)));
  lane_order(t, a, t0, t1, xp.data(), dxl.data(), xs.data());
  return LaneTokens{xp.data(), dxl.data(), xs.data(), a.st(t0), a.cols};
}

void matmul_q8_scalar(const MatmulArgs& m, const ActQ8& a) {
  for (int64_t r = m.row_begin; r < m.row_end; ++r) {
    const uint8_t* w = m.W + static_cast<size_t>(r) * m.row_bytes;
    for (int64_t t = 0; t < m.n_tok; ++t) {
      float y;
      switch (m.type) {
        case GgmlType::Q8_0:
        case GgmlType::Q4_0:
        case GgmlType::Q4_1:
        case GgmlType::Q5_0:
        case GgmlType::Q5_1:
        case GgmlType::IQ4_NL:
        case GgmlType::MXFP4: y = dot_b32(b32_format(m.type), w, m.cols, a.qt(t), a.dt(t), a.st(t)); break;
        case GgmlType::Q4_K: y = dot_q4_k<false>(w, m.cols, a.qt(t), a.dt(t), a.st(t)); break;
        case GgmlType::Q5_K: y = dot_q4_k<true>(w, m.cols, a.qt(t), a.dt(t), a.st(t)); break;
        case GgmlType::Q6_K: y = dot_q6_k(w, m.cols, a.qt(t), a.dt(t), a.st(t)); break;
        case GgmlType::Q2_K: y = dot_q2_k(w, m.cols, a.qt(t), a.dt(t), a.st(t)); break;
        case GgmlType::Q3_K: y = dot_q3_k(w, m.cols, a.qt(t), a.dt(t), a.st(t)); break;
        case GgmlType::IQ4_XS: y = dot_iq4_xs(w, m.cols, a.qt(t), a.dt(t)); break;
        case GgmlType::IQ3_S: y = dot_iq3_s(w, m.cols, a.qt(t), a.dt(t)); break;
        case GgmlType::IQ2_XS: y = dot_iq2_xs(w, m.cols, a.qt(t), a.dt(t)); break;
        default: throw std::runtime_error("quant: no q8 kernel for " + std::string(type_name(m.type)));
      }
      m.y[t * m.ldy + r] = y;
    }
  }
}

}  // namespace strata::cpu::kernels::detail
