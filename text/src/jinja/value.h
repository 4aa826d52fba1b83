// Template values: Python's data model as chat templates see it (None, bool, int, float, str,
// list and tuple, dict, namespace, loop, callable, and Jinja's undefined), with Python's str()
// and repr(), truthiness and equality.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json_fwd.hpp"

namespace tandem::text::jinja {

class Renderer;
class Value;
using ValueList = std::vector<Value>;
using ValueDict = std::vector<std::pair<Value, Value>>;  // Insertion-ordered, like Python.

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// Builtin functions, bound methods and macros.
struct Callable {
  std::string name;
  std::function<absl::StatusOr<Value>(Renderer&, CallArgs&)> fn;
  std::shared_ptr<const Value> receiver;  // The object a bound method belongs to, if any.
};

// State behind the `loop` variable of one for-loop iteration.
struct LoopInfo {
  int64_t index0 = 0;
  int64_t length = 0;
  int64_t depth0 = 0;
  std::shared_ptr<const ValueList> items;  // The (filtered) sequence being iterated.
};

// A Python-like value. Lists, dicts and namespaces share their storage between copies; only a
// namespace is ever mutated (the sandbox forbids changing lists and dicts).
class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kLoop,
    kCallable,
  };
  // A list is a Python list, a tuple, or a one-shot iterator (what select/map/reverse return:
  // always truthy, without a length, not subscriptable).
  enum class Flavor { kList, kTuple, kIterator };

  Value() = default;
  static Value Undefined(std::string hint) {
    Value v;
    v.str_ = std::move(hint);
    return v;
  }
  static Value None() { return Value(Kind::kNone); }
  static Value Bool(bool b) {
    Value v(Kind::kBool);
    v.int_ = b;
    return v;
  }
  static Value Int(int64_t i) {
    Value v(Kind::kInt);
    v.int_ = i;
    return v;
  }
  static Value Float(double f) {
    Value v(Kind::kFloat);
    v.float_ = f;
    return v;
  }
  static Value Str(std::string s) {
    Value v(Kind::kString);
    v.str_ = std::move(s);
    return v;
  }
  static Value List(ValueList items, Flavor flavor = Flavor::kList) {
    Value v(Kind::kList);
    for (const Value& item : items) v.nesting_ = std::max(v.nesting_, item.nesting_ + 1);
    v.list_ = std::make_shared<ValueList>(std::move(items));
    v.flavor_ = flavor;
    return v;
  }
  static Value Dict(ValueDict items) {
    Value v(Kind::kDict);
    for (const auto& [k, val] : items) v.nesting_ = std::max(v.nesting_, val.nesting_ + 1);
    v.dict_ = std::make_shared<ValueDict>(std::move(items));
    return v;
  }
  // A namespace's nesting is fixed at creation; assignments to its attributes are checked on
  // their own (see Renderer::Assign).
  static Value Namespace(ValueDict attrs) {
    Value v(Kind::kNamespace);
    for (const auto& [k, val] : attrs) v.nesting_ = std::max(v.nesting_, val.nesting_ + 1);
    v.dict_ = std::make_shared<ValueDict>(std::move(attrs));
    return v;
  }
  static Value Loop(std::shared_ptr<const LoopInfo> info) {
    Value v(Kind::kLoop);
    v.loop_ = std::move(info);
    return v;
  }
  static Value Function(std::string name,
                        std::function<absl::StatusOr<Value>(Renderer&, CallArgs&)> fn,
                        std::shared_ptr<const Value> receiver = nullptr) {
    Value v(Kind::kCallable);
    v.fn_ = std::make_shared<const Callable>(
        Callable{std::move(name), std::move(fn), std::move(receiver)});
    return v;
  }

  Kind kind() const { return kind_; }
  bool is(Kind k) const { return kind_ == k; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat || is_bool(); }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  Flavor flavor() const { return flavor_; }
  // How deeply lists and dicts nest inside this value (0 for scalars).
  int nesting() const { return nesting_; }

  bool as_bool() const { return int_ != 0; }
  // Integer value of an int or bool (Python's bool is an int).
  int64_t as_int() const { return int_; }
  double as_double() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& str() const { return str_; }
  // For undefined values: why the value is undefined, for error messages.
  const std::string& hint() const { return str_; }
  const ValueList& list() const { return *list_; }
  std::shared_ptr<const ValueList> list_ptr() const { return list_; }
  const ValueDict& dict() const { return *dict_; }
  ValueDict& namespace_attrs() const { return *dict_; }
  const LoopInfo& loop() const { return *loop_; }
  const Callable& callable() const { return *fn_; }
  // Identity for values with shared storage (namespace equality is identity in Python).
  const void* identity() const {
    if (dict_) return dict_.get();
    if (list_) return list_.get();
    if (loop_) return loop_.get();
    return fn_.get();
  }

 private:
  explicit Value(Kind kind) : kind_(kind) {}

  Kind kind_ = Kind::kUndefined;
  Flavor flavor_ = Flavor::kList;
  int nesting_ = 0;
  int64_t int_ = 0;
  double float_ = 0;
  std::string str_;
  std::shared_ptr<ValueList> list_;
  std::shared_ptr<ValueDict> dict_;
  std::shared_ptr<const LoopInfo> loop_;
  std::shared_ptr<const Callable> fn_;
};

using Kind = Value::Kind;

// Containers may nest this deep. Printing, serializing and freeing values recurse, so deeper
// values (from a request or built by a loop) are rejected instead of overflowing the stack.
constexpr int kMaxValueNesting = 256;

// Converts JSON to a Value; nullopt when it nests deeper than kMaxValueNesting.
std::optional<Value> FromJson(const nlohmann::json& j);
std::optional<Value> FromJson(const nlohmann::ordered_json& j);

// Python's type name of `v` ("str", "dict", ...), for error messages.
absl::string_view TypeName(const Value& v);
// Python's repr(float): the shortest digits that round-trip, in fixed notation when the decimal
// exponent is in [-4, 16), otherwise in exponent notation with at least two exponent digits.
std::string PyFloatRepr(double d);
// Python's str(): what `{{ value }}` prints.
std::string PyStr(const Value& v);
// Python's repr().
std::string PyRepr(const Value& v);
// Python's bool(); an undefined value is false.
bool Truthy(const Value& v);
// Python ==.
bool PyEquals(const Value& a, const Value& b);
// The value under `key` (compared with ==), or null.
const Value* DictFind(const ValueDict& dict, const Value& key);
const Value* DictFind(const ValueDict& dict, std::string_view key);

}  // namespace tandem::text::jinja
