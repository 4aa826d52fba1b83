// Test-only: random JSON schemas of the supported subset, random documents valid against them,
// and an independent validator for the subset (it shares no code with the grammar side).
#pragma once

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace tandem::grammar::testing {

using ordered_json = nlohmann::ordered_json;

class SchemaFuzzer {
 public:
  explicit SchemaFuzzer(uint32_t seed) : rng_(seed) {}

  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool Coin(double p = 0.5) { return std::bernoulli_distribution(p)(rng_); }
  std::mt19937& rng() { return rng_; }

  // A schema with an optional $defs block referenced from inside.
  ordered_json Schema() {
    defs_ = ordered_json::object();
    ordered_json s = Sub(0);
    if (Coin(0.5)) {
      ordered_json def = ObjectSchema(2);
      defs_["item"] = def;
      s = {{"type", "object"},
           {"properties", {{"main", s}, {"extra", {{"$ref", "#/$defs/item"}}}}},
           {"required", {"main"}},
           {"additionalProperties", false}};
    }
    if (!defs_.empty()) s["$defs"] = defs_;
    return s;
  }

  std::string RandomString(int min_len, int max_len) {
    static const std::vector<std::string> kPieces = {"a", "b", "z",  "Q",  "0",  "7",
                                                     " ", "-", "\"", "\\", "\n", "\t",
                                                     "/", "é", "日", "😀",  "{",  "}"};
    int n = Uniform(min_len, max_len);
    std::string s;
    for (int i = 0; i < n; ++i) s += kPieces[Uniform(0, kPieces.size() - 1)];
    return s;
  }

  // A document valid against `s` (`root` resolves $ref), keys in declaration order.
  ordered_json Document(const ordered_json& s, const ordered_json& root, int depth = 0) {
    if (s.contains("$ref")) {
      return Document(root.at(ordered_json::json_pointer(s["$ref"].get<std::string>().substr(1))),
                      root, depth);
    }
    if (s.contains("const")) return s["const"];
    if (s.contains("enum")) return s["enum"][Uniform(0, s["enum"].size() - 1)];
    if (s.contains("anyOf"))
      return Document(s["anyOf"][Uniform(0, s["anyOf"].size() - 1)], root, depth);
    if (!s.contains("type")) return AnyValue(depth);
    std::string type = s["type"].is_array()
                           ? s["type"][Uniform(0, s["type"].size() - 1)].get<std::string>()
                           : s["type"].get<std::string>();
    if (type == "null") return nullptr;
    if (type == "boolean") return Coin();
    if (type == "integer") return Uniform(-100000, 100000);
    if (type == "number") return Uniform(-100000, 100000) / 64.0;
    if (type == "string") {
      int min = s.value("minLength", 0), max = s.value("maxLength", min + 6);
      return RandomString(min, max);
    }
    if (type == "array") {
      int min = s.value("minItems", 0), max = s.value("maxItems", min + 3);
      ordered_json a = ordered_json::array();
      int n = Uniform(min, max);
      for (int i = 0; i < n; ++i)
        a.push_back(s.contains("items") ? Document(s["items"], root, depth + 1)
                                        : AnyValue(depth + 1));
      return a;
    }
    ordered_json o = ordered_json::object();
    if (!s.contains("properties")) return o;
    std::vector<std::string> required = s.value("required", std::vector<std::string>{});
    for (const auto& [key, sub] : s["properties"].items()) {
      bool must = std::find(required.begin(), required.end(), key) != required.end();
      if (must || Coin()) o[key] = Document(sub, root, depth + 1);
    }
    return o;
  }

  ordered_json AnyValue(int depth) {
    switch (Uniform(0, depth > 2 ? 3 : 5)) {
      case 0:
        return nullptr;
      case 1:
        return Coin();
      case 2:
        return Uniform(-50, 50);
      case 3:
        return RandomString(0, 4);
      case 4:
        return ordered_json::array({AnyValue(depth + 1), AnyValue(depth + 1)});
      default:
        return ordered_json{{RandomString(1, 3), AnyValue(depth + 1)}};
    }
  }

 private:
  ordered_json ObjectSchema(int depth) {
    ordered_json props = ordered_json::object();
    ordered_json required = ordered_json::array();
    int n = Uniform(0, 4);
    for (int i = 0; i < n; ++i) {
      std::string key = Coin(0.8) ? "k" + std::to_string(i) : "k\"é" + std::to_string(i);
      props[key] = Sub(depth + 1);
      if (Coin(0.6)) required.push_back(key);
    }
    return {{"type", "object"},
            {"properties", props},
            {"required", required},
            {"additionalProperties", false}};
  }

  ordered_json Sub(int depth) {
    int kind = Uniform(0, depth >= 3 ? 6 : 10);
    switch (kind) {
      case 0:
        return {{"type", "string"}};
      case 1: {
        int min = Uniform(0, 3);
        return {{"type", "string"}, {"minLength", min}, {"maxLength", min + Uniform(0, 4)}};
      }
      case 2:
        return {{"type", "integer"}};
      case 3:
        return {{"type", "number"}};
      case 4:
        return {{"type", "boolean"}};
      case 5:
        return {{"enum", {"red", "gr\"een", 3, nullptr, true}}};
      case 6:
        return {{"type", {"string", "null"}}, {"format", "date-time"}};
      case 7:
      case 8:
        return ObjectSchema(depth);
      case 9: {
        ordered_json a = {{"type", "array"}, {"items", Sub(depth + 1)}};
        if (Coin()) a["minItems"] = Uniform(0, 2);
        if (Coin()) a["maxItems"] = a.value("minItems", 0) + Uniform(0, 3);
        return a;
      }
      default:
        return {{"anyOf", {Sub(depth + 1), Sub(depth + 1)}}};
    }
  }

  std::mt19937 rng_;
  ordered_json defs_;
};

// Code points of a UTF-8 string.
inline size_t CodePoints(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

// Whether some object in `text` (JSON) names a key twice; false when `text` is not JSON.
inline bool HasDuplicateKeys(std::string_view text) {
  struct Handler : nlohmann::json_sax<ordered_json> {
    std::vector<std::vector<std::string>> keys;
    bool duplicate = false;
    bool null() override { return true; }
    bool boolean(bool) override { return true; }
    bool number_integer(number_integer_t) override { return true; }
    bool number_unsigned(number_unsigned_t) override { return true; }
    bool number_float(number_float_t, const string_t&) override { return true; }
    bool string(string_t&) override { return true; }
    bool binary(binary_t&) override { return true; }
    bool start_object(std::size_t) override {
      keys.emplace_back();
      return true;
    }
    bool key(string_t& k) override {
      auto& seen = keys.back();
      duplicate |= std::find(seen.begin(), seen.end(), k) != seen.end();
      seen.push_back(k);
      return true;
    }
    bool end_object() override {
      keys.pop_back();
      return true;
    }
    bool start_array(std::size_t) override { return true; }
    bool end_array() override { return true; }
    bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
      return false;
    }
  } handler;
  ordered_json::sax_parse(text, &handler, nlohmann::detail::input_format_t::json,
                          /*strict=*/true);
  return handler.duplicate;
}

// The subset's validation rules, written from the JSON Schema specification, plus the one
// thing the grammars fix that JSON Schema leaves open: properties come in the schema's order.
inline bool Validate(const ordered_json& s, const ordered_json& root, const ordered_json& doc) {
  if (s.is_boolean()) return s.get<bool>();
  if (s.contains("$ref")) {
    return Validate(root.at(ordered_json::json_pointer(s["$ref"].get<std::string>().substr(1))),
                    root, doc);
  }
  if (s.contains("const") && doc != s["const"]) return false;
  if (s.contains("enum")) {
    bool found = false;
    for (const auto& v : s["enum"]) found |= (v == doc);
    if (!found) return false;
  }
  if (s.contains("anyOf")) {
    bool any = false;
    for (const auto& sub : s["anyOf"]) any |= Validate(sub, root, doc);
    if (!any) return false;
  }
  if (s.contains("type")) {
    std::vector<std::string> types;
    if (s["type"].is_array()) {
      for (const auto& t : s["type"]) types.push_back(t);
    } else {
      types.push_back(s["type"]);
    }
    bool ok = false;
    for (const auto& t : types) {
      ok |= (t == "null" && doc.is_null()) || (t == "boolean" && doc.is_boolean()) ||
            (t == "integer" && doc.is_number_integer()) || (t == "number" && doc.is_number()) ||
            (t == "string" && doc.is_string()) || (t == "array" && doc.is_array()) ||
            (t == "object" && doc.is_object());
    }
    if (!ok) return false;
  }
  if (doc.is_string()) {
    size_t n = CodePoints(doc.get<std::string>());
    if (s.contains("minLength") && n < s["minLength"].get<size_t>()) return false;
    if (s.contains("maxLength") && n > s["maxLength"].get<size_t>()) return false;
  }
  if (doc.is_array()) {
    if (s.contains("minItems") && doc.size() < s["minItems"].get<size_t>()) return false;
    if (s.contains("maxItems") && doc.size() > s["maxItems"].get<size_t>()) return false;
    if (s.contains("items")) {
      for (const auto& item : doc) {
        if (!Validate(s["items"], root, item)) return false;
      }
    }
  }
  if (doc.is_object()) {
    if (s.contains("required")) {
      for (const auto& r : s["required"]) {
        if (!doc.contains(r.get<std::string>())) return false;
      }
    }
    if (s.contains("properties")) {
      // The grammars write properties in the schema's order.
      int last = -1;
      for (const auto& [key, value] : doc.items()) {
        int at = 0;
        for (const auto& [declared, unused] : s["properties"].items()) {
          if (declared == key) break;
          ++at;
        }
        if (at < last) return false;
        last = at;
      }
      for (const auto& [key, value] : doc.items()) {
        if (!s["properties"].contains(key)) {
          if (s.value("additionalProperties", true) == false) return false;
          continue;
        }
        if (!Validate(s["properties"][key], root, value)) return false;
      }
    } else if (s.contains("additionalProperties") && s["additionalProperties"] == false &&
               !doc.empty()) {
      return false;
    }
  }
  return true;
}

}  // namespace tandem::grammar::testing
