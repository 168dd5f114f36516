// The server's prefix cache (src/server/prefix_cache.h) through the scheduler: a request that
// continues from a cached prefix (a shared system prompt, the earlier turn of a chat) produces
// exactly what the same request produces without the cache (token ids and log-probabilities bit
// for bit), on an attention-only model (qwen3moe) and one with recurrent state (qwen3next,
// whose Gated DeltaNet state is restored from a checkpoint); the cache stays within its bound.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "server/scheduler.h"
#include "support/paths.h"

using namespace strata;
using server::Event;
using server::GenParams;
using server::Request;
using server::Scheduler;

namespace {

engine::EngineOptions options() {
  engine::EngineOptions o;
  o.n_ctx = 512;
  return o;
}

struct Outcome {
  std::vector<std::pair<int32_t, float>> tokens;
  std::string finish;
  bool operator==(const Outcome&) const = default;
};
void PrintTo(const Outcome& o, std::ostream* os) { *os << o.finish << " after " << o.tokens.size() << " tokens"; }

Outcome run(Scheduler& s, const std::vector<int32_t>& prompt, int max_tokens = 12) {
  GenParams p;
  p.prompt = prompt;
  p.sampler.temp = 0;
  p.max_tokens = max_tokens;
  p.top_logprobs = 1;
  auto r = std::make_shared<Request>(p);
  EXPECT_TRUE(s.submit(r));
  std::vector<Event> ev;
  while (!r->wait(ev, std::chrono::milliseconds(1000))) {}
  Outcome o;
  o.finish = r->finish_reason == "error" ? "error: " + r->error : r->finish_reason;
  for (auto& e : ev)
    if (e.token) o.tokens.emplace_back(e.token->id, e.token->logprob);
  return o;
}

void wait_idle(Scheduler& s) {
  for (int i = 0; i < 500 && s.counters().slots_busy != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST(PrefixCache, CachedContinuationEqualsFresh) {
  for (const std::string& path : {test::shipped_model(), test::shipped_qwen3next()}) {
    SCOPED_TRACE(path);
    engine::Engine eng(path, options());
    const auto& tok = eng.tokenizer();
    // A shared "system prompt" of ~100 tokens and three different user turns after it.
    std::string sys_text = "You are a careful Python assistant. Rules:\n";
    for (int i = 0; i < 8; ++i) sys_text += "- rule " + std::to_string(i) + ": write small, tested functions.\n";
    const std::vector<int32_t> sys = tok.encode(sys_text);
    ASSERT_GT(sys.size(), 64u);
    const std::vector<std::vector<int32_t>> asks = {cat(sys, tok.encode("def read_lines(path):")),
                                                    cat(sys, tok.encode("class Stack:")),
                                                    cat(sys, tok.encode("def fib(n):"))};
    server::SchedulerOptions o;
    o.n_slots = 2;
    o.cache_bytes = 0;
    std::vector<Outcome> fresh;
    std::vector<int32_t> turn2;  // the first ask, its answer and a follow-up: a chat's next turn
    {
      Scheduler s(eng, o);
      for (auto& a : asks) fresh.push_back(run(s, a));
      turn2 = asks[0];
      for (auto& t : fresh[0].tokens) turn2.push_back(t.first);
      turn2 = cat(turn2, tok.encode("\n\ndef write_lines(path, lines):"));
      fresh.push_back(run(s, turn2));
      EXPECT_EQ(s.counters().cache.hits, 0);
    }
    o.cache_bytes = uint64_t(256) << 20;
    o.cache_min_tokens = 16;
    Scheduler s(eng, o);
    for (size_t k = 0; k < asks.size(); ++k) {
      EXPECT_EQ(run(s, asks[k]), fresh[k]) << k;
      wait_idle(s);  // the finished request's state goes to the cache as its slot is freed
    }
    auto c = s.counters().cache;
    // qwen3moe reuses the system prompt from the second ask on; qwen3next (recurrent state)
    // stores a checkpoint at the common prefix on the second ask and reuses it on the third.
    EXPECT_GE(c.hits, 1);
    EXPECT_GE(c.tokens_reused, int64_t(sys.size()));
    EXPECT_EQ(run(s, turn2), fresh[3]);
    const auto c2 = s.counters().cache;
    EXPECT_EQ(c2.hits, c.hits + 1);  // the whole first turn (prompt + answer) is reused
    EXPECT_GE(c2.tokens_reused - c.tokens_reused, int64_t(asks[0].size() + fresh[0].tokens.size() - 1));
    EXPECT_LE(c2.bytes, c2.capacity_bytes);
    EXPECT_GT(c2.bytes, 0);
    std::string m;
    s.write_metrics(m);
    EXPECT_NE(m.find("strata_prefix_cache_hits_total " + std::to_string(c2.hits) + "\n"), std::string::npos) << m;
  }
}

TEST(PrefixCache, BoundedWithEviction) {
  engine::Engine eng(test::shipped_model(), options());
  const auto& tok = eng.tokenizer();
  std::string base = "# module\n";
  for (int i = 0; i < 6; ++i) base += "import mod" + std::to_string(i) + "\n";
  server::SchedulerOptions o;
  o.n_slots = 1;
  o.cache_min_tokens = 8;
  o.cache_bytes = uint64_t(1) << 40;  // measure one snapshot first
  uint64_t one = 0;
  {
    Scheduler s(eng, o);
    run(s, tok.encode(base + "def a():"), 4);
    wait_idle(s);
    one = uint64_t(s.counters().cache.bytes);
  }
  ASSERT_GT(one, 0u);
  o.cache_bytes = one + one / 2;  // room for one snapshot of that size, not two
  Scheduler s(eng, o);
  const std::vector<std::string> tails = {"def a():", "class B:", "x = [", "for i in"};
  for (auto& t : tails) {
    run(s, tok.encode(t + "\n" + base), 4);  // different from the first token on: nothing to reuse
    wait_idle(s);
    EXPECT_LE(s.counters().cache.bytes, int64_t(o.cache_bytes));
  }
  const auto c = s.counters().cache;
  EXPECT_EQ(c.tokens_reused, 0);
  EXPECT_EQ(c.inserts, int64_t(tails.size()));
  EXPECT_GE(c.evictions, int64_t(tails.size()) - 2);
  EXPECT_EQ(c.entries, 1);
  // Disabled (--cache-ram 0): nothing stored.
  o.cache_bytes = 0;
  Scheduler off(eng, o);
  run(off, tok.encode(base), 4);
  wait_idle(off);
  EXPECT_EQ(off.counters().cache.inserts, 0);
}
