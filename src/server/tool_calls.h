#pragma once
// Tool calls in model output: the markup each chat family writes when it calls a function,
// parsed into OpenAI tool calls (name + JSON arguments), whole or streamed.
//
// Formats (see the families' chat templates in ../shared/data/templates):
//  - Hermes: `<tool_call>{"name": N, "arguments": {...}}</tool_call>` (Qwen3, Hermes 2/3), and
//    Qwen3.5 / Qwen3-Coder's `<tool_call><function=N><parameter=K>V</parameter>...</function>
//    </tool_call>` in the same tags.
//  - Harmony (gpt-oss): `<|channel|>commentary to=functions.N <|constrain|>json<|message|>ARGS<|call|>`
//    and `<|start|>assistant to=functions.N<|channel|>commentary json<|message|>ARGS<|call|>`;
//    <|call|> ends generation, so a call may also end at the end of the output. Messages of
//    the other channels: `<|channel|>analysis<|message|>TEXT<|end|>` is reasoning (OpenAI's
//    harmony guide: chain of thought, not for the user), `final` and `commentary` without a
//    recipient are content; their headers (also after `<|start|>assistant`) and `<|end|>` are
//    dropped. A header with another role or channel, or more than the channel name, is text.
//  - DeepSeek: `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>N<｜tool▁sep｜>ARGS
//    <｜tool▁call▁end｜>` (V3.1/V3.2) or `<｜tool▁call▁begin｜>function<｜tool▁sep｜>N\n```json\nARGS
//    \n```<｜tool▁call▁end｜>` (V3/R1), then `<｜tool▁calls▁end｜>`.
//  - GLM (4.5/4.6): `<tool_call>N\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>...</tool_call>`;
//    a value is JSON when it parses as JSON, else the raw string.
// A block that opens like a call but does not parse (bad JSON, no name, no closer at the end)
// is returned as content text, byte for byte: nothing the model wrote is dropped, except
// whitespace-only text next to tool calls.
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace strata::server::tools {

enum class Format { None, Hermes, Harmony, DeepSeek, Glm };

/// The format a chat template teaches, from its source text: DeepSeek when it has
/// <｜tool▁calls▁begin｜>, GLM when <arg_key>, Harmony when <|channel|> and to=functions,
/// Hermes when <tool_call>; else None (tool-call output is then left as text).
Format detect_format(std::string_view template_source);

/// "hermes", "harmony", "deepseek", "glm" or "none".
const char* format_name(Format f);

/// One parsed call. `arguments` is JSON text of an object (OpenAI sends it as a string).
struct ToolCall {
  std::string name;
  std::string arguments;
};

/// A piece of a streamed tool call (StreamParser with `incremental`): the call's `index`
/// among the response's calls; the first piece of a call has `first` set and carries its
/// name; the `arguments` of a call's pieces concatenate to its arguments text.
struct CallPiece {
  size_t index = 0;
  bool first = false;
  std::string name;       // when `first`
  std::string arguments;  // the next bytes of the arguments text (may be empty)
};

/// What a piece of output adds: content text, reasoning text (harmony's analysis channel;
/// llama.cpp's and DeepSeek's API field `reasoning_content`) and whole tool calls (in order),
/// or, from an incremental StreamParser, pieces of calls.
struct Delta {
  std::string content;
  std::string reasoning;
  std::vector<ToolCall> calls;
  std::vector<CallPiece> pieces;
};

/// Incremental parser: push() the output text as it is generated, finish() once at the end.
/// The concatenation of all deltas does not depend on how the text was split (tested at
/// every byte boundary). Text that may still become a call is held back until it is decided.
class StreamParser {
 public:
  /// `calls` false: tool-call markup stays text (the request had no tools); harmony's channels
  /// are still parsed. `incremental`: calls come as Delta::pieces (never Delta::calls), and a
  /// harmony call's arguments stream as they are generated: once its header names a valid
  /// function and its arguments begin as a JSON object, the call opens (a first piece with
  /// the name) and each push adds the arguments decided so far (its text with leading
  /// whitespace dropped and trailing whitespace and a possible `<|call|>` prefix held back,
  /// while it is a valid prefix of a JSON object). Other formats send each call as one piece
  /// when it is complete. A call that opened and then does not parse (invalid JSON further
  /// on, text after the object, the output ending inside it) cannot be taken back: its
  /// markup is then content, byte for byte as without streaming, and it is not counted in
  /// n_calls(); its pieces stay a prefix of its argument text.
  explicit StreamParser(Format f, bool calls = true, bool incremental = false)
      : format_(f), calls_(calls), incremental_(incremental) {}
  /// Appends generated text; returns what is now decided.
  Delta push(std::string_view text);
  /// The end of the output: decides what is held back (an open block is parsed as a call when
  /// it is complete but for its closer, else returned as text).
  Delta finish();
  /// Calls returned so far (complete ones: not a call that opened and then failed to parse).
  size_t n_calls() const { return n_calls_; }

 private:
  void run(bool at_end, Delta& out);
  void emit_text(std::string_view s, Delta& out);
  void emit_call(ToolCall c, Delta& out);
  void stream_open_call(Delta& out);

  Format format_;
  bool calls_ = true;
  bool incremental_ = false;
  size_t next_index_ = 0;   // incremental: the index of the next call
  bool open_ = false;       // incremental: buf_'s call has opened (its first piece was sent)
  std::string sent_;        // incremental: the open call's arguments sent so far
  bool reasoning_ = false;  // harmony: text goes to Delta::reasoning (in an analysis message)
  std::string buf_;         // undecided text
  bool in_block_ = false;   // buf_ starts with an opener
  std::string pending_ws_;  // whitespace-only text, dropped if a call follows
  size_t n_calls_ = 0;
};

/// The whole output at once: StreamParser's push(text) then finish(), merged.
Delta parse(Format f, std::string_view text, bool calls = true);

}  // namespace strata::server::tools
