#include "server/server.h"

#include <sys/socket.h>
#include <fmt/format.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <iterator>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "server/scheduler.h"
#include "tokenizer/tokenizer.h"

namespace strata::server {

namespace {

using J = nlohmann::ordered_json;

/// An error answered to the client as {"error": {...}} with `status`.
struct ApiError {
  ApiError(int status_, std::string message_, std::string type_ = "invalid_request_error", std::string code_ = {},
           std::string param_ = {})
      : status(status_), message(std::move(message_)), type(std::move(type_)), code(std::move(code_)),
        param(std::move(param_)) {}
  int status;
  std::string message;
  std::string type;
  std::string code;
  std::string param;
  int retry_after = 0;
};

std::string dump(const J& j) { return j.dump(-1, ' ', false, J::error_handler_t::replace); }

J error_json(const ApiError& e) {
  J err = {{"message", e.message}, {"type", e.type}};
  err["param"] = e.param.empty() ? J(nullptr) : J(e.param);
  err["code"] = e.code.empty() ? J(nullptr) : J(e.code);
  return {{"error", err}};
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  if (e.retry_after > 0) res.set_header("Retry-After", std::to_string(e.retry_after));
  res.set_content(dump(error_json(e)), "application/json");
}

ApiError bad(std::string param, std::string message, std::string code = "invalid_value") {
  return ApiError{400, std::move(message), "invalid_request_error", std::move(code), std::move(param)};
}

// ---- typed access to request fields: absent or null means "not given"

const J* field(const J& b, const char* name) {
  auto it = b.find(name);
  if (it == b.end() || it->is_null()) return nullptr;
  return &*it;
}

double get_number(const J& b, const char* name, double dflt, double lo, double hi) {
  const J* v = field(b, name);
  if (!v) return dflt;
  if (!v->is_number()) throw bad(name, fmt::format("'{}' must be a number", name), "invalid_type");
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi)) throw bad(name, fmt::format("'{}' must be between {} and {}, got {}", name, lo, hi, x));
  return x;
}

int64_t get_int(const J& b, const char* name, int64_t dflt, int64_t lo, int64_t hi) {
  const J* v = field(b, name);
  if (!v) return dflt;
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (d != std::floor(d)) throw bad(name, fmt::format("'{}' must be an integer", name), "invalid_type");
    if (!(d >= double(lo) && d <= double(hi)))
      throw bad(name, fmt::format("'{}' must be between {} and {}, got {}", name, lo, hi, d));
    return int64_t(d);
  }
  if (!v->is_number_integer()) throw bad(name, fmt::format("'{}' must be an integer", name), "invalid_type");
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX))
    throw bad(name, fmt::format("'{}' must be between {} and {}", name, lo, hi));
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi) throw bad(name, fmt::format("'{}' must be between {} and {}, got {}", name, lo, hi, x));
  return x;
}

bool get_bool(const J& b, const char* name, bool dflt) {
  const J* v = field(b, name);
  if (!v) return dflt;
  if (!v->is_boolean()) throw bad(name, fmt::format("'{}' must be a boolean", name), "invalid_type");
  return v->get<bool>();
}

J parse_body(const httplib::Request& req) {
  if (auto at = tokenizer::find_invalid_utf8(req.body))
    throw bad("", fmt::format("the request body is not valid UTF-8 (byte {})", *at), "invalid_utf8");
  J b;
  try {
    b = J::parse(req.body);
  } catch (const J::parse_error& e) {
    throw bad("", fmt::format("the request body is not valid JSON: {}", e.what()), "invalid_json");
  }
  if (!b.is_object()) throw bad("", "the request body must be a JSON object", "invalid_json");
  return b;
}

std::string random_id(const char* prefix) {
  static std::mutex m;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard lk(m);
  return fmt::format("{}{:016x}", prefix, rng());
}

J bytes_json(const std::string& s) {
  J a = J::array();
  for (char c : s) a.push_back(int(static_cast<unsigned char>(c)));
  return a;
}

}  // namespace

struct Server::Impl {
  engine::Engine& eng;
  chat::ChatTemplate tmpl;
  ServerOptions opts;
  std::vector<int32_t> end_tokens;
  int64_t started = int64_t(std::time(nullptr));
  Scheduler sched;
  httplib::Server http;
  std::mutex count_mutex;
  std::map<std::pair<std::string, int>, int64_t> request_counts;

  Impl(engine::Engine& e, chat::ChatTemplate t, ServerOptions o)
      : eng(e),
        tmpl(std::move(t)),
        opts(std::move(o)),
        end_tokens(chat::end_of_generation_tokens(e.tokenizer())),
        sched(e, opts.parallel, opts.queue_size) {
    if (opts.model_name.empty()) opts.model_name = std::filesystem::path(eng.gguf().path()).stem().string();
    setup();
  }

  // ---- request parsing shared by both generation endpoints

  struct Parsed {
    GenParams gen;
    bool stream = false;
    bool include_usage = false;
  };

  void parse_common(const J& b, Parsed& p, bool chat) {
    const int64_t n_ctx = eng.n_ctx();
    auto& sp = p.gen.sampler;
    sp.temp = float(get_number(b, "temperature", sp.temp, 0, 2));
    sp.top_p = float(get_number(b, "top_p", sp.top_p, 0, 1));
    sp.top_k = int(get_int(b, "top_k", sp.top_k, 0, 1 << 20));
    sp.min_p = float(get_number(b, "min_p", sp.min_p, 0, 1));
    sp.repeat_penalty = float(get_number(b, "repeat_penalty", sp.repeat_penalty, 0, 10));
    const int64_t seed = get_int(b, "seed", -1, -1, INT64_MAX);
    sp.seed = seed < 0 ? 0xFFFFFFFF : uint64_t(seed);
    for (const char* pen : {"presence_penalty", "frequency_penalty"})
      if (get_number(b, pen, 0, -2, 2) != 0) throw bad(pen, fmt::format("'{}' is not supported by this server", pen), "unsupported");
    if (get_int(b, "n", 1, 1, 128) != 1) throw bad("n", "only n = 1 is supported", "unsupported");
    const char* mt = field(b, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    p.gen.max_tokens = int(get_int(b, mt, n_ctx, 1, n_ctx));
    p.stream = get_bool(b, "stream", false);
    if (const J* so = field(b, "stream_options")) {
      if (!so->is_object()) throw bad("stream_options", "'stream_options' must be an object", "invalid_type");
      p.include_usage = get_bool(*so, "include_usage", false);
    }
    if (const J* st = field(b, "stop")) {
      auto add = [&](const J& s) {
        if (!s.is_string()) throw bad("stop", "'stop' must be a string or an array of strings", "invalid_type");
        if (!s.get<std::string>().empty()) p.gen.stop.push_back(s.get<std::string>());
      };
      if (st->is_array()) {
        if (st->size() > 16) throw bad("stop", "at most 16 stop strings");
        for (auto& s : *st) add(s);
      } else {
        add(*st);
      }
    }
    if (chat) {
      const bool lp = get_bool(b, "logprobs", false);
      const int64_t top = get_int(b, "top_logprobs", 0, 0, 20);
      if (field(b, "top_logprobs") && !lp) throw bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
      p.gen.top_logprobs = lp ? int(top) : -1;
    } else {
      p.gen.top_logprobs = int(get_int(b, "logprobs", -1, 0, 20));
    }
    p.gen.end_tokens = get_bool(b, "ignore_eos", false) ? std::vector<int32_t>{} : end_tokens;
  }

  void check_prompt(const std::vector<int32_t>& prompt, const char* param) {
    const int64_t n_ctx = eng.n_ctx();
    if (prompt.empty()) throw bad(param, "the prompt is empty");
    if (int64_t(prompt.size()) >= n_ctx)
      throw bad(param,
                fmt::format("the prompt is {} tokens, but the context holds {} (--ctx-size) and at least one token "
                            "must be generated",
                            prompt.size(), n_ctx),
                "context_length_exceeded");
  }

  std::vector<int32_t> encode(const std::string& text) {
    try {
      return eng.tokenizer().encode(text, true);
    } catch (const tokenizer::TokenizerError& e) {
      throw bad("", e.what(), "invalid_utf8");
    }
  }

  J chat_messages(const J& b) {
    const J* m = field(b, "messages");
    if (!m) throw bad("messages", "'messages' is required", "missing_required_parameter");
    if (!m->is_array() || m->empty()) throw bad("messages", "'messages' must be a non-empty array", "invalid_type");
    J out = J::array();
    for (size_t k = 0; k < m->size(); ++k) {
      const J& msg = (*m)[k];
      const std::string where = fmt::format("messages[{}]", k);
      if (!msg.is_object()) throw bad(where, where + " must be an object", "invalid_type");
      const J* role = field(msg, "role");
      if (!role || !role->is_string()) throw bad(where + ".role", where + ".role must be a string", "invalid_type");
      static const char* const kRoles[] = {"system", "developer", "user", "assistant", "tool", "function"};
      if (std::none_of(std::begin(kRoles), std::end(kRoles), [&](const char* r) { return *role == r; }))
        throw bad(where + ".role",
                  fmt::format("{}.role '{}' is not one of system, developer, user, assistant, tool, function", where,
                              role->get<std::string>()),
                  "invalid_value");
      J o = msg;
      const J* content = field(msg, "content");
      if (!content) {
        o["content"] = "";
      } else if (content->is_array()) {
        std::string text;
        for (auto& part : *content) {
          if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
              !part["text"].is_string())
            throw bad(where + ".content", "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                      "unsupported");
          text += part["text"].get<std::string>();
        }
        o["content"] = text;
      } else if (!content->is_string()) {
        throw bad(where + ".content", where + ".content must be a string or an array of parts", "invalid_type");
      }
      out.push_back(std::move(o));
    }
    return out;
  }

  // ---- responses

  J logprob_entry_chat(const TokenLogprob& t) {
    const auto& tok = eng.tokenizer();
    J top = J::array();
    for (auto& [id, lp] : t.top)
      top.push_back({{"token", tok.token_bytes(id)}, {"logprob", lp}, {"bytes", bytes_json(tok.token_bytes(id))}});
    return {{"token", tok.token_bytes(t.id)},
            {"logprob", t.logprob},
            {"bytes", bytes_json(tok.token_bytes(t.id))},
            {"top_logprobs", top}};
  }

  // Completions-style logprobs of `events`, text offsets counted from `offset`.
  J logprobs_completion(const std::vector<Event>& events, size_t offset) {
    const auto& tok = eng.tokenizer();
    J tokens = J::array(), lps = J::array(), tops = J::array(), offs = J::array();
    for (auto& e : events) {
      if (!e.token) {
        offset += e.text.size();
        continue;
      }
      tokens.push_back(tok.token_bytes(e.token->id));
      lps.push_back(e.token->logprob);
      J top = J::object();
      for (auto& [id, lp] : e.token->top) top[tok.token_bytes(id)] = lp;
      tops.push_back(top);
      offs.push_back(offset);
      offset += e.text.size();
    }
    return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
  }

  J usage(const Request& r) {
    return {{"prompt_tokens", r.prompt_tokens},
            {"completion_tokens", r.completion_tokens},
            {"total_tokens", r.prompt_tokens + r.completion_tokens}};
  }

  std::shared_ptr<Request> submit(GenParams gen) {
    auto r = std::make_shared<Request>(std::move(gen));
    if (!sched.submit(r)) {
      ApiError e{503,
                 fmt::format("the server is busy: {} requests are generating and {} are queued; retry later",
                             opts.parallel, opts.queue_size),
                 "server_error", "server_busy"};
      e.retry_after = 1;
      throw e;
    }
    return r;
  }

  void generate(const httplib::Request&, httplib::Response& res, Parsed p, bool chat) {
    auto r = submit(std::move(p.gen));
    const std::string id = random_id(chat ? "chatcmpl-" : "cmpl-");
    const int64_t created = int64_t(std::time(nullptr));
    const std::string object = chat ? "chat.completion" : "text_completion";
    const bool logprobs = r->params.top_logprobs >= 0;

    if (!p.stream) {
      std::vector<Event> events;
      while (!r->wait(events, std::chrono::milliseconds(1000))) {
      }
      if (r->finish_reason == "error")
        throw ApiError{500, "generation failed: " + r->error, "server_error", "generation_failed"};
      std::string text;
      for (auto& e : events) text += e.text;
      J choice = {{"index", 0}};
      if (chat) {
        choice["message"] = {{"role", "assistant"}, {"content", text}};
        if (logprobs) {
          J content = J::array();
          for (auto& e : events)
            if (e.token) content.push_back(logprob_entry_chat(*e.token));
          choice["logprobs"] = {{"content", content}};
        } else {
          choice["logprobs"] = nullptr;
        }
      } else {
        choice["text"] = text;
        choice["logprobs"] = logprobs ? logprobs_completion(events, 0) : J(nullptr);
      }
      choice["finish_reason"] = r->finish_reason;
      J out = {{"id", id}, {"object", object}, {"created", created}, {"model", opts.model_name},
               {"choices", J::array({choice})}, {"usage", usage(*r)}};
      res.set_content(dump(out), "application/json");
      return;
    }

    const std::string chunk_object = chat ? "chat.completion.chunk" : "text_completion";
    const bool include_usage = p.include_usage;
    auto chunk = [this, id, created, chunk_object](J choice) {
      return J{{"id", id}, {"object", chunk_object}, {"created", created}, {"model", opts.model_name},
               {"choices", J::array({std::move(choice)})}};
    };
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, r, chat, logprobs, include_usage, chunk, id, created, chunk_object](size_t, httplib::DataSink& sink) {
          auto send = [&](const J& j) {
            const std::string s = "data: " + dump(j) + "\n\n";
            return sink.write(s.data(), s.size());
          };
          auto gone = [&] {
            r->cancel();
            return false;
          };
          if (chat && !send(chunk({{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}},
                                   {"logprobs", nullptr}, {"finish_reason", nullptr}})))
            return gone();
          std::vector<Event> events;
          size_t offset = 0;
          for (;;) {
            const bool done = r->wait(events, std::chrono::milliseconds(200));
            for (auto& e : events) {
              J choice = {{"index", 0}};
              if (chat) {
                choice["delta"] = e.text.empty() ? J::object() : J{{"content", e.text}};
                choice["logprobs"] = logprobs && e.token ? J{{"content", J::array({logprob_entry_chat(*e.token)})}}
                                                         : J(nullptr);
              } else {
                choice["text"] = e.text;
                choice["logprobs"] = logprobs && e.token ? logprobs_completion({e}, offset) : J(nullptr);
              }
              offset += e.text.size();
              choice["finish_reason"] = nullptr;
              if (!send(chunk(std::move(choice)))) return gone();
            }
            events.clear();
            if (done) break;
            if (!sink.is_writable()) return gone();
          }
          if (r->finish_reason == "error") {
            send(error_json(ApiError(500, "generation failed: " + r->error, "server_error", "generation_failed")));
          } else {
            J choice = {{"index", 0}};
            if (chat) choice["delta"] = J::object();
            else choice["text"] = "";
            choice["logprobs"] = nullptr;
            choice["finish_reason"] = r->finish_reason;
            if (!send(chunk(std::move(choice)))) return gone();
            if (include_usage) {
              J u = {{"id", id}, {"object", chunk_object}, {"created", created}, {"model", opts.model_name},
                     {"choices", J::array()}, {"usage", usage(*r)}};
              if (!send(u)) return gone();
            }
          }
          const std::string fin = "data: [DONE]\n\n";
          if (!sink.write(fin.data(), fin.size())) return gone();
          sink.done();
          return true;
        },
        [r](bool success) {
          if (!success) r->cancel();
        });
  }

  // ---- endpoints

  void chat_completions(const httplib::Request& req, httplib::Response& res) {
    const J b = parse_body(req);
    Parsed p;
    parse_common(b, p, true);
    const J messages = chat_messages(b);
    J extra = J::object();
    if (const J* kw = field(b, "chat_template_kwargs")) {
      if (!kw->is_object()) throw bad("chat_template_kwargs", "'chat_template_kwargs' must be an object", "invalid_type");
      extra = *kw;
    }
    if (const J* tools = field(b, "tools")) extra["tools"] = *tools;
    std::string prompt;
    try {
      prompt = tmpl.apply(messages, true, extra);
    } catch (const chat::RenderError& e) {
      throw bad("messages", fmt::format("the chat template rejected the messages: {}", e.what()), "invalid_messages");
    }
    p.gen.prompt = encode(prompt);
    check_prompt(p.gen.prompt, "messages");
    generate(req, res, std::move(p), true);
  }

  void completions(const httplib::Request& req, httplib::Response& res) {
    const J b = parse_body(req);
    Parsed p;
    parse_common(b, p, false);
    if (get_bool(b, "echo", false)) throw bad("echo", "'echo' is not supported", "unsupported");
    if (field(b, "suffix")) throw bad("suffix", "'suffix' is not supported", "unsupported");
    const J* pr = field(b, "prompt");
    if (!pr) throw bad("prompt", "'prompt' is required", "missing_required_parameter");
    const int32_t n_vocab = eng.tokenizer().n_vocab();
    if (pr->is_string()) {
      p.gen.prompt = encode(pr->get<std::string>());
    } else if (pr->is_array() && pr->size() == 1 && (*pr)[0].is_string()) {
      p.gen.prompt = encode((*pr)[0].get<std::string>());
    } else if (pr->is_array() && !pr->empty() && (*pr)[0].is_number()) {
      for (auto& t : *pr) {
        if (!t.is_number_integer()) throw bad("prompt", "a token-id prompt must hold integers only", "invalid_type");
        const int64_t id = t.get<int64_t>();
        if (id < 0 || id >= n_vocab) throw bad("prompt", fmt::format("token id {} is outside [0, {})", id, n_vocab));
        p.gen.prompt.push_back(int32_t(id));
      }
    } else if (pr->is_array() && pr->size() > 1) {
      throw bad("prompt", "only one prompt per request is supported", "unsupported");
    } else {
      throw bad("prompt", "'prompt' must be a string or an array of token ids", "invalid_type");
    }
    check_prompt(p.gen.prompt, "prompt");
    generate(req, res, std::move(p), false);
  }

  void models(const httplib::Request&, httplib::Response& res) {
    const auto& hp = eng.hparams();
    J m = {{"id", opts.model_name},
           {"object", "model"},
           {"created", started},
           {"owned_by", "strata"},
           {"meta", {{"architecture", hp.arch}, {"n_ctx", eng.n_ctx()}, {"n_vocab", eng.tokenizer().n_vocab()},
                     {"expert_bytes", eng.expert_bytes()}, {"arena_bytes", eng.arena_bytes()}}}};
    res.set_content(dump({{"object", "list"}, {"data", J::array({m})}}), "application/json");
  }

  void health(const httplib::Request&, httplib::Response& res) {
    // Reads only the scheduler's queue counters (not the engine lock), so it answers at once.
    J h = {{"status", "ok"}};
    res.set_content(dump(h), "application/json");
  }

  void tokenize(const httplib::Request& req, httplib::Response& res) {
    const J b = parse_body(req);
    const J* c = field(b, "content");
    if (!c || !c->is_string()) throw bad("content", "'content' must be a string", "invalid_type");
    const bool add_special = get_bool(b, "add_special", false);
    const bool parse_special = get_bool(b, "parse_special", true);
    const bool with_pieces = get_bool(b, "with_pieces", false);
    const auto& tok = eng.tokenizer();
    std::vector<int32_t> ids;
    if (add_special && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
    try {
      auto more = tok.encode(c->get<std::string>(), parse_special);
      ids.insert(ids.end(), more.begin(), more.end());
    } catch (const tokenizer::TokenizerError& e) {
      throw bad("content", e.what(), "invalid_utf8");
    }
    J out = J::array();
    for (int32_t id : ids) {
      if (!with_pieces) {
        out.push_back(id);
        continue;
      }
      const std::string& piece = tok.token_bytes(id);
      out.push_back({{"id", id}, {"piece", tokenizer::find_invalid_utf8(piece) ? bytes_json(piece) : J(piece)}});
    }
    res.set_content(dump({{"tokens", out}}), "application/json");
  }

  void detokenize(const httplib::Request& req, httplib::Response& res) {
    const J b = parse_body(req);
    const J* t = field(b, "tokens");
    if (!t || !t->is_array()) throw bad("tokens", "'tokens' must be an array of token ids", "invalid_type");
    const auto& tok = eng.tokenizer();
    tokenizer::StreamDecoder dec(tok);
    std::string text;
    for (auto& v : *t) {
      if (!v.is_number_integer()) throw bad("tokens", "'tokens' must hold integers", "invalid_type");
      const int64_t id = v.get<int64_t>();
      if (id < 0 || id >= tok.n_vocab())
        throw bad("tokens", fmt::format("token id {} is outside [0, {})", id, tok.n_vocab()));
      text += dec.push(int32_t(id));
    }
    text += dec.flush();
    res.set_content(dump({{"content", text}}), "application/json");
  }

  void metrics(const httplib::Request&, httplib::Response& res) {
    const SchedulerCounters c = sched.counters();
    std::string out;
    auto metric = [&](const char* name, const char* type, const char* help) {
      out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    };
    metric("strata_requests_total", "counter", "HTTP requests by endpoint and status code.");
    {
      std::lock_guard lk(count_mutex);
      for (auto& [k, n] : request_counts)
        out += fmt::format("strata_requests_total{{endpoint=\"{}\",status=\"{}\"}} {}\n", k.first, k.second, n);
    }
    auto gauge = [&](const char* name, const char* help, double v) {
      metric(name, "gauge", help);
      out += fmt::format("{} {}\n", name, v);
    };
    auto counter = [&](const char* name, const char* help, double v) {
      metric(name, "counter", help);
      out += fmt::format("{} {}\n", name, v);
    };
    gauge("strata_slots", "Slots (--parallel).", double(c.slots));
    gauge("strata_requests_processing", "Requests holding a slot.", double(c.slots_busy));
    gauge("strata_requests_queued", "Requests waiting for a slot.", double(c.queued));
    counter("strata_requests_rejected_total", "Requests turned away with 503 (queue full).", double(c.rejected));
    counter("strata_requests_cancelled_total", "Generations stopped because the client went away.", double(c.cancelled));
    counter("strata_requests_completed_total", "Generations finished (stop or length).", double(c.completed));
    counter("strata_prompt_tokens_total", "Prompt tokens prefilled.", double(c.prompt_tokens));
    counter("strata_generated_tokens_total", "Tokens generated.", double(c.generated_tokens));
    gauge("strata_prefill_tokens_per_second", "Prefill throughput of the engine since start.", c.prefill.tokens_per_s());
    gauge("strata_decode_tokens_per_second", "Decode throughput of the engine since start.", c.decode.tokens_per_s());
    auto phased = [&](const char* name, const char* type, const char* help, double pre, double dec) {
      metric(name, type, help);
      out += fmt::format("{}{{phase=\"prefill\"}} {}\n{}{{phase=\"decode\"}} {}\n", name, pre, name, dec);
    };
    const auto& ps = c.prefill.stream;
    const auto& ds = c.decode.stream;
    phased("strata_phase_tokens_total", "counter", "Tokens run by the engine per phase.", double(c.prefill.tokens),
           double(c.decode.tokens));
    phased("strata_phase_seconds_total", "counter", "Seconds the engine spent per phase.", c.prefill.seconds,
           c.decode.seconds);
    phased("strata_experts_needed_total", "counter", "Experts the compute asked for.", double(ps.needed),
           double(ds.needed));
    phased("strata_arena_hits_total", "counter", "Needed experts already resident in the arena.", double(ps.hits),
           double(ds.hits));
    phased("strata_arena_misses_total", "counter", "Needed experts read urgently (compute waited).", double(ps.misses),
           double(ds.misses));
    phased("strata_streamed_ahead_total", "counter", "Hits whose slot a read-ahead filled.", double(ps.streamed_ahead),
           double(ds.streamed_ahead));
    phased("strata_wasted_reads_total", "counter", "Read-aheads evicted unused.", double(ps.wasted), double(ds.wasted));
    phased("strata_bytes_read_total", "counter", "Expert bytes read from disk.", double(ps.bytes_read),
           double(ds.bytes_read));
    phased("strata_exposed_wait_seconds_total", "counter", "Seconds the compute blocked on expert reads.",
           ps.exposed_wait_s, ds.exposed_wait_s);
    gauge("strata_arena_bytes", "Bytes of the expert arena.", double(eng.arena_bytes()));
    res.set_content(out, "text/plain; version=0.0.4");
  }

  // ---- wiring

  using Handler = void (Impl::*)(const httplib::Request&, httplib::Response&);

  httplib::Server::Handler wrap(Handler h) {
    return [this, h](const httplib::Request& req, httplib::Response& res) {
      try {
        (this->*h)(req, res);
      } catch (const ApiError& e) {
        send_error(res, e);
      } catch (const std::exception& e) {
        send_error(res, ApiError(500, std::string("internal error: ") + e.what(), "server_error", "internal_error"));
      }
    };
  }

  void count(const httplib::Request& req, const httplib::Response& res) {
    static const std::set<std::string> known = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                                                "/metrics", "/tokenize", "/detokenize"};
    const std::string ep = known.count(req.path) ? req.path : "other";
    std::lock_guard lk(count_mutex);
    ++request_counts[{ep, res.status}];
  }

  void setup() {
    const int threads = opts.http_threads > 0 ? opts.http_threads : opts.parallel + opts.queue_size + 16;
    http.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
    http.set_payload_max_length(opts.max_body_bytes);
    http.set_read_timeout(30);
    http.set_write_timeout(10);
    http.set_keep_alive_timeout(5);
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (opts.api_key.empty() || req.path == "/health") return httplib::Server::HandlerResponse::Unhandled;
      const std::string auth = req.get_header_value("Authorization");
      if (auth == "Bearer " + opts.api_key) return httplib::Server::HandlerResponse::Unhandled;
      send_error(res, ApiError(401, auth.empty() ? "missing API key (send 'Authorization: Bearer KEY')" : "invalid API key",
                               "authentication_error", "invalid_api_key"));
      return httplib::Server::HandlerResponse::Handled;
    });
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      ApiError e{res.status, fmt::format("HTTP {}", res.status)};
      if (res.status == 404)
        e = ApiError(404, fmt::format("no endpoint {} {}", req.method, req.path), "invalid_request_error", "not_found");
      else if (res.status == 413)
        e = ApiError(413, "the request body is too large", "invalid_request_error", "request_too_large");
      else if (res.status == 405)
        e = ApiError(405, "method not allowed", "invalid_request_error", "method_not_allowed");
      else if (res.status >= 500) e.type = "server_error";
      send_error(res, e);
    });
    http.set_logger([this](const httplib::Request& req, const httplib::Response& res) { count(req, res); });
    http.Post("/v1/chat/completions", wrap(&Impl::chat_completions));
    http.Post("/chat/completions", wrap(&Impl::chat_completions));
    http.Post("/v1/completions", wrap(&Impl::completions));
    http.Post("/completions", wrap(&Impl::completions));
    http.Get("/v1/models", wrap(&Impl::models));
    http.Get("/models", wrap(&Impl::models));
    http.Get("/health", wrap(&Impl::health));
    http.Get("/metrics", wrap(&Impl::metrics));
    http.Post("/tokenize", wrap(&Impl::tokenize));
    http.Post("/detokenize", wrap(&Impl::detokenize));
  }
};

Server::Server(engine::Engine& eng, chat::ChatTemplate tmpl, ServerOptions opts)
    : impl_(std::make_unique<Impl>(eng, std::move(tmpl), std::move(opts))) {}

Server::~Server() { stop(); }

int Server::bind() {
  auto& o = impl_->opts;
  int port = o.port;
  if (port < 0 || port > 65535) throw std::runtime_error(fmt::format("--port {} is not a TCP port (0..65535)", port));
  // httplib's default socket options add SO_REUSEPORT, which lets a second server bind the
  // same port and silently share its connections: keep only SO_REUSEADDR.
  impl_->http.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const void*>(&yes), sizeof(yes));
  });
  if (port == 0) {
    port = impl_->http.bind_to_any_port(o.host);
    if (port < 0) throw std::runtime_error(fmt::format("cannot bind to {} (any port)", o.host));
  } else if (!impl_->http.bind_to_port(o.host, port)) {
    throw std::runtime_error(fmt::format("cannot bind to {}:{} (in use, or not an address of this machine?)", o.host, port));
  }
  return port;
}

void Server::listen() { impl_->http.listen_after_bind(); }

void Server::stop() {
  impl_->http.stop();
  impl_->sched.stop();
}

}  // namespace strata::server
