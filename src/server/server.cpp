#include "server/server.h"

#include <fmt/format.h>
#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <ctime>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "server/client_watch.h"
#include "server/openai.h"
#include "server/scheduler.h"
#include "server/tool_calls.h"
#include "server/web_page.h"
#include "tokenizer/tokenizer.h"

namespace strata::server {

namespace {

using openai::ApiError;
using J = openai::Json;

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  if (e.retry_after > 0) res.set_header("Retry-After", std::to_string(e.retry_after));
  res.set_content(openai::dump(openai::error_json(e)), "application/json");
}

// httplib's task queue for connections: a thread for every connection at once, up to
// `max_threads` (then connections wait in FIFO order for a free thread), so that slow or idle
// connections never make another (GET /health) wait behind them. httplib's own ThreadPool is
// fixed: N slow clients held all N threads. Threads idle for 30 s exit.
class ConnectionPool : public httplib::TaskQueue {
 public:
  explicit ConnectionPool(size_t max_threads) : max_(std::max<size_t>(max_threads, 1)) {}
  ~ConnectionPool() override { shutdown(); }

  void enqueue(std::function<void()> fn) override {
    std::lock_guard lk(mu_);
    jobs_.push_back(std::move(fn));
    if (jobs_.size() > idle_ && threads_ < max_) {
      ++threads_;
      std::thread([this] { worker(); }).detach();
    }
    cv_.notify_one();
  }

  void shutdown() override {
    std::unique_lock lk(mu_);
    stopping_ = true;
    cv_.notify_all();
    done_.wait(lk, [&] { return threads_ == 0; });
  }

 private:
  void worker() {
    std::unique_lock lk(mu_);
    for (;;) {
      if (jobs_.empty()) {
        if (stopping_) break;
        ++idle_;
        const bool woke = cv_.wait_for(lk, std::chrono::seconds(30), [&] { return !jobs_.empty() || stopping_; });
        --idle_;
        if (!woke) break;
        continue;
      }
      auto fn = std::move(jobs_.front());
      jobs_.pop_front();
      lk.unlock();
      fn();
      lk.lock();
    }
    --threads_;
    done_.notify_all();
  }

  const size_t max_;
  std::mutex mu_;
  std::condition_variable cv_, done_;
  std::deque<std::function<void()>> jobs_;
  size_t threads_ = 0, idle_ = 0;
  bool stopping_ = false;
};

// The token of an "Authorization: Bearer TOKEN" header (scheme case-insensitive, RFC 7235),
// or "" when it is not a bearer token.
std::string bearer_token(const std::string& auth) {
  const size_t sp = auth.find(' ');
  if (sp == std::string::npos) return {};
  std::string scheme = auth.substr(0, sp);
  for (char& c : scheme) c = char(std::tolower(static_cast<unsigned char>(c)));
  if (scheme != "bearer") return {};
  const size_t start = auth.find_first_not_of(' ', sp);
  return start == std::string::npos ? std::string() : auth.substr(start);
}

}  // namespace

struct Server::Impl {
  engine::Engine& eng;
  chat::ChatTemplate tmpl;
  chat::PromptEncoder prompt_encoder;
  ServerOptions opts;
  openai::ModelContext model;  // what the schema layer needs of the engine and the template
  int64_t started = int64_t(std::time(nullptr));
  Scheduler sched;
  httplib::Server http;
  std::mutex count_mutex;
  std::map<std::pair<std::string, int>, int64_t> request_counts;

  Impl(engine::Engine& e, chat::ChatTemplate t, ServerOptions o)
      : eng(e),
        tmpl(std::move(t)),
        prompt_encoder(e.tokenizer()),
        opts(std::move(o)),
        sched(e, scheduler_options(opts)) {
    if (opts.model_name.empty()) opts.model_name = std::filesystem::path(eng.gguf().path()).stem().string();
    model.n_ctx = eng.n_ctx();
    model.default_max_tokens = opts.n_predict;
    model.default_sampler = opts.sampling;  // parse_common drops its logit_bias per request
    model.n_vocab = eng.tokenizer().n_vocab();
    model.end_tokens = chat::end_of_generation_tokens(eng.tokenizer());
    model.encode = [this](const std::string& text, bool parse_special) {
      return eng.tokenizer().encode(text, parse_special);
    };
    model.encode_chat = [this](const J& messages, const J& extra) {
      return prompt_encoder.encode_chat(tmpl, messages, true, extra);
    };
    model.tool_format = tools::detect_format(tmpl.source());
    model.template_renders_tools = tmpl.source().find("tools") != std::string::npos;
    setup();
  }

  openai::TokenBytes token_bytes() const {
    return [this](int32_t id) { return eng.tokenizer().token_bytes(id); };
  }

  static SchedulerOptions scheduler_options(const ServerOptions& o) {
    SchedulerOptions s = o.scheduling;
    s.n_slots = o.parallel;
    s.queue_size = o.queue_size;
    return s;
  }

  std::shared_ptr<Request> submit(GenParams gen) {
    auto r = std::make_shared<Request>(std::move(gen));
    if (!sched.submit(r))
      throw sched.stopping() ? openai::shutting_down() : openai::server_busy(opts.parallel, opts.queue_size);
    return r;
  }

  // Runs `p` and answers with one JSON object, or with Server-Sent Events when it streams.
  void generate(const httplib::Request& req, httplib::Response& res, openai::ParsedRequest p,
                openai::Endpoint endpoint) {
    auto r = submit(std::move(p.gen));
    const openai::ResponseMeta meta{endpoint, openai::new_response_id(endpoint), int64_t(std::time(nullptr)),
                                    opts.model_name};
    const bool logprobs = r->params.top_logprobs >= 0;
    const tools::Format tool_format = p.tool_format;
    const bool tool_calls = p.tool_calls;

    if (!p.stream) {
      std::vector<Event> events;
      // Nothing is written until the end, so a client that hangs up is noticed by watching its socket.
      const ClientWatch watch(req.local_port, req.remote_addr, req.remote_port);
      while (!r->wait(events, std::chrono::milliseconds(100)))
        if (watch.gone()) r->cancel();
      if (openai::is_error_finish(r->finish_reason)) throw openai::generation_failed(r->error);
      if (r->finish_reason == "cancelled" && sched.stopping()) throw openai::shutting_down();
      const J out = openai::completion_json(meta, events, r->finish_reason, r->prompt_tokens, r->completion_tokens,
                                            logprobs, token_bytes(), tool_format, tool_calls);
      res.set_content(openai::dump(out), "application/json");
      return;
    }

    const bool include_usage = p.include_usage;
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, r, meta, logprobs, include_usage, tool_format, tool_calls](size_t, httplib::DataSink& sink) {
          auto send = [&](const J& j) {
            const std::string s = "data: " + openai::dump(j) + "\n\n";
            return sink.write(s.data(), s.size());
          };
          auto gone = [&] {
            r->cancel();
            return false;
          };
          const openai::TokenBytes bytes = token_bytes();
          if (meta.endpoint == openai::Endpoint::Chat && !send(openai::role_chunk_json(meta))) return gone();
          std::vector<Event> events;
          size_t offset = 0;
          // Tool calls: the text goes through the parser, which holds back possible markup.
          const bool parse_tools = tool_format != tools::Format::None && meta.endpoint == openai::Endpoint::Chat;
          // Incremental: calls come as pieces, harmony's arguments as they are generated.
          tools::StreamParser parser(tool_format, tool_calls, /*incremental=*/true);
          auto send_delta = [&](const tools::Delta& d, J lp) {
            if (d.content.empty() && d.reasoning.empty() && d.pieces.empty() && lp.is_null()) return true;
            return send(openai::tool_delta_chunk_json(meta, d, 0, std::move(lp)));
          };
          for (;;) {
            const bool done = r->wait(events, std::chrono::milliseconds(200));
            for (auto& e : events) {
              if (parse_tools) {
                J lp = logprobs && e.token ? J{{"content", J::array({openai::chat_logprob_entry(*e.token, bytes)})}}
                                           : J(nullptr);
                if (!send_delta(parser.push(e.text), std::move(lp))) return gone();
              } else if (!send(openai::event_chunk_json(meta, e, offset, logprobs, bytes))) {
                return gone();
              }
              offset += e.text.size();
            }
            events.clear();
            if (done) break;
            if (!sink.is_writable()) return gone();
          }
          if (parse_tools && !send_delta(parser.finish(), J(nullptr))) return gone();
          if (openai::is_error_finish(r->finish_reason)) {
            send(openai::error_json(openai::generation_failed(r->error)));
          } else if (r->finish_reason == "cancelled" && sched.stopping()) {
            send(openai::error_json(openai::shutting_down()));
          } else {
            const std::string finish =
                parser.n_calls() > 0 && r->finish_reason == "stop" ? "tool_calls" : r->finish_reason;
            if (!send(openai::finish_chunk_json(meta, finish))) return gone();
            if (include_usage && !send(openai::usage_chunk_json(meta, r->prompt_tokens, r->completion_tokens)))
              return gone();
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
    const J b = openai::parse_body(req.body);
    generate(req, res, openai::parse_chat_request(b, model), openai::Endpoint::Chat);
  }

  void completions(const httplib::Request& req, httplib::Response& res) {
    const J b = openai::parse_body(req.body);
    generate(req, res, openai::parse_completion_request(b, model), openai::Endpoint::Completion);
  }

  void models(const httplib::Request&, httplib::Response& res) {
    const auto& hp = eng.hparams();
    J m = {{"id", opts.model_name},
           {"object", "model"},
           {"created", started},
           {"owned_by", "strata"},
           {"meta",
            {{"architecture", hp.arch},
             {"n_ctx", eng.n_ctx()},
             {"n_vocab", eng.tokenizer().n_vocab()},
             {"expert_bytes", eng.expert_bytes()},
             {"arena_bytes", eng.arena_bytes()}}}};
    res.set_content(openai::dump({{"object", "list"}, {"data", J::array({m})}}), "application/json");
  }

  void health(const httplib::Request&, httplib::Response& res) {
    // Reads only the scheduler's queue counters (not the engine lock), so it answers at once.
    J h = {{"status", "ok"}};
    res.set_content(openai::dump(h), "application/json");
  }

  void page(const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-cache");
    res.set_content(kWebPage, sizeof(kWebPage) - 1, "text/html; charset=utf-8");
  }

  void tokenize(const httplib::Request& req, httplib::Response& res) {
    const J b = openai::parse_body(req.body);
    const J* c = openai::field(b, "content");
    if (!c || !c->is_string()) throw openai::bad_request("content", "'content' must be a string", "invalid_type");
    const bool add_special = openai::get_bool(b, "add_special", false);
    const bool parse_special = openai::get_bool(b, "parse_special", true);
    const bool with_pieces = openai::get_bool(b, "with_pieces", false);
    const auto& tok = eng.tokenizer();
    std::vector<int32_t> ids;
    if (add_special && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
    try {
      auto more = tok.encode(c->get<std::string>(), parse_special);
      ids.insert(ids.end(), more.begin(), more.end());
    } catch (const tokenizer::TokenizerError& e) {
      throw openai::bad_request("content", e.what(), "invalid_utf8");
    }
    J out = J::array();
    for (int32_t id : ids) {
      if (!with_pieces) {
        out.push_back(id);
        continue;
      }
      const std::string& piece = tok.token_bytes(id);
      out.push_back(
          {{"id", id}, {"piece", tokenizer::find_invalid_utf8(piece) ? openai::bytes_json(piece) : J(piece)}});
    }
    res.set_content(openai::dump({{"tokens", out}}), "application/json");
  }

  // POST /apply-template (llama.cpp's server): the chat template rendered over `messages`
  // (validated and normalised as for /v1/chat/completions), with `tools` when given, as text.
  void apply_template(const httplib::Request& req, httplib::Response& res) {
    const J b = openai::parse_body(req.body);
    const J messages = openai::chat_messages(b);
    J extra = J::object();
    if (const J* tools = openai::field(b, "tools")) {
      if (!tools->is_array())
        throw openai::bad_request("tools", "'tools' must be an array of tool objects", "invalid_type");
      for (size_t k = 0; k < tools->size(); ++k)
        if (!(*tools)[k].is_object())
          throw openai::bad_request(fmt::format("tools[{}]", k), fmt::format("tools[{}] must be an object", k),
                                    "invalid_type");
      if (!tools->empty()) {
        openai::refuse_tools_without_template(model);
        extra["tools"] = *tools;
      }
    }
    const bool add_generation_prompt = openai::get_bool(b, "add_generation_prompt", true);
    std::string prompt;
    try {
      prompt = tmpl.apply(messages, add_generation_prompt, extra);
    } catch (const chat::RenderError& e) {
      throw openai::bad_request("messages", fmt::format("the chat template rejected the messages: {}", e.what()),
                                "invalid_messages");
    }
    res.set_content(openai::dump({{"prompt", prompt}}), "application/json");
  }

  void detokenize(const httplib::Request& req, httplib::Response& res) {
    const J b = openai::parse_body(req.body);
    const J* t = openai::field(b, "tokens");
    if (!t || !t->is_array())
      throw openai::bad_request("tokens", "'tokens' must be an array of token ids", "invalid_type");
    const auto& tok = eng.tokenizer();
    tokenizer::StreamDecoder dec(tok);
    std::string text;
    for (auto& v : *t) {
      if (!v.is_number_integer()) throw openai::bad_request("tokens", "'tokens' must hold integers", "invalid_type");
      const int64_t id = v.get<int64_t>();
      if (id < 0 || id >= tok.n_vocab())
        throw openai::bad_request("tokens", fmt::format("token id {} is outside [0, {})", id, tok.n_vocab()));
      text += dec.push(int32_t(id));
    }
    text += dec.flush();
    res.set_content(openai::dump({{"content", text}}), "application/json");
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
    counter("strata_requests_cancelled_total", "Generations stopped because the client went away.",
            double(c.cancelled));
    counter("strata_requests_completed_total", "Generations finished (stop or length).", double(c.completed));
    counter("strata_prompt_tokens_total", "Prompt tokens prefilled.", double(c.prompt_tokens));
    counter("strata_generated_tokens_total", "Tokens generated.", double(c.generated_tokens));
    gauge("strata_prefill_tokens_per_second", "Prefill throughput of the engine since start.",
          c.prefill.tokens_per_s());
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
    // tiers: arena <- host RAM tier <- disk (docs/streaming.md, "Tiers"); reads = host hits + disk reads
    phased("strata_host_hits_total", "counter", "Arena fills served from the host RAM tier (no disk read).",
           double(ps.host_hits), double(ds.host_hits));
    phased("strata_disk_reads_total", "counter", "Arena fills read from disk.", double(ps.disk_reads),
           double(ds.disk_reads));
    phased("strata_h2d_bytes_total", "counter",
           "Bytes copied from host memory into the arena (host-to-device for a GPU arena).", double(ps.h2d_bytes),
           double(ds.h2d_bytes));
    gauge("strata_host_cache_bytes", "Bytes of the host RAM tier (0 = off).", double(eng.host_cache_bytes()));
    gauge("strata_arena_bytes", "Bytes of the expert arena.", double(eng.arena_bytes()));
    sched.write_metrics(out);
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
        send_error(res, openai::internal_error(e.what()));
      }
    };
  }

  void count(const httplib::Request& req, const httplib::Response& res) {
    static const std::set<std::string> known = {
        "/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/tokenize",
        "/detokenize",          "/apply-template", "/"};
    const std::string ep = known.count(req.path) ? req.path : "other";
    std::lock_guard lk(count_mutex);
    ++request_counts[{ep, res.status}];
  }

  // A POST route. Its body is read here rather than by httplib, which caps a body sent as
  // application/x-www-form-urlencoded (curl -d) at 8 KiB whatever set_payload_max_length says.
  void post(const std::string& path, Handler h) {
    routes[path].insert("POST");
    http.Post(path, [this, h](const httplib::Request& req, httplib::Response& res,
                              const httplib::ContentReader& reader) {
      std::string body;
      bool too_large = false;
      const bool read = reader([&](const char* data, size_t n) {
        if (body.size() + n > opts.max_body_bytes) {
          too_large = true;
          return false;
        }
        body.append(data, n);
        return true;
      });
      // (A Content-Length over the limit was answered before routing; this is a chunked body.)
      if (too_large) {
        send_error(res, openai::http_status_error(413, req.method, req.path));
        return;
      }
      if (!read) {
        res.set_header("Connection", "close");  // the rest of the stream is out of step
        send_error(res, openai::bad_request("", "the request body could not be read (the connection ended early?)",
                                            "invalid_body"));
        return;
      }
      httplib::Request full = req;
      full.body = std::move(body);
      wrap(h)(full, res);
    });
  }

  void get(const std::string& path, Handler h) {
    routes[path].insert("GET");
    http.Get(path, wrap(h));
  }

  std::map<std::string, std::set<std::string>> routes;  // path -> methods

  void setup() {
    const size_t threads =
        opts.http_threads > 0 ? size_t(opts.http_threads) : size_t(std::max(256, opts.parallel + opts.queue_size + 64));
    http.new_task_queue = [threads] { return new ConnectionPool(threads); };
    http.set_payload_max_length(opts.max_body_bytes);
    http.set_read_timeout(std::max(1, opts.read_timeout_s));
    http.set_write_timeout(10);
    http.set_keep_alive_timeout(std::min(5, std::max(1, opts.read_timeout_s)));
    http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      // Body framing first, before httplib or a route reads the body: httplib reads a
      // Content-Length with strtoull, so "-5" became 2^64 - 5 and the read waited for the
      // timeout, "abc" became 0 and "5x" 5.
      std::vector<std::string> lengths;
      for (size_t i = 0, n = req.get_header_value_count("Content-Length"); i < n; ++i)
        lengths.push_back(req.get_header_value("Content-Length", i));
      std::optional<ApiError> err = openai::content_length_error(lengths, opts.max_body_bytes);
      // A POST with neither a length nor chunked encoding (`curl -X POST` without -d; an empty
      // "Content-Length:" line, which httplib drops): httplib would read it until the client
      // closes, so the client waited for the read timeout.
      if (!err && lengths.empty() && req.method == "POST" && !req.has_header("Transfer-Encoding"))
        err = ApiError(411, "a POST needs a Content-Length header (or chunked Transfer-Encoding)",
                       "invalid_request_error", "length_required");
      if (err) {
        // The body is unread, so the stream is out of step: close (httplib adds the header itself
        // when the request asked for it).
        if (req.get_header_value("Connection") != "close") res.set_header("Connection", "close");
        send_error(res, *err);
        return httplib::Server::HandlerResponse::Handled;
      }
      if (opts.api_key.empty() || req.path == "/health" || req.path == "/")
        return httplib::Server::HandlerResponse::Unhandled;
      const std::string auth = req.get_header_value("Authorization");
      if (!auth.empty() && bearer_token(auth) == opts.api_key) return httplib::Server::HandlerResponse::Unhandled;
      send_error(res, openai::auth_error(auth.empty()));
      return httplib::Server::HandlerResponse::Handled;
    });
    http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;
      if (res.status == 404) {
        // A known path with another method: 405 with the methods it has (RFC 9110 15.5.6).
        auto it = routes.find(req.path);
        if (it != routes.end()) {
          std::string allow;
          for (auto& m : it->second) allow += (allow.empty() ? "" : ", ") + m;
          res.status = 405;
          res.set_header("Allow", allow);
          send_error(res, ApiError(405, fmt::format("{} {} is not allowed; use {}", req.method, req.path, allow),
                                   "invalid_request_error", "method_not_allowed"));
          return;
        }
      }
      send_error(res, openai::http_status_error(res.status, req.method, req.path));
    });
    http.set_logger([this](const httplib::Request& req, const httplib::Response& res) { count(req, res); });
    post("/v1/chat/completions", &Impl::chat_completions);
    post("/chat/completions", &Impl::chat_completions);
    post("/v1/completions", &Impl::completions);
    post("/completions", &Impl::completions);
    get("/v1/models", &Impl::models);
    get("/models", &Impl::models);
    get("/health", &Impl::health);
    get("/", &Impl::page);
    get("/metrics", &Impl::metrics);
    post("/tokenize", &Impl::tokenize);
    post("/detokenize", &Impl::detokenize);
    post("/apply-template", &Impl::apply_template);
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
    throw std::runtime_error(
        fmt::format("cannot bind to {}:{} (in use, or not an address of this machine?)", o.host, port));
  }
  return port;
}

void Server::listen() { impl_->http.listen_after_bind(); }

void Server::stop() {
  impl_->http.stop();
  impl_->sched.stop();
}

int64_t Server::shutdown(std::chrono::milliseconds grace) {
  // Refuse new generations (503) while the running ones finish; then stop listening. Handlers
  // still waiting return once their request has finished or been cancelled.
  const int64_t cancelled = impl_->sched.drain(grace);
  impl_->http.stop();
  return cancelled;
}

}  // namespace strata::server
