#include <chrono>
#include <thread>
// The server's scheduler without HTTP: interleaved requests give the same tokens as requests
// run alone, stop strings are held back and cut, cancellation frees the slot, a full queue
// refuses; and the logprob / stop-suffix helpers.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "chat/chat_template.h"
#include "engine/engine.h"
#include "server/scheduler.h"
#include "support/paths.h"

using namespace strata;
using server::Event;
using server::GenParams;
using server::Request;
using server::Scheduler;

namespace {

engine::Engine& shared_engine() {
  static engine::Engine eng = [] {
    engine::EngineOptions o;
    o.n_ctx = 512;
    return engine::Engine(test::shipped_model(), o);
  }();
  return eng;
}

GenParams greedy(const std::string& prompt, int max_tokens) {
  GenParams p;
  p.prompt = shared_engine().tokenizer().encode(prompt);
  p.sampler.temp = 0;
  p.max_tokens = max_tokens;
  p.end_tokens = chat::end_of_generation_tokens(shared_engine().tokenizer());
  return p;
}

std::string collect(Request& r, std::vector<Event>* events = nullptr) {
  std::vector<Event> ev;
  while (!r.wait(ev, std::chrono::milliseconds(1000))) {}
  std::string text;
  for (auto& e : ev) text += e.text;
  if (events) *events = std::move(ev);
  return text;
}

}  // namespace

TEST(Server, StopSuffixAndLogprob) {
  EXPECT_EQ(server::partial_stop_suffix("hello wor", {"world"}), 3u);
  EXPECT_EQ(server::partial_stop_suffix("hello", {"world"}), 0u);
  EXPECT_EQ(server::partial_stop_suffix("ab", {"b", "abc"}), 2u);
  EXPECT_EQ(server::partial_stop_suffix("x\n\n", {"\n\n\n", "y"}), 2u);
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, -INFINITY};
  const auto t = server::token_logprob(logits, 2, 2);
  double z = std::exp(1.0) + std::exp(3.0) + std::exp(2.0);
  EXPECT_NEAR(t.logprob, 2.0 - std::log(z), 1e-5);
  ASSERT_EQ(t.top.size(), 2u);
  EXPECT_EQ(t.top[0].first, 1);
  EXPECT_EQ(t.top[1].first, 2);
}

TEST(Server, InterleavedEqualsAlone) {
  auto& eng = shared_engine();
  const std::vector<std::string> prompts = {"def read_lines(path):", "class Stack:", "import os\n",
                                            "def fib(n):", "for i in range(3):"};
  std::vector<std::string> alone;
  {
    Scheduler s(eng, 1, 8);
    for (auto& p : prompts) {
      auto r = std::make_shared<Request>(greedy(p, 24));
      ASSERT_TRUE(s.submit(r));
      alone.push_back(collect(*r));
      EXPECT_NE(r->finish_reason, "error") << r->error;
    }
  }
  Scheduler s(eng, 3, 8);
  std::vector<std::shared_ptr<Request>> rs;
  for (auto& p : prompts) {
    rs.push_back(std::make_shared<Request>(greedy(p, 24)));
    ASSERT_TRUE(s.submit(rs.back()));
  }
  for (size_t k = 0; k < prompts.size(); ++k) {
    EXPECT_EQ(collect(*rs[k]), alone[k]) << prompts[k];
    EXPECT_EQ(rs[k]->prompt_tokens, int(eng.tokenizer().encode(prompts[k]).size()));
  }
  // The scheduler frees a slot just after the last token reaches the client: wait (bounded)
  // for that bookkeeping instead of racing it.
  auto c = s.counters();
  for (int i = 0; i < 500 && (c.slots_busy != 0 || c.completed != int64_t(prompts.size())); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    c = s.counters();
  }
  EXPECT_EQ(c.completed, int64_t(prompts.size()));
  EXPECT_EQ(c.slots_busy, 0);
}

TEST(Server, StopStringsAndLogprobs) {
  auto& eng = shared_engine();
  Scheduler s(eng, 2, 4);
  auto full = std::make_shared<Request>(greedy("def read_lines(path):", 32));
  ASSERT_TRUE(s.submit(full));
  const std::string text = collect(*full);
  ASSERT_GT(text.size(), 20u);
  const std::string stop = text.substr(10, 4);
  GenParams p = greedy("def read_lines(path):", 32);
  p.stop = {"@@@", stop};
  p.top_logprobs = 3;
  auto r = std::make_shared<Request>(p);
  ASSERT_TRUE(s.submit(r));
  std::vector<Event> ev;
  EXPECT_EQ(collect(*r, &ev), text.substr(0, text.find(stop)));
  EXPECT_EQ(r->finish_reason, "stop");
  int with_token = 0;
  for (auto& e : ev)
    if (e.token) {
      ++with_token;
      EXPECT_EQ(e.token->top.size(), 3u);
      EXPECT_EQ(e.token->top[0].first, e.token->id);  // greedy
    }
  EXPECT_EQ(with_token, r->completion_tokens);
}

TEST(Server, CancelFreesSlotAndQueueRefuses) {
  auto& eng = shared_engine();
  Scheduler s(eng, 1, 1);
  GenParams p = greedy("def main():", 400);
  p.end_tokens.clear();
  auto a = std::make_shared<Request>(p), b = std::make_shared<Request>(p), c = std::make_shared<Request>(p);
  ASSERT_TRUE(s.submit(a));
  std::vector<Event> ev;
  while (ev.empty()) a->wait(ev, std::chrono::milliseconds(100));  // a is generating
  ASSERT_TRUE(s.submit(b));                                        // b waits in the queue
  EXPECT_FALSE(s.submit(c));                                       // no room
  a->cancel();
  b->cancel();
  collect(*a);
  collect(*b);
  EXPECT_EQ(a->finish_reason, "cancelled");
  EXPECT_EQ(b->finish_reason, "cancelled");
  EXPECT_LT(a->completion_tokens, 400);
  auto d = std::make_shared<Request>(greedy("x", 2));
  // Cancelled requests leave their slot and queue place just after they finish: retry (bounded).
  bool submitted = s.submit(d);
  for (int i = 0; i < 500 && !submitted; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    submitted = s.submit(d);
  }
  ASSERT_TRUE(submitted);
  collect(*d);
  EXPECT_EQ(d->finish_reason, "length");
  const auto cnt = s.counters();
  EXPECT_EQ(cnt.cancelled, 2);
  EXPECT_EQ(cnt.rejected, 1);
}

namespace {

// What a request produced: its text, each token's id and log-probability (bit-exact floats),
// and how it ended.
struct Outcome {
  std::string text, finish;
  std::vector<std::pair<int32_t, float>> tokens;
  bool operator==(const Outcome&) const = default;
};
void PrintTo(const Outcome& o, std::ostream* os) {
  *os << o.finish << " after " << o.tokens.size() << " tokens: \"" << o.text << "\"";
}

Outcome outcome(Request& r) {
  std::vector<Event> ev;
  Outcome o;
  o.text = collect(r, &ev);
  o.finish = r.finish_reason == "error" ? "error: " + r.error : r.finish_reason;
  for (auto& e : ev)
    if (e.token) o.tokens.emplace_back(e.token->id, e.token->logprob);
  return o;
}

// Prompts of different lengths (repeating a code line), with different generation lengths.
GenParams varied(int k) {
  std::string prompt = "# file " + std::to_string(k) + "\n";
  for (int i = 0; i < k % 5; ++i)
    prompt += "def f" + std::to_string(i) + "(x):\n    return x * " + std::to_string(k) + "\n";
  prompt += k % 2 ? "class Node:" : "def main():";
  GenParams p = greedy(prompt, 6 + 3 * (k % 4));
  p.end_tokens.clear();  // fixed lengths: the whole test runs the batch, not early EOS
  p.top_logprobs = 1;
  return p;
}

int64_t wait_idle(Scheduler& s) {
  auto c = s.counters();
  for (int i = 0; i < 500 && (c.slots_busy != 0 || c.queued != 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    c = s.counters();
  }
  return c.slots_busy;
}

}  // namespace

TEST(Server, BatchedEqualsAloneWithDisconnects) {
  // 1..16 concurrent requests of different prompt and output lengths in one batched scheduler
  // (one forward per step over all of them), every fifth cancelled after its first tokens:
  // each finished request equals the same request served alone, token ids and log-probabilities
  // bit for bit; the cancelled ones are a prefix of it.
  auto& eng = shared_engine();
  constexpr int kMax = 16;
  std::vector<Outcome> alone;
  {
    server::SchedulerOptions o;
    o.n_slots = 1;
    o.cache_bytes = 0;
    Scheduler s(eng, o);
    for (int k = 0; k < kMax; ++k) {
      auto r = std::make_shared<Request>(varied(k));
      ASSERT_TRUE(s.submit(r));
      alone.push_back(outcome(*r));
      ASSERT_EQ(alone.back().finish, "length") << r->error;
    }
  }
  for (int budget : {0, 5}) {  // the default (one prompt chunk) and a budget smaller than the slots
    SCOPED_TRACE(budget);
    server::SchedulerOptions o;
    o.n_slots = kMax;
    o.batch_tokens = budget;
    o.cache_bytes = 0;
    Scheduler s(eng, o);
    for (int n : {1, 3, 16}) {
      SCOPED_TRACE(n);
      std::vector<std::shared_ptr<Request>> rs;
      for (int k = 0; k < n; ++k) {
        rs.push_back(std::make_shared<Request>(varied(k)));
        ASSERT_TRUE(s.submit(rs.back()));
      }
      for (int k = 0; k < n; ++k) {
        if (k % 5 == 4) {  // a client that hangs up after two tokens
          std::vector<Event> ev;
          int got = 0;
          while (got < 2 && !rs[size_t(k)]->wait(ev, std::chrono::milliseconds(100)))
            for (; got < 2 && !ev.empty(); ev.erase(ev.begin()))
              if (ev.front().token) ++got;
          rs[size_t(k)]->cancel();
        }
      }
      for (int k = 0; k < n; ++k) {
        const Outcome got = outcome(*rs[size_t(k)]);
        if (got.finish == "cancelled") {
          ASSERT_EQ(k % 5, 4);
          ASSERT_LE(got.tokens.size(), alone[size_t(k)].tokens.size());
          EXPECT_TRUE(std::equal(got.tokens.begin(), got.tokens.end(), alone[size_t(k)].tokens.begin())) << k;
        } else {
          EXPECT_EQ(got, alone[size_t(k)]) << k;
        }
      }
      EXPECT_EQ(wait_idle(s), 0);
    }
    // Batches formed: far fewer forward steps than tokens run, most of them with several sequences.
    const auto c = s.counters();
    EXPECT_LT(c.steps, (c.prompt_tokens + c.generated_tokens) / 2);
    std::string m;
    s.write_metrics(m);
    auto value = [&](const std::string& key) {
      const size_t at = m.find(key + " ");
      return at == std::string::npos ? -1.0 : std::stod(m.substr(at + key.size() + 1));
    };
    const double single = value("strata_batch_sequences_bucket{le=\"1\"}"), all = value("strata_batch_sequences_count");
    EXPECT_EQ(all, double(c.steps));
    EXPECT_GE(single, 0);
    EXPECT_LT(single, all / 2);
    EXPECT_NE(m.find("strata_time_to_first_token_seconds_count 20"), std::string::npos) << m;
  }
}

TEST(Server, InterleavingEqualsBatching) {
  // --no-cont-batching (one forward per slot per turn) gives the same tokens, in more steps.
  // (One scheduler at a time: the engine is not thread-safe.)
  auto& eng = shared_engine();
  server::SchedulerOptions o;
  o.n_slots = 4;
  o.cache_bytes = 0;
  std::vector<Outcome> got[2];
  int64_t steps[2] = {0, 0};
  for (int mode = 0; mode < 2; ++mode) {
    o.batching = mode == 1;
    Scheduler s(eng, o);
    std::vector<std::shared_ptr<Request>> rs;
    for (int k = 0; k < 4; ++k) {
      rs.push_back(std::make_shared<Request>(varied(k)));
      ASSERT_TRUE(s.submit(rs.back()));
    }
    for (auto& r : rs) got[mode].push_back(outcome(*r));
    steps[mode] = s.counters().steps;
  }
  EXPECT_EQ(got[0], got[1]);
  EXPECT_GT(steps[0], steps[1]);
}

TEST(Server, RequestTimeoutAndDrain) {
  auto& eng = shared_engine();
  server::SchedulerOptions o;
  o.n_slots = 1;
  // 400 tokens of the shipped model take ~0.25 s or more here (it decodes at ~1,600 tok/s on the
  // dev VM): a 0.05 s limit stops the request well before them
  o.request_timeout_s = 0.05;
  GenParams p = greedy("def main():", 400);
  p.end_tokens.clear();
  {
    Scheduler s(eng, o);
    auto r = std::make_shared<Request>(p);
    ASSERT_TRUE(s.submit(r));
    const auto t0 = std::chrono::steady_clock::now();
    collect(*r);
    EXPECT_EQ(r->finish_reason, "length");
    EXPECT_LT(r->completion_tokens, 400);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
    EXPECT_EQ(s.counters().timed_out, 1);
  }
  server::SchedulerOptions d;
  d.n_slots = 2;
  {
    // Drain: running requests that finish within the grace finish (and drain returns early).
    Scheduler t(eng, d);
    auto a = std::make_shared<Request>(greedy("x", 2)), b = std::make_shared<Request>(greedy("def f():", 3));
    ASSERT_TRUE(t.submit(a));
    ASSERT_TRUE(t.submit(b));
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(t.drain(std::chrono::seconds(30)), 0);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
    collect(*a);
    collect(*b);
    EXPECT_EQ(a->finish_reason, "length");
    EXPECT_EQ(b->finish_reason, "length");
    EXPECT_FALSE(t.submit(std::make_shared<Request>(greedy("x", 2))));  // refused once draining
  }
  {
    // ... and what does not finish within the grace is cancelled at the bound.
    Scheduler t(eng, d);
    auto longr = std::make_shared<Request>(p);
    ASSERT_TRUE(t.submit(longr));
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(t.drain(std::chrono::milliseconds(100)), 1);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
    collect(*longr);
    EXPECT_EQ(longr->finish_reason, "cancelled");
  }
}

TEST(Server, BatchTokensOutsideTheArenaRefused) {
  server::SchedulerOptions o;
  o.batch_tokens = shared_engine().options().prompt_chunk + 1;
  EXPECT_THROW(Scheduler(shared_engine(), o), std::invalid_argument);
}
