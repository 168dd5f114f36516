#include "server/prefix_cache.h"

#include <algorithm>

namespace strata::server {

namespace {

size_t common_prefix(std::span<const int32_t> a, std::span<const int32_t> b) {
  const size_t n = std::min(a.size(), b.size());
  size_t k = 0;
  while (k < n && a[k] == b[k]) ++k;
  return k;
}

// Floats of one position in a per-layer KV buffer of a state of n_ctx positions (rows are
// positions, model.h: [n_ctx][row]).
size_t row_floats(const model::StateBuf& b, int64_t n_ctx) { return n_ctx > 0 ? b.size() / size_t(n_ctx) : 0; }

}  // namespace

PrefixCache::PrefixCache(backend::Backend& be, uint64_t max_bytes, bool recurrent, size_t min_tokens)
    : be_(be), max_bytes_(max_bytes), recurrent_(recurrent), min_tokens_(std::max<size_t>(1, min_tokens)) {
  stats_.capacity_bytes = int64_t(max_bytes);
}

PrefixCache::Match PrefixCache::restore(std::span<const int32_t> prompt, model::SequenceState& st) {
  Match m;
  if (!enabled() || prompt.size() < 2) return m;
  const size_t limit = prompt.size() - 1;
  auto best = entries_.end();
  size_t longest_common = 0;
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    const size_t lcp = common_prefix(prompt, it->tokens);
    longest_common = std::max(longest_common, lcp);
    // Recurrent state is that after the snapshot's last token: usable only as a whole.
    const size_t usable = recurrent_ ? (lcp == it->tokens.size() ? lcp : 0) : lcp;
    if (std::min(usable, limit) > m.reused && (!recurrent_ || usable <= limit)) {
      m.reused = std::min(usable, limit);
      best = it;
    }
  }
  if (recurrent_ && std::min(longest_common, limit) > m.reused && std::min(longest_common, limit) >= min_tokens_)
    m.checkpoint = std::min(longest_common, limit);
  if (best != entries_.end()) {
    const Entry& e = *best;
    for (size_t l = 0; l < e.k.size(); ++l) {
      if (!e.k[l].empty())
        be_.upload(st.k[l].tensor(1), e.k[l].data(), m.reused * row_floats(st.k[l], st.n_ctx) * sizeof(float));
      if (!e.v[l].empty())
        be_.upload(st.v[l].tensor(1), e.v[l].data(), m.reused * row_floats(st.v[l], st.n_ctx) * sizeof(float));
    }
    for (size_t l = 0; l < e.conv.size(); ++l) {
      if (!e.conv[l].empty()) be_.upload(st.conv[l].tensor(1), e.conv[l].data(), e.conv[l].size() * sizeof(float));
      if (!e.ssm[l].empty()) be_.upload(st.ssm[l].tensor(1), e.ssm[l].data(), e.ssm[l].size() * sizeof(float));
    }
    st.n_past = int64_t(m.reused);
    entries_.splice(entries_.begin(), entries_, best);  // most recently used
  }
  std::lock_guard lk(stats_mutex_);
  ++stats_.lookups;
  if (m.reused > 0) {
    ++stats_.hits;
    stats_.tokens_reused += int64_t(m.reused);
  }
  return m;
}

void PrefixCache::insert(std::span<const int32_t> tokens, const model::SequenceState& st) {
  if (!enabled() || tokens.size() < min_tokens_ || int64_t(tokens.size()) != st.n_past) return;
  const size_t n = tokens.size();
  uint64_t bytes = n * sizeof(int32_t);
  for (size_t l = 0; l < st.k.size(); ++l) {
    bytes += n * (row_floats(st.k[l], st.n_ctx) + row_floats(st.v[l], st.n_ctx)) * sizeof(float);
    if (l < st.conv.size()) bytes += (st.conv[l].size() + st.ssm[l].size()) * sizeof(float);
  }
  if (bytes > max_bytes_) return;
  int64_t subsumed = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    const size_t lcp = common_prefix(tokens, it->tokens);
    if (lcp == n && (it->tokens.size() == n || !recurrent_)) {  // already held (equal or longer)
      entries_.splice(entries_.begin(), entries_, it);
      return;
    }
    if (!recurrent_ && lcp == it->tokens.size()) {  // the new snapshot extends this one
      bytes_ -= it->bytes;
      it = entries_.erase(it);
      ++subsumed;
      continue;
    }
    ++it;
  }
  evict_to(max_bytes_ - bytes);
  Entry e;
  e.tokens.assign(tokens.begin(), tokens.end());
  e.bytes = bytes;
  auto take = [&](const model::StateBuf& b, size_t floats) {
    std::vector<float> out(floats);
    if (floats > 0) be_.download(out.data(), b.tensor(1), floats * sizeof(float));
    return out;
  };
  for (size_t l = 0; l < st.k.size(); ++l) {
    e.k.push_back(take(st.k[l], n * row_floats(st.k[l], st.n_ctx)));
    e.v.push_back(take(st.v[l], n * row_floats(st.v[l], st.n_ctx)));
  }
  for (size_t l = 0; l < st.conv.size(); ++l) {
    e.conv.push_back(take(st.conv[l], st.conv[l].size()));
    e.ssm.push_back(take(st.ssm[l], st.ssm[l].size()));
  }
  entries_.push_front(std::move(e));
  bytes_ += bytes;
  std::lock_guard lk(stats_mutex_);
  ++stats_.inserts;
  stats_.evictions += subsumed;
  stats_.entries = int64_t(entries_.size());
  stats_.bytes = int64_t(bytes_);
}

void PrefixCache::evict_to(uint64_t budget) {
  int64_t dropped = 0;
  while (!entries_.empty() && bytes_ > budget) {
    bytes_ -= entries_.back().bytes;
    entries_.pop_back();
    ++dropped;
  }
  std::lock_guard lk(stats_mutex_);
  stats_.evictions += dropped;
  stats_.entries = int64_t(entries_.size());
  stats_.bytes = int64_t(bytes_);
}

PrefixCacheStats PrefixCache::stats() const {
  std::lock_guard lk(stats_mutex_);
  return stats_;
}

}  // namespace strata::server
