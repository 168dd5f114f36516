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
