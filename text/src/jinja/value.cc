// Python semantics of template values: conversion from JSON, str() and repr(), truthiness and
// equality (see value.h).

#include "text/src/jinja/value.h"

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "text/src/jinja/utf8.h"

namespace tandem::text::jinja {
namespace {

// FromJson for either JSON type, on a value `depth` levels down.
template <typename Json>
std::optional<Value> FromJsonAt(const Json& j, int depth) {
  if (depth > kMaxValueNesting) return std::nullopt;
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return Value::None();
    case nlohmann::json::value_t::boolean:
      return Value::Bool(j.template get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Value::Int(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      uint64_t u = j.template get<uint64_t>();
      if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Value::Int(static_cast<int64_t>(u));
      }
      return Value::Float(static_cast<double>(u));
    }
    case nlohmann::json::value_t::number_float:
      return Value::Float(j.template get<double>());
    case nlohmann::json::value_t::string:
      return Value::Str(j.template get<std::string>());
    case nlohmann::json::value_t::array: {
      ValueList items;
      items.reserve(j.size());
      for (const auto& e : j) {
        std::optional<Value> v = FromJsonAt(e, depth + 1);
        if (!v) return std::nullopt;
        items.push_back(std::move(*v));
      }
      return Value::List(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      ValueDict items;
      items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) {
        std::optional<Value> v = FromJsonAt(it.value(), depth + 1);
        if (!v) return std::nullopt;
        items.emplace_back(Value::Str(it.key()), std::move(*v));
      }
      return Value::Dict(std::move(items));
    }
    default:
      return Value::None();
  }
}

// Python's str.isprintable() for one code point: false for controls, separators other than
// the space, format characters, surrogates and private use (unassigned ones are not tracked).
bool IsPyPrintable(uint32_t cp) {
  if (cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD) return false;
  if (cp < 0x600) return true;
  return !((cp >= 0x600 && cp <= 0x605) || cp == 0x61C || cp == 0x6DD || cp == 0x70F ||
           cp == 0x180E || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200F) ||
           (cp >= 0x2028 && cp <= 0x202F) || (cp >= 0x205F && cp <= 0x2064) ||
           (cp >= 0x2066 && cp <= 0x206F) || cp == 0x3000 || (cp >= 0xD800 && cp <= 0xF8FF) ||
           cp == 0xFEFF || (cp >= 0xFFF9 && cp <= 0xFFFB) || cp == 0xFFFE || cp == 0xFFFF ||
           cp == 0x110BD || cp == 0xE0001 || (cp >= 0xE0020 && cp <= 0xE007F) || cp >= 0xF0000);
}

// Python's repr(str): quotes chosen as Python does, non-printable characters escaped.
std::string PyStrRepr(std::string_view s) {
  bool has_single = s.find('\'') != std::string_view::npos;
  bool has_double = s.find('"') != std::string_view::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string r(1, quote);
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = DecodeAt(s, i, &len);
    if (cp == '\\') {
      r += "\\\\";
    } else if (cp == static_cast<uint32_t>(quote)) {
      r += '\\';
      r += quote;
    } else if (cp == '\n') {
      r += "\\n";
    } else if (cp == '\r') {
      r += "\\r";
    } else if (cp == '\t') {
      r += "\\t";
    } else if (!IsPyPrintable(cp)) {
      r += cp <= 0xFF     ? absl::StrFormat("\\x%02x", cp)
           : cp <= 0xFFFF ? absl::StrFormat("\\u%04x", cp)
                          : absl::StrFormat("\\U%08x", cp);
    } else {
      r.append(s.substr(i, len));
    }
    i += len;
  }
  r += quote;
  return r;
}

}  // namespace

std::optional<Value> FromJson(const nlohmann::json& j) { return FromJsonAt(j, 0); }

std::optional<Value> FromJson(const nlohmann::ordered_json& j) { return FromJsonAt(j, 0); }

absl::string_view TypeName(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return v.flavor() == Value::Flavor::kTuple  ? "tuple"
             : v.flavor() == Value::Flavor::kList ? "list"
                                                  : "generator";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kLoop:
      return "LoopContext";
    case Kind::kCallable:
      return "function";
  }
  return "object";
}

std::string PyFloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string_view sci(buf, res.ptr - buf);
  std::string sign;
  if (!sci.empty() && sci[0] == '-') {
    sign = "-";
    sci.remove_prefix(1);
  }
  size_t e = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e)) {
    if (c != '.') digits.push_back(c);
  }
  int exp10 = 0;
  std::string_view exp_text = sci.substr(e + 1);
  if (!exp_text.empty() && exp_text[0] == '+') exp_text.remove_prefix(1);
  std::from_chars(exp_text.data(), exp_text.data() + exp_text.size(), exp10);
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  int decpt = exp10 + 1;
  int ndigits = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {
    std::string r = sign + digits.substr(0, 1);
    if (ndigits > 1) r += "." + digits.substr(1);
    int x = decpt - 1;
    return absl::StrCat(r, "e", x < 0 ? "-" : "+", absl::StrFormat("%02d", std::abs(x)));
  }
  if (decpt <= 0) return sign + "0." + std::string(-decpt, '0') + digits;
  if (decpt >= ndigits) return sign + digits + std::string(decpt - ndigits, '0') + ".0";
  return sign + digits.substr(0, decpt) + "." + digits.substr(decpt);
}

std::string PyStr(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return "";
    case Kind::kString:
      return v.str();
    default:
      return PyRepr(v);
  }
}

std::string PyRepr(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return v.as_bool() ? "True" : "False";
    case Kind::kInt:
      return std::to_string(v.as_int());
    case Kind::kFloat:
      return PyFloatRepr(v.as_double());
    case Kind::kString:
      return PyStrRepr(v.str());
    case Kind::kList: {
      if (v.flavor() == Value::Flavor::kIterator) return "<generator object>";
      std::string r = v.flavor() == Value::Flavor::kTuple ? "(" : "[";
      for (size_t i = 0; i < v.list().size(); ++i) {
        if (i > 0) r += ", ";
        r += PyRepr(v.list()[i]);
      }
      if (v.flavor() == Value::Flavor::kTuple) {
        r += v.list().size() == 1 ? ",)" : ")";
      } else {
        r += "]";
      }
      return r;
    }
    case Kind::kDict: {
      std::string r = "{";
      for (size_t i = 0; i < v.dict().size(); ++i) {
        if (i > 0) r += ", ";
        r += PyRepr(v.dict()[i].first) + ": " + PyRepr(v.dict()[i].second);
      }
      return r + "}";
    }
    case Kind::kNamespace: {
      std::string r = "<Namespace {";
      for (size_t i = 0; i < v.dict().size(); ++i) {
        if (i > 0) r += ", ";
        r += PyRepr(v.dict()[i].first) + ": " + PyRepr(v.dict()[i].second);
      }
      return r + "}>";
    }
    case Kind::kLoop:
      return absl::StrCat("<LoopContext ", v.loop().index0 + 1, "/", v.loop().length, ">");
    case Kind::kCallable:
      return absl::StrCat("<function ", v.callable().name, ">");
  }
  return "";
}

bool Truthy(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
    case Kind::kInt:
      return v.as_int() != 0;
    case Kind::kFloat:
      return v.as_double() != 0.0;
    case Kind::kString:
      return !v.str().empty();
    case Kind::kList:
      return v.flavor() == Value::Flavor::kIterator || !v.list().empty();
    case Kind::kDict:
      return !v.dict().empty();
    default:
      return true;
  }
}

bool PyEquals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is(Kind::kFloat) || b.is(Kind::kFloat)) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return a.str() == b.str();
    case Kind::kList: {
      if (a.flavor() == Value::Flavor::kIterator || b.flavor() == Value::Flavor::kIterator) {
        return a.identity() == b.identity();
      }
      if ((a.flavor() == Value::Flavor::kTuple) != (b.flavor() == Value::Flavor::kTuple)) {
        return false;
      }
      if (a.list().size() != b.list().size()) return false;
      for (size_t i = 0; i < a.list().size(); ++i) {
        if (!PyEquals(a.list()[i], b.list()[i])) return false;
      }
      return true;
    }
    case Kind::kDict: {
      if (a.dict().size() != b.dict().size()) return false;
      for (const auto& [k, v] : a.dict()) {
        bool found = false;
        for (const auto& [k2, v2] : b.dict()) {
          if (PyEquals(k, k2)) {
            if (!PyEquals(v, v2)) return false;
            found = true;
            break;
          }
        }
        if (!found) return false;
      }
      return true;
    }
    default:
      return a.identity() == b.identity();
  }
}

const Value* DictFind(const ValueDict& dict, const Value& key) {
  for (const auto& [k, v] : dict) {
    if (PyEquals(k, key)) return &v;
  }
  return nullptr;
}

const Value* DictFind(const ValueDict& dict, std::string_view key) {
  for (const auto& [k, v] : dict) {
    if (k.is_string() && k.str() == key) return &v;
  }
  return nullptr;
}

}  // namespace tandem::text::jinja
