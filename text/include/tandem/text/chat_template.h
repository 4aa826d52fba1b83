// Chat templates: the `chat_template` of a model's tokenizer_config.json rendered by a
// Jinja subset interpreter, or a documented plain format when the model has none.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::text {

// Bounds on one render, so that a bad template fails with InvalidArgumentError instead of
// hanging or exhausting the stack or memory of the server.
struct JinjaLimits {
  // Rendered text, and any single string or list built while rendering.
  size_t max_output_bytes = size_t{8} << 20;
  // Nested statements, expressions and macro calls being evaluated at once.
  int max_depth = 400;
  // Statements executed plus loop iterations: bounds the time a render can take.
  int64_t max_steps = 5'000'000;
};

// A parsed Jinja template. Supports what real chat templates use: {% for %} (with loop.*),
// {% if/elif/else %}, {% set %} (incl. namespace()), {% macro %}, expressions, string and list
// methods, the filters and tests those templates call, and raise_exception().
class JinjaTemplate {
 public:
  static absl::StatusOr<std::unique_ptr<JinjaTemplate>> Parse(std::string_view source);
  static absl::StatusOr<std::unique_ptr<JinjaTemplate>> Parse(std::string_view source,
                                                              const JinjaLimits& limits);
  virtual ~JinjaTemplate() = default;
  // Renders with `context` (a JSON object) as the global variables. A template that calls
  // raise_exception(msg) yields InvalidArgumentError(msg).
  virtual absl::StatusOr<std::string> Render(const nlohmann::json& context) const = 0;
  // As Render, but objects keep the key order they were given in (nlohmann::json sorts keys),
  // which is what `|tojson` and `|items` then see: use it for request bodies such as tool
  // schemas so that the prompt lists their fields as the client wrote them.
  virtual absl::StatusOr<std::string> RenderOrdered(
      const nlohmann::ordered_json& context) const = 0;
};

// How a model turns chat messages into a prompt. Templates come only from the model
// directory, never from a request.
class ChatFormatter {
 public:
  // Reads <dir>/tokenizer_config.json (chat_template, bos_token, eos_token) if present.
  // As in transformers, <dir>/chat_template.jinja takes precedence over tokenizer_config.json's
  // template and special_tokens_map.json over its tokens; a processor's chat_template.json is
  // used when neither has a template. A model directory without any template gets the plain
  // format; an unreadable or malformed file, or a template that does not parse, is an error
  // naming the file.
  static absl::StatusOr<std::unique_ptr<ChatFormatter>> Load(const std::string& model_dir);
  // The plain format used when a model has no template (documented in docs/api.md):
  //   "<role>: <content>\n" per message, then "assistant:" when add_generation_prompt.
  static std::unique_ptr<ChatFormatter> Plain();

  // messages: JSON array of {"role", "content"}. Extra context keys (tools, ...) may be given.
  // As in Hugging Face transformers, the template also sees `tools` and `documents` (none unless
  // given in `extra`) and the model's special tokens (bos_token, eos_token, ...) that are set.
  absl::StatusOr<std::string> Apply(const nlohmann::json& messages, bool add_generation_prompt,
                                    const nlohmann::json& extra = nlohmann::json::object()) const;
  // As Apply, keeping the clients' key order in objects (see JinjaTemplate::RenderOrdered).
  absl::StatusOr<std::string> ApplyOrdered(
      const nlohmann::ordered_json& messages, bool add_generation_prompt,
      const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;
  bool has_template() const { return template_ != nullptr; }
  // The template's Jinja source ("" without a template): what tells which tool-call syntax the
  // model was trained on.
  const std::string& template_source() const { return template_source_; }

 private:
  template <typename Json>
  absl::StatusOr<std::string> ApplyImpl(const Json& messages, bool add_generation_prompt,
                                        const Json& extra) const;

  std::unique_ptr<JinjaTemplate> template_;
  std::string template_source_;
  std::string bos_token_;
  std::string eos_token_;
  // Every special token the tokenizer config sets, by name ("bos_token" -> "<s>", ...).
  nlohmann::ordered_json special_tokens_ = nlohmann::ordered_json::object();
};

}  // namespace tandem::text
