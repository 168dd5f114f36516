// Tokenizer tests: exact agreement with the Hugging Face tokenizer on tests/data/tokenizer.json,
// round trips, streaming decode, error handling.
#include "tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "support/paths.h"

namespace tk = strata::tokenizer;
namespace gguf = strata::gguf;

namespace {

struct Case {
  std::string text;
  std::vector<int32_t> ids;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> cs = [] {
    std::ifstream in(strata::test::data_path("tokenizer.json"));
    if (!in) throw std::runtime_error("cannot open " + strata::test::data_path("tokenizer.json"));
    nlohmann::json j = nlohmann::json::parse(in);
    std::vector<Case> v;
    for (const auto& c : j.at("cases"))
      v.push_back({c.at("text").get<std::string>(), c.at("ids").get<std::vector<int32_t>>()});
    return v;
  }();
  return cs;
}

const tk::Tokenizer& model_tok() {
  static const tk::Tokenizer t = tk::Tokenizer::from_gguf(gguf::File::open(strata::test::shipped_model()));
  return t;
}

std::string ids_str(const std::vector<int32_t>& ids) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < ids.size(); ++i) os << (i ? ", " : "") << ids[i];
  os << "]";
  return os.str();
}

std::string short_text(const std::string& s) { return s.size() <= 80 ? s : s.substr(0, 80) + "..."; }

// A tiny tokenizer over the alphabet {a, b, c} plus one control token.
tk::Tokenizer tiny(const std::vector<std::string>& merges) {
  return tk::Tokenizer::from_vocab("gpt2", "qwen2", {"<|end|>", "a", "b", "c", "ab", "bc", "abc", "Ġ"},
                                   {3, 1, 1, 1, 1, 1, 1, 1}, merges, -1, 0);
}

}  // namespace

TEST(Tokenizer, Metadata) {
  const auto& t = model_tok();
  EXPECT_EQ(t.n_vocab(), 8192);
  EXPECT_EQ(t.pre_name(), "qwen2");
  EXPECT_EQ(t.eos_id(), 0);
  EXPECT_EQ(t.bos_id(), 0);
  EXPECT_TRUE(t.is_control(0));
  EXPECT_TRUE(t.is_control(1));
  EXPECT_TRUE(t.is_control(2));
  EXPECT_FALSE(t.is_control(3));
  EXPECT_FALSE(t.is_control(-1));
  EXPECT_FALSE(t.is_control(8192));
  EXPECT_EQ(t.find_token("<|im_end|>"), std::optional<int32_t>(2));
  EXPECT_EQ(t.find_token("<|endoftext|>"), std::optional<int32_t>(0));
  EXPECT_EQ(t.find_token("!"), std::optional<int32_t>(3));
  EXPECT_EQ(t.find_token(" "), std::optional<int32_t>(223));
  EXPECT_FALSE(t.find_token("this is surely not a single token").has_value());
  EXPECT_EQ(t.token_bytes(2), "<|im_end|>");
  EXPECT_EQ(t.token_bytes(223), " ");
  EXPECT_THROW(t.token_bytes(-1), std::out_of_range);
  EXPECT_THROW(t.token_bytes(8192), std::out_of_range);
}

TEST(Tokenizer, MatchesHuggingFaceCases) {
  const auto& t = model_tok();
  ASSERT_FALSE(cases().empty());
  int failures = 0;
  for (const auto& c : cases()) {
    std::vector<int32_t> got;
    try {
      got = t.encode(c.text);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "text " << ::testing::PrintToString(short_text(c.text)) << " threw: " << e.what();
      ++failures;
      continue;
    }
    if (got != c.ids) {
      ++failures;
      size_t k = 0;
      while (k < got.size() && k < c.ids.size() && got[k] == c.ids[k]) ++k;
      ADD_FAILURE() << "text " << ::testing::PrintToString(short_text(c.text)) << "\n  first difference at index " << k
                    << "\n  expected " << ids_str(c.ids) << "\n  got      " << ids_str(got);
    }
  }
  EXPECT_EQ(failures, 0) << failures << " of " << cases().size() << " cases differ";
}

TEST(Tokenizer, DecodeRoundTrip) {
  const auto& t = model_tok();
  for (const auto& c : cases()) {
    auto ids = t.encode(c.text);
    EXPECT_EQ(t.decode(ids), c.text) << "text " << ::testing::PrintToString(short_text(c.text));
    EXPECT_EQ(t.decode(c.ids), c.text) << "reference ids of " << ::testing::PrintToString(short_text(c.text));
  }
}

TEST(Tokenizer, ParseSpecialOff) {
  const auto& t = model_tok();
  const std::string text = "<|im_start|>user\nhi<|im_end|>";
  auto with = t.encode(text, true);
  auto without = t.encode(text, false);
  ASSERT_FALSE(with.empty());
  EXPECT_EQ(with.front(), 1);
  EXPECT_EQ(with.back(), 2);
  for (int32_t id : without) EXPECT_FALSE(t.is_control(id)) << id;
  EXPECT_EQ(t.decode(without), text);
}

TEST(Tokenizer, SpecialTokensSplitText) {
  const auto& t = model_tok();
  // Control tokens adjacent to each other and at both ends.
  auto ids = t.encode("<|im_end|><|im_start|>x<|endoftext|>");
  ASSERT_GE(ids.size(), 4u);
  EXPECT_EQ(ids[0], 2);
  EXPECT_EQ(ids[1], 1);
  EXPECT_EQ(ids.back(), 0);
  // An incomplete special token is ordinary text.
  auto partial = t.encode("<|im_end|");
  for (int32_t id : partial) EXPECT_FALSE(t.is_control(id));
  EXPECT_EQ(t.decode(partial), "<|im_end|");
}

TEST(Tokenizer, StreamDecoderMultiByte) {
  const auto& t = model_tok();
  const std::string text = "emoji 😀👍🏽 done, 日本語のテキスト — ünïcödé ☃ 🇯🇵 ok";
  auto ids = t.encode(text);
  ASSERT_EQ(t.decode(ids), text);
  // The test is only meaningful if some token ends inside a multi-byte character.
  bool some_partial = false;
  for (int32_t id : ids) some_partial |= tk::find_invalid_utf8(t.token_bytes(id)).has_value();
  EXPECT_TRUE(some_partial);

  tk::StreamDecoder dec(t);
  std::string all;
  for (int32_t id : ids) {
    std::string piece = dec.push(id);
    EXPECT_FALSE(tk::find_invalid_utf8(piece).has_value()) << "invalid UTF-8 emitted after token " << id;
    all += piece;
  }
  std::string rest = dec.flush();
  EXPECT_TRUE(rest.empty());
  all += rest;
  EXPECT_EQ(all, text);
}

TEST(Tokenizer, StreamDecoderReplacesInvalid) {
  const auto& t = model_tok();
  auto lead = t.find_token("\xE6");  // first byte of a 3-byte sequence
  auto cont = t.find_token("\x97");  // a lone continuation byte
  auto a = t.find_token("a");
  ASSERT_TRUE(lead && cont && a);
  {
    tk::StreamDecoder dec(t);
    EXPECT_EQ(dec.push(*lead), "");          // held back: may still complete
    EXPECT_EQ(dec.flush(), "\xEF\xBF\xBD");  // incomplete at the end -> U+FFFD
    EXPECT_EQ(dec.flush(), "");
  }
  {
    tk::StreamDecoder dec(t);
    EXPECT_EQ(dec.push(*lead), "");
    EXPECT_EQ(dec.push(*a),
              "\xEF\xBF\xBD"
              "a");  // can never complete -> replaced at once
    EXPECT_EQ(dec.push(*cont), "\xEF\xBF\xBD");
    EXPECT_EQ(dec.flush(), "");
  }
}

TEST(Tokenizer, InvalidUtf8Throws) {
  const auto& t = model_tok();
  auto expect_error = [&](const std::string& s, size_t at) {
    try {
      t.encode(s);
      ADD_FAILURE() << "no exception for " << ::testing::PrintToString(s);
    } catch (const tk::TokenizerError& e) {
      EXPECT_EQ(std::string(e.what()), "invalid UTF-8 at byte " + std::to_string(at)) << ::testing::PrintToString(s);
    }
  };
  expect_error(
      "ab\xFF"
      "cd",
      2);
  expect_error("abc\xE6\x97", 3);         // truncated
  expect_error("\xC0\x80", 0);            // overlong
  expect_error("x\xED\xA0\x80", 1);       // surrogate
  expect_error("xy\xF4\x90\x80\x80", 2);  // above U+10FFFF
  expect_error("\x80", 0);                // lone continuation
  EXPECT_NO_THROW(t.encode("\xF4\x8F\xBF\xBF"));
}

TEST(Tokenizer, BpeMergeOrderOnTinyVocab) {
  // "b c" has the best rank, so "abc" -> "a" + "bc" -> "abc" via "a bc".
  auto t1 = tiny({"b c", "a b", "a bc"});
  EXPECT_EQ(t1.encode("abc"), (std::vector<int32_t>{6}));
  // Without "a bc" the result is "a", "bc".
  auto t2 = tiny({"b c", "a b"});
  EXPECT_EQ(t2.encode("abc"), (std::vector<int32_t>{1, 5}));
  // "a b" first: "ab", "c".
  auto t3 = tiny({"a b", "b c"});
  EXPECT_EQ(t3.encode("abc"), (std::vector<int32_t>{4, 3}));
  EXPECT_EQ(t3.encode("abc<|end|>abc"), (std::vector<int32_t>{4, 3, 0, 4, 3}));
  EXPECT_EQ(t3.decode(std::vector<int32_t>{4, 3, 0, 7}), "abc<|end|> ");
  EXPECT_EQ(t3.n_vocab(), 8);
  EXPECT_EQ(t3.eos_id(), 0);
  EXPECT_EQ(t3.bos_id(), -1);
  // A byte with no token is an error, not a silent drop.
  EXPECT_THROW(t3.encode("z"), tk::TokenizerError);
}

TEST(Tokenizer, FromVocabErrors) {
  auto msg = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const tk::TokenizerError& e) {
      return e.what();
    }
    return "(no exception)";
  };
  std::string m = msg([] { tk::Tokenizer::from_vocab("gpt2", "bogus", {"a"}, {}, {}, -1, -1); });
  EXPECT_NE(m.find("unknown pre-tokenizer 'bogus' (supported: qwen2"), std::string::npos) << m;
  m = msg([] { tk::Tokenizer::from_vocab("llama", "qwen2", {"a"}, {}, {}, -1, -1); });
  EXPECT_NE(m.find("unsupported tokenizer.ggml.model 'llama'"), std::string::npos) << m;
  m = msg([] { tiny({"a b", "ab"}); });
  EXPECT_NE(m.find("bad merge #1 'ab'"), std::string::npos) << m;
  m = msg([] { tiny({"a c"}); });
  EXPECT_NE(m.find("bad merge #0 'a c'"), std::string::npos) << m;
  m = msg([] { tk::Tokenizer::from_vocab("gpt2", "qwen2", {"a", "b"}, {1}, {}, -1, -1); });
  EXPECT_NE(m.find("token_type"), std::string::npos) << m;
  m = msg([] { tk::Tokenizer::from_vocab("gpt2", "qwen2", {"a"}, {}, {}, -1, 5); });
  EXPECT_NE(m.find("eos token id 5 out of range"), std::string::npos) << m;
}

TEST(Tokenizer, FromGgufUnknownPreTokenizer) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("strata_tok_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& model, const std::string& pre) {
    gguf::Writer w;
    w.add_string("general.architecture", "test");
    w.add_string("tokenizer.ggml.model", model);
    w.add_string("tokenizer.ggml.pre", pre);
    w.add_string_array("tokenizer.ggml.tokens", {"<|end|>", "a", "b", "ab"});
    w.add_kv("tokenizer.ggml.token_type", gguf::make_i32_array({3, 1, 1, 1}));
    w.add_string_array("tokenizer.ggml.merges", {"a b"});
    w.add_u32("tokenizer.ggml.eos_token_id", 0);
    std::string path = (dir / name).string();
    w.write(path);
    return path;
  };
  std::string bad_pre = write("bad_pre.gguf", "gpt2", "qwen99");
  try {
    tk::Tokenizer::from_gguf(gguf::File::open(bad_pre));
    ADD_FAILURE() << "no exception";
  } catch (const tk::TokenizerError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown pre-tokenizer 'qwen99' (supported: qwen2"), std::string::npos)
        << e.what();
  }
  std::string bad_model = write("bad_model.gguf", "llama", "qwen2");
  EXPECT_THROW(tk::Tokenizer::from_gguf(gguf::File::open(bad_model)), tk::TokenizerError);
  {  // a large vocabulary without merges (e.g. a tiktoken-style file) is refused, not mis-encoded
    gguf::Writer w;
    w.add_string("general.architecture", "test");
    w.add_string("tokenizer.ggml.model", "gpt2");
    w.add_string("tokenizer.ggml.pre", "kimi-k2");
    std::vector<std::string> toks;
    for (int i = 0; i < 300; ++i) toks.push_back("t" + std::to_string(i));
    w.add_string_array("tokenizer.ggml.tokens", toks);
    const std::string path = (dir / "no_merges.gguf").string();
    w.write(path);
    try {
      tk::Tokenizer::from_gguf(gguf::File::open(path));
      ADD_FAILURE() << "no exception";
    } catch (const tk::TokenizerError& e) {
      EXPECT_NE(std::string(e.what()).find("no tokenizer.ggml.merges (pre-tokenizer 'kimi-k2')"), std::string::npos)
          << e.what();
    }
  }
  std::string good = write("good.gguf", "gpt2", "qwen2");
  auto t = tk::Tokenizer::from_gguf(gguf::File::open(good));
  EXPECT_EQ(t.encode("ab<|end|>"), (std::vector<int32_t>{3, 0}));
  EXPECT_EQ(t.eos_id(), 0);
  EXPECT_EQ(t.bos_id(), -1);
  fs::remove_all(dir);
}

// A 100 KB text round-trips; its encode time is printed, not asserted (speed belongs to
// benchmarks; a timed assertion flakes on a loaded CI machine).
TEST(Tokenizer, LargeTextRoundTrips) {
  const auto& t = model_tok();
  std::string text;
  while (text.size() < 100 * 1024)
    for (const auto& c : cases()) text += c.text;
  auto t0 = std::chrono::steady_clock::now();
  auto ids = t.encode(text);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("encoded %zu bytes into %zu tokens in %.3f s\n", text.size(), ids.size(), secs);
  EXPECT_EQ(t.decode(ids), text);
}

// ---- pre-tokenizers of the MoE families (issue 14) ----

namespace {

// ../shared/data/vocab (llama.cpp's tokenizer test vocabularies), or "" when absent.
std::string shared_vocab_dir() {
  namespace fs = std::filesystem;
  if (const char* env = std::getenv("STRATA_VOCAB_DIR"); env && *env) return env;
  const std::string fx = strata::test::shared_fixtures();
  if (!fx.empty() && fs::is_directory(fs::path(fx) / ".." / "data" / "vocab"))
    return (fs::path(fx) / ".." / "data" / "vocab").string();
  return "";
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// llama.cpp's test-tokenizer-0 format: <name>.inp holds the inputs, each followed by the line
// "__ggml_vocab_test__"; <name>.out holds one line of space-separated ids per input.
std::vector<Case> load_vocab_cases(const std::string& gguf_path) {
  const std::string inp = read_all(gguf_path + ".inp");
  const std::string sep = "\n__ggml_vocab_test__\n";
  std::vector<std::string> texts;
  size_t pos = 0;
  while (true) {
    size_t e = inp.find(sep, pos);
    if (e == std::string::npos) break;
    texts.push_back(inp.substr(pos, e - pos));
    pos = e + sep.size();
  }
  if (pos != inp.size()) throw std::runtime_error(gguf_path + ".inp: text after the last separator");
  std::ifstream out(gguf_path + ".out");
  if (!out) throw std::runtime_error("cannot open " + gguf_path + ".out");
  std::vector<Case> cs;
  std::string line;
  for (const auto& t : texts) {
    if (!std::getline(out, line)) throw std::runtime_error(gguf_path + ".out: fewer lines than inputs");
    std::istringstream ls(line);
    std::vector<int32_t> ids;
    int32_t v;
    while (ls >> v) ids.push_back(v);
    cs.push_back({t, ids});
  }
  if (std::getline(out, line)) throw std::runtime_error(gguf_path + ".out: more lines than inputs");
  return cs;
}

class VocabVectors : public ::testing::TestWithParam<std::string> {};

}  // namespace

// Every case of llama.cpp's tokenizer test file for a real vocabulary: exact ids (these are the
// Hugging Face tokenizer's outputs, written by llama.cpp's convert_hf_to_gguf_update.py).
TEST_P(VocabVectors, ExactIds) {
  const std::string dir = shared_vocab_dir();
  if (dir.empty()) GTEST_SKIP() << "../shared/data/vocab absent; set STRATA_VOCAB_DIR to run this test";
  const std::string path = dir + "/ggml-vocab-" + GetParam() + ".gguf";
  ASSERT_TRUE(std::filesystem::exists(path)) << path;
  const auto tok = tk::Tokenizer::from_gguf(gguf::File::open(path));
  EXPECT_EQ(tok.pre_name(), GetParam());
  const auto cs = load_vocab_cases(path);
  ASSERT_GE(cs.size(), 40u) << path;
  int failures = 0;
  for (const auto& c : cs) {
    const auto got = tok.encode(c.text, /*parse_special=*/false);
    if (got != c.ids) {
      ++failures;
      ADD_FAILURE() << GetParam() << ": text " << ::testing::PrintToString(short_text(c.text)) << "\n  expected "
                    << ids_str(c.ids) << "\n  got      " << ids_str(got);
    }
  }
  EXPECT_EQ(failures, 0) << failures << " of " << cs.size() << " cases differ";
}

INSTANTIATE_TEST_SUITE_P(Families, VocabVectors, ::testing::Values("gpt-2", "deepseek-coder", "falcon", "starcoder"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

// Pre-tokenizers with no vocabulary file here: pieces derived by hand from the published regexes
// (comments give the reasoning); each pre also gets one case that tells it apart from its nearest
// neighbour.
TEST(Tokenizer, PreTokenizerSplitsByHand) {
  using V = std::vector<std::string>;
  auto split = [](const char* pre, const std::string& text) { return tk::pre_tokenize(pre, text); };
  // qwen35: single digits; combining marks (U+0301) stay with letters, unlike qwen2.
  EXPECT_EQ(split("qwen35", "12345"), (V{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(split("qwen35", "e\u0301x"), (V{"e\u0301x"}));
  EXPECT_EQ(split("qwen2", "e\u0301x"), (V{"e", "\u0301x"}));
  EXPECT_EQ(split("qwen35", "I'm a  b"), (V{"I", "'m", " a", " ", " b"}));
  // gpt-4o / minimax-m2: digit groups of 1-3, case-aware words, contractions attached.
  for (const char* pre : {"gpt-4o", "minimax-m2"}) {
    EXPECT_EQ(split(pre, "1234567"), (V{"123", "456", "7"})) << pre;
    EXPECT_EQ(split(pre, "HelloWorld don't"), (V{"Hello", "World", " don't"})) << pre;
    EXPECT_EQ(split(pre, "HELLO's"), (V{"HELLO's"})) << pre;
    EXPECT_EQ(split(pre, "a+/\n"), (V{"a", "+/\n"})) << pre;
    EXPECT_EQ(split(pre, "你好world"), (V{"你好world"})) << pre;  // Han is \p{Lo}: one word
  }
  // kimi-k2: Han runs split off; letters exclude Han; digits 1-3.
  EXPECT_EQ(split("kimi-k2", "你好world"), (V{"你好", "world"}));
  EXPECT_EQ(split("kimi-k2", "abc你好 世界"), (V{"abc", "你好", " ", "世界"}));
  EXPECT_EQ(split("kimi-k2", "12345 It's"), (V{"123", "45", " It's"}));
  // deepseek-v3: digits 1-3 first, then CJK / kana runs, then the word rules
  EXPECT_EQ(split("deepseek-v3", "1234567"), (V{"123", "456", "7"}));
  EXPECT_EQ(split("deepseek-v3", "Hello 世界123"), (V{"Hello", " ", "世界", "123"}));
  EXPECT_EQ(split("deepseek-v3", "(foo) bar"), (V{"(foo", ")", " bar"}));
  EXPECT_EQ(split("deepseek-v3", "かなカナ漢字"), (V{"かなカナ漢字"}));
  // glm4 (llama3's pattern): digits 1-3, case-insensitive contractions.
  EXPECT_EQ(split("glm4", "12345"), (V{"123", "45"}));
  EXPECT_EQ(split("glm4", "I'M here"), (V{"I", "'M", " here"}));
  // refact (as starcoder): every digit isolated first, then GPT-2's regex.
  EXPECT_EQ(split("refact", "abc 123"), (V{"abc", " ", "1", "2", "3"}));
  // mpt (GPT-2's regex): digits stay together with their leading space.
  EXPECT_EQ(split("mpt", "Hello  world 123"), (V{"Hello", " ", " world", " 123"}));
  // deepseek-llm: newlines isolated, letter runs, punctuation runs, digit runs.
  EXPECT_EQ(split("deepseek-llm", "Hi, 42!\n"), (V{"Hi", ",", " ", "42", "!", "\n"}));
  // The pieces always concatenate back to the text.
  const std::string mixed = "Ünïcode 你好 123456 don't\r\n\t  (x)=>{y}; カナ e\u0301";
  for (const auto& pre : tk::supported_pre_tokenizers()) {
    std::string joined;
    for (const auto& p : tk::pre_tokenize(pre, mixed)) {
      EXPECT_FALSE(p.empty()) << pre;
      joined += p;
    }
    EXPECT_EQ(joined, mixed) << pre;
  }
  try {
    tk::pre_tokenize("no-such-pre", "x");
    ADD_FAILURE() << "no exception";
  } catch (const tk::TokenizerError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown pre-tokenizer 'no-such-pre' (supported: "), std::string::npos)
        << e.what();
  }
}
