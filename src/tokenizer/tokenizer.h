#pragma once
// Byte-level BPE tokenizer (GPT-2 style) built from GGUF metadata.
//
// Pipeline of encode(): validate UTF-8 -> split on special tokens -> pre-tokenize each
// remaining segment with the model's sequence of split regexes (PCRE2, UTF + UCP) -> map bytes to the GPT-2
// printable-unicode alphabet -> BPE merges by rank within each piece -> token ids.
// Matches the Hugging Face `tokenizers` output for the supported pre-tokenizers.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace strata::gguf {
class File;
}

namespace strata::tokenizer {

/// Thrown for unsupported or malformed tokenizer metadata and for invalid input text.
class TokenizerError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// GGUF token types (tokenizer.ggml.token_type), as in llama.cpp's llama_token_type.
enum class TokenType : int32_t {
  UNDEFINED = 0,
  NORMAL = 1,
  UNKNOWN = 2,
  CONTROL = 3,
  USER_DEFINED = 4,
  UNUSED = 5,
  BYTE = 6,
};

/// An immutable byte-level BPE tokenizer. Cheap to copy (shares its tables); thread-safe to use.
class Tokenizer {
 public:
  /// Builds the tokenizer from the `tokenizer.ggml.*` keys of a GGUF file
  /// (model, pre, tokens, token_type, merges, bos_token_id, eos_token_id).
  /// Throws TokenizerError for an unsupported tokenizer.ggml.model (only "gpt2"), an unknown
  /// pre-tokenizer name, a missing vocabulary, or bad merges; see from_vocab.
  static Tokenizer from_gguf(const gguf::File& f);

  /// Builds the tokenizer from plain vectors (what from_gguf reads from the file).
  ///  - model: must be "gpt2" (byte-level BPE).
  ///  - pre: pre-tokenizer name (`tokenizer.ggml.pre`), one of supported_pre_tokenizers():
  ///    qwen2, deepseek-r1-qwen, qwen35, llama-bpe, llama3, glm4, chatglm-bpe, gpt2, gpt-2, mpt,
  ///    gpt-4o, minimax-m2, kimi-k2, deepseek-v3, deepseek-llm, deepseek-coder, falcon, starcoder,
  ///    refact; "" is treated as "gpt2". Anything else throws
  ///    "unknown pre-tokenizer 'x' (supported: qwen2, ...)".
  ///  - tokens: vocabulary in byte-level form (e.g. "Ġworld"); special tokens are literal text.
  ///  - types: one TokenType value per token, or empty for all NORMAL; other sizes throw.
  ///  - merges: "left right" strings in rank order; a merge without the separating space or whose
  ///    left, right or merged form is not in the vocabulary throws TokenizerError ("bad merge ...").
  ///  - bos, eos: token ids, or -1 when absent; out-of-range ids throw.
  static Tokenizer from_vocab(const std::string& model, const std::string& pre, std::vector<std::string> tokens,
                              std::vector<int32_t> types, const std::vector<std::string>& merges, int32_t bos,
                              int32_t eos);

  /// Encodes `text` (UTF-8) into token ids. No BOS is added.
  /// User-defined tokens (type 4) found in the text always become their ids; control tokens
  /// (type 3) do so only when `parse_special` is true, otherwise their text is encoded as
  /// ordinary text. Matching is leftmost, longest token first.
  /// Throws TokenizerError("invalid UTF-8 at byte N") when `text` is not valid UTF-8
  /// (N = 0-based offset where the first invalid or truncated sequence starts).
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;

  /// The raw bytes token `id` stands for: byte-level decoded for normal tokens, the literal
  /// text for control / user-defined tokens. Throws std::out_of_range for a bad id.
  const std::string& token_bytes(int32_t id) const;

  /// The concatenated token_bytes of `ids` (control tokens included as their text). The result
  /// may end with (or contain) partial UTF-8; use StreamDecoder for display.
  /// Throws std::out_of_range for a bad id.
  std::string decode(std::span<const int32_t> ids) const;

  /// Vocabulary size.
  int32_t n_vocab() const;
  /// End-of-sequence token id, or -1 if the model has none.
  int32_t eos_id() const;
  /// Beginning-of-sequence token id, or -1 if the model has none.
  int32_t bos_id() const;
  /// The token's type (TokenType::NORMAL when types were not given). Throws std::out_of_range.
  TokenType type(int32_t id) const;
  /// True if `id` is a control token (type 3). False for out-of-range ids.
  bool is_control(int32_t id) const;
  /// The id of the token whose raw text (token_bytes) is exactly `text`, preferring control /
  /// user-defined tokens; e.g. find_token("<|im_end|>"), find_token(" world").
  std::optional<int32_t> find_token(std::string_view text) const;
  /// The pre-tokenizer name as given (e.g. "qwen2").
  const std::string& pre_name() const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

/// Streaming decoder: feed ids one by one, get back only complete UTF-8. A trailing partial
/// sequence is held back until it completes; bytes that can never form valid UTF-8 are
/// replaced by U+FFFD (one per maximal invalid subpart, as in the WHATWG decoder).
/// flush() returns whatever is held back (an incomplete tail becomes U+FFFD) and resets.
/// The Tokenizer must outlive the decoder.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok);
  /// Appends the bytes of `id`; returns the newly completed valid UTF-8 text (may be empty).
  std::string push(int32_t id);
  /// Returns the held-back bytes with invalid/incomplete sequences replaced by U+FFFD.
  std::string flush();

 private:
  const Tokenizer* tok_;
  std::string pending_;
};

/// Pre-tokenizes `text` (UTF-8) as pre-tokenizer `pre` does inside Tokenizer::encode (no
/// special-token handling): each of the pre-tokenizer's split regexes in turn cuts every piece
/// into its matches and the gaps between them. Returns the pieces as raw text, in order; their
/// concatenation is `text`. Throws TokenizerError for an unknown `pre` (the message names it and
/// lists the supported ones) or invalid UTF-8. Compiles the regexes on every call (for tests and
/// tools, not for hot paths).
std::vector<std::string> pre_tokenize(const std::string& pre, std::string_view text);

/// The pre-tokenizer names from_vocab accepts, in the order the error message lists them.
std::vector<std::string> supported_pre_tokenizers();

/// Checks that `s` is valid UTF-8 (no overlongs, surrogates or code points above U+10FFFF).
/// Returns the offset where the first invalid (or truncated) sequence starts, or std::nullopt.
std::optional<size_t> find_invalid_utf8(std::string_view s);

}  // namespace strata::tokenizer
