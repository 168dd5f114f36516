// Tool-call parsing of model output (server/tool_calls.h) for each family's markup, whole and
// streamed: the deltas of any split of the text (at every byte boundary, and byte by byte)
// add up to the whole-text parse. The markup follows the families' templates in
// ../shared/data/templates (Qwen3, Qwen3.5, gpt-oss, DeepSeek V3/V3.1, GLM-4.6).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/tool_calls.h"

using namespace strata::server::tools;

namespace {

// DeepSeek's markers, spelled out as in the templates.
const std::string kCallsBegin = "<｜tool▁calls▁begin｜>", kCallsEnd = "<｜tool▁calls▁end｜>",
                  kCallBegin = "<｜tool▁call▁begin｜>", kCallEnd = "<｜tool▁call▁end｜>", kSep = "<｜tool▁sep｜>";

struct Expect {
  std::string content;
  std::vector<std::pair<std::string, nlohmann::json>> calls;  // name, arguments
  std::string reasoning = "";
};

void expect_delta(const Delta& d, const Expect& e, const std::string& what) {
  EXPECT_EQ(d.content, e.content) << what;
  EXPECT_EQ(d.reasoning, e.reasoning) << what;
  ASSERT_EQ(d.calls.size(), e.calls.size()) << what;
  for (size_t k = 0; k < d.calls.size(); ++k) {
    EXPECT_EQ(d.calls[k].name, e.calls[k].first) << what;
    EXPECT_EQ(nlohmann::json::parse(d.calls[k].arguments), e.calls[k].second) << what;
  }
}

Delta merged(StreamParser& p, const std::vector<std::string>& pieces) {
  Delta all;
  auto add = [&](Delta d) {
    all.content += d.content;
    all.reasoning += d.reasoning;
    for (auto& c : d.calls) all.calls.push_back(c);
  };
  for (auto& s : pieces) add(p.push(s));
  add(p.finish());
  return all;
}

// An incremental stream of `pieces`: the content and reasoning equal the whole parse's; the
// calls' pieces (grouped by index, the first with the name) concatenate to the whole parse's
// arguments exactly, in order; a group that does not (a call that opened and then failed to
// parse) has arguments that occur in the text, and n_calls() counts only the complete calls.
// Returns the number of pieces of each call.
std::vector<size_t> check_incremental(Format f, bool calls, const std::vector<std::string>& pieces,
                                      const std::string& text, const Delta& whole, const std::string& what) {
  StreamParser p(f, calls, true);
  Delta all;
  auto add = [&](Delta d) {
    EXPECT_TRUE(d.calls.empty()) << what;
    all.content += d.content;
    all.reasoning += d.reasoning;
    for (auto& c : d.pieces) all.pieces.push_back(c);
  };
  for (auto& s : pieces) add(p.push(s));
  add(p.finish());
  EXPECT_EQ(all.content, whole.content) << what;
  EXPECT_EQ(all.reasoning, whole.reasoning) << what;
  EXPECT_EQ(p.n_calls(), whole.calls.size()) << what;
  std::vector<ToolCall> groups;
  std::vector<size_t> n_pieces;
  for (auto& c : all.pieces) {
    if (c.index == groups.size()) {
      EXPECT_TRUE(c.first) << what;
      groups.push_back({c.name, c.arguments});
      n_pieces.push_back(1);
    } else {
      EXPECT_EQ(c.index + 1, groups.size()) << what << ": pieces of one call follow each other";
      if (groups.empty()) return {};
      EXPECT_FALSE(c.first) << what;
      groups.back().arguments += c.arguments;
      ++n_pieces.back();
    }
  }
  size_t k = 0;
  std::vector<size_t> complete;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (k < whole.calls.size() && groups[g].name == whole.calls[k].name &&
        groups[g].arguments == whole.calls[k].arguments) {
      ++k;
      complete.push_back(n_pieces[g]);
    } else {
      EXPECT_NE(text.find(groups[g].arguments), std::string::npos) << what << ": an opened call's pieces are text";
    }
  }
  EXPECT_EQ(k, whole.calls.size()) << what << ": every call streamed, arguments equal";
  return complete;
}

// The whole parse equals `e`, and so does every two-piece split and the byte-by-byte stream,
// plain and incremental (check_incremental).
void check(Format f, const std::string& text, const Expect& e, bool calls = true) {
  const Delta whole = parse(f, text, calls);
  for (size_t cut = 0; cut <= text.size(); ++cut)
    check_incremental(f, calls, {text.substr(0, cut), text.substr(cut)}, text, whole,
                      "incremental, cut " + std::to_string(cut));
  {
    std::vector<std::string> bytes;
    for (char c : text) bytes.emplace_back(1, c);
    check_incremental(f, calls, bytes, text, whole, "incremental, byte by byte");
  }
  expect_delta(parse(f, text, calls), e, "whole: " + text);
  for (size_t cut = 0; cut <= text.size(); ++cut) {
    StreamParser p(f, calls);
    expect_delta(merged(p, {text.substr(0, cut), text.substr(cut)}), e, "cut at " + std::to_string(cut));
  }
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  StreamParser p(f, calls);
  expect_delta(merged(p, bytes), e, "byte by byte: " + text);
}

nlohmann::json J(const char* s) { return nlohmann::json::parse(s); }

}  // namespace

TEST(ToolCalls, DetectFormatFromRealTemplates) {
  EXPECT_EQ(detect_format("{{- '<tool_call>\\n{\"name\": \"' }}"), Format::Hermes);
  EXPECT_EQ(detect_format("<|start|>assistant to=functions.x<|channel|>commentary"), Format::Harmony);
  EXPECT_EQ(detect_format("{{'" + kCallsBegin + "'}}"), Format::DeepSeek);
  EXPECT_EQ(detect_format("<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key>"), Format::Glm);
  EXPECT_EQ(detect_format("{{ message.content }}"), Format::None);
}

TEST(ToolCalls, Hermes) {
  // Qwen3: two calls after some text; whitespace around the calls is dropped.
  check(Format::Hermes,
        "<think>\nok\n</think>\n\nLet me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
        "\"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
        {"<think>\nok\n</think>\n\nLet me look.", {{"get_weather", J(R"({"city": "Paris"})")}, {"now", J("{}")}}});
  // arguments as a JSON string (Hermes 2 Pro style), and a closer cut by the end of the output.
  check(Format::Hermes, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}",
        {"", {{"f", J(R"({"a": 1})")}}});
  // Qwen3.5 / Qwen3-Coder XML functions: values JSON when they parse, strings otherwise.
  check(Format::Hermes,
        "<tool_call>\n<function=search>\n<parameter=query>\nbest pizza in town\n</parameter>\n<parameter=limit>\n5\n"
        "</parameter>\n</function>\n</tool_call>",
        {"", {{"search", J(R"({"query": "best pizza in town", "limit": 5})")}}});
  // No call: text as is (a lone '<' at the end, markup-like words).
  check(Format::Hermes, "use a <tool_call tag? 1 < 2 <", {"use a <tool_call tag? 1 < 2 <", {}});
  check(Format::Hermes, "  plain answer \n", {"  plain answer \n", {}});
}

TEST(ToolCalls, MalformedIsText) {
  const std::string bad_json = "before <tool_call>{\"name\": \"f\", \"arguments\": {1: 2}}</tool_call> after";
  check(Format::Hermes, bad_json, {bad_json, {}});
  const std::string no_name = "<tool_call>{\"arguments\": {}}</tool_call>";
  check(Format::Hermes, no_name, {no_name, {}});
  const std::string open = "<tool_call>{\"name\": \"f\", \"argu";  // cut off mid-JSON
  check(Format::Hermes, open, {open, {}});
  // A good call next to a bad one: the good one parsed, the bad one kept as text.
  check(Format::Hermes, "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>not json</tool_call>",
        {"<tool_call>not json</tool_call>", {{"a", J("{}")}}});
  const std::string glm_bad = "<tool_call>f\n<arg_key>x</arg_key>\n</tool_call>";  // a key without value
  check(Format::Glm, glm_bad, {glm_bad, {}});
  const std::string ds_bad = kCallsBegin + kCallBegin + "f" + kSep + "{nope" + kCallEnd + kCallsEnd;
  check(Format::DeepSeek, ds_bad, {ds_bad, {}});
  const std::string harmony_bad = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops";
  check(Format::Harmony, harmony_bad, {harmony_bad, {}});
}

TEST(ToolCalls, Harmony) {
  // What gpt-oss writes after "<|start|>assistant" (<|call|> ends generation and is not in the text).
  check(Format::Harmony,
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"Tokyo\"}",
        {"", {{"get_weather", J(R"({"location": "Tokyo"})")}}, "Need weather."});
  // The template's own form (recipient before the channel), with <|call|>.
  check(Format::Harmony,
        "<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{\"id\": 3}<|call|>",
        {"", {{"lookup", J(R"({"id": 3})")}}});
  // A final answer is content, without its header.
  check(Format::Harmony, "<|channel|>final<|message|>It is sunny.", {"It is sunny.", {}});
}

// gpt-oss's non-call channels: analysis is reasoning_content, final (and commentary without a
// recipient, a preamble for the user) is content; headers and <|end|> are dropped; anything
// else that looks like markup is content byte for byte. With and without tools.
TEST(ToolCalls, HarmonyChannels) {
  for (bool calls : {true, false}) {
    const std::string what = calls ? " (tools)" : " (no tools)";
    SCOPED_TRACE(what);
    // The usual answer: analysis, then the final message after <|start|>assistant.
    check(Format::Harmony,
          "<|channel|>analysis<|message|>User wants 2+2. Easy.<|end|><|start|>assistant<|channel|>final"
          "<|message|>2 + 2 = 4.",
          {"2 + 2 = 4.", {}, "User wants 2+2. Easy."}, calls);
    // A preamble on commentary, then the final answer; reasoning keeps its whitespace.
    check(Format::Harmony,
          "<|channel|>analysis<|message|> a\n b \n<|end|><|start|>assistant<|channel|>commentary<|message|>Let me "
          "see.<|end|><|start|>assistant<|channel|>final<|message|>Done.",
          {"Let me see.Done.", {}, " a\n b \n"}, calls);
    // Cut off inside the analysis (max_tokens): all of it is reasoning, no content.
    check(Format::Harmony, "<|channel|>analysis<|message|>Thinking about <|", {"", {}, "Thinking about <|"}, calls);
    // Hostile or malformed headers stay content, byte for byte, and route nothing to reasoning.
    for (const std::string bad :
         {"<|channel|>secret<|message|>x", "<|channel|>analysis extra<|message|>x", "<|start|>user<|message|>hi",
          "<|start|>system<|channel|>analysis<|message|>x", "<|start|>assistant<|message|>no channel",
          "<|channel|>analysis", "<|channel|>Analysis<|message|>x", "<|message|>analysis text", "<|channel|>"}) {
      check(Format::Harmony, bad, {bad, {}}, calls);
    }
    // Text before any header is content; a header inside the final text switches channels.
    check(Format::Harmony, "hello <|channel|>final<|message|>a<|channel|>analysis<|message|>b<|end|>c",
          {"hello ac", {}, "b"}, calls);
    // A call without tools is text (after the reasoning).
    if (!calls) {
      const std::string call = "<|start|>assistant<|channel|>commentary to=functions.f json<|message|>{}";
      check(Format::Harmony, "<|channel|>analysis<|message|>r<|end|>" + call, {call, {}, "r"}, false);
    }
  }
}

TEST(ToolCalls, DeepSeek) {
  // V3.1 / V3.2.
  check(Format::DeepSeek,
        "Checking." + kCallsBegin + kCallBegin + "get_weather" + kSep + "{\"city\": \"Oslo\"}" + kCallEnd + kCallBegin +
            "now" + kSep + "{}" + kCallEnd + kCallsEnd,
        {"Checking.", {{"get_weather", J(R"({"city": "Oslo"})")}, {"now", J("{}")}}});
  // V3 / R1: type, separator, name and a fenced JSON block.
  check(Format::DeepSeek,
        kCallsBegin + kCallBegin + "function" + kSep + "get_weather\n```json\n{\"city\": \"Oslo\"}\n```" + kCallEnd +
            kCallsEnd,
        {"", {{"get_weather", J(R"({"city": "Oslo"})")}}});
  // Output ended (EOS) before the closing marker.
  check(Format::DeepSeek, kCallsBegin + kCallBegin + "f" + kSep + "{\"a\": 1}" + kCallEnd,
        {"", {{"f", J(R"({"a": 1})")}}});
}

TEST(ToolCalls, Glm) {
  // GLM-4.6: string values raw, others as JSON.
  check(Format::Glm,
        "\n<think></think>\nSure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{\"unit\": "
        "\"c\"}</arg_value>\n</tool_call>",
        {"\n<think></think>\nSure.", {{"get_weather", J(R"({"city": "Beijing", "days": 3, "opts": {"unit": "c"}})")}}});
  check(Format::Glm, "<tool_call>now</tool_call>", {"", {{"now", J("{}")}}});
}

TEST(ToolCalls, NoneIsText) {
  const std::string t = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>";
  check(Format::None, t, {t, {}});
}

// Streamed harmony calls send their arguments as they are generated: byte by byte, the call
// opens before its arguments end and they come in many pieces, which add up to the arguments
// of the whole parse exactly (check_incremental). Other formats send each call whole.
TEST(ToolCalls, IncrementalArguments) {
  const std::string args = "{\"path\": \"a/b.py\", \"text\": \"def f():\\n    return [1, 2.5e3, true, null]\\n\"}";
  const std::string text =
      "<|channel|>analysis<|message|>Write it.<|end|><|start|>assistant<|channel|>commentary "
      "to=functions.write <|constrain|>json<|message|> " +
      args + " <|call|>";
  check(Format::Harmony, text, {"", {{"write", nlohmann::json::parse(args)}}, "Write it."});
  const Delta whole = parse(Format::Harmony, text);
  ASSERT_EQ(whole.calls.size(), 1u);
  EXPECT_EQ(whole.calls[0].arguments, args);
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  const auto n = check_incremental(Format::Harmony, true, bytes, text, whole, "byte by byte");
  ASSERT_EQ(n.size(), 1u);
  EXPECT_GE(n[0], args.size() / 2) << "the arguments stream in pieces";
  // When the first piece comes: right after `{` arrives, before the rest of the arguments.
  StreamParser p(Format::Harmony, true, true);
  const size_t open_at = text.find("<|message|> {") + 13;
  size_t first_piece_at = 0;
  for (size_t i = 0; i < text.size() && !first_piece_at; ++i)
    if (!p.push(text.substr(i, 1)).pieces.empty()) first_piece_at = i + 1;
  EXPECT_EQ(first_piece_at, open_at);
  // Without <|call|> (it ends generation and is often not in the text) the same.
  check(Format::Harmony,
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": [1, {\"b\": \"}\"}]}",
        {"", {{"f", J(R"({"a": [1, {"b": "}"}]})")}}});
  // Malformed after the call opened: the markup is content byte for byte, no call counted.
  for (const std::string bad : {"{\"a\": 1, oops}", "{\"a\": 1} trailing", "{\"a\": \"open", "{\"a\": tru",
                                "{\"a\": 1}<|channel|>x", "{\"a\": \"x<|call|>\"}"}) {
    const std::string t = "<|channel|>commentary to=functions.f json<|message|>" + bad;
    const Delta d = parse(Format::Harmony, t);
    EXPECT_TRUE(d.calls.empty()) << t;
    if (bad.find("<|channel|>") == std::string::npos && bad.find("<|call|>") == std::string::npos) {
      check(Format::Harmony, t, {t, {}});
    } else {
      check(Format::Harmony, t, {d.content, {}});
    }
  }
  // Two calls in a row keep their indices (0, 1) and each streams.
  check(Format::Harmony,
        "<|channel|>commentary to=functions.a json<|message|>{\"x\": 1}<|call|><|start|>assistant<|channel|>commentary "
        "to=functions.b json<|message|>{\"y\": [2]}<|call|>",
        {"", {{"a", J(R"({"x": 1})")}, {"b", J(R"({"y": [2]})")}}});
}
