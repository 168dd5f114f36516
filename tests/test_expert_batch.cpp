// The CPU backend's queue of expert_ffn calls (src/backend/cpu/expert_batch.h): a layer's
// experts run in one pool loop at flush(), and every output keeps the bits of one
// cpu::matmul per projection per expert (the arithmetic before the queue existed), whatever
// the thread count, the number of experts per flush and the order of the calls.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>

#include "backend/cpu/cpu_backend.h"
#include "backend/cpu/expert_batch.h"
#include "backend/cpu/ops.h"
#include "quant/quant.h"

using namespace strata;
namespace k = strata::cpu::kernels;

namespace {

/// `rows` random rows of type t (`cols` elements each): random code bytes, fp16 scales of
/// order 1/32 at the scale fields of the types used here, so values stay finite and O(1).
std::vector<uint8_t> random_matrix(GgmlType t, int64_t rows, int64_t cols, std::mt19937_64& rng) {
  const size_t rb = quant::row_size(t, cols);
  std::vector<uint8_t> w(rb * size_t(rows));
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  auto put16 = [&](size_t off, uint16_t v) { std::memcpy(w.data() + off, &v, 2); };
  if (t == GgmlType::F16) {
    for (size_t i = 0; i < w.size() / 2; ++i) put16(2 * i, quant::fp32_to_fp16(u(rng) / 8.f));
    return w;
  }
  for (auto& b : w) b = uint8_t(byte(rng));
  std::vector<int> fields;  // byte offsets of the fp16 scales in one block
  switch (t) {
    case GgmlType::Q8_0:
    case GgmlType::IQ4_XS: fields = {0}; break;
    case GgmlType::Q4_K:
    case GgmlType::Q5_K: fields = {0, 2}; break;
    case GgmlType::Q6_K: fields = {208}; break;
    default: throw std::logic_error("random_matrix: type not used by this test");
  }
  const size_t bb = quant::row_size(t, quant::block_elems(t));
  for (size_t b = 0; b < w.size() / bb; ++b)
    for (int off : fields) put16(b * bb + size_t(off), quant::fp32_to_fp16(u(rng) / 32.f));
  return w;
}

struct Types {
  GgmlType gate, up, down;
};

/// A layer of n_expert random experts, T tokens routed to top_k distinct experts each (skewed:
/// expert e drawn with weight 1/(e+1), so token counts per expert are uneven), with biases
/// when `biases`.
struct Layer {
  int64_t n_embd = 256, n_ff = 512, T = 37;
  int n_expert = 12, top_k = 4;
  std::vector<std::vector<uint8_t>> gate, up, down;
  std::vector<std::vector<float>> bg, bu, bd;
  std::vector<float> h;
  std::vector<std::vector<int64_t>> pairs;  // per expert, ascending t * top_k + k
  Types ty;

  Layer(Types types, bool biases, uint64_t seed) : ty(types) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (int e = 0; e < n_expert; ++e) {
      gate.push_back(random_matrix(ty.gate, n_ff, n_embd, rng));
      up.push_back(random_matrix(ty.up, n_ff, n_embd, rng));
      down.push_back(random_matrix(ty.down, n_embd, n_ff, rng));
      auto vec = [&](int64_t n) {
        std::vector<float> v(static_cast<size_t>(n));
        for (auto& x : v) x = u(rng);
        return v;
      };
      bg.push_back(biases ? vec(n_ff) : std::vector<float>{});
      bu.push_back(biases ? vec(n_ff) : std::vector<float>{});
      bd.push_back(biases ? vec(n_embd) : std::vector<float>{});
    }
    h.resize(size_t(T * n_embd));
    for (auto& x : h) x = 2.f * u(rng);
    pairs.assign(size_t(n_expert), {});
    std::vector<double> wt(static_cast<size_t>(n_expert));
    for (int e = 0; e < n_expert; ++e) wt[size_t(e)] = 1.0 / (e + 1);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> left = wt;
      for (int kk = 0; kk < top_k; ++kk) {
        std::discrete_distribution<int> pick(left.begin(), left.end());
        const int e = pick(rng);
        left[size_t(e)] = 0;
        pairs[size_t(e)].push_back(t * top_k + kk);
      }
    }
  }

  backend::ExpertJob job(int e) const {
    backend::ExpertJob j;
    j.expert = e;
    j.w.gate = backend::Tensor::matrix(ty.gate, gate[size_t(e)].data(), n_embd, n_ff, quant::row_size(ty.gate, n_embd));
    j.w.up = backend::Tensor::matrix(ty.up, up[size_t(e)].data(), n_embd, n_ff, quant::row_size(ty.up, n_embd));
    j.w.down = backend::Tensor::matrix(ty.down, down[size_t(e)].data(), n_ff, n_embd, quant::row_size(ty.down, n_ff));
    if (!bg[size_t(e)].empty()) {
      j.w.gate_b = backend::Tensor::f32(const_cast<float*>(bg[size_t(e)].data()), n_ff);
      j.w.up_b = backend::Tensor::f32(const_cast<float*>(bu[size_t(e)].data()), n_ff);
      j.w.down_b = backend::Tensor::f32(const_cast<float*>(bd[size_t(e)].data()), n_embd);
    }
    j.pairs = pairs[size_t(e)];
    return j;
  }
};

/// The expert FFN as it was computed before the queue: per expert, cpu::matmul for gate, up
/// and down (each quantizing its own input in q8 mode), biases and the activation per element.
std::vector<float> reference(const Layer& L, const backend::FfnSpec& spec, const k::KernelConfig& kc) {
  cpu::ThreadPool pool(2);
  std::vector<float> out(size_t(L.T * L.top_k * L.n_embd), 0.f);
  for (int e = 0; e < L.n_expert; ++e) {
    const backend::ExpertJob j = L.job(e);
    const int64_t n = int64_t(j.pairs.size());
    if (n == 0) continue;
    std::vector<float> x(size_t(n * L.n_embd)), g(size_t(n * L.n_ff)), u(size_t(n * L.n_ff)), y(size_t(n * L.n_embd));
    for (int64_t r = 0; r < n; ++r)
      std::copy_n(L.h.data() + (j.pairs[size_t(r)] / L.top_k) * L.n_embd, L.n_embd, x.data() + r * L.n_embd);
    cpu::matmul(pool, kc, cpu::as_matrix(j.w.gate), x.data(), L.n_embd, n, g.data(), L.n_ff);
    cpu::matmul(pool, kc, cpu::as_matrix(j.w.up), x.data(), L.n_embd, n, u.data(), L.n_ff);
    const bool bias = !L.bg[size_t(e)].empty();
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < L.n_ff; ++i) {
        float& gv = g[size_t(r * L.n_ff + i)];
        float& uv = u[size_t(r * L.n_ff + i)];
        if (bias) gv += L.bg[size_t(e)][size_t(i)], uv += L.bu[size_t(e)][size_t(i)];
        gv = spec.act == backend::FfnSpec::Act::SwiGluOai ? cpu::swiglu_oai(gv, uv, spec.alpha, spec.limit)
                                                          : cpu::silu(gv) * uv;
      }
    cpu::matmul(pool, kc, cpu::as_matrix(j.w.down), g.data(), L.n_ff, n, y.data(), L.n_embd);
    for (int64_t r = 0; r < n; ++r) {
      float* o = out.data() + j.pairs[size_t(r)] * L.n_embd;
      for (int64_t i = 0; i < L.n_embd; ++i)
        o[i] = y[size_t(r * L.n_embd + i)] + (bias ? L.bd[size_t(e)][size_t(i)] : 0.f);
    }
  }
  return out;
}

/// Every expert through CpuBackend::expert_ffn with `threads` threads, in the order `order`,
/// flushing after each call (per_call) or once at the end.
std::vector<float> through_backend(const Layer& L, const backend::FfnSpec& spec, const k::KernelConfig& kc, int threads,
                                   const std::vector<int>& order, bool per_call) {
  cpu::CpuBackend be(cpu::CpuOptions{threads, kc});
  std::vector<float> out(size_t(L.T * L.top_k * L.n_embd), 0.f);
  const backend::Tensor h = backend::Tensor::f32(const_cast<float*>(L.h.data()), L.n_embd, L.T);
  const backend::Tensor o = backend::Tensor::f32(out.data(), L.n_embd, L.T * L.top_k);
  for (int e : order) {
    be.expert_ffn(spec, L.job(e), L.top_k, h, o);
    if (per_call) be.flush();
  }
  be.synchronize();
  EXPECT_EQ(be.queued_experts(), 0u);
  return out;
}

bool bit_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Not a trivially equal pair: most outputs finite and nonzero, and of varied values.
void expect_meaningful(const std::vector<float>& y) {
  size_t nonzero = 0;
  for (float v : y) {
    ASSERT_TRUE(std::isfinite(v));
    nonzero += v != 0.f;
  }
  EXPECT_GT(nonzero, y.size() / 2);
}

void check_layer(Types ty, bool biases, backend::FfnSpec::Act act, k::ActQuant aq, uint64_t seed) {
  const k::KernelConfig kc = k::resolve_kernels(k::CpuKernels::Auto, aq);
  const Layer L(ty, biases, seed);
  backend::FfnSpec spec;
  spec.act = act;
  const std::vector<float> ref = reference(L, spec, kc);
  expect_meaningful(ref);
  std::vector<int> order(size_t(L.n_expert));
  std::iota(order.begin(), order.end(), 0);
  for (int threads : {1, 2, 3, 16, 64}) {
    SCOPED_TRACE(testing::Message() << threads << " threads");
    EXPECT_TRUE(bit_equal(through_backend(L, spec, kc, threads, order, false), ref)) << "one flush for the layer";
  }
  for (int threads : {1, 3}) {
    SCOPED_TRACE(testing::Message() << threads << " threads");
    EXPECT_TRUE(bit_equal(through_backend(L, spec, kc, threads, order, true), ref)) << "one flush per expert";
  }
  std::vector<int> shuffled = order;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937_64(seed + 1));
  EXPECT_TRUE(bit_equal(through_backend(L, spec, kc, 2, shuffled, false), ref)) << "experts queued in another order";
}

}  // namespace

TEST(ExpertBatch, OneLoopEqualsOneCallPerExpertQ8_0) {
  check_layer({GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q8_0}, false, backend::FfnSpec::Act::SwiGLU, k::ActQuant::Auto,
              1);
}

TEST(ExpertBatch, OneLoopEqualsOneCallPerExpertKQuantsWithLaneOrders) {
  // Q4_K gate/up (lane-ordered activations), Q6_K down (another lane order), Q5_K up: x is
  // quantized once in gate's order and up's kernel reorders it.
  check_layer({GgmlType::Q4_K, GgmlType::Q4_K, GgmlType::Q6_K}, false, backend::FfnSpec::Act::SwiGLU, k::ActQuant::Auto,
              2);
  check_layer({GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::IQ4_XS}, false, backend::FfnSpec::Act::SwiGLU,
              k::ActQuant::Auto, 3);
}

TEST(ExpertBatch, OneLoopEqualsOneCallPerExpertF32ActivationsAndF16) {
  check_layer({GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q4_K}, false, backend::FfnSpec::Act::SwiGLU, k::ActQuant::F32,
              4);
  check_layer({GgmlType::F16, GgmlType::F16, GgmlType::F16}, false, backend::FfnSpec::Act::SwiGLU, k::ActQuant::Auto,
              5);
}

TEST(ExpertBatch, OneLoopEqualsOneCallPerExpertClampedWithBiases) {
  check_layer({GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q8_0}, true, backend::FfnSpec::Act::SwiGluOai,
              k::ActQuant::Auto, 6);
}

TEST(ExpertBatch, QueuedUntilFlushAndConflictingCallsRunInOrder) {
  const k::KernelConfig kc = k::resolve_kernels();
  const Layer L({GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q8_0}, false, 7);
  backend::FfnSpec spec;
  cpu::CpuBackend be(cpu::CpuOptions{2, kc});
  std::vector<float> out(size_t(L.T * L.top_k * L.n_embd), -1.f);
  const backend::Tensor h = backend::Tensor::f32(const_cast<float*>(L.h.data()), L.n_embd, L.T);
  const backend::Tensor o = backend::Tensor::f32(out.data(), L.n_embd, L.T * L.top_k);
  be.expert_ffn(spec, L.job(0), L.top_k, h, o);
  be.expert_ffn(spec, L.job(1), L.top_k, h, o);
  EXPECT_EQ(be.queued_experts(), 2u);
  EXPECT_EQ(out[size_t(L.pairs[0][0] * L.n_embd)], -1.f) << "nothing runs before the flush";
  float first = 0;
  be.download(&first, o.rows_view(L.pairs[0][0], 1), sizeof(float));  // download runs the queue
  EXPECT_EQ(be.queued_experts(), 0u);
  EXPECT_NE(first, -1.f);
  // Expert 1's job again, then expert 2's weights on expert 1's rows: the second writes rows
  // the first writes, so the queue runs first and the last call wins, as one by one.
  backend::ExpertJob j2 = L.job(2);
  j2.pairs = L.pairs[1];
  be.expert_ffn(spec, L.job(1), L.top_k, h, o);
  be.expert_ffn(spec, j2, L.top_k, h, o);
  EXPECT_EQ(be.queued_experts(), 1u) << "the conflicting call flushed the first";
  be.synchronize();
  std::vector<float> alone(out.size(), -1.f);
  cpu::CpuBackend be1(cpu::CpuOptions{1, kc});
  be1.expert_ffn(spec, j2, L.top_k, h, backend::Tensor::f32(alone.data(), L.n_embd, L.T * L.top_k));
  be1.synchronize();
  for (int64_t p : L.pairs[1])
    EXPECT_EQ(std::memcmp(out.data() + p * L.n_embd, alone.data() + p * L.n_embd, size_t(L.n_embd) * sizeof(float)), 0);
}

TEST(ExpertBatch, BadCallsAreRefusedWhenQueued) {
  const k::KernelConfig kc = k::resolve_kernels();
  const Layer L({GgmlType::Q8_0, GgmlType::Q8_0, GgmlType::Q8_0}, false, 8);
  backend::FfnSpec spec;
  cpu::CpuBackend be(cpu::CpuOptions{2, kc});
  std::vector<float> out(size_t(L.T * L.top_k * L.n_embd));
  const backend::Tensor h = backend::Tensor::f32(const_cast<float*>(L.h.data()), L.n_embd, L.T);
  const backend::Tensor o = backend::Tensor::f32(out.data(), L.n_embd, L.T * L.top_k);
  backend::ExpertJob j = L.job(0);
  const int64_t outside[] = {L.T * L.top_k};
  j.pairs = outside;
  EXPECT_THROW(be.expert_ffn(spec, j, L.top_k, h, o), std::invalid_argument);
  j = L.job(0);
  j.w.down = L.job(0).w.gate;  // ne {n_embd, n_ff}: the wrong way round
  try {
    be.expert_ffn(spec, j, L.top_k, h, o);
    ADD_FAILURE() << "a transposed down was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("down ne {n_ff, 256}"), std::string::npos) << e.what();
  }
  EXPECT_EQ(be.queued_experts(), 0u);
}

TEST(ExpertBatch, EnoughWorkItemsFor64ThreadsOnOneLayer) {
  // The 30B shape (n_embd 2048, n_ff 768, Q8_0): a 512-token prefill chunk's layer (128
  // experts x 32 tokens) and a decode step (8 experts x 1 token).
  const k::KernelConfig kc = k::resolve_kernels();
  const int64_t n_embd = 2048, n_ff = 768;
  const size_t rb_gate = quant::row_size(GgmlType::Q8_0, n_embd), rb_down = quant::row_size(GgmlType::Q8_0, n_ff);
  static const uint8_t dummy = 0;  // never read: planning only
  auto calls = [&](int n_expert, int64_t tokens) {
    std::vector<cpu::ExpertCall> v(static_cast<size_t>(n_expert));
    for (int e = 0; e < n_expert; ++e) {
      v[size_t(e)].w.gate = backend::Tensor::matrix(GgmlType::Q8_0, &dummy, n_embd, n_ff, rb_gate);
      v[size_t(e)].w.up = v[size_t(e)].w.gate;
      v[size_t(e)].w.down = backend::Tensor::matrix(GgmlType::Q8_0, &dummy, n_ff, n_embd, rb_down);
      v[size_t(e)].pairs.resize(size_t(tokens));
    }
    return v;
  };
  for (int threads : {16, 64}) {
    const auto prefill = cpu::expert_batch_items(kc, calls(128, 32), threads);
    const auto decode = cpu::expert_batch_items(kc, calls(8, 1), threads);
    EXPECT_GE(prefill[1], 4 * threads) << threads;
    EXPECT_GE(prefill[3], 4 * threads) << threads;
    EXPECT_GE(decode[1], 4 * threads) << threads;
    EXPECT_GE(decode[3], 4 * threads) << threads;
    std::printf(
        "%d threads: prefill items %lld gather, %lld gate/up, %lld quantize, %lld down; decode %lld gate/up, "
        "%lld down\n",
        threads, (long long)prefill[0], (long long)prefill[1], (long long)prefill[2], (long long)prefill[3],
        (long long)decode[1], (long long)decode[3]);
  }
}
