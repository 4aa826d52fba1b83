// JSON schema -> GBNF: one rule per subschema, shared rules for JSON's lexical pieces.
#include "tandem/grammar/json_schema.h"

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "tandem/base/status_macros.h"

namespace tandem::grammar {
namespace {

using json = nlohmann::ordered_json;

// JSON's lexical rules, shared by every schema grammar and by json_object.
constexpr const char* kJsonRules = R"(ws ::= [ \t\n\r]{0,20}
string ::= "\"" char* "\""
char ::= [^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4})
integer ::= "-"? ("0" | [1-9] [0-9]{0,17})
number ::= integer ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,2})?
boolean ::= "true" | "false"
null ::= "null"
value ::= object | array | string | number | boolean | null
object ::= "{" ws ( string ws ":" ws value ws ( "," ws string ws ":" ws value ws )* )? "}"
array ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
)";

// Keywords that only describe: ignored.
const std::set<std::string> kAnnotations = {
    "title",       "description", "default",  "examples",         "$schema",        "$id",
    "$comment",    "deprecated",  "readOnly", "writeOnly",        "format",         "$defs",
    "definitions", "strict",      "name",     "contentMediaType", "contentEncoding"};
const std::set<std::string> kKnown = {"type",    "properties", "required",  "additionalProperties",
                                      "enum",    "const",      "minLength", "maxLength",
                                      "pattern", "items",      "minItems",  "maxItems",
                                      "anyOf",   "$ref"};

std::string Literal(std::string_view s) { return GbnfLiteral(s); }

class SchemaConverter {
 public:
  // `prefix` starts the name of every rule the schema needs (none but JSON's lexical rules).
  SchemaConverter(const json& root, std::string prefix = "")
      : root_(root), prefix_(std::move(prefix)) {}

  // The schema's rules, the document being rule `root_name`, without JSON's lexical rules.
  absl::StatusOr<std::string> Rules(std::string_view root_name) {
    TANDEM_ASSIGN_OR_RETURN(std::string expr, Visit(root_, ""));
    std::string out = absl::StrCat(std::string(root_name), " ::= ", expr, "\n");
    for (const auto& [name, body] : rules_) absl::StrAppend(&out, name, " ::= ", body, "\n");
    return out;
  }

  absl::StatusOr<std::string> Convert() {
    TANDEM_ASSIGN_OR_RETURN(std::string rules, Rules("root"));
    return rules + kJsonRules;
  }

 private:
  static absl::Status Error(const std::string& path, std::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(
        "json schema: at '", path.empty() ? "#" : "#" + path, "': ", std::string(what)));
  }

  std::string NewRule(const std::string& path, std::string body) {
    std::string name;
    for (char c : path) {
      bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
      name += ok ? c : '-';
    }
    name = absl::StrCat(prefix_, "s", name, "-", rules_.size());
    rules_[name] = std::move(body);
    return name;
  }

  absl::StatusOr<std::string> Resolve(const std::string& ref, const std::string& path) {
    auto it = refs_.find(ref);
    if (it != refs_.end()) return it->second;
    if (ref.empty() || ref[0] != '#')
      return Error(path,
                   absl::StrCat("$ref '", ref, "' is not local (only '#...' refs are supported)"));
    const json* target = &root_;
    if (ref != "#") {
      try {
        target = &root_.at(json::json_pointer(ref.substr(1)));
      } catch (const json::exception&) {
        return Error(path, absl::StrCat("$ref '", ref, "' points nowhere"));
      }
    }
    // Name the rule before visiting, so recursive references find it.
    std::string name = absl::StrCat(prefix_, "ref", refs_.size());
    refs_[ref] = name;
    rules_[name] = "";
    TANDEM_ASSIGN_OR_RETURN(std::string body, Visit(*target, ref.substr(1)));
    rules_[name] = body;
    return name;
  }

  absl::StatusOr<std::string> Visit(const json& s, const std::string& path) {
    // The converter recurses once per nested subschema.
    if (path.size() > 4096 || ++depth_ > 128) {
      return Error(path.substr(0, 64), "schema nested too deeply");
    }
    absl::StatusOr<std::string> out = VisitSchema(s, path);
    --depth_;
    return out;
  }

  absl::StatusOr<std::string> VisitSchema(const json& s, const std::string& path) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return std::string("value");
      return Error(path, "the schema 'false' matches nothing");
    }
    if (!s.is_object()) return Error(path, "a schema must be an object or a boolean");
    for (const auto& [key, v] : s.items()) {
      if (!kKnown.contains(key) && !kAnnotations.contains(key)) {
        return Error(path, absl::StrCat("keyword '", key, "' is not supported"));
      }
    }
    if (s.contains("$ref")) {
      if (!s["$ref"].is_string()) return Error(path, "'$ref' must be a string");
      return Resolve(s["$ref"].get<std::string>(), path);
    }
    if (s.contains("const")) return Literal(s["const"].dump());
    if (s.contains("enum")) {
      if (!s["enum"].is_array() || s["enum"].empty()) {
        return Error(path, "'enum' must be a non-empty array");
      }
      std::vector<std::string> alternatives;
      for (const json& v : s["enum"]) alternatives.push_back(Literal(v.dump()));
      return absl::StrCat("(", absl::StrJoin(alternatives, " | "), ")");
    }
    if (s.contains("anyOf")) {
      const json& any = s["anyOf"];
      if (!any.is_array() || any.empty()) return Error(path, "'anyOf' must be a non-empty array");
      std::vector<std::string> alternatives;
      for (size_t i = 0; i < any.size(); ++i) {
        TANDEM_ASSIGN_OR_RETURN(std::string alt, Visit(any[i], absl::StrCat(path, "/anyOf/", i)));
        alternatives.push_back(alt);
      }
      return NewRule(path, absl::StrJoin(alternatives, " | "));
    }
    if (!s.contains("type")) return std::string("value");
    const json& type = s["type"];
    if (type.is_array()) {
      if (type.empty()) return Error(path, "'type' is an empty list");
      std::vector<std::string> alternatives;
      for (const json& t : type) {
        if (!t.is_string()) return Error(path, "'type' entries must be strings");
        TANDEM_ASSIGN_OR_RETURN(std::string alt, VisitType(s, t.get<std::string>(), path));
        alternatives.push_back(alt);
      }
      return NewRule(path, absl::StrJoin(alternatives, " | "));
    }
    if (!type.is_string()) return Error(path, "'type' must be a string or a list of strings");
    return VisitType(s, type.get<std::string>(), path);
  }

  static absl::StatusOr<int> Count(const json& s, const char* key, const std::string& path,
                                   int fallback) {
    if (!s.contains(key)) return fallback;
    const json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 10000) {
      return Error(path, absl::StrCat("'", key, "' must be an integer from 0 to 10000"));
    }
    return static_cast<int>(v.get<int64_t>());
  }

  absl::StatusOr<std::string> VisitType(const json& s, const std::string& type,
                                        const std::string& path) {
    if (type == "null" || type == "boolean" || type == "integer" || type == "number") {
      return type;
    }
    if (type == "string") return VisitString(s, path);
    if (type == "array") return VisitArray(s, path);
    if (type == "object") return VisitObject(s, path);
    return Error(path, absl::StrCat("unknown type '", type, "'"));
  }

  absl::StatusOr<std::string> VisitString(const json& s, const std::string& path) {
    if (s.contains("pattern")) {
      if (!s["pattern"].is_string()) return Error(path, "'pattern' must be a string");
      if (s.contains("minLength") || s.contains("maxLength")) {
        return Error(path, "'pattern' with 'minLength'/'maxLength' is not supported");
      }
      auto expr = RegexToJsonStringGbnf(s["pattern"].get<std::string>());
      if (!expr.ok()) return Error(path + "/pattern", std::string(expr.status().message()));
      return NewRule(path, absl::StrCat("\"\\\"\" ", *expr, " \"\\\"\""));
    }
    TANDEM_ASSIGN_OR_RETURN(int min, Count(s, "minLength", path, 0));
    TANDEM_ASSIGN_OR_RETURN(int max, Count(s, "maxLength", path, -1));
    if (min == 0 && max == -1) return std::string("string");
    if (max != -1 && max < min) return Error(path, "'maxLength' is below 'minLength'");
    return NewRule(path, absl::StrCat("\"\\\"\" char{", min, ",",
                                      max == -1 ? "" : absl::StrCat(max), "} \"\\\"\""));
  }

  absl::StatusOr<std::string> VisitArray(const json& s, const std::string& path) {
    std::string item = "value";
    if (s.contains("items")) {
      TANDEM_ASSIGN_OR_RETURN(item, Visit(s["items"], path + "/items"));
    }
    TANDEM_ASSIGN_OR_RETURN(int min, Count(s, "minItems", path, 0));
    TANDEM_ASSIGN_OR_RETURN(int max, Count(s, "maxItems", path, -1));
    if (max != -1 && max < min) return Error(path, "'maxItems' is below 'minItems'");
    if (max == 0) return NewRule(path, "\"[\" ws \"]\"");
    std::string more = absl::StrCat("(\",\" ws ", item, " ws){", min > 0 ? min - 1 : 0, ",",
                                    max == -1 ? "" : absl::StrCat(max - 1), "}");
    std::string items = absl::StrCat(item, " ws ", more);
    if (min == 0) items = absl::StrCat("(", items, ")?");
    return NewRule(path, absl::StrCat("\"[\" ws ", items, " \"]\""));
  }

  absl::StatusOr<std::string> VisitObject(const json& s, const std::string& path) {
    const json* additional =
        s.contains("additionalProperties") ? &s["additionalProperties"] : nullptr;
    bool closed = additional != nullptr && additional->is_boolean() && !additional->get<bool>();
    if (!s.contains("properties")) {
      if (s.contains("required") && !s["required"].empty()) {
        return Error(path, "'required' names properties that 'properties' does not define");
      }
      return closed ? NewRule(path, "\"{\" ws \"}\"") : std::string("object");
    }
    if (additional != nullptr && !closed) {
      return Error(path,
                   "'additionalProperties' must be false or absent when 'properties' is given");
    }
    const json& props = s["properties"];
    if (!props.is_object()) return Error(path, "'properties' must be an object");
    std::set<std::string> required;
    if (s.contains("required")) {
      if (!s["required"].is_array()) return Error(path, "'required' must be an array");
      for (const json& r : s["required"]) {
        if (!r.is_string()) return Error(path, "'required' entries must be strings");
        if (!props.contains(r.get<std::string>())) {
          return Error(path, absl::StrCat("required property '", r.get<std::string>(),
                                          "' is not in 'properties'"));
        }
        required.insert(r.get<std::string>());
      }
    }
    // Properties in declaration order; `after_i` is "the properties from i on, some property
    // already written" (each starts with a comma), `first_i` the same with none written yet.
    std::vector<std::string> pairs;
    std::vector<bool> must;
    for (const auto& [key, sub] : props.items()) {
      TANDEM_ASSIGN_OR_RETURN(std::string value,
                              Visit(sub, absl::StrCat(path, "/properties/", key)));
      pairs.push_back(absl::StrCat(Literal(json(key).dump()), " ws \":\" ws ", value, " ws"));
      must.push_back(required.contains(key));
    }
    const size_t n = pairs.size();
    std::string after_next = "\"\"", first_next = "\"\"";
    for (size_t i = n; i-- > 0;) {
      std::string after =
          must[i] ? absl::StrCat("\",\" ws ", pairs[i], " ", after_next)
                  : absl::StrCat("\",\" ws ", pairs[i], " ", after_next, " | ", after_next);
      std::string first = must[i] ? absl::StrCat(pairs[i], " ", after_next)
                                  : absl::StrCat(pairs[i], " ", after_next, " | ", first_next);
      after_next = NewRule(absl::StrCat(path, "-after", i), after);
      first_next = NewRule(absl::StrCat(path, "-first", i), first);
    }
    return NewRule(path, absl::StrCat("\"{\" ws ", first_next, " \"}\""));
  }

  const json& root_;
  const std::string prefix_;
  int depth_ = 0;
  std::map<std::string, std::string> rules_;
  absl::flat_hash_map<std::string, std::string> refs_;
};

}  // namespace

absl::StatusOr<std::string> JsonSchemaToGbnf(const nlohmann::ordered_json& schema) {
  return SchemaConverter(schema).Convert();
}

absl::StatusOr<std::string> JsonSchemaToGbnf(const nlohmann::json& schema) {
  return SchemaConverter(json::parse(schema.dump())).Convert();
}

absl::StatusOr<std::string> JsonSchemaToGbnf(std::string_view schema_text) {
  json schema = json::parse(schema_text, nullptr, /*allow_exceptions=*/false);
  if (schema.is_discarded()) return absl::InvalidArgumentError("json schema: not valid JSON");
  return JsonSchemaToGbnf(schema);
}

absl::StatusOr<std::string> JsonSchemaToGbnfRules(const nlohmann::ordered_json& schema,
                                                  std::string_view name) {
  return SchemaConverter(schema, absl::StrCat(std::string(name), "-")).Rules(name);
}

std::string JsonLexicalGbnf() { return kJsonRules; }

std::string JsonObjectGbnf() { return absl::StrCat("root ::= object\n", kJsonRules); }

std::string GbnfLiteral(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    uint8_t c = ch;
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20 || c == 0x7F) {
      absl::StrAppendFormat(&out, "\\x%02X", c);
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

}  // namespace tandem::grammar
