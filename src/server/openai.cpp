// The OpenAI schema: request validation and answer objects (see openai.h).
#include "server/openai.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <mutex>
#include <random>

#include "chat/jinja.h"
#include "chat/json_depth.h"
#include "tokenizer/tokenizer.h"

namespace strata::server::openai {

ApiError bad_request(std::string param, std::string message, std::string code) {
  return ApiError{400, std::move(message), "invalid_request_error", std::move(code), std::move(param)};
}

Json error_json(const ApiError& e) {
  Json err = {{"message", e.message}, {"type", e.type}};
  err["param"] = e.param.empty() ? Json(nullptr) : Json(e.param);
  err["code"] = e.code.empty() ? Json(nullptr) : Json(e.code);
  return {{"error", err}};
}

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

Json parse_body(std::string_view body) {
  if (body.empty()) throw bad_request("", "the request body is empty: expected a JSON object", "invalid_json");
  if (auto at = tokenizer::find_invalid_utf8(body))
    throw bad_request("", fmt::format("the request body is not valid UTF-8 (byte {})", *at), "invalid_utf8");
  Json b;
  try {
    b = Json::parse(body);
  } catch (const Json::exception& e) {
    // a syntax error, or a number outside the range of a double (1e400): both the client's.
    // nlohmann's "[json.exception.parse_error.101] " prefix is dropped from the message.
    std::string what = e.what();
    if (what.rfind("[json.exception.", 0) == 0)
      if (const size_t close = what.find("] "); close != std::string::npos) what.erase(0, close + 2);
    throw bad_request("", fmt::format("the request body is not valid JSON: {}", what), "invalid_json");
  }
  if (!b.is_object()) throw bad_request("", "the request body must be a JSON object", "invalid_json");
  if (const size_t d = chat::json_depth(b); d > chat::kMaxJsonDepth)
    throw bad_request("", fmt::format("the request body nests {} levels deep (at most {})", d, chat::kMaxJsonDepth),
                      "invalid_json");
  return b;
}

// ---- typed request fields

const Json* field(const Json& b, const char* name) {
  auto it = b.find(name);
  if (it == b.end() || it->is_null()) return nullptr;
  return &*it;
}

double get_number(const Json& b, const char* name, double dflt, double lo, double hi) {
  const Json* v = field(b, name);
  if (!v) return dflt;
  if (!v->is_number()) throw bad_request(name, fmt::format("'{}' must be a number", name), "invalid_type");
  const double x = v->get<double>();
  if (!(x >= lo && x <= hi))
    throw bad_request(name, fmt::format("'{}' must be between {} and {}, got {}", name, lo, hi, x));
  return x;
}

int64_t get_int(const Json& b, const char* name, int64_t dflt, int64_t lo, int64_t hi) {
  const Json* v = field(b, name);
  if (!v) return dflt;
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (d != std::floor(d)) throw bad_request(name, fmt::format("'{}' must be an integer", name), "invalid_type");
    if (!(d >= double(lo) && d <= double(hi)))
      throw bad_request(name, fmt::format("'{}' must be between {} and {}, got {}", name, lo, hi, d));
    return int64_t(d);
  }
  if (!v->is_number_integer()) throw bad_request(name, fmt::format("'{}' must be an integer", name), "invalid_type");
  if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX))
    throw bad_request(name, fmt::format("'{}' must be between {} and {}", name, lo, hi));
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi) throw bad_request(name, fmt::format("'{}' must be between {} and {}, got {}", name, lo, hi, x));
  return x;
}

bool get_bool(const Json& b, const char* name, bool dflt) {
  const Json* v = field(b, name);
  if (!v) return dflt;
  if (!v->is_boolean()) throw bad_request(name, fmt::format("'{}' must be a boolean", name), "invalid_type");
  return v->get<bool>();
}

// ---- requests

namespace {

// The fields both generation endpoints share: sampling, length, stream, stop, logprobs.
ParsedRequest parse_common(const Json& b, const ModelContext& m, bool chat) {
  ParsedRequest p;
  const int64_t n_ctx = m.n_ctx;
  auto& sp = p.gen.sampler;
  sp = m.default_sampler;  // the server's flags; the request's own fields override them below
  sp.logit_bias.clear();
  sp.temp = float(get_number(b, "temperature", sp.temp, 0, kMaxTemperature));
  sp.top_p = float(get_number(b, "top_p", sp.top_p, 0, 1));
  sp.top_k = int(get_int(b, "top_k", sp.top_k, 0, kMaxTopK));
  sp.min_p = float(get_number(b, "min_p", sp.min_p, 0, 1));
  sp.repeat_penalty = float(get_number(b, "repeat_penalty", sp.repeat_penalty, 0, kMaxRepeatPenalty));
  if (!(sp.repeat_penalty > 0))  // the penalty divides positive logits by it
    throw bad_request("repeat_penalty", "'repeat_penalty' must be > 0 (1 = off), got 0");
  // the tokens the penalty looks back over (-1: the whole context, 0: off), as --repeat-last-n
  sp.repeat_last_n = int(get_int(b, "repeat_last_n", sp.repeat_last_n, -1, kMaxRepeatLastN));
  const int64_t seed = get_int(b, "seed", -1, -1, INT64_MAX);
  // unset: the server's -s/--seed (random by default); -1: random
  if (field(b, "seed")) sp.seed = seed < 0 ? engine::kRandomSeed : uint64_t(seed);
  for (const char* pen : {"presence_penalty", "frequency_penalty"})
    if (get_number(b, pen, 0, -2, 2) != 0)
      throw bad_request(pen, fmt::format("'{}' is not supported by this server", pen), "unsupported");
  if (get_int(b, "n", 1, 1, 128) != 1) throw bad_request("n", "only n = 1 is supported", "unsupported");
  if (const Json* lb = field(b, "logit_bias")) {
    // OpenAI: {"token id as a string": bias in [-100, 100]}, added to the logits before sampling.
    if (!lb->is_object())
      throw bad_request("logit_bias", "'logit_bias' must be an object mapping token ids to biases", "invalid_type");
    for (const auto& [key, val] : lb->items()) {
      size_t used = 0;
      long long id = -1;
      try {
        id = std::stoll(key, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != key.size() || key.empty() || id < 0 || id >= m.n_vocab)
        throw bad_request("logit_bias",
                          fmt::format("'logit_bias' key '{}' is not a token id (0..{})", key, m.n_vocab - 1));
      if (!val.is_number())
        throw bad_request("logit_bias", fmt::format("'logit_bias' value of token {} must be a number", key),
                          "invalid_type");
      const double bias = val.get<double>();
      if (!(bias >= -100 && bias <= 100))
        throw bad_request("logit_bias",
                          fmt::format("'logit_bias' value of token {} must be between -100 and 100, got {}", key,
                                      bias));
      sp.logit_bias.emplace_back(int32_t(id), float(bias));
    }
  }
  const char* mt = field(b, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  const int64_t dflt = m.default_max_tokens > 0 ? std::min(m.default_max_tokens, n_ctx) : n_ctx;
  p.gen.max_tokens = int(get_int(b, mt, dflt, 1, n_ctx));
  p.stream = get_bool(b, "stream", false);
  if (const Json* so = field(b, "stream_options")) {
    if (!so->is_object()) throw bad_request("stream_options", "'stream_options' must be an object", "invalid_type");
    p.include_usage = get_bool(*so, "include_usage", false);
  }
  if (const Json* st = field(b, "stop")) {
    auto add = [&](const Json& s) {
      if (!s.is_string()) throw bad_request("stop", "'stop' must be a string or an array of strings", "invalid_type");
      if (!s.get<std::string>().empty()) p.gen.stop.push_back(s.get<std::string>());
    };
    if (st->is_array()) {
      if (st->size() > 16) throw bad_request("stop", "at most 16 stop strings");
      for (auto& s : *st) add(s);
    } else {
      add(*st);
    }
  }
  if (chat) {
    const bool lp = get_bool(b, "logprobs", false);
    const int64_t top = get_int(b, "top_logprobs", 0, 0, 20);
    if (field(b, "top_logprobs") && !lp) throw bad_request("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    p.gen.top_logprobs = lp ? int(top) : -1;
  } else {
    p.gen.top_logprobs = int(get_int(b, "logprobs", -1, 0, 20));
  }
  p.gen.end_tokens = get_bool(b, "ignore_eos", false) ? std::vector<int32_t>{} : m.end_tokens;
  return p;
}

std::vector<int32_t> encode(const ModelContext& m, const std::string& text, bool parse_special) {
  try {
    return m.encode(text, parse_special);
  } catch (const tokenizer::TokenizerError& e) {
    throw bad_request("", e.what(), "invalid_utf8");
  }
}

// An assistant message's tool_calls, validated; string arguments parsed into objects.
Json normalise_tool_calls(const Json& calls, const std::string& where) {
  if (!calls.is_array()) throw bad_request(where, where + " must be an array", "invalid_type");
  Json out = Json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    const std::string w = fmt::format("{}[{}]", where, k);
    Json c = calls[k];
    if (!c.is_object() || !c.contains("function") || !c["function"].is_object())
      throw bad_request(w, w + " must be an object with a 'function' object", "invalid_type");
    Json& f = c["function"];
    if (!f.contains("name") || !f["name"].is_string())
      throw bad_request(w + ".function.name", w + ".function.name must be a string", "invalid_type");
    if (!f.contains("arguments") || f["arguments"].is_null()) {
      f["arguments"] = Json::object();
    } else if (f["arguments"].is_string()) {
      Json a = Json::parse(f["arguments"].get<std::string>(), nullptr, false);
      if (a.is_discarded() || !a.is_object())
        throw bad_request(w + ".function.arguments", w + ".function.arguments must be JSON text of an object");
      f["arguments"] = std::move(a);
    } else if (!f["arguments"].is_object()) {
      throw bad_request(w + ".function.arguments", w + ".function.arguments must be a string or an object",
                        "invalid_type");
    }
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace

Json chat_messages(const Json& b) {
  const Json* m = field(b, "messages");
  if (!m) throw bad_request("messages", "'messages' is required", "missing_required_parameter");
  if (!m->is_array() || m->empty())
    throw bad_request("messages", "'messages' must be a non-empty array", "invalid_type");
  Json out = Json::array();
  for (size_t k = 0; k < m->size(); ++k) {
    const Json& msg = (*m)[k];
    const std::string where = fmt::format("messages[{}]", k);
    if (!msg.is_object()) throw bad_request(where, where + " must be an object", "invalid_type");
    const Json* role = field(msg, "role");
    if (!role || !role->is_string())
      throw bad_request(where + ".role", where + ".role must be a string", "invalid_type");
    static const char* const kRoles[] = {"system", "developer", "user", "assistant", "tool", "function"};
    if (std::none_of(std::begin(kRoles), std::end(kRoles), [&](const char* r) { return *role == r; }))
      throw bad_request(where + ".role",
                        fmt::format("{}.role '{}' is not one of system, developer, user, assistant, tool, function",
                                    where, role->get<std::string>()),
                        "invalid_value");
    Json o = msg;
    const Json* content = field(msg, "content");
    if (!msg.contains("content") && *role != "assistant") {
      // only an assistant turn (with tool_calls) may leave its content out (null is "")
      throw bad_request(where + ".content", where + ".content is required", "missing_required_parameter");
    } else if (!content) {
      o["content"] = "";
    } else if (content->is_array()) {
      std::string text;
      for (auto& part : *content) {
        if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
            !part["text"].is_string())
          throw bad_request(where + ".content",
                            "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                            "unsupported");
        text += part["text"].get<std::string>();
      }
      o["content"] = text;
    } else if (!content->is_string()) {
      throw bad_request(where + ".content", where + ".content must be a string or an array of parts", "invalid_type");
    }
    if (const Json* tc = field(msg, "tool_calls")) {
      if (*role != "assistant")
        throw bad_request(where + ".tool_calls", "only assistant messages have tool_calls", "invalid_value");
      o["tool_calls"] = normalise_tool_calls(*tc, where + ".tool_calls");
    } else if (o.contains("tool_calls")) {
      o.erase("tool_calls");  // null
    }
    out.push_back(std::move(o));
  }
  return out;
}

void check_prompt(const std::vector<int32_t>& prompt, int64_t n_ctx, const char* param) {
  if (prompt.empty()) throw bad_request(param, "the prompt is empty");
  if (int64_t(prompt.size()) >= n_ctx)
    throw bad_request(param,
                      fmt::format("the prompt is {} tokens, but the context holds {} (--ctx-size) and at least one "
                                  "token must be generated",
                                  prompt.size(), n_ctx),
                      "context_length_exceeded");
}

ParsedRequest parse_chat_request(const Json& b, const ModelContext& m) {
  ParsedRequest p = parse_common(b, m, true);
  const Json messages = chat_messages(b);
  Json extra = Json::object();
  if (const Json* kw = field(b, "chat_template_kwargs")) {
    if (!kw->is_object())
      throw bad_request("chat_template_kwargs", "'chat_template_kwargs' must be an object", "invalid_type");
    extra = *kw;
  }
  if (const Json* rf = field(b, "response_format")) {
    if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string())
      throw bad_request("response_format", "'response_format' must be an object with a string 'type'", "invalid_type");
    if ((*rf)["type"] != "text")
      throw bad_request("response_format",
                        fmt::format("'response_format' of type '{}' is not supported by this server (it needs "
                                    "constrained sampling); only 'text'",
                                    (*rf)["type"].get<std::string>()),
                        "unsupported");
  }
  bool tools_on = true;
  if (const Json* tc = field(b, "tool_choice")) {
    if (tc->is_string() && (*tc == "none" || *tc == "auto")) {
      tools_on = *tc == "auto";
    } else if (tc->is_string() || tc->is_object()) {
      throw bad_request("tool_choice",
                        "'tool_choice' other than \"auto\" or \"none\" (\"required\", a named function) is not "
                        "supported by this server (it needs constrained sampling)",
                        "unsupported");
    } else {
      throw bad_request("tool_choice", "'tool_choice' must be a string or an object", "invalid_type");
    }
  }
  if (const Json* tools = field(b, "tools")) {
    if (!tools->is_array()) throw bad_request("tools", "'tools' must be an array of tool objects", "invalid_type");
    for (size_t k = 0; k < tools->size(); ++k) {
      const Json& t = (*tools)[k];
      const std::string w = fmt::format("tools[{}]", k);
      if (!t.is_object() || !t.contains("function") || !t["function"].is_object())
        throw bad_request(w, w + " must be an object with a 'function' object", "invalid_type");
      if (t.contains("type") && t["type"] != "function")
        throw bad_request(w + ".type", w + ".type must be \"function\"", "invalid_value");
      if (!t["function"].contains("name") || !t["function"]["name"].is_string())
        throw bad_request(w + ".function.name", w + ".function.name must be a string", "invalid_type");
    }
    if (tools_on && !tools->empty()) {
      refuse_tools_without_template(m);
      extra["tools"] = *tools;
      p.tool_format = m.tool_format;
      p.tool_calls = true;
    }
  }
  // Harmony's channels (analysis = reasoning_content) are parsed with or without tools.
  if (m.tool_format == tools::Format::Harmony) p.tool_format = tools::Format::Harmony;
  try {
    p.gen.prompt = m.encode_chat(messages, extra);
  } catch (const chat::RenderError& e) {
    throw bad_request("messages", fmt::format("the chat template rejected the messages: {}", e.what()),
                      "invalid_messages");
  } catch (const tokenizer::TokenizerError& e) {
    throw bad_request("messages", e.what(), "invalid_utf8");
  }
  check_prompt(p.gen.prompt, m.n_ctx, "messages");
  return p;
}

ParsedRequest parse_completion_request(const Json& b, const ModelContext& m) {
  ParsedRequest p = parse_common(b, m, false);
  if (get_bool(b, "echo", false)) throw bad_request("echo", "'echo' is not supported", "unsupported");
  if (field(b, "suffix")) throw bad_request("suffix", "'suffix' is not supported", "unsupported");
  const bool parse_special = get_bool(b, "parse_special", false);
  const Json* pr = field(b, "prompt");
  if (!pr) throw bad_request("prompt", "'prompt' is required", "missing_required_parameter");
  if (pr->is_string()) {
    p.gen.prompt = encode(m, pr->get<std::string>(), parse_special);
  } else if (pr->is_array() && pr->size() == 1 && (*pr)[0].is_string()) {
    p.gen.prompt = encode(m, (*pr)[0].get<std::string>(), parse_special);
  } else if (pr->is_array() && !pr->empty() && (*pr)[0].is_number()) {
    for (auto& t : *pr) {
      if (!t.is_number_integer())
        throw bad_request("prompt", "a token-id prompt must hold integers only", "invalid_type");
      const int64_t id = t.get<int64_t>();
      if (id < 0 || id >= m.n_vocab)
        throw bad_request("prompt", fmt::format("token id {} is outside [0, {})", id, m.n_vocab));
      p.gen.prompt.push_back(int32_t(id));
    }
  } else if (pr->is_array() && pr->size() > 1) {
    throw bad_request("prompt", "only one prompt per request is supported", "unsupported");
  } else {
    throw bad_request("prompt", "'prompt' must be a string or an array of token ids", "invalid_type");
  }
  check_prompt(p.gen.prompt, m.n_ctx, "prompt");
  return p;
}

// ---- answers

std::string new_response_id(Endpoint e) {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard lk(mu);
  return fmt::format("{}{:016x}", e == Endpoint::Chat ? "chatcmpl-" : "cmpl-", rng());
}

bool is_error_finish(const std::string& finish_reason) { return finish_reason == "error"; }

ApiError generation_failed(const std::string& error) {
  return ApiError{500, "generation failed: " + error, "server_error", "generation_failed"};
}

ApiError server_busy(int parallel, int queue_size) {
  ApiError e{503,
             fmt::format("the server is busy: {} requests are generating and {} are queued; retry later", parallel,
                         queue_size),
             "server_error", "server_busy"};
  e.retry_after = 1;
  return e;
}

void refuse_tools_without_template(const ModelContext& m) {
  if (m.template_renders_tools) return;
  throw bad_request("tools",
                    "the model's chat template does not render tools (it never mentions 'tools'), so the tool "
                    "definitions would not reach the model; send tool_choice \"none\", or start the server with "
                    "--chat-template-file naming a template that renders tools",
                    "unsupported");
}

ApiError shutting_down() {
  return ApiError{503, "the server is shutting down", "server_error", "server_shutting_down"};
}

ApiError auth_error(bool key_missing) {
  return ApiError(401, key_missing ? "missing API key (send 'Authorization: Bearer KEY')" : "invalid API key",
                  "authentication_error", "invalid_api_key");
}

ApiError internal_error(const std::string& what) {
  return ApiError(500, "internal error: " + what, "server_error", "internal_error");
}

ApiError http_status_error(int status, const std::string& method, const std::string& path) {
  ApiError e{status, fmt::format("HTTP {}", status)};
  if (status == 400)
    e = ApiError(400, "malformed HTTP request: the request line or a header does not parse", "invalid_request_error",
                 "invalid_http_request");
  else if (status == 414)
    e = ApiError(414, "the request URI is too long", "invalid_request_error", "uri_too_long");
  else if (status == 416)
    e = ApiError(416, "the Range header cannot be satisfied", "invalid_request_error", "range_not_satisfiable");
  else if (status == 404)
    e = ApiError(404, fmt::format("no endpoint {} {}", method, path), "invalid_request_error", "not_found");
  else if (status == 413)
    e = ApiError(413, "the request body is too large", "invalid_request_error", "request_too_large");
  else if (status == 405)
    e = ApiError(405, "method not allowed", "invalid_request_error", "method_not_allowed");
  else if (status >= 500)
    e.type = "server_error";
  return e;
}

std::optional<ApiError> content_length_error(const std::vector<std::string>& values, size_t max_body) {
  if (values.empty()) return std::nullopt;
  uint64_t length = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    const std::string& v = values[i];
    const bool digits = !v.empty() && v.size() <= 19 && v.find_first_not_of("0123456789") == std::string::npos;
    if (!digits)
      return bad_request("", fmt::format("invalid Content-Length header '{}': expected a number of bytes", v),
                         "invalid_content_length");
    const uint64_t n = std::stoull(v);
    if (i > 0 && n != length)
      return bad_request("", "several Content-Length headers with different values", "invalid_content_length");
    length = n;
  }
  if (length > max_body)
    return ApiError(413, fmt::format("the request body is too large ({} bytes; at most {})", length, max_body),
                    "invalid_request_error", "request_too_large");
  return std::nullopt;
}

Json usage_json(int prompt_tokens, int completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

Json bytes_json(const std::string& s) {
  Json a = Json::array();
  for (char c : s) a.push_back(int(static_cast<unsigned char>(c)));
  return a;
}

Json chat_logprob_entry(const TokenLogprob& t, const TokenBytes& bytes) {
  Json top = Json::array();
  for (auto& [id, lp] : t.top) {
    const std::string b = bytes(id);
    top.push_back({{"token", b}, {"logprob", lp}, {"bytes", bytes_json(b)}});
  }
  const std::string b = bytes(t.id);
  return {{"token", b}, {"logprob", t.logprob}, {"bytes", bytes_json(b)}, {"top_logprobs", top}};
}

Json completion_logprobs(const std::vector<Event>& events, size_t offset, const TokenBytes& bytes) {
  Json tokens = Json::array(), lps = Json::array(), tops = Json::array(), offs = Json::array();
  for (auto& e : events) {
    if (!e.token) {
      offset += e.text.size();
      continue;
    }
    tokens.push_back(bytes(e.token->id));
    lps.push_back(e.token->logprob);
    Json top = Json::object();
    for (auto& [id, lp] : e.token->top) top[bytes(id)] = lp;
    tops.push_back(top);
    offs.push_back(offset);
    offset += e.text.size();
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
}

namespace {
std::string new_call_id() {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard lk(mu);
  return fmt::format("call_{:016x}", rng());
}
}  // namespace

Json tool_calls_json(const std::vector<tools::ToolCall>& calls, size_t first_index, bool with_index) {
  Json out = Json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    Json c = Json::object();
    if (with_index) c["index"] = first_index + k;
    c["id"] = new_call_id();
    c["type"] = "function";
    c["function"] = {{"name", calls[k].name}, {"arguments", calls[k].arguments}};
    out.push_back(std::move(c));
  }
  return out;
}

Json completion_json(const ResponseMeta& meta, const std::vector<Event>& events, const std::string& finish_reason,
                     int prompt_tokens, int completion_tokens, bool logprobs, const TokenBytes& bytes,
                     tools::Format tool_format, bool tool_calls) {
  const bool chat = meta.endpoint == Endpoint::Chat;
  std::string text;
  for (auto& e : events) text += e.text;
  Json choice = {{"index", 0}};
  std::string finish = finish_reason;
  if (chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
    if (tool_format != tools::Format::None) {
      tools::Delta d = tools::parse(tool_format, text, tool_calls);
      if (!d.calls.empty() || !d.reasoning.empty())
        choice["message"]["content"] = d.content.empty() && !d.calls.empty() ? Json(nullptr) : Json(d.content);
      if (!d.reasoning.empty()) choice["message"]["reasoning_content"] = d.reasoning;
      if (!d.calls.empty()) {
        choice["message"]["tool_calls"] = tool_calls_json(d.calls, 0, false);
        if (finish == "stop") finish = "tool_calls";
      }
    }
    if (logprobs) {
      Json content = Json::array();
      for (auto& e : events)
        if (e.token) content.push_back(chat_logprob_entry(*e.token, bytes));
      choice["logprobs"] = {{"content", content}};
    } else {
      choice["logprobs"] = nullptr;
    }
  } else {
    choice["text"] = text;
    choice["logprobs"] = logprobs ? completion_logprobs(events, 0, bytes) : Json(nullptr);
  }
  choice["finish_reason"] = finish;
  return {{"id", meta.id},
          {"object", chat ? "chat.completion" : "text_completion"},
          {"created", meta.created},
          {"model", meta.model},
          {"choices", Json::array({choice})},
          {"usage", usage_json(prompt_tokens, completion_tokens)}};
}

namespace {

// The fields every chunk of a stream starts with.
Json chunk_head(const ResponseMeta& meta) {
  return {{"id", meta.id},
          {"object", meta.endpoint == Endpoint::Chat ? "chat.completion.chunk" : "text_completion"},
          {"created", meta.created},
          {"model", meta.model}};
}

}  // namespace

Json chunk_json(const ResponseMeta& meta, Json choice) {
  Json j = chunk_head(meta);
  j["choices"] = Json::array({std::move(choice)});
  return j;
}

Json role_chunk_json(const ResponseMeta& meta) {
  return chunk_json(meta, {{"index", 0},
                           {"delta", {{"role", "assistant"}, {"content", ""}}},
                           {"logprobs", nullptr},
                           {"finish_reason", nullptr}});
}

Json event_chunk_json(const ResponseMeta& meta, const Event& e, size_t offset, bool logprobs, const TokenBytes& bytes) {
  Json choice = {{"index", 0}};
  if (meta.endpoint == Endpoint::Chat) {
    choice["delta"] = e.text.empty() ? Json::object() : Json{{"content", e.text}};
    choice["logprobs"] =
        logprobs && e.token ? Json{{"content", Json::array({chat_logprob_entry(*e.token, bytes)})}} : Json(nullptr);
  } else {
    choice["text"] = e.text;
    choice["logprobs"] = logprobs && e.token ? completion_logprobs({e}, offset, bytes) : Json(nullptr);
  }
  choice["finish_reason"] = nullptr;
  return chunk_json(meta, std::move(choice));
}

Json tool_delta_chunk_json(const ResponseMeta& meta, const tools::Delta& d, size_t first_index, Json logprobs) {
  Json delta = Json::object();
  if (!d.content.empty()) delta["content"] = d.content;
  if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
  if (!d.calls.empty()) delta["tool_calls"] = tool_calls_json(d.calls, first_index, true);
  if (!d.pieces.empty()) {
    Json calls = Json::array();
    for (const auto& p : d.pieces) {
      if (!calls.empty() && !p.first && calls.back()["index"] == p.index) {  // one entry per call and chunk
        calls.back()["function"]["arguments"] = calls.back()["function"]["arguments"].get<std::string>() + p.arguments;
        continue;
      }
      Json c = {{"index", p.index}};
      if (p.first) {
        c["id"] = new_call_id();
        c["type"] = "function";
        c["function"] = {{"name", p.name}, {"arguments", p.arguments}};
      } else {
        c["function"] = {{"arguments", p.arguments}};
      }
      calls.push_back(std::move(c));
    }
    delta["tool_calls"] = std::move(calls);
  }
  return chunk_json(meta,
                    {{"index", 0}, {"delta", delta}, {"logprobs", std::move(logprobs)}, {"finish_reason", nullptr}});
}

Json finish_chunk_json(const ResponseMeta& meta, const std::string& finish_reason) {
  Json choice = {{"index", 0}};
  if (meta.endpoint == Endpoint::Chat)
    choice["delta"] = Json::object();
  else
    choice["text"] = "";
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = finish_reason;
  return chunk_json(meta, std::move(choice));
}

Json usage_chunk_json(const ResponseMeta& meta, int prompt_tokens, int completion_tokens) {
  Json j = chunk_head(meta);
  j["choices"] = Json::array();
  j["usage"] = usage_json(prompt_tokens, completion_tokens);
  return j;
}

}  // namespace strata::server::openai
