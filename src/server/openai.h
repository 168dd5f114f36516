#pragma once
// The OpenAI schema of `strata serve`, without HTTP: a request body (JSON) to the generation
// parameters of the scheduler, validated with OpenAI-style errors, and the JSON objects of
// the answers (completions, streamed chunks, usage, errors). Pure functions: the model is
// reached only through the callbacks of ModelContext, so every function can be tested
// without a socket, a scheduler or (with stand-in callbacks) a model. server.cpp is the
// HTTP transport over them.
//
// Two endpoints share the schema: chat completions (messages rendered by the chat template)
// and completions (a prompt string or token ids). Field names and defaults follow the
// OpenAI API; strata adds top_k, min_p, repeat_penalty, ignore_eos and chat_template_kwargs.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "server/scheduler.h"
#include "server/tool_calls.h"

namespace strata::server::openai {

/// Upper bounds of a request's sampling fields (temperature: OpenAI's range; the others this
/// server's), which serve's defaults (--temp, --top-k, --repeat-penalty, --repeat-last-n) keep too.
inline constexpr double kMaxTemperature = 2;
inline constexpr int kMaxTopK = 1 << 20;
inline constexpr double kMaxRepeatPenalty = 10;
inline constexpr int kMaxRepeatLastN = 1 << 30;

using Json = nlohmann::ordered_json;

/// An error answered to the client as {"error": {"message", "type", "param", "code"}} with
/// HTTP status `status`. Thrown (by value) by the parsing functions below.
struct ApiError {
  ApiError(int status_, std::string message_, std::string type_ = "invalid_request_error", std::string code_ = {},
           std::string param_ = {})
      : status(status_),
        message(std::move(message_)),
        type(std::move(type_)),
        code(std::move(code_)),
        param(std::move(param_)) {}
  int status;           ///< the HTTP status (400, 401, 404, 413, 500, 503, ...)
  std::string message;  ///< for a human
  std::string type;     ///< "invalid_request_error", "authentication_error" or "server_error"
  std::string code;     ///< machine-readable ("invalid_value", "invalid_type", ...); empty: null
  std::string param;    ///< the request field at fault ("messages[0].role"); empty: null
  int retry_after = 0;  ///< seconds for a Retry-After header; 0: none
};

/// A 400 invalid_request_error about request field `param` (empty: the body as a whole).
ApiError bad_request(std::string param, std::string message, std::string code = "invalid_value");

/// {"error": {...}} of `e`.
Json error_json(const ApiError& e);

/// Compact JSON text of `j`; invalid UTF-8 in strings becomes U+FFFD instead of throwing.
std::string dump(const Json& j);

/// The JSON object of a request body. Throws ApiError (400) when `body` is not valid UTF-8
/// (code invalid_utf8, naming the byte offset), not JSON or not an object (invalid_json).
Json parse_body(std::string_view body);

// ---- typed request fields: absent or null means "not given" (the default)

/// The field `name` of object `b`; null when absent or JSON null.
const Json* field(const Json& b, const char* name);
/// Number field in [lo, hi]. Throws ApiError (400; invalid_type, or invalid_value out of range).
double get_number(const Json& b, const char* name, double dflt, double lo, double hi);
/// Integer field in [lo, hi]; a float with no fraction counts as an integer. Throws ApiError (400).
int64_t get_int(const Json& b, const char* name, int64_t dflt, int64_t lo, int64_t hi);
/// Boolean field. Throws ApiError (400, invalid_type).
bool get_bool(const Json& b, const char* name, bool dflt);

// ---- requests

/// What the schema needs of the model. The callbacks may throw as the real ones do.
struct ModelContext {
  int64_t n_ctx = 0;                ///< context in tokens: max_tokens' limit, the prompt's limit
  int64_t default_max_tokens = 0;   ///< max_tokens when the request leaves it unset (<= 0: n_ctx), capped at n_ctx
  /// Sampling fields (and the seed) when the request leaves them unset: serve's --temp, ...
  engine::SamplerParams default_sampler;
  int32_t n_vocab = 0;              ///< token ids of a token-id prompt must lie in [0, n_vocab)
  std::vector<int32_t> end_tokens;  ///< tokens that end generation unless ignore_eos
  /// Text to token ids (no BOS added); control-token text becomes control tokens only when
  /// `parse_special`. May throw tokenizer::TokenizerError (invalid UTF-8), which becomes a 400.
  std::function<std::vector<int32_t>(const std::string& text, bool parse_special)> encode;
  /// The chat template and the tokenizer: validated messages and extra top-level variables
  /// ("tools", chat_template_kwargs) to the prompt ids, with the generation prompt added, where
  /// only the template's markup becomes control tokens (chat::PromptEncoder). May throw
  /// chat::RenderError (a 400 invalid_messages) or tokenizer::TokenizerError (a 400).
  std::function<std::vector<int32_t>(const Json& messages, const Json& extra)> encode_chat;
  /// The tool-call markup the template teaches (tools::detect_format of its source).
  tools::Format tool_format = tools::Format::None;
  /// False when the chat template never mentions `tools`: non-empty tools (tool_choice not
  /// "none") are then refused with 400 unsupported instead of silently not reaching the model.
  bool template_renders_tools = true;
};

/// Throws ApiError (400 unsupported, param "tools") when the chat template does not render
/// tools (ModelContext::template_renders_tools false): the message says why and what to do.
void refuse_tools_without_template(const ModelContext& m);

/// A validated generation request.
struct ParsedRequest {
  GenParams gen;               ///< prompt, sampler, max_tokens, stop, logprobs, end tokens
  bool stream = false;         ///< answer with Server-Sent Events
  bool include_usage = false;  ///< stream_options.include_usage: a last chunk with the usage
  /// The markup to parse out of the reply: the model's format when the request has `tools`
  /// (and tool_choice is not "none") or the model is harmony's (gpt-oss: its channels are
  /// parsed into content and reasoning_content), else None (the reply is plain content).
  tools::Format tool_format = tools::Format::None;
  /// Tool-call markup becomes tool_calls (the request has tools); else it stays text.
  bool tool_calls = false;
};

/// The messages of a chat request, validated (roles system, developer, user, assistant,
/// tool, function) and normalised: content null or absent becomes "", an array of text parts
/// becomes their concatenated text; an assistant message's tool_calls must be an array of
/// {"function": {"name": string, "arguments": object or JSON text of an object}}, and string
/// arguments are parsed into the object (templates iterate or tojson them). Throws ApiError
/// (400) naming the message at fault.
Json chat_messages(const Json& body);

/// The prompt token ids of `body`: at least one token and fewer than `m.n_ctx`.
/// `param` names the field in errors. Throws ApiError (400, context_length_exceeded when too long).
void check_prompt(const std::vector<int32_t>& prompt, int64_t n_ctx, const char* param);

/// POST /v1/chat/completions: body to generation parameters, the prompt from m.encode_chat.
/// `tools` must be an array of {"type": "function", "function": {"name", ...}} objects;
/// `tool_choice` "auto" (default) or "none" (tools are then not shown to the template);
/// "required", a named function and `response_format` json_object / json_schema would need
/// constrained sampling and are refused (400 unsupported). Throws ApiError (400) for every
/// invalid or unsupported field, with the messages of the OpenAI API where it has them.
ParsedRequest parse_chat_request(const Json& body, const ModelContext& m);

/// POST /v1/completions: body to generation parameters; `prompt` is a string, an array of
/// one string, or an array of token ids. A string prompt is plain text (control-token text in
/// it is not a control token) unless the body has "parse_special": true. Throws ApiError (400).
ParsedRequest parse_completion_request(const Json& body, const ModelContext& m);

// ---- answers

/// The two generation endpoints, for the object names and ids of their answers.
enum class Endpoint { Chat, Completion };

/// A token's raw bytes (tokenizer::Tokenizer::token_bytes), for logprobs.
using TokenBytes = std::function<std::string(int32_t id)>;

/// What every answer of one request carries.
struct ResponseMeta {
  Endpoint endpoint = Endpoint::Chat;
  std::string id;       ///< "chatcmpl-..." or "cmpl-..." (new_response_id)
  int64_t created = 0;  ///< Unix seconds
  std::string model;    ///< the model id /v1/models reports
};

/// A fresh random id: "chatcmpl-" or "cmpl-" and 16 hex digits. Thread-safe.
std::string new_response_id(Endpoint e);

/// True for the finish reason "error" of Request::finish_reason (generation failed; the
/// answer is then generation_failed(Request::error)). The others ("stop", "length",
/// "cancelled") are reported as the choice's finish_reason.
bool is_error_finish(const std::string& finish_reason);

/// The 500 (server_error, generation_failed) answered when generation failed with `error`.
ApiError generation_failed(const std::string& error);
/// The 503 (server_busy, Retry-After 1) answered when all `parallel` slots are generating
/// and `queue_size` requests wait.
ApiError server_busy(int parallel, int queue_size);
/// The 503 (server_error, server_shutting_down) answered to a request refused, or cancelled
/// before anything was sent, because the server is shutting down (SIGINT/SIGTERM).
ApiError shutting_down();
/// The 401 (authentication_error, invalid_api_key) for a missing or a wrong API key.
ApiError auth_error(bool key_missing);
/// The 500 (server_error, internal_error) for an unexpected exception's `what`.
ApiError internal_error(const std::string& what);
/// The error answered for an HTTP `status` that no handler answered, each with its own message
/// and code: 400 (a request line or header httplib could not parse: invalid_http_request), 404
/// for `method` and `path` (not_found), 405, 413 (request_too_large), 414 (uri_too_long), 416
/// (range_not_satisfiable); a status >= 500 as a server_error.
ApiError http_status_error(int status, const std::string& method, const std::string& path);

/// The error for a request's Content-Length header before its body is read, or nullopt when it
/// is fine. `values` are the header's values (none when absent: fine, e.g. a chunked body).
/// RFC 9110 8.6: the value is one or more decimal digits; anything else (empty, "-5", "5x",
/// "+5", a number past 2^64) or several differing values is a 400 invalid_content_length (the
/// body's end is then unknown, so the connection must close); a valid length over `max_body`
/// bytes is the 413 request_too_large, answered without reading the body.
std::optional<ApiError> content_length_error(const std::vector<std::string>& values, size_t max_body);

/// {"prompt_tokens", "completion_tokens", "total_tokens"}.
Json usage_json(int prompt_tokens, int completion_tokens);

/// A chat logprobs "content" entry of one token: token text, logprob, bytes, top_logprobs.
Json chat_logprob_entry(const TokenLogprob& t, const TokenBytes& bytes);

/// Completions-style logprobs {"tokens", "token_logprobs", "top_logprobs", "text_offset"} of
/// the token events in `events`, text offsets in bytes counted from `offset`.
Json completion_logprobs(const std::vector<Event>& events, size_t offset, const TokenBytes& bytes);

/// The whole answer of a request that does not stream ("chat.completion" or
/// "text_completion"): the text of `events`, `finish_reason`, the usage, and logprobs when
/// `logprobs` (GenParams::top_logprobs >= 0). With a `tool_format` other than None (chat
/// only), the text goes through tools::parse: with `tool_calls`, tool calls in it become
/// message.tool_calls (content null when nothing else is left) and a "stop" finish becomes
/// "tool_calls"; reasoning (harmony's analysis channel) becomes message.reasoning_content.
Json completion_json(const ResponseMeta& meta, const std::vector<Event>& events, const std::string& finish_reason,
                     int prompt_tokens, int completion_tokens, bool logprobs, const TokenBytes& bytes,
                     tools::Format tool_format = tools::Format::None, bool tool_calls = true);

/// OpenAI tool_calls entries of `calls`: {"index": first_index + k (when `with_index`),
/// "id": "call_" + 16 random hex digits, "type": "function", "function": {"name", "arguments"}}.
Json tool_calls_json(const std::vector<tools::ToolCall>& calls, size_t first_index, bool with_index);

/// A chat stream chunk of a tools::Delta: delta.content when it has text,
/// delta.reasoning_content when it has reasoning, delta.tool_calls from its pieces (OpenAI's
/// streamed form: a call's first entry has index, id, type and function.name with the first
/// arguments text, later entries index and function.arguments only; pieces of one call in
/// one chunk are merged) and
/// (indices from `first_index`) when it has calls, `logprobs` (null or a logprobs object).
Json tool_delta_chunk_json(const ResponseMeta& meta, const tools::Delta& d, size_t first_index, Json logprobs);

/// A streamed chunk ("chat.completion.chunk" or "text_completion") holding `choice`.
Json chunk_json(const ResponseMeta& meta, Json choice);
/// The first chunk of a chat stream: the assistant role with empty content.
Json role_chunk_json(const ResponseMeta& meta);
/// The chunk of one event: its text (as delta.content for chat) and its token's logprobs;
/// `offset` is the byte offset of the event's text in the whole completion.
Json event_chunk_json(const ResponseMeta& meta, const Event& e, size_t offset, bool logprobs, const TokenBytes& bytes);
/// The last chunk with a choice: empty text and `finish_reason`.
Json finish_chunk_json(const ResponseMeta& meta, const std::string& finish_reason);
/// The usage chunk after the finish chunk (stream_options.include_usage): no choices.
Json usage_chunk_json(const ResponseMeta& meta, int prompt_tokens, int completion_tokens);

/// The byte values of `s` as a JSON array of integers (the "bytes" of logprobs).
Json bytes_json(const std::string& s);

}  // namespace strata::server::openai
