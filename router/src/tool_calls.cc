#include "tandem/router/tool_calls.h"

#include <algorithm>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "tandem/grammar/grammar.h"
#include "tandem/grammar/json_schema.h"
#include "tandem/router/openai_request.h"

namespace tandem::router {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

constexpr std::string_view kHermesOpen = "<tool_call>";
constexpr std::string_view kHermesClose = "</tool_call>";
constexpr std::string_view kPythonTag = "<|python_tag|>";

bool IsWs(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

const json* Field(const json& object, const char* name) {
  auto it = object.find(name);
  if (it == object.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string Short(const std::string& s) { return s.size() <= 40 ? s : s.substr(0, 40) + "..."; }

bool ValidFunctionName(const std::string& name) {
  if (name.empty() || name.size() > static_cast<size_t>(kMaxFunctionNameBytes)) return false;
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// How many characters at the end of text[from..] are a proper prefix of `tag`: text that may
// still become the tag and so is held back.
size_t PartialSuffix(const std::string& text, size_t from, std::string_view tag) {
  const size_t avail = text.size() - from;
  for (size_t n = std::min(avail, tag.size() - 1); n > 0; --n) {
    if (text.compare(text.size() - n, n, tag.data(), n) == 0) return n;
  }
  return 0;
}

// 1: text[i..] starts with `tag`; 0: it is a proper prefix of it (wait for more); -1: neither.
int MatchAt(const std::string& text, size_t i, std::string_view tag) {
  const size_t n = std::min(text.size() - i, tag.size());
  if (text.compare(i, n, tag.data(), n) != 0) return -1;
  return n == tag.size() ? 1 : 0;
}

absl::Status ToolError(size_t i, const std::string& what) {
  return ParamError("tools", absl::StrCat("tools[", i, "]", what));
}

}  // namespace

const char* ToolCallFormatName(ToolCallFormat format) {
  switch (format) {
    case ToolCallFormat::kNone:
      return "none";
    case ToolCallFormat::kHermes:
      return "hermes";
    case ToolCallFormat::kLlama3Json:
      return "llama3_json";
  }
  return "none";
}

absl::StatusOr<std::optional<ToolCallFormat>> ParseToolCallFormat(std::string_view name) {
  if (name == "auto") return std::nullopt;
  if (name == "hermes") return ToolCallFormat::kHermes;
  if (name == "llama3_json") return ToolCallFormat::kLlama3Json;
  return absl::InvalidArgumentError(absl::StrCat(
      "tool-call parser must be auto, hermes or llama3_json; got '", std::string(name), "'"));
}

ToolCallFormat DetectToolCallFormat(std::string_view chat_template) {
  auto contains = [&](std::string_view s) { return chat_template.find(s) != std::string::npos; };
  if (contains(kHermesOpen)) return ToolCallFormat::kHermes;
  if (contains(kPythonTag) || contains("\"parameters\"")) {
    return ToolCallFormat::kLlama3Json;
  }
  return ToolCallFormat::kNone;
}

absl::StatusOr<ToolRequest> ParseToolRequest(const json& body, const ordered_json* ordered_body) {
  ToolRequest r;
  const json* tools = Field(body, "tools");
  if (tools != nullptr) {
    if (!tools->is_array()) return ParamError("tools", "tools must be an array of tools");
    if (tools->size() > static_cast<size_t>(kMaxTools)) {
      return ParamError("tools", absl::StrCat("tools may hold at most ", kMaxTools, " tools, got ",
                                              tools->size()));
    }
    const ordered_json* ordered = nullptr;
    if (ordered_body != nullptr) {
      auto it = ordered_body->find("tools");
      if (it != ordered_body->end() && it->is_array() && it->size() == tools->size()) {
        ordered = &*it;
      }
    }
    std::set<std::string> seen;
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      if (!t.is_object()) return ToolError(i, " must be an object");
      const json* type = Field(t, "type");
      if (type == nullptr || !type->is_string() || type->get<std::string>() != "function") {
        return ToolError(i, ".type must be 'function' (the only kind of tool)");
      }
      const json* fn = Field(t, "function");
      if (fn == nullptr || !fn->is_object()) return ToolError(i, ".function must be an object");
      const json* name = Field(*fn, "name");
      if (name == nullptr || !name->is_string()) {
        return ToolError(i, ".function.name must be a string");
      }
      const std::string n = name->get<std::string>();
      if (!ValidFunctionName(n)) {
        return ToolError(i, absl::StrCat(".function.name '", Short(n),
                                         "' must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -"));
      }
      if (!seen.insert(n).second) {
        return ToolError(i, absl::StrCat(".function.name '", n, "' is used by another tool"));
      }
      if (const json* d = Field(*fn, "description"); d != nullptr && !d->is_string()) {
        return ToolError(i, ".function.description must be a string");
      }
      if (const json* s = Field(*fn, "strict"); s != nullptr && !s->is_boolean()) {
        return ToolError(i, ".function.strict must be a boolean");
      }
      ordered_json parameters = {{"type", "object"}, {"properties", ordered_json::object()}};
      if (const json* p = Field(*fn, "parameters")) {
        if (!p->is_object()) {
          return ToolError(i, ".function.parameters must be a JSON schema object");
        }
        parameters = ordered != nullptr ? (*ordered)[i]["function"]["parameters"]
                                        : ordered_json::parse(p->dump());
      }
      r.names.push_back(n);
      r.parameters.push_back(std::move(parameters));
    }
    if (!r.names.empty()) {
      r.tools = ordered != nullptr ? *ordered : ordered_json::parse(tools->dump());
    }
  }

  if (const json* v = Field(body, "parallel_tool_calls")) {
    if (!v->is_boolean()) {
      return ParamError("parallel_tool_calls", "parallel_tool_calls must be a boolean");
    }
    r.parallel = v->get<bool>();
  }

  const json* choice = Field(body, "tool_choice");
  if (choice == nullptr) {
    return r;  // auto with tools, and nothing to do without
  }
  const char* kShape =
      "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
      "\"function\": {\"name\": ...}}";
  if (choice->is_string()) {
    const std::string c = choice->get<std::string>();
    if (c == "none") {
      r.choice = ToolChoice::kNone;
    } else if (c == "auto") {
      r.choice = ToolChoice::kAuto;
    } else if (c == "required") {
      r.choice = ToolChoice::kRequired;
    } else {
      return ParamError("tool_choice", absl::StrCat(kShape, "; got '", Short(c), "'"));
    }
  } else if (choice->is_object()) {
    const json* type = Field(*choice, "type");
    const json* fn = Field(*choice, "function");
    const json* name = fn != nullptr && fn->is_object() ? Field(*fn, "name") : nullptr;
    if (type == nullptr || !type->is_string() || type->get<std::string>() != "function" ||
        name == nullptr || !name->is_string()) {
      return ParamError("tool_choice", kShape);
    }
    r.choice = ToolChoice::kFunction;
    r.function = name->get<std::string>();
    if (r.active() && std::find(r.names.begin(), r.names.end(), r.function) == r.names.end()) {
      return ParamError("tool_choice",
                        absl::StrCat("tool_choice names the function '", Short(r.function),
                                     "', which is not among the tools"));
    }
  } else {
    return ParamError("tool_choice", kShape);
  }
  if (!r.active() && (r.choice == ToolChoice::kRequired || r.choice == ToolChoice::kFunction)) {
    return ParamError("tool_choice",
                      "tool_choice 'required' or a function needs tools; none were given");
  }
  return r;
}

absl::StatusOr<std::string> ToolCallGbnf(const ToolRequest& request, ToolCallFormat format) {
  if (format == ToolCallFormat::kNone) {
    return absl::InvalidArgumentError("no tool-call format to build a grammar for");
  }
  const bool hermes = format == ToolCallFormat::kHermes;
  const std::string args_key = hermes ? "arguments" : "parameters";
  std::string functions;
  std::string rules;
  for (size_t i = 0; i < request.names.size(); ++i) {
    if (request.choice == ToolChoice::kFunction && request.names[i] != request.function) continue;
    const std::string rule = absl::StrCat("tool-", i, "-args");
    absl::StatusOr<std::string> args = grammar::JsonSchemaToGbnfRules(request.parameters[i], rule);
    if (!args.ok()) {
      std::string message(args.status().message());
      if (absl::StartsWith(message, "json schema: ")) message.erase(0, 13);
      return ParamError("tools",
                        absl::StrCat("tools[", i, "].function.parameters ('", request.names[i],
                                     "') cannot be enforced: ", message));
    }
    rules += *args;
    if (!functions.empty()) functions += " | ";
    const std::string head = absl::StrCat(json(request.names[i]).dump(), ", \"", args_key, "\": ");
    absl::StrAppend(&functions, grammar::GbnfLiteral(head), " ", rule);
  }
  std::string out;
  if (hermes) {
    absl::StrAppend(&out, "root ::= tool-call", request.parallel ? " (\"\\n\" tool-call)*" : "",
                    "\n");
    absl::StrAppend(&out, "tool-call ::= ", grammar::GbnfLiteral("<tool_call>\n{\"name\": "),
                    " tool-function ", grammar::GbnfLiteral("}\n</tool_call>"), "\n");
  } else {
    absl::StrAppend(&out, "root ::= ", grammar::GbnfLiteral("{\"name\": "), " tool-function ",
                    grammar::GbnfLiteral("}"), "\n");
  }
  absl::StrAppend(&out, "tool-function ::= ", functions, "\n", rules, grammar::JsonLexicalGbnf());
  return out;
}

// ---------------------------------------------------------------------------------------------
// ToolCallParser

ToolCallParser::ToolCallParser(ToolCallFormat format)
    : format_(format),
      state_(format == ToolCallFormat::kLlama3Json ? State::kStart : State::kText) {}

ParsedText ToolCallParser::Feed(std::string_view text) {
  out_ = ParsedText{};
  pending_.append(text);
  Run(/*at_end=*/false);
  return std::move(out_);
}

ParsedText ToolCallParser::Finish() {
  out_ = ParsedText{};
  Run(/*at_end=*/true);
  switch (state_) {
    case State::kStart:
    case State::kBetween:
      if (num_calls_ == 0) EmitContent(between_);
      break;
    case State::kCallOpen:
      EmitContent(raw_call_);
      break;
    case State::kCall:
      if (announced_) {
        EmitArguments();
      } else {
        EmitContent(raw_call_);
      }
      break;
    default:
      break;
  }
  between_.clear();
  if (num_calls_ == 0) out_.content += held_ws_;
  held_ws_.clear();
  state_ = State::kRaw;
  return std::move(out_);
}

void ToolCallParser::Run(bool at_end) {
  size_t i = 0;
  while (i < pending_.size()) {
    const char c = pending_[i];
    switch (state_) {
      case State::kText: {
        size_t tag = pending_.find(kHermesOpen, i);
        if (tag != std::string::npos) {
          EmitContent(std::string_view(pending_).substr(i, tag - i));
          i = tag + kHermesOpen.size();
          BeginCall(std::string(kHermesOpen));
          state_ = State::kCallOpen;
          continue;
        }
        const size_t keep = at_end ? 0 : PartialSuffix(pending_, i, kHermesOpen);
        EmitContent(std::string_view(pending_).substr(i, pending_.size() - keep - i));
        i = pending_.size() - keep;
        pending_.erase(0, i);
        EmitArguments();
        return;
      }
      case State::kCallOpen:
        if (IsWs(c)) {
          raw_call_ += c;
          ++i;
        } else if (c == '{') {
          raw_call_ += c;
          ++i;
          depth_ = 1;
          state_ = State::kCall;
        } else {
          EmitContent(raw_call_);  // a tag not followed by an object: text after all
          ResetCall();
          state_ = State::kText;
        }
        continue;
      case State::kCall:
        ++i;
        StepCall(c);
        continue;
      case State::kCallClose: {
        if (IsWs(c)) {
          ++i;
          continue;
        }
        int m = MatchAt(pending_, i, kHermesClose);
        if (m == 1) {
          i += kHermesClose.size();
        } else if (m == 0 && !at_end) {
          pending_.erase(0, i);
          EmitArguments();
          return;
        }
        state_ = State::kText;  // the closing tag, or text without it
        continue;
      }
      case State::kStart:
      case State::kBetween: {
        if (IsWs(c) || (state_ == State::kBetween && c == ';')) {
          between_ += c;
          if (c == ';') state_ = State::kStart;
          ++i;
          continue;
        }
        if (state_ == State::kStart && c == '{') {
          between_.clear();
          BeginCall("{");
          depth_ = 1;
          state_ = State::kCall;
          ++i;
          continue;
        }
        if (state_ == State::kStart) {
          int m = MatchAt(pending_, i, kPythonTag);
          if (m == 1) {
            between_ += kPythonTag;
            i += kPythonTag.size();
            continue;
          }
          if (m == 0 && !at_end) {
            pending_.erase(0, i);
            EmitArguments();
            return;
          }
        }
        EmitContent(between_);  // not a call: the rest is content
        between_.clear();
        state_ = State::kRaw;
        continue;
      }
      case State::kRaw:
        EmitContent(std::string_view(pending_).substr(i));
        i = pending_.size();
        continue;
    }
  }
  pending_.clear();
  EmitArguments();
}

void ToolCallParser::BeginCall(std::string opening) {
  ResetCall();
  // Whitespace just before a call is not content, unless the call turns out to be text.
  raw_call_ = held_ws_ + opening;
  held_ws_.clear();
}

void ToolCallParser::ResetCall() {
  raw_call_.clear();
  depth_ = 0;
  in_string_ = false;
  escaped_ = false;
  phase_ = Phase::kKey;
  key_raw_.clear();
  key_.clear();
  capture_ = nullptr;
  capturing_scalar_ = false;
  name_raw_.clear();
  name_.clear();
  have_name_ = false;
  arguments_.clear();
  have_arguments_ = false;
  arguments_sent_ = 0;
  announced_ = false;
}

std::string* ToolCallParser::ValueTarget() {
  if (key_ == "name" && !have_name_) {
    name_raw_.clear();
    return &name_raw_;
  }
  const bool arguments_key =
      key_ == "arguments" || (format_ == ToolCallFormat::kLlama3Json && key_ == "parameters");
  if (arguments_key && !have_arguments_ && arguments_.empty()) return &arguments_;
  return nullptr;
}

void ToolCallParser::StepCall(char c) {
  raw_call_ += c;
  if (in_string_) {
    if (capture_ != nullptr) *capture_ += c;
    if (escaped_) {
      escaped_ = false;
    } else if (c == '\\') {
      escaped_ = true;
    } else if (c == '"') {
      in_string_ = false;
      if (depth_ == 1) EndTopString();
    }
    return;
  }
  if (depth_ >= 2) {  // inside a nested value
    if (capture_ != nullptr) *capture_ += c;
    if (c == '"') {
      in_string_ = true;
    } else if (c == '{' || c == '[') {
      ++depth_;
    } else if ((c == '}' || c == ']') && --depth_ == 1) {
      EndValue();
    }
    return;
  }
  // depth 1: the call object's own keys and values.
  if (capturing_scalar_ && (IsWs(c) || c == ',' || c == '}')) EndValue();
  switch (c) {
    case '"':
      in_string_ = true;
      if (phase_ == Phase::kKey) {
        key_raw_ = "\"";
        capture_ = &key_raw_;
      } else if (phase_ == Phase::kValue) {
        capture_ = ValueTarget();
        if (capture_ != nullptr) *capture_ += c;
        phase_ = Phase::kAfterValue;
      }
      return;
    case ':':
      if (phase_ == Phase::kColon) phase_ = Phase::kValue;
      return;
    case ',':
      phase_ = Phase::kKey;
      key_.clear();
      return;
    case '}':
      EndCall();
      return;
    case '{':
    case '[':
      if (phase_ == Phase::kValue) {
        capture_ = ValueTarget();
        if (capture_ != nullptr) *capture_ += c;
        phase_ = Phase::kAfterValue;
      }
      depth_ = 2;
      return;
    default:
      if (IsWs(c)) return;
      if (phase_ == Phase::kValue) {
        capture_ = ValueTarget();
        if (capture_ != nullptr) *capture_ += c;
        capturing_scalar_ = true;
        phase_ = Phase::kAfterValue;
      } else if (capturing_scalar_ && capture_ != nullptr) {
        *capture_ += c;
      }
      return;
  }
}

void ToolCallParser::EndTopString() {
  if (capture_ == &key_raw_) {
    json k = json::parse(key_raw_, nullptr, /*allow_exceptions=*/false);
    key_ = k.is_string() ? k.get<std::string>() : "";
    capture_ = nullptr;
    phase_ = Phase::kColon;
    return;
  }
  EndValue();
}

void ToolCallParser::EndValue() {
  if (capture_ == &name_raw_) {
    json n = json::parse(name_raw_, nullptr, /*allow_exceptions=*/false);
    if (n.is_string()) {
      name_ = n.get<std::string>();
      have_name_ = true;
      if (!announced_) Announce();
    }
  } else if (capture_ == &arguments_) {
    have_arguments_ = true;
  }
  capture_ = nullptr;
  capturing_scalar_ = false;
}

void ToolCallParser::EndCall() {
  depth_ = 0;
  const bool is_call = have_name_;
  if (is_call) {
    if (!announced_) Announce();
    if (arguments_.empty()) arguments_ = "{}";  // a call without arguments
    EmitArguments();
  } else {
    EmitContent(raw_call_);  // an object that names no function: text after all
  }
  ResetCall();
  if (format_ == ToolCallFormat::kHermes) {
    state_ = is_call ? State::kCallClose : State::kText;
  } else {
    state_ = is_call ? State::kBetween : State::kRaw;
  }
}

void ToolCallParser::Announce() {
  announced_ = true;
  out_.calls.push_back({num_calls_, /*first=*/true, name_, ""});
  ++num_calls_;
  EmitArguments();
}

void ToolCallParser::EmitArguments() {
  if (!announced_ || arguments_sent_ >= arguments_.size()) return;
  std::string piece = arguments_.substr(arguments_sent_);
  arguments_sent_ = arguments_.size();
  const int index = num_calls_ - 1;
  if (!out_.calls.empty() && out_.calls.back().index == index && !out_.calls.back().first) {
    out_.calls.back().arguments += piece;
  } else {
    out_.calls.push_back({index, /*first=*/false, "", std::move(piece)});
  }
}

void ToolCallParser::EmitContent(std::string_view text) {
  std::string s = held_ws_;
  s.append(text);
  held_ws_.clear();
  size_t end = s.find_last_not_of(" \t\n\r");
  if (end == std::string::npos) {
    held_ws_ = std::move(s);
    return;
  }
  out_.content.append(s, 0, end + 1);
  held_ws_ = s.substr(end + 1);
}

}  // namespace tandem::router
