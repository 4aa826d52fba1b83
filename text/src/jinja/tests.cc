// Tests: `value is name(args)` (see builtins.h and Renderer::ApplyTest).

#include <string>
#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "text/src/jinja/builtins.h"
#include "text/src/jinja/renderer.h"
#include "text/src/jinja/utf8.h"
#include "text/src/jinja/value.h"

namespace tandem::text::jinja {
namespace {

using TestFn = absl::StatusOr<bool> (*)(Renderer&, const Value&, CallArgs&);

absl::StatusOr<Value> OneArg(Renderer& r, absl::string_view test, const CallArgs& a) {
  if (a.positional.size() != 1 || !a.keyword.empty()) {
    return r.Fail(absl::StrCat("test '", test, "' takes one argument"));
  }
  return a.positional[0];
}

absl::StatusOr<bool> CompareTest(Renderer& r, const Value& v, const CallArgs& a,
                                 absl::string_view op) {
  TANDEM_ASSIGN_OR_RETURN(Value other, OneArg(r, op, a));
  if (op == "==") return PyEquals(v, other);
  if (op == "!=") return !PyEquals(v, other);
  if (op == "<") return r.Less(v, other);
  if (op == ">") return r.Less(other, v);
  if (op == "<=") {
    TANDEM_ASSIGN_OR_RETURN(bool greater, r.Less(other, v));
    return !greater;
  }
  TANDEM_ASSIGN_OR_RETURN(bool less, r.Less(v, other));
  return !less;
}

const absl::flat_hash_map<std::string_view, TestFn>& Tests() {
#define TANDEM_JINJA_TEST(expr) \
  [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<bool> { return (expr); }
#define TANDEM_JINJA_COMPARE(op) \
  [](Renderer& r, const Value& v, CallArgs& a) { return CompareTest(r, v, a, op); }
  static const auto* tests = new absl::flat_hash_map<std::string_view, TestFn>{
      {"defined", TANDEM_JINJA_TEST(!v.is_undefined())},
      {"undefined", TANDEM_JINJA_TEST(v.is_undefined())},
      {"none", TANDEM_JINJA_TEST(v.is(Kind::kNone))},
      {"boolean", TANDEM_JINJA_TEST(v.is_bool())},
      {"true", TANDEM_JINJA_TEST(v.is_bool() && v.as_bool())},
      {"false", TANDEM_JINJA_TEST(v.is_bool() && !v.as_bool())},
      {"integer", TANDEM_JINJA_TEST(v.is(Kind::kInt))},
      {"float", TANDEM_JINJA_TEST(v.is(Kind::kFloat))},
      {"number", TANDEM_JINJA_TEST(v.is_number())},
      {"string", TANDEM_JINJA_TEST(v.is_string())},
      {"mapping", TANDEM_JINJA_TEST(v.is_dict())},
      {"iterable", TANDEM_JINJA_TEST(v.is_string() || v.is_list() || v.is_dict() ||
                                     v.is_undefined() || v.is(Kind::kLoop))},
      {"sequence", TANDEM_JINJA_TEST(v.is_string() || v.is_dict() ||
                                     (v.is_list() && v.flavor() != Value::Flavor::kIterator))},
      {"callable", TANDEM_JINJA_TEST(v.is(Kind::kCallable) || v.is_undefined())},
      {"escaped", TANDEM_JINJA_TEST(false)},
      {"lower",
       TANDEM_JINJA_TEST(AsciiLower(PyStr(v)) == PyStr(v) && AsciiUpper(PyStr(v)) != PyStr(v))},
      {"upper",
       TANDEM_JINJA_TEST(AsciiUpper(PyStr(v)) == PyStr(v) && AsciiLower(PyStr(v)) != PyStr(v))},
      {"sameas",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<bool> {
         TANDEM_ASSIGN_OR_RETURN(Value other, OneArg(r, "sameas", a));
         if (v.kind() != other.kind()) return false;
         switch (v.kind()) {
           case Kind::kUndefined:
           case Kind::kNone:
             return true;
           case Kind::kBool:
           case Kind::kInt:
           case Kind::kFloat:
           case Kind::kString:
             return PyEquals(v, other);
           default:
             return v.identity() == other.identity();
         }
       }},
      {"odd",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<bool> {
         TANDEM_ASSIGN_OR_RETURN(Value m, r.Arith("%", v, Value::Int(2)));
         return m.as_double() == 1;
       }},
      {"even",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::StatusOr<bool> {
         TANDEM_ASSIGN_OR_RETURN(Value m, r.Arith("%", v, Value::Int(2)));
         return m.as_double() == 0;
       }},
      {"divisibleby",
       [](Renderer& r, const Value& v,
          CallArgs& a) -> absl::
                           StatusOr<bool> {
                             TANDEM_ASSIGN_OR_RETURN(Value n, OneArg(r, "divisibleby", a));
                             TANDEM_ASSIGN_OR_RETURN(Value m, r.Arith("%", v, n));
                             return m.as_double() == 0;
                           }},
      {"in",
       [](Renderer& r, const Value& v, CallArgs& a) -> absl::
                                                        StatusOr<bool> {
                                                          TANDEM_ASSIGN_OR_RETURN(
                                                              Value seq, OneArg(r, "in", a));
                                                          return r.Contains(seq, v);
                                                        }},
      {"filter",
       [](Renderer& r, const Value& v,
          CallArgs& a) -> absl::StatusOr<bool> { return v.is_string() && IsKnownFilter(v.str()); }},
      {"test",
       [](Renderer& r, const Value& v,
          CallArgs& a) -> absl::StatusOr<bool> { return v.is_string() && IsKnownTest(v.str()); }},
      {"eq", TANDEM_JINJA_COMPARE("==")},
      {"equalto", TANDEM_JINJA_COMPARE("==")},
      {"==", TANDEM_JINJA_COMPARE("==")},
      {"ne", TANDEM_JINJA_COMPARE("!=")},
      {"!=", TANDEM_JINJA_COMPARE("!=")},
      {"lt", TANDEM_JINJA_COMPARE("<")},
      {"lessthan", TANDEM_JINJA_COMPARE("<")},
      {"<", TANDEM_JINJA_COMPARE("<")},
      {"le", TANDEM_JINJA_COMPARE("<=")},
      {"<=", TANDEM_JINJA_COMPARE("<=")},
      {"gt", TANDEM_JINJA_COMPARE(">")},
      {"greaterthan", TANDEM_JINJA_COMPARE(">")},
      {">", TANDEM_JINJA_COMPARE(">")},
      {"ge", TANDEM_JINJA_COMPARE(">=")},
      {">=", TANDEM_JINJA_COMPARE(">=")},
  };
#undef TANDEM_JINJA_TEST
#undef TANDEM_JINJA_COMPARE
  return *tests;
}

}  // namespace

bool IsKnownTest(std::string_view name) { return Tests().contains(name); }

absl::StatusOr<bool> Renderer::ApplyTest(const std::string& name, const Value& input,
                                         CallArgs& args) {
  auto it = Tests().find(name);
  if (it == Tests().end()) return Fail(absl::StrCat("no test named '", name, "'"));
  return it->second(*this, input, args);
}

}  // namespace tandem::text::jinja
