#pragma once
// `strata serve`: an OpenAI-compatible HTTP server over one Engine.
//
// HTTP is Debian's cpp-httplib (libcpp-httplib-dev): a thread per connection (up to
// --max-connections, see ConnectionPool in server.cpp), Server-Sent Events through chunked
// content providers. This is the transport: routes,
// authentication, streaming and the wiring to the Scheduler (scheduler.h). The OpenAI schema
// (request validation into generation parameters, the answer and error objects) is
// server/openai.h, which handlers call before submitting a server::Request and waiting on it.
//
// Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming and not),
// GET /v1/models, GET /health, GET /metrics (Prometheus), POST /tokenize, POST /detokenize.
// Errors are OpenAI-style: {"error": {"message", "type", "code", "param"}} with the HTTP status.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "chat/chat_template.h"
#include "engine/engine.h"
#include "server/scheduler.h"

namespace strata::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;                  ///< 0 = any free port (see Server::bind)
  std::string api_key;              ///< when set, every endpoint but /health needs "Authorization: Bearer KEY"
  int parallel = 4;                 ///< slots: requests generating at once
  int queue_size = 64;              ///< requests waiting for a slot; beyond it: 503 with Retry-After
  size_t max_body_bytes = 1 << 20;  ///< larger request bodies: 413
  int http_threads = 0;     ///< most connection threads (--max-connections); 0 = max(256, parallel + queue_size + 64)
  int read_timeout_s = 10;  ///< a connection that sends nothing for this long is closed (--timeout)
  std::string model_name;   ///< the id /v1/models reports (default: the file name without .gguf)
  /// Batching, prefix cache and request timeout (n_slots and queue_size come from the two above).
  SchedulerOptions scheduling;
  /// max_tokens of a request that leaves it unset (-n, --n-predict), capped by the context; <= 0 = the context.
  int n_predict = 2048;
  /// Sampling of a request that leaves a field unset (--temp, --top-k, --top-p, --min-p,
  /// --repeat-penalty, --repeat-last-n, -s/--seed; llama.cpp's defaults). logit_bias is ignored.
  engine::SamplerParams sampling;
};

class Server {
 public:
  /// The engine must outlive the server. Starts the scheduler (allocates the slots).
  Server(engine::Engine& eng, chat::ChatTemplate tmpl, ServerOptions opts);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// Binds host:port (port 0: a free port) and returns the port. Throws std::runtime_error.
  int bind();
  /// Serves until stop(); call bind() first.
  void listen();
  /// Stops listening and the scheduler at once (running requests end "cancelled"); safe from another thread.
  void stop();
  /// Graceful stop: new generation requests get 503, running and queued ones have `grace` to
  /// finish (then they are cancelled), then listening stops. Returns the requests cancelled.
  int64_t shutdown(std::chrono::milliseconds grace);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::server
