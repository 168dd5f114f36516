// cpu::attention_tile (tiles of query tokens x heads per K/V block; AVX2 flash-attention order)
// against cpu::attention_one, one query token at a time: bit for bit, for every tile shape,
// head_dim (multiples of 8 and one that is not), window and sinks, so that prefill (tiles),
// decode (one token) and any chunking keep identical results.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/kernels/kernels.h"
#include "backend/cpu/ops.h"

using namespace strata;
namespace k = strata::cpu::kernels;

namespace {

struct Case {
  int group, head_dim;
  int64_t n_ctx, window;
  bool sinks;
};

// Runs every token of [pos0, pos0 + T) through attention_tile in tiles of `tile` tokens and
// heads [h0, h0 + nh) of the group, and through attention_one alone, and compares the bits.
void check(const k::KernelConfig& kc, const Case& c, int tile, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int n_head_kv = 2, n_head = c.group * n_head_kv, hd = c.head_dim;
  const int64_t kv_dim = int64_t(n_head_kv) * hd, q_dim = int64_t(n_head) * hd, T = c.n_ctx;
  std::vector<float> q(size_t(T * q_dim)), kc_(size_t(T * kv_dim)), vc(size_t(T * kv_dim)), sinks(static_cast<size_t>(n_head));
  for (auto& x : q) x = 2.f * nd(rng);  // scores of order 10: exp spans many octaves
  for (auto& x : kc_) x = nd(rng);
  for (auto& x : vc) x = nd(rng);
  for (auto& x : sinks) x = nd(rng);
  const float scale = 1.0f / std::sqrt(float(hd));
  std::vector<int64_t> first(static_cast<size_t>(T)), last(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    last[size_t(t)] = t;
    first[size_t(t)] = c.window > 0 ? std::max<int64_t>(0, t + 1 - c.window) : 0;
  }
  std::vector<float> one(size_t(T * q_dim), NAN), tiled(size_t(T * q_dim), NAN);
  std::vector<float> scratch(size_t(8 * T));
  for (int64_t t = 0; t < T; ++t)
    for (int g = 0; g < n_head_kv; ++g) {
      const int64_t off = t * q_dim + int64_t(g) * c.group * hd;
      cpu::attention_one(kc, q.data() + off, kc_.data() + first[size_t(t)] * kv_dim + g * hd,
                         vc.data() + first[size_t(t)] * kv_dim + g * hd, kv_dim, t + 1 - first[size_t(t)], c.group, 1,
                         hd, scale, one.data() + off, scratch.data(),
                         c.sinks ? sinks.data() + int64_t(g) * c.group : nullptr);
    }
  // heads in parts of 1, 3 and the whole group
  for (int part : {1, 3, c.group}) {
    std::fill(tiled.begin(), tiled.end(), NAN);
    for (int64_t t0 = 0; t0 < T; t0 += tile)
      for (int g = 0; g < n_head_kv; ++g)
        for (int h0 = 0; h0 < c.group; h0 += part) {
          cpu::AttentionTile at;
          const int64_t off = t0 * q_dim + (int64_t(g) * c.group + h0) * hd;
          at.q = q.data() + off;
          at.q_stride = q_dim;
          at.n_tok = int(std::min<int64_t>(tile, T - t0));
          at.n_head = std::min(part, c.group - h0);
          at.head_dim = hd;
          at.k = kc_.data() + g * hd;
          at.v = vc.data() + g * hd;
          at.kv_stride = kv_dim;
          at.first = first.data() + t0;
          at.last = last.data() + t0;
          at.scale = scale;
          at.out = tiled.data() + off;
          at.out_stride = q_dim;
          at.sinks = c.sinks ? sinks.data() + int64_t(g) * c.group + h0 : nullptr;
          std::vector<float> sc(size_t(cpu::attention_tile_scratch(at)));
          cpu::attention_tile(kc, at, sc.data());
        }
    ASSERT_EQ(std::memcmp(one.data(), tiled.data(), one.size() * sizeof(float)), 0)
        << "family " << k::cpu_kernels_name(kc.family) << ", group " << c.group << ", head_dim " << hd << ", window "
        << c.window << ", sinks " << c.sinks << ", tile " << tile << ", head part " << part;
  }
  for (float x : one) ASSERT_TRUE(std::isfinite(x));
}

}  // namespace

TEST(CpuAttention, TilesEqualOneQueryAtATimeBitForBit) {
  std::vector<k::KernelConfig> fams = {k::resolve_kernels(k::CpuKernels::Scalar)};
  try {
    fams.push_back(k::resolve_kernels(k::CpuKernels::Avx2));
  } catch (const std::exception&) {
    std::printf("no AVX2 on this CPU: the scalar family only\n");
  }
  const Case cases[] = {
      {8, 128, 150, 0, false},  // the 30B shape's group; crosses the 32-position blocks
      {3, 64, 77, 0, true},     // sinks
      {4, 72, 90, 20, false},   // head_dim not a multiple of 16; a window
      {2, 36, 40, 0, false},    // head_dim not a multiple of 8: attention_one per token
      {1, 128, 70, 33, true},   // one head per KV head, window and sinks
  };
  uint64_t seed = 1;
  for (const auto& kc : fams)
    for (const Case& c : cases)
      for (int tile : {1, 4, 5}) check(kc, c, tile, seed++);
}
