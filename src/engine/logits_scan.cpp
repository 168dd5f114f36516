#include "engine/logits_scan.h"

#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace strata::engine {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float nan_as_neginf(float x) { return std::isnan(x) ? kNegInf : x; }

}  // namespace

bool all_finite(std::span<const float> v) {
  const float* p = v.data();
  const size_t n = v.size();
  size_t i = 0;
  bool bad = false;
#if defined(__SSE2__)
  // |x| as an integer is above the largest finite float's bits exactly for inf and NaN
  const __m128i abs = _mm_set1_epi32(0x7fffffff), max_finite = _mm_set1_epi32(0x7f7fffff);
  __m128i b0 = _mm_setzero_si128(), b1 = b0, b2 = b0, b3 = b0;
  auto over = [&](size_t at) {
    return _mm_cmpgt_epi32(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + at)), abs), max_finite);
  };
  for (; i + 16 <= n; i += 16) {
    b0 = _mm_or_si128(b0, over(i));
    b1 = _mm_or_si128(b1, over(i + 4));
    b2 = _mm_or_si128(b2, over(i + 8));
    b3 = _mm_or_si128(b3, over(i + 12));
  }
  bad = _mm_movemask_epi8(_mm_or_si128(_mm_or_si128(b0, b1), _mm_or_si128(b2, b3))) != 0;
#endif
  for (; i < n; ++i) bad = bad || !std::isfinite(p[i]);
  return !bad;
}

int32_t argmax(std::span<const float> v) {
  const float* p = v.data();
  const auto n = static_cast<int32_t>(v.size());
  if (n == 0) return 0;
  // Two passes: the maximum (NaN as -inf), then the first index holding it. (-inf == -inf, so an
  // all -inf / NaN input gives index 0 when NaN reads as -inf in the second pass too.)
  float best = kNegInf;
  int32_t i = 0;
#if defined(__SSE2__)
  const __m128 ninf = _mm_set1_ps(kNegInf);
  auto key4 = [&](int32_t at) {
    const __m128 x = _mm_loadu_ps(p + at), ord = _mm_cmpord_ps(x, x);
    return _mm_or_ps(_mm_and_ps(ord, x), _mm_andnot_ps(ord, ninf));
  };
  __m128 m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm_max_ps(m0, key4(i));
    m1 = _mm_max_ps(m1, key4(i + 4));
    m2 = _mm_max_ps(m2, key4(i + 8));
    m3 = _mm_max_ps(m3, key4(i + 12));
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3)));
  for (float x : lanes) best = x > best ? x : best;
#endif
  for (; i < n; ++i) best = std::max(best, nan_as_neginf(p[i]));
  i = 0;
#if defined(__SSE2__)
  const __m128 b4 = _mm_set1_ps(best);
  for (; i + 16 <= n; i += 16) {
    const int hit = _mm_movemask_ps(_mm_cmpeq_ps(key4(i), b4)) | _mm_movemask_ps(_mm_cmpeq_ps(key4(i + 4), b4)) << 4 |
                    _mm_movemask_ps(_mm_cmpeq_ps(key4(i + 8), b4)) << 8 |
                    _mm_movemask_ps(_mm_cmpeq_ps(key4(i + 12), b4)) << 12;
    if (hit) return i + __builtin_ctz(static_cast<unsigned>(hit));
  }
#endif
  for (; i < n; ++i)
    if (nan_as_neginf(p[i]) == best) return i;
  return 0;  // not reached: the maximum is one of the elements
}

void top_k(std::span<const float> v, int k, std::vector<LogitCand>& out) {
  out.clear();
  if (k <= 0 || v.empty()) return;
  const auto n = static_cast<int32_t>(v.size());
  const int32_t m = std::min<int32_t>(k, n);
  out.reserve(static_cast<size_t>(m));
  const float* p = v.data();
  for (int32_t i = 0; i < m; ++i) out.push_back({nan_as_neginf(p[i]), i});
  // a heap whose front is the worst kept candidate; every later id is larger than all kept ones,
  // so an equal logit never displaces it: only a strictly higher logit gets in
  std::make_heap(out.begin(), out.end(), better);
  auto offer = [&](int32_t i) {
    const float x = nan_as_neginf(p[i]);
    if (!(x > out.front().logit)) return;
    std::pop_heap(out.begin(), out.end(), better);
    out.back() = {x, i};
    std::push_heap(out.begin(), out.end(), better);
  };
  int32_t i = m;
#if defined(__SSE2__)
  // skip 16 at a time while none beats the threshold (a NaN never does)
  for (; i + 16 <= n; i += 16) {
    const __m128 t = _mm_set1_ps(out.front().logit);
    const __m128 c = _mm_or_ps(_mm_or_ps(_mm_cmpgt_ps(_mm_loadu_ps(p + i), t), _mm_cmpgt_ps(_mm_loadu_ps(p + i + 4), t)),
                               _mm_or_ps(_mm_cmpgt_ps(_mm_loadu_ps(p + i + 8), t), _mm_cmpgt_ps(_mm_loadu_ps(p + i + 12), t)));
    if (_mm_movemask_ps(c) == 0) continue;
    for (int32_t j = i; j < i + 16; ++j) offer(j);
  }
#endif
  for (; i < n; ++i) offer(i);
  std::sort(out.begin(), out.end(), better);
}

}  // namespace strata::engine
