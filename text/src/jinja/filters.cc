// Filters: `value | name(args)` (see builtins.h and Renderer::ApplyFilter).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "tandem/base/status_macros.h"
#include "text/src/jinja/builtins.h"
#include "text/src/jinja/json_dump.h"
#include "text/src/jinja/renderer.h"
#include "text/src/jinja/utf8.h"
#include "text/src/jinja/value.h"

namespace tandem::text::jinja {
namespace {

using FilterFn = absl::StatusOr<Value> (*)(Renderer&, const Value&, CallArgs&);

absl::StatusOr<Value> LengthOf(Renderer& r, const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return Value::Int(0);
    case Kind::kString:
      return Value::Int(static_cast<int64_t>(CodePointCount(v.str())));
    case Kind::kList:
      if (v.flavor() == Value::Flavor::kIterator) break;
      return Value::Int(static_cast<int64_t>(v.list().size()));
    case Kind::kDict:
      return Value::Int(static_cast<int64_t>(v.dict().size()));
    case Kind::kLoop:
      return Value::Int(v.loop().length);
    default:
      break;
  }
  return r.Fail(absl::StrCat("object of type '", TypeName(v), "' has no len()"));
}

// Sort key for filters with case_sensitive=false: strings compare lowercased.
Value CaseKey(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::Str(AsciiLower(v.str()));
  return v;
}

// Items of `input` paired with their sort/compare keys (attribute= and case folding applied).
absl::StatusOr<std::vector<std::pair<Value, Value>>> KeyedItems(Renderer& r, const Value& input,
                                                                const std::optional<Value>& attr,
                                                                bool case_sensitive) {
  TANDEM_ASSIGN_OR_RETURN(auto items, r.Iterate(input));
  std::vector<std::pair<Value, Value>> keyed;
  for (const Value& item : *items) {
    Value key = item;
    if (attr && !attr->is(Kind::kNone)) {
      TANDEM_ASSIGN_OR_RETURN(key, r.AttrPath(item, *attr));
    }
    keyed.emplace_back(CaseKey(key, case_sensitive), item);
  }
  return keyed;
}

absl::StatusOr<Value> MinMax(Renderer& r, const Value& input, CallArgs& args, bool max) {
  TANDEM_ASSIGN_OR_RETURN(Params p,
                          r.Bind(max ? "max" : "min", args, {"case_sensitive", "attribute"}));
  TANDEM_ASSIGN_OR_RETURN(auto keyed, KeyedItems(r, input, p[1], Renderer::BoolParam(p[0], false)));
  if (keyed.empty()) return Value::Undefined("no aggregated item, sequence was empty");
  size_t best = 0;
  for (size_t i = 1; i < keyed.size(); ++i) {
    TANDEM_ASSIGN_OR_RETURN(bool better, max ? r.Less(keyed[best].first, keyed[i].first)
                                             : r.Less(keyed[i].first, keyed[best].first));
    if (better) best = i;
  }
  return keyed[best].second;
}

// select/reject/selectattr/rejectattr: keep items whose (attribute's) test result is `keep`.
absl::StatusOr<Value> SelectItems(Renderer& r, const Value& input, CallArgs& args, bool by_attr,
                                  bool keep) {
  std::vector<Value> pos = args.positional;
  std::optional<Value> attr;
  if (by_attr) {
    if (pos.empty()) return r.Fail("missing parameter for attribute name");
    attr = pos[0];
    pos.erase(pos.begin());
  }
  std::optional<std::string> test;
  if (!pos.empty()) {
    if (!pos[0].is_string()) return r.Fail("test name must be a string");
    test = pos[0].str();
    pos.erase(pos.begin());
  }
  TANDEM_ASSIGN_OR_RETURN(auto items, r.Iterate(input));
  ValueList out;
  for (const Value& item : *items) {
    Value subject = item;
    if (attr) {
      TANDEM_ASSIGN_OR_RETURN(subject, r.AttrPath(item, *attr));
    }
    bool result;
    if (test) {
      CallArgs test_args{pos, args.keyword};
      TANDEM_ASSIGN_OR_RETURN(result, r.ApplyTest(*test, subject, test_args));
    } else {
      result = Truthy(subject);
    }
    if (result == keep) out.push_back(item);
  }
  return Value::List(std::move(out), Value::Flavor::kIterator);
}

absl::StatusOr<Value> RoundFilter(Renderer& r, const Value& input, CallArgs& args) {
  TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("round", args, {"precision", "method"}));
  TANDEM_ASSIGN_OR_RETURN(int64_t precision, r.IntParam(p[0], "precision", 0));
  std::string method = p[1] && p[1]->is_string() ? p[1]->str() : "common";
  if (!input.is_number()) return r.Fail("round() needs a number");
  double x = input.as_double();
  if (method == "common" && !input.is(Kind::kFloat)) {
    // Python's round() keeps an int an int, rounding half to even at 10**-precision.
    int64_t v = input.as_int();
    if (precision >= 0) return Value::Int(v);
    if (precision < -18) return Value::Int(0);
    int64_t unit = 1;
    for (int64_t i = 0; i < -precision; ++i) unit *= 10;
    int64_t q = v / unit, rem = v % unit;
    if (rem < 0) {
      rem += unit;
      --q;
    }
    if (2 * rem > unit || (2 * rem == unit && (q % 2 != 0))) ++q;
    int64_t rounded;
    if (__builtin_mul_overflow(q, unit, &rounded)) return r.Fail("integer overflow");
    return Value::Int(rounded);
  }
  if (method == "common") {
    if (precision >= 0) {
      // printf rounds the exact binary value half-to-even, like Python's round().
      std::string text =
          absl::StrFormat("%.*f", static_cast<int>(std::min<int64_t>(precision, 300)), x);
      return Value::Float(std::strtod(text.c_str(), nullptr));
    }
    double scale = std::pow(10.0, static_cast<double>(-precision));
    return Value::Float(std::nearbyint(x / scale) * scale);
  }
  if (method != "ceil" && method != "floor") {
    return r.Fail("method must be common, ceil or floor");
  }
  double scale = std::pow(10.0, static_cast<double>(precision));
  double y = method == "ceil" ? std::ceil(x * scale) : std::floor(x * scale);
  return Value::Float(y / scale);
}

absl::StatusOr<Value> ToJsonFilter(Renderer& r, const Value& input, CallArgs& args) {
  TANDEM_ASSIGN_OR_RETURN(
      Params p, r.Bind("tojson", args, {"ensure_ascii", "indent", "separators", "sort_keys"}));
  JsonStyle style;
  style.ensure_ascii = Renderer::BoolParam(p[0], false);
  style.sort_keys = Renderer::BoolParam(p[3], false);
  if (p[1] && !p[1]->is(Kind::kNone)) {
    if (p[1]->is_string()) {
      style.indent = p[1]->str();
    } else if (p[1]->is(Kind::kInt) || p[1]->is_bool()) {
      style.indent = std::string(std::max<int64_t>(0, std::min<int64_t>(p[1]->as_int(), 64)), ' ');
    } else {
      return r.Fail("indent must be an integer or a string");
    }
    // Not `= ","`: inlined here, that assignment draws a false -Wrestrict from GCC 12.
    style.item_separator.assign(1, ',');
  }
  if (p[2] && !p[2]->is(Kind::kNone)) {
    if (!p[2]->is_list() || p[2]->list().size() != 2 || !p[2]->list()[0].is_string() ||
        !p[2]->list()[1].is_string()) {
      return r.Fail("separators must be a pair of strings");
    }
    style.item_separator = p[2]->list()[0].str();
    style.key_separator = p[2]->list()[1].str();
  }
  std::string out;
  absl::Status status = DumpJson(input, style, 0, &out);
  if (!status.ok()) return r.Fail(status.message());
  TANDEM_RETURN_IF_ERROR(r.CheckSize(out.size()));
  return Value::Str(std::move(out));
}

absl::StatusOr<Value> IndentFilter(Renderer& r, const Value& input, CallArgs& args) {
  TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("indent", args, {"width", "first", "blank"}));
  std::string indention;
  if (p[0] && p[0]->is_string()) {
    indention = p[0]->str();
  } else {
    TANDEM_ASSIGN_OR_RETURN(int64_t width, r.IntParam(p[0], "width", 4));
    indention = std::string(std::max<int64_t>(0, std::min<int64_t>(width, 1024)), ' ');
  }
  // Jinja appends a newline before splitting, so a trailing newline is dropped.
  std::vector<std::string> lines = PySplitLines(PyStr(input) + "\n", false);
  std::string out;
  if (Renderer::BoolParam(p[2], false)) {
    out = absl::StrJoin(lines, "\n" + indention);
  } else if (!lines.empty()) {
    out = lines[0];
    for (size_t i = 1; i < lines.size(); ++i) {
      out += "\n";
      if (!lines[i].empty()) out += indention;
      out += lines[i];
    }
  }
  if (Renderer::BoolParam(p[1], false)) out = indention + out;
  TANDEM_RETURN_IF_ERROR(r.CheckSize(out.size()));
  return Value::Str(std::move(out));
}

absl::StatusOr<Value> IntFilter(Renderer& r, const Value& input, CallArgs& args) {
  TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("int", args, {"default", "base"}));
  Value def = p[0] ? *p[0] : Value::Int(0);
  TANDEM_ASSIGN_OR_RETURN(int64_t base, r.IntParam(p[1], "base", 10));
  switch (input.kind()) {
    case Kind::kUndefined:
      return r.UndefinedError(input);
    case Kind::kInt:
    case Kind::kBool:
      return Value::Int(input.as_int());
    case Kind::kFloat: {
      double d = std::trunc(input.as_double());
      if (!std::isfinite(d) || std::fabs(d) >= 9.2e18) return def;
      return Value::Int(static_cast<int64_t>(d));
    }
    case Kind::kString: {
      if (auto v = ParsePyInt(input.str(), static_cast<int>(base))) return Value::Int(*v);
      if (auto d = ParsePyFloat(input.str()); d && std::isfinite(*d) && std::fabs(*d) < 9.2e18) {
        return Value::Int(static_cast<int64_t>(std::trunc(*d)));
      }
      return def;
    }
    default:
      return def;
  }
}

absl::StatusOr<Value> FloatFilter(Renderer& r, const Value& input, CallArgs& args) {
  TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("float", args, {"default"}));
  Value def = p[0] ? *p[0] : Value::Float(0.0);
  if (input.is_undefined()) return r.UndefinedError(input);
  if (input.is_number()) return Value::Float(input.as_double());
  if (input.is_string()) {
    if (auto d = ParsePyFloat(input.str())) return Value::Float(*d);
  }
  return def;
}

absl::StatusOr<Value> MapFilter(Renderer& r, const Value& input, CallArgs& args) {
  TANDEM_ASSIGN_OR_RETURN(auto items, r.Iterate(input));
  ValueList out;
  std::optional<Value> attribute, fallback;
  std::vector<std::pair<std::string, Value>> other_kwargs;
  for (const auto& [k, v] : args.keyword) {
    if (k == "attribute") {
      attribute = v;
    } else if (k == "default") {
      fallback = v;
    } else {
      other_kwargs.emplace_back(k, v);
    }
  }
  if (attribute) {
    for (const Value& item : *items) {
      TANDEM_ASSIGN_OR_RETURN(Value v, r.AttrPath(item, *attribute));
      if (v.is_undefined() && fallback) v = *fallback;
      out.push_back(std::move(v));
    }
  } else {
    if (args.positional.empty() || !args.positional[0].is_string()) {
      return r.Fail("map() needs a filter name or attribute=");
    }
    std::string filter = args.positional[0].str();
    if (!IsKnownFilter(filter)) return r.Fail(absl::StrCat("no filter named '", filter, "'"));
    for (const Value& item : *items) {
      CallArgs sub{std::vector<Value>(args.positional.begin() + 1, args.positional.end()),
                   args.keyword};
      TANDEM_ASSIGN_OR_RETURN(Value v, r.ApplyFilter(filter, item, sub));
      out.push_back(std::move(v));
    }
  }
  return Value::List(std::move(out), Value::Flavor::kIterator);
}

const absl::flat_hash_map<std::string_view, FilterFn>& Filters() {
  static const auto* filters = new absl::flat_hash_map<std::string_view, FilterFn>{
      {"abs",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("abs", a, {}));
         if (v.is(Kind::kFloat)) return Value::Float(std::fabs(v.as_double()));
         if (v.is(Kind::kInt) || v.is_bool()) {
           if (v.as_int() == std::numeric_limits<int64_t>::min()) return r.Fail("integer overflow");
           return Value::Int(std::abs(v.as_int()));
         }
         return r.Fail(absl::StrCat("bad operand type for abs(): '", TypeName(v), "'"));
       }},
      {"capitalize",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("capitalize", a, {}));
         return Value::Str(PyCapitalize(PyStr(v)));
       }},
      {"count",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("count", a, {}));
         return LengthOf(r, v);
       }},
      {"length",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("length", a, {}));
         return LengthOf(r, v);
       }},
      {"default",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("default", a, {"default_value", "boolean"}));
         if (v.is_undefined() || (Renderer::BoolParam(p[1], false) && !Truthy(v))) {
           return p[0] ? *p[0] : Value::Str("");
         }
         return v;
       }},
      {"dictsort",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p,
                                 r.Bind("dictsort", a, {"case_sensitive", "by", "reverse"}));
         if (!v.is_dict()) return r.Fail("dictsort needs a mapping");
         bool by_value = p[1] && p[1]->is_string() && p[1]->str() == "value";
         if (p[1] && !(p[1]->is_string() && (p[1]->str() == "key" || p[1]->str() == "value"))) {
           return r.Fail("You can only sort by either 'key' or 'value'");
         }
         std::vector<std::pair<Value, Value>> keyed;
         for (const auto& [k, val] : v.dict()) {
           keyed.emplace_back(CaseKey(by_value ? val : k, Renderer::BoolParam(p[0], false)),
                              Value::List({k, val}, Value::Flavor::kTuple));
         }
         TANDEM_RETURN_IF_ERROR(r.Sort(&keyed, Renderer::BoolParam(p[2], false)));
         ValueList out;
         for (auto& kv : keyed) out.push_back(std::move(kv.second));
         return Value::List(std::move(out));
       }},
      {"escape",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("escape", a, {}));
         return Value::Str(HtmlEscape(PyStr(v)));
       }},
      {"first",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("first", a, {}));
         TANDEM_ASSIGN_OR_RETURN(auto items, r.Iterate(v));
         if (items->empty()) return Value::Undefined("no first item, sequence was empty");
         return items->front();
       }},
      {"last",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("last", a, {}));
         if (v.is_list() && v.flavor() == Value::Flavor::kIterator) {
           return r.Fail("'generator' object is not reversible");
         }
         TANDEM_ASSIGN_OR_RETURN(auto items, r.Iterate(v));
         if (items->empty()) return Value::Undefined("no last item, sequence was empty");
         return items->back();
       }},
      {"float", FloatFilter},
      {"format",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         if (!a.positional.empty() && !a.keyword.empty()) {
           return r.Fail("can't handle positional and keyword arguments at the same time");
         }
         Value args;
         if (!a.keyword.empty()) {
           ValueDict kwargs;
           for (const auto& [k, val] : a.keyword) kwargs.emplace_back(Value::Str(k), val);
           args = Value::Dict(std::move(kwargs));
         } else {
           args = Value::List(a.positional, Value::Flavor::kTuple);
         }
         return PyPercentFormat(r, PyStr(v), args);
       }},
      {"int", IntFilter},
      {"indent", IndentFilter},
      {"items",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("items", a, {}));
         ValueList out;
         if (v.is_undefined()) return Value::List(std::move(out), Value::Flavor::kIterator);
         if (!v.is_dict()) return r.Fail("can only get item pairs from a mapping");
         for (const auto& [k, val] : v.dict()) {
           out.push_back(Value::List({k, val}, Value::Flavor::kTuple));
         }
         return Value::List(std::move(out), Value::Flavor::kIterator);
       }},
      {"join",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("join", a, {"d", "attribute"}));
         std::string sep = p[0] ? PyStr(*p[0]) : "";
         TANDEM_ASSIGN_OR_RETURN(auto items, r.Iterate(v));
         std::string out;
         for (size_t i = 0; i < items->size(); ++i) {
           Value item = (*items)[i];
           if (p[1] && !p[1]->is(Kind::kNone)) {
             TANDEM_ASSIGN_OR_RETURN(item, r.AttrPath(item, *p[1]));
           }
           if (i > 0) out += sep;
           out += PyStr(item);
           TANDEM_RETURN_IF_ERROR(r.CheckSize(out.size()));
         }
         return Value::Str(std::move(out));
       }},
      {"list",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("list", a, {}));
         TANDEM_ASSIGN_OR_RETURN(auto items, r.Iterate(v));
         return Value::List(*items);
       }},
      {"lower",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("lower", a, {}));
         return Value::Str(AsciiLower(PyStr(v)));
       }},
      {"upper",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("upper", a, {}));
         return Value::Str(AsciiUpper(PyStr(v)));
       }},
      {"map", MapFilter},
      {"max",
       [](Renderer& r, const Value& v, CallArgs& a) { return MinMax(r, v, a, /*max=*/true); }},
      {"min",
       [](Renderer& r, const Value& v, CallArgs& a) { return MinMax(r, v, a, /*max=*/false); }},
      {"replace",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<Value> {
         TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("replace", a, {"old", "new", "count"}));
         if (!p[0] || !p[1]) return r.Fail("replace() needs old and new");
         TANDEM_ASSIGN_OR_RETURN(int64_t count, r.IntParam(p[2], "count", -1));
         std::string out = PyReplace(PyStr(v), PyStr(*p[0]), PyStr(*p[1]), count);
         TANDEM_RETURN_IF_ERROR(r.CheckSize(out.size()));
         return Value::Str(std::move(out));
       }},
      {"reject",
       [](Renderer& r, const Value& v, CallArgs& a) { return SelectItems(r, v, a, false, false); }},
      {"rejectattr",
       [](Renderer& r, const Value& v, CallArgs& a) { return SelectItems(r, v, a, true, false); }},
      {"select",
       [](Renderer& r, const Value& v, CallArgs& a) { return SelectItems(r, v, a, false, true); }},
      {"selectattr",
       [](Renderer& r, const Value& v, CallArgs& a) { return SelectItems(r, v, a, true, true); }},
      {"reverse",
       [](Renderer& r, const Value& v,
          CallArgs& a) -> absl::
                           StatusOr<Value> {
                             TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("reverse", a, {}));
                             TANDEM_ASSIGN_OR_RETURN(auto items, r.Iterate(v));
                             if (v.is_string()) {
                               std::string out;
                               for (auto it = items->rbegin(); it != items->rend(); ++it)
                                 out += it->str();
                               return Value::Str(std::move(out));
                             }
                             return Value::List(ValueList(items->rbegin(), items->rend()),
                                                Value::Flavor::kIterator);
                           }},
      {"round", RoundFilter},
      {"safe",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::
                                                        StatusOr<Value> {
                                                          TANDEM_ASSIGN_OR_RETURN(
                                                              Params p, r.Bind("safe", a, {}));
                                                          return Value::Str(PyStr(v));
                                                        }},
      {"sort",
       [](Renderer& r, const Value& v, CallArgs& a)
           -> absl::
               StatusOr<Value> {
                 TANDEM_ASSIGN_OR_RETURN(
                     Params p, r.Bind("sort", a, {"reverse", "case_sensitive", "attribute"}));
                 TANDEM_ASSIGN_OR_RETURN(auto keyed,
                                         KeyedItems(r, v, p[2], Renderer::BoolParam(p[1], false)));
                 TANDEM_RETURN_IF_ERROR(r.Sort(&keyed, Renderer::BoolParam(p[0], false)));
                 ValueList out;
                 for (auto& kv : keyed) out.push_back(std::move(kv.second));
                 return Value::List(std::move(out));
               }},
      {"string",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::
                                                        StatusOr<Value> {
                                                          TANDEM_ASSIGN_OR_RETURN(
                                                              Params p, r.Bind("string", a, {}));
                                                          return Value::Str(PyStr(v));
                                                        }},
      {"sum",
       [](Renderer& r, const Value& v, CallArgs& a)
           -> absl::
               StatusOr<Value> {
                 TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("sum", a, {"attribute", "start"}));
                 Value total = p[1] ? *p[1] : Value::Int(0);
                 TANDEM_ASSIGN_OR_RETURN(auto keyed, KeyedItems(r, v, p[0], true));
                 for (const auto& kv : keyed) {
                   TANDEM_ASSIGN_OR_RETURN(total, r.Arith("+", total, kv.first));
                 }
                 return total;
               }},
      {"title",
       [](Renderer& r, const Value& v,
          CallArgs& a) -> absl::
                           StatusOr<Value> {
                             TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("title", a, {}));
                             // Words start after '-', whitespace or an opening bracket.
                             std::string s = PyStr(v), out;
                             bool word_start = true;
                             for (size_t i = 0; i < s.size();) {
                               size_t len;
                               uint32_t cp = DecodeAt(s, i, &len);
                               std::string_view ch(s.data() + i, len);
                               if (IsPySpace(cp) || cp == '-' || cp == '(' || cp == '{' ||
                                   cp == '[' || cp == '<') {
                                 word_start = true;
                                 out.append(ch);
                               } else {
                                 out += word_start ? AsciiUpper(ch) : AsciiLower(ch);
                                 word_start = false;
                               }
                               i += len;
                             }
                             return Value::Str(std::move(out));
                           }},
      {"tojson", ToJsonFilter},
      {"trim",
       [](Renderer& r, const Value& v,
          CallArgs& a) -> absl::
                           StatusOr<Value> {
                             TANDEM_ASSIGN_OR_RETURN(Params p, r.Bind("trim", a, {"chars"}));
                             TANDEM_ASSIGN_OR_RETURN(std::string out,
                                                     PyStrip(r, PyStr(v), p[0], true, true));
                             return Value::Str(std::move(out));
                           }},
      {"unique",
       [](Renderer& r, const Value& v, CallArgs& a)
           -> absl::
               StatusOr<Value> {
                 TANDEM_ASSIGN_OR_RETURN(Params p,
                                         r.Bind("unique", a, {"case_sensitive", "attribute"}));
                 TANDEM_ASSIGN_OR_RETURN(auto keyed,
                                         KeyedItems(r, v, p[1], Renderer::BoolParam(p[0], false)));
                 ValueList seen, out;
                 for (auto& kv : keyed) {
                   if (std::any_of(seen.begin(), seen.end(),
                                   [&](const Value& s) { return PyEquals(s, kv.first); })) {
                     continue;
                   }
                   seen.push_back(kv.first);
                   out.push_back(kv.second);
                 }
                 return Value::List(std::move(out), Value::Flavor::kIterator);
               }},
  };
  return *filters;
}

}  // namespace

bool IsKnownFilter(std::string_view name) {
  return name == "d" || name == "e" || Filters().contains(name);
}

absl::StatusOr<Value> Renderer::ApplyFilter(const std::string& name, const Value& input,
                                            CallArgs& args) {
  std::string_view canonical = name;
  if (name == "d") canonical = "default";
  if (name == "e") canonical = "escape";
  auto it = Filters().find(canonical);
  if (it == Filters().end()) return Fail(absl::StrCat("no filter named '", name, "'"));
  return it->second(*this, input, args);
}

}  // namespace tandem::text::jinja
