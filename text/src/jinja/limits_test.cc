// The Jinja interpreter's guards against runaway templates: recursion, nesting in the source and
// in values, output size and the step limit fail with an error instead of exhausting the stack,
// memory or time of the server.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/text/chat_template.h"
#include "text/src/jinja/render_test_support.h"

namespace tandem::text::jinja {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

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

}  // namespace
}  // namespace tandem::text::jinja
