// Rendering by the Jinja interpreter: loops and scoping, Python-style values, tojson, key order,
// strftime_now and concurrent renders of one template. Fidelity to Jinja2 is covered case by
// case in tests/chat_template (chat_template_golden).

#include <ctime>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/text/chat_template.h"
#include "text/src/jinja/render_test_support.h"

namespace tandem::text::jinja {
namespace {

using json = nlohmann::json;

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

// ---- threads -------------------------------------------------------------------------------

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

}  // namespace
}  // namespace tandem::text::jinja
