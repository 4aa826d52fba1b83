// A Jinja subset interpreter for chat templates.
//
// Rendering matches what Hugging Face transformers produces for a tokenizer_config.json
// chat_template: Jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
// loop-control extension, autoescape off, a json.dumps-based `tojson`, and the globals
// raise_exception() and strftime_now(). Values follow Python: str() and repr() of numbers and
// containers, truthiness, integer vs float arithmetic, and an "undefined" distinct from none.
// tests/chat_template/ checks the output byte for byte against Jinja2.
//
// The stages, one per file in this folder: lexer (source to tokens, whitespace control), parser
// (tokens to the tree in ast.h), renderer (statements and expressions, with operators.cc,
// methods.cc, filters.cc, tests.cc and globals.cc), over the values of value.h.

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tandem/base/status_macros.h"
#include "tandem/text/chat_template.h"
#include "text/src/jinja/ast.h"
#include "text/src/jinja/lexer.h"
#include "text/src/jinja/parser.h"
#include "text/src/jinja/renderer.h"
#include "text/src/jinja/value.h"

namespace tandem::text {
namespace jinja {
namespace {

// A template parsed once and rendered any number of times, from any number of threads: each
// render has its own Renderer and scopes, and the tree is only read.
class ParsedTemplate final : public JinjaTemplate {
 public:
  ParsedTemplate(Body body, const JinjaLimits& limits) : body_(std::move(body)), limits_(limits) {}

  absl::StatusOr<std::string> Render(const nlohmann::json& context) const override {
    return RenderValue(FromJson(context));
  }
  absl::StatusOr<std::string> RenderOrdered(const nlohmann::ordered_json& context) const override {
    return RenderValue(FromJson(context));
  }

 private:
  absl::StatusOr<std::string> RenderValue(const std::optional<Value>& maybe_context) const {
    if (!maybe_context) {
      return absl::InvalidArgumentError(
          absl::StrCat("template context nests deeper than ", kMaxValueNesting, " levels"));
    }
    const Value& context = *maybe_context;
    if (!context.is_dict())
      return absl::InvalidArgumentError("template context must be a JSON object");
    auto root = std::make_shared<Scope>();
    for (const auto& [k, v] : context.dict()) root->vars[k.str()] = v;
    std::string out;
    Renderer renderer(limits_, &out);
    TANDEM_RETURN_IF_ERROR(renderer.ExecBody(body_, root));
    return out;
  }

  const Body body_;
  const JinjaLimits limits_;
};

}  // namespace
}  // namespace jinja

absl::StatusOr<std::unique_ptr<JinjaTemplate>> JinjaTemplate::Parse(std::string_view source) {
  return Parse(source, JinjaLimits{});
}

absl::StatusOr<std::unique_ptr<JinjaTemplate>> JinjaTemplate::Parse(std::string_view source,
                                                                    const JinjaLimits& limits) {
  TANDEM_ASSIGN_OR_RETURN(std::vector<jinja::Token> tokens, jinja::Tokenize(source));
  TANDEM_ASSIGN_OR_RETURN(jinja::Body body, jinja::ParseTemplate(std::move(tokens)));
  return std::unique_ptr<JinjaTemplate>(new jinja::ParsedTemplate(std::move(body), limits));
}

}  // namespace tandem::text
