#pragma once
// The server's prefix cache: snapshots of sequence states (KV rows of attention layers and the
// recurrent state of linear-attention layers) keyed by the tokens that produced them, so that a
// request whose prompt starts with a cached prefix (an agent's system prompt and tools, the
// earlier turns of a chat) continues from the snapshot instead of prefilling it again.
//
// Exact: a sequence restored from a snapshot of k tokens holds the same bytes as one that ran
// those k tokens itself (the forward pass is invariant to how tokens are split into calls), so a
// cached continuation equals a fresh one bit for bit (tests/test_prefix_cache.cpp).
//
// Attention-only models can reuse any common prefix of a snapshot (KV row p depends on tokens
// 0..p only). Models with recurrent state (qwen3next's and qwen35moe's Gated DeltaNet) hold the
// state after the snapshot's last token, which cannot be rolled back: only a snapshot whose
// whole token list starts the prompt is usable. For them a lookup also reports the longest
// common prefix with any snapshot (a "checkpoint"), where the scheduler ends a prompt chunk
// and stores a snapshot, so the next request sharing that prefix hits.
//
// Memory: snapshots live in host RAM (std::vector<float>), at most `max_bytes` in all; the
// least recently used are evicted first. Used by the scheduler thread only; stats() may be
// called from any thread.
#include <cstdint>
#include <list>
#include <mutex>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "model/model.h"

namespace strata::server {

/// Counters of the prefix cache, for /metrics.
struct PrefixCacheStats {
  int64_t lookups = 0;         ///< requests that asked
  int64_t hits = 0;            ///< of them, requests that reused at least one token
  int64_t tokens_reused = 0;   ///< prompt tokens not prefilled thanks to the cache
  int64_t inserts = 0;         ///< snapshots stored
  int64_t evictions = 0;       ///< snapshots dropped to stay within max_bytes (or subsumed)
  int64_t entries = 0;         ///< snapshots held now
  int64_t bytes = 0;           ///< bytes held now (states and token lists)
  int64_t capacity_bytes = 0;  ///< the bound (--cache-ram)
};

class PrefixCache {
 public:
  /// A cache of at most `max_bytes` (0: disabled, every lookup misses and nothing is stored) for
  /// states of `be`; `recurrent`: the model has recurrent state (see above); snapshots shorter
  /// than `min_tokens` tokens are not stored.
  PrefixCache(backend::Backend& be, uint64_t max_bytes, bool recurrent, size_t min_tokens);

  /// What a lookup found.
  struct Match {
    size_t reused = 0;      ///< tokens of the prompt restored into the state (st.n_past)
    size_t checkpoint = 0;  ///< recurrent models: prompt position worth a snapshot (0 = none)
  };

  /// Restores the longest usable cached prefix of `prompt` into `st` (whose n_past becomes
  /// Match::reused; its buffers must be fresh: zero recurrent state, n_past 0) and reports it.
  /// At most prompt.size() - 1 tokens are reused, so the last prompt token is always run (its
  /// logits start the generation).
  Match restore(std::span<const int32_t> prompt, model::SequenceState& st);

  /// Stores a snapshot of `st` (st.n_past tokens, which are `tokens`). Does nothing when the
  /// cache is disabled, the snapshot is shorter than min_tokens or larger than max_bytes, or an
  /// equal (or, for attention-only models, longer) snapshot already holds it; evicts the least
  /// recently used snapshots (and, for attention-only models, those it extends) to make room.
  /// Precondition: tokens.size() == st.n_past.
  void insert(std::span<const int32_t> tokens, const model::SequenceState& st);

  PrefixCacheStats stats() const;
  bool enabled() const { return max_bytes_ > 0; }

 private:
  struct Entry {
    std::vector<int32_t> tokens;
    std::vector<std::vector<float>> k, v, conv, ssm;  // per layer; k/v: the first tokens.size() rows
    uint64_t bytes = 0;
  };
  void evict_to(uint64_t budget);

  backend::Backend& be_;
  uint64_t max_bytes_;
  bool recurrent_;
  size_t min_tokens_;
  std::list<Entry> entries_;  // most recently used first
  uint64_t bytes_ = 0;
  mutable std::mutex stats_mutex_;
  PrefixCacheStats stats_;
};

}  // namespace strata::server
