// The OpenAI schema layer of `strata serve` (server/openai.h) without HTTP or a model: request
// bodies to generation parameters with each validation error, and the answer builders' fields.
// The model is a stand-in: one token per byte, a chat "template" that joins role and content.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "chat/jinja.h"
#include "server/openai.h"
#include "tokenizer/tokenizer.h"

using namespace strata;
using server::Event;
using server::TokenLogprob;
using namespace server::openai;

namespace {

constexpr int64_t kCtx = 32;

ModelContext fake_model() {
  ModelContext m;
  m.n_ctx = kCtx;
  m.n_vocab = 300;
  m.end_tokens = {2, 7};
  // One id per byte; with parse_special, the text "<S>" is the one control token 299.
  m.encode = [](const std::string& text, bool parse_special) {
    if (text.find("BADTOKEN") != std::string::npos) throw tokenizer::TokenizerError("cannot encode BADTOKEN");
    std::vector<int32_t> ids;
    for (size_t i = 0; i < text.size(); ++i) {
      if (parse_special && text.compare(i, 3, "<S>") == 0) {
        ids.push_back(299);
        i += 2;
        continue;
      }
      ids.push_back(int32_t(static_cast<unsigned char>(text[i])));
    }
    return ids;
  };
  m.encode_chat = [](const Json& messages, const Json& extra) {
    if (extra.contains("reject")) throw chat::RenderError("no thanks");
    std::string out;
    for (auto& msg : messages) out += msg["role"].get<std::string>() + ":" + msg["content"].get<std::string>() + ";";
    if (extra.contains("tools")) out += "T";
    if (extra.contains("flag")) out += "F";
    if (out.find("BADTOKEN") != std::string::npos) throw tokenizer::TokenizerError("cannot encode BADTOKEN");
    std::vector<int32_t> ids;
    for (char c : out) ids.push_back(int32_t(static_cast<unsigned char>(c)));
    return ids;
  };
  m.tool_format = server::tools::Format::Hermes;
  return m;
}

Json chat_body() { return Json::parse(R"({"messages": [{"role": "user", "content": "hi"}]})"); }
Json completion_body() { return Json::parse(R"({"prompt": "abc"})"); }

// The error `fn` throws; fails the test when it throws none.
template <class F>
ApiError error_of(F&& fn) {
  try {
    fn();
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "no ApiError thrown";
  return ApiError(0, "");
}

struct Case {
  const char* body;  // merged over a valid body
  const char* param;
  const char* code;
  const char* message;
};

void expect_chat_error(const Case& c) {
  Json b = chat_body();
  b.update(Json::parse(c.body));
  const ApiError e = error_of([&] { parse_chat_request(b, fake_model()); });
  EXPECT_EQ(e.status, 400) << c.body;
  EXPECT_EQ(e.type, "invalid_request_error") << c.body;
  EXPECT_EQ(e.param, c.param) << c.body;
  EXPECT_EQ(e.code, c.code) << c.body;
  EXPECT_EQ(e.message, c.message) << c.body;
}

void expect_completion_error(const Case& c) {
  Json b = completion_body();
  b.update(Json::parse(c.body));
  const ApiError e = error_of([&] { parse_completion_request(b, fake_model()); });
  EXPECT_EQ(e.status, 400) << c.body;
  EXPECT_EQ(e.param, c.param) << c.body;
  EXPECT_EQ(e.code, c.code) << c.body;
  EXPECT_EQ(e.message, c.message) << c.body;
}

std::string bytes_of(int32_t id) { return "<" + std::to_string(id) + ">"; }

Event token_event(const std::string& text, int32_t id, float lp, std::vector<std::pair<int32_t, float>> top = {}) {
  Event e;
  e.text = text;
  e.token = TokenLogprob{id, lp, std::move(top)};
  return e;
}

}  // namespace

TEST(OpenAISchema, ParseBody) {
  EXPECT_EQ(parse_body(R"({"a": 1})")["a"], 1);
  ApiError e = error_of([] { parse_body("{\"a\": \"\xc0\xaf\"}"); });
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.code, "invalid_utf8");
  EXPECT_EQ(e.message, "the request body is not valid UTF-8 (byte 7)");
  e = error_of([] { parse_body("{\"a\": "); });
  EXPECT_EQ(e.code, "invalid_json");
  EXPECT_EQ(e.message.rfind("the request body is not valid JSON: ", 0), 0u) << e.message;
  // a number beyond a double (nlohmann's out_of_range while parsing): the client's error, 400
  e = error_of([] { parse_body(R"({"temperature": 1e400})"); });
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.code, "invalid_json");
  EXPECT_EQ(e.message.rfind("the request body is not valid JSON: number overflow", 0), 0u) << e.message;
  e = error_of([] { parse_body("[1, 2]"); });
  EXPECT_EQ(e.code, "invalid_json");
  EXPECT_EQ(e.message, "the request body must be a JSON object");
  EXPECT_EQ(e.param, "");
}

TEST(OpenAISchema, ChatDefaults) {
  const ParsedRequest p = parse_chat_request(chat_body(), fake_model());
  const engine::SamplerParams dflt;
  EXPECT_EQ(p.gen.sampler.temp, dflt.temp);
  EXPECT_EQ(p.gen.sampler.top_k, dflt.top_k);
  EXPECT_EQ(p.gen.sampler.top_p, dflt.top_p);
  EXPECT_EQ(p.gen.sampler.min_p, dflt.min_p);
  EXPECT_EQ(p.gen.sampler.repeat_penalty, dflt.repeat_penalty);
  EXPECT_EQ(p.gen.sampler.seed, strata::engine::kRandomSeed);
  EXPECT_EQ(p.gen.max_tokens, kCtx);
  EXPECT_EQ(p.gen.top_logprobs, -1);
  EXPECT_TRUE(p.gen.stop.empty());
  EXPECT_EQ(p.gen.end_tokens, (std::vector<int32_t>{2, 7}));
  EXPECT_FALSE(p.stream);
  EXPECT_FALSE(p.include_usage);
  const std::string prompt = "user:hi;";
  EXPECT_EQ(p.gen.prompt, std::vector<int32_t>(prompt.begin(), prompt.end()));
}

// serve's sampling flags (ModelContext::default_sampler) fill the fields a request leaves unset;
// the request's own fields win, and its "seed": -1 is random whatever the server's seed.
TEST(OpenAISchema, ServerSamplingDefaults) {
  ModelContext m = fake_model();
  m.default_sampler.temp = 0.0f;
  m.default_sampler.top_k = 5;
  m.default_sampler.top_p = 0.5f;
  m.default_sampler.min_p = 0.0f;
  m.default_sampler.repeat_penalty = 1.25f;
  m.default_sampler.repeat_last_n = 16;
  m.default_sampler.seed = 7;
  m.default_sampler.logit_bias = {{1, 5.0f}};  // never carried over: logit_bias is per request
  for (const bool chat : {true, false}) {
    const ParsedRequest p = chat ? parse_chat_request(chat_body(), m) : parse_completion_request(completion_body(), m);
    EXPECT_EQ(p.gen.sampler.temp, 0.0f);
    EXPECT_EQ(p.gen.sampler.top_k, 5);
    EXPECT_EQ(p.gen.sampler.top_p, 0.5f);
    EXPECT_EQ(p.gen.sampler.min_p, 0.0f);
    EXPECT_EQ(p.gen.sampler.repeat_penalty, 1.25f);
    EXPECT_EQ(p.gen.sampler.repeat_last_n, 16);
    EXPECT_EQ(p.gen.sampler.seed, 7u);
    EXPECT_TRUE(p.gen.sampler.logit_bias.empty());
  }
  Json b = chat_body();
  b.update(Json::parse(R"({"temperature": 1.5, "top_k": 0, "seed": 3})"));
  ParsedRequest q = parse_chat_request(b, m);
  EXPECT_EQ(q.gen.sampler.temp, 1.5f);
  EXPECT_EQ(q.gen.sampler.top_k, 0);
  EXPECT_EQ(q.gen.sampler.seed, 3u);
  EXPECT_EQ(q.gen.sampler.top_p, 0.5f);  // unset: still the server's
  b["seed"] = -1;
  EXPECT_EQ(parse_chat_request(b, m).gen.sampler.seed, strata::engine::kRandomSeed);
  b["seed"] = 4294967295LL;  // any seed a client can give is used as given (kRandomSeed is above them)
  EXPECT_EQ(parse_chat_request(b, m).gen.sampler.seed, 4294967295u);
  // a request's repeat_last_n overrides the server's (-1: the whole context, 0: off)
  b["repeat_last_n"] = 0;
  EXPECT_EQ(parse_chat_request(b, m).gen.sampler.repeat_last_n, 0);
  b["repeat_last_n"] = -1;
  EXPECT_EQ(parse_chat_request(b, m).gen.sampler.repeat_last_n, -1);
}

TEST(OpenAISchema, ChatFields) {
  const Json b = Json::parse(R"({
    "messages": [{"role": "system", "content": null},
                 {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.25, "repeat_penalty": 1.5, "seed": 42,
    "max_completion_tokens": 5, "max_tokens": 99, "stream": true, "stream_options": {"include_usage": true},
    "stop": ["x", "", "yz"], "logprobs": true, "top_logprobs": 4, "ignore_eos": true,
    "presence_penalty": 0, "frequency_penalty": null, "n": 1,
    "chat_template_kwargs": {"flag": true}, "tools": [{"type": "function", "function": {"name": "f"}}]})");
  const ParsedRequest p = parse_chat_request(b, fake_model());
  EXPECT_EQ(p.gen.sampler.temp, 0.0f);
  EXPECT_EQ(p.gen.sampler.top_p, 0.5f);
  EXPECT_EQ(p.gen.sampler.top_k, 3);
  EXPECT_EQ(p.gen.sampler.min_p, 0.25f);
  EXPECT_EQ(p.gen.sampler.repeat_penalty, 1.5f);
  EXPECT_EQ(p.gen.sampler.seed, 42u);
  EXPECT_EQ(p.gen.max_tokens, 5);  // max_completion_tokens wins over max_tokens
  EXPECT_TRUE(p.stream);
  EXPECT_TRUE(p.include_usage);
  EXPECT_EQ(p.gen.stop, (std::vector<std::string>{"x", "yz"}));  // empty stop strings dropped
  EXPECT_EQ(p.gen.top_logprobs, 4);
  EXPECT_TRUE(p.gen.end_tokens.empty());
  const std::string prompt = "system:;user:ab;TF";  // null content is "", parts joined, tools and kwargs passed
  EXPECT_EQ(p.gen.prompt, std::vector<int32_t>(prompt.begin(), prompt.end()));

  Json single = chat_body();
  single["stop"] = "q";
  single["max_tokens"] = 7.0;  // a float without fraction is an integer
  single["logprobs"] = true;
  const ParsedRequest q = parse_chat_request(single, fake_model());
  EXPECT_EQ(q.gen.stop, (std::vector<std::string>{"q"}));
  EXPECT_EQ(q.gen.max_tokens, 7);
  EXPECT_EQ(q.gen.top_logprobs, 0);
}

TEST(OpenAISchema, ChatMessagesNormalised) {
  const Json m = chat_messages(Json::parse(R"({"messages": [{"role": "tool", "content": "r", "name": "f"},
                                                             {"role": "assistant"}]})"));
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[0], Json::parse(R"({"role": "tool", "content": "r", "name": "f"})"));
  EXPECT_EQ(m[1]["content"], "");
}

TEST(OpenAISchema, ChatValidationErrors) {
  const Case cases[] = {
      {R"({"temperature": "hot"})", "temperature", "invalid_type", "'temperature' must be a number"},
      {R"({"temperature": 3})", "temperature", "invalid_value", "'temperature' must be between 0 and 2, got 3"},
      {R"({"top_p": -0.5})", "top_p", "invalid_value", "'top_p' must be between 0 and 1, got -0.5"},
      {R"({"top_k": 1.5})", "top_k", "invalid_type", "'top_k' must be an integer"},
      {R"({"top_k": "3"})", "top_k", "invalid_type", "'top_k' must be an integer"},
      {R"({"top_k": -1})", "top_k", "invalid_value", "'top_k' must be between 0 and 1048576, got -1"},
      {R"({"min_p": 2})", "min_p", "invalid_value", "'min_p' must be between 0 and 1, got 2"},
      {R"({"repeat_penalty": 11})", "repeat_penalty", "invalid_value",
       "'repeat_penalty' must be between 0 and 10, got 11"},
      {R"({"seed": -2})", "seed", "invalid_value", "'seed' must be between -1 and 9223372036854775807, got -2"},
      {R"({"seed": 18446744073709551615})", "seed", "invalid_value",
       "'seed' must be between -1 and 9223372036854775807"},
      {R"({"presence_penalty": 0.5})", "presence_penalty", "unsupported",
       "'presence_penalty' is not supported by this server"},
      {R"({"frequency_penalty": 1})", "frequency_penalty", "unsupported",
       "'frequency_penalty' is not supported by this server"},
      {R"({"presence_penalty": 3})", "presence_penalty", "invalid_value",
       "'presence_penalty' must be between -2 and 2, got 3"},
      {R"({"n": 2})", "n", "unsupported", "only n = 1 is supported"},
      {R"({"n": 0})", "n", "invalid_value", "'n' must be between 1 and 128, got 0"},
      {R"({"max_tokens": 0})", "max_tokens", "invalid_value", "'max_tokens' must be between 1 and 32, got 0"},
      {R"({"max_tokens": 33})", "max_tokens", "invalid_value", "'max_tokens' must be between 1 and 32, got 33"},
      {R"({"max_completion_tokens": 40.0})", "max_completion_tokens", "invalid_value",
       "'max_completion_tokens' must be between 1 and 32, got 40"},
      {R"({"stream": 1})", "stream", "invalid_type", "'stream' must be a boolean"},
      {R"({"stream_options": true})", "stream_options", "invalid_type", "'stream_options' must be an object"},
      {R"({"stream_options": {"include_usage": "yes"}})", "include_usage", "invalid_type",
       "'include_usage' must be a boolean"},
      {R"({"stop": 5})", "stop", "invalid_type", "'stop' must be a string or an array of strings"},
      {R"({"stop": ["a", 1]})", "stop", "invalid_type", "'stop' must be a string or an array of strings"},
      {R"({"stop": ["1","2","3","4","5","6","7","8","9","10","11","12","13","14","15","16","17"]})", "stop",
       "invalid_value", "at most 16 stop strings"},
      {R"({"logprobs": "yes"})", "logprobs", "invalid_type", "'logprobs' must be a boolean"},
      {R"({"logprobs": true, "top_logprobs": 21})", "top_logprobs", "invalid_value",
       "'top_logprobs' must be between 0 and 20, got 21"},
      {R"({"top_logprobs": 2})", "top_logprobs", "invalid_value", "'top_logprobs' needs 'logprobs': true"},
      {R"({"ignore_eos": "no"})", "ignore_eos", "invalid_type", "'ignore_eos' must be a boolean"},
      {R"({"messages": null})", "messages", "missing_required_parameter", "'messages' is required"},
      {R"({"messages": "hello"})", "messages", "invalid_type", "'messages' must be a non-empty array"},
      {R"({"messages": []})", "messages", "invalid_type", "'messages' must be a non-empty array"},
      {R"({"messages": [3]})", "messages[0]", "invalid_type", "messages[0] must be an object"},
      {R"({"messages": [{"content": "x"}]})", "messages[0].role", "invalid_type", "messages[0].role must be a string"},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "x"}]})", "messages[1].role",
       "invalid_value", "messages[1].role 'wizard' is not one of system, developer, user, assistant, tool, function"},
      {R"({"messages": [{"role": "user", "content": 42}]})", "messages[0].content", "invalid_type",
       "messages[0].content must be a string or an array of parts"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})",
       "messages[0].content", "unsupported",
       "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported"},
      {R"({"chat_template_kwargs": []})", "chat_template_kwargs", "invalid_type",
       "'chat_template_kwargs' must be an object"},
      {R"({"chat_template_kwargs": {"reject": 1}})", "messages", "invalid_messages",
       "the chat template rejected the messages: no thanks"},
      {R"({"messages": [{"role": "user", "content": "BADTOKEN"}]})", "messages", "invalid_utf8",
       "cannot encode BADTOKEN"},
      {R"({"messages": [{"role": "user", "content": "01234567890123456789012345"}]})", "messages",
       "context_length_exceeded",
       "the prompt is 32 tokens, but the context holds 32 (--ctx-size) and at least one token must be generated"},
  };
  for (const Case& c : cases) expect_chat_error(c);
}

TEST(OpenAISchema, CompletionPrompts) {
  ParsedRequest p = parse_completion_request(completion_body(), fake_model());
  EXPECT_EQ(p.gen.prompt, (std::vector<int32_t>{'a', 'b', 'c'}));
  EXPECT_EQ(p.gen.top_logprobs, -1);
  p = parse_completion_request(Json::parse(R"({"prompt": ["xy"], "logprobs": 3, "echo": false})"), fake_model());
  EXPECT_EQ(p.gen.prompt, (std::vector<int32_t>{'x', 'y'}));
  EXPECT_EQ(p.gen.top_logprobs, 3);
  p = parse_completion_request(Json::parse(R"({"prompt": [5, 0, 299]})"), fake_model());
  EXPECT_EQ(p.gen.prompt, (std::vector<int32_t>{5, 0, 299}));
}

TEST(OpenAISchema, CompletionValidationErrors) {
  const Case cases[] = {
      {R"({"logprobs": true})", "logprobs", "invalid_type", "'logprobs' must be an integer"},
      {R"({"logprobs": 21})", "logprobs", "invalid_value", "'logprobs' must be between 0 and 20, got 21"},
      {R"({"echo": true})", "echo", "unsupported", "'echo' is not supported"},
      {R"({"suffix": "x"})", "suffix", "unsupported", "'suffix' is not supported"},
      {R"({"prompt": null})", "prompt", "missing_required_parameter", "'prompt' is required"},
      {R"({"prompt": [1, 2.5]})", "prompt", "invalid_type", "a token-id prompt must hold integers only"},
      {R"({"prompt": [1, 300]})", "prompt", "invalid_value", "token id 300 is outside [0, 300)"},
      {R"({"prompt": [-1]})", "prompt", "invalid_value", "token id -1 is outside [0, 300)"},
      {R"({"prompt": ["a", "b"]})", "prompt", "unsupported", "only one prompt per request is supported"},
      {R"({"prompt": 5})", "prompt", "invalid_type", "'prompt' must be a string or an array of token ids"},
      {R"({"prompt": []})", "prompt", "invalid_type", "'prompt' must be a string or an array of token ids"},
      {R"({"prompt": ""})", "prompt", "invalid_value", "the prompt is empty"},
      {R"({"prompt": "BADTOKEN"})", "", "invalid_utf8", "cannot encode BADTOKEN"},
      {R"({"prompt": "0123456789012345678901234567890123"})", "prompt", "context_length_exceeded",
       "the prompt is 34 tokens, but the context holds 32 (--ctx-size) and at least one token must be generated"},
  };
  for (const Case& c : cases) expect_completion_error(c);
  // the sampling fields' own limits (both endpoints share them)
  const Case sampling[] = {
      {R"({"repeat_penalty": 0})", "repeat_penalty", "invalid_value", "'repeat_penalty' must be > 0 (1 = off), got 0"},
      {R"({"repeat_last_n": -2})", "repeat_last_n", "invalid_value",
       "'repeat_last_n' must be between -1 and 1073741824, got -2"},
      {R"({"repeat_last_n": 1.5})", "repeat_last_n", "invalid_type", "'repeat_last_n' must be an integer"},
  };
  for (const Case& c : sampling) expect_completion_error(c);
}

TEST(OpenAISchema, ErrorObjects) {
  EXPECT_EQ(error_json(bad_request("top_k", "m", "invalid_type")),
            Json::parse(R"({"error": {"message": "m", "type": "invalid_request_error", "param": "top_k",
                                      "code": "invalid_type"}})"));
  EXPECT_EQ(error_json(ApiError(500, "x", "server_error")),
            Json::parse(R"({"error": {"message": "x", "type": "server_error", "param": null, "code": null}})"));
  ApiError e = server_busy(4, 64);
  EXPECT_EQ(e.status, 503);
  EXPECT_EQ(e.retry_after, 1);
  EXPECT_EQ(e.code, "server_busy");
  EXPECT_EQ(e.type, "server_error");
  EXPECT_EQ(e.message, "the server is busy: 4 requests are generating and 64 are queued; retry later");
  e = generation_failed("disk gone");
  EXPECT_EQ(e.status, 500);
  EXPECT_EQ(e.code, "generation_failed");
  EXPECT_EQ(e.message, "generation failed: disk gone");
  e = auth_error(true);
  EXPECT_EQ(e.status, 401);
  EXPECT_EQ(e.type, "authentication_error");
  EXPECT_EQ(e.code, "invalid_api_key");
  EXPECT_EQ(e.message, "missing API key (send 'Authorization: Bearer KEY')");
  EXPECT_EQ(auth_error(false).message, "invalid API key");
  e = internal_error("boom");
  EXPECT_EQ(e.status, 500);
  EXPECT_EQ(e.code, "internal_error");
  EXPECT_EQ(e.message, "internal error: boom");
  e = http_status_error(404, "GET", "/nope");
  EXPECT_EQ(e.code, "not_found");
  EXPECT_EQ(e.message, "no endpoint GET /nope");
  EXPECT_EQ(http_status_error(413, "POST", "/").code, "request_too_large");
  EXPECT_EQ(http_status_error(405, "PUT", "/").code, "method_not_allowed");
  e = http_status_error(502, "GET", "/");
  EXPECT_EQ(e.message, "HTTP 502");
  EXPECT_EQ(e.type, "server_error");
  EXPECT_EQ(e.code, "");
  EXPECT_EQ(http_status_error(400, "GET", "/").type, "invalid_request_error");
  EXPECT_TRUE(is_error_finish("error"));
  for (const char* r : {"stop", "length", "cancelled"}) EXPECT_FALSE(is_error_finish(r));
  EXPECT_EQ(dump(Json::parse(R"({"a": [1, "b"]})")), R"({"a":[1,"b"]})");
  EXPECT_EQ(dump(Json("\xff")), "\"\xef\xbf\xbd\"");  // invalid UTF-8 replaced, not thrown
}

TEST(OpenAISchema, Ids) {
  const std::string a = new_response_id(Endpoint::Chat), b = new_response_id(Endpoint::Chat);
  EXPECT_EQ(a.rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(a.size(), 9u + 16u);
  EXPECT_NE(a, b);
  const std::string c = new_response_id(Endpoint::Completion);
  EXPECT_EQ(c.rfind("cmpl-", 0), 0u);
  EXPECT_EQ(c.size(), 5u + 16u);
}

TEST(OpenAISchema, CompletionObjects) {
  const std::vector<Event> events = {token_event("He", 10, -0.5f, {{10, -0.5f}, {11, -1.5f}}), Event{"", {}},
                                     token_event("llo", 12, -0.25f)};
  const ResponseMeta chat{Endpoint::Chat, "chatcmpl-1", 1700000000, "m"};
  Json j = completion_json(chat, events, "length", 3, 2, false, bytes_of);
  EXPECT_EQ(j, Json::parse(R"({"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
      "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": null,
                   "finish_reason": "length"}],
      "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})"));
  j = completion_json(chat, events, "stop", 3, 2, true, bytes_of);
  const Json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[0], Json::parse(R"({"token": "<10>", "logprob": -0.5, "bytes": [60, 49, 48, 62],
      "top_logprobs": [{"token": "<10>", "logprob": -0.5, "bytes": [60, 49, 48, 62]},
                       {"token": "<11>", "logprob": -1.5, "bytes": [60, 49, 49, 62]}]})"));
  EXPECT_EQ(content[1]["top_logprobs"], Json::array());

  const ResponseMeta cmpl{Endpoint::Completion, "cmpl-1", 5, "m"};
  j = completion_json(cmpl, events, "stop", 1, 2, true, bytes_of);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], "Hello");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["choices"][0]["logprobs"], Json::parse(R"({"tokens": ["<10>", "<12>"], "token_logprobs": [-0.5, -0.25],
      "top_logprobs": [{"<10>": -0.5, "<11>": -1.5}, {}], "text_offset": [0, 2]})"));
  EXPECT_EQ(j["usage"]["total_tokens"], 3);
  EXPECT_EQ(completion_logprobs(events, 10, bytes_of)["text_offset"], Json::parse("[10, 12]"));
  EXPECT_EQ(usage_json(4, 5), Json::parse(R"({"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9})"));
  EXPECT_EQ(bytes_json("A\xff"), Json::parse("[65, 255]"));
}

TEST(OpenAISchema, StreamChunks) {
  const ResponseMeta chat{Endpoint::Chat, "chatcmpl-2", 7, "m"};
  EXPECT_EQ(role_chunk_json(chat), Json::parse(R"({"id": "chatcmpl-2", "object": "chat.completion.chunk",
      "created": 7, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
      "logprobs": null, "finish_reason": null}]})"));
  const Event e = token_event("ab", 3, -1.0f);
  Json j = event_chunk_json(chat, e, 0, false, bytes_of);
  EXPECT_EQ(j["choices"][0], Json::parse(R"({"index": 0, "delta": {"content": "ab"}, "logprobs": null,
      "finish_reason": null})"));
  j = event_chunk_json(chat, e, 0, true, bytes_of);
  EXPECT_EQ(j["choices"][0]["logprobs"]["content"][0]["token"], "<3>");
  j = event_chunk_json(chat, Event{"", {}}, 0, true, bytes_of);  // no text, no token: empty delta
  EXPECT_EQ(j["choices"][0]["delta"], Json::object());
  EXPECT_EQ(j["choices"][0]["logprobs"], nullptr);
  EXPECT_EQ(finish_chunk_json(chat, "stop")["choices"][0],
            Json::parse(R"({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "stop"})"));
  EXPECT_EQ(usage_chunk_json(chat, 2, 3), Json::parse(R"({"id": "chatcmpl-2", "object": "chat.completion.chunk",
      "created": 7, "model": "m", "choices": [],
      "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}})"));

  const ResponseMeta cmpl{Endpoint::Completion, "cmpl-2", 7, "m"};
  j = event_chunk_json(cmpl, e, 4, true, bytes_of);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], "ab");
  EXPECT_EQ(j["choices"][0]["logprobs"]["text_offset"], Json::parse("[4]"));
  EXPECT_EQ(j["choices"][0]["finish_reason"], nullptr);
  EXPECT_EQ(finish_chunk_json(cmpl, "length")["choices"][0],
            Json::parse(R"({"index": 0, "text": "", "logprobs": null, "finish_reason": "length"})"));
  EXPECT_EQ(chunk_json(cmpl, Json{{"index", 0}})["choices"], Json::parse(R"([{"index": 0}])"));
}

// tools, tool_choice, response_format and assistant tool_calls: validation and what reaches
// the template.
TEST(OpenAISchema, ToolFields) {
  const Case cases[] = {
      {R"({"tools": "notalist"})", "tools", "invalid_type", "'tools' must be an array of tool objects"},
      {R"({"tools": [3]})", "tools[0]", "invalid_type", "tools[0] must be an object with a 'function' object"},
      {R"({"tools": [{"type": "function", "function": {}}]})", "tools[0].function.name", "invalid_type",
       "tools[0].function.name must be a string"},
      {R"({"tools": [{"type": "retrieval", "function": {"name": "f"}}]})", "tools[0].type", "invalid_value",
       "tools[0].type must be \"function\""},
      {R"({"tool_choice": "required"})", "tool_choice", "unsupported",
       "'tool_choice' other than \"auto\" or \"none\" (\"required\", a named function) is not supported by this "
       "server (it needs constrained sampling)"},
      {R"({"tool_choice": 5})", "tool_choice", "invalid_type", "'tool_choice' must be a string or an object"},
      {R"({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}})", "response_format",
       "unsupported",
       "'response_format' of type 'json_schema' is not supported by this server (it needs constrained sampling); "
       "only 'text'"},
      {R"({"response_format": {"type": "json_object"}})", "response_format", "unsupported",
       "'response_format' of type 'json_object' is not supported by this server (it needs constrained sampling); "
       "only 'text'"},
      {R"({"response_format": "json"})", "response_format", "invalid_type",
       "'response_format' must be an object with a string 'type'"},
      {R"({"messages": [{"role": "assistant", "tool_calls": {}}]})", "messages[0].tool_calls", "invalid_type",
       "messages[0].tool_calls must be an array"},
      {R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]})",
       "messages[0].tool_calls[0].function.arguments", "invalid_value",
       "messages[0].tool_calls[0].function.arguments must be JSON text of an object"},
      {R"({"messages": [{"role": "user", "content": "a", "tool_calls": []}]})", "messages[0].tool_calls",
       "invalid_value", "only assistant messages have tool_calls"},
  };
  for (const Case& c : cases) expect_chat_error(c);

  Json b = chat_body();
  b["tools"] = Json::parse(R"([{"type": "function", "function": {"name": "f"}}])");
  EXPECT_EQ(parse_chat_request(b, fake_model()).tool_format, server::tools::Format::Hermes);
  b["tool_choice"] = "none";  // tools hidden from the template, output not parsed
  const ParsedRequest none = parse_chat_request(b, fake_model());
  EXPECT_EQ(none.tool_format, server::tools::Format::None);
  EXPECT_EQ(none.gen.prompt.back(), int32_t(';'));
  EXPECT_EQ(parse_chat_request(chat_body(), fake_model()).tool_format, server::tools::Format::None);
  b["response_format"] = {{"type", "text"}};
  EXPECT_NO_THROW(parse_chat_request(b, fake_model()));

  // String arguments become objects for the template; absent ones an empty object.
  const Json m = chat_messages(Json::parse(R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [
      {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": [1, 2]}"}},
      {"function": {"name": "g"}}]}]})"));
  EXPECT_EQ(m[0]["tool_calls"][0]["function"]["arguments"], Json::parse(R"({"a": [1, 2]})"));
  EXPECT_EQ(m[0]["tool_calls"][0]["id"], "c1");
  EXPECT_EQ(m[0]["tool_calls"][1]["function"]["arguments"], Json::object());
}

// /v1/completions: control-token text is plain unless "parse_special": true.
TEST(OpenAISchema, CompletionParseSpecial) {
  ParsedRequest p = parse_completion_request(Json::parse(R"({"prompt": "a<S>"})"), fake_model());
  EXPECT_EQ(p.gen.prompt, (std::vector<int32_t>{'a', '<', 'S', '>'}));
  p = parse_completion_request(Json::parse(R"({"prompt": "a<S>", "parse_special": true})"), fake_model());
  EXPECT_EQ(p.gen.prompt, (std::vector<int32_t>{'a', 299}));
  expect_completion_error(
      {R"({"parse_special": 1})", "parse_special", "invalid_type", "'parse_special' must be a boolean"});
}

// Tool calls in the answers: message.tool_calls with finish_reason "tool_calls", the text
// left around them, and the streamed delta.tool_calls.
TEST(OpenAISchema, ToolCallAnswers) {
  const ResponseMeta meta{Endpoint::Chat, "chatcmpl-x", 7, "m"};
  const auto bytes = [](int32_t id) { return std::to_string(id); };
  const std::vector<Event> events = {{"Let me check.\n<tool_", std::nullopt},
                                     {"call>\n{\"name\": \"get\", \"arguments\": {\"q\": 1}}\n</tool_call>",
                                      std::nullopt}};
  Json j = completion_json(meta, events, "stop", 3, 2, false, bytes, server::tools::Format::Hermes);
  const Json& msg = j["choices"][0]["message"];
  EXPECT_EQ(msg["content"], "Let me check.");
  ASSERT_EQ(msg["tool_calls"].size(), 1u);
  EXPECT_EQ(msg["tool_calls"][0]["type"], "function");
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get");
  EXPECT_EQ(msg["tool_calls"][0]["function"]["arguments"], "{\"q\":1}");
  EXPECT_EQ(msg["tool_calls"][0]["id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_FALSE(msg["tool_calls"][0].contains("index"));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls");
  // "length" stays; without a format the markup is content.
  j = completion_json(meta, events, "length", 3, 2, false, bytes, server::tools::Format::Hermes);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  j = completion_json(meta, events, "stop", 3, 2, false, bytes);
  EXPECT_EQ(j["choices"][0]["message"]["content"], events[0].text + events[1].text);
  EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls"));
  // Malformed markup is content, byte for byte.
  const std::vector<Event> bad = {{"<tool_call>{\"name\": \"get\", \"arguments\": {oops}</tool_call>", std::nullopt}};
  j = completion_json(meta, bad, "stop", 3, 1, false, bytes, server::tools::Format::Hermes);
  EXPECT_EQ(j["choices"][0]["message"]["content"], bad[0].text);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");

  server::tools::Delta d{"hi", "", {{"f", "{}"}, {"g", "{\"a\":1}"}}, {}};
  const Json c = tool_delta_chunk_json(meta, d, 2, nullptr);
  const Json& delta = c["choices"][0]["delta"];
  EXPECT_EQ(delta["content"], "hi");
  ASSERT_EQ(delta["tool_calls"].size(), 2u);
  EXPECT_EQ(delta["tool_calls"][0]["index"], 2);
  EXPECT_EQ(delta["tool_calls"][1]["index"], 3);
  EXPECT_EQ(delta["tool_calls"][1]["function"]["name"], "g");
  EXPECT_EQ(delta["tool_calls"][1]["function"]["arguments"], "{\"a\":1}");
  EXPECT_NE(delta["tool_calls"][0]["id"], delta["tool_calls"][1]["id"]);
  EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
}

// gpt-oss (harmony): the analysis channel is message.reasoning_content and the final channel
// the content, whole and streamed; without tools, call markup stays content.
TEST(OpenAISchema, HarmonyReasoningContent) {
  const ResponseMeta meta{Endpoint::Chat, "chatcmpl-x", 7, "m"};
  const auto bytes = [](int32_t id) { return std::to_string(id); };
  const std::vector<Event> events = {{"<|channel|>analysis<|message|>Sum it.<|end|><|start|>assistant", std::nullopt},
                                     {"<|channel|>final<|message|>4", std::nullopt}};
  for (bool tools : {true, false}) {
    Json j = completion_json(meta, events, "stop", 3, 2, false, bytes, server::tools::Format::Harmony, tools);
    const Json& msg = j["choices"][0]["message"];
    EXPECT_EQ(msg["content"], "4");
    EXPECT_EQ(msg["reasoning_content"], "Sum it.");
    EXPECT_FALSE(msg.contains("tool_calls"));
    EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  }
  const std::vector<Event> call = {
      {"<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>commentary to=functions.f "
       "<|constrain|>json<|message|>{\"a\": 1}",
       std::nullopt}};
  Json j = completion_json(meta, call, "stop", 3, 2, false, bytes, server::tools::Format::Harmony, true);
  EXPECT_TRUE(j["choices"][0]["message"]["content"].is_null());
  EXPECT_EQ(j["choices"][0]["message"]["reasoning_content"], "r");
  EXPECT_EQ(j["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"], "{\"a\": 1}");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls");
  j = completion_json(meta, call, "stop", 3, 2, false, bytes, server::tools::Format::Harmony, false);
  EXPECT_EQ(j["choices"][0]["message"]["content"],
            "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 1}");
  EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  // A stream chunk of reasoning.
  const Json c = tool_delta_chunk_json(meta, server::tools::Delta{"", "think", {}, {}}, 0, nullptr);
  EXPECT_EQ(c["choices"][0]["delta"]["reasoning_content"], "think");
  EXPECT_FALSE(c["choices"][0]["delta"].contains("content"));
}

// Streamed tool-call pieces in OpenAI's form: the first entry of a call has index, id, type,
// name and the first arguments text; later ones index and arguments; one entry per call and
// chunk.
TEST(OpenAISchema, ToolCallPiecesChunk) {
  const ResponseMeta meta{Endpoint::Chat, "chatcmpl-x", 7, "m"};
  server::tools::Delta d;
  d.pieces = {{0, false, "", "1}"}, {1, true, "g", "{\"b\""}, {1, false, "", ": 2"}};
  const Json c = tool_delta_chunk_json(meta, d, 0, nullptr);
  const Json& tc = c["choices"][0]["delta"]["tool_calls"];
  ASSERT_EQ(tc.size(), 2u);
  EXPECT_EQ(tc[0], Json({{"index", 0}, {"function", {{"arguments", "1}"}}}}));
  EXPECT_EQ(tc[1]["index"], 1);
  EXPECT_EQ(tc[1]["type"], "function");
  EXPECT_EQ(tc[1]["id"].get<std::string>().rfind("call_", 0), 0u);
  EXPECT_EQ(tc[1]["function"], Json({{"name", "g"}, {"arguments", "{\"b\": 2"}}));
  EXPECT_FALSE(c["choices"][0]["delta"].contains("content"));
}

TEST(OpenAISchema, ContentLengthIsCheckedBeforeTheBody) {
  EXPECT_FALSE(content_length_error({}, 1024).has_value());  // absent: a chunked or empty body
  EXPECT_FALSE(content_length_error({"0"}, 1024).has_value());
  EXPECT_FALSE(content_length_error({"1024"}, 1024).has_value());
  EXPECT_FALSE(content_length_error({"12", "12"}, 1024).has_value());  // repeated, the same
  // Not a plain decimal number of bytes (httplib's strtoull read "-5" as 2^64 - 5, "abc" as 0).
  for (const char* bad : {"-5", "abc", "5x", "+5", "", " 5", "0x10", "99999999999999999999999"}) {
    const auto e = content_length_error({bad}, 1024);
    ASSERT_TRUE(e.has_value()) << "'" << bad << "'";
    EXPECT_EQ(e->status, 400) << bad;
    EXPECT_EQ(e->code, "invalid_content_length") << bad;
    EXPECT_NE(e->message.find(std::string("'") + bad + "'"), std::string::npos) << e->message;
  }
  const auto twice = content_length_error({"12", "13"}, 1024);
  ASSERT_TRUE(twice.has_value());
  EXPECT_EQ(twice->code, "invalid_content_length");
  const auto big = content_length_error({"1025"}, 1024);
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ(big->status, 413);
  EXPECT_EQ(big->code, "request_too_large");
  EXPECT_NE(big->message.find("1025 bytes; at most 1024"), std::string::npos) << big->message;
  // httplib's own statuses get their own messages and codes, not "HTTP 400".
  EXPECT_EQ(http_status_error(400, "GET", "/").code, "invalid_http_request");
  EXPECT_EQ(http_status_error(414, "GET", "/").code, "uri_too_long");
  EXPECT_EQ(http_status_error(416, "GET", "/").code, "range_not_satisfiable");
}
