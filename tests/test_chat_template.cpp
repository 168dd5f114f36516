// The Jinja subset interpreter and chat templates, checked against Python's jinja2 set up as
// transformers' apply_chat_template does (the oracle; tests skip, saying so, without it).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "chat/chat_template.h"
#include "chat/jinja.h"
#include "chat/json_depth.h"
#include "gguf/gguf.h"
#include "support/paths.h"
#include "tokenizer/tokenizer.h"

using strata::chat::ChatTemplate;
using strata::chat::RenderError;
using strata::chat::Template;
using strata::chat::TemplateError;
using J = nlohmann::ordered_json;

namespace {

// transformers' chat-template environment (transformers/utils/chat_template_utils.py).
const char* kOracle = R"PY(
import json, sys
from datetime import datetime
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.ext import loopcontrols, Extension
from jinja2 import nodes
from jinja2.exceptions import TemplateError

def raise_exception(message):
    raise TemplateError(message)

def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

class AssistantTracker(Extension):  # transformers' {% generation %}: renders its body
    tags = {"generation"}
    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)
    def _render(self, caller):
        return caller()

env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, AssistantTracker])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
out = []
compiled = {}  # template source -> Template (or the exception compiling it raised)
def compile(src):
    if src not in compiled:
        try:
            compiled[src] = env.from_string(src)
        except Exception as e:
            compiled[src] = e
    if isinstance(compiled[src], Exception):
        raise compiled[src]
    return compiled[src]
for case in json.load(open(sys.argv[1])):
    try:
        out.append({"ok": compile(case["template"]).render(**case["context"])})
    except Exception as e:
        out.append({"error": type(e).__name__ + ": " + str(e)})
json.dump(out, open(sys.argv[2], "w"), ensure_ascii=False)
)PY";

bool have_jinja2() { return std::system("python3 -c 'import jinja2' >/dev/null 2>&1") == 0; }

// Renders every case with python's jinja2; returns one {"ok": text} or {"error": msg} per case.
J oracle(const J& cases) {
  const auto dir = std::filesystem::temp_directory_path() / ("strata_jinja_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "oracle.py") << kOracle;
  std::ofstream(dir / "cases.json") << cases.dump();
  const std::string cmd = "python3 " + (dir / "oracle.py").string() + " " + (dir / "cases.json").string() + " " +
                          (dir / "out.json").string();
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(dir / "out.json");
  J out = J::parse(in);
  std::filesystem::remove_all(dir);
  return out;
}

std::string shipped_template() {
  auto f = strata::gguf::File::open(strata::test::shipped_model());
  return f.get_string("tokenizer.chat_template");
}

// A Qwen3-style template without the tool branches' bodies trimmed: thinking blocks,
// namespace, reverse iteration, string methods, `is string`, `is defined`.
const char* kQwen3 = R"J({%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %})J";

// Llama-3 style: system message pulled out with a slice, `| trim` binding tighter than `+`.
const char* kLlama3 = R"J({{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
)J";

// Mistral style: strict alternation enforced with raise_exception.
const char* kMistral = R"J({%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
)J";

// Gemma style: no system role, 'model' for the assistant, one line, no whitespace control.
const char* kGemma =
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif "
    "%}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ "
    "raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if "
    "(message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif "
    "%}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if "
    "add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}";

// Everything else templates use, and the whitespace rules without dashes (trim_blocks and
// lstrip_blocks), indented blocks, comments, macros, filters, tests and printing of values.
const char* kSoup = R"J({# a comment at the top #}
{% macro turn(role, text, sep='\n') %}<{{ role|upper }}>{{ sep }}{{ text }}</{{ role }}>{% endmacro %}
{% set ns = namespace(n=0, roles=[]) %}
  {% for m in messages if m.role != 'system' %}
    {% set ns.n = ns.n + 1 %}
    {{ loop.index }}/{{ loop.length }} {{ loop.revindex0 }}{% if loop.first %} first{% endif %}{% if loop.last %} last{% endif %}
 prev={{ loop.previtem.role if loop.previtem is defined else 'none' }}
    {{ turn(m.role, m.content | trim) }}
    {% if m.role == 'assistant' and '</think>' in m.content %}
      thought={{ m.content.split('</think>')[0].replace('<think>', '').strip() | length }}
    {% elif m.role not in ['user', 'assistant'] %}
      odd role {{ m.role | title }}
    {% else %}
      words={{ m.content.split() | length }} first={{ m.content[:5] ~ '|' ~ m.content[-3:] }}
    {% endif %}
  {% else %}
    no messages
  {% endfor %}
count={{ ns.n }} sys={{ messages | selectattr('role', 'equalto', 'system') | list | length }}
roles={{ messages | map(attribute='role') | join(',') }} uniq={{ messages | map(attribute='role') | unique | list }}
{% set d = {'b': 1, 'a': [1, 2.5, none, true, 'x'], 'c': {'k': "q'uote"}} %}
{{ d | tojson }} {{ d | tojson(indent=2) }} {{ d.a }} {{ d.c }} {{ d.items() | list }}
{% for k, v in d | dictsort %}{{ k }}={{ v }};{% endfor %}
{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1e20 }} {{ 0.1 + 0.2 }} {{ 3.0 }} {{ 1/3 }}
{{ 'abc' if messages | length > 2 else 'xyz' }} {{ none }} {{ undefined_thing }}|{{ undefined_thing | default('dflt') }}
{{ [1, 2, 3][::-1] }} {{ 'hello'[1:-1] }} {{ range(3) | list }} {{ range(1, 10, 3) | list }} {{ (1, 'a') }}
{% for i in range(10) %}{% if i is even %}{% continue %}{% endif %}{% if i > 6 %}{% break %}{% endif %}{{ i }}{% endfor %}
{{ 'a,b,,c'.split(',') }} {{ '  x y  '.split() }} {{ 'x'.join(['1', '2']) }} {{ 'Hello'.startswith(('He', 'x')) }}
{{ 1 < 2 < 3 }} {{ 3 > 2 > 5 }} {{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in d.c }} {{ x is not defined }}
{{ "line1\nline2\n\nline3" | indent(2) }}
{{ messages | last | tojson }} {{ (messages | first).role | capitalize }} {{ -3 | abs }} {{ '42' | int + 1 }}
{%- if add_generation_prompt +%}
  gen
{%+ endif -%}
   tail   )J";

// Integer dict keys (ByteDance-Seed-OSS's budget table), the sort filter and str.format.
const char* kKeysSortFormat = R"J({% set g = {0: 'zero', 512: 'a', 16384: 'top', 2048: 'b', -1: 'neg', none: 'n'} %}
{{ g }} {{ g[512] }} {{ g[16384.0] }} {{ g[none] }} {{ 512 in g }} {{ '512' in g }} {{ g.get(2048) }} {{ g | tojson }}
{% for k, v in g | dictsort if k is not none %}{{ k }}:{{ v }},{% endfor %} {{ g.keys() | list }}
{% set b = {1: 'one'} %}{% set b2 = {true: 'yes'} %}{{ b[true] }} {{ b2[1] }} {{ b2 }}
{{ messages | map(attribute='content') | sort | list }}
{{ messages | sort(attribute='role') | map(attribute='role') | join(',') }}
{{ messages | sort(attribute='role,content', reverse=true) | map(attribute='role') | join(',') }}
{{ ['b', 'A', 'a', 'C'] | sort }} {{ ['b', 'A', 'a', 'C'] | sort(case_sensitive=true) }} {{ [3, 1, 2] | sort(true) }}
{{ '{} says {}: {{x}} {!r}'.format(messages[0].role, 42, 'q') }} {{ '{1}-{0}-{1}'.format('a', 2.5) }}
{{ '<{who}> {n}'.format(who=messages | length, n=none) }}
{{ "<b>'"|safe + messages[0].role + '"&' }} {{ '<i>' + "x"|safe }} {{ ('a'|safe + 'b') + '<' }}
{{ none | selectattr('type', 'equalto', 'x') | list }} {{ none | reject | list }} {{ none | map(attribute='a') | list }}
)J";

J message_sets() {
  J sys = {{"role", "system"}, {"content", "You are terse.  "}};
  J u1 = {{"role", "user"}, {"content", "Write a function that reads lines."}};
  J a1 = {{"role", "assistant"},
          {"content", "<think>\nThe user wants code.\n</think>\n\ndef read_lines(p):\n    pass"}};
  J u2 = {{"role", "user"}, {"content", "  héllo 🌍 \"quoted\" and 'single'\n\twith tabs  "}};
  J a2 = {{"role", "assistant"}, {"content", "Sure."}};
  return J::array({J::array({u1}), J::array({sys, u1}), J::array({sys, u1, a2, u2}), J::array({u1, a1, u2}),
                   J::array({sys, u1, a1}), J::array({u1, u2}) /* breaks alternation */,
                   J::array({{{"role", "user"}, {"content", ""}}})});
}

struct Case {
  std::string name, tmpl;
  J context;
};

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  const std::vector<std::pair<std::string, std::string>> templates = {{"shipped-chatml", shipped_template()},
                                                                      {"qwen3", kQwen3},
                                                                      {"llama3", kLlama3},
                                                                      {"mistral", kMistral},
                                                                      {"gemma", kGemma},
                                                                      {"soup", kSoup},
                                                                      {"keys-sort-format", kKeysSortFormat}};
  const J sets = message_sets();
  for (auto& [name, t] : templates)
    for (size_t k = 0; k < sets.size(); ++k)
      for (bool gen : {true, false}) {
        J ctx = {{"messages", sets[k]}, {"add_generation_prompt", gen}, {"bos_token", "<s>"}, {"eos_token", "</s>"}};
        cases.push_back({name + "/set" + std::to_string(k) + (gen ? "/gen" : ""), t, ctx});
      }
  J ctx = {{"messages", sets[3]}, {"add_generation_prompt", true}, {"enable_thinking", false}};
  cases.push_back({"qwen3/no-thinking", kQwen3, ctx});
  J tools = J::array({{{"type", "function"},
                       {"function",
                        {{"name", "get_weather"},
                         {"description", "Weather <now> & later"},
                         {"parameters", {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}});
  ctx = {{"messages", sets[2]}, {"add_generation_prompt", true}, {"tools", tools}};
  cases.push_back({"qwen3/tools", kQwen3, ctx});
  return cases;
}

}  // namespace

TEST(ChatTemplate, MatchesPythonJinja2) {
  if (!have_jinja2()) GTEST_SKIP() << "python3 with jinja2 absent (apt-get install python3-jinja2): oracle unavailable";
  const std::vector<Case> cases = all_cases();
  J in = J::array();
  for (auto& c : cases) in.push_back({{"template", c.tmpl}, {"context", c.context}});
  const J want = oracle(in);
  ASSERT_EQ(want.size(), cases.size());
  int compared = 0, errors = 0;
  for (size_t k = 0; k < cases.size(); ++k) {
    SCOPED_TRACE(cases[k].name);
    const Template t(cases[k].tmpl);
    if (want[k].contains("error")) {
      ++errors;
      try {
        const std::string got = t.render(cases[k].context);
        ADD_FAILURE() << "jinja2 failed (" << want[k]["error"].get<std::string>() << ") but we rendered:\n" << got;
      } catch (const RenderError& e) {
        const std::string py = want[k]["error"].get<std::string>();
        if (py.rfind("TemplateError: ", 0) == 0) {  // raise_exception: same message
          EXPECT_EQ(std::string(e.what()), py.substr(15));
        }
      }
      continue;
    }
    std::string got;
    ASSERT_NO_THROW(got = t.render(cases[k].context));
    EXPECT_EQ(got, want[k]["ok"].get<std::string>());
    ++compared;
  }
  EXPECT_GT(compared, 50);
  EXPECT_GT(errors, 3);  // the alternation and system-role checks fire in both engines
}

TEST(ChatTemplate, WhitespaceRulesMatchPython) {
  if (!have_jinja2()) GTEST_SKIP() << "python3 with jinja2 absent (apt-get install python3-jinja2): oracle unavailable";
  const std::vector<std::string> snippets = {
      "a\n  {% if true %}\n    b\n  {% endif %}\nc\n",
      "  {%- if true -%}  x  {%- endif -%}  \n",
      "{% for i in [1,2] %}\n{{ i }}\n{% endfor %}\n",
      "x {# c #}\n  {# d #}\ny",
      "  {%+ if true %}k{% endif +%}\nz",
      "{{ 'a' }}\n{{- 'b' -}}\n   {{ 'c' }}",
      "  {{ 'v' }}  {% set z = 1 %}\n{{ z }}",
      "{% for i in [1] %}{% set y = i %}{% endfor %}[{{ y }}]",
      "{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = x + i %}{{ x }}{% endfor %}{{ x }}",
      "{% if true %}{% set w = 5 %}{% endif %}{{ w }}",
      "{% set blk %}  in block {{ 1 + 1 }}\n{% endset %}[{{ blk }}]",
      "{{ '%}' }} {{ \"}}\" }}",
      "{{ [1, 'a', none, 1.5, {'k': [true]}] | tojson }} {{ 'caf\\u00e9' }} {{ '\\n' | tojson }}",
      "{% macro a(x) %}[{{ b(x) }}]{% endmacro %}{% macro b(y) %}<{{ y }}>{% endmacro %}{{ a(3) }}",
      "{% for i in [1, 2] %}{% generation %}\n  g{{ i }}\n{% endgeneration %}{% endfor %}",
      "{% filter trim | upper %}\n  ab {{ 'c' }}  \n{% endfilter %}!{%- filter replace('a', 'b') -%} aaa {%- endfilter "
      "%}",
  };
  J in = J::array();
  for (auto& s : snippets) in.push_back({{"template", s}, {"context", J::object()}});
  const J want = oracle(in);
  for (size_t k = 0; k < snippets.size(); ++k) {
    SCOPED_TRACE(snippets[k]);
    ASSERT_TRUE(want[k].contains("ok")) << want[k].dump();
    EXPECT_EQ(Template(snippets[k]).render(J::object()), want[k]["ok"].get<std::string>());
  }
}

TEST(ChatTemplate, UnsupportedConstructsFailAtParse) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{% include 'x.j2' %}", "unsupported tag 'include'"},
      {"{{ x | frobnicate }}", "unsupported filter 'frobnicate'"},
      {"{{ x.zfill(3) }}", "unsupported method 'zfill()'"},
      {"{{ cycler(1, 2) }}", "unsupported function 'cycler()'"},
      {"{% if x is prime %}{% endif %}", "unsupported test 'prime'"},
      {"{% for x in y %}", "missing 'endfor'"},
      {"{% if x %}{% endfor %}", "unexpected 'endfor'"},
      {"{{ 'abc }}", "unclosed '{{' tag"},
      {"{% break %}", "outside a loop"},
      {"{{ x ! y }}", "unexpected character"},
  };
  for (auto& [src, msg] : bad) {
    try {
      Template t(src);
      ADD_FAILURE() << "no error for " << src;
    } catch (const TemplateError& e) {
      EXPECT_NE(std::string(e.what()).find(msg), std::string::npos) << src << " -> " << e.what();
    }
  }
  // ChatTemplate also renders a sample conversation at load: a template that always raises fails there.
  EXPECT_THROW(ChatTemplate("{{ raise_exception('nope') }}", "", ""), TemplateError);
  EXPECT_THROW(ChatTemplate("{{ messages[0].content + 1 }}", "", ""), TemplateError);
}

// list.append / list.pop (jinja2's immutable sandbox refuses them, so no oracle here) and from_json: Python's
// semantics, the list shared by every name bound to it.
TEST(ChatTemplate, ListAppendPopAndFromJson) {
  EXPECT_EQ(Template(
                "{% set l = [1] %}{% set m = l %}{% set _ = m.append(2) %}{{ l }}|{{ l.pop(0) }}|{{ l.pop() }}|{{ l }}")
                .render(J::object()),
            "[1, 2]|1|2|[]");
  EXPECT_EQ(Template("{% set l = ['a', 'b', 'c'] %}{{ l.pop(-2) }}{{ l }}").render(J::object()), "b['a', 'c']");
  EXPECT_THROW(Template("{% set l = [] %}{{ l.pop() }}").render(J::object()), RenderError);
  EXPECT_THROW(Template("{% set l = [1] %}{{ l.pop(5) }}").render(J::object()), RenderError);
  EXPECT_THROW(Template("{{ b() }}{% macro a() %}{% endmacro %}"), TemplateError);  // b is never defined
  // from_json (not a jinja2 builtin either): json.loads.
  EXPECT_EQ(Template("{% set d = '{\"b\": [1, 2.5, null, \"x\"]}' | from_json %}{{ d.b }}").render(J::object()),
            "[1, 2.5, None, 'x']");
  EXPECT_THROW(Template("{{ '{bad' | from_json }}").render(J::object()), RenderError);
  EXPECT_THROW(Template("{{ 3 | from_json }}").render(J::object()), RenderError);
}

TEST(ChatTemplate, RunawayRecursionAndDeepJsonAreErrorsNotCrashes) {
  // A macro that calls itself without end: the 65th nested call is refused (it used to recurse
  // until the stack ran out: a template in a downloaded GGUF could crash chat and serve).
  try {
    Template("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").render(J::object());
    FAIL() << "no error";
  } catch (const RenderError& e) {
    EXPECT_NE(std::string(e.what()).find("macro recursion too deep"), std::string::npos) << e.what();
  }
  // Legitimate recursion below the cap still renders, and the count resets between renders.
  const std::string count = "{% macro c(n) %}{% if n > 0 %}{{ n }}{{ c(n - 1) }}{% endif %}{% endmacro %}{{ c(60) }}";
  for (int round = 0; round < 2; ++round) EXPECT_EQ(Template(count).render(J::object()).substr(0, 4), "6059");
  // JSON nested 300 levels in the context (and through from_json): an error, not a stack overflow.
  std::string deep;
  for (int i = 0; i < 300; ++i) deep += "[";
  for (int i = 0; i < 300; ++i) deep += "]";
  const J ctx = J::object({{"x", J::parse(deep)}});
  EXPECT_EQ(strata::chat::json_depth(ctx), 301u);
  EXPECT_EQ(strata::chat::json_depth(J(1)), 0u);
  EXPECT_EQ(strata::chat::json_depth(J::parse("[1, {\"a\": [2]}]")), 3u);
  EXPECT_THROW(Template("{{ x | length }}").render(ctx), RenderError);
  EXPECT_THROW(Template("{{ s | from_json }}").render(J::object({{"s", deep}})), RenderError);
  // 256 levels are taken.
  std::string ok;
  for (int i = 0; i < 255; ++i) ok += "[";
  for (int i = 0; i < 255; ++i) ok += "]";
  EXPECT_EQ(Template("{{ x | length }}").render(J::object({{"x", J::parse(ok)}})), "1");
  // The conversion counts depth as it recurses (no second walk): exactly json_depth's limit, a
  // value of 256 levels taken and one of 257 refused.
  const auto nested = [](size_t n) { return J::parse(std::string(n, '[') + std::string(n, ']')); };
  EXPECT_EQ(strata::chat::json_depth(nested(256)), strata::chat::kMaxJsonDepth);
  EXPECT_EQ(Template("{{ x | length }}").render(J::object({{"x", nested(256)}})), "1");
  try {
    Template("{{ x | length }}").render(J::object({{"x", nested(257)}}));
    ADD_FAILURE() << "257 levels rendered";
  } catch (const RenderError& e) {
    EXPECT_NE(std::string(e.what()).find("more than 256 levels deep"), std::string::npos) << e.what();
  }
}

TEST(ChatTemplate, RenderErrors) {
  EXPECT_THROW(Template("{{ 'a' + 1 }}").render(J::object()), RenderError);
  EXPECT_THROW(Template("{{ x.y.z }}").render(J::object()), RenderError);  // attribute of undefined
  EXPECT_THROW(Template("{{ 1 / 0 }}").render(J::object()), RenderError);
  EXPECT_THROW(Template("{{ '{:>5}'.format(1) }}").render(J::object()), RenderError);  // format specs: refused
  EXPECT_THROW(Template("{{ '{} {}'.format(1) }}").render(J::object()), RenderError);  // too few arguments
  EXPECT_THROW(Template("{{ '{0} {}'.format(1, 2) }}").render(J::object()), RenderError);
  EXPECT_THROW(Template("{{ {[1]: 2} }}").render(J::object()), RenderError);  // unhashable key
  try {
    Template("{{ raise_exception('roles must alternate') }}").render(J::object());
    FAIL();
  } catch (const RenderError& e) {
    EXPECT_STREQ(e.what(), "roles must alternate");
  }
}

TEST(ChatTemplate, ShippedModel) {
  auto f = strata::gguf::File::open(strata::test::shipped_model());
  auto tok = strata::tokenizer::Tokenizer::from_gguf(f);
  const ChatTemplate t = ChatTemplate::from_gguf(f, tok);
  EXPECT_FALSE(t.is_fallback());
  const J msgs = J::array({{{"role", "system"}, {"content", "S"}}, {{"role", "user"}, {"content", "U"}}});
  EXPECT_EQ(t.apply(msgs, true),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n");
  const auto eog = strata::chat::end_of_generation_tokens(tok);
  const auto im_end = tok.find_token("<|im_end|>");
  ASSERT_TRUE(im_end.has_value());
  EXPECT_NE(std::find(eog.begin(), eog.end(), *im_end), eog.end());
  EXPECT_NE(std::find(eog.begin(), eog.end(), tok.eos_id()), eog.end());
}

namespace {

// Real chat templates strata cannot load or render identically yet, with the reason. The test
// asserts that exactly these fail, so both a regression and a fix show up.
const std::map<std::string, std::string> kKnownFailures = {};

}  // namespace

// Every template of ../shared/data/templates over a few conversations (one user turn; a
// multi-turn with system; tools; an assistant tool call with the tool's answer), with and
// without add_generation_prompt: byte-identical to jinja2 wherever jinja2 renders.
TEST(ChatTemplate, RealTemplatesMatchPythonJinja2) {
  const std::filesystem::path dir = std::string(STRATA_REPO_DIR) + "/../shared/data/templates";
  if (!std::filesystem::is_directory(dir)) GTEST_SKIP() << dir << " absent: no real templates to check";
  if (!have_jinja2()) GTEST_SKIP() << "python3 with jinja2 absent (apt-get install python3-jinja2): oracle unavailable";
  std::vector<std::filesystem::path> files;
  for (auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".jinja") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  ASSERT_FALSE(files.empty());

  const J tools = J::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "description": "The weather of a city", "parameters": {"type": "object",
      "properties": {"location": {"type": "string", "description": "city name"}}, "required": ["location"]}}}])");
  const J user = {{"role", "user"}, {"content", "What is the weather in Paris?"}};
  const J call = J::parse(R"({"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
      "function": {"name": "get_weather", "arguments": {"location": "Paris"}}}]})");
  const J answer = J::parse(R"({"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
      "content": "{\"temperature\": 21, \"sky\": \"clear\"}"})");
  struct Conv {
    std::string name;
    J messages, tools;
  };
  const std::vector<Conv> convs = {
      {"single", J::array({user}), J()},
      {"multi-turn",
       J::array({{{"role", "system"}, {"content", "You are a helpful assistant."}},
                 {{"role", "user"}, {"content", "Hello"}},
                 {{"role", "assistant"}, {"content", "Hi there, how can I help?"}},
                 {{"role", "user"}, {"content", "Tell me a joke."}}}),
       J()},
      {"tools", J::array({user}), tools},
      {"tool-call", J::array({user, call, answer}), tools},
  };
  const std::string bos = "<s>", eos = "</s>";

  J in = J::array();
  for (auto& f : files) {
    std::ifstream is(f, std::ios::binary);
    const std::string src((std::istreambuf_iterator<char>(is)), std::istreambuf_iterator<char>());
    for (auto& c : convs)
      for (bool agp : {false, true}) {
        J ctx = {{"messages", c.messages}, {"add_generation_prompt", agp}, {"bos_token", bos}, {"eos_token", eos}};
        if (!c.tools.is_null()) ctx["tools"] = c.tools;
        in.push_back({{"template", src}, {"context", ctx}});
      }
  }
  const J want = oracle(in);
  ASSERT_EQ(want.size(), in.size());

  std::map<std::string, std::string> failing;  // file -> first failure
  int rendered_by_jinja2 = 0;
  size_t k = 0;
  for (auto& f : files) {
    const std::string name = f.filename().string();
    const std::string src = in[k]["template"].get<std::string>();
    std::unique_ptr<ChatTemplate> t;
    try {
      t = std::make_unique<ChatTemplate>(src, bos, eos);
    } catch (const std::exception& e) {
      failing.emplace(name, std::string("load: ") + e.what());
    }
    for (auto& c : convs)
      for (bool agp : {false, true}) {
        const J& w = want[k++];
        if (!w.contains("ok")) continue;
        ++rendered_by_jinja2;
        if (!t || failing.count(name)) continue;
        const std::string where = c.name + (agp ? " +gen" : "");
        J extra = J::object();
        if (!c.tools.is_null()) extra["tools"] = c.tools;
        try {
          const std::string got = t->apply(c.messages, agp, extra);
          if (got != w["ok"].get<std::string>()) {
            const std::string& py = w["ok"].get_ref<const std::string&>();
            size_t at = 0;
            while (at < got.size() && at < py.size() && got[at] == py[at]) ++at;
            failing.emplace(name, where + ": differs at byte " + std::to_string(at) + ": strata '" +
                                      got.substr(at, 40) + "' jinja2 '" + py.substr(at, 40) + "'");
          }
        } catch (const std::exception& e) {
          failing.emplace(name, where + ": " + e.what());
        }
      }
  }
  for (auto& [name, why] : failing)
    EXPECT_TRUE(kKnownFailures.count(name)) << name << " fails, not in kKnownFailures: " << why;
  for (auto& [name, why] : kKnownFailures)
    EXPECT_TRUE(failing.count(name)) << name << " is listed as failing (" << why << ") but now passes: remove it";
  std::printf("real chat templates: %zu of %zu match jinja2 (%d renders by jinja2 compared)\n",
              files.size() - failing.size(), files.size(), rendered_by_jinja2);
  EXPECT_GT(rendered_by_jinja2, int(files.size()));  // the oracle renders most cases
}
