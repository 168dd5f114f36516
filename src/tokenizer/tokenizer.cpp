#include "tokenizer/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <new>
#include <queue>
#include <unordered_map>
#include <utility>

#include "gguf/gguf.h"

namespace strata::tokenizer {

namespace {

// ---- pre-tokenizer regexes ----
// Each pre-tokenizer is a sequence of split regexes (Hugging Face `Split` with behaviour
// "Isolated", or the regex of `ByteLevel(use_regex=true)`): every stage splits every piece the
// previous stage produced into its matches and the gaps between them, both kept. The patterns
// are those of the models' tokenizer.json / tiktoken definitions as llama.cpp lists them in
// src/llama-vocab.cpp (LLAMA_VOCAB_PRE_TYPE_*); where llama.cpp rewrote a pattern for std::regex
// (e.g. `(?i:...)` spelled out as `'[sS]`), the original is used, since PCRE2 supports it.

// qwen2: the "Split" pattern of Qwen2's tokenizer.json (LLAMA_VOCAB_PRE_TYPE_QWEN2).
constexpr const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// qwen35: Qwen3.5's pattern: like qwen2, but combining marks (\p{M}) join letters; single digits.
constexpr const char* kQwen35Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// llama3 ("llama-bpe" in GGUF; also glm4 / chatglm-bpe): digits in groups of up to three.
constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// gpt2: the original GPT-2 pattern (ByteLevel's regex).
constexpr const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// gpt-4o (tiktoken o200k_base; also minimax-m2): case-aware words with attached contractions,
// digits in groups of up to three, '/' may trail punctuation.
constexpr const char* kGpt4oPattern =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// kimi-k2 (tokenization_kimi.py): Han runs first, then the gpt-4o-like word rules restricted to
// non-Han letters. The source's class intersection `[...&&[^\p{Han}]]` (Python `regex`) is
// written as a negative lookahead per character, which PCRE2 supports.
#define STRATA_KIMI_UPPER R"((?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]))"
#define STRATA_KIMI_LOWER R"((?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}]))"
constexpr const char* kKimiK2Pattern =
    R"(\p{Han}+)"
    R"(|[^\r\n\p{L}\p{N}]?)" STRATA_KIMI_UPPER "*" STRATA_KIMI_LOWER R"(+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?)" STRATA_KIMI_UPPER "+" STRATA_KIMI_LOWER R"(*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
#undef STRATA_KIMI_UPPER
#undef STRATA_KIMI_LOWER
// deepseek-v3 (DeepSeek V3 / R1 tokenizer.json): three Splits.
constexpr const char* kDeepseekV3Words =
    R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// deepseek-llm (DeepSeek LLM 7B/67B tokenizer.json): explicit letter ranges (the cased letters),
// ASCII / full-width punctuation, CJK / Hangul runs, digit runs. The letter class is spelled with
// \x{...} escapes: several of its code points (U+1F7D, U+1FBE, U+1FD3, U+1FDB, U+2126, U+212A)
// are NFC singletons that a text tool would silently replace.
constexpr const char* kDeepseekLlmLetters =
    R"(\s?[)"
    R"(A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293})"
    R"(\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A})"
    R"(\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556})"
    R"(\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF})"
    R"(\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D})"
    R"(\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D})"
    R"(\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4})"
    R"(\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4})"
    R"(\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124})"
    R"(\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F})"
    R"(\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4})"
    R"(\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F})"
    R"(\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17})"
    R"(\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3})"
    R"(\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF})"
    R"(\x{1E900}-\x{1E943})"
    R"(]+)";
constexpr const char* kCjkRuns = R"([\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+)";
// falcon: HF Punctuation(Contiguous) (ASCII punctuation or \p{P}), then ByteLevel's GPT-2 regex,
// then Split("[0-9][0-9][0-9]").
constexpr const char* kFalconPunct = R"([\p{P}$+<=>^~|`]+)";

constexpr size_t kMaxStages = 6;
struct PreTokenizerDef {
  const char* name;
  std::array<const char*, kMaxStages> stages;  // applied in order; nullptr ends the list
};
constexpr std::array<PreTokenizerDef, 19> kPreTokenizers{{
    {"qwen2", {kQwen2Pattern}},
    {"deepseek-r1-qwen", {kQwen2Pattern}},
    {"qwen35", {kQwen35Pattern}},
    {"llama-bpe", {kLlama3Pattern}},
    {"llama3", {kLlama3Pattern}},
    {"glm4", {kLlama3Pattern}},
    {"chatglm-bpe", {kLlama3Pattern}},
    {"gpt2", {kGpt2Pattern}},
    {"gpt-2", {kGpt2Pattern}},
    {"mpt", {kGpt2Pattern}},
    {"gpt-4o", {kGpt4oPattern}},
    {"minimax-m2", {kGpt4oPattern}},
    {"kimi-k2", {kKimiK2Pattern}},
    {"deepseek-v3", {R"(\p{N}{1,3})", R"([\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+)", kDeepseekV3Words}},
    {"deepseek-llm",
     {R"([\r\n])", kDeepseekLlmLetters,
      R"(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)", R"(\s+$)", kCjkRuns,
      R"(\p{N}+)"}},
    {"deepseek-coder", {R"([\r\n])", R"(\s?\p{L}+)", R"(\s?\p{P}+)", kCjkRuns, R"(\p{N})"}},
    {"falcon", {kFalconPunct, kGpt2Pattern, R"([0-9][0-9][0-9])"}},
    {"starcoder", {R"(\p{N})", kGpt2Pattern}},
    {"refact", {R"(\p{N})", kGpt2Pattern}},
}};

std::string supported_pre_list() {
  std::string s;
  for (const auto& d : kPreTokenizers) {
    if (!s.empty()) s += ", ";
    s += d.name;
  }
  return s;
}

const PreTokenizerDef* find_pre(const std::string& name) {
  for (const auto& d : kPreTokenizers)
    if (name == d.name) return &d;
  return nullptr;
}

// ---- GPT-2 byte <-> unicode mapping ----
struct ByteMap {
  std::array<std::string, 256> enc;  // byte -> UTF-8 of its printable code point
  std::array<int16_t, 324> dec;      // code point -> byte, -1 if none (all code points < 324)
  ByteMap() {
    dec.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      uint32_t cp = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
      dec[cp] = static_cast<int16_t>(b);
      std::string s;
      if (cp < 0x80) {
        s.push_back(static_cast<char>(cp));
      } else {
        s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      enc[b] = std::move(s);
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// Decodes one code point of valid-or-not UTF-8 at s[i]; returns the code point and advances i.
// Invalid sequences yield U+FFFD-like garbage but always advance (used on vocab strings only).
uint32_t next_cp(std::string_view s, size_t& i) {
  auto c = static_cast<unsigned char>(s[i]);
  int len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
  if (i + static_cast<size_t>(len) > s.size()) len = 1;
  uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
  for (int k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += static_cast<size_t>(len);
  return cp;
}

// Byte-level decoding of a vocabulary string: every code point of the GPT-2 alphabet becomes
// its byte; anything else (should not occur in a byte-level vocab) is kept as its UTF-8.
std::string byte_decode(std::string_view tok) {
  const auto& bm = byte_map();
  std::string out;
  out.reserve(tok.size());
  size_t i = 0;
  while (i < tok.size()) {
    size_t start = i;
    uint32_t cp = next_cp(tok, i);
    if (cp < bm.dec.size() && bm.dec[cp] >= 0)
      out.push_back(static_cast<char>(bm.dec[cp]));
    else
      out.append(tok.substr(start, i - start));
  }
  return out;
}

std::string byte_encode(std::string_view raw) {
  const auto& bm = byte_map();
  std::string out;
  out.reserve(raw.size() * 2);
  for (char c : raw) out += bm.enc[static_cast<unsigned char>(c)];
  return out;
}

// Length of the valid UTF-8 sequence at s[i], or 0 with `bad` = offset of the offending byte.
// `truncated` is set when the sequence is a valid prefix cut off by the end of `s`.
size_t utf8_seq(std::string_view s, size_t i, size_t& bad, bool& truncated) {
  truncated = false;
  auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return 1;
  size_t len;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    bad = i;
    return 0;
  }
  for (size_t k = 1; k < len; ++k) {
    if (i + k >= s.size()) {
      truncated = true;
      bad = i + k;
      return 0;
    }
    auto d = static_cast<unsigned char>(s[i + k]);
    unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (d < l || d > h) {
      bad = i + k;
      return 0;
    }
  }
  return len;
}

constexpr const char* kReplacement = "\xEF\xBF\xBD";

// Appends the valid UTF-8 of s[0, end) to out, replacing each maximal invalid subpart with
// U+FFFD. With `hold_tail`, a trailing truncated-but-valid prefix is not consumed; returns
// the number of bytes consumed.
size_t sanitize_utf8(std::string_view s, bool hold_tail, std::string& out) {
  size_t i = 0;
  while (i < s.size()) {
    size_t bad = 0;
    bool truncated = false;
    size_t n = utf8_seq(s, i, bad, truncated);
    if (n > 0) {
      out.append(s.substr(i, n));
      i += n;
    } else if (truncated && hold_tail) {
      return i;
    } else {
      out += kReplacement;
      i = bad > i ? bad : i + 1;
    }
  }
  return i;
}

struct CodeDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};

// The compiled stages of one pre-tokenizer.
struct Splitter {
  std::vector<std::unique_ptr<pcre2_code, CodeDeleter>> stages;

  // Compiles the stages of `def`; throws TokenizerError naming the stage on a compile error.
  explicit Splitter(const PreTokenizerDef& def) {
    for (size_t k = 0; k < kMaxStages && def.stages[k]; ++k) {
      int errcode = 0;
      PCRE2_SIZE erroff = 0;
      pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(def.stages[k]), PCRE2_ZERO_TERMINATED,
                                       PCRE2_UTF | PCRE2_UCP, &errcode, &erroff, nullptr);
      if (!code) {
        PCRE2_UCHAR buf[256];
        pcre2_get_error_message(errcode, buf, sizeof buf);
        throw TokenizerError("pre-tokenizer '" + std::string(def.name) + "' stage " + std::to_string(k) +
                             ": regex compile error at " + std::to_string(erroff) + ": " +
                             reinterpret_cast<char*>(buf));
      }
      pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // best effort: falls back to the interpreter
      stages.emplace_back(code);
    }
  }

  // Per-call matching scratch (match data with one ovector pair: only the whole match is used).
  struct Scratch {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md{pcre2_match_data_create(1, nullptr),
                                                                           &pcre2_match_data_free};
    std::unique_ptr<pcre2_match_context, decltype(&pcre2_match_context_free)> mctx{pcre2_match_context_create(nullptr),
                                                                                   &pcre2_match_context_free};
    std::unique_ptr<pcre2_jit_stack, decltype(&pcre2_jit_stack_free)> jstack{
        pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr), &pcre2_jit_stack_free};
    Scratch() {
      if (!md || !mctx) throw std::bad_alloc();
      if (jstack) pcre2_jit_stack_assign(mctx.get(), nullptr, jstack.get());
    }
  };

  // Splits `piece` with stage `re` into matches and the gaps between them (both kept, in order),
  // appending the non-empty parts to `out`.
  static void split_one(const pcre2_code* re, std::string_view piece, Scratch& sc, std::vector<std::string_view>& out) {
    const auto* subj = reinterpret_cast<PCRE2_SPTR>(piece.data());
    const size_t len = piece.size();
    size_t gap_start = 0, search = 0;
    while (search < len) {
      int rc = pcre2_match(re, subj, len, search, PCRE2_NO_UTF_CHECK, sc.md.get(), sc.mctx.get());
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR buf[256];
        pcre2_get_error_message(rc, buf, sizeof buf);
        throw TokenizerError(std::string("pre-tokenizer regex failed: ") + reinterpret_cast<char*>(buf));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(sc.md.get());
      size_t s = ov[0], e = ov[1];
      if (e == s) {  // empty match (not possible with the built-in patterns): skip one character
        size_t bad = 0;
        bool tr = false;
        size_t n = utf8_seq(piece, s, bad, tr);
        search = s + (n ? n : 1);
        continue;
      }
      if (s > gap_start) out.push_back(piece.substr(gap_start, s - gap_start));
      out.push_back(piece.substr(s, e - s));
      gap_start = search = e;
    }
    if (gap_start < len) out.push_back(piece.substr(gap_start));
  }

  // Runs every stage over the pieces of the previous one; returns views into `text`.
  std::vector<std::string_view> split(std::string_view text, Scratch& sc) const {
    std::vector<std::string_view> cur, next;
    if (!text.empty()) cur.push_back(text);
    for (const auto& re : stages) {
      next.clear();
      for (std::string_view p : cur) split_one(re.get(), p, sc, next);
      cur.swap(next);
    }
    return cur;
  }
};

}  // namespace

std::optional<size_t> find_invalid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t bad = 0;
    bool truncated = false;
    size_t n = utf8_seq(s, i, bad, truncated);
    if (n == 0) return i;
    i += n;
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string model;
  std::string pre;
  std::vector<std::string> tokens;  // stored (byte-level) form
  std::vector<std::string> raw;     // raw bytes of each token
  std::vector<TokenType> types;
  std::unordered_map<std::string, int32_t> token_to_id;  // stored form -> id (first wins)
  struct MergeInfo {
    int32_t rank;
    int32_t result;
  };
  std::unordered_map<uint64_t, MergeInfo> merges;  // (left id << 32 | right id) -> merge
  std::array<int32_t, 256> byte_token{};           // id of the single-byte token, -1 if none
  struct Special {
    std::string text;
    int32_t id;
    bool control;
  };
  std::vector<Special> specials;  // control + user-defined, longest first
  std::array<bool, 256> special_first{};
  std::unique_ptr<const Splitter> splitter;
  int32_t bos = -1, eos = -1;

  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  void bpe(std::string_view piece, std::vector<int32_t>& out) const;
  void pretokenize_and_bpe(std::string_view seg, Splitter::Scratch& sc, std::vector<int32_t>& out) const;
};

namespace {
struct Sym {
  int32_t id;
  int32_t prev;
  int32_t next;
};
struct Cand {
  int32_t rank;
  int32_t left;
  int32_t left_id;
  int32_t right_id;
  int32_t result;
  bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
};
}  // namespace

void Tokenizer::Impl::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  // Whole piece is one token and needs no merging? Still run merges (ignore_merges=false),
  // but a single byte is trivial.
  auto byte_id = [&](size_t i) {
    int32_t id = byte_token[static_cast<unsigned char>(piece[i])];
    if (id < 0)
      throw TokenizerError(
          "no token for byte 0x" + std::string(1, "0123456789abcdef"[static_cast<unsigned char>(piece[i]) >> 4]) +
          std::string(1, "0123456789abcdef"[static_cast<unsigned char>(piece[i]) & 15]) + " in the vocabulary");
    return id;
  };
  if (piece.size() == 1) {
    out.push_back(byte_id(0));
    return;
  }
  thread_local std::vector<Sym> syms;
  syms.clear();
  const auto n = static_cast<int32_t>(piece.size());
  for (int32_t i = 0; i < n; ++i) syms.push_back({byte_id(static_cast<size_t>(i)), i - 1, i + 1 < n ? i + 1 : -1});

  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> pq;
  auto try_add = [&](int32_t l) {
    int32_t r = syms[static_cast<size_t>(l)].next;
    if (l < 0 || r < 0) return;
    int32_t a = syms[static_cast<size_t>(l)].id, b = syms[static_cast<size_t>(r)].id;
    auto it = merges.find(key(a, b));
    if (it == merges.end()) return;
    pq.push({it->second.rank, l, a, b, it->second.result});
  };
  for (int32_t i = 0; i + 1 < n; ++i) try_add(i);
  while (!pq.empty()) {
    Cand c = pq.top();
    pq.pop();
    Sym& L = syms[static_cast<size_t>(c.left)];
    if (L.id != c.left_id || L.next < 0) continue;
    Sym& R = syms[static_cast<size_t>(L.next)];
    if (R.id != c.right_id) continue;
    // merge R into L
    L.id = c.result;
    int32_t rn = R.next;
    L.next = rn;
    if (rn >= 0) syms[static_cast<size_t>(rn)].prev = c.left;
    R.id = -1;  // dead
    if (L.prev >= 0) try_add(L.prev);
    try_add(c.left);
  }
  for (int32_t i = 0; i >= 0; i = syms[static_cast<size_t>(i)].next) out.push_back(syms[static_cast<size_t>(i)].id);
}

void Tokenizer::Impl::pretokenize_and_bpe(std::string_view seg, Splitter::Scratch& sc,
                                          std::vector<int32_t>& out) const {
  for (std::string_view piece : splitter->split(seg, sc)) bpe(piece, out);
}

// ---------------------------------------------------------------------------------------------

Tokenizer Tokenizer::from_vocab(const std::string& model, const std::string& pre, std::vector<std::string> tokens,
                                std::vector<int32_t> types, const std::vector<std::string>& merges, int32_t bos,
                                int32_t eos) {
  if (model != "gpt2") throw TokenizerError("unsupported tokenizer.ggml.model '" + model + "' (supported: gpt2)");
  const std::string pre_eff = pre.empty() ? "gpt2" : pre;
  const PreTokenizerDef* def = find_pre(pre_eff);
  if (!def) throw TokenizerError("unknown pre-tokenizer '" + pre + "' (supported: " + supported_pre_list() + ")");
  if (tokens.empty()) throw TokenizerError("tokenizer vocabulary is empty");
  if (tokens.size() > static_cast<size_t>(INT32_MAX)) throw TokenizerError("tokenizer vocabulary too large");
  if (!types.empty() && types.size() != tokens.size())
    throw TokenizerError("tokenizer.ggml.token_type has " + std::to_string(types.size()) + " entries for " +
                         std::to_string(tokens.size()) + " tokens");
  const auto n_vocab = static_cast<int32_t>(tokens.size());
  for (auto [name, id] : {std::pair{"bos", bos}, std::pair{"eos", eos}})
    if (id < -1 || id >= n_vocab)
      throw TokenizerError(std::string(name) + " token id " + std::to_string(id) + " out of range [0, " +
                           std::to_string(n_vocab) + ")");

  auto impl = std::make_shared<Impl>();
  impl->model = model;
  impl->pre = pre;
  impl->bos = bos;
  impl->eos = eos;
  impl->types.resize(tokens.size(), TokenType::NORMAL);
  for (size_t i = 0; i < types.size(); ++i) impl->types[i] = static_cast<TokenType>(types[i]);

  impl->token_to_id.reserve(tokens.size() * 2);
  impl->raw.resize(tokens.size());
  for (int32_t i = 0; i < n_vocab; ++i) {
    const auto& t = tokens[static_cast<size_t>(i)];
    impl->token_to_id.emplace(t, i);
    TokenType ty = impl->types[static_cast<size_t>(i)];
    if (ty == TokenType::CONTROL || ty == TokenType::USER_DEFINED) {
      impl->raw[static_cast<size_t>(i)] = t;
      if (!t.empty()) {
        impl->specials.push_back({t, i, ty == TokenType::CONTROL});
        impl->special_first[static_cast<unsigned char>(t[0])] = true;
      }
    } else {
      impl->raw[static_cast<size_t>(i)] = byte_decode(t);
    }
  }
  std::stable_sort(impl->specials.begin(), impl->specials.end(),
                   [](const Impl::Special& a, const Impl::Special& b) { return a.text.size() > b.text.size(); });

  const auto& bm = byte_map();
  for (int b = 0; b < 256; ++b) {
    auto it = impl->token_to_id.find(bm.enc[static_cast<size_t>(b)]);
    impl->byte_token[static_cast<size_t>(b)] = it == impl->token_to_id.end() ? -1 : it->second;
  }

  impl->merges.reserve(merges.size() * 2);
  for (size_t r = 0; r < merges.size(); ++r) {
    const std::string& m = merges[r];
    size_t sp = m.find(' ', 1);
    auto bad = [&](const std::string& why) {
      return TokenizerError("bad merge #" + std::to_string(r) + " '" + m + "': " + why);
    };
    if (sp == std::string::npos || sp + 1 >= m.size()) throw bad("expected 'left right'");
    std::string left = m.substr(0, sp), right = m.substr(sp + 1);
    auto li = impl->token_to_id.find(left);
    auto ri = impl->token_to_id.find(right);
    auto mi = impl->token_to_id.find(left + right);
    if (li == impl->token_to_id.end()) throw bad("'" + left + "' is not in the vocabulary");
    if (ri == impl->token_to_id.end()) throw bad("'" + right + "' is not in the vocabulary");
    if (mi == impl->token_to_id.end()) throw bad("'" + left + right + "' is not in the vocabulary");
    // the first (lowest-rank) occurrence of a pair wins
    impl->merges.emplace(Impl::key(li->second, ri->second), Impl::MergeInfo{static_cast<int32_t>(r), mi->second});
  }
  impl->tokens = std::move(tokens);

  impl->splitter = std::make_unique<const Splitter>(*def);

  Tokenizer t;
  t.impl_ = std::move(impl);
  return t;
}

Tokenizer Tokenizer::from_gguf(const gguf::File& f) {
  const std::string model = f.get_string("tokenizer.ggml.model", "");
  if (model.empty()) throw TokenizerError(f.path() + ": no tokenizer.ggml.model");
  if (model != "gpt2")
    throw TokenizerError(f.path() + ": unsupported tokenizer.ggml.model '" + model + "' (supported: gpt2)");
  const std::string pre = f.get_string("tokenizer.ggml.pre", "gpt2");
  if (!f.has("tokenizer.ggml.tokens")) throw TokenizerError(f.path() + ": no tokenizer.ggml.tokens");
  std::vector<std::string> tokens = f.get_string_array("tokenizer.ggml.tokens");
  std::vector<int32_t> types;
  if (f.has("tokenizer.ggml.token_type")) {
    for (int64_t v : f.get_int_array("tokenizer.ggml.token_type")) types.push_back(static_cast<int32_t>(v));
  }
  std::vector<std::string> merges;
  if (f.has("tokenizer.ggml.merges")) merges = f.get_string_array("tokenizer.ggml.merges");
  if (merges.empty() && tokens.size() > 256)
    throw TokenizerError(f.path() + ": no tokenizer.ggml.merges (pre-tokenizer '" + pre +
                         "'): byte-level BPE without merges would only produce single bytes");
  auto id_or_none = [&](const char* key) -> int32_t {
    const int64_t v = f.get_int(key, -1);
    if (v < -1 || v > INT32_MAX)
      throw TokenizerError(f.path() + ": key '" + key + "' = " + std::to_string(v) + " is not a token id");
    return static_cast<int32_t>(v);
  };
  try {
    return from_vocab(model, pre, std::move(tokens), std::move(types), merges,
                      id_or_none("tokenizer.ggml.bos_token_id"), id_or_none("tokenizer.ggml.eos_token_id"));
  } catch (const TokenizerError& e) {
    throw TokenizerError(f.path() + ": " + e.what());
  }
}

// ---------------------------------------------------------------------------------------------

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  if (auto bad = find_invalid_utf8(text)) throw TokenizerError("invalid UTF-8 at byte " + std::to_string(*bad));
  const Impl& im = *impl_;
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);

  Splitter::Scratch sc;

  size_t seg_start = 0;
  if (!im.specials.empty()) {
    size_t i = 0;
    while (i < text.size()) {
      if (im.special_first[static_cast<unsigned char>(text[i])]) {
        const Impl::Special* hit = nullptr;
        for (const auto& sp : im.specials) {
          if (sp.control && !parse_special) continue;
          if (text.compare(i, sp.text.size(), sp.text) == 0) {
            hit = &sp;
            break;
          }
        }
        if (hit) {
          if (i > seg_start) im.pretokenize_and_bpe(text.substr(seg_start, i - seg_start), sc, out);
          out.push_back(hit->id);
          i += hit->text.size();
          seg_start = i;
          continue;
        }
      }
      ++i;
    }
  }
  if (seg_start < text.size()) im.pretokenize_and_bpe(text.substr(seg_start), sc, out);
  return out;
}

const std::string& Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= n_vocab())
    throw std::out_of_range("token id " + std::to_string(id) + " out of range [0, " + std::to_string(n_vocab()) + ")");
  return impl_->raw[static_cast<size_t>(id)];
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += token_bytes(id);
  return out;
}

int32_t Tokenizer::n_vocab() const { return static_cast<int32_t>(impl_->raw.size()); }
int32_t Tokenizer::eos_id() const { return impl_->eos; }
int32_t Tokenizer::bos_id() const { return impl_->bos; }

TokenType Tokenizer::type(int32_t id) const {
  if (id < 0 || id >= n_vocab())
    throw std::out_of_range("token id " + std::to_string(id) + " out of range [0, " + std::to_string(n_vocab()) + ")");
  return impl_->types[static_cast<size_t>(id)];
}

bool Tokenizer::is_control(int32_t id) const {
  return id >= 0 && id < n_vocab() && impl_->types[static_cast<size_t>(id)] == TokenType::CONTROL;
}

std::optional<int32_t> Tokenizer::find_token(std::string_view text) const {
  for (const auto& sp : impl_->specials)
    if (sp.text == text) return sp.id;
  auto it = impl_->token_to_id.find(byte_encode(text));
  if (it != impl_->token_to_id.end()) {
    TokenType ty = impl_->types[static_cast<size_t>(it->second)];
    if (ty != TokenType::CONTROL && ty != TokenType::USER_DEFINED) return it->second;
  }
  return std::nullopt;
}

const std::string& Tokenizer::pre_name() const { return impl_->pre; }

std::vector<std::string> pre_tokenize(const std::string& pre, std::string_view text) {
  const PreTokenizerDef* def = find_pre(pre.empty() ? "gpt2" : pre);
  if (!def) throw TokenizerError("unknown pre-tokenizer '" + pre + "' (supported: " + supported_pre_list() + ")");
  if (auto bad = find_invalid_utf8(text)) throw TokenizerError("invalid UTF-8 at byte " + std::to_string(*bad));
  const Splitter splitter(*def);
  Splitter::Scratch sc;
  std::vector<std::string> out;
  for (std::string_view p : splitter.split(text, sc)) out.emplace_back(p);
  return out;
}

std::vector<std::string> supported_pre_tokenizers() {
  std::vector<std::string> v;
  for (const auto& d : kPreTokenizers) v.emplace_back(d.name);
  return v;
}

// ---------------------------------------------------------------------------------------------

StreamDecoder::StreamDecoder(const Tokenizer& tok) : tok_(&tok) {}

std::string StreamDecoder::push(int32_t id) {
  pending_ += tok_->token_bytes(id);
  std::string out;
  size_t used = sanitize_utf8(pending_, /*hold_tail=*/true, out);
  pending_.erase(0, used);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  sanitize_utf8(pending_, /*hold_tail=*/false, out);
  pending_.clear();
  return out;
}

}  // namespace strata::tokenizer
