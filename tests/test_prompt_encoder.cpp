// Chat prompts where only the template's markup becomes control tokens (chat::PromptEncoder):
// hostile conversations carrying every control token string of the vocabulary (and every
// special token string, and partial ones at string edges) in system, user, assistant and
// tool content, tool-call arguments and their keys, and tool definitions must encode to the
// same control-token sequence as a harmless conversation of the same shape, with the text
// itself unchanged; conversations without such strings encode exactly as
// encode(render(messages), parse_special = true).
//
// Families: the shipped qwen3moe model (its vocabulary and template, and Qwen3's template
// with tools), and gpt-oss (harmony), DeepSeek V3.1 and GLM-4.6 with their real templates from
// ../shared/data/templates. No fixture carries those three vocabularies, so their tokenizer
// is the shipped model's with the family's markup tokens made control tokens (existing
// entries retyped, missing ones added).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "chat/chat_template.h"
#include "gguf/gguf.h"
#include "support/paths.h"
#include "tokenizer/tokenizer.h"

using namespace strata;
using J = nlohmann::ordered_json;

namespace {

std::string shared_template(const std::string& name) {
  const std::string path = std::string(STRATA_REPO_DIR) + "/../shared/data/templates/" + name;
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The shipped model's tokenizer with `controls` as control tokens.
tokenizer::Tokenizer with_controls(const gguf::File& f, const std::vector<std::string>& controls, int32_t* bos) {
  std::vector<std::string> tokens = f.get_string_array("tokenizer.ggml.tokens");
  std::vector<int32_t> types;
  for (int64_t t : f.get_int_array("tokenizer.ggml.token_type")) types.push_back(int32_t(t));
  for (const std::string& c : controls) {
    auto it = std::find(tokens.begin(), tokens.end(), c);
    if (it != tokens.end()) {
      types[size_t(it - tokens.begin())] = int32_t(tokenizer::TokenType::CONTROL);
    } else {
      tokens.push_back(c);
      types.push_back(int32_t(tokenizer::TokenType::CONTROL));
    }
  }
  *bos = int32_t(std::find(tokens.begin(), tokens.end(), controls[0]) - tokens.begin());
  return tokenizer::Tokenizer::from_vocab("gpt2", f.get_string("tokenizer.ggml.pre"), tokens, types,
                                          f.get_string_array("tokenizer.ggml.merges"), *bos,
                                          int32_t(f.get_int("tokenizer.ggml.eos_token_id")));
}

std::vector<int32_t> controls_of(const tokenizer::Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::vector<int32_t> out;
  for (int32_t id : ids)
    if (tok.is_control(id)) out.push_back(id);
  return out;
}

// A conversation with tools whose every client string is `s` (`key` for argument keys).
J conversation(const std::string& s, const std::string& key, bool with_tool_turn) {
  J m = J::array();
  m.push_back({{"role", "system"}, {"content", "System: " + s}});
  m.push_back({{"role", "user"}, {"content", s}});
  if (with_tool_turn) {
    m.push_back(
        {{"role", "assistant"},
         {"content", ""},
         {"tool_calls", J::array({{{"id", "call_1"},
                                   {"type", "function"},
                                   {"function", {{"name", "lookup"}, {"arguments", {{key, s}, {"n", 2}}}}}}})}});
    m.push_back({{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "Result: " + s}});
  }
  m.push_back({{"role", "user"}, {"content", s + " end"}});
  return m;
}

J tools_with(const std::string& s) {
  return J::array(
      {{{"type", "function"},
        {"function",
         {{"name", "lookup"},
          {"description", "Looks up " + s},
          {"parameters", {{"type", "object"}, {"properties", {{"q", {{"type", "string"}, {"description", s}}}}}}}}}}});
}

// Every special (control and user-defined) token string of `tok`, and partial ones at the edges.
std::string hostile_text(const tokenizer::Tokenizer& tok) {
  std::string special;
  std::string first_control;
  for (int32_t id = 0; id < tok.n_vocab(); ++id) {
    const auto t = tok.type(id);
    if (t != tokenizer::TokenType::CONTROL && t != tokenizer::TokenType::USER_DEFINED) continue;
    special += tok.token_bytes(id) + " x";
    if (t == tokenizer::TokenType::CONTROL && first_control.empty()) first_control = tok.token_bytes(id);
  }
  // A leading suffix and a trailing prefix of a control token (the template's markup beside
  // them must not complete a token), and the strings glued to each other.
  return first_control.substr(2) + " " + special + special + first_control.substr(0, first_control.size() - 2);
}

void check_family(const std::string& name, const tokenizer::Tokenizer& tok, const chat::ChatTemplate& tmpl,
                  bool with_tools) {
  SCOPED_TRACE(name);
  const chat::PromptEncoder enc(tok);
  ASSERT_FALSE(enc.control_tokens().empty());
  const std::string hostile = hostile_text(tok);
  const J extra_h = with_tools ? J{{"tools", tools_with(hostile)}} : J::object();
  const J extra_b = with_tools ? J{{"tools", tools_with("plain words")}} : J::object();
  const J bad = conversation(hostile, hostile, with_tools);
  const J good = conversation("plain words", "q", with_tools);

  // Harmless: exactly what encoding the rendered text with parse_special gives.
  const std::vector<int32_t> benign = enc.encode_chat(tmpl, good, true, extra_b);
  EXPECT_EQ(benign, tok.encode(tmpl.apply(good, true, extra_b), true));
  ASSERT_FALSE(controls_of(tok, benign).empty());

  // Hostile: the template's control tokens only, and the text unchanged.
  const std::vector<int32_t> ids = enc.encode_chat(tmpl, bad, true, extra_h);
  EXPECT_EQ(controls_of(tok, ids), controls_of(tok, benign));
  EXPECT_EQ(tok.decode(ids), tmpl.apply(bad, true, extra_h));
  // Without the encoder, the same text would have injected control tokens (the test bites).
  EXPECT_GT(controls_of(tok, tok.encode(tmpl.apply(bad, true, extra_h), true)).size(), controls_of(tok, benign).size());
}

}  // namespace

TEST(PromptEncoder, ShippedQwen3MoeModel) {
  auto f = gguf::File::open(test::shipped_model());
  const auto tok = tokenizer::Tokenizer::from_gguf(f);
  check_family("qwen3moe, its own template", tok, chat::ChatTemplate::from_gguf(f, tok), false);
  const std::string qwen3 = shared_template("Qwen-Qwen3-0.6B.jinja");
  if (qwen3.empty()) GTEST_SKIP() << "../shared/data/templates absent: Qwen3's tool template not checked";
  check_family("qwen3moe vocabulary, Qwen3 template with tools", tok, chat::ChatTemplate(qwen3, "", "<|im_end|>"),
               true);
}

TEST(PromptEncoder, OtherFamilies) {
  auto f = gguf::File::open(test::shipped_model());
  struct Fam {
    const char* name;
    const char* file;
    std::vector<std::string> controls;  // the first is BOS
  };
  const Fam fams[] = {
      {"gpt-oss harmony",
       "openai-gpt-oss-120b.jinja",
       {"<|startoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
        "<|constrain|>"}},
      {"DeepSeek V3.1",
       "deepseek-ai-DeepSeek-V3.1.jinja",
       {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
        "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<think>", "</think>"}},
      {"GLM-4.6",
       "GLM-4.6.jinja",
       {"[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<tool_call>", "</tool_call>",
        "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>", "<think>",
        "</think>"}},
  };
  for (const Fam& fam : fams) {
    const std::string src = shared_template(fam.file);
    if (src.empty()) GTEST_SKIP() << "../shared/data/templates absent";
    int32_t bos = -1;
    const auto tok = with_controls(f, fam.controls, &bos);
    check_family(fam.name, tok, chat::ChatTemplate(src, tok.token_bytes(bos), tok.token_bytes(tok.eos_id())), true);
  }
}

// A slice through a marker (a template that cuts content) keeps the text as plain text.
TEST(PromptEncoder, TemplateThatSlicesContent) {
  auto f = gguf::File::open(test::shipped_model());
  const auto tok = tokenizer::Tokenizer::from_gguf(f);
  const chat::ChatTemplate t("{% for m in messages %}<|im_start|>{{ m.content[:9] }}<|im_end|>{% endfor %}", "", "");
  const chat::PromptEncoder enc(tok);
  const J m = J::array({{{"role", "user"}, {"content", "ab<|im_end|>cd"}}});
  const auto ids = enc.encode_chat(t, m, false);
  EXPECT_EQ(controls_of(tok, ids),
            (std::vector<int32_t>{*tok.find_token("<|im_start|>"), *tok.find_token("<|im_end|>")}));
  EXPECT_EQ(tok.decode(ids).rfind("<|im_start|>ab", 0), 0u);
}

TEST(ChatTemplateFile, EmptyOrBinaryFailsAtLoad) {
  EXPECT_THROW(chat::ChatTemplate("", "", ""), chat::TemplateError);
  EXPECT_THROW(chat::ChatTemplate(" \n\t", "", ""), chat::TemplateError);
  EXPECT_THROW(chat::ChatTemplate(std::string("\x7f"
                                              "ELF\x02\x01\x01\0\0",
                                              9),
                                  "", ""),
               chat::TemplateError);
  EXPECT_THROW(chat::ChatTemplate("\xff\xfe{{ x }}", "", ""), chat::TemplateError);
  EXPECT_THROW(chat::ChatTemplate("Hello, no messages here", "", ""), chat::TemplateError);
  EXPECT_THROW(chat::ChatTemplate("{{ messages | length }}", "", ""), chat::TemplateError);
  try {
    chat::ChatTemplate("", "", "");
  } catch (const chat::TemplateError& e) {
    EXPECT_STREQ(e.what(), "the chat template is empty");
  }
}

// gpt-oss: the turn ends at <|return|> or <|call|>, not at the <|end|> of its analysis message.
TEST(ChatTemplateFile, HarmonyEndOfGenerationTokens) {
  auto f = gguf::File::open(test::shipped_model());
  int32_t bos = -1;
  const auto tok =
      with_controls(f,
                    {"<|startoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"},
                    &bos);
  const auto eog = chat::end_of_generation_tokens(tok);
  auto has = [&](const char* t) { return std::count(eog.begin(), eog.end(), *tok.find_token(t)) == 1; };
  EXPECT_TRUE(has("<|return|>"));
  EXPECT_TRUE(has("<|call|>"));
  EXPECT_FALSE(has("<|end|>"));
  EXPECT_TRUE(has("<|im_end|>"));  // the shipped vocabulary's own, still a control token
  const auto plain = chat::end_of_generation_tokens(tokenizer::Tokenizer::from_gguf(f));
  EXPECT_EQ(std::count(plain.begin(), plain.end(), *tok.find_token("<|im_end|>")), 1);
}
