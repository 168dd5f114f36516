#include "backend/cpu/ops.h"

#include <immintrin.h>
#include <algorithm>
#include <cmath>

#include "quant/quant.h"

namespace strata::cpu {

void matmul(ThreadPool& pool, const kernels::KernelConfig& kc, const MatrixRef& W, const float* x, int64_t ldx,
            int64_t n_tok, float* y, int64_t ldy) {
  // Rows are split in blocks; each output element is computed by one call with the same
  // accumulation order whatever the block (kernels::matmul's invariance contract).
  const int64_t grain = std::max<int64_t>(8, W.rows / (pool.n_threads() * 8));
  if (kernels::has_q8_activations(kc, W.type)) {
    // q8 mode: quantize the activations once (tokens split over the pool when there are many),
    // then every row block reads the same codes
    thread_local kernels::ActQ8 tl_act;
    kernels::ActQ8& act = tl_act;       // lambdas on pool threads must see this thread's buffer
    act.resize(n_tok, W.cols, W.type);  // with W.type's lane order, made once for all row blocks
    if (n_tok * W.cols >= 32768) {
      pool.parallel_for(n_tok, 1,
                        [&](int64_t t0, int64_t t1) { kernels::quantize_activations(kc, x, ldx, t0, t1, act); });
    } else {
      kernels::quantize_activations(kc, x, ldx, 0, n_tok, act);
    }
    pool.parallel_for(W.rows, grain, [&](int64_t r0, int64_t r1) {
      kernels::matmul_q8(kc, W.type, W.data, W.row_bytes, r0, r1, W.cols, act, y, ldy);
    });
    return;
  }
  pool.parallel_for(W.rows, grain, [&](int64_t r0, int64_t r1) {
    kernels::matmul(kc, W.type, W.data, W.row_bytes, r0, r1, W.cols, x, ldx, n_tok, y, ldy);
  });
}

void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  const float scale = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale * w[i];
}

void rope_apply(const backend::RopeSpec& rope, float* x, int n_heads, int head_dim, int64_t pos) {
  const int half = rope.n_rot / 2;
  const bool neox = rope.mode == backend::RopeSpec::Mode::Neox;
  for (int i = 0; i < half; ++i) {
    const double theta = double(pos) * rope.inv_freq[i];
    const float c = float(std::cos(theta) * rope.attn_factor), s = float(std::sin(theta) * rope.attn_factor);
    const int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
    for (int h = 0; h < n_heads; ++h) {
      float* xh = x + int64_t(h) * head_dim;
      const float a = xh[i0], b = xh[i1];
      xh[i0] = a * c - b * s;
      xh[i1] = b * c + a * s;
    }
  }
}

// Dot product with 8 independent partial sums (so the compiler vectorizes it), combined in
// a fixed tree: the same inputs always give the same bits.
static inline float dot_f32(const float* a, const float* b, int n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[d + j] * b[d + j];
  for (; d < n; ++d) acc[d & 7] += a[d] * b[d];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

void attention_one(const kernels::KernelConfig& kc, const float* q, const float* k_cache, const float* v_cache,
                   int64_t kv_stride, int64_t n_pos, int n_head, int n_head_kv, int head_dim, float scale, float* out,
                   float* scratch, const float* sinks) {
  if (kc.family == kernels::CpuKernels::Avx512) {
    detail::attention_one_avx512(q, k_cache, v_cache, kv_stride, n_pos, n_head, n_head_kv, head_dim, scale, out,
                                 scratch, sinks);
    return;
  }
  const int group = n_head / n_head_kv;
  for (int h = 0; h < n_head; ++h) {
    const float* qh = q + int64_t(h) * head_dim;
    const int64_t kv_off = int64_t(h / group) * head_dim;
    float mx = -INFINITY;
    for (int64_t p = 0; p < n_pos; ++p) {
      const float s = dot_f32(qh, k_cache + p * kv_stride + kv_off, head_dim) * scale;
      scratch[p] = s;
      mx = std::max(mx, s);
    }
    if (sinks) mx = std::max(mx, sinks[h]);
    double sum = 0;
    for (int64_t p = 0; p < n_pos; ++p) {
      scratch[p] = std::exp(scratch[p] - mx);
      sum += scratch[p];
    }
    if (sinks) sum += std::exp(sinks[h] - mx);  // the sink's share of the denominator
    const float inv = float(1.0 / sum);
    // out = sum_p w_p v_p, 16 dims at a time held in four SSE registers across all positions.
    // Each lane adds w_p * v_p in position order, exactly as the scalar loop would.
    float* oh = out + int64_t(h) * head_dim;
    int d = 0;
    for (; d + 16 <= head_dim; d += 16) {
      __m128 a0 = _mm_setzero_ps(), a1 = _mm_setzero_ps(), a2 = _mm_setzero_ps(), a3 = _mm_setzero_ps();
      for (int64_t p = 0; p < n_pos; ++p) {
        const __m128 w = _mm_set1_ps(scratch[p] * inv);
        const float* vp = v_cache + p * kv_stride + kv_off + d;
        a0 = _mm_add_ps(a0, _mm_mul_ps(w, _mm_loadu_ps(vp)));
        a1 = _mm_add_ps(a1, _mm_mul_ps(w, _mm_loadu_ps(vp + 4)));
        a2 = _mm_add_ps(a2, _mm_mul_ps(w, _mm_loadu_ps(vp + 8)));
        a3 = _mm_add_ps(a3, _mm_mul_ps(w, _mm_loadu_ps(vp + 12)));
      }
      _mm_storeu_ps(oh + d, a0);
      _mm_storeu_ps(oh + d + 4, a1);
      _mm_storeu_ps(oh + d + 8, a2);
      _mm_storeu_ps(oh + d + 12, a3);
    }
    for (; d < head_dim; ++d) {
      float acc = 0;
      for (int64_t p = 0; p < n_pos; ++p) acc += scratch[p] * inv * v_cache[p * kv_stride + kv_off + d];
      oh[d] = acc;
    }
  }
}

int64_t attention_tile_scratch(const AttentionTile& t) {
  const int64_t len = t.last[t.n_tok - 1] + 1 - t.first[0];
  return int64_t(t.n_tok) * t.n_head * len;
}

void attention_tile(const kernels::KernelConfig& kc, const AttentionTile& t, float* scratch) {
  if (kc.family == kernels::CpuKernels::Avx2 && t.head_dim % 8 == 0) {
    detail::attention_tile_avx2(t, scratch);
    return;
  }
  for (int i = 0; i < t.n_tok; ++i)
    attention_one(kc, t.q + int64_t(i) * t.q_stride, t.k + t.first[i] * t.kv_stride, t.v + t.first[i] * t.kv_stride,
                  t.kv_stride, t.last[i] + 1 - t.first[i], t.n_head, 1, t.head_dim, t.scale,
                  t.out + int64_t(i) * t.out_stride, scratch, t.sinks);
}

}  // namespace strata::cpu
