// ChatFormatter: finds a model's chat template in its directory and turns conversations into
// prompts with it, passing the template the same variables Hugging Face transformers does.

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tandem/base/status_macros.h"
#include "tandem/text/chat_template.h"

namespace tandem::text {
namespace {

namespace fs = std::filesystem;
using OrderedJson = nlohmann::ordered_json;

// The special tokens transformers hands every template (its SPECIAL_TOKENS_ATTRIBUTES), when
// the tokenizer config sets them.
constexpr const char* kSpecialTokenNames[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                              "pad_token", "cls_token", "mask_token"};

// The file's contents, nullopt when it does not exist, or an error naming it.
absl::StatusOr<std::optional<std::string>> ReadFileIfPresent(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    if (ec) return absl::InternalError(absl::StrCat(path.string(), ": ", ec.message()));
    return std::nullopt;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InternalError(absl::StrCat(path.string(), ": cannot open for reading"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::InternalError(absl::StrCat(path.string(), ": read failed"));
  return text.str();
}

absl::StatusOr<OrderedJson> ParseJsonObject(const fs::path& path, const std::string& text) {
  OrderedJson j = OrderedJson::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": invalid JSON"));
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": expected a JSON object"));
  }
  return j;
}

// A token given as "<s>" or as {"content": "<s>", ...}; nullopt when null.
absl::StatusOr<std::optional<std::string>> TokenText(const OrderedJson& v, const fs::path& path,
                                                     const std::string& name) {
  if (v.is_null()) return std::nullopt;
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) {
    return v["content"].get<std::string>();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(path.string(), ": ", name, " must be a string or an object with \"content\""));
}

// Adds the special tokens `file` sets (null ones are left out) to `tokens`, replacing any there.
absl::Status CollectSpecialTokens(const OrderedJson& file, const fs::path& path,
                                  OrderedJson* tokens) {
  for (const char* name : kSpecialTokenNames) {
    if (!file.contains(name)) continue;
    TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> text, TokenText(file[name], path, name));
    if (text) (*tokens)[name] = *text;
  }
  if (file.contains("additional_special_tokens") && file["additional_special_tokens"].is_array()) {
    OrderedJson extra = OrderedJson::array();
    for (const auto& token : file["additional_special_tokens"]) {
      TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> text,
                              TokenText(token, path, "additional_special_tokens"));
      if (text) extra.push_back(*text);
    }
    (*tokens)["additional_special_tokens"] = std::move(extra);
  }
  return absl::OkStatus();
}

// `chat_template` is either the template or a list of {"name", "template"}, of which the one
// named "default" is the model's chat template.
absl::StatusOr<std::string> TemplateText(const OrderedJson& field, const fs::path& path) {
  if (field.is_string()) return field.get<std::string>();
  if (field.is_array()) {
    for (const auto& entry : field) {
      if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
          entry["template"].is_string()) {
        return entry["template"].get<std::string>();
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": chat_template lists no template named \"default\""));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(path.string(), ": chat_template must be a string or a list of templates"));
}

absl::StatusOr<std::unique_ptr<JinjaTemplate>> ParseTemplate(const std::string& source,
                                                             const fs::path& path) {
  absl::StatusOr<std::unique_ptr<JinjaTemplate>> parsed = JinjaTemplate::Parse(source);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": chat_template: ", parsed.status().message()));
  }
  return parsed;
}

// The text of one message's content for the plain format: a string, nothing for null, or the
// text parts of an OpenAI-style content list, concatenated.
template <typename Json>
absl::StatusOr<std::string> PlainContent(const Json& message, size_t index) {
  auto it = message.find("content");
  if (it == message.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->template get<std::string>();
  if (it->is_array()) {
    std::string text;
    for (const auto& part : *it) {
      if (!part.is_object() || part.value("type", "text") != "text" || !part.contains("text") ||
          !part["text"].is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "messages[", index, "]: the plain chat format accepts only text content parts"));
      }
      text += part["text"].template get<std::string>();
    }
    return text;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("messages[", index, "].content must be a string, a list of parts or null"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ChatFormatter>> ChatFormatter::Load(const std::string& model_dir) {
  std::error_code ec;
  if (!fs::is_directory(model_dir, ec)) {
    return absl::NotFoundError(absl::StrCat("model directory ", model_dir, " does not exist"));
  }
  auto formatter = std::unique_ptr<ChatFormatter>(new ChatFormatter());
  const fs::path dir(model_dir);

  // Special tokens come from tokenizer_config.json, overridden by special_tokens_map.json when
  // a checkpoint has both, as transformers loads them.
  const fs::path config_path = dir / "tokenizer_config.json";
  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> config_text, ReadFileIfPresent(config_path));
  OrderedJson config = OrderedJson::object();
  if (config_text) {
    TANDEM_ASSIGN_OR_RETURN(config, ParseJsonObject(config_path, *config_text));
    TANDEM_RETURN_IF_ERROR(CollectSpecialTokens(config, config_path, &formatter->special_tokens_));
  }
  const fs::path map_path = dir / "special_tokens_map.json";
  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> map_text, ReadFileIfPresent(map_path));
  if (map_text) {
    TANDEM_ASSIGN_OR_RETURN(OrderedJson map, ParseJsonObject(map_path, *map_text));
    TANDEM_RETURN_IF_ERROR(CollectSpecialTokens(map, map_path, &formatter->special_tokens_));
  }
  formatter->bos_token_ = formatter->special_tokens_.value("bos_token", "");
  formatter->eos_token_ = formatter->special_tokens_.value("eos_token", "");

  // The template: chat_template.jinja (where newer checkpoints keep it), else the one in
  // tokenizer_config.json, else a processor's chat_template.json (multimodal checkpoints).
  std::optional<std::string> source;
  fs::path source_path;
  const fs::path jinja_path = dir / "chat_template.jinja";
  TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> jinja_text, ReadFileIfPresent(jinja_path));
  if (jinja_text) {
    source = std::move(jinja_text);
    source_path = jinja_path;
  } else if (config.contains("chat_template") && !config["chat_template"].is_null()) {
    TANDEM_ASSIGN_OR_RETURN(source, TemplateText(config["chat_template"], config_path));
    source_path = config_path;
  } else {
    const fs::path json_path = dir / "chat_template.json";
    TANDEM_ASSIGN_OR_RETURN(std::optional<std::string> json_text, ReadFileIfPresent(json_path));
    if (json_text) {
      TANDEM_ASSIGN_OR_RETURN(OrderedJson file, ParseJsonObject(json_path, *json_text));
      if (!file.contains("chat_template")) {
        return absl::InvalidArgumentError(absl::StrCat(json_path.string(), ": no chat_template"));
      }
      TANDEM_ASSIGN_OR_RETURN(source, TemplateText(file["chat_template"], json_path));
      source_path = json_path;
    }
  }

  if (source) {
    TANDEM_ASSIGN_OR_RETURN(formatter->template_, ParseTemplate(*source, source_path));
    formatter->template_source_ = std::move(*source);
  }
  return formatter;
}

std::unique_ptr<ChatFormatter> ChatFormatter::Plain() {
  return std::unique_ptr<ChatFormatter>(new ChatFormatter());
}

absl::StatusOr<std::string> ChatFormatter::Apply(const nlohmann::json& messages,
                                                 bool add_generation_prompt,
                                                 const nlohmann::json& extra) const {
  return ApplyImpl(messages, add_generation_prompt, extra);
}

absl::StatusOr<std::string> ChatFormatter::ApplyOrdered(const nlohmann::ordered_json& messages,
                                                        bool add_generation_prompt,
                                                        const nlohmann::ordered_json& extra) const {
  return ApplyImpl(messages, add_generation_prompt, extra);
}

template <typename Json>
absl::StatusOr<std::string> ChatFormatter::ApplyImpl(const Json& messages,
                                                     bool add_generation_prompt,
                                                     const Json& extra) const {
  if (!messages.is_array()) return absl::InvalidArgumentError("messages must be a JSON array");
  if (!extra.is_null() && !extra.is_object()) {
    return absl::InvalidArgumentError("extra template variables must be a JSON object");
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!messages[i].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat("messages[", i, "] must be an object"));
    }
  }

  if (template_ == nullptr) {
    std::string prompt;
    for (size_t i = 0; i < messages.size(); ++i) {
      auto role = messages[i].find("role");
      if (role == messages[i].end() || !role->is_string()) {
        return absl::InvalidArgumentError(absl::StrCat("messages[", i, "].role must be a string"));
      }
      TANDEM_ASSIGN_OR_RETURN(std::string content, PlainContent(messages[i], i));
      absl::StrAppend(&prompt, role->template get<std::string>(), ": ", content, "\n");
    }
    if (add_generation_prompt) prompt += "assistant:";
    return prompt;
  }

  // The variables transformers' apply_chat_template renders with: its special tokens, then
  // messages, tools, documents and add_generation_prompt, then the caller's keyword arguments.
  Json context = Json::object();
  for (auto it = special_tokens_.begin(); it != special_tokens_.end(); ++it) {
    if (it->is_string()) {
      context[it.key()] = it->template get<std::string>();
    } else {
      context[it.key()] = it->template get<std::vector<std::string>>();
    }
  }
  context["messages"] = messages;
  context["tools"] = nullptr;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = add_generation_prompt;
  if (extra.is_object()) {
    for (auto it = extra.begin(); it != extra.end(); ++it) {
      if (it.key() == "messages" || it.key() == "add_generation_prompt") {
        return absl::InvalidArgumentError(
            absl::StrCat("extra template variables may not set '", it.key(), "'"));
      }
      context[it.key()] = it.value();
    }
  }
  if constexpr (std::is_same_v<Json, OrderedJson>) {
    return template_->RenderOrdered(context);
  } else {
    return template_->Render(context);
  }
}

}  // namespace tandem::text
