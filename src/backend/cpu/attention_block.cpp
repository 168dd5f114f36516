#include "backend/cpu/attention_block.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace strata::cpu {

namespace {
// y[t][i] += b[i] for T rows of n floats (a projection's bias; b null: nothing), rows split over
// the pool.
void add_bias(ThreadPool& pool, float* y, const float* b, int64_t T, int64_t n) {
  if (!b) return;
  pool.parallel_for(T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < n; ++i) y[t * n + i] += b[i];
  });
}

}  // namespace

void attention_block(ThreadPool& pool, const kernels::KernelConfig& kc, const AttentionWeights& w,
                     const AttentionShape& s, const float* h, int64_t n_embd, int64_t T, int64_t pos0, float* k_cache,
                     float* v_cache, float* out) {
  const int64_t q_dim = int64_t(s.n_head) * s.head_dim;
  const int64_t kv_dim = int64_t(s.n_head_kv) * s.head_dim;
  thread_local GrowBuffer<float> tl_q, tl_k, tl_v, tl_att, tl_gate, tl_qg;
  float* const q = scratch_floats(tl_q, T * q_dim);
  float* const k = scratch_floats(tl_k, T * kv_dim);
  float* const v = scratch_floats(tl_v, T * kv_dim);
  float* const att = scratch_floats(tl_att, T * q_dim);

  // Projections. Gated: attn_q gives [n_head][q, gate] per token; split it into q and gate.
  float* gate = nullptr;
  if (s.q_gate) {
    float* const qg = scratch_floats(tl_qg, T * 2 * q_dim);
    matmul(pool, kc, w.wq, h, n_embd, T, qg, 2 * q_dim);
    add_bias(pool, qg, w.bq, T, 2 * q_dim);
    gate = scratch_floats(tl_gate, T * q_dim);
    pool.parallel_for(T, 4, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int hh = 0; hh < s.n_head; ++hh) {
          const float* src = qg + t * 2 * q_dim + int64_t(hh) * 2 * s.head_dim;
          std::copy_n(src, s.head_dim, q + t * q_dim + int64_t(hh) * s.head_dim);
          std::copy_n(src + s.head_dim, s.head_dim, gate + t * q_dim + int64_t(hh) * s.head_dim);
        }
    });
  } else {
    matmul(pool, kc, w.wq, h, n_embd, T, q, q_dim);
    add_bias(pool, q, w.bq, T, q_dim);
  }
  matmul(pool, kc, w.wk, h, n_embd, T, k, kv_dim);
  matmul(pool, kc, w.wv, h, n_embd, T, v, kv_dim);
  add_bias(pool, k, w.bk, T, kv_dim);
  add_bias(pool, v, w.bv, T, kv_dim);

  // q/k RMSNorm (per head, or over the whole row), rotary embedding, then K and V into the cache.
  pool.parallel_for(T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* qt = q + t * q_dim;
      float* kt = k + t * kv_dim;
      if (s.qk_norm_full) {  // one norm over the whole row (MiniMax-M2)
        if (w.q_norm) rms_norm(qt, w.q_norm, qt, int(q_dim), s.rms_eps);
        if (w.k_norm) rms_norm(kt, w.k_norm, kt, int(kv_dim), s.rms_eps);
      } else {
        for (int hh = 0; w.q_norm && hh < s.n_head; ++hh)
          rms_norm(qt + hh * s.head_dim, w.q_norm, qt + hh * s.head_dim, s.head_dim, s.rms_eps);
        for (int hh = 0; w.k_norm && hh < s.n_head_kv; ++hh)
          rms_norm(kt + hh * s.head_dim, w.k_norm, kt + hh * s.head_dim, s.head_dim, s.rms_eps);
      }
      rope_apply(*s.rope, qt, s.n_head, s.head_dim, pos0 + t);
      rope_apply(*s.rope, kt, s.n_head_kv, s.head_dim, pos0 + t);
      std::copy(kt, kt + kv_dim, k_cache + (pos0 + t) * kv_dim);
      std::copy(v + t * kv_dim, v + (t + 1) * kv_dim, v_cache + (pos0 + t) * kv_dim);
    }
  });

  // Scaled dot-product attention in tiles (attention_tile): kTileTokens tokens x the query heads
  // of one GQA group (or a part of them), so the tile's queries share the reads of their K/V
  // rows. A query's result does not depend on the tile it is in, so prefill, decode and any
  // chunk give the same bits. Work items: (token tile, KV head, head part), the costliest (last)
  // tiles first; the group is cut into parts only when there would be fewer than 4 items per
  // thread (a decode step has one token).
  const float scale = s.scale != 0 ? s.scale : 1.0f / std::sqrt(float(s.head_dim));
  const int group = s.n_head / s.n_head_kv;
  constexpr int64_t kTileTokens = 4;
  const int64_t n_tiles = (T + kTileTokens - 1) / kTileTokens;
  int parts = 1;
  while (parts < group && n_tiles * s.n_head_kv * parts < 4 * int64_t(pool.n_threads())) parts *= 2;
  parts = std::min(parts, group);
  const int per_part = (group + parts - 1) / parts;
  std::vector<int64_t> first(static_cast<size_t>(T)), last(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    last[size_t(t)] = pos0 + t;
    // positions [first, pos0 + t]: all of them, or the last `window`
    first[size_t(t)] = s.window > 0 ? std::max<int64_t>(0, pos0 + t + 1 - s.window) : 0;
  }
  pool.parallel_for(n_tiles * s.n_head_kv * parts, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scratch;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t tile = n_tiles - 1 - i / (int64_t(s.n_head_kv) * parts);
      const int g = int(i / parts % s.n_head_kv);
      const int h0 = int(i % parts) * per_part;
      const int nh = std::min(group - h0, per_part);
      if (nh <= 0) continue;
      const int64_t t0 = tile * kTileTokens, nt = std::min(kTileTokens, T - t0);
      AttentionTile at;
      at.q = q + t0 * q_dim + (int64_t(g) * group + h0) * s.head_dim;
      at.q_stride = q_dim;
      at.n_tok = int(nt);
      at.n_head = nh;
      at.head_dim = s.head_dim;
      at.k = k_cache + int64_t(g) * s.head_dim;
      at.v = v_cache + int64_t(g) * s.head_dim;
      at.kv_stride = kv_dim;
      at.first = first.data() + t0;
      at.last = last.data() + t0;
      at.scale = scale;
      at.out = att + t0 * q_dim + (int64_t(g) * group + h0) * s.head_dim;
      at.out_stride = q_dim;
      at.sinks = w.sinks ? w.sinks + int64_t(g) * group + h0 : nullptr;
      scratch.resize(size_t(attention_tile_scratch(at)));
      attention_tile(kc, at, scratch.data());
    }
  });

  // Gated output: att *= sigmoid(gate), element by element.
  if (s.q_gate)
    pool.parallel_for(T, 4, [&](int64_t t0, int64_t t1) {
      for (int64_t i = t0 * q_dim; i < t1 * q_dim; ++i) att[i] *= 1.0f / (1.0f + std::exp(-gate[i]));
    });

  // Output projection.
  matmul(pool, kc, w.wo, att, q_dim, T, out, n_embd);
  add_bias(pool, out, w.bo, T, n_embd);
}

void mla_attention_block(ThreadPool& pool, const kernels::KernelConfig& kc, const MlaWeights& w,
                         const backend::MlaSpec& s, const float* h, int64_t n_embd, int64_t T, int64_t pos0,
                         float* cache, float* out) {
  const int64_t H = s.n_head, R = s.kv_lora_rank, P = s.n_rot, N = s.n_nope, Vd = s.v_dim;
  const int64_t qk = N + P, C = R + P;  // q/k dims per head; cache row (= absorbed query) dims
  // Queries [T][H][N + P].
  thread_local GrowBuffer<float> tl_q, tl_qa, tl_kva, tl_qabs, tl_att, tl_o;
  float* const q = scratch_floats(tl_q, T * H * qk);
  if (s.q_lora_rank > 0) {
    const int64_t QL = s.q_lora_rank;
    float* const qa = scratch_floats(tl_qa, T * QL);
    matmul(pool, kc, w.wq_a, h, n_embd, T, qa, QL);
    pool.parallel_for(T, 4, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) rms_norm(qa + t * QL, w.q_a_norm, qa + t * QL, int(QL), s.rms_eps);
    });
    matmul(pool, kc, w.wq_b, qa, QL, T, q, H * qk);
  } else {
    matmul(pool, kc, w.wq, h, n_embd, T, q, H * qk);
  }
  // Latent and shared rotary key [T][R + P]: normed latent into the cache, kpe rotated.
  float* const kva = scratch_floats(tl_kva, T * C);
  matmul(pool, kc, w.wkv_a, h, n_embd, T, kva, C);
  // Absorbed queries [T][H][R + P]: k_b[h]^T q_nope[h], then the rotated q_pe.
  float* const qabs = scratch_floats(tl_qabs, T * H * C);
  float* const att = scratch_floats(tl_att, T * H * C);
  pool.parallel_for(T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = kva + t * C;
      rms_norm(row, w.kv_a_norm, row, int(R), s.rms_eps);
      rope_apply(*s.rope, row + R, 1, int(P), pos0 + t);
      std::copy(row, row + C, cache + (pos0 + t) * C);
      for (int64_t hh = 0; hh < H; ++hh) {
        float* qh = q + (t * H + hh) * qk;
        rope_apply(*s.rope, qh + N, 1, int(P), pos0 + t);
        std::copy(qh + N, qh + qk, qabs + (t * H + hh) * C + R);
      }
    }
  });
  // k_b[h] has R rows of N columns: qabs[t][h][:R] = k_b[h] q_nope[t][h] (one matmul per head
  // over the T tokens, rows strided by H * (N + P)).
  const size_t kb_head_bytes = size_t(R) * w.wk_b.row_bytes;
  const size_t vb_head_bytes = size_t(Vd) * w.wv_b.row_bytes;
  for (int64_t hh = 0; hh < H; ++hh) {
    MatrixRef kb = w.wk_b;
    kb.data = static_cast<const uint8_t*>(w.wk_b.data) + size_t(hh) * kb_head_bytes;
    kb.rows = R;
    matmul(pool, kc, kb, q + hh * qk, H * qk, T, qabs + hh * C, H * C);
  }
  // Attention of all heads over one shared KV "head" (keys: cache rows; values: their latent).
  const float scale = s.scale != 0 ? s.scale : 1.0f / std::sqrt(float(qk));
  pool.parallel_for(T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(size_t(std::min<int64_t>(H, 8)) * size_t(pos0 + T));
    for (int64_t t = t0; t < t1; ++t)
      attention_one(kc, qabs + t * H * C, cache, cache, C, pos0 + t + 1, int(H), 1, int(C), scale, att + t * H * C,
                    scratch.data());
  });
  // out[h] = v_b[h] ctx[h] (ctx: the first R dims of each head's output), then attn_output.
  float* const o = scratch_floats(tl_o, T * H * Vd);
  for (int64_t hh = 0; hh < H; ++hh) {
    MatrixRef vb = w.wv_b;
    vb.data = static_cast<const uint8_t*>(w.wv_b.data) + size_t(hh) * vb_head_bytes;
    vb.rows = Vd;
    matmul(pool, kc, vb, att + hh * C, H * C, T, o + hh * Vd, H * Vd);
  }
  matmul(pool, kc, w.wo, o, H * Vd, T, out, n_embd);
}

}  // namespace strata::cpu
