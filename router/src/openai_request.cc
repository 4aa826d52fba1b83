#include "tandem/router/openai_request.h"

#include <cmath>
#include <limits>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"

namespace tandem::router {
namespace {

using nlohmann::json;

constexpr char kParamPayload[] = "type.tandem/openai.param";
constexpr char kCodePayload[] = "type.tandem/openai.code";

// A value from the request shown in a message: short, so a message never echoes the input.
std::string Excerpt(const std::string& s) {
  constexpr size_t kMax = 40;
  if (s.size() <= kMax) return s;
  return s.substr(0, kMax) + "...";
}

std::string ShortDump(const json& v) {
  return Excerpt(v.dump(-1, ' ', false, json::error_handler_t::replace));
}

// The field, or nullptr when it is absent or null (clients send null for "default").
const json* Field(const json& body, const char* name) {
  auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

absl::Status ReadBool(const json& body, const char* name, bool* out) {
  const json* v = Field(body, name);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_boolean()) return ParamError(name, absl::StrCat(name, " must be a boolean"));
  *out = v->get<bool>();
  return absl::OkStatus();
}

// An integer in [lo, hi]; a float with an integral value (2.0) counts as an integer.
absl::Status ReadInt(const json& body, const char* name, int64_t lo, int64_t hi,
                     std::optional<int64_t>* out) {
  const json* v = Field(body, name);
  if (v == nullptr) return absl::OkStatus();
  auto range_error = [&] {
    return ParamError(name, absl::StrCat(name, " must be an integer in [", lo, ", ", hi, "], got ",
                                         ShortDump(*v)));
  };
  if (v->is_number_unsigned()) {
    uint64_t u = v->get<uint64_t>();
    if (u > static_cast<uint64_t>(hi)) return range_error();
    *out = static_cast<int64_t>(u);
  } else if (v->is_number_integer()) {
    int64_t i = v->get<int64_t>();
    if (i < lo || i > hi) return range_error();
    *out = i;
  } else if (v->is_number_float()) {
    double d = v->get<double>();
    if (d != std::floor(d)) return ParamError(name, absl::StrCat(name, " must be an integer"));
    if (d < static_cast<double>(lo) || d > static_cast<double>(hi)) return range_error();
    *out = static_cast<int64_t>(d);
  } else {
    return ParamError(name, absl::StrCat(name, " must be an integer"));
  }
  return absl::OkStatus();
}

absl::Status ReadInt32(const json& body, const char* name, int64_t lo, int* out) {
  std::optional<int64_t> v;
  TANDEM_RETURN_IF_ERROR(ReadInt(body, name, lo, std::numeric_limits<int32_t>::max(), &v));
  if (v) *out = static_cast<int>(*v);
  return absl::OkStatus();
}

absl::Status ReadFloat(const json& body, const char* name, float* out) {
  const json* v = Field(body, name);
  if (v == nullptr) return absl::OkStatus();
  if (!v->is_number()) return ParamError(name, absl::StrCat(name, " must be a number"));
  double d = v->get<double>();
  // Values beyond float range become infinite here and are refused by the range check.
  *out = static_cast<float>(d);
  return absl::OkStatus();
}

absl::Status ReadStop(const json& body, engine::SamplingParams* params) {
  const json* v = Field(body, "stop");
  if (v == nullptr) return absl::OkStatus();
  const std::string kType = "stop must be a string or an array of strings";
  if (v->is_string()) {
    params->stop = {v->get<std::string>()};
  } else if (v->is_array()) {
    if (v->size() > static_cast<size_t>(engine::kMaxStopStrings)) {
      return ParamError("stop", absl::StrCat("stop may hold at most ", engine::kMaxStopStrings,
                                             " strings, got ", v->size()));
    }
    for (const json& s : *v) {
      if (!s.is_string()) return ParamError("stop", kType);
      params->stop.push_back(s.get<std::string>());
    }
  } else {
    return ParamError("stop", kType);
  }
  return absl::OkStatus();
}

// logit_bias: {"<token id>": bias in [-100, 100], ...}.
absl::Status ReadLogitBias(const json& body, int vocab_size, engine::SamplingParams* params) {
  const json* v = Field(body, "logit_bias");
  if (v == nullptr) return absl::OkStatus();
  const char* kParam = "logit_bias";
  if (!v->is_object()) {
    return ParamError(kParam, "logit_bias must be an object of token ids to biases");
  }
  if (v->size() > static_cast<size_t>(engine::kMaxLogitBias)) {
    return ParamError(kParam, absl::StrCat("logit_bias may hold at most ", engine::kMaxLogitBias,
                                           " tokens, got ", v->size()));
  }
  for (const auto& [key, value] : v->items()) {
    int64_t id = -1;
    if (key.empty() || key.size() > 10 ||
        key.find_first_not_of("0123456789") != std::string::npos ||
        (id = std::stoll(key)) >= vocab_size) {
      return ParamError(kParam, absl::StrCat("logit_bias: key '", Excerpt(key),
                                             "' is not a token id in [0, ", vocab_size, ")"));
    }
    if (!value.is_number()) {
      return ParamError(kParam,
                        absl::StrCat("logit_bias: the bias of token ", id, " must be a number"));
    }
    const double bias = value.get<double>();
    if (!(bias >= -engine::kMaxLogitBiasValue && bias <= engine::kMaxLogitBiasValue)) {
      return ParamError(kParam, absl::StrCat("logit_bias: the bias of token ", id,
                                             " must be in [-100, 100], got ", ShortDump(value)));
    }
    params->logit_bias.push_back({static_cast<int32_t>(id), static_cast<float>(bias)});
  }
  return absl::OkStatus();
}

absl::Status ReadTokenIds(const json& array, const char* param, int vocab_size,
                          std::vector<int32_t>* out) {
  for (const json& t : array) {
    if (!t.is_number_integer()) {
      return ParamError(param, absl::StrCat(param, " must hold integer token ids"));
    }
    int64_t id = t.is_number_unsigned()
                     ? static_cast<int64_t>(std::min<uint64_t>(t.get<uint64_t>(),
                                                               std::numeric_limits<int64_t>::max()))
                     : t.get<int64_t>();
    if (id < 0 || id >= vocab_size) {
      return ParamError(param, absl::StrCat(param, ": token id ", id,
                                            " is outside the vocabulary [0, ", vocab_size, ")"));
    }
    out->push_back(static_cast<int32_t>(id));
  }
  return absl::OkStatus();
}

absl::Status ReadPrompt(const json& body, int vocab_size, CompletionRequest* r) {
  const json* v = Field(body, "prompt");
  const std::string kType =
      "prompt must be a string, an array of token ids, or an array of strings or of token-id "
      "arrays (a batch)";
  if (v == nullptr) return ParamError("prompt", "prompt is required");
  if (v->is_string()) {
    r->prompts.push_back({v->get<std::string>(), {}});
    return absl::OkStatus();
  }
  if (!v->is_array()) return ParamError("prompt", kType);
  if (v->empty()) return ParamError("prompt", "prompt must not be empty");
  const json& first = v->front();
  if (first.is_number()) {
    CompletionRequest::Prompt p;
    TANDEM_RETURN_IF_ERROR(ReadTokenIds(*v, "prompt", vocab_size, &p.tokens));
    r->prompts.push_back(std::move(p));
    return absl::OkStatus();
  }
  if (!first.is_string() && !first.is_array()) return ParamError("prompt", kType);
  if (v->size() > static_cast<size_t>(kMaxPromptsPerRequest)) {
    return ParamError("prompt", absl::StrCat("a batch may hold at most ", kMaxPromptsPerRequest,
                                             " prompts, got ", v->size()));
  }
  for (size_t i = 0; i < v->size(); ++i) {
    const json& item = (*v)[i];
    CompletionRequest::Prompt p;
    if (first.is_string()) {
      if (!item.is_string()) {
        return ParamError("prompt", absl::StrCat("prompt[", i, "] must be a string, as the first"));
      }
      p.text = item.get<std::string>();
    } else {
      if (!item.is_array()) {
        return ParamError(
            "prompt", absl::StrCat("prompt[", i, "] must be an array of token ids, as the first"));
      }
      if (item.empty())
        return ParamError("prompt", absl::StrCat("prompt[", i, "] must not be empty"));
      TANDEM_RETURN_IF_ERROR(ReadTokenIds(item, "prompt", vocab_size, &p.tokens));
    }
    r->prompts.push_back(std::move(p));
  }
  return absl::OkStatus();
}

// echo, best_of and suffix: completions' own fields; on chat only their no-op values.
absl::Status ReadCompletionExtras(const json& body, ApiKind kind, int n, bool stream,
                                  CompletionRequest* r) {
  const bool chat = kind == ApiKind::kChat;
  auto completions_only = [](const char* name) {
    return ParamError(name, absl::StrCat(name, " is only supported on /v1/completions"));
  };
  if (const json* v = Field(body, "echo")) {
    if (!v->is_boolean()) return ParamError("echo", "echo must be a boolean");
    if (v->get<bool>() && chat) return completions_only("echo");
    r->echo = v->get<bool>();
  }
  if (const json* v = Field(body, "suffix")) {
    if (!v->is_string()) return ParamError("suffix", "suffix must be a string");
    if (!v->get<std::string>().empty() && chat) return completions_only("suffix");
    r->suffix = v->get<std::string>();
  }
  std::optional<int64_t> best_of;
  TANDEM_RETURN_IF_ERROR(ReadInt(body, "best_of", 1, engine::kMaxSamplesPerRequest, &best_of));
  if (best_of && *best_of != n) {
    if (chat) return completions_only("best_of");
    if (*best_of < n) {
      return ParamError("best_of",
                        absl::StrCat("best_of must be at least n (", n, "), got ", *best_of));
    }
    if (stream) {
      return ParamError("best_of",
                        "best_of other than n cannot be streamed: the best samples are known only "
                        "once all have finished");
    }
    r->best_of = static_cast<int>(*best_of);
  }
  return absl::OkStatus();
}

// An assistant message's tool_calls as chat templates expect them: [{id, type: "function",
// function: {name, arguments}}] with arguments an object when its JSON text parses as one.
absl::StatusOr<json> NormalizeToolCalls(const json& calls, const std::string& where) {
  if (!calls.is_array()) return ParamError("messages", where + " must be an array");
  if (calls.size() > static_cast<size_t>(kMaxTools)) {
    return ParamError("messages", absl::StrCat(where, " may hold at most ", kMaxTools, " calls"));
  }
  json out = json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    const json& call = calls[i];
    const std::string at = absl::StrCat(where, "[", i, "]");
    if (!call.is_object()) return ParamError("messages", at + " must be an object");
    const json* type = Field(call, "type");
    if (type != nullptr && !(type->is_string() && type->get<std::string>() == "function")) {
      return ParamError("messages", at + ".type must be 'function'");
    }
    const json* fn = Field(call, "function");
    if (fn == nullptr || !fn->is_object()) {
      return ParamError("messages", at + ".function must be an object");
    }
    const json* name = Field(*fn, "name");
    if (name == nullptr || !name->is_string()) {
      return ParamError("messages", at + ".function.name must be a string");
    }
    json arguments = json::object();
    if (const json* a = Field(*fn, "arguments")) {
      if (a->is_string()) {
        json parsed = json::parse(a->get<std::string>(), nullptr, /*allow_exceptions=*/false);
        arguments = parsed.is_discarded() ? *a : parsed;
      } else if (a->is_object()) {
        arguments = *a;
      } else {
        return ParamError("messages", at + ".function.arguments must be a string of JSON");
      }
    }
    json normalized = {{"type", "function"},
                       {"function", {{"name", *name}, {"arguments", std::move(arguments)}}}};
    if (const json* id = Field(call, "id")) {
      if (!id->is_string()) return ParamError("messages", at + ".id must be a string");
      normalized["id"] = *id;
    }
    out.push_back(std::move(normalized));
  }
  return out;
}

// Refuses request fields whose meaning this server does not implement.
absl::Status RefuseUnsupported(const json& body) {
  // The deprecated spellings of tools and tool_choice.
  if (const json* v = Field(body, "functions")) {
    if (!v->is_array()) return ParamError("functions", "functions must be an array");
    if (!v->empty()) {
      return ParamError("functions", "functions is not supported by this server; use tools");
    }
  }
  if (const json* v = Field(body, "function_call")) {
    if (!(v->is_string() && v->get<std::string>() == "none")) {
      return ParamError("function_call",
                        "function_call is not supported by this server; use tool_choice");
    }
  }
  return absl::OkStatus();
}

// GBNF of exactly one of `choices` (guided_choice): each a string literal, bytes that end or
// escape a literal and control characters written as escapes.
std::string ChoiceGbnf(const std::vector<std::string>& choices) {
  std::string gbnf = "root ::= ";
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i > 0) gbnf += " | ";
    gbnf += '"';
    for (unsigned char c : choices[i]) {
      if (c == '"' || c == '\\') {
        gbnf += '\\';
        gbnf += static_cast<char>(c);
      } else if (c < 0x20 || c == 0x7f) {
        absl::StrAppend(&gbnf, "\\x", absl::Hex(c, absl::kZeroPad2));
      } else {
        gbnf += static_cast<char>(c);
      }
    }
    gbnf += '"';
  }
  return gbnf + "\n";
}

// The request's structured-output constraints as they are read: the field each came from.
class ConstraintReader {
 public:
  ConstraintReader(const json& body, std::string_view raw_body) : body_(body), raw_(raw_body) {}

  // Reads every constraint field; more than one constraint is an error naming both.
  absl::StatusOr<engine::StructuredOutput> Read() {
    TANDEM_RETURN_IF_ERROR(ReadResponseFormat());
    if (const json* v = Field(body_, "guided_json")) {
      TANDEM_RETURN_IF_ERROR(AddSchema("guided_json", *v, {"guided_json"}));
    }
    TANDEM_RETURN_IF_ERROR(
        ReadString(body_, "guided_regex", "guided_regex", engine::ConstraintKind::kRegex));
    TANDEM_RETURN_IF_ERROR(
        ReadString(body_, "guided_grammar", "guided_grammar", engine::ConstraintKind::kGrammar));
    if (const json* v = Field(body_, "guided_choice")) {
      TANDEM_RETURN_IF_ERROR(AddChoice("guided_choice", *v));
    }
    TANDEM_RETURN_IF_ERROR(ReadStructuredOutputs());
    if (found_.empty()) return engine::StructuredOutput{};
    if (found_.size() > 1) {
      return ParamError(found_[1].param,
                        absl::StrCat("only one structured-output constraint may be given; got ",
                                     found_[0].param, " and ", found_[1].param));
    }
    Found& f = found_[0];
    absl::Status valid = f.constraint.Validate(/*num_prompt_tokens=*/1);
    if (valid.ok()) valid = engine::BuildGrammar(f.constraint).status();
    if (!valid.ok()) {
      std::string message(valid.message());
      if (absl::StartsWith(message, "structured output: ")) message.erase(0, 19);
      return ParamError(f.param, absl::StrCat(f.param, ": ", message));
    }
    return f.constraint;
  }

 private:
  struct Found {
    std::string param;
    engine::StructuredOutput constraint;
  };

  void Add(std::string param, engine::ConstraintKind kind, std::string source) {
    found_.push_back({std::move(param), {kind, std::move(source), 0}});
  }

  absl::Status ReadString(const json& object, const char* name, const std::string& param,
                          engine::ConstraintKind kind) {
    const json* v = Field(object, name);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_string()) return ParamError(param, absl::StrCat(param, " must be a string"));
    Add(param, kind, v->get<std::string>());
    return absl::OkStatus();
  }

  // A schema given as an object (its text taken from the raw body, so its properties keep the
  // order the client wrote them in) or as a string of JSON.
  absl::Status AddSchema(const std::string& param, const json& v, std::vector<std::string> path) {
    if (v.is_string()) {
      Add(param, engine::ConstraintKind::kJsonSchema, v.get<std::string>());
      return absl::OkStatus();
    }
    if (!v.is_object()) {
      return ParamError(param, absl::StrCat(param, " must be a JSON schema object"));
    }
    Add(param, engine::ConstraintKind::kJsonSchema, OrderedDump(v, path));
    return absl::OkStatus();
  }

  absl::Status AddChoice(const std::string& param, const json& v) {
    const std::string kType = absl::StrCat(param, " must be a non-empty array of strings");
    if (!v.is_array() || v.empty()) return ParamError(param, kType);
    std::vector<std::string> choices;
    for (const json& c : v) {
      if (!c.is_string()) return ParamError(param, kType);
      choices.push_back(c.get<std::string>());
    }
    Add(param, engine::ConstraintKind::kGrammar, ChoiceGbnf(choices));
    return absl::OkStatus();
  }

  absl::Status ReadResponseFormat() {
    const json* v = Field(body_, "response_format");
    if (v == nullptr) return absl::OkStatus();
    const char* kParam = "response_format";
    if (!v->is_object()) return ParamError(kParam, "response_format must be an object");
    const json* type = Field(*v, "type");
    if (type == nullptr || !type->is_string()) {
      return ParamError(kParam, "response_format.type must be a string");
    }
    const std::string t = type->get<std::string>();
    if (t == "text") return absl::OkStatus();
    if (t == "json_object") {
      Add(kParam, engine::ConstraintKind::kJsonObject, "");
      return absl::OkStatus();
    }
    if (t != "json_schema") {
      return ParamError(kParam, absl::StrCat("response_format.type must be text, json_object or "
                                             "json_schema; got '",
                                             Excerpt(t), "'"));
    }
    const json* spec = Field(*v, "json_schema");
    if (spec == nullptr || !spec->is_object()) {
      return ParamError(kParam, "response_format.json_schema must be an object holding the schema");
    }
    if (const json* name = Field(*spec, "name"); name != nullptr && !name->is_string()) {
      return ParamError(kParam, "response_format.json_schema.name must be a string");
    }
    if (const json* strict = Field(*spec, "strict"); strict != nullptr && !strict->is_boolean()) {
      return ParamError(kParam, "response_format.json_schema.strict must be a boolean");
    }
    const json* schema = Field(*spec, "schema");
    if (schema == nullptr || !schema->is_object()) {
      return ParamError(kParam, "response_format.json_schema.schema must be a JSON schema object");
    }
    return AddSchema(kParam, *schema, {"response_format", "json_schema", "schema"});
  }

  // vLLM's `structured_outputs`: {json | regex | grammar | choice | json_object: true}.
  absl::Status ReadStructuredOutputs() {
    const json* v = Field(body_, "structured_outputs");
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_object())
      return ParamError("structured_outputs", "structured_outputs must be an object");
    if (const json* j = Field(*v, "json")) {
      TANDEM_RETURN_IF_ERROR(
          AddSchema("structured_outputs.json", *j, {"structured_outputs", "json"}));
    }
    TANDEM_RETURN_IF_ERROR(
        ReadString(*v, "regex", "structured_outputs.regex", engine::ConstraintKind::kRegex));
    TANDEM_RETURN_IF_ERROR(
        ReadString(*v, "grammar", "structured_outputs.grammar", engine::ConstraintKind::kGrammar));
    if (const json* c = Field(*v, "choice")) {
      TANDEM_RETURN_IF_ERROR(AddChoice("structured_outputs.choice", *c));
    }
    if (const json* o = Field(*v, "json_object")) {
      if (!o->is_boolean()) {
        return ParamError("structured_outputs.json_object",
                          "structured_outputs.json_object must be a boolean");
      }
      if (o->get<bool>())
        Add("structured_outputs.json_object", engine::ConstraintKind::kJsonObject, "");
    }
    return absl::OkStatus();
  }

  // `v` as JSON text, from the raw body when there is one (nlohmann::json sorts keys).
  std::string OrderedDump(const json& v, const std::vector<std::string>& path) {
    if (!raw_.empty()) {
      if (!ordered_) {
        ordered_ = nlohmann::ordered_json::parse(raw_, nullptr, /*allow_exceptions=*/false);
      }
      const nlohmann::ordered_json* at = &*ordered_;
      for (const std::string& key : path) {
        if (!at->is_object()) break;
        auto it = at->find(key);
        if (it == at->end()) {
          at = nullptr;
          break;
        }
        at = &*it;
      }
      if (at != nullptr && at->is_object()) {
        return at->dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
      }
    }
    return v.dump(-1, ' ', false, json::error_handler_t::replace);
  }

  const json& body_;
  std::string_view raw_;
  std::optional<nlohmann::ordered_json> ordered_;
  std::vector<Found> found_;
};

}  // namespace

absl::StatusOr<std::vector<int32_t>> ParseTokenIds(const json& array, const char* param,
                                                   int vocab_size) {
  if (!array.is_array()) {
    return ParamError(param, absl::StrCat(param, " must be an array of token ids"));
  }
  std::vector<int32_t> ids;
  TANDEM_RETURN_IF_ERROR(ReadTokenIds(array, param, vocab_size, &ids));
  return ids;
}

absl::Status ParamError(std::string_view param, std::string_view message) {
  absl::Status status = absl::InvalidArgumentError(std::string(message));
  status.SetPayload(kParamPayload, absl::Cord(std::string(param)));
  return status;
}

absl::Status WithErrorCode(absl::Status status, std::string_view code) {
  status.SetPayload(kCodePayload, absl::Cord(std::string(code)));
  return status;
}

std::string ParamOf(const absl::Status& status) {
  auto payload = status.GetPayload(kParamPayload);
  return payload ? std::string(*payload) : "";
}

std::string ErrorCodeOf(const absl::Status& status) {
  auto payload = status.GetPayload(kCodePayload);
  return payload ? std::string(*payload) : "";
}

std::string ErrorBody(int http_status, std::string_view message, std::string_view param,
                      std::string_view code) {
  std::string type = "invalid_request_error";
  if (http_status >= 500) type = "server_error";
  json error = {{"message", std::string(message)},
                {"type", type},
                {"param", param.empty() ? json(nullptr) : json(std::string(param))},
                {"code", code.empty() ? json(nullptr) : json(std::string(code))}};
  return json{{"error", error}}.dump(-1, ' ', false, json::error_handler_t::replace);
}

absl::StatusOr<json> ParseJsonObject(std::string_view body) {
  // nlohmann's parser copes with any depth, but nothing Tandem reads nests deeply, and a
  // shallow document is cheap to handle everywhere else.
  int depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (char c : body) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonDepth) {
        return absl::InvalidArgumentError(
            absl::StrCat("request body nests deeper than ", kMaxJsonDepth, " levels"));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  if (body.find_first_not_of(" \t\r\n") == std::string_view::npos) {
    return absl::InvalidArgumentError("request body is empty; expected a JSON object");
  }
  json parsed;
  try {
    parsed = json::parse(body.begin(), body.end());
  } catch (const json::parse_error& e) {
    // e.what() quotes the last token read, which may be most of the input: keep the reason only.
    std::string what = e.what();
    std::string reason;
    size_t start = what.find(" - ");
    if (start != std::string::npos) {
      size_t end = what.find("; last read", start);
      reason =
          what.substr(start + 3, end == std::string::npos ? std::string::npos : end - start - 3);
    }
    return absl::InvalidArgumentError(
        absl::StrCat("request body is not valid JSON (",
                     Excerpt(reason.empty() ? "syntax error" : reason), " at byte ", e.byte, ")"));
  } catch (const std::exception&) {
    return absl::InvalidArgumentError("request body is not valid JSON");
  }
  if (!parsed.is_object()) return absl::InvalidArgumentError("request body must be a JSON object");
  return parsed;
}

absl::StatusOr<json> NormalizeMessages(const json& messages) {
  if (!messages.is_array()) {
    return ParamError("messages", "messages must be an array of message objects");
  }
  if (messages.empty()) return ParamError("messages", "messages must not be empty");
  if (messages.size() > static_cast<size_t>(kMaxMessagesPerRequest)) {
    return ParamError("messages", absl::StrCat("messages may hold at most ", kMaxMessagesPerRequest,
                                               " messages, got ", messages.size()));
  }
  json out = json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string where = absl::StrCat("messages[", i, "]");
    if (!m.is_object()) return ParamError("messages", where + " must be an object");
    const json* role_v = Field(m, "role");
    if (role_v == nullptr || !role_v->is_string()) {
      return ParamError("messages", where + ".role must be a string");
    }
    std::string role = role_v->get<std::string>();
    if (role == "developer") role = "system";  // the newer name of the system role
    if (role == "function") {
      return ParamError("messages", absl::StrCat(where,
                                                 ".role 'function' is not supported by this "
                                                 "server; use role 'tool'"));
    }
    if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
      return ParamError("messages", absl::StrCat(where,
                                                 ".role must be one of system, developer, user, "
                                                 "assistant, tool; got '",
                                                 Excerpt(role), "'"));
    }
    json tool_calls = nullptr;
    if (const json* calls = Field(m, "tool_calls")) {
      if (role != "assistant") {
        return ParamError("messages", where + ".tool_calls is only allowed on assistant messages");
      }
      TANDEM_ASSIGN_OR_RETURN(tool_calls, NormalizeToolCalls(*calls, where + ".tool_calls"));
    }
    std::string content;
    const json* c = Field(m, "content");
    if (c == nullptr) {
      if (role != "assistant") return ParamError("messages", where + ".content is required");
    } else if (c->is_string()) {
      content = c->get<std::string>();
    } else if (c->is_array()) {
      for (size_t j = 0; j < c->size(); ++j) {
        const json& part = (*c)[j];
        const std::string pwhere = absl::StrCat(where, ".content[", j, "]");
        if (!part.is_object()) return ParamError("messages", pwhere + " must be an object");
        const json* type = Field(part, "type");
        if (type == nullptr || !type->is_string()) {
          return ParamError("messages", pwhere + ".type must be a string");
        }
        if (type->get<std::string>() != "text") {
          return ParamError("messages",
                            absl::StrCat(pwhere, ": part type '", Excerpt(type->get<std::string>()),
                                         "' is not supported; only 'text' parts are"));
        }
        const json* text = Field(part, "text");
        if (text == nullptr || !text->is_string()) {
          return ParamError("messages", pwhere + ".text must be a string");
        }
        if (j > 0) content += "\n";
        content += text->get<std::string>();
      }
    } else {
      return ParamError("messages", where + ".content must be a string or an array of text parts");
    }
    json normalized = {{"role", role}, {"content", content}};
    if (const json* name = Field(m, "name")) {
      if (!name->is_string()) return ParamError("messages", where + ".name must be a string");
      normalized["name"] = *name;
    }
    if (!tool_calls.is_null()) normalized["tool_calls"] = std::move(tool_calls);
    if (const json* id = Field(m, "tool_call_id")) {
      if (role != "tool") {
        return ParamError("messages", where + ".tool_call_id is only allowed on tool messages");
      }
      if (!id->is_string()) return ParamError("messages", where + ".tool_call_id must be a string");
      normalized["tool_call_id"] = *id;
    }
    out.push_back(std::move(normalized));
  }
  return out;
}

absl::Status AttachParam(absl::Status status, ApiKind kind) {
  if (status.ok() || !ParamOf(status).empty()) return status;
  const std::string message(status.message());
  const char* prompt_param = kind == ApiKind::kChat ? "messages" : "prompt";
  if (absl::StartsWith(message, "this model's maximum context length") ||
      absl::StartsWith(message, "the prompt (")) {
    absl::Status out = ParamError(prompt_param, message);
    return WithErrorCode(out, "context_length_exceeded");
  }
  if (absl::StartsWith(message, "prompt")) return ParamError(prompt_param, message);
  if (absl::StartsWith(message, "stop ") || absl::StartsWith(message, "each stop string")) {
    return ParamError("stop", message);
  }
  size_t end = message.find_first_not_of("abcdefghijklmnopqrstuvwxyz_");
  std::string word = message.substr(0, end);
  for (const char* known : {"temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                            "presence_penalty", "frequency_penalty", "max_tokens", "min_tokens",
                            "n", "stop_token_ids", "seed", "logit_bias"}) {
    if (word == known) return ParamError(word, message);
  }
  if (word == "logprobs") {
    return ParamError(kind == ApiKind::kChat ? "top_logprobs" : "logprobs", message);
  }
  return status;
}

absl::StatusOr<CompletionRequest> ParseCompletionRequest(const json& body, ApiKind kind,
                                                         int vocab_size,
                                                         std::string_view raw_body) {
  CompletionRequest r;
  r.kind = kind;
  engine::SamplingParams& p = r.params;
  if (const json* v = Field(body, "model")) {
    if (!v->is_string()) return ParamError("model", "model must be a string");
    r.model = v->get<std::string>();
  }
  if (kind == ApiKind::kCompletion) {
    for (const char* name : {"tools", "tool_choice", "parallel_tool_calls"}) {
      if (Field(body, name) != nullptr) {
        return ParamError(name, absl::StrCat(name, " is only supported on /v1/chat/completions"));
      }
    }
    TANDEM_RETURN_IF_ERROR(ReadPrompt(body, vocab_size, &r));
  } else {
    const json* m = Field(body, "messages");
    if (m == nullptr) return ParamError("messages", "messages is required");
    TANDEM_ASSIGN_OR_RETURN(r.messages, NormalizeMessages(*m));
    r.add_special_tokens = false;  // the chat template writes the special tokens it wants
    // The tools' schemas keep the client's key order (the order the model is shown properties
    // in and generates them in), from the raw body when there is one.
    std::optional<nlohmann::ordered_json> ordered;
    if (Field(body, "tools") != nullptr && !raw_body.empty()) {
      ordered = nlohmann::ordered_json::parse(raw_body, nullptr, /*allow_exceptions=*/false);
      if (ordered->is_discarded()) ordered.reset();
    }
    TANDEM_ASSIGN_OR_RETURN(r.tools, ParseToolRequest(body, ordered ? &*ordered : nullptr));
    TANDEM_RETURN_IF_ERROR(ReadBool(body, "add_generation_prompt", &r.add_generation_prompt));
  }
  TANDEM_RETURN_IF_ERROR(ReadBool(body, "add_special_tokens", &r.add_special_tokens));

  if (const json* v = Field(body, "cache_salt")) {
    if (!v->is_string()) return ParamError("cache_salt", "cache_salt must be a string");
    r.cache_salt = v->get<std::string>();
    if (r.cache_salt.size() > kMaxCacheSaltBytes) {
      return ParamError("cache_salt",
                        absl::StrCat("cache_salt may hold at most ", kMaxCacheSaltBytes, " bytes"));
    }
  }

  TANDEM_RETURN_IF_ERROR(ReadBool(body, "stream", &r.stream));
  if (const json* v = Field(body, "stream_options")) {
    if (!v->is_object()) return ParamError("stream_options", "stream_options must be an object");
    if (!r.stream) {
      return ParamError("stream_options", "stream_options is only allowed when stream is true");
    }
    auto usage = v->find("include_usage");
    if (usage != v->end() && !usage->is_null()) {
      if (!usage->is_boolean()) {
        return ParamError("stream_options", "stream_options.include_usage must be a boolean");
      }
      r.include_usage = usage->get<bool>();
    }
  }

  TANDEM_RETURN_IF_ERROR(ReadInt32(body, "n", 1, &p.n));
  if (p.n > engine::kMaxSamplesPerRequest) {
    return ParamError("n", absl::StrCat("n must be an integer in [1, ",
                                        engine::kMaxSamplesPerRequest, "], got ", p.n));
  }
  TANDEM_RETURN_IF_ERROR(RefuseUnsupported(body));
  TANDEM_RETURN_IF_ERROR(ReadCompletionExtras(body, kind, p.n, r.stream, &r));
  TANDEM_ASSIGN_OR_RETURN(p.structured, ConstraintReader(body, raw_body).Read());

  std::optional<int64_t> max_tokens;
  const int64_t kIntMax = std::numeric_limits<int32_t>::max();
  TANDEM_RETURN_IF_ERROR(ReadInt(body, "max_tokens", 1, kIntMax, &max_tokens));
  if (kind == ApiKind::kChat) {
    std::optional<int64_t> max_completion_tokens;
    TANDEM_RETURN_IF_ERROR(
        ReadInt(body, "max_completion_tokens", 1, kIntMax, &max_completion_tokens));
    if (max_completion_tokens) max_tokens = max_completion_tokens;
  }
  if (max_tokens) r.max_tokens = static_cast<int>(*max_tokens);

  TANDEM_RETURN_IF_ERROR(ReadFloat(body, "temperature", &p.temperature));
  TANDEM_RETURN_IF_ERROR(ReadFloat(body, "top_p", &p.top_p));
  TANDEM_RETURN_IF_ERROR(ReadInt32(body, "top_k", std::numeric_limits<int32_t>::min(), &p.top_k));
  TANDEM_RETURN_IF_ERROR(ReadFloat(body, "min_p", &p.min_p));
  TANDEM_RETURN_IF_ERROR(ReadFloat(body, "presence_penalty", &p.presence_penalty));
  TANDEM_RETURN_IF_ERROR(ReadFloat(body, "frequency_penalty", &p.frequency_penalty));
  TANDEM_RETURN_IF_ERROR(ReadFloat(body, "repetition_penalty", &p.repetition_penalty));
  TANDEM_RETURN_IF_ERROR(ReadInt32(body, "min_tokens", 0, &p.min_tokens));
  TANDEM_RETURN_IF_ERROR(ReadBool(body, "ignore_eos", &p.ignore_eos));
  TANDEM_RETURN_IF_ERROR(ReadBool(body, "skip_special_tokens", &p.skip_special_tokens));
  TANDEM_RETURN_IF_ERROR(
      ReadBool(body, "include_stop_str_in_output", &p.include_stop_str_in_output));
  if (const json* v = Field(body, "seed")) {
    if (v->is_number_unsigned()) {
      p.seed = v->get<uint64_t>();
    } else if (v->is_number_integer()) {
      p.seed = static_cast<uint64_t>(v->get<int64_t>());
    } else {
      return ParamError("seed", "seed must be an integer");
    }
  }
  TANDEM_RETURN_IF_ERROR(ReadStop(body, &p));
  TANDEM_RETURN_IF_ERROR(ReadLogitBias(body, vocab_size, &p));
  if (const json* v = Field(body, "stop_token_ids")) {
    if (!v->is_array()) return ParamError("stop_token_ids", "stop_token_ids must be an array");
    if (v->size() > static_cast<size_t>(engine::kMaxStopTokenIds)) {
      return ParamError("stop_token_ids", absl::StrCat("stop_token_ids may hold at most ",
                                                       engine::kMaxStopTokenIds, " ids"));
    }
    TANDEM_RETURN_IF_ERROR(ReadTokenIds(*v, "stop_token_ids", vocab_size, &p.stop_token_ids));
  }

  if (kind == ApiKind::kCompletion) {
    std::optional<int64_t> logprobs;
    TANDEM_RETURN_IF_ERROR(ReadInt(body, "logprobs", 0, engine::kMaxTopLogprobs, &logprobs));
    p.logprobs = logprobs ? static_cast<int>(*logprobs) : -1;
    if (r.echo && logprobs) {
      return ParamError(
          "echo",
          "echo with logprobs needs the prompt's logprobs, which this server does not "
          "compute; drop one of them");
    }
  } else {
    bool logprobs = false;
    TANDEM_RETURN_IF_ERROR(ReadBool(body, "logprobs", &logprobs));
    std::optional<int64_t> top;
    TANDEM_RETURN_IF_ERROR(ReadInt(body, "top_logprobs", 0, engine::kMaxTopLogprobs, &top));
    if (top && !logprobs) {
      return ParamError("top_logprobs", "top_logprobs requires logprobs to be true");
    }
    p.logprobs = logprobs ? static_cast<int>(top.value_or(0)) : -1;
  }

  // Chat's default max_tokens depends on the prompt length; until then check with the most
  // permissive value so min_tokens is not refused early.
  p.max_tokens = r.max_tokens.value_or(kind == ApiKind::kChat ? static_cast<int>(kIntMax) : 16);
  TANDEM_RETURN_IF_ERROR(AttachParam(p.Validate(vocab_size), kind));
  return r;
}

absl::StatusOr<EmbeddingRequest> ParseEmbeddingRequest(const json& body, int vocab_size,
                                                       int hidden_size) {
  EmbeddingRequest r;
  if (const json* v = Field(body, "model")) {
    if (!v->is_string()) return ParamError("model", "model must be a string");
    r.model = v->get<std::string>();
  }
  const json* v = Field(body, "input");
  const std::string kType =
      "input must be a string, an array of strings, an array of token ids, or an array of "
      "token-id arrays";
  if (v == nullptr) return ParamError("input", "input is required");
  if (v->is_string()) {
    if (v->get_ref<const std::string&>().empty()) {
      return ParamError("input", "input must not be an empty string");
    }
    r.inputs.push_back({v->get<std::string>(), {}});
  } else if (!v->is_array()) {
    return ParamError("input", kType);
  } else if (v->empty()) {
    return ParamError("input", "input must not be an empty array");
  } else if (v->front().is_number()) {
    CompletionRequest::Prompt p;
    TANDEM_RETURN_IF_ERROR(ReadTokenIds(*v, "input", vocab_size, &p.tokens));
    r.inputs.push_back(std::move(p));
  } else if (!v->front().is_string() && !v->front().is_array()) {
    return ParamError("input", kType);
  } else {
    if (v->size() > static_cast<size_t>(kMaxEmbeddingInputs)) {
      return ParamError("input", absl::StrCat("input may hold at most ", kMaxEmbeddingInputs,
                                              " items, got ", v->size()));
    }
    const bool strings = v->front().is_string();
    for (size_t i = 0; i < v->size(); ++i) {
      const json& item = (*v)[i];
      CompletionRequest::Prompt p;
      if (strings) {
        if (!item.is_string()) {
          return ParamError("input", absl::StrCat("input[", i, "] must be a string, as the first"));
        }
        if (item.get_ref<const std::string&>().empty()) {
          return ParamError("input", absl::StrCat("input[", i, "] must not be an empty string"));
        }
        p.text = item.get<std::string>();
      } else {
        if (!item.is_array()) {
          return ParamError(
              "input", absl::StrCat("input[", i, "] must be an array of token ids, as the first"));
        }
        if (item.empty()) {
          return ParamError("input", absl::StrCat("input[", i, "] must not be empty"));
        }
        TANDEM_RETURN_IF_ERROR(ReadTokenIds(item, "input", vocab_size, &p.tokens));
      }
      r.inputs.push_back(std::move(p));
    }
  }
  if (const json* f = Field(body, "encoding_format")) {
    if (!f->is_string() || (*f != "float" && *f != "base64")) {
      return ParamError(
          "encoding_format",
          absl::StrCat("encoding_format must be \"float\" or \"base64\", got ", ShortDump(*f)));
    }
    r.base64 = *f == "base64";
  }
  std::optional<int64_t> dimensions;
  TANDEM_RETURN_IF_ERROR(
      ReadInt(body, "dimensions", 1, std::numeric_limits<int32_t>::max(), &dimensions));
  if (dimensions && *dimensions != hidden_size) {
    return ParamError(
        "dimensions",
        absl::StrCat("dimensions must be this model's hidden size, ", hidden_size,
                     " (or absent): its embeddings cannot be shortened; got ", *dimensions));
  }
  if (const json* u = Field(body, "user"); u != nullptr && !u->is_string()) {
    return ParamError("user", "user must be a string");
  }
  TANDEM_RETURN_IF_ERROR(ReadBool(body, "add_special_tokens", &r.add_special_tokens));
  std::optional<int64_t> truncate;
  TANDEM_RETURN_IF_ERROR(
      ReadInt(body, "truncate_prompt_tokens", -1, std::numeric_limits<int32_t>::max(), &truncate));
  if (truncate) {
    if (*truncate == 0) {
      return ParamError("truncate_prompt_tokens",
                        "truncate_prompt_tokens must be -1 (the context length) or at least 1");
    }
    r.truncate_prompt_tokens = static_cast<int>(*truncate);
  }
  bool normalize = true;
  TANDEM_RETURN_IF_ERROR(ReadBool(body, "normalize", &normalize));
  if (!normalize) {
    return ParamError("normalize", "Tandem returns L2-normalised embeddings only");
  }
  return r;
}

}  // namespace tandem::router
