// Errors of the Jinja interpreter: syntax errors and the line they name, unknown filters and
// tags refused when the template is parsed, runtime errors, raise_exception() and the context.

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/text/chat_template.h"
#include "text/src/jinja/render_test_support.h"

namespace tandem::text::jinja {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using json = nlohmann::json;

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

}  // namespace
}  // namespace tandem::text::jinja
