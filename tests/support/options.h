#pragma once
// Engine options the tests build: small runs on the shipped models.
#include <cstdint>

#include "engine/engine.h"

namespace strata::test {

/// EngineOptions with `n_threads` compute threads, a context of `n_ctx` tokens and an arena of
/// `arena_mb` MiB (0: automatic); every other field keeps its default.
inline engine::EngineOptions engine_options(int n_threads, int64_t n_ctx, int64_t arena_mb) {
  engine::EngineOptions o;
  o.n_threads = n_threads;
  o.n_ctx = n_ctx;
  o.arena_mb = arena_mb;
  return o;
}

}  // namespace strata::test
