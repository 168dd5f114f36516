// The CUDA kernels (src/backend/cuda/kernels.h) against the CPU references: quant::dequantize_row
// with a double-precision dot for matmul, cpu::rms_norm / backend::softmax / silu / cpu::rope_apply / the gated delta
// net block for the rest, and a double-precision softmax attention. Plus batch invariance: a
// token's outputs are bit-identical alone, in small batches and in a batch of 2048, on both
// matmul paths, and attention gives the same bits in decode and in any prefill chunking.
// Without a CUDA device every test that needs one skips, saying so.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/gated_delta_net.h"
#include "backend/cpu/kernels/act_q8.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/thread_pool.h"
#include "backend/cuda/attention_mma.h"
#include "backend/cuda/family_kernels.h"
#include "backend/cuda/kernels.h"
#include "quant/quant.h"

namespace cuda = strata::cuda;
namespace quant = strata::quant;
namespace cpu = strata::cpu;
using strata::GgmlType;

namespace {

#define REQUIRE_CUDA_DEVICE()                                                                                \
  do {                                                                                                       \
    if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device found (cudaGetDeviceCount reports none)"; \
  } while (0)

const GgmlType kAllTypes[] = {GgmlType::F32,    GgmlType::F16,    GgmlType::BF16, GgmlType::Q8_0,   GgmlType::Q4_0,
                              GgmlType::Q4_1,   GgmlType::Q5_0,   GgmlType::Q5_1, GgmlType::Q2_K,   GgmlType::Q3_K,
                              GgmlType::Q4_K,   GgmlType::Q5_K,   GgmlType::Q6_K, GgmlType::IQ2_XS, GgmlType::IQ3_S,
                              GgmlType::IQ4_XS, GgmlType::IQ4_NL, GgmlType::MXFP4};

template <class T>
cuda::DeviceBuffer upload(const std::vector<T>& v) {
  cuda::DeviceBuffer b(std::max<size_t>(1, v.size() * sizeof(T)));
  if (!v.empty()) cuda::copy_to_device(b.get(), v.data(), v.size() * sizeof(T));
  return b;
}
template <class T>
std::vector<T> download(const cuda::DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  cuda::synchronize();
  if (n) cuda::copy_to_host(v.data(), b.get(), n * sizeof(T));
  return v;
}

void put_half(uint8_t* p, float f) {
  const uint16_t h = quant::fp32_to_fp16(f);
  std::memcpy(p, &h, 2);
}

/// Random rows of type t: random bytes (every code and grid index is valid: the grids have
/// 512 entries and 9-bit indices, ksigns 128 and 7-bit ones), then sane fp16 scales
/// (|d| in [2^-8, 2^-6], random sign for the K-quant mins) and MXFP4 exponents in [118, 132].
std::vector<uint8_t> random_rows(GgmlType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  const size_t rb = quant::row_size(t, cols);
  std::vector<uint8_t> w(rb * rows);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> mag(1.0f / 256, 1.0f / 64), uni(-1.0f, 1.0f);
  if (t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16) {
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float f = uni(rng);
      if (t == GgmlType::F32)
        std::memcpy(&w[4 * i], &f, 4);
      else {
        const uint16_t h = t == GgmlType::F16 ? quant::fp32_to_fp16(f) : quant::fp32_to_bf16(f);
        std::memcpy(&w[2 * i], &h, 2);
      }
    }
    return w;
  }
  for (auto& b : w) b = uint8_t(byte(rng));
  const int be = quant::block_elems(t);
  const size_t bb = quant::row_size(t, be);
  auto sgn = [&] { return byte(rng) & 1 ? -1.0f : 1.0f; };
  for (size_t off = 0; off + bb <= w.size(); off += bb) {
    uint8_t* b = &w[off];
    switch (t) {
      case GgmlType::Q4_1:
      case GgmlType::Q5_1:
        put_half(b, mag(rng));
        put_half(b + 2, sgn() * mag(rng) * 8);
        break;
      case GgmlType::Q2_K:
        put_half(b + 80, mag(rng));
        put_half(b + 82, sgn() * mag(rng));
        break;
      case GgmlType::Q3_K: put_half(b + 108, mag(rng)); break;
      case GgmlType::Q4_K:
      case GgmlType::Q5_K:
        put_half(b, mag(rng));
        put_half(b + 2, sgn() * mag(rng));
        break;
      case GgmlType::Q6_K: put_half(b + 208, mag(rng)); break;
      case GgmlType::MXFP4: b[0] = uint8_t(118 + byte(rng) % 15); break;
      default: put_half(b, sgn() * mag(rng)); break;  // Q8_0, Q4_0, Q5_0, IQ4_NL, IQ2_XS, IQ3_S, IQ4_XS
    }
  }
  return w;
}

std::vector<float> random_floats(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

/// cols that exercise each type: a partial 256-column chunk for the 32-weight types, a
/// multiple of 8 but not of 256 for the plain ones.
int64_t test_cols(GgmlType t) {
  const int be = quant::block_elems(t);
  if (be == 256) return 768;
  if (be == 32) return 608;
  return 520;
}

bool bits_equal(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

}  // namespace

TEST(CudaKernels, UnsupportedTypeIsAClearError) {
  // checked on the host before any CUDA call, so this runs without a device too
  try {
    cuda::matmul(GgmlType::IQ1_S, nullptr, 50, 1, 256, nullptr, 256, 1, nullptr, 1);
    FAIL() << "no exception";
  } catch (const cuda::CudaError& e) {
    EXPECT_NE(std::string(e.what()).find("IQ1_S"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cuda::get_rows(GgmlType::Q8_K, nullptr, 292, 256, nullptr, 1, nullptr, 256), cuda::CudaError);
  for (GgmlType t : kAllTypes) EXPECT_TRUE(cuda::is_supported(t));
}

TEST(CudaKernels, DeviceInfo) {
  REQUIRE_CUDA_DEVICE();
  std::printf("device 0: %s\n", cuda::device_description(0).c_str());
}

// Embedding rows are the decoders' output: bit-identical with quant::dequantize_row.
TEST(CudaKernels, GetRowsBitExactWithReference) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(11);
  for (GgmlType t : kAllTypes) {
    SCOPED_TRACE(quant::is_supported(t) ? strata::ggml_type_name(t) : "?");
    const int64_t rows = 23, cols = test_cols(t);
    const size_t rb = quant::row_size(t, cols);
    const auto w = random_rows(t, rows, cols, rng);
    std::vector<int32_t> ids = {0, 5, 22, 5, 17, 1, 22, 9};
    auto dw = upload(w);
    auto dids = upload(ids);
    cuda::DeviceBuffer dout(ids.size() * cols * 4);
    cuda::get_rows(t, dw.get(), rb, cols, dids.as<int32_t>(), int64_t(ids.size()), dout.as<float>(), cols);
    const auto out = download<float>(dout, ids.size() * cols);
    std::vector<float> ref(cols);
    int64_t mismatches = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      quant::dequantize_row(t, w.data() + ids[i] * rb, ref.data(), cols);
      for (int64_t c = 0; c < cols; ++c) mismatches += !bits_equal(out[i * cols + c], ref[c]);
    }
    EXPECT_EQ(mismatches, 0);
  }
}

// matmul against dequantize_row + a double dot. Bound (kernels.h): fp32 FMA accumulation of
// cols/32 terms per lane, then 5 butterfly additions, with exactly dequantized weights:
// |y - exact| <= (cols/32 + 6) * 2^-24 * sum |w x| to first order; we allow 1.05 times that.
TEST(CudaKernels, MatmulMatchesReferenceAllTypes) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(7);
  for (GgmlType t : kAllTypes) {
    const std::string name = strata::ggml_type_name(t);
    const int64_t rows = 37, cols = test_cols(t);
    const size_t rb = quant::row_size(t, cols);
    const auto w = random_rows(t, rows, cols, rng);
    std::vector<double> wd(rows * cols);
    {
      std::vector<float> tmp(cols);
      for (int64_t r = 0; r < rows; ++r) {
        quant::dequantize_row(t, w.data() + r * rb, tmp.data(), cols);
        for (int64_t c = 0; c < cols; ++c) wd[r * cols + c] = tmp[c];
      }
    }
    auto dw = upload(w);
    double worst_ratio = 0, worst_abs = 0;
    for (int64_t n_tok : {1, 3, 64, 300}) {
      for (cuda::MatmulPath path : {cuda::MatmulPath::MatVec, cuda::MatmulPath::Tiled}) {
        SCOPED_TRACE(name + " n_tok=" + std::to_string(n_tok) +
                     (path == cuda::MatmulPath::Tiled ? " tiled" : " matvec"));
        const int64_t ldx = cols + 4, ldy = rows + 3;
        const auto x = random_floats(size_t(n_tok * ldx), rng);
        auto dx = upload(x);
        cuda::DeviceBuffer dy(size_t(n_tok * ldy) * 4);
        cuda::matmul(t, dw.get(), rb, rows, cols, dx.as<float>(), ldx, n_tok, dy.as<float>(), ldy, nullptr, path);
        const auto y = download<float>(dy, size_t(n_tok * ldy));
        int64_t bad = 0;
        for (int64_t tk = 0; tk < n_tok; ++tk)
          for (int64_t r = 0; r < rows; ++r) {
            double s = 0, sa = 0;
            for (int64_t c = 0; c < cols; ++c) {
              const double p = wd[r * cols + c] * double(x[tk * ldx + c]);
              s += p, sa += std::fabs(p);
            }
            const double err = std::fabs(double(y[tk * ldy + r]) - s);
            const double bound = 1.05 * (double(cols) / 32 + 6) * 0x1p-24 * sa + 1e-30;
            worst_ratio = std::max(worst_ratio, err / bound);
            worst_abs = std::max(worst_abs, err);
            bad += err > bound;
          }
        EXPECT_EQ(bad, 0);
      }
    }
    std::printf("matmul %-6s cols=%lld: max |err| %.3g, max err/bound %.3f\n", name.c_str(), (long long)cols, worst_abs,
                worst_ratio);
  }
}

// The same token's outputs, bit for bit: alone (both paths), at another offset of a batch of 3,
// and inside a batch of 2048 (tiled), for every type.
TEST(CudaKernels, MatmulBatchInvariance) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(5);
  const int64_t big = 2048;
  const int64_t probe[] = {0, 1, 7, 8, 9, 1000, 2046, 2047};
  for (GgmlType t : kAllTypes) {
    SCOPED_TRACE(strata::ggml_type_name(t));
    const int64_t rows = 40, cols = test_cols(t), ldx = cols;
    const size_t rb = quant::row_size(t, cols);
    auto dw = upload(random_rows(t, rows, cols, rng));
    const auto x = random_floats(size_t(big * ldx), rng);
    auto dx = upload(x);
    cuda::DeviceBuffer dy(size_t(big * rows) * 4), d1(size_t(rows) * 4), d3(size_t(3 * rows) * 4);
    cuda::matmul(t, dw.get(), rb, rows, cols, dx.as<float>(), ldx, big, dy.as<float>(), rows);
    const auto y = download<float>(dy, size_t(big * rows));
    int64_t mismatches = 0;
    // Auto takes the tensor-core path for its types at every n_tok; the fp32 paths are compared otherwise.
    std::vector<cuda::MatmulPath> paths = {cuda::MatmulPath::MatVec, cuda::MatmulPath::Tiled};
    if (cuda::has_mma(t, cols)) paths = {cuda::MatmulPath::Mma};
    for (int64_t p : probe) {
      for (cuda::MatmulPath path : paths) {
        cuda::matmul(t, dw.get(), rb, rows, cols, dx.as<float>() + p * ldx, ldx, 1, d1.as<float>(), rows, nullptr,
                     path);
        const auto y1 = download<float>(d1, size_t(rows));
        for (int64_t r = 0; r < rows; ++r) mismatches += !bits_equal(y1[r], y[p * rows + r]);
      }
      // token p as the last of 3 (rows p-2, p-1, p), on the default (mat-vec) path
      if (p >= 2) {
        cuda::matmul(t, dw.get(), rb, rows, cols, dx.as<float>() + (p - 2) * ldx, ldx, 3, d3.as<float>(), rows);
        const auto y3 = download<float>(d3, size_t(3 * rows));
        for (int64_t r = 0; r < rows; ++r) mismatches += !bits_equal(y3[2 * rows + r], y[p * rows + r]);
      }
    }
    EXPECT_EQ(mismatches, 0);
  }
}

// The tensor-core path (MatmulPath::Mma) against dequantize_row + a double dot. Bound
// (kernels.h): |y - exact| <= (cols/16 + 8) * 2^-23 * sum |w x|: the activations enter exactly
// (three bf16 pieces), the weights as exact codes, so only the fp32 sums round (the tensor
// cores' per group, then the fold per group).
const GgmlType kMmaTypes[] = {GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::BF16};

TEST(CudaKernels, MmaMatmulMatchesReference) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(11);
  for (GgmlType t : kMmaTypes) {
    const std::string name = strata::ggml_type_name(t);
    const int64_t rows = 77, cols = t == GgmlType::BF16 ? 608 : test_cols(t);
    ASSERT_TRUE(cuda::has_mma(t, cols));
    const size_t rb = quant::row_size(t, cols);
    const auto w = random_rows(t, rows, cols, rng);
    std::vector<double> wd(rows * cols);
    {
      std::vector<float> tmp(cols);
      for (int64_t r = 0; r < rows; ++r) {
        quant::dequantize_row(t, w.data() + r * rb, tmp.data(), cols);
        for (int64_t c = 0; c < cols; ++c) wd[r * cols + c] = tmp[c];
      }
    }
    auto dw = upload(w);
    double worst_ratio = 0, worst_abs = 0;
    for (int64_t n_tok : {1, 3, 9, 40, 300}) {
      SCOPED_TRACE(name + " n_tok=" + std::to_string(n_tok));
      const int64_t ldx = cols + 4, ldy = rows + 3;
      // activations over a wide range of magnitudes (the three pieces must carry all 24 bits)
      auto x = random_floats(size_t(n_tok * ldx), rng);
      for (size_t i = 0; i < x.size(); i += 3) x[i] *= 1000.0f;
      for (size_t i = 1; i < x.size(); i += 7) x[i] *= 1e-3f;
      auto dx = upload(x);
      std::vector<float> poison(size_t(n_tok * ldy), std::nanf(""));
      auto dy = upload(poison);
      cuda::matmul(t, dw.get(), rb, rows, cols, dx.as<float>(), ldx, n_tok, dy.as<float>(), ldy, nullptr,
                   cuda::MatmulPath::Mma);
      const auto y = download<float>(dy, size_t(n_tok * ldy));
      int64_t bad = 0;
      for (int64_t tk = 0; tk < n_tok; ++tk)
        for (int64_t r = 0; r < rows; ++r) {
          double sm = 0, sa = 0;
          for (int64_t c = 0; c < cols; ++c) {
            const double p = wd[r * cols + c] * double(x[tk * ldx + c]);
            sm += p, sa += std::fabs(p);
          }
          const double err = std::fabs(double(y[tk * ldy + r]) - sm);
          const double bound = (double(cols) / 16 + 8) * 0x1p-23 * sa + 1e-30;
          worst_ratio = std::max(worst_ratio, err / bound);
          worst_abs = std::max(worst_abs, err);
          bad += !(err <= bound);  // NaN (an unwritten element) counts
        }
      EXPECT_EQ(bad, 0);
    }
    std::printf("mma matmul %-5s cols=%lld: max |err| %.3g, max err/bound %.3f\n", name.c_str(), (long long)cols,
                worst_abs, worst_ratio);
  }
  // the tensor-core path refuses what it does not take
  EXPECT_FALSE(cuda::has_mma(GgmlType::Q5_K, 256));
  EXPECT_FALSE(cuda::has_mma(GgmlType::BF16, 520));
  EXPECT_THROW(cuda::matmul(GgmlType::Q5_K, nullptr, 176, 1, 256, nullptr, 256, 1, nullptr, 1, nullptr,
                            cuda::MatmulPath::Mma),
               cuda::CudaError);
}

// grouped_matmul over jobs of different sizes = matmul (Mma) on each job's rows alone, bit for
// bit; and the SwiGLU pair = matmul(gate), matmul(up), swiglu.
TEST(CudaKernels, GroupedMatmulEqualsPerJob) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(13);
  // a prefill-like group (the 32/64-token tiles) and a decode-like one (all <= 8: the small kernel)
  const std::vector<int64_t> size_sets[] = {{1, 5, 37, 64, 65, 130, 2, 300}, {1, 3, 8, 2, 1}};
  for (const auto& sizes : size_sets)
    for (GgmlType t : kMmaTypes) {
      const int nj = int(sizes.size());
      SCOPED_TRACE(strata::ggml_type_name(t) + " jobs=" + std::to_string(nj));
      const int64_t rows = 96, cols = 1280;  // 2.5 chunks of 512
      const size_t rb = quant::row_size(t, cols);
      std::vector<cuda::DeviceBuffer> wg, wu;
      for (int i = 0; i < nj; ++i) {
        wg.push_back(upload(random_rows(t, rows, cols, rng)));
        wu.push_back(upload(random_rows(t, rows, cols, rng)));
      }
      int64_t total = 0;
      for (int64_t n : sizes) total += n;
      const auto x = random_floats(size_t(total * cols), rng);
      auto dx = upload(x);
      for (bool pair : {false, true}) {
        std::vector<cuda::GroupedMatmulJob> jobs(static_cast<size_t>(nj));
        int64_t row0 = 0;
        for (int i = 0; i < nj; ++i) {
          jobs[size_t(i)].w = wg[size_t(i)].get(), jobs[size_t(i)].w2 = wu[size_t(i)].get();
          jobs[size_t(i)].row0 = row0, jobs[size_t(i)].n_tok = sizes[i];
          row0 += sizes[i];
        }
        const cuda::GroupedMatmulPlan plan = cuda::plan_grouped(jobs.data(), nj, rows, cols, pair);
        auto djobs = upload(jobs);
        std::vector<float> poison(size_t(total * rows), std::nanf(""));
        auto dy = upload(poison);
        cuda::grouped_matmul(plan, t, djobs.as<cuda::GroupedMatmulJob>(), nj, rb, rows, cols, dx.as<float>(), cols,
                             dy.as<float>(), rows, pair);
        const auto y = download<float>(dy, size_t(total * rows));
        int64_t mismatches = 0;
        for (int i = 0; i < nj; ++i) {
          const int64_t n = sizes[i], r0 = jobs[size_t(i)].row0;
          cuda::DeviceBuffer g(size_t(n * rows) * 4), u(size_t(n * rows) * 4);
          const float* xi = dx.as<float>() + r0 * cols;
          cuda::matmul(t, wg[size_t(i)].get(), rb, rows, cols, xi, cols, n, g.as<float>(), rows);
          if (pair) {
            cuda::matmul(t, wu[size_t(i)].get(), rb, rows, cols, xi, cols, n, u.as<float>(), rows);
            cuda::swiglu(g.as<float>(), u.as<float>(), g.as<float>(), n * rows);
          }
          const auto yi = download<float>(g, size_t(n * rows));
          for (int64_t k = 0; k < n * rows; ++k) mismatches += !bits_equal(yi[size_t(k)], y[size_t(r0 * rows + k)]);
        }
        EXPECT_EQ(mismatches, 0) << (pair ? "swiglu pair" : "plain");
      }
    }
}

// The two stagings of the tensor-core kernels (cuda::mma_kernel_version: 1 = 32-bit fragment
// loads, 2 = ldmatrix with double buffering; for <= 8 tokens mma_small vs mma_small2's group-
// parallel rounds) compute every element with the same MMAs and the same fold: bit-identical
// outputs, for plain matmuls at every token tile (n_tok 1..300) with a ragged last row block and
// chunk, and for grouped plain and SwiGLU-pair launches of prefill-like and decode-like groups.
// Version 2 is also the one every other test here checks against the scalar reference.
TEST(CudaKernels, MmaKernelVersionsBitIdentical) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(17);
  const int before = cuda::mma_kernel_version();
  EXPECT_THROW(cuda::set_mma_kernel_version(3), std::invalid_argument);
  auto run_both = [&](auto&& fn, size_t n) {
    std::vector<float> out[2];
    for (int v : {1, 2}) {
      cuda::set_mma_kernel_version(v);
      out[v - 1] = fn(n);
    }
    cuda::set_mma_kernel_version(before);
    int64_t mismatches = 0;
    for (size_t i = 0; i < n; ++i) mismatches += !bits_equal(out[0][i], out[1][i]);
    return mismatches;
  };
  for (GgmlType t : kMmaTypes) {
    SCOPED_TRACE(strata::ggml_type_name(t));
    const int64_t rows = 200, cols = 1280;  // a partial row block of 64; 2.5 chunks of 512
    const size_t rb = quant::row_size(t, cols);
    auto dw = upload(random_rows(t, rows, cols, rng));
    auto dw2 = upload(random_rows(t, rows, cols, rng));
    const int64_t max_tok = 300;
    auto dx = upload(random_floats(size_t(max_tok * cols), rng));
    for (int64_t n : {1, 3, 8, 9, 32, 33, 64, 65, 300}) {
      const size_t ny = size_t(n * rows);
      const int64_t bad = run_both(
          [&](size_t m) {
            std::vector<float> poison(m, std::nanf(""));
            auto dy = upload(poison);
            cuda::matmul(t, dw.get(), rb, rows, cols, dx.as<float>(), cols, n, dy.as<float>(), rows, nullptr,
                         cuda::MatmulPath::Mma);
            return download<float>(dy, m);
          },
          ny);
      EXPECT_EQ(bad, 0) << "n_tok " << n;
    }
    for (const std::vector<int64_t>& sizes :
         {std::vector<int64_t>{40, 3, 64, 130, 17}, std::vector<int64_t>{1, 3, 8, 2}})
      for (bool pair : {false, true}) {
        std::vector<cuda::GroupedMatmulJob> jobs(sizes.size());
        int64_t row0 = 0;
        for (size_t i = 0; i < sizes.size(); ++i) {
          jobs[i].w = i % 2 ? dw2.get() : dw.get(), jobs[i].w2 = i % 2 ? dw.get() : dw2.get();
          jobs[i].row0 = row0, jobs[i].n_tok = sizes[i];
          row0 += sizes[i];
        }
        const cuda::GroupedMatmulPlan plan = cuda::plan_grouped(jobs.data(), int(jobs.size()), rows, cols, pair);
        auto djobs = upload(jobs);
        const int64_t bad = run_both(
            [&](size_t m) {
              std::vector<float> poison(m, std::nanf(""));
              auto dy = upload(poison);
              cuda::grouped_matmul(plan, t, djobs.as<cuda::GroupedMatmulJob>(), int(jobs.size()), rb, rows, cols,
                                   dx.as<float>(), cols, dy.as<float>(), rows, pair);
              return download<float>(dy, m);
            },
            size_t(row0 * rows));
        EXPECT_EQ(bad, 0) << (pair ? "grouped swiglu pair" : "grouped plain");
      }
  }
}

// RMSNorm: cpu::rms_norm differs only in the order of the double sum of squares, so the scale
// agrees to <= 1 ulp; relative tolerance 4 * 2^-24 per element.
TEST(CudaKernels, RmsNormMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(3);
  const int64_t n = 1000, n_rows = 37, ld = 1003;
  const auto x = random_floats(size_t(n_rows * ld), rng, -3, 3);
  const auto w = random_floats(size_t(n), rng, 0.5f, 1.5f);
  auto dx = upload(x), dw = upload(w);
  cuda::DeviceBuffer dy(size_t(n_rows * n) * 4);
  cuda::rms_norm(dx.as<float>(), ld, dw.as<float>(), dy.as<float>(), n, n, n_rows, 1e-6f);
  const auto y = download<float>(dy, size_t(n_rows * n));
  double worst = 0;
  std::vector<float> ref(n);
  for (int64_t r = 0; r < n_rows; ++r) {
    cpu::rms_norm(x.data() + r * ld, w.data(), ref.data(), n, 1e-6f);
    for (int64_t i = 0; i < n; ++i)
      worst = std::max(worst, std::fabs(double(y[r * n + i]) - ref[i]) / (std::fabs(double(ref[i])) + 1e-30));
  }
  std::printf("rms_norm: max rel err %.3g\n", worst);
  EXPECT_LE(worst, 4 * 0x1p-24);
}

// rms_norm and add_rms_norm against a host replica of their arithmetic, bit for bit: thread t of
// the 256 sums the squares of its values t + 256 j in j order (in double), the partial sums meet
// in the shared-memory tree (s = 128, 64, ..., 1: sum[t] = sum[t] + sum[t + s]), then
// y = (x * float(1 / sqrt(sum / n + eps))) * w in float. The widths cover each register variant
// (up to 2048, 4096 and 8192 values a row) at and past its edge, and the loop past 8192; in place
// (y = x) too, as the gated delta net calls it.
TEST(CudaKernels, RmsNormIsTheBlockTreeOrderBitForBit) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(17);
  auto replica = [](const float* x, const float* w, float* y, int64_t n, float eps) {
    double part[256];
    for (int t = 0; t < 256; ++t) {
      double ss = 0;
      for (int64_t i = t; i < n; i += 256) ss += double(x[i]) * double(x[i]);
      part[t] = ss;
    }
    for (int s = 128; s > 0; s /= 2)
      for (int t = 0; t < s; ++t) part[t] = part[t] + part[t + s];
    const float scale = float(1.0 / std::sqrt(part[0] / double(n) + double(eps)));
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * scale) * w[i];
  };
  for (int regs : {1, 0})  // registers (STRATA_CUDA_NORM_REGS=1), then the loop for every width
    for (int64_t n :
         {int64_t(100), int64_t(2048), int64_t(2049), int64_t(4096), int64_t(5000), int64_t(8192), int64_t(9001)}) {
      cuda::set_norm_regs(regs);
      SCOPED_TRACE("n=" + std::to_string(n) + (regs ? "" : ", the loop"));
      const int64_t n_rows = 3, ld = n + 7;
      const auto x = random_floats(size_t(n_rows * ld), rng, -3, 3);
      const auto r = random_floats(size_t(n_rows * ld), rng, -3, 3);
      const auto w = random_floats(size_t(n), rng, 0.5f, 1.5f);
      std::vector<float> sum = x, want(size_t(n_rows * ld)), want_sum(size_t(n_rows * ld));
      for (int64_t row = 0; row < n_rows; ++row) {
        for (int64_t i = 0; i < n; ++i) sum[size_t(row * ld + i)] = x[size_t(row * ld + i)] + r[size_t(row * ld + i)];
        replica(sum.data() + row * ld, w.data(), want_sum.data() + row * ld, n, 1e-6f);
        replica(x.data() + row * ld, w.data(), want.data() + row * ld, n, 1e-6f);
      }
      auto dx = upload(x), dr = upload(r), dw = upload(w), dinplace = upload(x), dsum = upload(x);
      cuda::DeviceBuffer dy(size_t(n_rows * ld) * 4), dout(size_t(n_rows * ld) * 4);
      cuda::rms_norm(dx.as<float>(), ld, dw.as<float>(), dy.as<float>(), ld, n, n_rows, 1e-6f);
      cuda::rms_norm(dinplace.as<float>(), ld, dw.as<float>(), dinplace.as<float>(), ld, n, n_rows, 1e-6f);
      cuda::add_rms_norm(dsum.as<float>(), ld, dr.as<float>(), ld, dw.as<float>(), dout.as<float>(), ld, n, n_rows,
                         1e-6f);
      const auto y = download<float>(dy, x.size()), yi = download<float>(dinplace, x.size());
      const auto s2 = download<float>(dsum, x.size()), o = download<float>(dout, x.size());
      int64_t differ[4] = {};
      for (int64_t row = 0; row < n_rows; ++row)
        for (int64_t i = 0; i < n; ++i) {
          const size_t k = size_t(row * ld + i);
          differ[0] += !bits_equal(y[k], want[k]);
          differ[1] += !bits_equal(yi[k], want[k]);
          differ[2] += !bits_equal(s2[k], sum[k]);
          differ[3] += !bits_equal(o[k], want_sum[k]);
        }
      EXPECT_EQ(differ[0], 0) << "rms_norm";
      EXPECT_EQ(differ[1], 0) << "rms_norm in place";
      EXPECT_EQ(differ[2], 0) << "add_rms_norm's sum";
      EXPECT_EQ(differ[3], 0) << "add_rms_norm's norm";
    }
  cuda::set_norm_regs(-1);
}

// The fused residual add + RMSNorm against add then rms_norm: bit for bit (x and out), on rows of
// several widths (one under the block's 256 threads, one over several strides).
TEST(CudaKernels, AddRmsNormEqualsAddThenRmsNorm) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(31);
  for (int64_t n : {int64_t(100), int64_t(2048), int64_t(4099)}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const int64_t n_rows = 7, ldx = n + 5, ldy = n + 3, ldo = n + 1;
    const auto x = random_floats(size_t(n_rows * ldx), rng, -3, 3);
    const auto y = random_floats(size_t(n_rows * ldy), rng, -3, 3);
    const auto w = random_floats(size_t(n), rng, 0.5f, 1.5f);
    auto dx1 = upload(x), dx2 = upload(x), dy = upload(y), dw = upload(w);
    cuda::DeviceBuffer do1(size_t(n_rows * ldo) * 4), do2(size_t(n_rows * ldo) * 4);
    for (int64_t r = 0; r < n_rows; ++r)
      cuda::add(dx1.as<float>() + r * ldx, dy.as<float>() + r * ldy, dx1.as<float>() + r * ldx, n);
    cuda::rms_norm(dx1.as<float>(), ldx, dw.as<float>(), do1.as<float>(), ldo, n, n_rows, 1e-6f);
    cuda::add_rms_norm(dx2.as<float>(), ldx, dy.as<float>(), ldy, dw.as<float>(), do2.as<float>(), ldo, n, n_rows,
                       1e-6f);
    const auto x1 = download<float>(dx1, x.size()), x2 = download<float>(dx2, x.size());
    const auto o1 = download<float>(do1, size_t(n_rows * ldo)), o2 = download<float>(do2, size_t(n_rows * ldo));
    int64_t differ = 0;
    for (int64_t r = 0; r < n_rows; ++r)
      for (int64_t i = 0; i < n; ++i)
        differ += !bits_equal(x1[r * ldx + i], x2[r * ldx + i]) + !bits_equal(o1[r * ldo + i], o2[r * ldo + i]);
    EXPECT_EQ(differ, 0);
  }
  EXPECT_THROW(cuda::add_rms_norm(nullptr, 4, nullptr, 8, nullptr, nullptr, 8, 8, 1, 1e-6f), cuda::CudaError);
}

// The fused q/k RMSNorm + NEOX RoPE against rms_norm per head then rope_neox on q and k: bit for
// bit, with full and partial rotation, with and without norm weights, one token (decode) and many.
TEST(CudaKernels, QkNormRopeEqualsSeparateKernels) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(32);
  struct Case {
    int n_head, n_head_kv, head_dim, n_rot;
    bool q_norm, k_norm;
    int64_t n_tok, pos0;
  };
  const Case cases[] = {{32, 4, 128, 128, true, true, 1, 2047}, {32, 4, 128, 128, true, true, 19, 300},
                        {6, 2, 64, 32, true, false, 5, 0},      {6, 3, 64, 64, false, false, 3, 70000},
                        {8, 8, 256, 64, false, true, 2, 12},    {4, 1, 576, 64, true, true, 2, 5},
                        {32, 4, 128, 128, true, true, 70, 0},   {5, 1, 80, 40, true, true, 66, 9},
                        {8, 8, 256, 64, false, true, 65, 12},   {3, 1, 96, 32, true, true, 64, 4}};
  for (const Case& c : cases) {
    SCOPED_TRACE("heads " + std::to_string(c.n_head) + "/" + std::to_string(c.n_head_kv) + " dim " +
                 std::to_string(c.head_dim) + " rot " + std::to_string(c.n_rot) + " T " + std::to_string(c.n_tok));
    const int64_t ldq = int64_t(c.n_head) * c.head_dim + 8, ldk = int64_t(c.n_head_kv) * c.head_dim;
    const auto q = random_floats(size_t(c.n_tok * ldq), rng, -3, 3);
    const auto k = random_floats(size_t(c.n_tok * ldk), rng, -3, 3);
    const auto qw = random_floats(size_t(c.head_dim), rng, 0.5f, 1.5f);
    const auto kw = random_floats(size_t(c.head_dim), rng, 0.5f, 1.5f);
    const auto rope = strata::backend::RopeSpec::standard(c.n_rot, 1e6);
    std::vector<int32_t> pos(size_t(c.n_tok));
    for (int64_t t = 0; t < c.n_tok; ++t) pos[size_t(t)] = int32_t(c.pos0 + t);
    auto dq1 = upload(q), dq2 = upload(q), dk1 = upload(k), dk2 = upload(k), dqw = upload(qw), dkw = upload(kw);
    auto dpos = upload(pos), dfreq = upload(rope.inv_freq);
    const float eps = 1e-6f;
    // rows of head_dim inside rows of ldq: norm token by token (ldq has padding after the heads)
    for (int64_t t = 0; t < c.n_tok; ++t) {
      if (c.q_norm)
        cuda::rms_norm(dq1.as<float>() + t * ldq, c.head_dim, dqw.as<float>(), dq1.as<float>() + t * ldq, c.head_dim,
                       c.head_dim, c.n_head, eps);
      if (c.k_norm)
        cuda::rms_norm(dk1.as<float>() + t * ldk, c.head_dim, dkw.as<float>(), dk1.as<float>() + t * ldk, c.head_dim,
                       c.head_dim, c.n_head_kv, eps);
    }
    cuda::rope_neox(dq1.as<float>(), ldq, c.n_tok, c.n_head, c.head_dim, c.n_rot, dpos.as<int32_t>(),
                    dfreq.as<double>());
    cuda::rope_neox(dk1.as<float>(), ldk, c.n_tok, c.n_head_kv, c.head_dim, c.n_rot, dpos.as<int32_t>(),
                    dfreq.as<double>());
    cuda::qk_norm_rope(dq2.as<float>(), ldq, c.n_head, dk2.as<float>(), ldk, c.n_head_kv, c.head_dim, c.n_tok,
                       c.q_norm ? dqw.as<float>() : nullptr, c.k_norm ? dkw.as<float>() : nullptr, eps, c.n_rot,
                       c.pos0, dfreq.as<double>());
    const auto q1 = download<float>(dq1, q.size()), q2 = download<float>(dq2, q.size());
    const auto k1 = download<float>(dk1, k.size()), k2 = download<float>(dk2, k.size());
    int64_t differ = 0, changed = 0;
    for (size_t i = 0; i < q.size(); ++i) differ += !bits_equal(q1[i], q2[i]), changed += !bits_equal(q1[i], q[i]);
    for (size_t i = 0; i < k.size(); ++i) differ += !bits_equal(k1[i], k2[i]);
    EXPECT_EQ(differ, 0);
    EXPECT_GT(changed, 0);  // the reference did rotate (and norm) something
  }
  EXPECT_THROW(cuda::qk_norm_rope(nullptr, 128, 1, nullptr, 128, 1, 128, 1, nullptr, nullptr, 1e-6f, 3, 0, nullptr),
               cuda::CudaError);
}

TEST(CudaKernels, AddSwigluSoftmaxMatchCpu) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(4);
  const int64_t n = 100003;
  const auto a = random_floats(size_t(n), rng, -8, 8), b = random_floats(size_t(n), rng, -8, 8);
  auto da = upload(a), db = upload(b);
  cuda::DeviceBuffer dy(size_t(n) * 4);
  cuda::add(da.as<float>(), db.as<float>(), dy.as<float>(), n);
  auto y = download<float>(dy, size_t(n));
  int64_t add_bad = 0;
  for (int64_t i = 0; i < n; ++i) add_bad += !bits_equal(y[i], a[i] + b[i]);
  EXPECT_EQ(add_bad, 0) << "add is exact";
  // silu(g) * u: CUDA expf is within 2 ulp, then a division and a product: 8 * 2^-24 relative
  cuda::swiglu(da.as<float>(), db.as<float>(), dy.as<float>(), n);
  y = download<float>(dy, size_t(n));
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double ref = double(cpu::silu(a[i])) * double(b[i]);
    worst = std::max(worst, std::fabs(y[i] - ref) / (std::fabs(ref) + 1e-30));
  }
  std::printf("swiglu: max rel err %.3g\n", worst);
  EXPECT_LE(worst, 8 * 0x1p-24);
  // softmax rows: expf (2 ulp) then a product with the inverse sum: 6 * 2^-24 relative
  const int64_t sn = 1500, rows = 9;
  auto s = random_floats(size_t(sn * rows), rng, -20, 20);
  auto ds = upload(s);
  cuda::softmax_rows(ds.as<float>(), sn, sn, rows);
  const auto sy = download<float>(ds, size_t(sn * rows));
  worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> ref(s.begin() + r * sn, s.begin() + (r + 1) * sn);
    strata::backend::softmax(ref.data(), sn);
    for (int64_t i = 0; i < sn; ++i)
      worst = std::max(worst, std::fabs(double(sy[r * sn + i]) - ref[i]) / (double(ref[i]) + 1e-38));
  }
  std::printf("softmax: max rel err %.3g\n", worst);
  EXPECT_LE(worst, 6 * 0x1p-24);
}

// RoPE: the same double theta and cos/sin rounded to float as cpu::rope_apply; CUDA's double cos/sin
// are within 2 ulp of double, so the floats almost always agree; allow 2 ulp of the inputs.
TEST(CudaKernels, RopeNeoxMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(6);
  const int n_heads = 6, head_dim = 128, n_rot = 96;
  const int64_t n_tok = 50, ld = n_heads * head_dim + 8;
  const auto rope = strata::backend::RopeSpec::standard(n_rot, 1e6);
  auto x = random_floats(size_t(n_tok * ld), rng, -2, 2);
  std::vector<int32_t> pos(n_tok);
  for (int64_t t = 0; t < n_tok; ++t) pos[t] = int32_t(rng() % 40000);
  auto dx = upload(x);
  auto dpos = upload(pos);
  auto dfreq = upload(rope.inv_freq);
  cuda::rope_neox(dx.as<float>(), ld, n_tok, n_heads, head_dim, n_rot, dpos.as<int32_t>(), dfreq.as<double>());
  const auto y = download<float>(dx, size_t(n_tok * ld));
  double worst = 0;
  int64_t differ = 0;
  for (int64_t t = 0; t < n_tok; ++t) {
    std::vector<float> ref(x.begin() + t * ld, x.begin() + (t + 1) * ld);
    cpu::rope_apply(rope, ref.data(), n_heads, head_dim, pos[t]);
    for (int64_t i = 0; i < ld; ++i) {
      differ += !bits_equal(y[t * ld + i], ref[i]);
      worst = std::max(worst, std::fabs(double(y[t * ld + i]) - ref[i]));
    }
  }
  std::printf("rope: %lld of %lld values differ from cpu::rope_apply in bits, max |err| %.3g\n", (long long)differ,
              (long long)(n_tok * ld), worst);
  EXPECT_LE(worst, 4 * 2.0 * 0x1p-24);
}

namespace {

/// Double-precision causal attention for query token t (at position pos0 + t): positions
/// [F, P] with F = max(0, P + 1 - window) when a.window > 0, and sinks[h] (host copy; empty:
/// none) as an extra logit in each head's softmax denominator (transformers' eager gpt-oss form).
void attention_ref(const cuda::AttentionArgs& a, const std::vector<float>& q, const std::vector<float>& k,
                   const std::vector<float>& v, int64_t t, std::vector<double>& out,
                   const std::vector<float>& sinks = {}) {
  const int group = a.n_head / a.n_head_kv, hd = a.head_dim;
  const int64_t P = a.pos0 + t;
  const int64_t F = a.window > 0 ? std::max<int64_t>(0, P + 1 - a.window) : 0;
  out.assign(size_t(a.n_head) * hd, 0.0);
  std::vector<double> s(size_t(P + 1));
  for (int h = 0; h < a.n_head; ++h) {
    const float* qh = q.data() + t * a.q_stride + int64_t(h) * hd;
    const int64_t off = int64_t(h / group) * hd;
    double mx = -1e300;
    for (int64_t p = F; p <= P; ++p) {
      double d = 0;
      for (int i = 0; i < hd; ++i) d += double(qh[i]) * k[p * a.kv_stride + off + i];
      s[p] = d * a.scale;
      mx = std::max(mx, s[p]);
    }
    if (!sinks.empty()) mx = std::max(mx, double(sinks[size_t(h)]));
    double l = 0;
    for (int64_t p = F; p <= P; ++p) l += (s[p] = std::exp(s[p] - mx));
    if (!sinks.empty()) l += std::exp(double(sinks[size_t(h)]) - mx);
    for (int64_t p = F; p <= P; ++p)
      for (int i = 0; i < hd; ++i) out[size_t(h) * hd + i] += s[p] / l * v[p * a.kv_stride + off + i];
  }
}

// Bit-identity checks of an attention call `a` that wrote `out` (a.n_tok x a.out_stride floats):
// the number of output floats that differ from single-token decode calls of the given rows (rows
// >= a.n_tok are skipped), or from the same prefill in chunks of `chunk` tokens (the last one
// shorter), each call at its own positions a.pos0 + row.
int64_t attention_decode_mismatches(const cuda::AttentionArgs& a, const std::vector<float>& out,
                                    std::initializer_list<int64_t> rows) {
  int64_t mismatches = 0;
  cuda::DeviceBuffer d1(size_t(a.out_stride) * 4);
  for (int64_t t : rows) {
    if (t >= a.n_tok) continue;
    cuda::AttentionArgs b = a;
    b.q = a.q + t * a.q_stride, b.out = d1.as<float>(), b.n_tok = 1, b.pos0 = a.pos0 + t;
    cuda::attention(b);
    const auto o1 = download<float>(d1, size_t(a.out_stride));
    for (int64_t i = 0; i < a.out_stride; ++i) mismatches += !bits_equal(o1[i], out[t * a.out_stride + i]);
  }
  return mismatches;
}
int64_t attention_chunked_mismatches(const cuda::AttentionArgs& a, const std::vector<float>& out, int64_t chunk) {
  cuda::DeviceBuffer dc(size_t(a.n_tok * a.out_stride) * 4);
  for (int64_t c0 = 0; c0 < a.n_tok; c0 += chunk) {
    cuda::AttentionArgs b = a;
    b.q = a.q + c0 * a.q_stride, b.out = dc.as<float>() + c0 * a.out_stride;
    b.n_tok = std::min(chunk, a.n_tok - c0), b.pos0 = a.pos0 + c0;
    cuda::attention(b);
  }
  const auto oc = download<float>(dc, size_t(a.n_tok * a.out_stride));
  int64_t mismatches = 0;
  for (size_t i = 0; i < oc.size(); ++i) mismatches += !bits_equal(oc[i], out[i]);
  return mismatches;
}

}  // namespace

// Attention: against a double reference (tolerance below), and bit-identical between decode
// (one query) and prefill in one chunk or several; on both kernels (AttentionPath::Simt, and
// ::Mma for head_dim 64 and 128; positions 417..716 span three of its 128-segments too).
TEST(CudaKernels, AttentionMatchesReferenceAndDecodeEqualsPrefill) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(9);
  struct Shape {
    int n_head, n_head_kv, head_dim;
  };
  for (Shape sh : {Shape{8, 2, 64}, Shape{16, 2, 128}, Shape{4, 4, 256}, Shape{6, 1, 96}})
    for (cuda::AttentionPath path : {cuda::AttentionPath::Simt, cuda::AttentionPath::Mma}) {
      if (path == cuda::AttentionPath::Mma && sh.head_dim != 64 && sh.head_dim != 128) continue;  // Simt only
      SCOPED_TRACE("heads " + std::to_string(sh.n_head) + "/" + std::to_string(sh.n_head_kv) + " dim " +
                   std::to_string(sh.head_dim) + (path == cuda::AttentionPath::Mma ? " mma" : " simt"));
      const int64_t pos0 = 417, n_tok = 300, n_ctx = pos0 + n_tok;  // positions 417..716: three 256-segments
      cuda::AttentionArgs a;
      a.n_head = sh.n_head, a.n_head_kv = sh.n_head_kv, a.head_dim = sh.head_dim;
      a.q_stride = a.out_stride = int64_t(sh.n_head) * sh.head_dim;
      a.kv_stride = int64_t(sh.n_head_kv) * sh.head_dim;
      a.scale = 1.0f / std::sqrt(float(sh.head_dim));
      a.path = path;
      const auto q = random_floats(size_t(n_tok * a.q_stride), rng, -2, 2);
      const auto k = random_floats(size_t(n_ctx * a.kv_stride), rng, -2, 2);
      const auto v = random_floats(size_t(n_ctx * a.kv_stride), rng, -1, 1);
      auto dq = upload(q), dk = upload(k), dv = upload(v);
      cuda::DeviceBuffer dout(size_t(n_tok * a.out_stride) * 4);
      a.q = dq.as<float>(), a.k = dk.as<float>(), a.v = dv.as<float>(), a.out = dout.as<float>();
      a.n_tok = n_tok, a.pos0 = pos0;
      cuda::attention(a);
      const auto out = download<float>(dout, size_t(n_tok * a.out_stride));
      // |v| <= 1: the output error of fp32 online softmax is a few ulp per weight plus the fp32
      // sums over <= 717 positions and 3 segment folds, ~ (717/32 + 50) * 2^-24 on this data;
      // allow 4e-6 absolute.
      double worst = 0;
      std::vector<double> ref;
      for (int64_t t : {int64_t(0), int64_t(1), int64_t(31), int64_t(150), n_tok - 1}) {
        attention_ref(a, q, k, v, t, ref);
        for (size_t i = 0; i < ref.size(); ++i) worst = std::max(worst, std::fabs(out[t * a.out_stride + i] - ref[i]));
      }
      std::printf("attention %d/%d heads, dim %d (%s): max |err| %.3g\n", sh.n_head, sh.n_head_kv, sh.head_dim,
                  path == cuda::AttentionPath::Mma ? "mma" : "simt", worst);
      EXPECT_LE(worst, 4e-6);
      // decode: one query at a time (segments in parallel + fold); prefill in chunks of 100
      // (positions 417.., 517.., 617..)
      EXPECT_EQ(attention_decode_mismatches(a, out, {0, 5, 32, 150, n_tok - 1}), 0);
      EXPECT_EQ(attention_chunked_mismatches(a, out, 100), 0);
    }
}

// Sliding window and attention sinks (gpt-oss): against the double reference with the window's
// first position and the sink logit, and bit-identical between decode, prefill in one chunk and
// in chunks. Window 100 over positions 417..716 puts rows' first positions in segments 1 and 2
// (the folds then start there), and window 300 makes some rows start in one segment and end two
// later (for the Mma kernel's 128-segments: first positions in segments 2..5). Same tolerance as
// the plain attention test (fewer positions; the sink is one more term). Both kernels.
TEST(CudaKernels, AttentionWindowAndSinksMatchReference) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(10);
  for (int64_t window : {int64_t(100), int64_t(300), int64_t(1)})
    for (cuda::AttentionPath path : {cuda::AttentionPath::Simt, cuda::AttentionPath::Mma}) {
      const int n_head = 8, n_head_kv = 2, head_dim = 64;
      SCOPED_TRACE("window " + std::to_string(window) + (path == cuda::AttentionPath::Mma ? " mma" : " simt"));
      const int64_t pos0 = 417, n_tok = 300, n_ctx = pos0 + n_tok;
      cuda::AttentionArgs a;
      a.n_head = n_head, a.n_head_kv = n_head_kv, a.head_dim = head_dim;
      a.q_stride = a.out_stride = int64_t(n_head) * head_dim;
      a.kv_stride = int64_t(n_head_kv) * head_dim;
      a.scale = 1.0f / std::sqrt(float(head_dim));
      a.window = window;
      a.path = path;
      const auto q = random_floats(size_t(n_tok * a.q_stride), rng, -2, 2);
      const auto k = random_floats(size_t(n_ctx * a.kv_stride), rng, -2, 2);
      const auto v = random_floats(size_t(n_ctx * a.kv_stride), rng, -1, 1);
      const auto sinks = random_floats(size_t(n_head), rng, -1, 3);  // gpt-oss's sinks are O(1) logits
      auto dq = upload(q), dk = upload(k), dv = upload(v), ds = upload(sinks);
      cuda::DeviceBuffer dout(size_t(n_tok * a.out_stride) * 4);
      a.q = dq.as<float>(), a.k = dk.as<float>(), a.v = dv.as<float>(), a.out = dout.as<float>();
      a.sinks = ds.as<float>();
      a.n_tok = n_tok, a.pos0 = pos0;
      cuda::attention(a);
      const auto out = download<float>(dout, size_t(n_tok * a.out_stride));
      double worst = 0, moved = 0;
      std::vector<double> ref, ref_plain;
      for (int64_t t : {int64_t(0), int64_t(1), int64_t(38), int64_t(39), int64_t(150), n_tok - 1}) {
        attention_ref(a, q, k, v, t, ref, sinks);
        cuda::AttentionArgs full = a;
        full.window = 0;
        attention_ref(full, q, k, v, t, ref_plain);  // what a kernel ignoring window and sinks would give
        for (size_t i = 0; i < ref.size(); ++i) {
          worst = std::max(worst, std::fabs(out[t * a.out_stride + i] - ref[i]));
          moved = std::max(moved, std::fabs(ref_plain[i] - ref[i]));
        }
      }
      std::printf(
          "attention window %lld + sinks (%s): max |err| %.3g (window and sinks move the output by up to %.3g)\n",
          (long long)window, path == cuda::AttentionPath::Mma ? "mma" : "simt", worst, moved);
      EXPECT_LE(worst, 4e-6);
      EXPECT_GT(moved, 1e-2);  // the check can fail: ignoring the window or the sinks is far outside 4e-6
      EXPECT_EQ(attention_decode_mismatches(a, out, {0, 5, 39, 150, n_tok - 1}), 0);
      EXPECT_EQ(attention_chunked_mismatches(a, out, 100), 0);
    }
}

// The tensor-core kernel (AttentionPath::Mma) at the shapes of the model families it takes
// (GQA groups 1, 3, 5, 8; head_dim 64 and 128; gpt-oss's window 128 + sinks) and odd lengths:
// a prompt of 2049 tokens (rows end mid-tile, mid-segment and one past a 2048 boundary) against
// the double reference on rows at the tile / segment edges, within the plain test's bound
// (4e-6 absolute, |v| <= 1: the piece products are exact to 2^-24 relative, the rest is the
// fp32 sums, whose rounding grows with the ~2049/32 tiles and 17 segment folds: ~ (64 + 17 + 50)
// * 2^-24 ~ 8e-6 relative to the largest partial, which the softmax weights scale below 1).
// Then bit-identity of every row: the one-pass prefill of all 2049 tokens = chunks of 7 (the
// split path, one block of <= 56 rows), 15 and 17 (odd chunks: a token's rows cross blocks when
// the group is 3 or 5) = decode of single tokens, so no row's bits depend on the rows sharing
// its tile. The Simt kernel's distance is printed (the same quantity, another rounding).
TEST(CudaKernels, AttentionMmaOddLengthsGroupsAndChunking) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(13);
  struct Case {
    int n_head, n_head_kv, head_dim;
    int64_t n_tok;
    int64_t window;
    bool sinks;
  };
  for (Case c : {Case{32, 4, 128, 2049, 0, false}, Case{12, 4, 64, 2049, 0, false}, Case{10, 2, 128, 300, 0, false},
                 Case{8, 8, 64, 17, 0, false}, Case{16, 2, 64, 1, 0, false}, Case{64, 8, 64, 2049, 128, true},
                 Case{16, 4, 128, 15, 0, true}, Case{32, 2, 128, 300, 0, false}}) {
    SCOPED_TRACE("heads " + std::to_string(c.n_head) + "/" + std::to_string(c.n_head_kv) + " dim " +
                 std::to_string(c.head_dim) + " n_tok " + std::to_string(c.n_tok) + " window " +
                 std::to_string(c.window));
    cuda::AttentionArgs a;
    a.n_head = c.n_head, a.n_head_kv = c.n_head_kv, a.head_dim = c.head_dim;
    a.q_stride = a.out_stride = int64_t(c.n_head) * c.head_dim;
    a.kv_stride = int64_t(c.n_head_kv) * c.head_dim;
    a.scale = 1.0f / std::sqrt(float(c.head_dim));
    a.window = c.window;
    a.path = cuda::AttentionPath::Mma;
    const int64_t n_tok = c.n_tok;
    const auto q = random_floats(size_t(n_tok * a.q_stride), rng, -2, 2);
    const auto k = random_floats(size_t(n_tok * a.kv_stride), rng, -2, 2);
    const auto v = random_floats(size_t(n_tok * a.kv_stride), rng, -1, 1);
    const auto sinks = c.sinks ? random_floats(size_t(c.n_head), rng, -1, 3) : std::vector<float>{};
    auto dq = upload(q), dk = upload(k), dv = upload(v), ds = upload(sinks);
    cuda::DeviceBuffer dout(size_t(n_tok * a.out_stride) * 4);
    a.q = dq.as<float>(), a.k = dk.as<float>(), a.v = dv.as<float>(), a.out = dout.as<float>();
    a.sinks = c.sinks ? ds.as<float>() : nullptr;
    a.n_tok = n_tok, a.pos0 = 0;
    ASSERT_TRUE(cuda::attention_has_mma(a));
    cuda::attention(a);
    const auto out = download<float>(dout, size_t(n_tok * a.out_stride));
    double worst = 0;
    std::vector<double> ref;
    for (int64_t t : {int64_t(0), int64_t(1), int64_t(14), int64_t(15), int64_t(16), int64_t(31), int64_t(32),
                      int64_t(127), int64_t(128), int64_t(129), int64_t(1000), int64_t(2047), int64_t(2048)}) {
      if (t >= n_tok) continue;
      attention_ref(a, q, k, v, t, ref, sinks);
      for (size_t i = 0; i < ref.size(); ++i) worst = std::max(worst, std::fabs(out[t * a.out_stride + i] - ref[i]));
    }
    cuda::AttentionArgs simt = a;
    simt.path = cuda::AttentionPath::Simt;
    cuda::DeviceBuffer dsimt(size_t(n_tok * a.out_stride) * 4);
    simt.out = dsimt.as<float>();
    cuda::attention(simt);
    const auto os = download<float>(dsimt, size_t(n_tok * a.out_stride));
    double vs_simt = 0;
    for (size_t i = 0; i < os.size(); ++i) vs_simt = std::max(vs_simt, double(std::fabs(os[i] - out[i])));
    std::printf(
        "attention mma %d/%d heads, dim %d, %lld tokens, window %lld%s: max |err| %.3g, max |mma - simt| %.3g\n",
        c.n_head, c.n_head_kv, c.head_dim, (long long)n_tok, (long long)c.window, c.sinks ? " + sinks" : "", worst,
        vs_simt);
    EXPECT_LE(worst, 4e-6);
    // Chunkings: every row against the one-pass prefill.
    for (int64_t chunk : {int64_t(7), int64_t(15), int64_t(17)}) {
      if (chunk >= n_tok) continue;
      EXPECT_EQ(attention_chunked_mismatches(a, out, chunk), 0) << "chunks of " << chunk;
    }
    // Decode: single tokens.
    EXPECT_EQ(attention_decode_mismatches(a, out, {0, 14, 16, 127, 128, 200, 1023, 2048}), 0) << "decode";
  }
  // A shape the tensor-core kernel does not take is an error on AttentionPath::Mma (Auto runs Simt).
  cuda::AttentionArgs bad;
  bad.n_head = 4, bad.n_head_kv = 4, bad.head_dim = 96, bad.scale = 0.1f;
  bad.q_stride = bad.out_stride = bad.kv_stride = 4 * 96;
  cuda::DeviceBuffer buf(size_t(4 * 96) * 4);
  bad.q = bad.k = bad.v = buf.as<float>(), bad.out = buf.as<float>() + 0;
  bad.n_tok = 1, bad.pos0 = 0;
  bad.path = cuda::AttentionPath::Mma;
  EXPECT_FALSE(cuda::attention_has_mma(bad));
  EXPECT_THROW(cuda::attention(bad), cuda::CudaError);
}

// The one-pass tensor-core prefill on its two kernels (detail::fa_prefill_enabled: the K / V
// pieces split once per call and copied with cp.async into blocks of 128 rows, or the former
// fa_kernel of 64 rows staging its own tiles): bit-identical outputs for head_dim 64 and 128,
// GQA groups 1, 4, 8 (n_head / n_head_kv 4/4, 8/2, 16/2, 32/4), lengths that leave partial tiles,
// segments and row blocks (1 .. 1000), a first chunk (pos0 = 0) and later ones (pos0 = 37, 512),
// with a sliding window (and sinks). Each call runs in one pass (detail::set_fa_split_allowed
// (false)) so that the small shapes reach the kernels too, and the new kernel's outputs must also
// equal the default path's (split-KV + fold for the small calls, the same bits by construction).
// The outputs start as NaN, so a row either kernel skips shows up (and must not stay NaN).
TEST(CudaKernels, AttentionMmaPrefillKernelsBitIdentical) {
  REQUIRE_CUDA_DEVICE();
  namespace cd = strata::cuda::detail;
  std::mt19937 rng(21);
  struct Shape {
    int n_head, n_head_kv, head_dim;
  };
  struct Variant {
    int64_t window;
    bool sinks;
  };
  const int64_t kMaxTok = 1000, kMaxPos0 = 512;
  const bool before = cd::fa_prefill_enabled();
  for (Shape sh : {Shape{4, 4, 64}, Shape{8, 2, 64}, Shape{16, 2, 64}, Shape{4, 4, 128}, Shape{8, 2, 128},
                   Shape{16, 2, 128}, Shape{32, 4, 128}}) {
    cuda::AttentionArgs a;
    a.n_head = sh.n_head, a.n_head_kv = sh.n_head_kv, a.head_dim = sh.head_dim;
    a.q_stride = a.out_stride = int64_t(sh.n_head) * sh.head_dim;
    a.kv_stride = int64_t(sh.n_head_kv) * sh.head_dim;
    a.scale = 1.0f / std::sqrt(float(sh.head_dim));
    a.path = cuda::AttentionPath::Mma;
    const int64_t n_ctx = kMaxPos0 + kMaxTok;
    const auto q = random_floats(size_t(kMaxTok * a.q_stride), rng, -2, 2);
    const auto k = random_floats(size_t(n_ctx * a.kv_stride), rng, -2, 2);
    const auto v = random_floats(size_t(n_ctx * a.kv_stride), rng, -1, 1);
    const auto sinks = random_floats(size_t(sh.n_head), rng, -1, 3);
    auto dq = upload(q), dk = upload(k), dv = upload(v), ds = upload(sinks);
    a.q = dq.as<float>(), a.k = dk.as<float>(), a.v = dv.as<float>();
    const std::vector<float> poison(size_t(kMaxTok * a.out_stride), std::nanf(""));
    cuda::DeviceBuffer dout(poison.size() * 4);
    a.out = dout.as<float>();
    for (Variant var : {Variant{0, false}, Variant{100, true}, Variant{300, false}, Variant{0, true}})
      for (int64_t pos0 : {int64_t(0), int64_t(37), kMaxPos0})
        for (int64_t n_tok :
             {int64_t(1), int64_t(5), int64_t(63), int64_t(64), int64_t(65), int64_t(130), int64_t(300), kMaxTok}) {
          SCOPED_TRACE("heads " + std::to_string(sh.n_head) + "/" + std::to_string(sh.n_head_kv) + " dim " +
                       std::to_string(sh.head_dim) + " window " + std::to_string(var.window) +
                       (var.sinks ? " + sinks" : "") + " pos0 " + std::to_string(pos0) + " n_tok " +
                       std::to_string(n_tok));
          a.window = var.window, a.sinks = var.sinks ? ds.as<float>() : nullptr;
          a.n_tok = n_tok, a.pos0 = pos0;
          const size_t n = size_t(n_tok * a.out_stride);
          auto run = [&](bool prefill_kernel, bool split_allowed) {
            cuda::copy_to_device(dout.get(), poison.data(), n * 4);
            cd::set_fa_prefill_enabled(prefill_kernel);
            cd::set_fa_split_allowed(split_allowed);
            cuda::attention(a);
            auto o = download<float>(dout, n);
            cd::set_fa_split_allowed(true);
            return o;
          };
          const auto o_new = run(true, false), o_old = run(false, false), o_default = run(true, true);
          cd::set_fa_prefill_enabled(before);
          int64_t vs_old = 0, vs_default = 0, nan = 0;
          for (size_t i = 0; i < n; ++i) {
            vs_old += !bits_equal(o_new[i], o_old[i]);
            vs_default += !bits_equal(o_new[i], o_default[i]);
            nan += std::isnan(o_new[i]);
          }
          EXPECT_EQ(nan, 0) << "outputs the new kernel did not write";
          EXPECT_EQ(vs_old, 0) << "fa_prefill_kernel vs fa_kernel (one pass)";
          EXPECT_EQ(vs_default, 0) << "fa_prefill_kernel (one pass) vs the default path";
        }
  }
}

// Split-KV decode with the fold in the decode kernel (detail::fa_fused_enabled: the blocks with
// the last arrivals at a per-KV-head counter fold the segment states with fa_combine's code)
// against the two-kernel path (fa_decode_kernel + fa_combine) and the one-pass prefill kernel
// (detail::set_fa_split_allowed(false)), bit for bit: head_dim 64 and 128; GQA groups 1, 4, 8, 16
// (one or two 8-row n-tiles), 2 tokens of group 8 (16 rows, two query positions); 8 KV heads of
// group 16 (128 rows: one finisher per head instead of one per row); caches of 1 .. 4100
// positions (within a segment, at and past its edges, 2080 = Qwen3-30B-A3B's decode case, 4100 >
// 128 segments); without and with a window (some segments before it: blocks that arrive without
// computing) and sinks. The fused call runs three times back to back without a synchronization
// (the counters must be back at zero after each call), each into an output poisoned with NaN.
TEST(CudaKernels, AttentionMmaFusedDecodeBitIdentical) {
  REQUIRE_CUDA_DEVICE();
  namespace cd = strata::cuda::detail;
  std::mt19937 rng(29);
  struct Shape {
    int n_head_kv, group;
    int64_t n_tok;
  };
  struct Variant {
    int64_t window;
    bool sinks;
  };
  const bool fused_before = cd::fa_fused_enabled();
  const int64_t kMaxCtx = 4100;
  for (int head_dim : {64, 128})
    for (Shape sh :
         {Shape{4, 1, 1}, Shape{4, 4, 1}, Shape{4, 8, 1}, Shape{4, 16, 1}, Shape{2, 8, 2}, Shape{8, 16, 1}}) {
      cuda::AttentionArgs a;
      a.n_head = sh.n_head_kv * sh.group, a.n_head_kv = sh.n_head_kv, a.head_dim = head_dim;
      a.q_stride = a.out_stride = int64_t(a.n_head) * head_dim;
      a.kv_stride = int64_t(sh.n_head_kv) * head_dim;
      a.scale = 1.0f / std::sqrt(float(head_dim));
      a.path = cuda::AttentionPath::Mma;
      const auto q = random_floats(size_t(sh.n_tok * a.q_stride), rng, -2, 2);
      const auto k = random_floats(size_t(kMaxCtx * a.kv_stride), rng, -2, 2);
      const auto v = random_floats(size_t(kMaxCtx * a.kv_stride), rng, -1, 1);
      const auto sinks = random_floats(size_t(a.n_head), rng, -1, 3);
      auto dq = upload(q), dk = upload(k), dv = upload(v), ds = upload(sinks);
      a.q = dq.as<float>(), a.k = dk.as<float>(), a.v = dv.as<float>();
      const size_t n = size_t(sh.n_tok * a.out_stride);
      const std::vector<float> poison(n, std::nanf(""));
      cuda::DeviceBuffer dout[3] = {cuda::DeviceBuffer(n * 4), cuda::DeviceBuffer(n * 4), cuda::DeviceBuffer(n * 4)};
      for (Variant var : {Variant{0, false}, Variant{0, true}, Variant{100, true}, Variant{1000, false}})
        for (int64_t len :
             {int64_t(1), int64_t(31), int64_t(32), int64_t(33), int64_t(100), int64_t(1000), int64_t(2080), kMaxCtx}) {
          if (len < sh.n_tok) continue;
          SCOPED_TRACE("dim " + std::to_string(head_dim) + " heads " + std::to_string(a.n_head) + "/" +
                       std::to_string(sh.n_head_kv) + " n_tok " + std::to_string(sh.n_tok) + " cache " +
                       std::to_string(len) + " window " + std::to_string(var.window) + (var.sinks ? " + sinks" : ""));
          a.window = var.window, a.sinks = var.sinks ? ds.as<float>() : nullptr;
          a.n_tok = sh.n_tok, a.pos0 = len - sh.n_tok;  // the last query sees positions 0 .. len - 1
          auto run = [&](bool fused, bool split_allowed) {
            cd::set_fa_fused_enabled(fused);
            cd::set_fa_split_allowed(split_allowed);
            cuda::AttentionArgs b = a;
            b.out = dout[0].as<float>();
            cuda::copy_to_device(dout[0].get(), poison.data(), n * 4);
            cuda::attention(b);
            auto o = download<float>(dout[0], n);
            cd::set_fa_split_allowed(true);
            return o;
          };
          const auto o_fused = run(true, true), o_two = run(false, true), o_one = run(true, false);
          // Three fused calls queued back to back (outputs 0, 1, 2), then compared.
          cd::set_fa_fused_enabled(true);
          for (auto& d : dout) cuda::copy_to_device(d.get(), poison.data(), n * 4);
          for (auto& d : dout) {
            cuda::AttentionArgs b = a;
            b.out = d.as<float>();
            cuda::attention(b);
          }
          int64_t vs_two = 0, vs_one = 0, nan = 0, repeat = 0;
          for (size_t i = 0; i < n; ++i) {
            vs_two += !bits_equal(o_fused[i], o_two[i]);
            vs_one += !bits_equal(o_fused[i], o_one[i]);
            nan += std::isnan(o_fused[i]);
          }
          for (auto& d : dout) {
            const auto o = download<float>(d, n);
            for (size_t i = 0; i < n; ++i) repeat += !bits_equal(o[i], o_fused[i]);
          }
          EXPECT_EQ(nan, 0) << "outputs the fused kernel did not write";
          EXPECT_EQ(vs_two, 0) << "fused decode vs fa_decode_kernel + fa_combine";
          EXPECT_EQ(vs_one, 0) << "fused decode vs the one-pass prefill kernel";
          EXPECT_EQ(repeat, 0) << "back-to-back fused calls";
        }
    }
  cd::set_fa_fused_enabled(fused_before);
}

// RoPE in the NORM layout with YaRN's attention factor, and the NEOX layout with it: against
// cpu::rope_apply (same double theta, cos/sin times the factor in double, rounded to float);
// 2 ulp of the inputs as the NEOX test. The YaRN table itself is RopeSpec::yarn (test_yarn).
TEST(CudaKernels, RopeNormAndYarnFactorMatchCpu) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(7);
  const int n_heads = 4, head_dim = 64, n_rot = 64;
  const int64_t n_tok = 40, ld = n_heads * head_dim;
  using Mode = strata::backend::RopeSpec::Mode;
  for (Mode mode : {Mode::Norm, Mode::Neox}) {
    const auto rope = strata::backend::RopeSpec::yarn(n_rot, 150000, mode, 32, 4096, 32, 1, true, 1.3465735902799727);
    auto x = random_floats(size_t(n_tok * ld), rng, -2, 2);
    std::vector<int32_t> pos(n_tok);
    for (int64_t t = 0; t < n_tok; ++t) pos[t] = int32_t(rng() % 100000);
    auto dx = upload(x);
    auto dpos = upload(pos);
    auto dfreq = upload(rope.inv_freq);
    cuda::rope(dx.as<float>(), ld, n_tok, n_heads, head_dim, n_rot, dpos.as<int32_t>(), dfreq.as<double>(),
               mode == Mode::Neox, rope.attn_factor);
    const auto y = download<float>(dx, size_t(n_tok * ld));
    double worst = 0, moved = 0;
    for (int64_t t = 0; t < n_tok; ++t) {
      std::vector<float> ref(x.begin() + t * ld, x.begin() + (t + 1) * ld);
      cpu::rope_apply(rope, ref.data(), n_heads, head_dim, pos[t]);
      for (int64_t i = 0; i < ld; ++i) {
        worst = std::max(worst, std::fabs(double(y[t * ld + i]) - ref[i]));
        moved = std::max(moved, std::fabs(double(x[t * ld + i]) - ref[i]));
      }
    }
    std::printf("rope %s with attn_factor %.4f: max |err| %.3g\n", mode == Mode::Neox ? "neox" : "norm",
                rope.attn_factor, worst);
    EXPECT_LE(worst, 4 * 2.0 * 1.35 * 0x1p-24);
    EXPECT_GT(moved, 0.1);
  }
}

// gpt-oss's clamped SwiGLU against cpu::swiglu_oai on values around and beyond the clamp
// (|g|, |u| up to 12 > limit 7): the same fp32 operations, CUDA's expf within 2 ulp, so a few
// ulp of the result.
TEST(CudaKernels, SwigluOaiMatchesCpu) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(8);
  const int64_t n = 100000;
  const auto g = random_floats(size_t(n), rng, -12, 12), u = random_floats(size_t(n), rng, -12, 12);
  auto dg = upload(g), du = upload(u);
  cuda::DeviceBuffer dy(size_t(n) * 4);
  cuda::swiglu_oai(dg.as<float>(), du.as<float>(), dy.as<float>(), n, 1.702f, 7.0f);
  const auto y = download<float>(dy, size_t(n));
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double r = cpu::swiglu_oai(g[size_t(i)], u[size_t(i)], 1.702f, 7.0f);
    worst = std::max(worst, std::fabs(y[size_t(i)] - r) / (std::fabs(r) + 1e-30));
  }
  std::printf("swiglu_oai: max rel err %.3g\n", worst);
  EXPECT_LE(worst, 8 * 0x1p-24);
}

// The gated delta net block on the GPU (matmuls, conv, recurrence, gated RMSNorm, output
// projection) against cpu::gated_delta_net_block, in two chunks so the states carry over.
// The CPU f32 matmuls differ from the GPU's in accumulation order (~1e-7 relative), which the
// normalizations and the recurrence carry along; allow 1e-4 relative to the largest output.
TEST(CudaKernels, GatedDeltaNetMatchesCpuBlock) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(12);
  strata::cpu::GatedDeltaNetShape s;
  s.n_k_head = 2, s.n_v_head = 4, s.head_k_dim = 128, s.head_v_dim = 128, s.conv_kernel = 4, s.rms_eps = 1e-6f;
  const int64_t n_embd = 256, C = s.conv_dim(), VD = s.value_dim(), nv = s.n_v_head;
  const int K = s.conv_kernel;
  auto mk = [&](int64_t rows, int64_t cols, float sc) { return random_floats(size_t(rows * cols), rng, -sc, sc); };
  const auto wqkv = mk(C, n_embd, 0.08f), wz = mk(VD, n_embd, 0.08f), wba = mk(2 * nv, n_embd, 0.1f),
             wout = mk(n_embd, VD, 0.05f), conv = mk(C, K, 0.5f), dtb = mk(1, nv, 0.5f), norm = mk(1, 128, 1.0f);
  std::vector<float> A(nv);
  for (auto& a : A) a = -std::exp(std::uniform_real_distribution<float>(-1, 1)(rng));
  auto ref = [&](const std::vector<float>& w, int64_t rows, int64_t cols) {
    return cpu::MatrixRef{GgmlType::F32, w.data(), rows, cols, size_t(cols) * 4};
  };
  strata::cpu::GatedDeltaNetWeights W{ref(wqkv, C, n_embd),
                                      ref(wz, VD, n_embd),
                                      ref(wba, 2 * nv, n_embd),
                                      ref(wout, n_embd, VD),
                                      conv.data(),
                                      dtb.data(),
                                      A.data(),
                                      norm.data()};
  const int64_t T = 40, chunks[] = {25, 15};
  const auto h = random_floats(size_t(T * n_embd), rng, -1, 1);
  std::vector<float> conv_state(size_t(s.conv_state_size()), 0.0f), ssm_state(size_t(s.ssm_state_size()), 0.0f);
  std::vector<float> out_cpu(size_t(T * n_embd));
  {
    cpu::ThreadPool pool(1);
    int64_t t0 = 0;
    for (int64_t n : chunks) {
      strata::cpu::gated_delta_net_block(pool, cpu::kernels::KernelConfig{}, W, s, h.data() + t0 * n_embd, n_embd, n,
                                         conv_state.data(), ssm_state.data(), out_cpu.data() + t0 * n_embd);
      t0 += n;
    }
  }
  auto dh = upload(h), dwqkv = upload(wqkv), dwz = upload(wz), dwba = upload(wba), dwout = upload(wout),
       dconv = upload(conv), ddtb = upload(dtb), dA = upload(A), dnorm = upload(norm);
  cuda::DeviceBuffer dcs(size_t(s.conv_state_size()) * 4), dss(size_t(s.ssm_state_size()) * 4);
  {
    std::vector<float> zc(size_t(s.conv_state_size()), 0.0f), zs(size_t(s.ssm_state_size()), 0.0f);
    cuda::copy_to_device(dcs.get(), zc.data(), zc.size() * 4);
    cuda::copy_to_device(dss.get(), zs.data(), zs.size() * 4);
  }
  cuda::DeviceBuffer dx(size_t(T * C) * 4), dxc(size_t(T * C) * 4), dz(size_t(T * VD) * 4), dba(size_t(T * 2 * nv) * 4),
      dO(size_t(T * VD) * 4), dout(size_t(T * n_embd) * 4);
  int64_t t0 = 0;
  for (int64_t n : chunks) {
    const float* hx = dh.as<float>() + t0 * n_embd;
    cuda::matmul(GgmlType::F32, dwqkv.get(), size_t(n_embd) * 4, C, n_embd, hx, n_embd, n, dx.as<float>(), C);
    cuda::matmul(GgmlType::F32, dwz.get(), size_t(n_embd) * 4, VD, n_embd, hx, n_embd, n, dz.as<float>(), VD);
    cuda::matmul(GgmlType::F32, dwba.get(), size_t(n_embd) * 4, 2 * nv, n_embd, hx, n_embd, n, dba.as<float>(), 2 * nv);
    cuda::gdn_conv(dx.as<float>(), C, n, dconv.as<float>(), K, dcs.as<float>(), dxc.as<float>());
    cuda::gdn_recurrent(dxc.as<float>(), C, n, dba.as<float>(), ddtb.as<float>(), dA.as<float>(), s.n_k_head,
                        s.n_v_head, s.head_k_dim, s.head_v_dim, dss.as<float>(), dO.as<float>());
    cuda::rms_norm(dO.as<float>(), s.head_v_dim, dnorm.as<float>(), dO.as<float>(), s.head_v_dim, s.head_v_dim, n * nv,
                   s.rms_eps);
    cuda::swiglu(dz.as<float>(), dO.as<float>(), dO.as<float>(), n * VD);
    cuda::matmul(GgmlType::F32, dwout.get(), size_t(VD) * 4, n_embd, VD, dO.as<float>(), VD, n,
                 dout.as<float>() + t0 * n_embd, n_embd);
    t0 += n;
  }
  const auto out = download<float>(dout, size_t(T * n_embd));
  const auto ss = download<float>(dss, ssm_state.size());
  const auto cs = download<float>(dcs, conv_state.size());
  auto rel = [](const std::vector<float>& g, const std::vector<float>& r) {
    double mx = 0, err = 0;
    for (size_t i = 0; i < r.size(); ++i)
      mx = std::max(mx, std::fabs(double(r[i]))), err = std::max(err, std::fabs(double(g[i]) - r[i]));
    return err / mx;
  };
  const double e_out = rel(out, out_cpu), e_ss = rel(ss, ssm_state), e_cs = rel(cs, conv_state);
  std::printf("gated delta net: max err / max |ref|: out %.3g, ssm state %.3g, conv state %.3g\n", e_out, e_ss, e_cs);
  EXPECT_LE(e_out, 1e-4);
  EXPECT_LE(e_ss, 1e-4);
  EXPECT_LE(e_cs, 1e-5);
}

// ---- q8 activations (quantize_q8, matmul_q8, grouped_matmul_q8) ----------------------------

namespace {

/// The contract of matmul_q8 (kernels.h) computed on the host: per element acc = 0, then per
/// Q8_0 block in column order acc = fmaf(float(S_b), dw_b * dx_b, acc) with S_b the exact int32
/// sum and the product rounded on its own.
std::vector<float> q8_host(const std::vector<uint8_t>& w, size_t rb, int64_t rows, int64_t cols,
                           const std::vector<int8_t>& q, const std::vector<float>& d, int64_t n_tok) {
  const int64_t nb = cols / 32;
  std::vector<float> y(size_t(n_tok * rows));
  for (int64_t t = 0; t < n_tok; ++t)
    for (int64_t r = 0; r < rows; ++r) {
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = &w[size_t(r) * rb + size_t(b) * 34];
        uint16_t h;
        std::memcpy(&h, blk, 2);
        int32_t s = 0;
        for (int k = 0; k < 32; ++k) s += int32_t(int8_t(blk[2 + k])) * int32_t(q[size_t(t * cols + b * 32 + k)]);
        volatile float p = quant::fp16_to_fp32(h) * d[size_t(t * nb + b)];  // rounded on its own
        acc = std::fmaf(float(s), p, acc);
      }
      y[size_t(t * rows + r)] = acc;
    }
  return y;
}

/// Rows of random Q8_0 blocks, each row padded to `rb` bytes (rb >= the row size).
std::vector<uint8_t> q8_rows(int64_t rows, int64_t cols, size_t rb, std::mt19937& rng) {
  const size_t used = quant::row_size(GgmlType::Q8_0, cols);
  const auto dense = random_rows(GgmlType::Q8_0, rows, cols, rng);
  std::vector<uint8_t> w(rb * size_t(rows), 0xA5);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(&w[size_t(r) * rb], &dense[size_t(r) * used], used);
  return w;
}

}  // namespace

// The codes and scales are the CPU's (cpu::kernels::detail::quantize_block_q8) bit for bit:
// random magnitudes over many decades, an all-zero block, subnormals, exact ties (x * id = k + 0.5
// for amax 127: x = k + 0.5), a NaN and an infinity (d = NaN, codes 0).
// quantize_q8_rows (the quantizer gathering a MoE layer's pair rows itself) against the CPU's
// quantize_block_q8 of the gathered rows, bit for bit: the 16-byte path (ldx % 4 == 0) and the
// scalar one (odd ldx), a row length that leaves part of the last 1024-column block idle, rows
// repeated (rep 3, several pairs of one token) in a shuffled order, and a NaN block.
TEST(CudaKernels, QuantizeQ8RowsEqualsCpuOfGatheredRows) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(41);
  for (int64_t cols : {int64_t(768), int64_t(2080)}) {
    for (int64_t pad : {int64_t(12), int64_t(3)}) {
      SCOPED_TRACE("cols " + std::to_string(cols) + " ldx pad " + std::to_string(pad));
      const int64_t n_src = 9, ldx = cols + pad, rep = 3, n = 23;
      auto x = random_floats(size_t(n_src * ldx), rng, -4, 4);
      x[size_t(4 * ldx + 2 * 32 + 5)] = std::nanf("");
      std::vector<int64_t> map(static_cast<size_t>(n));
      std::uniform_int_distribution<int64_t> pick(0, n_src * rep - 1);
      for (auto& m : map) m = pick(rng);
      auto dx = upload(x), dmap = upload(map);
      cuda::DeviceBuffer dq(size_t(n * cols)), dd(size_t(n * cols / 32) * 4);
      cuda::quantize_q8_rows(dx.as<float>(), ldx, cols, n, dmap.as<int64_t>(), int(rep), dq.as<int8_t>(),
                             dd.as<float>());
      const auto q = download<int8_t>(dq, size_t(n * cols));
      const auto d = download<float>(dd, size_t(n * cols / 32));
      int64_t bad = 0;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t b = 0; b < cols / 32; ++b) {
          int8_t ref[32];
          const float rd =
              cpu::kernels::detail::quantize_block_q8(&x[size_t((map[size_t(t)] / rep) * ldx + b * 32)], ref);
          const float gd = d[size_t(t * (cols / 32) + b)];
          bad += std::isnan(rd) ? !std::isnan(gd) : !bits_equal(rd, gd);
          for (int k = 0; k < 32; ++k) bad += q[size_t(t * cols + b * 32 + k)] != ref[k];
        }
      EXPECT_EQ(bad, 0);
    }
  }
}

TEST(CudaKernels, QuantizeQ8EqualsCpu) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(21);
  const int64_t cols = 4096, n = 7, ldx = cols + 12;
  std::vector<float> x(size_t(n * ldx), 0.0f);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f), e(-30.0f, 30.0f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t b = c / 32;
      float v = u(rng) * std::exp2(std::floor(e(rng) / 4) + float(b % 9) - 4);  // per-element spread too
      if (b == 3) v = 0.0f;                                                     // all-zero block
      if (b == 4) v = u(rng) * 1e-39f;                                          // subnormals
      if (b == 5) v = c % 32 == 0 ? 127.0f : float(int(c % 32) - 16) + 0.5f;    // ties
      x[size_t(t * ldx + c)] = v;
    }
  x[size_t(2 * ldx + 7 * 32 + 3)] = std::nanf("");
  x[size_t(3 * ldx + 8 * 32 + 9)] = -INFINITY;
  auto dx = upload(x);
  cuda::DeviceBuffer dq(size_t(n * cols)), dd(size_t(n * cols / 32) * 4);
  cuda::quantize_q8(dx.as<float>(), ldx, cols, n, dq.as<int8_t>(), dd.as<float>());
  const auto q = download<int8_t>(dq, size_t(n * cols));
  const auto d = download<float>(dd, size_t(n * cols / 32));
  int64_t bad_codes = 0, bad_scales = 0, nonzero = 0;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t b = 0; b < cols / 32; ++b) {
      int8_t ref[32];
      const float rd = cpu::kernels::detail::quantize_block_q8(&x[size_t(t * ldx + b * 32)], ref);
      const float gd = d[size_t(t * (cols / 32) + b)];
      bad_scales += std::isnan(rd) ? !std::isnan(gd) : !bits_equal(rd, gd);
      for (int k = 0; k < 32; ++k) {
        bad_codes += ref[k] != q[size_t(t * cols + b * 32 + k)];
        nonzero += ref[k] != 0;
      }
    }
  EXPECT_EQ(bad_codes, 0);
  EXPECT_EQ(bad_scales, 0);
  EXPECT_GT(nonzero, n * cols / 2);  // the data is not degenerate
  EXPECT_TRUE(std::isnan(d[size_t(2 * (cols / 32) + 7)]) && std::isnan(d[size_t(3 * (cols / 32) + 8)]));
  EXPECT_THROW(cuda::quantize_q8(dx.as<float>(), ldx, 100, n, dq.as<int8_t>(), dd.as<float>()), cuda::CudaError);
}

// matmul_q8 equals the scalar host definition bit for bit on every kernel (MatVec with 32-bit and
// 16-bit weight loads, the GEMM) for n_tok 1, 3, 64, 300, odd row counts and a block count that
// leaves a partial pipeline stage; and the result is within the stated error of the exact w·x.
TEST(CudaKernels, MatmulQ8EqualsHostDefinition) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(22);
  struct Shape {
    int64_t rows, cols;
    size_t rb;
  };
  // 608 columns: 19 blocks (646 bytes: 2-byte aligned rows; 656: 16-byte aligned, the mat-vec's
  // 16-byte staging, 8 rows a block); 2048: 2176 bytes (one stage of that staging); 4160: two stages
  // and 2 blocks; 4250 rows: the 2-byte aligned mat-vec's 16-row blocks (fewer rows take its 4-row
  // blocks, 16-byte aligned; fewer rows take its 4-row blocks). The 16-byte aligned ones run both
  // mat-vec kernels (mv2_q8_kernel: rows of <= 32 blocks in one-warp blocks of 8 rows and stages
  // of 24 blocks, longer rows in stages of 64; and mv16_q8_kernel): 768 (24 blocks, one full
  // stage of 24), 800 (25: a stage of 24 and one of 1), 1056 (33: one odd stage of 64), 608 (19)
  const Shape shapes[] = {{203, 608, 646},  {203, 608, 656}, {130, 2048, 2176}, {77, 4160, 4432}, {4250, 160, 170},
                          {4250, 160, 176}, {203, 768, 816}, {77, 800, 864},    {130, 1056, 1136}};
  for (const Shape& sh : shapes) {
    const auto w = q8_rows(sh.rows, sh.cols, sh.rb, rng);
    auto dw = upload(w);
    for (int64_t n : {1, 3, 64, 300}) {
      SCOPED_TRACE("rows=" + std::to_string(sh.rows) + " cols=" + std::to_string(sh.cols) +
                   " row_bytes=" + std::to_string(sh.rb) + " n_tok=" + std::to_string(n));
      const auto x = random_floats(size_t(n * sh.cols), rng, -2.0f, 2.0f);
      auto dx = upload(x);
      cuda::DeviceBuffer dq(size_t(n * sh.cols)), dd(size_t(n * sh.cols / 32) * 4);
      cuda::quantize_q8(dx.as<float>(), sh.cols, sh.cols, n, dq.as<int8_t>(), dd.as<float>());
      const auto q = download<int8_t>(dq, size_t(n * sh.cols));
      const auto d = download<float>(dd, size_t(n * sh.cols / 32));
      const auto ref = q8_host(w, sh.rb, sh.rows, sh.cols, q, d, n);
      std::vector<cuda::MatmulPath> paths = {cuda::MatmulPath::Auto, cuda::MatmulPath::MatVec};
      if (sh.rb % 8 == 0) paths.push_back(cuda::MatmulPath::Mma);
      for (cuda::MatmulPath p : paths)
        for (int v2 : {1, 0}) {  // the 16-byte mat-vec as mv2_q8_kernel, then as mv16_q8_kernel
          if (v2 == 0 && (p == cuda::MatmulPath::Mma || sh.rb % 16 != 0)) continue;
          cuda::detail::set_mv16_v2(v2);
          std::vector<float> poison(size_t(n * sh.rows), std::nanf(""));
          auto dy = upload(poison);
          cuda::matmul_q8(GgmlType::Q8_0, dw.get(), sh.rb, sh.rows, sh.cols, dq.as<int8_t>(), dd.as<float>(), n,
                          dy.as<float>(), sh.rows, nullptr, p);
          const auto y = download<float>(dy, size_t(n * sh.rows));
          cuda::detail::set_mv16_v2(-1);
          int64_t mism = 0;
          for (size_t i = 0; i < y.size(); ++i) mism += !bits_equal(y[i], ref[i]);
          EXPECT_EQ(mism, 0) << "path " << int(p) << " mv16_v2 " << v2;
        }
      // the error statement of kernels.h against the exact (double) w·x
      std::vector<float> wr(size_t(sh.cols));
      double worst = 0;
      for (int64_t r = 0; r < sh.rows; ++r) {
        quant::dequantize_row(GgmlType::Q8_0, &w[size_t(r) * sh.rb], wr.data(), sh.cols);
        for (int64_t t = 0; t < n; ++t) {
          double exact = 0, quant_err = 0, mag = 0;
          for (int64_t k = 0; k < sh.cols; ++k) {
            const double wk = wr[size_t(k)], xk = x[size_t(t * sh.cols + k)], dk = d[size_t(t * sh.cols / 32 + k / 32)];
            exact += wk * xk;
            // |x - dx qx| <= dx (0.5 + 2^-17) + |x| 2^-23 (the roundings of x * id, 127 / amax, amax / 127)
            quant_err += std::fabs(wk) * (dk * (0.5 + std::ldexp(1.0, -16)) + std::fabs(xk) * std::ldexp(1.0, -21));
            mag += std::fabs(wk) * (std::fabs(xk) + dk * 0.5);
          }
          const double bound = quant_err + double(sh.cols / 32 + 1) * std::ldexp(1.0, -24) * mag;
          worst = std::max(worst, std::fabs(ref[size_t(t * sh.rows + r)] - exact) / bound);
        }
      }
      EXPECT_LE(worst, 1.0);
      EXPECT_GT(worst, 0.0);
    }
  }
  auto dw = upload(q8_rows(8, 608, 646, rng));
  cuda::DeviceBuffer dq(608), dd(76), dy(64);
  EXPECT_THROW(cuda::matmul_q8(GgmlType::Q8_0, dw.get(), 646, 8, 608, dq.as<int8_t>(), dd.as<float>(), 1,
                               dy.as<float>(), 8, nullptr, cuda::MatmulPath::Mma),
               cuda::CudaError);  // the GEMM needs 8-byte aligned rows
  EXPECT_THROW(cuda::matmul_q8(GgmlType::Q4_K, dw.get(), 646, 8, 608, dq.as<int8_t>(), dd.as<float>(), 1,
                               dy.as<float>(), 8),
               cuda::CudaError);
}

// The CPU's AVX-512 Q8_0 definition (cpu::kernels::detail::matmul_q8_scalar_avx512, which the
// tokens-in-the-lanes GEMM follows bit for bit) is the CUDA q8 one: from the same fp32 x, each
// backend quantizing it itself (identical codes, QuantizeQ8EqualsCpu), every CUDA path gives the
// CPU's bits; and so does the CPU's AVX-512 kernel where this CPU has AVX-512.
TEST(CudaKernels, MatmulQ8EqualsCpuAvx512Bits) {
  REQUIRE_CUDA_DEVICE();
  namespace ck = cpu::kernels;
  std::mt19937 rng(23);
  const int64_t rows = 203, cols = 2048;
  const size_t rb = quant::row_size(GgmlType::Q8_0, cols);
  const auto w = q8_rows(rows, cols, rb, rng);
  auto dw = upload(w);
  bool avx512 = true;
  try {
    ck::resolve_kernels(ck::CpuKernels::Avx512, ck::ActQuant::Q8);
  } catch (const std::runtime_error&) {
    avx512 = false;
  }
  for (int64_t n : {1, 17, 300}) {
    SCOPED_TRACE("n_tok=" + std::to_string(n));
    const auto x = random_floats(size_t(n * cols), rng, -2.0f, 2.0f);
    ck::ActQ8 act;
    act.resize(n, cols, GgmlType::Q8_0);
    ck::quantize_activations(ck::resolve_kernels(ck::CpuKernels::Scalar, ck::ActQuant::Q8), x.data(), cols, 0, n, act);
    std::vector<float> cpu_y(size_t(n * rows));
    const ck::detail::MatmulArgs a{GgmlType::Q8_0, w.data(), rb, 0, rows, cols, x.data(), cols, n, cpu_y.data(), rows};
    ck::detail::matmul_q8_scalar_avx512(a, act);
    if (avx512) {
      std::vector<float> y(cpu_y.size());
      ck::matmul(ck::resolve_kernels(ck::CpuKernels::Avx512, ck::ActQuant::Q8), GgmlType::Q8_0, w.data(), rb, 0, rows,
                 cols, x.data(), cols, n, y.data(), rows);
      int64_t mism = 0;
      for (size_t i = 0; i < y.size(); ++i) mism += !bits_equal(y[i], cpu_y[i]);
      EXPECT_EQ(mism, 0) << "CPU AVX-512 kernel against its definition";
    }
    auto dx = upload(x);
    cuda::DeviceBuffer dq(size_t(n * cols)), dd(size_t(n * cols / 32) * 4);
    cuda::quantize_q8(dx.as<float>(), cols, cols, n, dq.as<int8_t>(), dd.as<float>());
    for (cuda::MatmulPath p : {cuda::MatmulPath::Auto, cuda::MatmulPath::MatVec, cuda::MatmulPath::Mma}) {
      std::vector<float> poison(size_t(n * rows), std::nanf(""));
      auto dy = upload(poison);
      cuda::matmul_q8(GgmlType::Q8_0, dw.get(), rb, rows, cols, dq.as<int8_t>(), dd.as<float>(), n, dy.as<float>(),
                      rows, nullptr, p);
      const auto y = download<float>(dy, size_t(n * rows));
      int64_t mism = 0;
      for (size_t i = 0; i < y.size(); ++i) mism += !bits_equal(y[i], cpu_y[i]);
      EXPECT_EQ(mism, 0) << "CUDA path " << int(p) << " against the CPU's AVX-512 definition";
    }
  }
}

// grouped_matmul_q8 equals matmul_q8 on each job alone (and swiglu of two of them), bit for bit, for
// a prefill-like group (the GEMM) and a decode-like one (all <= 8 tokens: the mat-vec).
// matmul_q8_multi (attention's q, k, v in one decode launch) against one matmul_q8 per matrix,
// bit for bit: row counts that are not multiples of the 8-row blocks, padded output strides, the
// 4-warp (2048 columns) and one-warp (768) mat-vec, n_tok 1 .. 8 (one launch) and 9 (the
// separate launches), and a NaN-poisoned output checked to be written everywhere.
TEST(CudaKernels, MatmulQ8MultiEqualsSeparateLaunches) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(43);
  for (int64_t cols : {int64_t(2048), int64_t(768)}) {
    const size_t rb = (quant::row_size(GgmlType::Q8_0, cols) + 15) / 16 * 16;
    const int64_t rows[3] = {300, 64, 37}, ldy[3] = {300 + 4, 64, 37 + 3};
    std::vector<cuda::DeviceBuffer> w;
    for (int i = 0; i < 3; ++i) w.push_back(upload(q8_rows(rows[i], cols, rb, rng)));
    for (int64_t n_tok : {int64_t(1), int64_t(3), int64_t(8), int64_t(9)}) {
      SCOPED_TRACE("cols " + std::to_string(cols) + " n_tok " + std::to_string(n_tok));
      auto dx = upload(random_floats(size_t(n_tok * cols), rng));
      cuda::DeviceBuffer dq(size_t(n_tok * cols)), dd(size_t(n_tok * cols / 32) * 4);
      cuda::quantize_q8(dx.as<float>(), cols, cols, n_tok, dq.as<int8_t>(), dd.as<float>());
      std::vector<cuda::DeviceBuffer> ym, ys;
      cuda::MatmulQ8Part parts[3];
      for (int i = 0; i < 3; ++i) {
        const std::vector<float> poison(size_t(n_tok * ldy[i]), std::nanf(""));
        ym.push_back(upload(poison));
        ys.push_back(upload(poison));
        parts[i] = {w[size_t(i)].get(), rows[i], ym[size_t(i)].as<float>(), ldy[i]};
      }
      cuda::matmul_q8_multi(GgmlType::Q8_0, parts, 3, rb, cols, dq.as<int8_t>(), dd.as<float>(), n_tok);
      for (int i = 0; i < 3; ++i)
        cuda::matmul_q8(GgmlType::Q8_0, w[size_t(i)].get(), rb, rows[i], cols, dq.as<int8_t>(), dd.as<float>(), n_tok,
                        ys[size_t(i)].as<float>(), ldy[i]);
      int64_t differ = 0, unwritten = 0;
      for (int i = 0; i < 3; ++i) {
        const auto a = download<float>(ym[size_t(i)], size_t(n_tok * ldy[i]));
        const auto b = download<float>(ys[size_t(i)], size_t(n_tok * ldy[i]));
        for (int64_t t = 0; t < n_tok; ++t)
          for (int64_t r = 0; r < rows[i]; ++r) {
            const size_t k = size_t(t * ldy[i] + r);
            differ += !bits_equal(a[k], b[k]);
            unwritten += std::isnan(a[k]);
          }
      }
      EXPECT_EQ(differ, 0);
      EXPECT_EQ(unwritten, 0);
    }
  }
  EXPECT_THROW(cuda::matmul_q8_multi(GgmlType::Q8_0, nullptr, 0, 2176, 2048, nullptr, nullptr, 1), cuda::CudaError);
}

// The one-token fp32 entry points (matmul_q8_x1, matmul_q8_multi_x1, grouped_matmul_q8_x1) quantize
// inside the mat-vec: bit for bit the quantizer launch + the q8 call they replace, on both mv2
// instances (<= 32 blocks a row: one-warp blocks; more: 4-warp blocks, 1 or 2 stages), rows
// not multiples of 8, and activations with an all-zero block, a NaN block and large values.
TEST(CudaKernels, MatmulQ8X1EqualsQuantizeThenMatmul) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(71);
  auto make_x = [&](int64_t n, int64_t cols) {
    auto x = random_floats(size_t(n * cols), rng, -3.0f, 3.0f);
    for (int64_t i = 0; i < 32 && cols >= 96; ++i) x[size_t(32 + i)] = 0.0f;  // token 0's block 1: all zero
    if (cols >= 128) x[size_t(100)] = 1.0e30f;                                  // block 3: a large value
    if (n > 1) x[size_t((n - 1) * cols + cols / 2)] = std::nanf("");            // the last token: a NaN block
    return x;
  };
  auto compare = [](const cuda::DeviceBuffer& a, const cuda::DeviceBuffer& b, size_t n, int64_t& differ) {
    const auto va = download<float>(a, n), vb = download<float>(b, n);
    for (size_t i = 0; i < n; ++i) differ += !bits_equal(va[i], vb[i]);
  };
  ASSERT_TRUE(cuda::q8_x1_takes(GgmlType::Q8_0, 2176, 2048, nullptr, 2048));
  for (int64_t cols : {int64_t(32), int64_t(768), int64_t(1024), int64_t(1056), int64_t(2048), int64_t(4096),
                       int64_t(8192)}) {
    const size_t rb = (quant::row_size(GgmlType::Q8_0, cols) + 15) / 16 * 16;
    SCOPED_TRACE("cols " + std::to_string(cols));
    // one matrix, and three in one launch
    const int64_t rows[3] = {300, 64, 37};
    std::vector<cuda::DeviceBuffer> w;
    for (int i = 0; i < 3; ++i) w.push_back(upload(q8_rows(rows[i], cols, rb, rng)));
    auto dx = upload(make_x(1, cols));
    cuda::DeviceBuffer dq{size_t(cols)}, dd{size_t(cols / 32) * 4};
    cuda::quantize_q8(dx.as<float>(), cols, cols, 1, dq.as<int8_t>(), dd.as<float>());
    int64_t differ = 0;
    std::vector<cuda::DeviceBuffer> y1, ym, yr;
    cuda::MatmulQ8Part parts[3];
    for (int i = 0; i < 3; ++i) {
      const std::vector<float> poison(size_t(rows[i]), std::nanf(""));
      y1.push_back(upload(poison)), ym.push_back(upload(poison)), yr.push_back(upload(poison));
      parts[i] = {w[size_t(i)].get(), rows[i], ym[size_t(i)].as<float>(), rows[i]};
      cuda::matmul_q8_x1(GgmlType::Q8_0, w[size_t(i)].get(), rb, rows[i], cols, dx.as<float>(),
                         y1[size_t(i)].as<float>(), rows[i]);
      cuda::matmul_q8(GgmlType::Q8_0, w[size_t(i)].get(), rb, rows[i], cols, dq.as<int8_t>(), dd.as<float>(), 1,
                      yr[size_t(i)].as<float>(), rows[i]);
    }
    cuda::matmul_q8_multi_x1(GgmlType::Q8_0, parts, 3, rb, cols, dx.as<float>());
    for (int i = 0; i < 3; ++i) {
      compare(y1[size_t(i)], yr[size_t(i)], size_t(rows[i]), differ);
      compare(ym[size_t(i)], yr[size_t(i)], size_t(rows[i]), differ);
    }
    EXPECT_EQ(differ, 0) << "single / multi";
    // with the L2 prefetch hint (both modes, direct regions): the same bits
    for (int mode : {1, 2}) {
      cuda::detail::set_l2_prefetch(mode);
      cuda::L2Prefetch pf;
      pf.p[0] = w[0].get(), pf.bytes[0] = size_t(rows[0]) * rb;
      pf.p[1] = w[2].get(), pf.bytes[1] = size_t(rows[2]) * rb - 16;  // not a whole line
      pf.n = 2;
      for (int i = 0; i < 3; ++i) ym[size_t(i)] = upload(std::vector<float>(size_t(rows[i]), std::nanf("")));
      for (int i = 0; i < 3; ++i) parts[i].y = ym[size_t(i)].as<float>();
      cuda::matmul_q8_multi_x1(GgmlType::Q8_0, parts, 3, rb, cols, dx.as<float>(), nullptr, &pf);
      int64_t pdiffer = 0;
      for (int i = 0; i < 3; ++i) compare(ym[size_t(i)], yr[size_t(i)], size_t(rows[i]), pdiffer);
      EXPECT_EQ(pdiffer, 0) << "multi with L2 prefetch mode " << mode;
      cuda::detail::set_l2_prefetch(-1);
    }
    // grouped: a MoE step's pairs, one token per job; gate/up (rep: tokens of K pairs) and down
    for (int rep : {1, 8}) {
      const int nj = 16;
      const int64_t grows = 203;
      const int64_t n_x = (nj + rep - 1) / rep;
      auto gx = upload(make_x(n_x, cols));
      std::vector<cuda::DeviceBuffer> wg, wu;
      std::vector<cuda::GroupedMatmulJob> jobs(static_cast<size_t>(nj));
      for (int j = 0; j < nj; ++j) {
        wg.push_back(upload(q8_rows(grows, cols, rb, rng)));
        wu.push_back(upload(q8_rows(grows, cols, rb, rng)));
      }
      cuda::DeviceBuffer gq(size_t(nj * cols)), gd(size_t(nj * cols / 32) * 4);
      cuda::quantize_q8(gx.as<float>(), cols, cols, nj, gq.as<int8_t>(), gd.as<float>(), nullptr, rep);
      for (bool pair : {false, true}) {
        SCOPED_TRACE(std::string(pair ? "swiglu pair" : "plain") + " rep " + std::to_string(rep));
        for (int j = 0; j < nj; ++j) {
          jobs[size_t(j)].w = wg[size_t(j)].get();
          jobs[size_t(j)].w2 = pair ? wu[size_t(j)].get() : nullptr;
          jobs[size_t(j)].row0 = j;
          jobs[size_t(j)].n_tok = 1;
        }
        const cuda::GroupedMatmulPlan plan = cuda::plan_grouped_q8(jobs.data(), nj, grows, cols, rb);
        ASSERT_TRUE(plan.one_token && plan.vec16);
        auto dj = upload(jobs);
        const std::vector<float> poison(size_t(nj * grows), std::nanf(""));
        auto ya = upload(poison), yb = upload(poison);
        cuda::grouped_matmul_q8_x1(plan, GgmlType::Q8_0, dj.as<cuda::GroupedMatmulJob>(), nj, rb, grows, cols,
                                   gx.as<float>(), cols, rep, ya.as<float>(), grows, pair);
        cuda::grouped_matmul_q8(plan, GgmlType::Q8_0, dj.as<cuda::GroupedMatmulJob>(), nj, rb, grows, cols,
                                gq.as<int8_t>(), gd.as<float>(), yb.as<float>(), grows, pair);
        int64_t gdiffer = 0;
        compare(ya, yb, size_t(nj * grows), gdiffer);
        EXPECT_EQ(gdiffer, 0);
        // with the L2 prefetch of a device job table's weights (as gate/up prefetches down's)
        cuda::detail::set_l2_prefetch(2);
        cuda::L2Prefetch pf;
        pf.jobs = dj.as<cuda::GroupedMatmulJob>(), pf.n_jobs = nj, pf.job_bytes = size_t(grows) * rb;
        auto yc = upload(poison);
        cuda::grouped_matmul_q8_x1(plan, GgmlType::Q8_0, dj.as<cuda::GroupedMatmulJob>(), nj, rb, grows, cols,
                                   gx.as<float>(), cols, rep, yc.as<float>(), grows, pair, nullptr, &pf);
        cuda::detail::set_l2_prefetch(-1);
        gdiffer = 0;
        compare(yc, yb, size_t(nj * grows), gdiffer);
        EXPECT_EQ(gdiffer, 0) << "with the L2 prefetch";
      }
    }
  }
  // off: the predicate says so and the entry points refuse
  cuda::detail::set_q8_x1(0);
  EXPECT_FALSE(cuda::q8_x1_takes(GgmlType::Q8_0, 2176, 2048, nullptr, 2048));
  EXPECT_THROW(cuda::matmul_q8_x1(GgmlType::Q8_0, nullptr, 2176, 8, 2048, nullptr, nullptr, 8), cuda::CudaError);
  cuda::detail::set_q8_x1(-1);
  EXPECT_FALSE(cuda::q8_x1_takes(GgmlType::Q8_0, 2176, 8224, nullptr, 8224));  // above kX1MaxCols
  EXPECT_FALSE(cuda::q8_x1_takes(GgmlType::Q4_K, 2176, 2048, nullptr, 2048));
}

TEST(CudaKernels, GroupedMatmulQ8EqualsPerJob) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(23);
  struct Case {
    std::vector<int64_t> sizes;
    int64_t rows, cols;
    size_t rb;  // 16-byte aligned rows
  };
  // 800 columns: 25 blocks (mv2_q8_kernel's one-warp blocks, stages of 24 and 1); 768: 24 (one
  // stage); 2048: 64 (its 4-warp blocks); rows not multiples of 8 in the last two
  const Case cases[] = {{{1, 5, 37, 64, 65, 130, 2, 300}, 200, 800, 864},
                        {{1, 3, 8, 2, 1}, 200, 800, 864},
                        {{1, 1, 2, 1, 8, 1, 1, 3, 1}, 203, 768, 816},
                        {{1, 4, 1, 1, 7, 1, 1, 1}, 101, 2048, 2176}};
  for (const Case& cs : cases) {
    const auto& sizes = cs.sizes;
    const int nj = int(sizes.size());
    const int64_t rows = cs.rows, cols = cs.cols;
    const size_t rb = cs.rb;
    std::vector<cuda::DeviceBuffer> wg, wu;
    for (int i = 0; i < nj; ++i) {
      wg.push_back(upload(q8_rows(rows, cols, rb, rng)));
      wu.push_back(upload(q8_rows(rows, cols, rb, rng)));
    }
    int64_t total = 0;
    for (int64_t n : sizes) total += n;
    auto dx = upload(random_floats(size_t(total * cols), rng));
    cuda::DeviceBuffer dq(size_t(total * cols)), dd(size_t(total * cols / 32) * 4);
    cuda::quantize_q8(dx.as<float>(), cols, cols, total, dq.as<int8_t>(), dd.as<float>());
    for (bool pair : {false, true}) {
      SCOPED_TRACE(std::string(pair ? "swiglu pair" : "plain") + " jobs=" + std::to_string(nj) +
                   " cols=" + std::to_string(cols));
      std::vector<cuda::GroupedMatmulJob> jobs(static_cast<size_t>(nj));
      int64_t row0 = 0;
      for (int i = 0; i < nj; ++i) {
        jobs[size_t(i)].w = wg[size_t(i)].get(), jobs[size_t(i)].w2 = pair ? wu[size_t(i)].get() : nullptr;
        jobs[size_t(i)].row0 = row0, jobs[size_t(i)].n_tok = sizes[i];
        row0 += sizes[i];
      }
      const cuda::GroupedMatmulPlan plan = cuda::plan_grouped_q8(jobs.data(), nj, rows, cols, rb);
      EXPECT_EQ(plan.tile_tokens, *std::max_element(sizes.begin(), sizes.end()) > 8 ? 64 : 8);
      auto djobs = upload(jobs);
      std::vector<float> poison(size_t(total * rows), std::nanf(""));
      auto dy = upload(poison);
      cuda::grouped_matmul_q8(plan, GgmlType::Q8_0, djobs.as<cuda::GroupedMatmulJob>(), nj, rb, rows, cols,
                              dq.as<int8_t>(), dd.as<float>(), dy.as<float>(), rows, pair);
      const auto y = download<float>(dy, size_t(total * rows));
      if (plan.tile_tokens == cuda::kGemmTileTokens) {
        // the same launch storing row j to row perm[j] (the scatter done by the store)
        std::vector<int64_t> perm(static_cast<size_t>(total));
        for (int64_t j = 0; j < total; ++j) perm[size_t(j)] = j;
        std::shuffle(perm.begin(), perm.end(), rng);
        auto dperm = upload(perm);
        auto dys = upload(poison);
        cuda::grouped_matmul_q8(plan, GgmlType::Q8_0, djobs.as<cuda::GroupedMatmulJob>(), nj, rb, rows, cols,
                                dq.as<int8_t>(), dd.as<float>(), dys.as<float>(), rows, pair, nullptr,
                                dperm.as<int64_t>());
        const auto ys = download<float>(dys, size_t(total * rows));
        int64_t moved = 0;
        for (int64_t j = 0; j < total; ++j)
          for (int64_t r = 0; r < rows; ++r)
            moved += !bits_equal(ys[size_t(perm[size_t(j)] * rows + r)], y[size_t(j * rows + r)]);
        EXPECT_EQ(moved, 0);
      } else {
        EXPECT_THROW(cuda::grouped_matmul_q8(plan, GgmlType::Q8_0, djobs.as<cuda::GroupedMatmulJob>(), nj, rb, rows,
                                             cols, dq.as<int8_t>(), dd.as<float>(), dy.as<float>(), rows, pair, nullptr,
                                             djobs.as<int64_t>()),
                     cuda::CudaError);
      }
      int64_t mismatches = 0;
      for (int i = 0; i < nj; ++i) {
        const int64_t n = sizes[i], r0 = jobs[size_t(i)].row0;
        cuda::DeviceBuffer g(size_t(n * rows) * 4), u(size_t(n * rows) * 4);
        const int8_t* qi = dq.as<int8_t>() + r0 * cols;
        const float* di = dd.as<float>() + r0 * (cols / 32);
        cuda::matmul_q8(GgmlType::Q8_0, wg[size_t(i)].get(), rb, rows, cols, qi, di, n, g.as<float>(), rows);
        if (pair) {
          cuda::matmul_q8(GgmlType::Q8_0, wu[size_t(i)].get(), rb, rows, cols, qi, di, n, u.as<float>(), rows);
          cuda::swiglu(g.as<float>(), u.as<float>(), g.as<float>(), n * rows);
        }
        const auto yi = download<float>(g, size_t(n * rows));
        for (int64_t k = 0; k < n * rows; ++k) mismatches += !bits_equal(yi[size_t(k)], y[size_t(r0 * rows + k)]);
      }
      EXPECT_EQ(mismatches, 0);
    }
  }
}

// mv2_q8_kernel (the default 16-byte q8 mat-vec) equals mv16_q8_kernel bit for bit on the
// Qwen3-30B-A3B decode launches: grouped gate/up (SwiGLU pair, 8 pairs of one token, 768 x 2048)
// and down (2048 x 768) with the decode path's job table (job j = pair j, one token), the dense
// q (4096 x 2048), o (2048 x 4096) and k/v (512 x 2048) at 1..8 tokens, and the 8-expert groups
// with 1..8 tokens per job.
TEST(CudaKernels, MatmulQ8V2EqualsMv16OnDecodeShapes) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(24);
  auto run_both = [](auto&& launch, size_t n_out) {
    std::vector<float> out[2];
    for (int v2 : {0, 1}) {
      cuda::detail::set_mv16_v2(v2);
      std::vector<float> poison(n_out, std::nanf(""));
      auto dy = upload(poison);
      launch(dy.as<float>());
      out[v2] = download<float>(dy, n_out);
    }
    cuda::detail::set_mv16_v2(-1);
    int64_t mism = 0, nan = 0;
    for (size_t i = 0; i < n_out; ++i) {
      mism += !bits_equal(out[0][i], out[1][i]);
      nan += std::isnan(out[1][i]);
    }
    EXPECT_EQ(mism, 0);
    EXPECT_EQ(nan, 0);  // every output written
  };
  auto quantized = [&](int64_t n, int64_t cols, cuda::DeviceBuffer& dq, cuda::DeviceBuffer& dd) {
    auto dx = upload(random_floats(size_t(n * cols), rng, -2.0f, 2.0f));
    dq = cuda::DeviceBuffer(size_t(n * cols));
    dd = cuda::DeviceBuffer(size_t(n * cols / 32) * 4);
    cuda::quantize_q8(dx.as<float>(), cols, cols, n, dq.as<int8_t>(), dd.as<float>());
  };
  // dense projections
  struct Dense {
    int64_t rows, cols;
  };
  for (const Dense& de : {Dense{4096, 2048}, Dense{2048, 4096}, Dense{512, 2048}}) {
    const size_t rb = size_t(de.cols / 32) * 34;
    auto dw = upload(q8_rows(de.rows, de.cols, rb, rng));
    for (int64_t n = 1; n <= 8; ++n) {
      SCOPED_TRACE("dense rows=" + std::to_string(de.rows) + " cols=" + std::to_string(de.cols) +
                   " n_tok=" + std::to_string(n));
      cuda::DeviceBuffer dq, dd;
      quantized(n, de.cols, dq, dd);
      run_both(
          [&](float* y) {
            cuda::matmul_q8(GgmlType::Q8_0, dw.get(), rb, de.rows, de.cols, dq.as<int8_t>(), dd.as<float>(), n, y,
                            de.rows, nullptr, cuda::MatmulPath::MatVec);
          },
          size_t(n * de.rows));
    }
  }
  // the experts: 8 of them, gate/up 768 x 2048 (pairs), down 2048 x 768
  const int64_t E = 2048, F = 768;
  const size_t rb_gu = size_t(E / 32) * 34, rb_dn = size_t(F / 32) * 34;
  std::vector<cuda::DeviceBuffer> wg, wu, wd;
  for (int e = 0; e < 8; ++e) {
    wg.push_back(upload(q8_rows(F, E, rb_gu, rng)));
    wu.push_back(upload(q8_rows(F, E, rb_gu, rng)));
    wd.push_back(upload(q8_rows(E, F, rb_dn, rng)));
  }
  const std::vector<int64_t> size_sets[] = {{1, 1, 1, 1, 1, 1, 1, 1},
                                            {1, 2, 3, 4, 5, 6, 7, 8},
                                            {8, 8, 1, 3, 8, 2, 8, 5}};
  for (const auto& sizes : size_sets) {
    int64_t total = 0;
    for (int64_t n : sizes) total += n;
    for (bool gate_up : {true, false}) {
      SCOPED_TRACE(std::string(gate_up ? "gate/up" : "down") + " tokens=" + std::to_string(total));
      const int64_t rows = gate_up ? F : E, cols = gate_up ? E : F;
      const size_t rb = gate_up ? rb_gu : rb_dn;
      std::vector<cuda::GroupedMatmulJob> jobs(8);
      int64_t row0 = 0;
      for (int e = 0; e < 8; ++e) {
        jobs[size_t(e)].w = gate_up ? wg[size_t(e)].get() : wd[size_t(e)].get();
        jobs[size_t(e)].w2 = gate_up ? wu[size_t(e)].get() : nullptr;
        jobs[size_t(e)].row0 = row0, jobs[size_t(e)].n_tok = sizes[size_t(e)];
        row0 += sizes[size_t(e)];
      }
      const cuda::GroupedMatmulPlan plan = cuda::plan_grouped_q8(jobs.data(), 8, rows, cols, rb);
      EXPECT_EQ(plan.tile_tokens, 8);
      EXPECT_TRUE(plan.vec16);
      auto djobs = upload(jobs);
      cuda::DeviceBuffer dq, dd;
      quantized(total, cols, dq, dd);
      run_both(
          [&](float* y) {
            cuda::grouped_matmul_q8(plan, GgmlType::Q8_0, djobs.as<cuda::GroupedMatmulJob>(), 8, rb, rows, cols,
                                    dq.as<int8_t>(), dd.as<float>(), y, rows, gate_up);
          },
          size_t(total * rows));
    }
  }
}

// Timings, only with STRATA_CUDA_BENCH=1 (wall clock around synchronize, 20 repetitions after a
// warm-up): matmul at n_tok = 1 (GB/s of weight bytes) and 512 (GFLOP/s). Weights 32768 x 4096,
// larger than the H200's L2. Attention: AttentionTimings.
TEST(CudaKernels, Timings) {
  REQUIRE_CUDA_DEVICE();
  const char* env = std::getenv("STRATA_CUDA_BENCH");
  if (!env || std::string(env) != "1") GTEST_SKIP() << "set STRATA_CUDA_BENCH=1 to time the kernels";
  std::mt19937 rng(1);
  auto time_ms = [](auto&& fn) {
    fn();
    cuda::synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 20; ++i) fn();
    cuda::synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 20;
  };
  const int64_t rows = 32768, cols = 4096;
  const auto x = random_floats(size_t(512 * cols), rng);
  auto dx = upload(x);
  cuda::DeviceBuffer dy(size_t(512 * rows) * 4);
  for (GgmlType t : {GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K,
                     GgmlType::IQ2_XS, GgmlType::IQ3_S, GgmlType::IQ4_XS, GgmlType::MXFP4}) {
    const size_t rb = quant::row_size(t, cols);
    auto dw = upload(random_rows(t, rows, cols, rng));
    const double ms1 =
        time_ms([&] { cuda::matmul(t, dw.get(), rb, rows, cols, dx.as<float>(), cols, 1, dy.as<float>(), rows); });
    const double ms512 =
        time_ms([&] { cuda::matmul(t, dw.get(), rb, rows, cols, dx.as<float>(), cols, 512, dy.as<float>(), rows); });
    std::printf("timing matmul %-6s %lldx%lld: n_tok=1 %.3f ms = %.0f GB/s | n_tok=512 %.2f ms = %.0f GFLOP/s\n",
                strata::ggml_type_name(t).c_str(), (long long)rows, (long long)cols, ms1, double(rb * rows) / ms1 / 1e6,
                ms512, 2.0 * rows * cols * 512 / ms512 / 1e6);
    if (cuda::has_q8(t, cols)) {
      // q8 activations: quantize_q8 + matmul_q8 (the quantizer included), next to the fp32 paths above
      cuda::DeviceBuffer dq(size_t(2048 * cols)), dd(size_t(2048 * cols / 32) * 4);
      auto q8 = [&](int64_t n, cuda::MatmulPath p) {
        cuda::quantize_q8(dx.as<float>(), cols, cols, std::min<int64_t>(n, 512), dq.as<int8_t>(), dd.as<float>());
        cuda::matmul_q8(t, dw.get(), rb, rows, cols, dq.as<int8_t>(), dd.as<float>(), n, dy.as<float>(), rows, nullptr,
                        p);
      };
      const double mma1 = time_ms([&] {
        cuda::matmul(t, dw.get(), rb, rows, cols, dx.as<float>(), cols, 1, dy.as<float>(), rows, nullptr,
                     cuda::MatmulPath::Mma);
      });
      const double q1 = time_ms([&] { q8(1, cuda::MatmulPath::Auto); });
      const double q8t = time_ms([&] { q8(8, cuda::MatmulPath::Auto); });
      const double q512 = time_ms([&] { q8(512, cuda::MatmulPath::Auto); });
      const double m512 = time_ms([&] {
        cuda::matmul(t, dw.get(), rb, rows, cols, dx.as<float>(), cols, 512, dy.as<float>(), rows, nullptr,
                     cuda::MatmulPath::Mma);
      });
      std::printf(
          "timing matmul %-6s q8 act: n_tok=1 %.3f ms = %.0f GB/s (bf16x3 mma %.0f GB/s) | n_tok=8 %.3f ms = %.0f "
          "GB/s | n_tok=512 %.2f ms = %.0f GFLOP/s (bf16x3 mma %.0f GFLOP/s)\n",
          strata::ggml_type_name(t).c_str(), q1, double(rb * rows) / q1 / 1e6, double(rb * rows) / mma1 / 1e6, q8t,
          double(rb * rows) / q8t / 1e6, q512, 2.0 * rows * cols * 512 / q512 / 1e6,
          2.0 * rows * cols * 512 / m512 / 1e6);
    }
  }
}

// The host's cost of one kernel launch, only with STRATA_CUDA_BENCH=1 (as Timings): 4000 launches
// of the smallest kernel (cuda::add of one float, through detail::launch as every kernel goes,
// with programmatic dependent launch unless STRATA_CUDA_PDL=0) enqueued back to back, the host's
// time for the enqueueing and then its wait for the device. When the host time per launch is the
// larger, a chain of small kernels (decode: ~510 a token on the 30B shape) is bound by the host.
TEST(CudaKernels, TimingsLaunchCost) {
  REQUIRE_CUDA_DEVICE();
  const char* env = std::getenv("STRATA_CUDA_BENCH");
  if (!env || std::string(env) != "1") GTEST_SKIP() << "set STRATA_CUDA_BENCH=1 to time the launches";
  cuda::DeviceBuffer a(4), b(4), y(4);
  cudaStream_t st = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  for (int round = 0; round < 3; ++round) {
    constexpr int kLaunches = 4000;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kLaunches; ++i) cuda::add(a.as<float>(), b.as<float>(), y.as<float>(), 1, st);
    const auto t1 = std::chrono::steady_clock::now();
    ASSERT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    const auto t2 = std::chrono::steady_clock::now();
    const double host = std::chrono::duration<double, std::micro>(t1 - t0).count() / kLaunches;
    const double wait = std::chrono::duration<double, std::micro>(t2 - t1).count();
    std::printf("launch cost (round %d): host %.2f us per launch, then %.1f us waiting for the device (PDL %s)\n",
                round, host, wait, std::getenv("STRATA_CUDA_PDL") ? std::getenv("STRATA_CUDA_PDL") : "default");
  }
  cudaStreamDestroy(st);
}

// Attention timings, only with STRATA_CUDA_BENCH=1 (as Timings): both kernels side by side at
// the Qwen3-30B-A3B shape (32 query heads, 4 KV heads, dim 128): a 2048-token prefill from
// position 0 (TFLOP/s of the causal product's useful FLOPs) and one decode token at KV 2048,
// 4096 and 8192.
TEST(CudaKernels, AttentionTimings) {
  REQUIRE_CUDA_DEVICE();
  const char* env = std::getenv("STRATA_CUDA_BENCH");
  if (!env || std::string(env) != "1") GTEST_SKIP() << "set STRATA_CUDA_BENCH=1 to time the kernels";
  std::mt19937 rng(1);
  auto time_ms = [](auto&& fn) {
    fn();
    cuda::synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 20; ++i) fn();
    cuda::synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 20;
  };
  cuda::AttentionArgs a;
  a.n_head = 32, a.n_head_kv = 4, a.head_dim = 128, a.scale = 1.0f / std::sqrt(128.0f);
  a.q_stride = a.out_stride = 32 * 128, a.kv_stride = 4 * 128;
  const int64_t n_ctx = 8192;
  auto dq = upload(random_floats(size_t(2048 * a.q_stride), rng));
  auto dk = upload(random_floats(size_t(n_ctx * a.kv_stride), rng));
  auto dv = upload(random_floats(size_t(n_ctx * a.kv_stride), rng));
  cuda::DeviceBuffer dout(size_t(2048 * a.out_stride) * 4);
  a.q = dq.as<float>(), a.k = dk.as<float>(), a.v = dv.as<float>(), a.out = dout.as<float>();
  // Useful FLOPs of a causal prefill of n from position 0: 2 (QK and PV) * 2 * heads * dim * n (n + 1) / 2.
  for (cuda::AttentionPath path : {cuda::AttentionPath::Simt, cuda::AttentionPath::Mma}) {
    a.path = path;
    a.n_tok = 2048, a.pos0 = 0;
    const double pre = time_ms([&] { cuda::attention(a); });
    a.n_tok = 1, a.pos0 = 2047;
    const double d2k = time_ms([&] { cuda::attention(a); });
    a.n_tok = 1, a.pos0 = 4095;
    const double d4k = time_ms([&] { cuda::attention(a); });
    a.n_tok = 1, a.pos0 = n_ctx - 1;
    const double d8k = time_ms([&] { cuda::attention(a); });
    std::printf(
        "timing attention %s 32/4 heads dim 128: prefill 2048 tokens %.3f ms (%.2f TFLOP/s) | decode at KV 2048 "
        "%.4f ms, 4096 %.4f ms, 8192 %.4f ms\n",
        path == cuda::AttentionPath::Mma ? "mma " : "simt", pre, 4.0 * 32 * 128 * 2048.0 * 2049 / 2 / pre / 1e9, d2k,
        d4k, d8k);
  }
}

// ---- expert selection on the device (route.h) against backend::select_experts ----
//
// Both are given the same logits. The ids must be equal; probs and weights may differ only
// through exp (device: exp in double rounded to float; host: glibc expf, <= 0.502 ulp), so each
// exp differs by <= 1 ulp. Softmax: the double sum then differs by <= 2^-23 relative, 1/sum
// rounded to float by <= 2^-22, each prob by <= 2^-21 relative (<= 8 ulp at the bottom of a
// binade); a normalized weight divides by a sum of such probs: <= 2^-20 (16 ulp). Sigmoid:
// 1 + e and its reciprocal add <= 2 roundings (< 8 ulp). Bounds: 8 ulp on probs / next_prob,
// 16 ulp on weights. Measured maxima are printed.
#include "backend/cuda/route.h"

namespace {

// |a - b| in units of the float ulp at max(|a|, |b|) (0 when both are equal, incl. both 0).
double ulp_diff(float a, float b) {
  if (a == b) return 0;
  const float m = std::max(std::fabs(a), std::fabs(b));
  const float ulp = std::nextafter(m, INFINITY) - m;
  return double(std::fabs(a - b)) / double(ulp);
}

struct RouteCase {
  const char* name;
  strata::backend::RouterSpec spec;
  int ties;        // 0: continuous logits; 1: logits on a coarse grid (many exact ties)
  int minus_inf;   // every how-many-th logit is -inf (0: none)
};

strata::backend::RouterSpec make_spec(strata::backend::RouterSpec::Gating g, int n_expert, int top_k, bool norm,
                                      int n_group = 0, int n_group_used = 0, float scale = 1.0f, bool bias = false,
                                      uint32_t seed = 1) {
  strata::backend::RouterSpec s;
  s.gating = g;
  s.n_expert = n_expert;
  s.top_k = top_k;
  s.norm_topk = norm;
  s.n_group = n_group;
  s.n_group_used = n_group_used;
  s.weights_scale = scale;
  if (bias) {
    std::mt19937 rng(seed);
    s.selection_bias = random_floats(size_t(n_expert), rng, -0.05f, 0.05f);
  }
  return s;
}

cuda::RouteSpec device_spec(const strata::backend::RouterSpec& s, const float* d_bias) {
  cuda::RouteSpec r;
  using G = strata::backend::RouterSpec::Gating;
  r.gating = s.gating == G::Softmax ? 0 : s.gating == G::Sigmoid ? 1 : 2;
  r.n_expert = s.n_expert;
  r.top_k = s.top_k;
  r.norm_topk = s.norm_topk;
  r.n_group = s.n_group;
  r.n_group_used = s.n_group_used;
  r.weights_scale = s.weights_scale;
  r.selection_bias = d_bias;
  return r;
}

// Runs the device selection on `logits` ([T][n_expert]); returns the status and the routing.
std::vector<int32_t> device_select(const strata::backend::RouterSpec& s, const std::vector<float>& logits, int64_t T,
                                   strata::backend::Routing& r) {
  const int K = s.top_k;
  cuda::DeviceBuffer d_l = upload(logits), d_b = upload(s.selection_bias);
  cuda::DeviceBuffer d_o(cuda::route_bytes(T, K));
  const cuda::RouteOut o = cuda::route_layout(d_o.get(), T, K);
  cuda::select_topk(device_spec(s, s.selection_bias.empty() ? nullptr : d_b.as<float>()), d_l.as<float>(),
                    s.n_expert, T, o);
  std::vector<uint8_t> host = download<uint8_t>(d_o, cuda::route_bytes(T, K));
  const cuda::RouteOut h = cuda::route_layout(host.data(), T, K);
  r.top_k = K;
  r.ids.assign(h.ids, h.ids + T * K);
  r.probs.assign(h.probs, h.probs + T * K);
  r.weights.assign(h.weights, h.weights + T * K);
  r.next_prob.assign(h.next_prob, h.next_prob + T);
  return std::vector<int32_t>(h.status, h.status + T);
}

}  // namespace

TEST(CudaKernels, RouteSelectMatchesHost) {
  REQUIRE_CUDA_DEVICE();
  using G = strata::backend::RouterSpec::Gating;
  const RouteCase cases[] = {
      {"qwen3moe softmax 128/8", make_spec(G::Softmax, 128, 8, true), 0, 0},
      {"qwen3moe softmax 128/8 ties", make_spec(G::Softmax, 128, 8, true), 1, 0},
      {"softmax 128/8 -inf", make_spec(G::Softmax, 128, 8, true), 0, 7},
      {"qwen3next softmax 512/10", make_spec(G::Softmax, 512, 10, true), 0, 0},
      {"mixtral softmax 8/2 ties", make_spec(G::Softmax, 8, 2, true), 1, 0},
      {"softmax no norm 64/6", make_spec(G::Softmax, 64, 6, false), 0, 0},
      {"deepseek-v3 sigmoid grouped 256/8", make_spec(G::Sigmoid, 256, 8, true, 8, 4, 2.5f, true), 0, 0},
      {"deepseek-v3 sigmoid grouped ties", make_spec(G::Sigmoid, 256, 8, true, 8, 4, 2.5f, false), 1, 0},
      {"glm4moe sigmoid 128/8 bias", make_spec(G::Sigmoid, 128, 8, true, 1, 1, 1.0f, true, 5), 0, 0},
      {"sigmoid -inf ties", make_spec(G::Sigmoid, 160, 6, false, 0, 0, 16.0f), 1, 5},
      {"gpt-oss softmax-topk 32/4", make_spec(G::SoftmaxTopK, 32, 4, true), 0, 0},
      {"softmax-topk 128/4 ties -inf", make_spec(G::SoftmaxTopK, 128, 4, true), 1, 3},
      {"top_k = n_expert", make_spec(G::Softmax, 16, 16, true), 0, 0},
      {"2048 experts", make_spec(G::Softmax, 2048, 16, true), 0, 0},
  };
  std::mt19937 rng(4242);
  double max_p = 0, max_w = 0;
  for (const RouteCase& c : cases) {
    const int n = c.spec.n_expert;
    const int64_t T = 300;
    std::vector<float> logits = random_floats(size_t(T * n), rng, -6.0f, 6.0f);
    for (size_t i = 0; i < logits.size(); ++i) {
      if (c.ties) logits[i] = std::round(logits[i] * 2) / 2;  // 25 values: exact ties in every row
      if (c.minus_inf && i % size_t(c.minus_inf) == 0) logits[i] = -INFINITY;
    }
    strata::backend::Routing host, dev;
    std::vector<float> copy = logits;
    strata::backend::select_experts(c.spec, copy.data(), T, host);
    const std::vector<int32_t> status = device_select(c.spec, logits, T, dev);
    int64_t id_mismatch = 0;
    for (int64_t t = 0; t < T; ++t) {
      ASSERT_EQ(status[size_t(t)], 0) << c.name << " token " << t;
      for (int k = 0; k < c.spec.top_k; ++k) {
        const size_t i = size_t(t * c.spec.top_k + k);
        if (host.ids[i] != dev.ids[i]) {
          ++id_mismatch;
          continue;
        }
        const double dp = ulp_diff(host.probs[i], dev.probs[i]), dw = ulp_diff(host.weights[i], dev.weights[i]);
        max_p = std::max(max_p, dp), max_w = std::max(max_w, dw);
        EXPECT_LE(dp, 8.0) << c.name << " t " << t << " k " << k << ": " << host.probs[i] << " vs " << dev.probs[i];
        EXPECT_LE(dw, 16.0) << c.name << " t " << t << " k " << k << ": " << host.weights[i] << " vs "
                            << dev.weights[i];
      }
      const double dn = ulp_diff(host.next_prob[size_t(t)], dev.next_prob[size_t(t)]);
      max_p = std::max(max_p, dn);
      EXPECT_LE(dn, 8.0) << c.name << " t " << t << " next_prob";
    }
    EXPECT_EQ(id_mismatch, 0) << c.name;
  }
  std::printf("route select, device vs host: max %.0f ulp (probs, next_prob), %.0f ulp (weights)\n", max_p, max_w);
}

TEST(CudaKernels, RouteSelectDefectsAsHost) {
  REQUIRE_CUDA_DEVICE();
  using G = strata::backend::RouterSpec::Gating;
  struct Defect {
    G gating;
    float value;
    bool all;  // every logit of the token is `value`
    int code;  // router_logits_defect's
  };
  const Defect defects[] = {{G::Softmax, NAN, false, 1},      {G::Sigmoid, NAN, false, 1},
                            {G::SoftmaxTopK, NAN, false, 1},  {G::Softmax, INFINITY, false, 2},
                            {G::SoftmaxTopK, INFINITY, false, 2}, {G::Softmax, -INFINITY, true, 3},
                            {G::Sigmoid, INFINITY, false, 0}, {G::Sigmoid, -INFINITY, true, 0}};
  std::mt19937 rng(7);
  for (const Defect& d : defects) {
    // (Sigmoid without norm_topk: all -inf gives probabilities 0, whose normalization would be 0 / 0.)
    const strata::backend::RouterSpec spec = make_spec(d.gating, 64, 4, d.gating != G::Sigmoid);
    const int64_t T = 40, bad = 17, also_bad = 29;
    std::vector<float> logits = random_floats(size_t(T * 64), rng, -3.0f, 3.0f);
    for (int64_t t : {bad, also_bad})
      for (int e = 0; e < 64; ++e)
        if (d.all || e == 5) logits[size_t(t * 64 + e)] = d.value;
    strata::backend::Routing host, dev;
    const std::vector<int32_t> status = device_select(spec, logits, T, dev);
    EXPECT_EQ(strata::backend::router_logits_defect(d.gating, &logits[size_t(bad * 64)], 64), d.code);
    std::vector<float> copy = logits;
    if (d.code == 0) {
      strata::backend::select_experts(spec, copy.data(), T, host);
      for (int64_t t = 0; t < T; ++t) ASSERT_EQ(status[size_t(t)], 0);
      EXPECT_EQ(host.ids, dev.ids);  // +inf -> p = 1, -inf -> p = 0 exactly on both
      for (size_t i = 0; i < host.weights.size(); ++i) EXPECT_LE(ulp_diff(host.weights[i], dev.weights[i]), 8.0) << i;
      for (int k = 0; k < 4; ++k) {
        // The defective-looking tokens: +inf at expert 5 is chosen first with p = 1; all -inf:
        // experts 0..3 (ties, lower id first) with p = 0.
        const size_t i = size_t(bad * 4 + k);
        if (d.all) {
          EXPECT_TRUE(dev.ids[i] == k && dev.weights[i] == 0.0f) << k;
        } else if (k == 0) {
          EXPECT_TRUE(dev.ids[i] == 5 && dev.weights[i] == 1.0f);
        }
      }
      continue;
    }
    for (int64_t t = 0; t < T; ++t)
      EXPECT_EQ(status[size_t(t)], t == bad || t == also_bad ? d.code : 0) << "token " << t;
    try {
      strata::backend::select_experts(spec, copy.data(), T, host);
      ADD_FAILURE() << "the host selection accepted defect " << d.code;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), strata::backend::router_logits_defect_message(d.code, bad));
    }
  }
}

// ---- route_fused: the router matmul and the selection in one launch (decode) ----
// Bit for bit equal to cuda::matmul (F32) + add_bias + select_topk with pair jobs: the logits,
// the RouteOut arrays (status, ids, probs, weights, next_prob) and both pair-job arrays, compared
// as bytes (outputs start as the same garbage, so a word one path writes and the other does not
// shows too).
namespace {

struct FusedRouteRun {
  std::vector<uint8_t> logits, route, gate_up, down;
};

struct FusedRouteInputs {
  int n = 0, K = 0;
  int64_t cols = 0, T = 0;
  cuda::RouteSpec rs;
  const float* W = nullptr;
  const float* rbias = nullptr;  // router bias (add_bias) or null
  const float* x = nullptr;
  const void* const* table = nullptr;
};

// Device outputs of one routing: logits, RouteOut and the pair jobs, filled with 0xcd bytes.
struct FusedRouteBuffers {
  cuda::DeviceBuffer logits, route, gu, dn;
  FusedRouteBuffers(int n, int K, int64_t T) {
    const size_t nl = size_t(T) * size_t(n) * 4, nr = cuda::route_bytes(T, K),
                 nj = size_t(T) * size_t(K) * sizeof(cuda::GroupedMatmulJob);
    logits = upload(std::vector<uint8_t>(nl, 0xcd));
    route = upload(std::vector<uint8_t>(nr, 0xcd));
    gu = upload(std::vector<uint8_t>(nj, 0xcd));
    dn = upload(std::vector<uint8_t>(nj, 0xcd));
  }
  cuda::PairJobs jobs(const void* const* table) const {
    cuda::PairJobs pj;
    pj.table = table;
    pj.blocks_gu = 3, pj.blocks_dn = 5;
    pj.gate_up = gu.as<cuda::GroupedMatmulJob>();
    pj.down = dn.as<cuda::GroupedMatmulJob>();
    return pj;
  }
  FusedRouteRun download_all(int n, int K, int64_t T) const {
    const size_t nj = size_t(T) * size_t(K) * sizeof(cuda::GroupedMatmulJob);
    return {download<uint8_t>(logits, size_t(T) * size_t(n) * 4), download<uint8_t>(route, cuda::route_bytes(T, K)),
            download<uint8_t>(gu, nj), download<uint8_t>(dn, nj)};
  }
};

// Queues one routing into b: route_fused (fused) or the two-launch path.
void queue_route(const FusedRouteInputs& in, const FusedRouteBuffers& b, bool fused, unsigned* counter) {
  const cuda::RouteOut ro = cuda::route_layout(b.route.get(), in.T, in.K);
  const cuda::PairJobs pj = b.jobs(in.table);
  float* logits = b.logits.as<float>();
  if (fused) {
    cuda::route_fused(in.rs, in.W, size_t(in.cols) * 4, in.cols, in.rbias, in.x, in.cols, in.T, logits, ro, counter,
                      nullptr, &pj);
    return;
  }
  cuda::matmul(GgmlType::F32, in.W, size_t(in.cols) * 4, in.n, in.cols, in.x, in.cols, in.T, logits, in.n);
  if (in.rbias) cuda::add_bias(logits, in.n, in.rbias, in.n, in.T);
  cuda::select_topk(in.rs, logits, in.n, in.T, ro, nullptr, &pj);
}

// Both paths on `in`; expects equal bytes everywhere, returns the statuses.
std::vector<int32_t> expect_fused_route_equal(const FusedRouteInputs& in, unsigned* counter, const std::string& what) {
  FusedRouteBuffers ref(in.n, in.K, in.T), fus(in.n, in.K, in.T);
  queue_route(in, ref, false, counter);
  queue_route(in, fus, true, counter);
  const FusedRouteRun a = ref.download_all(in.n, in.K, in.T), b = fus.download_all(in.n, in.K, in.T);
  EXPECT_TRUE(a.logits == b.logits) << what << ": logits";
  EXPECT_TRUE(a.route == b.route) << what << ": status / ids / probs / weights / next_prob";
  EXPECT_TRUE(a.gate_up == b.gate_up) << what << ": gate/up pair jobs";
  EXPECT_TRUE(a.down == b.down) << what << ": down pair jobs";
  std::vector<int32_t> status(size_t(in.T));
  std::memcpy(status.data(), b.route.data(), status.size() * 4);
  // The statuses are router_logits_defect's of the logits.
  using G = strata::backend::RouterSpec::Gating;
  const G g = in.rs.gating == 0 ? G::Softmax : in.rs.gating == 1 ? G::Sigmoid : G::SoftmaxTopK;
  for (int64_t t = 0; t < in.T; ++t) {
    const float* lt = reinterpret_cast<const float*>(b.logits.data()) + t * in.n;
    EXPECT_EQ(status[size_t(t)], strata::backend::router_logits_defect(g, lt, in.n)) << what << " token " << t;
  }
  return status;
}

// A fake expert table ([n][3] distinct "pointers"; the jobs only copy them).
cuda::DeviceBuffer fake_table(int n) {
  std::vector<uint64_t> t(size_t(n) * 3);
  for (size_t i = 0; i < t.size(); ++i) t[i] = 0x100000 + 64 * i;
  return upload(t);
}

}  // namespace

TEST(CudaKernels, RouteFusedEqualsMatmulThenSelect) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(2024);
  cuda::DeviceBuffer counter = upload(std::vector<uint32_t>{0});
  int idx = 0, ran = 0;
  for (int n : {4, 8, 64, 128, 256, 512, 2048}) {
    cuda::DeviceBuffer table = fake_table(n);
    for (int K : {1, 2, 8, 22}) {
      if (K > n) continue;
      for (int v = 0; v < 6; ++v, ++idx) {
        const int64_t cols = std::array<int64_t, 3>{2048, 776, 4096}[size_t(idx % 3)];
        int64_t T = 1 + idx % cuda::kFusedRouteMaxTokens;
        while (T > 1 && !cuda::route_fused_fits(n, cols, T, nullptr, size_t(cols) * 4, nullptr, cols)) --T;
        FusedRouteInputs in;
        in.n = n, in.K = K, in.cols = cols, in.T = T;
        cuda::RouteSpec& rs = in.rs;
        rs.n_expert = n, rs.top_k = K;
        const bool ties = v == 5;
        std::vector<float> w = random_floats(size_t(n) * size_t(cols), rng, -0.1f, 0.1f);
        std::vector<float> x = random_floats(size_t(T) * size_t(cols), rng, -1.0f, 1.0f);
        if (ties) {  // exact sums on a coarse grid: many equal logits (the tie rules)
          for (float& f : w) f = std::round(f * 20) / 4;
          for (float& f : x) f = std::round(f * 2);
        }
        std::vector<float> rbias = random_floats(size_t(n), rng, -0.5f, 0.5f);
        std::vector<float> sbias = random_floats(size_t(n), rng, -0.05f, 0.05f);
        bool use_rbias = false, use_sbias = false;
        switch (v) {
          case 0: rs.gating = 0; break;                                             // softmax, norm
          case 1: rs.gating = 0, rs.norm_topk = false, use_rbias = true; break;     // + router bias
          case 2: rs.gating = 1, rs.weights_scale = 2.5f, use_sbias = true; break;  // sigmoid + selection bias
          case 3:  // sigmoid, group limit (deepseek-v3 style) + selection bias
            if (n % 8 != 0 || (n / 8) * 4 < K) continue;
            rs.gating = 1, rs.n_group = 8, rs.n_group_used = 4, rs.weights_scale = 2.5f, use_sbias = true;
            break;
          case 4: rs.gating = 2, use_rbias = true; break;                           // softmax over the top-k
          default: rs.gating = idx % 2 ? 0 : 1, use_sbias = rs.gating == 1; break;  // ties
        }
        cuda::DeviceBuffer d_w = upload(w), d_x = upload(x), d_rb = upload(rbias), d_sb = upload(sbias);
        in.W = d_w.as<float>(), in.x = d_x.as<float>();
        in.rbias = use_rbias ? d_rb.as<float>() : nullptr;
        rs.selection_bias = use_sbias ? d_sb.as<float>() : nullptr;
        in.table = static_cast<const void* const*>(table.get());
        ASSERT_TRUE(cuda::route_fused_fits(n, cols, T, in.W, size_t(cols) * 4, in.x, cols));
        const std::string what = "n " + std::to_string(n) + " K " + std::to_string(K) + " variant " +
                                 std::to_string(v) + " T " + std::to_string(T) + " cols " + std::to_string(cols);
        const std::vector<int32_t> status = expect_fused_route_equal(in, counter.as<unsigned>(), what);
        for (int32_t s : status) EXPECT_EQ(s, 0) << what;
        ++ran;
      }
    }
  }
  EXPECT_EQ(download<uint32_t>(counter, 1)[0], 0u) << "every launch leaves the counter at 0";
  std::printf("route_fused: %d cases bit-identical with matmul + select_topk\n", ran);
}

TEST(CudaKernels, RouteFusedDefectsEqualTwoLaunches) {
  REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(99);
  cuda::DeviceBuffer counter = upload(std::vector<uint32_t>{0});
  const int n = 128, K = 8;
  const int64_t cols = 2048, T = 3;
  cuda::DeviceBuffer table = fake_table(n);
  const std::vector<float> w = random_floats(size_t(n) * size_t(cols), rng, -0.1f, 0.1f);
  cuda::DeviceBuffer d_w = upload(w);
  // Defects through the router bias (every token) or one token's hidden state (NaN there makes
  // all of its logits NaN).
  enum Kind { kBiasNan, kBiasPinf, kBiasAllMinf, kXNan };
  for (int gating = 0; gating <= 2; ++gating) {
    for (Kind kind : {kBiasNan, kBiasPinf, kBiasAllMinf, kXNan}) {
      std::vector<float> x = random_floats(size_t(T) * size_t(cols), rng, -1.0f, 1.0f);
      std::vector<float> rbias = random_floats(size_t(n), rng, -0.5f, 0.5f);
      if (kind == kBiasNan) rbias[5] = NAN;
      if (kind == kBiasPinf) rbias[9] = INFINITY;
      if (kind == kBiasAllMinf) std::fill(rbias.begin(), rbias.end(), -INFINITY);
      if (kind == kXNan) x[size_t(1 * cols + 7)] = NAN;
      cuda::DeviceBuffer d_x = upload(x), d_rb = upload(rbias);
      FusedRouteInputs in;
      in.n = n, in.K = K, in.cols = cols, in.T = T;
      in.rs.gating = gating, in.rs.n_expert = n, in.rs.top_k = K;
      in.rs.norm_topk = gating != 1;  // (sigmoid, all -inf: p = 0 everywhere, whose norm would be 0 / 0)
      in.W = d_w.as<float>(), in.x = d_x.as<float>(), in.rbias = d_rb.as<float>();
      in.table = static_cast<const void* const*>(table.get());
      const std::string what = "gating " + std::to_string(gating) + " defect " + std::to_string(int(kind));
      const std::vector<int32_t> st = expect_fused_route_equal(in, counter.as<unsigned>(), what);
      // The expected codes (router_logits_defect's order: NaN 1; +inf 2 and no finite value 3,
      // both softmax gatings only).
      for (int64_t t = 0; t < T; ++t) {
        int want = 0;
        if (kind == kBiasNan || (kind == kXNan && t == 1)) want = 1;
        if (kind == kBiasPinf && gating != 1) want = 2;
        if (kind == kBiasAllMinf && gating != 1) want = 3;
        EXPECT_EQ(st[size_t(t)], want) << what << " token " << t;
      }
    }
  }
  EXPECT_EQ(download<uint32_t>(counter, 1)[0], 0u);
}

TEST(CudaKernels, RouteSelectTooFewValidScoresIsStatus4) {
  REQUIRE_CUDA_DEVICE();
  // A selection bias with NaN (a damaged model: the logit checks do not see it) leaves fewer than
  // top_k valid scores: the token's status is 4 ("unusable") and its pair jobs name expert 0's
  // weights (never a null pointer), on both paths, bit for bit equal; the other tokens select.
  std::mt19937 rng(41);
  cuda::DeviceBuffer counter = upload(std::vector<uint32_t>{0});
  const int n = 128, K = 8;
  const int64_t cols = 2048, T = 2;
  cuda::DeviceBuffer table = fake_table(n);
  cuda::DeviceBuffer d_w = upload(random_floats(size_t(n) * size_t(cols), rng, -0.1f, 0.1f));
  cuda::DeviceBuffer d_x = upload(random_floats(size_t(T) * size_t(cols), rng, -1.0f, 1.0f));
  for (int valid : {0, 3, K - 1, K}) {  // how many experts keep a finite selection bias
    std::vector<float> sbias(size_t(n), NAN);
    for (int e = 0; e < valid; ++e) sbias[size_t(11 * e % n)] = 0.01f * float(e);
    cuda::DeviceBuffer d_sb = upload(sbias);
    FusedRouteInputs in;
    in.n = n, in.K = K, in.cols = cols, in.T = T;
    in.rs.gating = 1, in.rs.n_expert = n, in.rs.top_k = K, in.rs.selection_bias = d_sb.as<float>();
    in.W = d_w.as<float>(), in.x = d_x.as<float>();
    in.table = static_cast<const void* const*>(table.get());
    const std::string what = std::to_string(valid) + " valid scores";
    FusedRouteBuffers fus(n, K, T);
    queue_route(in, fus, true, counter.as<unsigned>());
    FusedRouteBuffers ref(n, K, T);
    queue_route(in, ref, false, counter.as<unsigned>());
    const FusedRouteRun a = ref.download_all(n, K, T), b = fus.download_all(n, K, T);
    EXPECT_TRUE(a.route == b.route && a.gate_up == b.gate_up && a.down == b.down) << what;
    std::vector<int32_t> status(static_cast<size_t>(T));
    std::memcpy(status.data(), b.route.data(), status.size() * 4);
    std::vector<cuda::GroupedMatmulJob> gu(size_t(T * K)), dn(size_t(T * K));
    std::memcpy(gu.data(), b.gate_up.data(), b.gate_up.size());
    std::memcpy(dn.data(), b.down.data(), b.down.size());
    const std::vector<uint64_t> tab = download<uint64_t>(table, size_t(n) * 3);
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(status[size_t(t)], valid < K ? 4 : 0) << what;
      for (int k = 0; k < K; ++k) {
        const cuda::GroupedMatmulJob &g = gu[size_t(t * K + k)], &d = dn[size_t(t * K + k)];
        ASSERT_NE(g.w, nullptr) << what;
        ASSERT_NE(g.w2, nullptr) << what;
        ASSERT_NE(d.w, nullptr) << what;
        if (valid < K) {
          EXPECT_EQ(reinterpret_cast<uint64_t>(g.w), tab[0]) << what;
          EXPECT_EQ(reinterpret_cast<uint64_t>(g.w2), tab[1]) << what;
          EXPECT_EQ(reinterpret_cast<uint64_t>(d.w), tab[2]) << what;
        }
      }
    }
  }
  EXPECT_EQ(download<uint32_t>(counter, 1)[0], 0u);
  EXPECT_NE(strata::backend::router_logits_defect_message(4, 0).find("unusable"), std::string::npos);
}

TEST(CudaKernels, RouteFusedConsecutiveCalls) {
  REQUIRE_CUDA_DEVICE();
  // Many launches queued back to back on one counter (PDL where the device has it), interleaved
  // with the two-launch path: each equals its reference, so the last-block count restarts at 0
  // every time (a stale count would make a block other than the last select, on missing logits).
  std::mt19937 rng(5);
  cuda::DeviceBuffer counter = upload(std::vector<uint32_t>{0});
  const int n = 128, K = 8;
  const int64_t cols = 2048;
  cuda::DeviceBuffer table = fake_table(n);
  cuda::DeviceBuffer d_w = upload(random_floats(size_t(n) * size_t(cols), rng, -0.1f, 0.1f));
  cuda::DeviceBuffer d_sb = upload(random_floats(size_t(n), rng, -0.05f, 0.05f));
  const int kCalls = 24;
  std::vector<cuda::DeviceBuffer> xs;
  std::vector<FusedRouteInputs> ins;
  std::vector<std::unique_ptr<FusedRouteBuffers>> ref, fus;
  for (int i = 0; i < kCalls; ++i) {
    const int64_t T = 1 + i % 2;
    xs.push_back(upload(random_floats(size_t(T) * size_t(cols), rng, -1.0f, 1.0f)));
    FusedRouteInputs in;
    in.n = n, in.K = K, in.cols = cols, in.T = T;
    in.rs.gating = i % 3 == 2 ? 1 : 0, in.rs.n_expert = n, in.rs.top_k = K;
    in.rs.selection_bias = in.rs.gating == 1 ? d_sb.as<float>() : nullptr;
    in.W = d_w.as<float>(), in.x = xs.back().as<float>();
    in.table = static_cast<const void* const*>(table.get());
    ins.push_back(in);
    ref.push_back(std::make_unique<FusedRouteBuffers>(n, K, T));
    fus.push_back(std::make_unique<FusedRouteBuffers>(n, K, T));
  }
  for (int i = 0; i < kCalls; ++i) {  // no synchronization in between
    queue_route(ins[size_t(i)], *fus[size_t(i)], true, counter.as<unsigned>());
    if (i % 4 == 3) queue_route(ins[size_t(i)], *fus[size_t(i)], true, counter.as<unsigned>());  // twice in a row
    queue_route(ins[size_t(i)], *ref[size_t(i)], false, counter.as<unsigned>());
  }
  for (int i = 0; i < kCalls; ++i) {
    const FusedRouteInputs& in = ins[size_t(i)];
    const FusedRouteRun a = ref[size_t(i)]->download_all(n, K, in.T), b = fus[size_t(i)]->download_all(n, K, in.T);
    EXPECT_TRUE(a.logits == b.logits && a.route == b.route && a.gate_up == b.gate_up && a.down == b.down)
        << "call " << i;
  }
  EXPECT_EQ(download<uint32_t>(counter, 1)[0], 0u);
}

TEST(CudaKernels, RouteFusedFits) {
  // Host-only checks of the shape conditions (no device needed).
  alignas(16) static float buf[8];
  EXPECT_TRUE(cuda::route_fused_fits(128, 2048, 1, buf, 2048 * 4, buf, 2048));
  EXPECT_TRUE(cuda::route_fused_fits(128, 2048, cuda::kFusedRouteMaxTokens, buf, 2048 * 4, buf, 2048));
  EXPECT_FALSE(cuda::route_fused_fits(128, 2048, cuda::kFusedRouteMaxTokens + 1, buf, 2048 * 4, buf, 2048));
  EXPECT_FALSE(cuda::route_fused_fits(128, 2048, 0, buf, 2048 * 4, buf, 2048));
  EXPECT_TRUE(cuda::route_fused_fits(512, 2048, 4, buf, 2048 * 4, buf, 2048));
  EXPECT_TRUE(cuda::route_fused_fits(2048, 2048, 1, buf, 2048 * 4, buf, 2048));
  EXPECT_FALSE(cuda::route_fused_fits(2048, 2048, 2, buf, 2048 * 4, buf, 2048));     // shared memory
  EXPECT_FALSE(cuda::route_fused_fits(128, 2044, 1, buf, 2044 * 4, buf, 2044));      // cols % 8
  EXPECT_FALSE(cuda::route_fused_fits(128, 2048, 1, buf + 1, 2048 * 4, buf, 2048));  // W alignment
  EXPECT_FALSE(cuda::route_fused_fits(128, 2048, 1, buf, 2048 * 4, buf + 1, 2048));  // x alignment
  EXPECT_FALSE(cuda::route_fused_fits(128, 2048, 1, buf, 2048 * 4, buf, 2050));      // ldx % 4
  EXPECT_FALSE(cuda::route_fused_fits(4096, 2048, 1, buf, 2048 * 4, buf, 2048));     // n_expert
}
