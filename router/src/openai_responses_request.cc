// /v1/responses requests as chat completions requests (see ResponsesToChat).
#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "tandem/router/openai_request.h"

namespace tandem::router {
namespace {

using ojson = nlohmann::ordered_json;

const ojson* Get(const ojson& object, const char* name) {
  auto it = object.find(name);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

// A message's content: a string, or input_text / output_text (or text) parts joined.
absl::StatusOr<std::string> ItemText(const ojson& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) {
    return ParamError("input", where + ".content must be a string or an array of text parts");
  }
  std::string text;
  for (size_t j = 0; j < content.size(); ++j) {
    const ojson& part = content[j];
    const std::string at = absl::StrCat(where, ".content[", j, "]");
    const ojson* type = part.is_object() ? Get(part, "type") : nullptr;
    if (type == nullptr || !type->is_string()) {
      return ParamError("input", at + ".type must be a string");
    }
    const std::string t = type->get<std::string>();
    if (t != "input_text" && t != "output_text" && t != "text") {
      return ParamError("input", absl::StrCat(at, ": part type '", t.substr(0, 40),
                                              "' is not supported; only text parts are"));
    }
    const ojson* s = Get(part, "text");
    if (s == nullptr || !s->is_string()) return ParamError("input", at + ".text must be a string");
    if (j > 0) text += "\n";
    text += s->get<std::string>();
  }
  return text;
}

absl::Status Unsupported(const char* field, const std::string& why) {
  return ParamError(field, absl::StrCat(field, " is not supported by this server: ", why));
}

}  // namespace

absl::StatusOr<ojson> ResponsesToChat(const ojson& body) {
  if (Get(body, "previous_response_id") != nullptr) {
    return Unsupported("previous_response_id",
                       "responses are not stored; send the conversation in input");
  }
  if (const ojson* v = Get(body, "background"); v != nullptr && v->is_boolean() && v->get<bool>()) {
    return Unsupported("background", "responses run in the foreground only");
  }
  if (Get(body, "conversation") != nullptr) {
    return Unsupported("conversation", "conversations are not stored; send them in input");
  }
  ojson chat = ojson::object();
  for (const char* name : {"model",
                           "temperature",
                           "top_p",
                           "top_k",
                           "min_p",
                           "seed",
                           "stream",
                           "parallel_tool_calls",
                           "presence_penalty",
                           "frequency_penalty",
                           "repetition_penalty",
                           "stop",
                           "logit_bias",
                           "cache_salt",
                           "ignore_eos",
                           "min_tokens",
                           "structured_outputs",
                           "guided_json",
                           "guided_regex",
                           "guided_grammar",
                           "guided_choice"}) {
    if (const ojson* v = Get(body, name)) chat[name] = *v;
  }
  if (const ojson* v = Get(body, "max_output_tokens")) chat["max_tokens"] = *v;

  ojson messages = ojson::array();
  if (const ojson* v = Get(body, "instructions")) {
    if (!v->is_string()) return ParamError("instructions", "instructions must be a string");
    messages.push_back({{"role", "system"}, {"content", *v}});
  }
  const ojson* input = Get(body, "input");
  if (input == nullptr) return ParamError("input", "input is required");
  if (input->is_string()) {
    messages.push_back({{"role", "user"}, {"content", *input}});
  } else if (input->is_array()) {
    for (size_t i = 0; i < input->size(); ++i) {
      const ojson& item = (*input)[i];
      const std::string where = absl::StrCat("input[", i, "]");
      if (!item.is_object()) return ParamError("input", where + " must be an object");
      std::string type = "message";
      if (const ojson* t = Get(item, "type")) {
        if (!t->is_string()) return ParamError("input", where + ".type must be a string");
        type = t->get<std::string>();
      }
      if (type == "message") {
        const ojson* role = Get(item, "role");
        if (role == nullptr || !role->is_string()) {
          return ParamError("input", where + ".role must be a string");
        }
        const ojson* content = Get(item, "content");
        if (content == nullptr) return ParamError("input", where + ".content is required");
        TANDEM_ASSIGN_OR_RETURN(std::string text, ItemText(*content, where));
        messages.push_back({{"role", *role}, {"content", text}});
      } else if (type == "function_call") {
        const ojson* name = Get(item, "name");
        const ojson* arguments = Get(item, "arguments");
        const ojson* call_id = Get(item, "call_id");
        if (name == nullptr || !name->is_string() || arguments == nullptr ||
            !arguments->is_string() || call_id == nullptr || !call_id->is_string()) {
          return ParamError("input", where +
                                         ": a function_call needs string call_id, name and "
                                         "arguments");
        }
        ojson call = {{"id", *call_id},
                      {"type", "function"},
                      {"function", {{"name", *name}, {"arguments", *arguments}}}};
        // Calls made in one turn are one assistant message.
        if (!messages.empty() && messages.back()["role"] == "assistant" &&
            messages.back().contains("tool_calls")) {
          messages.back()["tool_calls"].push_back(std::move(call));
        } else {
          messages.push_back({{"role", "assistant"},
                              {"content", nullptr},
                              {"tool_calls", ojson::array({std::move(call)})}});
        }
      } else if (type == "function_call_output") {
        const ojson* call_id = Get(item, "call_id");
        const ojson* output = Get(item, "output");
        if (call_id == nullptr || !call_id->is_string() || output == nullptr) {
          return ParamError("input", where +
                                         ": a function_call_output needs a string call_id "
                                         "and an output");
        }
        std::string text;
        if (output->is_string()) {
          text = output->get<std::string>();
        } else {
          TANDEM_ASSIGN_OR_RETURN(text, ItemText(*output, where + ".output"));
        }
        messages.push_back({{"role", "tool"}, {"tool_call_id", *call_id}, {"content", text}});
      } else {
        return ParamError("input", absl::StrCat(where, ".type '", type.substr(0, 40),
                                                "' is not supported; use message, function_call "
                                                "or function_call_output"));
      }
    }
  } else {
    return ParamError("input", "input must be a string or an array of input items");
  }
  chat["messages"] = std::move(messages);

  if (const ojson* tools = Get(body, "tools")) {
    if (!tools->is_array()) return ParamError("tools", "tools must be an array of tools");
    ojson out = ojson::array();
    for (size_t i = 0; i < tools->size(); ++i) {
      const ojson& t = (*tools)[i];
      const ojson* type = t.is_object() ? Get(t, "type") : nullptr;
      if (type == nullptr || !type->is_string() || type->get<std::string>() != "function") {
        return ParamError("tools", absl::StrCat("tools[", i,
                                                "].type must be 'function'; built-in "
                                                "tools (web search, file search, ...) are not "
                                                "supported"));
      }
      ojson fn = ojson::object();
      for (const char* key : {"name", "description", "parameters", "strict"}) {
        if (const ojson* v = Get(t, key)) fn[key] = *v;
      }
      out.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    chat["tools"] = std::move(out);
  }
  if (const ojson* choice = Get(body, "tool_choice")) {
    if (choice->is_object()) {
      const ojson* type = Get(*choice, "type");
      const ojson* name = Get(*choice, "name");
      if (type == nullptr || *type != "function" || name == nullptr) {
        return ParamError("tool_choice",
                          "tool_choice must be 'none', 'auto', 'required' or {\"type\": "
                          "\"function\", \"name\": ...}");
      }
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", *name}}}};
    } else {
      chat["tool_choice"] = *choice;
    }
  }
  if (const ojson* text = Get(body, "text")) {
    const ojson* format = text->is_object() ? Get(*text, "format") : nullptr;
    if (!text->is_object()) return ParamError("text", "text must be an object");
    if (format != nullptr) {
      const ojson* type = format->is_object() ? Get(*format, "type") : nullptr;
      if (type == nullptr || !type->is_string()) {
        return ParamError("text", "text.format.type must be a string");
      }
      const std::string t = type->get<std::string>();
      if (t == "json_object") {
        chat["response_format"] = {{"type", "json_object"}};
      } else if (t == "json_schema") {
        ojson spec = ojson::object();
        for (const char* key : {"name", "schema", "strict", "description"}) {
          if (const ojson* v = Get(*format, key)) spec[key] = *v;
        }
        chat["response_format"] = {{"type", "json_schema"}, {"json_schema", std::move(spec)}};
      } else if (t != "text") {
        return ParamError("text", absl::StrCat("text.format.type must be text, json_object or "
                                               "json_schema; got '",
                                               t.substr(0, 40), "'"));
      }
    }
  }
  return chat;
}

}  // namespace tandem::router
