// Chat templates: the `chat_template` of a model's tokenizer_config.json rendered by a
// Jinja subset interpreter, or a documented plain format when the model has none.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::engine {

// A parsed Jinja template. Supports what real chat templates use: {% for %} (with loop.*),
// {% if/elif/else %}, {% set %} (incl. namespace()), {% macro %}, expressions, string and list
// methods, the filters and tests those templates call, and raise_exception().
class JinjaTemplate {
 public:
  static absl::StatusOr<std::unique_ptr<JinjaTemplate>> Parse(std::string_view source);
  virtual ~JinjaTemplate() = default;
  // Renders with `context` (a JSON object) as the global variables. A template that calls
  // raise_exception(msg) yields InvalidArgumentError(msg).
  virtual absl::StatusOr<std::string> Render(const nlohmann::json& context) const = 0;
};

// How a model turns chat messages into a prompt. Templates come only from the model
// directory, never from a request.
class ChatFormatter {
 public:
  // Reads <dir>/tokenizer_config.json (chat_template, bos_token, eos_token) if present.
  static absl::StatusOr<std::unique_ptr<ChatFormatter>> Load(const std::string& model_dir);
  // The plain format used when a model has no template (documented in docs/api.md):
  //   "<role>: <content>\n" per message, then "assistant:" when add_generation_prompt.
  static std::unique_ptr<ChatFormatter> Plain();

  // messages: JSON array of {"role", "content"}. Extra context keys (tools, ...) may be given.
  absl::StatusOr<std::string> Apply(const nlohmann::json& messages, bool add_generation_prompt,
                                    const nlohmann::json& extra = nlohmann::json::object()) const;
  bool has_template() const { return template_ != nullptr; }

 private:
  std::unique_ptr<JinjaTemplate> template_;
  std::string bos_token_;
  std::string eos_token_;
};

}  // namespace tandem::engine
