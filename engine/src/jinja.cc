// A Jinja subset interpreter for chat templates.
//
// Rendering matches what Hugging Face transformers produces for a tokenizer_config.json
// chat_template: Jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
// loop-control extension, autoescape off, a json.dumps-based `tojson`, and the globals
// raise_exception() and strftime_now(). Values follow Python: str() and repr() of numbers and
// containers, truthiness, integer vs float arithmetic, and an "undefined" distinct from none.
// tests/chat_template/ checks the output byte for byte against Jinja2.
//
// The file has four parts: values (Python-like data), the lexer (delimiters and whitespace
// control), the parser (tokens to a tree), and the renderer (statements, expressions, filters,
// tests, methods and globals).

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <functional>
#include <limits>
#include <memory>
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
#include "tandem/engine/chat_template.h"

namespace tandem::engine {
namespace {

// ---------------------------------------------------------------------------------------------
// UTF-8 helpers. Python strings are sequences of code points, so lengths, indices, slices and
// character iteration work on code points; everything else treats the text as bytes.
// ---------------------------------------------------------------------------------------------

size_t Utf8SeqLen(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c >> 5) == 0x6) return 2;
  if ((c >> 4) == 0xE) return 3;
  if ((c >> 3) == 0x1E) return 4;
  return 1;  // Stray continuation byte: step over it alone.
}

// Byte offsets where each code point of `s` starts.
std::vector<size_t> CodePointStarts(std::string_view s) {
  std::vector<size_t> starts;
  starts.reserve(s.size());
  for (size_t i = 0; i < s.size(); i += Utf8SeqLen(static_cast<unsigned char>(s[i]))) {
    starts.push_back(i);
  }
  return starts;
}

size_t CodePointCount(std::string_view s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); i += Utf8SeqLen(static_cast<unsigned char>(s[i]))) ++n;
  return n;
}

// Decodes the code point at byte `i` (which must start one) and its length in bytes.
uint32_t DecodeAt(std::string_view s, size_t i, size_t* len) {
  unsigned char c = s[i];
  size_t n = std::min(Utf8SeqLen(c), s.size() - i);
  *len = n;
  if (n == 1) return c;
  uint32_t cp = c & (0x7F >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  return cp;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Python's str.isspace() for one code point.
bool IsPySpace(uint32_t cp) {
  if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x1F)) return true;
  if (cp < 0x80) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Length in bytes of the run of Python whitespace that starts at byte `i`.
size_t SpaceRunFrom(std::string_view s, size_t i) {
  size_t j = i;
  while (j < s.size()) {
    size_t len;
    if (!IsPySpace(DecodeAt(s, j, &len))) break;
    j += len;
  }
  return j - i;
}

// str.rstrip() / str.lstrip() with no arguments.
std::string_view RStripSpace(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t len;
    if (!IsPySpace(DecodeAt(s, start, &len))) break;
    end = start;
  }
  return s.substr(0, end);
}

std::string_view LStripSpace(std::string_view s) { return s.substr(SpaceRunFrom(s, 0)); }

// str.strip(chars) family with an explicit character set (code points).
std::string StripChars(std::string_view s, std::string_view chars, bool left, bool right) {
  std::vector<size_t> starts = CodePointStarts(s);
  auto in_set = [&](size_t k) {
    size_t end = k + 1 < starts.size() ? starts[k + 1] : s.size();
    std::string_view cp = s.substr(starts[k], end - starts[k]);
    return chars.find(cp) != std::string_view::npos;
  };
  size_t lo = 0, hi = starts.size();
  if (left) {
    while (lo < hi && in_set(lo)) ++lo;
  }
  if (right) {
    while (hi > lo && in_set(hi - 1)) --hi;
  }
  size_t b = lo < starts.size() ? starts[lo] : s.size();
  size_t e = hi < starts.size() ? starts[hi] : s.size();
  return std::string(s.substr(b, e - b));
}

// Case mapping covers ASCII only; other letters are left as they are.
std::string AsciiUpper(std::string_view s) {
  std::string r(s);
  for (char& c : r) {
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  }
  return r;
}

std::string AsciiLower(std::string_view s) {
  std::string r(s);
  for (char& c : r) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return r;
}

bool IsAsciiAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsAsciiDigit(char c) { return c >= '0' && c <= '9'; }

// ---------------------------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------------------------

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
template <typename Json>
std::optional<Value> FromJson(const Json& j, int depth = 0) {
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
        std::optional<Value> v = FromJson(e, depth + 1);
        if (!v) return std::nullopt;
        items.push_back(std::move(*v));
      }
      return Value::List(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      ValueDict items;
      items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) {
        std::optional<Value> v = FromJson(it.value(), depth + 1);
        if (!v) return std::nullopt;
        items.emplace_back(Value::Str(it.key()), std::move(*v));
      }
      return Value::Dict(std::move(items));
    }
    default:
      return Value::None();
  }
}

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

// Python's repr(float): the shortest digits that round-trip, in fixed notation when the decimal
// exponent is in [-4, 16), otherwise in exponent notation with at least two exponent digits.
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

std::string PyRepr(const Value& v);

// Python's str(): what `{{ value }}` prints.
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

// Python ==.
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

// ---------------------------------------------------------------------------------------------
// JSON output for `tojson`: Python's json.dumps(value, ensure_ascii, indent, separators,
// sort_keys), which is what Hugging Face installs as the filter.
// ---------------------------------------------------------------------------------------------

struct JsonStyle {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // Unset: everything on one line.
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};

void JsonQuote(std::string_view s, bool ensure_ascii, std::string* out) {
  out->push_back('"');
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = DecodeAt(s, i, &len);
    switch (cp) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      default:
        if (cp < 0x20) {
          *out += absl::StrFormat("\\u%04x", cp);
        } else if (ensure_ascii && cp >= 0x80) {
          if (cp >= 0x10000) {
            uint32_t v = cp - 0x10000;
            *out += absl::StrFormat("\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
          } else {
            *out += absl::StrFormat("\\u%04x", cp);
          }
        } else {
          out->append(s.substr(i, len));
        }
    }
    i += len;
  }
  out->push_back('"');
}

std::string JsonFloat(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  return PyFloatRepr(d);
}

absl::Status DumpJson(const Value& v, const JsonStyle& style, int level, std::string* out) {
  auto newline = [&](int lvl) {
    if (!style.indent) return;
    out->push_back('\n');
    for (int i = 0; i < lvl; ++i) *out += *style.indent;
  };
  switch (v.kind()) {
    case Kind::kNone:
      *out += "null";
      return absl::OkStatus();
    case Kind::kBool:
      *out += v.as_bool() ? "true" : "false";
      return absl::OkStatus();
    case Kind::kInt:
      *out += std::to_string(v.as_int());
      return absl::OkStatus();
    case Kind::kFloat:
      *out += JsonFloat(v.as_double());
      return absl::OkStatus();
    case Kind::kString:
      JsonQuote(v.str(), style.ensure_ascii, out);
      return absl::OkStatus();
    case Kind::kList: {
      if (v.flavor() == Value::Flavor::kIterator) break;
      if (v.list().empty()) {
        *out += "[]";
        return absl::OkStatus();
      }
      out->push_back('[');
      for (size_t i = 0; i < v.list().size(); ++i) {
        if (i > 0) *out += style.item_separator;
        newline(level + 1);
        TANDEM_RETURN_IF_ERROR(DumpJson(v.list()[i], style, level + 1, out));
      }
      newline(level);
      out->push_back(']');
      return absl::OkStatus();
    }
    case Kind::kDict: {
      if (v.dict().empty()) {
        *out += "{}";
        return absl::OkStatus();
      }
      // json.dumps turns keys into strings; sort_keys orders them as strings.
      std::vector<std::pair<std::string, const Value*>> items;
      for (const auto& [k, val] : v.dict()) {
        std::string key;
        switch (k.kind()) {
          case Kind::kString:
            key = k.str();
            break;
          case Kind::kNone:
            key = "null";
            break;
          case Kind::kBool:
            key = k.as_bool() ? "true" : "false";
            break;
          case Kind::kInt:
            key = std::to_string(k.as_int());
            break;
          case Kind::kFloat:
            key = JsonFloat(k.as_double());
            break;
          default:
            return absl::InvalidArgumentError(
                absl::StrCat("keys must be str, int, float, bool or None, not ", TypeName(k)));
        }
        items.emplace_back(std::move(key), &val);
      }
      if (style.sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](const auto& a, const auto& b) { return a.first < b.first; });
      }
      out->push_back('{');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) *out += style.item_separator;
        newline(level + 1);
        JsonQuote(items[i].first, style.ensure_ascii, out);
        *out += style.key_separator;
        TANDEM_RETURN_IF_ERROR(DumpJson(*items[i].second, style, level + 1, out));
      }
      newline(level);
      out->push_back('}');
      return absl::OkStatus();
    }
    default:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("Object of type ", TypeName(v), " is not JSON serializable"));
}

// ---------------------------------------------------------------------------------------------
// Lexer. Splits the source into text and the contents of {{ }}, {% %} tags (comments vanish),
// applying whitespace control as Jinja2 does with trim_blocks and lstrip_blocks:
//   "{%-" / "{{-" / "{#-"  strip all whitespace before the tag;
//   "-%}" / "-}}" / "-#}"  strip all whitespace after it;
//   "%}" / "#}"            drop one newline right after it (trim_blocks; "+%}" keeps it);
//   "{%" / "{#"            drop spaces between the start of the line and the tag when nothing
//                          else is on that line before it (lstrip_blocks; "{%+" keeps them).
// Newlines are normalized to "\n" and one trailing newline is dropped, as Jinja2 does.
// ---------------------------------------------------------------------------------------------

enum class Tok {
  kText,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof
};

struct Token {
  Tok type;
  std::string text;  // Text, name, decoded string literal, or operator.
  int line = 1;
  int64_t int_value = 0;
  double float_value = 0;
};

absl::Status SyntaxError(int line, absl::string_view msg) {
  return absl::InvalidArgumentError(absl::StrCat("template line ", line, ": ", msg));
}

bool IsHex(char c) { return IsAsciiDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// Decodes a string literal's backslash escapes as Python's "unicode-escape" codec does;
// unknown escapes keep their backslash.
absl::StatusOr<std::string> UnescapeLiteral(std::string_view raw, int line) {
  std::string out;
  out.reserve(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    char c = raw[i];
    if (c != '\\' || i + 1 == raw.size()) {
      out.push_back(c);
      continue;
    }
    char e = raw[++i];
    switch (e) {
      case '\n':
        break;  // Line continuation.
      case '\\':
      case '\'':
      case '"':
        out.push_back(e);
        break;
      case 'a':
        out.push_back('\a');
        break;
      case 'b':
        out.push_back('\b');
        break;
      case 'f':
        out.push_back('\f');
        break;
      case 'n':
        out.push_back('\n');
        break;
      case 'r':
        out.push_back('\r');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'v':
        out.push_back('\v');
        break;
      case 'x':
      case 'u':
      case 'U': {
        size_t digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        if (i + digits >= raw.size()) {
          return SyntaxError(line, absl::StrCat("truncated \\", std::string(1, e), " escape"));
        }
        uint32_t cp = 0;
        for (size_t k = 1; k <= digits; ++k) {
          char h = raw[i + k];
          if (!IsHex(h)) {
            return SyntaxError(line, absl::StrCat("truncated \\", std::string(1, e), " escape"));
          }
          cp = cp * 16 + (IsAsciiDigit(h) ? h - '0' : (h | 0x20) - 'a' + 10);
        }
        if (cp > 0x10FFFF) return SyntaxError(line, "illegal Unicode character");
        AppendUtf8(cp, &out);
        i += digits;
        break;
      }
      case 'N':
        return SyntaxError(line, "\\N{...} escapes are not supported");
      default:
        if (e >= '0' && e <= '7') {
          uint32_t cp = e - '0';
          for (int k = 0; k < 2 && i + 1 < raw.size() && raw[i + 1] >= '0' && raw[i + 1] <= '7';
               ++k) {
            cp = cp * 8 + (raw[++i] - '0');
          }
          AppendUtf8(cp, &out);
        } else {
          out.push_back('\\');
          out.push_back(e);
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string_view source) {
    // Jinja2 splits on \r\n, \r and \n, drops one trailing empty line and joins with \n.
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        src_.push_back('\n');
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      } else {
        src_.push_back(source[i]);
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  absl::StatusOr<std::vector<Token>> Run() {
    while (pos_ < src_.size()) {
      size_t d = FindDelimiter(pos_);
      if (d == std::string::npos) {
        Emit(Tok::kText, src_.substr(pos_), pos_);
        break;
      }
      std::string_view text = std::string_view(src_).substr(pos_, d - pos_);
      char kind = src_[d + 1];
      size_t p = d + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      size_t raw_body = kind == '%' ? MatchRawBegin(p) : std::string::npos;
      EmitText(text, sign, kind != '{');
      line_starting_ = false;
      if (raw_body != std::string::npos) {
        TANDEM_RETURN_IF_ERROR(LexRaw(d, raw_body));
      } else if (kind == '#') {
        TANDEM_RETURN_IF_ERROR(LexComment(d, p));
      } else {
        TANDEM_RETURN_IF_ERROR(LexTag(d, p, kind == '%'));
      }
    }
    Token eof{Tok::kEof, "", LineAt(src_.size())};
    out_.push_back(std::move(eof));
    return std::move(out_);
  }

 private:
  int LineAt(size_t pos) {
    if (pos < line_pos_) {
      line_pos_ = 0;
      line_ = 1;
    }
    for (; line_pos_ < pos && line_pos_ < src_.size(); ++line_pos_) {
      if (src_[line_pos_] == '\n') ++line_;
    }
    return line_;
  }

  void Emit(Tok type, std::string text, size_t at) {
    Token t{type, std::move(text), LineAt(at)};
    out_.push_back(std::move(t));
  }

  bool StartsWith(size_t at, std::string_view s) const {
    return src_.compare(at, s.size(), s) == 0;
  }

  size_t FindDelimiter(size_t from) const {
    for (size_t i = src_.find('{', from); i != std::string::npos; i = src_.find('{', i + 1)) {
      if (i + 1 < src_.size() && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return std::string::npos;
  }

  // Text before a tag, with the stripping its opening delimiter asks for. `block` is true for
  // statement and comment tags, the ones lstrip_blocks applies to.
  void EmitText(std::string_view text, char sign, bool block) {
    size_t at = pos_;
    if (sign == '-') {
      text = RStripSpace(text);
    } else if (sign != '+' && block) {
      size_t l_pos = text.rfind('\n');
      l_pos = l_pos == std::string_view::npos ? 0 : l_pos + 1;
      if ((l_pos > 0 || line_starting_) && l_pos < text.size() &&
          SpaceRunFrom(text, l_pos) == text.size() - l_pos) {
        text = text.substr(0, l_pos);
      }
    }
    if (!text.empty()) Emit(Tok::kText, std::string(text), at);
  }

  // Position after "{% raw %}" when the tag at `p` (after "{%" and its sign) is one, else npos.
  size_t MatchRawBegin(size_t p) const {
    p += SpaceRunFrom(src_, p);
    if (!StartsWith(p, "raw")) return std::string::npos;
    p += 3;
    p += SpaceRunFrom(src_, p);
    if (StartsWith(p, "-%}")) return p + 3 + SpaceRunFrom(src_, p + 3);
    if (StartsWith(p, "%}")) return p + 2;
    return std::string::npos;
  }

  // The end of a statement tag starting at `p` ("+%}", "-%}" plus whitespace, "%}" plus one
  // newline), or npos.
  size_t MatchBlockEnd(size_t p) const {
    if (StartsWith(p, "+%}")) return p + 3;
    if (StartsWith(p, "-%}")) return p + 3 + SpaceRunFrom(src_, p + 3);
    if (StartsWith(p, "%}")) return p + 2 + (StartsWith(p + 2, "\n") ? 1 : 0);
    return std::string::npos;
  }

  absl::Status LexRaw(size_t begin, size_t body) {
    for (size_t i = src_.find("{%", body); i != std::string::npos; i = src_.find("{%", i + 1)) {
      size_t p = i + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      p += SpaceRunFrom(src_, p);
      if (!StartsWith(p, "endraw")) continue;
      p += 6;
      p += SpaceRunFrom(src_, p);
      size_t end = MatchBlockEnd(p);
      if (end == std::string::npos) continue;
      line_starting_ = src_[body - 1] == '\n';
      pos_ = body;
      EmitText(std::string_view(src_).substr(body, i - body), sign, true);
      line_starting_ = src_[end - 1] == '\n';
      pos_ = end;
      return absl::OkStatus();
    }
    return SyntaxError(LineAt(begin), "missing end of raw directive");
  }

  absl::Status LexComment(size_t begin, size_t p) {
    for (size_t i = p; i < src_.size(); ++i) {
      size_t end = std::string::npos;
      if (StartsWith(i, "+#}")) {
        end = i + 3;
      } else if (StartsWith(i, "-#}")) {
        end = i + 3 + SpaceRunFrom(src_, i + 3);
      } else if (StartsWith(i, "#}")) {
        end = i + 2 + (StartsWith(i + 2, "\n") ? 1 : 0);
      }
      if (end != std::string::npos) {
        line_starting_ = src_[end - 1] == '\n';
        pos_ = end;
        return absl::OkStatus();
      }
    }
    return SyntaxError(LineAt(begin), "missing end of comment tag");
  }

  // `(\d+_)*\d+` at `i`: the end of the digits, or npos.
  size_t MatchDigits(size_t i) const {
    if (i >= src_.size() || !IsAsciiDigit(src_[i])) return std::string::npos;
    while (true) {
      while (i < src_.size() && IsAsciiDigit(src_[i])) ++i;
      if (i + 1 < src_.size() && src_[i] == '_' && IsAsciiDigit(src_[i + 1])) {
        ++i;
      } else {
        return i;
      }
    }
  }

  size_t MatchExponent(size_t i) const {
    if (i >= src_.size() || (src_[i] != 'e' && src_[i] != 'E')) return std::string::npos;
    ++i;
    if (i < src_.size() && (src_[i] == '+' || src_[i] == '-')) ++i;
    return MatchDigits(i);
  }

  size_t MatchFloat(size_t i) const {
    if (i > 0 && src_[i - 1] == '.') return std::string::npos;
    size_t a = MatchDigits(i);
    if (a == std::string::npos) return a;
    size_t frac = a < src_.size() && src_[a] == '.' ? MatchDigits(a + 1) : std::string::npos;
    size_t after = frac != std::string::npos ? frac : a;
    size_t exp = MatchExponent(after);
    if (exp != std::string::npos) return exp;
    return frac;
  }

  // Integer literal forms: 0b.., 0o.., 0x.., decimal, with single underscores between digits.
  size_t MatchInt(size_t i, int* base) const {
    auto run = [&](size_t j, auto is_digit) {
      size_t k = j;
      while (true) {
        size_t m = k;
        if (m < src_.size() && src_[m] == '_') ++m;
        if (m < src_.size() && is_digit(src_[m])) {
          k = m + 1;
        } else {
          return k;
        }
      }
    };
    if (i >= src_.size() || !IsAsciiDigit(src_[i])) return std::string::npos;
    if (src_[i] == '0' && i + 1 < src_.size()) {
      char b = src_[i + 1] | 0x20;
      auto try_base = [&](int radix, auto is_digit) -> size_t {
        size_t e = run(i + 2, is_digit);
        if (e == i + 2) return std::string::npos;
        *base = radix;
        return e;
      };
      if (b == 'b') {
        size_t e = try_base(2, [](char c) { return c == '0' || c == '1'; });
        if (e != std::string::npos) return e;
      } else if (b == 'o') {
        size_t e = try_base(8, [](char c) { return c >= '0' && c <= '7'; });
        if (e != std::string::npos) return e;
      } else if (b == 'x') {
        size_t e = try_base(16, IsHex);
        if (e != std::string::npos) return e;
      }
    }
    *base = 10;
    if (src_[i] == '0') return run(i + 1, [](char c) { return c == '0'; });
    return run(i + 1, IsAsciiDigit);
  }

  absl::Status LexTag(size_t begin, size_t p, bool block) {
    Emit(block ? Tok::kBlockBegin : Tok::kVarBegin, "", begin);
    std::string balance;  // Closing brackets still expected.
    size_t i = p;
    while (true) {
      if (i >= src_.size()) {
        return SyntaxError(LineAt(begin), block ? "unexpected end of template, expected '%}'"
                                                : "unexpected end of template, expected '}}'");
      }
      if (balance.empty()) {
        size_t end = std::string::npos;
        if (block) {
          end = MatchBlockEnd(i);
        } else if (StartsWith(i, "-}}")) {
          end = i + 3 + SpaceRunFrom(src_, i + 3);
        } else if (StartsWith(i, "}}")) {
          end = i + 2;
        }
        if (end != std::string::npos) {
          Emit(block ? Tok::kBlockEnd : Tok::kVarEnd, "", i);
          line_starting_ = src_[end - 1] == '\n';
          pos_ = end;
          return absl::OkStatus();
        }
      }
      size_t space = SpaceRunFrom(src_, i);
      if (space > 0) {
        i += space;
        continue;
      }
      char c = src_[i];
      if (size_t e = MatchFloat(i); e != std::string::npos) {
        std::string digits;
        for (size_t k = i; k < e; ++k) {
          if (src_[k] != '_') digits.push_back(src_[k]);
        }
        Token t{Tok::kFloat, digits, LineAt(i)};
        t.float_value = std::strtod(digits.c_str(), nullptr);
        out_.push_back(std::move(t));
        i = e;
        continue;
      }
      int base = 10;
      if (size_t e = MatchInt(i, &base); e != std::string::npos) {
        Token t{Tok::kInt, src_.substr(i, e - i), LineAt(i)};
        uint64_t v = 0;
        for (size_t k = base == 10 ? i : i + 2; k < e; ++k) {
          char d = src_[k];
          if (d == '_') continue;
          int digit = IsAsciiDigit(d) ? d - '0' : (d | 0x20) - 'a' + 10;
          if (v > (static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - digit) / base) {
            return SyntaxError(t.line, "integer literal too large");
          }
          v = v * base + digit;
        }
        t.int_value = static_cast<int64_t>(v);
        out_.push_back(std::move(t));
        i = e;
        continue;
      }
      if (IsAsciiAlpha(c) || c == '_') {
        size_t e = i + 1;
        while (e < src_.size() &&
               (IsAsciiAlpha(src_[e]) || IsAsciiDigit(src_[e]) || src_[e] == '_')) {
          ++e;
        }
        Emit(Tok::kName, src_.substr(i, e - i), i);
        i = e;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t e = i + 1;
        while (e < src_.size() && src_[e] != c) e += src_[e] == '\\' ? 2 : 1;
        if (e < src_.size()) {
          int line = LineAt(i);
          TANDEM_ASSIGN_OR_RETURN(
              std::string value,
              UnescapeLiteral(std::string_view(src_).substr(i + 1, e - i - 1), line));
          Token t{Tok::kString, std::move(value), line};
          out_.push_back(std::move(t));
          i = e + 1;
          continue;
        }
      }
      static constexpr std::string_view kTwoCharOps[] = {"//", "**", "==", "!=", ">=", "<="};
      std::string op;
      for (std::string_view two : kTwoCharOps) {
        if (StartsWith(i, two)) op = two;
      }
      if (op.empty() &&
          std::string_view("+-/*%~[](){}><=.:|,;").find(c) != std::string_view::npos) {
        op = std::string(1, c);
      }
      if (op.empty()) {
        return SyntaxError(LineAt(i), absl::StrCat("unexpected char '", std::string(1, c), "'"));
      }
      if (op == "(" || op == "[" || op == "{") {
        balance.push_back(op == "(" ? ')' : op == "[" ? ']' : '}');
      } else if (op == ")" || op == "]" || op == "}") {
        if (balance.empty()) return SyntaxError(LineAt(i), absl::StrCat("unexpected '", op, "'"));
        if (balance.back() != op[0]) {
          return SyntaxError(LineAt(i), absl::StrCat("unexpected '", op, "', expected '",
                                                     std::string(1, balance.back()), "'"));
        }
        balance.pop_back();
      }
      Emit(Tok::kOp, op, i);
      i += op.size();
    }
  }

  std::string src_;
  size_t pos_ = 0;
  bool line_starting_ = true;
  std::vector<Token> out_;
  size_t line_pos_ = 0;
  int line_ = 1;
};

// ---------------------------------------------------------------------------------------------
// Syntax tree
// ---------------------------------------------------------------------------------------------

struct Expr {
  enum class Op {
    kLiteral,  // literal
    kName,     // name
    kList,     // args: items
    kTuple,    // args: items
    kDict,     // args: key0, value0, key1, value1, ...
    kGetAttr,  // args: object; name: attribute
    kGetItem,  // args: object, key
    kSlice,    // args: object, start, stop, step (each may be null)
    kCall,     // args: callee, positional...; kwargs
    kFilter,   // args: input (null inside a filter chain), positional...; kwargs; name
    kTest,     // args: input, positional...; kwargs; name
    kNeg,      // args: operand
    kPos,      // args: operand
    kNot,      // args: operand
    kAnd,      // args: left, right
    kOr,       // args: left, right
    kBinary,   // args: left, right; name: + - * / // % **
    kCompare,  // args: operands; compare_ops between them
    kConcat,   // args: parts joined by ~
    kCond,     // args: value, condition, else-value (may be null)
  };
  Op op;
  int line;
  Value literal;
  std::string name;
  std::vector<std::unique_ptr<Expr>> args;
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kwargs;
  std::vector<std::string> compare_ops;

  Expr() = default;
  Expr(const Expr&) = delete;
  Expr& operator=(const Expr&) = delete;
  ~Expr();
};
using ExprPtr = std::unique_ptr<Expr>;

// Frees the tree without recursion: a long chain such as "a ~ b + c + ..." nests as deep as it
// is long.
Expr::~Expr() {
  std::vector<ExprPtr> pending;
  auto take_children = [&pending](Expr& e) {
    for (ExprPtr& a : e.args) {
      if (a) pending.push_back(std::move(a));
    }
    for (auto& kw : e.kwargs) {
      if (kw.second) pending.push_back(std::move(kw.second));
    }
  };
  take_children(*this);
  while (!pending.empty()) {
    ExprPtr e = std::move(pending.back());
    pending.pop_back();
    take_children(*e);
  }
}

ExprPtr MakeExpr(Expr::Op op, int line) {
  auto e = std::make_unique<Expr>();
  e->op = op;
  e->line = line;
  return e;
}

// Where `{% set %}` and `{% for %}` store values.
struct Target {
  enum class Kind { kName, kTuple, kNamespaceAttr };
  Kind kind = Kind::kName;
  std::vector<std::string> names;  // One name, the tuple's names, or the namespace variable.
  std::string attr;                // kNamespaceAttr: the attribute.
};

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Type {
    kText,      // text
    kOutput,    // expr
    kIf,        // conds[i] selects branches[i]; a trailing extra branch is the else
    kFor,       // target in expr [if cond]: body, else_body
    kSet,       // target = expr
    kSetBlock,  // target = rendered body, through filters
    kMacro,     // text: name; params, defaults; body
    kBreak,
    kContinue,
    kWith,         // with_targets = with_values: body
    kFilterBlock,  // rendered body through filters
    kPassThrough,  // body rendered as is ({% generation %})
  };
  Type type;
  int line;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;
  std::vector<ExprPtr> conds;
  std::vector<Body> branches;
  Target target;
  Body body;
  Body else_body;
  std::vector<ExprPtr> filters;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // Parallel to params; null where a parameter has none.
  std::vector<Target> with_targets;
  std::vector<ExprPtr> with_values;
};

bool IsKnownFilter(std::string_view name);
bool IsKnownTest(std::string_view name);

// ---------------------------------------------------------------------------------------------
// Parser: Jinja2's grammar, from loosest to tightest binding:
//   conditional (x if c else y) < or < and < not < comparisons (== != < <= > >= in, not in)
//   < + - < ~ < * / // % < ** < unary - + < primary with .attr [key] (call) |filter `is` test
// ---------------------------------------------------------------------------------------------

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : toks_(std::move(tokens)) {}

  absl::StatusOr<Body> ParseTemplate() {
    std::string end;
    return ParseBody({}, &end);
  }

 private:
  static constexpr int kMaxNesting = 100;

  const Token& Cur() const { return toks_[pos_]; }
  const Token& Look() const { return toks_[std::min(pos_ + 1, toks_.size() - 1)]; }
  bool IsName(std::string_view n) const { return Cur().type == Tok::kName && Cur().text == n; }
  bool IsOp(std::string_view o) const { return Cur().type == Tok::kOp && Cur().text == o; }
  bool SkipName(std::string_view n) {
    if (!IsName(n)) return false;
    ++pos_;
    return true;
  }
  bool SkipOp(std::string_view o) {
    if (!IsOp(o)) return false;
    ++pos_;
    return true;
  }

  static std::string Describe(const Token& t) {
    switch (t.type) {
      case Tok::kText:
        return "template data";
      case Tok::kVarBegin:
        return "'{{'";
      case Tok::kVarEnd:
        return "end of print statement";
      case Tok::kBlockBegin:
        return "'{%'";
      case Tok::kBlockEnd:
        return "end of statement block";
      case Tok::kString:
        return "string";
      case Tok::kEof:
        return "end of template";
      default:
        return absl::StrCat("'", t.text, "'");
    }
  }

  absl::Status Unexpected(absl::string_view expected = "") const {
    std::string msg = absl::StrCat("unexpected ", Describe(Cur()));
    if (!expected.empty()) absl::StrAppend(&msg, ", expected ", expected);
    return SyntaxError(Cur().line, msg);
  }
  absl::Status ExpectOp(std::string_view o) {
    if (!SkipOp(o)) return Unexpected(absl::StrCat("'", std::string(o), "'"));
    return absl::OkStatus();
  }
  absl::Status ExpectName(std::string_view n) {
    if (!SkipName(n)) return Unexpected(absl::StrCat("'", std::string(n), "'"));
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> ExpectAnyName() {
    if (Cur().type != Tok::kName) return Unexpected("a name");
    return toks_[pos_++].text;
  }
  absl::Status ExpectBlockEnd() {
    if (Cur().type != Tok::kBlockEnd) return Unexpected("end of statement block");
    ++pos_;
    return absl::OkStatus();
  }

  // Counts nesting of statements and parenthesised expressions so that a hostile template
  // cannot overflow the parser's stack.
  class NestingGuard {
   public:
    explicit NestingGuard(Parser* p) : p_(p) { ++p_->nesting_; }
    ~NestingGuard() { --p_->nesting_; }
    absl::Status Check() const {
      if (p_->nesting_ > kMaxNesting)
        return SyntaxError(p_->Cur().line, "template nests too deeply");
      return absl::OkStatus();
    }

   private:
    Parser* p_;
  };

  // Parses template data, output and statements until a tag named in `ends` (consumed along
  // with the "{%" before it; its name goes to *end) or, when `ends` is empty, the end.
  absl::StatusOr<Body> ParseBody(const std::vector<std::string_view>& ends, std::string* end) {
    NestingGuard guard(this);
    TANDEM_RETURN_IF_ERROR(guard.Check());
    Body body;
    while (true) {
      const Token& t = Cur();
      switch (t.type) {
        case Tok::kText: {
          auto node = std::make_unique<Node>();
          node->type = Node::Type::kText;
          node->line = t.line;
          node->text = t.text;
          body.push_back(std::move(node));
          ++pos_;
          break;
        }
        case Tok::kVarBegin: {
          auto node = std::make_unique<Node>();
          node->type = Node::Type::kOutput;
          node->line = t.line;
          ++pos_;
          TANDEM_ASSIGN_OR_RETURN(node->expr, ParseTuple(true, {}, false));
          if (Cur().type != Tok::kVarEnd) return Unexpected("end of print statement");
          ++pos_;
          body.push_back(std::move(node));
          break;
        }
        case Tok::kBlockBegin: {
          const Token& name = Look();
          if (name.type == Tok::kName &&
              std::find(ends.begin(), ends.end(), name.text) != ends.end()) {
            *end = name.text;
            pos_ += 2;
            return body;
          }
          ++pos_;
          TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Node> node, ParseStatement());
          body.push_back(std::move(node));
          break;
        }
        case Tok::kEof:
          if (!ends.empty()) {
            return SyntaxError(
                t.line,
                absl::StrCat(
                    "unexpected end of template, expected '",
                    absl::StrJoin(std::vector<std::string>(ends.begin(), ends.end()), "' or '"),
                    "'"));
          }
          return body;
        default:
          return Unexpected();
      }
    }
  }

  absl::StatusOr<std::unique_ptr<Node>> ParseStatement() {
    const Token& t = Cur();
    if (t.type != Tok::kName) return SyntaxError(t.line, "tag name expected");
    auto node = std::make_unique<Node>();
    node->line = t.line;
    std::string tag = t.text;
    ++pos_;
    if (tag == "if") {
      TANDEM_RETURN_IF_ERROR(ParseIf(node.get()));
    } else if (tag == "for") {
      TANDEM_RETURN_IF_ERROR(ParseFor(node.get()));
    } else if (tag == "set") {
      TANDEM_RETURN_IF_ERROR(ParseSet(node.get()));
    } else if (tag == "macro") {
      TANDEM_RETURN_IF_ERROR(ParseMacro(node.get()));
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) {
        return SyntaxError(node->line, absl::StrCat("'", tag, "' outside of a loop"));
      }
      node->type = tag == "break" ? Node::Type::kBreak : Node::Type::kContinue;
      TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
    } else if (tag == "with") {
      TANDEM_RETURN_IF_ERROR(ParseWith(node.get()));
    } else if (tag == "filter") {
      node->type = Node::Type::kFilterBlock;
      TANDEM_RETURN_IF_ERROR(ParseFilterChain(node.get(), /*first_pipe=*/false));
      TANDEM_RETURN_IF_ERROR(ParseBlockBody(node.get(), "endfilter"));
    } else if (tag == "generation") {
      // Hugging Face marks assistant turns with {% generation %} to build masks; the text
      // renders unchanged.
      node->type = Node::Type::kPassThrough;
      TANDEM_RETURN_IF_ERROR(ParseBlockBody(node.get(), "endgeneration"));
    } else if (tag == "block" || tag == "extends" || tag == "include" || tag == "import" ||
               tag == "from" || tag == "call" || tag == "autoescape" || tag == "print") {
      return SyntaxError(node->line, absl::StrCat("the '", tag, "' tag is not supported"));
    } else {
      return SyntaxError(node->line, absl::StrCat("unknown tag '", tag, "'"));
    }
    return node;
  }

  absl::Status ParseBlockBody(Node* node, std::string_view end_tag) {
    TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
    std::string end;
    TANDEM_ASSIGN_OR_RETURN(node->body, ParseBody({end_tag}, &end));
    return ExpectBlockEnd();
  }

  absl::Status ParseIf(Node* node) {
    node->type = Node::Type::kIf;
    while (true) {
      TANDEM_ASSIGN_OR_RETURN(ExprPtr cond, ParseTuple(false, {}, false));
      node->conds.push_back(std::move(cond));
      TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
      std::string end;
      TANDEM_ASSIGN_OR_RETURN(Body body, ParseBody({"elif", "else", "endif"}, &end));
      node->branches.push_back(std::move(body));
      if (end == "elif") continue;
      if (end == "else") {
        TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
        TANDEM_ASSIGN_OR_RETURN(Body else_body, ParseBody({"endif"}, &end));
        node->branches.push_back(std::move(else_body));
      }
      return ExpectBlockEnd();
    }
  }

  absl::Status ParseFor(Node* node) {
    node->type = Node::Type::kFor;
    TANDEM_ASSIGN_OR_RETURN(node->target, ParseTarget({"in"}));
    TANDEM_RETURN_IF_ERROR(ExpectName("in"));
    TANDEM_ASSIGN_OR_RETURN(node->expr, ParseTuple(false, {"recursive"}, false));
    if (SkipName("if")) {
      TANDEM_ASSIGN_OR_RETURN(node->cond, ParseExpression(true));
    }
    if (IsName("recursive")) return SyntaxError(Cur().line, "recursive loops are not supported");
    TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
    std::string end;
    ++loop_depth_;
    absl::StatusOr<Body> body = ParseBody({"endfor", "else"}, &end);
    --loop_depth_;
    if (!body.ok()) return body.status();
    node->body = std::move(*body);
    if (end == "else") {
      TANDEM_RETURN_IF_ERROR(ExpectBlockEnd());
      TANDEM_ASSIGN_OR_RETURN(node->else_body, ParseBody({"endfor"}, &end));
    }
    return ExpectBlockEnd();
  }

  absl::Status ParseSet(Node* node) {
    if (Cur().type == Tok::kName && Look().type == Tok::kOp && Look().text == ".") {
      node->target.kind = Target::Kind::kNamespaceAttr;
      node->target.names.push_back(Cur().text);
      pos_ += 2;
      TANDEM_ASSIGN_OR_RETURN(node->target.attr, ExpectAnyName());
    } else {
      TANDEM_ASSIGN_OR_RETURN(node->target, ParseTarget({}));
    }
    if (SkipOp("=")) {
      node->type = Node::Type::kSet;
      TANDEM_ASSIGN_OR_RETURN(node->expr, ParseTuple(true, {}, false));
      return ExpectBlockEnd();
    }
    node->type = Node::Type::kSetBlock;
    if (IsOp("|")) TANDEM_RETURN_IF_ERROR(ParseFilterChain(node, /*first_pipe=*/true));
    return ParseBlockBody(node, "endset");
  }

  absl::Status ParseMacro(Node* node) {
    node->type = Node::Type::kMacro;
    TANDEM_ASSIGN_OR_RETURN(node->text, ExpectAnyName());
    TANDEM_RETURN_IF_ERROR(ExpectOp("("));
    while (!IsOp(")")) {
      if (!node->params.empty()) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
      TANDEM_ASSIGN_OR_RETURN(std::string param, ExpectAnyName());
      ExprPtr def;
      if (SkipOp("=")) {
        TANDEM_ASSIGN_OR_RETURN(def, ParseExpression(true));
      } else if (!node->defaults.empty() && node->defaults.back() != nullptr) {
        return SyntaxError(Cur().line, "non-default argument follows default argument");
      }
      node->params.push_back(std::move(param));
      node->defaults.push_back(std::move(def));
    }
    ++pos_;
    int saved_loop_depth = loop_depth_;
    loop_depth_ = 0;  // `break` inside a macro cannot leave a loop around its definition.
    absl::Status status = ParseBlockBody(node, "endmacro");
    loop_depth_ = saved_loop_depth;
    return status;
  }

  absl::Status ParseWith(Node* node) {
    node->type = Node::Type::kWith;
    while (Cur().type != Tok::kBlockEnd) {
      if (!node->with_targets.empty()) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
      TANDEM_ASSIGN_OR_RETURN(Target target, ParseTarget({}));
      TANDEM_RETURN_IF_ERROR(ExpectOp("="));
      TANDEM_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
      node->with_targets.push_back(std::move(target));
      node->with_values.push_back(std::move(value));
    }
    return ParseBlockBody(node, "endwith");
  }

  // `name(args) | name ...` for {% filter %} and {% set x | filter %}.
  absl::Status ParseFilterChain(Node* node, bool first_pipe) {
    bool first = true;
    while (IsOp("|") || (first && !first_pipe)) {
      if (!(first && !first_pipe)) ++pos_;
      first = false;
      TANDEM_ASSIGN_OR_RETURN(ExprPtr filter, ParseFilter(nullptr));
      node->filters.push_back(std::move(filter));
    }
    return absl::OkStatus();
  }

  // A name or comma-separated names, optionally in parentheses, ended by a name in `ends`,
  // "=", or the end of the tag.
  absl::StatusOr<Target> ParseTarget(const std::vector<std::string_view>& ends) {
    Target target;
    bool paren = SkipOp("(");
    bool comma = false;
    while (true) {
      if (Cur().type != Tok::kName) return Unexpected("a name to assign to");
      const std::string& n = Cur().text;
      if (n == "true" || n == "false" || n == "none" || n == "True" || n == "False" ||
          n == "None") {
        return SyntaxError(Cur().line, "can't assign to a constant");
      }
      target.names.push_back(n);
      ++pos_;
      if (!SkipOp(",")) break;
      comma = true;
      if (IsOp(")") || IsOp("=") || Cur().type == Tok::kBlockEnd ||
          (Cur().type == Tok::kName &&
           std::find(ends.begin(), ends.end(), Cur().text) != ends.end())) {
        break;
      }
    }
    if (paren) TANDEM_RETURN_IF_ERROR(ExpectOp(")"));
    target.kind = comma ? Target::Kind::kTuple : Target::Kind::kName;
    return target;
  }

  bool IsTupleEnd(const std::vector<std::string_view>& extra_ends) const {
    if (Cur().type == Tok::kVarEnd || Cur().type == Tok::kBlockEnd || IsOp(")")) return true;
    return Cur().type == Tok::kName &&
           std::find(extra_ends.begin(), extra_ends.end(), Cur().text) != extra_ends.end();
  }

  // Expressions separated by commas form a tuple.
  absl::StatusOr<ExprPtr> ParseTuple(bool with_condexpr,
                                     const std::vector<std::string_view>& extra_ends,
                                     bool explicit_parens) {
    int line = Cur().line;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
      if (IsTupleEnd(extra_ends)) break;
      TANDEM_ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(with_condexpr));
      items.push_back(std::move(item));
      if (IsOp(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) return Unexpected("an expression");
    }
    ExprPtr tuple = MakeExpr(Expr::Op::kTuple, line);
    tuple->args = std::move(items);
    return tuple;
  }

  absl::StatusOr<ExprPtr> ParseExpression(bool with_condexpr) {
    if (!with_condexpr) return ParseOr();
    int line = Cur().line;
    TANDEM_ASSIGN_OR_RETURN(ExprPtr expr, ParseOr());
    while (SkipName("if")) {
      ExprPtr cond_expr = MakeExpr(Expr::Op::kCond, line);
      TANDEM_ASSIGN_OR_RETURN(ExprPtr cond, ParseOr());
      ExprPtr otherwise;
      if (SkipName("else")) {
        TANDEM_ASSIGN_OR_RETURN(otherwise, ParseExpression(true));
      }
      cond_expr->args.push_back(std::move(expr));
      cond_expr->args.push_back(std::move(cond));
      cond_expr->args.push_back(std::move(otherwise));
      expr = std::move(cond_expr);
    }
    return expr;
  }

  absl::StatusOr<ExprPtr> ParseOr() {
    TANDEM_ASSIGN_OR_RETURN(ExprPtr left, ParseAnd());
    while (IsName("or")) {
      ExprPtr node = MakeExpr(Expr::Op::kOr, Cur().line);
      ++pos_;
      TANDEM_ASSIGN_OR_RETURN(ExprPtr right, ParseAnd());
      node->args.push_back(std::move(left));
      node->args.push_back(std::move(right));
      left = std::move(node);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseAnd() {
    TANDEM_ASSIGN_OR_RETURN(ExprPtr left, ParseNot());
    while (IsName("and")) {
      ExprPtr node = MakeExpr(Expr::Op::kAnd, Cur().line);
      ++pos_;
      TANDEM_ASSIGN_OR_RETURN(ExprPtr right, ParseNot());
      node->args.push_back(std::move(left));
      node->args.push_back(std::move(right));
      left = std::move(node);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseNot() {
    if (IsName("not")) {
      NestingGuard guard(this);
      TANDEM_RETURN_IF_ERROR(guard.Check());
      ExprPtr node = MakeExpr(Expr::Op::kNot, Cur().line);
      ++pos_;
      TANDEM_ASSIGN_OR_RETURN(ExprPtr operand, ParseNot());
      node->args.push_back(std::move(operand));
      return node;
    }
    return ParseCompare();
  }

  absl::StatusOr<ExprPtr> ParseCompare() {
    int line = Cur().line;
    TANDEM_ASSIGN_OR_RETURN(ExprPtr first, ParseMath1());
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (Cur().type == Tok::kOp &&
          (Cur().text == "==" || Cur().text == "!=" || Cur().text == "<" || Cur().text == "<=" ||
           Cur().text == ">" || Cur().text == ">=")) {
        op = Cur().text;
        ++pos_;
      } else if (IsName("in")) {
        op = "in";
        ++pos_;
      } else if (IsName("not") && Look().type == Tok::kName && Look().text == "in") {
        op = "not in";
        pos_ += 2;
      } else {
        break;
      }
      if (!cmp) {
        cmp = MakeExpr(Expr::Op::kCompare, line);
        cmp->args.push_back(std::move(first));
      }
      TANDEM_ASSIGN_OR_RETURN(ExprPtr operand, ParseMath1());
      cmp->args.push_back(std::move(operand));
      cmp->compare_ops.push_back(std::move(op));
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  absl::StatusOr<ExprPtr> Binary(ExprPtr left, std::string op,
                                 absl::StatusOr<ExprPtr> (Parser::*next)()) {
    ExprPtr node = MakeExpr(Expr::Op::kBinary, Cur().line);
    TANDEM_ASSIGN_OR_RETURN(ExprPtr right, (this->*next)());
    node->name = std::move(op);
    node->args.push_back(std::move(left));
    node->args.push_back(std::move(right));
    return node;
  }

  absl::StatusOr<ExprPtr> ParseMath1() {
    TANDEM_ASSIGN_OR_RETURN(ExprPtr left, ParseConcat());
    while (IsOp("+") || IsOp("-")) {
      std::string op = toks_[pos_++].text;
      TANDEM_ASSIGN_OR_RETURN(left, Binary(std::move(left), op, &Parser::ParseConcat));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseConcat() {
    int line = Cur().line;
    TANDEM_ASSIGN_OR_RETURN(ExprPtr first, ParseMath2());
    if (!IsOp("~")) return first;
    ExprPtr node = MakeExpr(Expr::Op::kConcat, line);
    node->args.push_back(std::move(first));
    while (SkipOp("~")) {
      TANDEM_ASSIGN_OR_RETURN(ExprPtr part, ParseMath2());
      node->args.push_back(std::move(part));
    }
    return node;
  }

  absl::StatusOr<ExprPtr> ParseMath2() {
    TANDEM_ASSIGN_OR_RETURN(ExprPtr left, ParsePow());
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      std::string op = toks_[pos_++].text;
      TANDEM_ASSIGN_OR_RETURN(left, Binary(std::move(left), op, &Parser::ParsePow));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParsePow() {
    TANDEM_ASSIGN_OR_RETURN(ExprPtr left, ParseUnaryWithFilters());
    while (IsOp("**")) {
      ++pos_;
      TANDEM_ASSIGN_OR_RETURN(left, Binary(std::move(left), "**", &Parser::ParseUnaryWithFilters));
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseUnaryWithFilters() { return ParseUnary(true); }

  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
    NestingGuard guard(this);
    TANDEM_RETURN_IF_ERROR(guard.Check());
    ExprPtr node;
    if (IsOp("-") || IsOp("+")) {
      node = MakeExpr(IsOp("-") ? Expr::Op::kNeg : Expr::Op::kPos, Cur().line);
      ++pos_;
      TANDEM_ASSIGN_OR_RETURN(ExprPtr operand, ParseUnary(false));
      node->args.push_back(std::move(operand));
    } else {
      TANDEM_ASSIGN_OR_RETURN(node, ParsePrimary());
    }
    TANDEM_ASSIGN_OR_RETURN(node, ParsePostfix(std::move(node)));
    if (with_filter) {
      TANDEM_ASSIGN_OR_RETURN(node, ParseFilterExpr(std::move(node)));
    }
    return node;
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    const Token& t = Cur();
    int line = t.line;
    switch (t.type) {
      case Tok::kName: {
        ExprPtr node = MakeExpr(Expr::Op::kLiteral, line);
        if (t.text == "true" || t.text == "True") {
          node->literal = Value::Bool(true);
        } else if (t.text == "false" || t.text == "False") {
          node->literal = Value::Bool(false);
        } else if (t.text == "none" || t.text == "None") {
          node->literal = Value::None();
        } else {
          node->op = Expr::Op::kName;
          node->name = t.text;
        }
        ++pos_;
        return node;
      }
      case Tok::kString: {
        // Adjacent string literals concatenate, as in Python.
        std::string s;
        while (Cur().type == Tok::kString) s += toks_[pos_++].text;
        ExprPtr node = MakeExpr(Expr::Op::kLiteral, line);
        node->literal = Value::Str(std::move(s));
        return node;
      }
      case Tok::kInt:
      case Tok::kFloat: {
        ExprPtr node = MakeExpr(Expr::Op::kLiteral, line);
        node->literal = t.type == Tok::kInt ? Value::Int(t.int_value) : Value::Float(t.float_value);
        ++pos_;
        return node;
      }
      case Tok::kOp:
        if (t.text == "(") {
          ++pos_;
          TANDEM_ASSIGN_OR_RETURN(ExprPtr inner, ParseTuple(true, {}, true));
          TANDEM_RETURN_IF_ERROR(ExpectOp(")"));
          return inner;
        }
        if (t.text == "[") {
          ++pos_;
          ExprPtr node = MakeExpr(Expr::Op::kList, line);
          while (!IsOp("]")) {
            if (!node->args.empty()) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
            if (IsOp("]")) break;
            TANDEM_ASSIGN_OR_RETURN(ExprPtr item, ParseExpression(true));
            node->args.push_back(std::move(item));
          }
          ++pos_;
          return node;
        }
        if (t.text == "{") {
          ++pos_;
          ExprPtr node = MakeExpr(Expr::Op::kDict, line);
          while (!IsOp("}")) {
            if (!node->args.empty()) TANDEM_RETURN_IF_ERROR(ExpectOp(","));
            if (IsOp("}")) break;
            TANDEM_ASSIGN_OR_RETURN(ExprPtr key, ParseExpression(true));
            TANDEM_RETURN_IF_ERROR(ExpectOp(":"));
            TANDEM_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
            node->args.push_back(std::move(key));
            node->args.push_back(std::move(value));
          }
          ++pos_;
          return node;
        }
        break;
      default:
        break;
    }
    return Unexpected();
  }

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr node) {
    while (true) {
      if (IsOp(".")) {
        int line = Cur().line;
        ++pos_;
        if (Cur().type == Tok::kName) {
          ExprPtr attr = MakeExpr(Expr::Op::kGetAttr, line);
          attr->name = toks_[pos_++].text;
          attr->args.push_back(std::move(node));
          node = std::move(attr);
        } else if (Cur().type == Tok::kInt) {
          ExprPtr item = MakeExpr(Expr::Op::kGetItem, line);
          item->args.push_back(std::move(node));
          ExprPtr index = MakeExpr(Expr::Op::kLiteral, line);
          index->literal = Value::Int(toks_[pos_++].int_value);
          item->args.push_back(std::move(index));
          node = std::move(item);
        } else {
          return Unexpected("a name or number");
        }
      } else if (IsOp("[")) {
        TANDEM_ASSIGN_OR_RETURN(node, ParseSubscript(std::move(node)));
      } else if (IsOp("(")) {
        TANDEM_ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        return node;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseSubscript(ExprPtr object) {
    int line = Cur().line;
    ++pos_;                      // [
    std::vector<ExprPtr> parts;  // start, stop, step
    bool is_slice = false;
    if (!IsOp(":")) {
      TANDEM_ASSIGN_OR_RETURN(ExprPtr first, ParseExpression(true));
      parts.push_back(std::move(first));
    } else {
      parts.push_back(nullptr);
    }
    if (SkipOp(":")) {
      is_slice = true;
      for (int k = 0; k < 2; ++k) {
        if (k == 1 && !SkipOp(":")) {
          parts.push_back(nullptr);
          break;
        }
        if (IsOp(":") || IsOp("]")) {
          parts.push_back(nullptr);
        } else {
          TANDEM_ASSIGN_OR_RETURN(ExprPtr part, ParseExpression(true));
          parts.push_back(std::move(part));
        }
      }
    }
    if (IsOp(",")) return SyntaxError(Cur().line, "tuple subscripts are not supported");
    TANDEM_RETURN_IF_ERROR(ExpectOp("]"));
    ExprPtr node = MakeExpr(is_slice ? Expr::Op::kSlice : Expr::Op::kGetItem, line);
    node->args.push_back(std::move(object));
    for (ExprPtr& p : parts) node->args.push_back(std::move(p));
    return node;
  }

  absl::Status ParseCallArgs(Expr* node) {
    TANDEM_RETURN_IF_ERROR(ExpectOp("("));
    bool need_comma = false;
    while (!IsOp(")")) {
      if (need_comma) {
        TANDEM_RETURN_IF_ERROR(ExpectOp(","));
        if (IsOp(")")) break;
      }
      if (IsOp("*") || IsOp("**")) {
        return SyntaxError(Cur().line, "*args and **kwargs in calls are not supported");
      }
      if (Cur().type == Tok::kName && Look().type == Tok::kOp && Look().text == "=") {
        std::string key = Cur().text;
        pos_ += 2;
        TANDEM_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        node->kwargs.emplace_back(std::move(key), std::move(value));
      } else {
        if (!node->kwargs.empty()) {
          return SyntaxError(Cur().line, "positional argument follows keyword argument");
        }
        TANDEM_ASSIGN_OR_RETURN(ExprPtr value, ParseExpression(true));
        node->args.push_back(std::move(value));
      }
      need_comma = true;
    }
    ++pos_;
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> ParseCall(ExprPtr callee) {
    ExprPtr node = MakeExpr(Expr::Op::kCall, Cur().line);
    node->args.push_back(std::move(callee));
    TANDEM_RETURN_IF_ERROR(ParseCallArgs(node.get()));
    return node;
  }

  absl::StatusOr<ExprPtr> ParseFilter(ExprPtr input) {
    int line = Cur().line;
    TANDEM_ASSIGN_OR_RETURN(std::string name, ExpectAnyName());
    if (!IsKnownFilter(name)) {
      return SyntaxError(line, absl::StrCat("no filter named '", name, "'"));
    }
    ExprPtr node = MakeExpr(Expr::Op::kFilter, line);
    node->name = std::move(name);
    node->args.push_back(std::move(input));
    if (IsOp("(")) TANDEM_RETURN_IF_ERROR(ParseCallArgs(node.get()));
    return node;
  }

  absl::StatusOr<ExprPtr> ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (SkipOp("|")) {
        TANDEM_ASSIGN_OR_RETURN(node, ParseFilter(std::move(node)));
      } else if (IsName("is")) {
        TANDEM_ASSIGN_OR_RETURN(node, ParseTest(std::move(node)));
      } else if (IsOp("(")) {
        TANDEM_ASSIGN_OR_RETURN(node, ParseCall(std::move(node)));
      } else {
        return node;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseTest(ExprPtr input) {
    int line = Cur().line;
    ++pos_;  // is
    bool negated = SkipName("not");
    TANDEM_ASSIGN_OR_RETURN(std::string name, ExpectAnyName());
    if (!IsKnownTest(name)) return SyntaxError(line, absl::StrCat("no test named '", name, "'"));
    ExprPtr node = MakeExpr(Expr::Op::kTest, line);
    node->name = std::move(name);
    node->args.push_back(std::move(input));
    if (IsOp("(")) {
      TANDEM_RETURN_IF_ERROR(ParseCallArgs(node.get()));
    } else if ((Cur().type == Tok::kName || Cur().type == Tok::kString || Cur().type == Tok::kInt ||
                Cur().type == Tok::kFloat || IsOp("[") || IsOp("{")) &&
               !IsName("else") && !IsName("or") && !IsName("and")) {
      if (IsName("is")) return SyntaxError(Cur().line, "you cannot chain multiple tests with is");
      // A single argument without parentheses: `x is divisibleby 3`, `x is sameas none`.
      TANDEM_ASSIGN_OR_RETURN(ExprPtr arg, ParsePrimary());
      TANDEM_ASSIGN_OR_RETURN(arg, ParsePostfix(std::move(arg)));
      node->args.push_back(std::move(arg));
    }
    if (!negated) return node;
    ExprPtr not_node = MakeExpr(Expr::Op::kNot, line);
    not_node->args.push_back(std::move(node));
    return not_node;
  }

  std::vector<Token> toks_;
  size_t pos_ = 0;
  int nesting_ = 0;
  int loop_depth_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Renderer
// ---------------------------------------------------------------------------------------------

// Variables visible at one point. A for-loop iteration, macro call, {% with %} and block
// captures get their own scope, so `set` inside them does not leak out (namespaces aside);
// {% if %} shares its parent's.
struct Scope {
  std::shared_ptr<Scope> parent;
  absl::flat_hash_map<std::string, Value> vars;
};
using ScopePtr = std::shared_ptr<Scope>;

ScopePtr NewScope(const ScopePtr& parent) {
  auto scope = std::make_shared<Scope>();
  scope->parent = parent;
  return scope;
}

using Params = std::vector<std::optional<Value>>;

class Renderer {
 public:
  Renderer(const JinjaLimits& limits, std::string* out) : limits_(limits), out_(out) {}

  absl::Status ExecBody(const Body& body, const ScopePtr& scope);
  absl::StatusOr<Value> Eval(const Expr& e, const ScopePtr& scope);

  // An error at the template line being evaluated.
  absl::Status Fail(absl::string_view msg) const {
    return absl::InvalidArgumentError(absl::StrCat("template line ", line_, ": ", msg));
  }
  absl::Status UndefinedError(const Value& v) const {
    return Fail(v.hint().empty() ? "value is undefined" : v.hint());
  }
  absl::Status CheckNesting(int nesting) const {
    if (nesting > kMaxValueNesting) {
      return Fail(absl::StrCat("value nests deeper than ", kMaxValueNesting, " levels"));
    }
    return absl::OkStatus();
  }
  // Rejects a string or list of `n` bytes or items that would exceed the output limit.
  absl::Status CheckSize(size_t n) const {
    if (n > limits_.max_output_bytes) {
      return Fail(absl::StrCat("value exceeds the template size limit of ",
                               limits_.max_output_bytes, " bytes"));
    }
    return absl::OkStatus();
  }

  // Binds call arguments to named parameters like a Python signature; parameters the caller
  // did not pass stay empty.
  absl::StatusOr<Params> Bind(absl::string_view fn, const CallArgs& args,
                              std::initializer_list<std::string_view> names) const {
    if (args.positional.size() > names.size()) {
      return Fail(absl::StrCat(fn, "() takes at most ", names.size(), " argument(s), ",
                               args.positional.size(), " given"));
    }
    Params out(names.size());
    for (size_t i = 0; i < args.positional.size(); ++i) out[i] = args.positional[i];
    for (const auto& [key, value] : args.keyword) {
      auto it = std::find(names.begin(), names.end(), key);
      if (it == names.end()) {
        return Fail(absl::StrCat(fn, "() got an unexpected keyword argument '", key, "'"));
      }
      size_t i = it - names.begin();
      if (out[i]) return Fail(absl::StrCat(fn, "() got multiple values for argument '", key, "'"));
      out[i] = value;
    }
    return out;
  }
  absl::StatusOr<int64_t> IntParam(const std::optional<Value>& v, absl::string_view what,
                                   int64_t def) const {
    if (!v || v->is(Kind::kNone)) return def;
    if (v->is(Kind::kInt) || v->is_bool()) return v->as_int();
    return Fail(absl::StrCat(what, " must be an integer, not ", TypeName(*v)));
  }
  static bool BoolParam(const std::optional<Value>& v, bool def) { return v ? Truthy(*v) : def; }

  absl::StatusOr<std::shared_ptr<const ValueList>> Iterate(const Value& v) const;
  absl::StatusOr<Value> GetAttr(const Value& obj, const std::string& name) const;
  absl::StatusOr<Value> GetItem(const Value& obj, const Value& key) const;
  // `item.a.b` or `item.0` for the attribute= arguments of filters.
  absl::StatusOr<Value> AttrPath(const Value& item, const Value& path) const;
  absl::StatusOr<Value> CallValue(const Value& fn, CallArgs& args);
  absl::StatusOr<Value> CallMethod(const Value& self, const std::string& name, CallArgs& args);
  absl::StatusOr<Value> ApplyFilter(const std::string& name, const Value& input, CallArgs& args);
  absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& input, CallArgs& args);
  absl::StatusOr<Value> Arith(absl::string_view op, const Value& a, const Value& b) const;
  absl::StatusOr<bool> Less(const Value& a, const Value& b) const;
  absl::StatusOr<bool> Contains(const Value& container, const Value& item) const;
  // Sorts like Python's sorted(): stable, by `<`, failing on values that do not compare.
  absl::Status Sort(std::vector<std::pair<Value, Value>>* keyed, bool reverse) const;
  absl::StatusOr<Value> CallMacro(const Node& macro, const ScopePtr& closure, CallArgs& args);

 private:
  // Bounds the nesting of evaluation, so that deep or recursive templates fail cleanly.
  class DepthGuard {
   public:
    explicit DepthGuard(Renderer* r) : r_(r) { ++r_->depth_; }
    ~DepthGuard() { --r_->depth_; }
    absl::Status Check() const {
      if (r_->depth_ > r_->limits_.max_depth) {
        return r_->Fail(absl::StrCat("template nesting exceeds ", r_->limits_.max_depth,
                                     " levels (runaway recursion?)"));
      }
      return absl::OkStatus();
    }

   private:
    Renderer* r_;
  };

  enum class Jump { kNone, kBreak, kContinue };

  absl::Status Exec(const Node& n, const ScopePtr& scope);
  absl::Status ExecFor(const Node& n, const ScopePtr& scope);
  absl::Status Step() {
    if (++steps_ > limits_.max_steps) {
      return Fail(absl::StrCat("template exceeded its limit of ", limits_.max_steps, " steps"));
    }
    return absl::OkStatus();
  }
  absl::Status Write(std::string_view s) {
    written_ += s.size();
    if (written_ > limits_.max_output_bytes) {
      return Fail(absl::StrCat("template output exceeds ", limits_.max_output_bytes, " bytes"));
    }
    out_->append(s);
    return absl::OkStatus();
  }
  // Renders `body` in a child scope and returns the text instead of writing it.
  absl::StatusOr<std::string> Capture(const Body& body, const ScopePtr& scope) {
    std::string buf;
    std::string* saved = out_;
    out_ = &buf;
    absl::Status status = ExecBody(body, scope);
    out_ = saved;
    TANDEM_RETURN_IF_ERROR(status);
    return buf;
  }
  absl::Status Assign(const Target& target, const Value& value, const ScopePtr& scope);
  Value Lookup(const std::string& name, const ScopePtr& scope) const;
  absl::StatusOr<CallArgs> EvalArgs(const Expr& e, size_t first, const ScopePtr& scope);
  absl::StatusOr<Value> EvalCall(const Expr& e, const ScopePtr& scope);
  absl::StatusOr<Value> EvalSlice(const Expr& e, const ScopePtr& scope);
  absl::StatusOr<Value> ApplyFilters(const std::vector<ExprPtr>& filters, Value value,
                                     const ScopePtr& scope);
  absl::StatusOr<Value> LoopAttr(const Value& loop, const std::string& name) const;
  absl::StatusOr<Value> StrMethod(const std::string& s, const std::string& name, CallArgs& args);

  const JinjaLimits& limits_;
  std::string* out_;  // Where text goes: the result, or a capture buffer. Not owned.
  int line_ = 1;
  int depth_ = 0;
  int64_t steps_ = 0;
  size_t written_ = 0;
  Jump jump_ = Jump::kNone;
};

// ---- globals --------------------------------------------------------------------------------

absl::StatusOr<ValueDict> DictFromArgs(Renderer& r, absl::string_view fn, const CallArgs& args) {
  ValueDict out;
  auto put = [&](const Value& k, const Value& v) {
    for (auto& [k2, v2] : out) {
      if (PyEquals(k2, k)) {
        v2 = v;
        return;
      }
    }
    out.emplace_back(k, v);
  };
  if (args.positional.size() > 1) return r.Fail(absl::StrCat(fn, "() takes at most 1 argument"));
  if (!args.positional.empty()) {
    const Value& src = args.positional[0];
    if (src.is_dict() || src.is(Kind::kNamespace)) {
      for (const auto& [k, v] : src.dict()) put(k, v);
    } else {
      TANDEM_ASSIGN_OR_RETURN(auto items, r.Iterate(src));
      for (const Value& pair : *items) {
        TANDEM_ASSIGN_OR_RETURN(auto kv, r.Iterate(pair));
        if (kv->size() != 2) return r.Fail(absl::StrCat(fn, "() needs key/value pairs"));
        put((*kv)[0], (*kv)[1]);
      }
    }
  }
  for (const auto& [k, v] : args.keyword) put(Value::Str(k), v);
  return out;
}

const absl::flat_hash_map<std::string, Value>& Globals() {
  static const auto* globals = [] {
    auto* g = new absl::flat_hash_map<std::string, Value>();
    (*g)["range"] = Value::Function("range", [](Renderer& r, CallArgs& a) -> absl::StatusOr<Value> {
      if (!a.keyword.empty() || a.positional.empty() || a.positional.size() > 3) {
        return r.Fail("range() takes 1 to 3 integer arguments");
      }
      int64_t v[3] = {0, 0, 1};
      for (size_t i = 0; i < a.positional.size(); ++i) {
        const Value& x = a.positional[i];
        if (!x.is(Kind::kInt) && !x.is_bool()) {
          return r.Fail(
              absl::StrCat("'", TypeName(x), "' object cannot be interpreted as an integer"));
        }
        v[a.positional.size() == 1 ? 1 : i] = x.as_int();
      }
      if (v[2] == 0) return r.Fail("range() arg 3 must not be zero");
      // The sandbox's limit on range sizes.
      constexpr int64_t kMaxRange = 100000;
      long double count = v[2] > 0 ? std::ceil((static_cast<long double>(v[1]) - v[0]) / v[2])
                                   : std::ceil((static_cast<long double>(v[0]) - v[1]) / -v[2]);
      if (count > kMaxRange) {
        return r.Fail("range too big, the sandbox blocks ranges larger than 100000");
      }
      ValueList items;
      for (int64_t i = v[0]; v[2] > 0 ? i < v[1] : i > v[1]; i += v[2])
        items.push_back(Value::Int(i));
      return Value::List(std::move(items));
    });
    (*g)["dict"] = Value::Function("dict", [](Renderer& r, CallArgs& a) -> absl::StatusOr<Value> {
      TANDEM_ASSIGN_OR_RETURN(ValueDict d, DictFromArgs(r, "dict", a));
      return Value::Dict(std::move(d));
    });
    (*g)["namespace"] =
        Value::Function("namespace", [](Renderer& r, CallArgs& a) -> absl::StatusOr<Value> {
          TANDEM_ASSIGN_OR_RETURN(ValueDict d, DictFromArgs(r, "namespace", a));
          return Value::Namespace(std::move(d));
        });
    // The message becomes the error, unprefixed, as Hugging Face surfaces TemplateError.
    (*g)["raise_exception"] =
        Value::Function("raise_exception", [](Renderer&, CallArgs& a) -> absl::StatusOr<Value> {
          return absl::InvalidArgumentError(a.positional.empty() ? "" : PyStr(a.positional[0]));
        });
    (*g)["strftime_now"] =
        Value::Function("strftime_now", [](Renderer& r, CallArgs& a) -> absl::StatusOr<Value> {
          if (a.positional.size() != 1 || !a.positional[0].is_string()) {
            return r.Fail("strftime_now() takes one format string");
          }
          std::time_t now = std::time(nullptr);
          std::tm tm{};
          localtime_r(&now, &tm);
          std::string buf(256, '\0');
          size_t n = std::strftime(buf.data(), buf.size(), a.positional[0].str().c_str(), &tm);
          buf.resize(n);
          return Value::Str(std::move(buf));
        });
    return g;
  }();
  return *globals;
}

// ---- statements -----------------------------------------------------------------------------

absl::Status Renderer::ExecBody(const Body& body, const ScopePtr& scope) {
  for (const auto& node : body) {
    TANDEM_RETURN_IF_ERROR(Exec(*node, scope));
    if (jump_ != Jump::kNone) break;
  }
  return absl::OkStatus();
}

absl::Status Renderer::Exec(const Node& n, const ScopePtr& scope) {
  DepthGuard guard(this);
  TANDEM_RETURN_IF_ERROR(guard.Check());
  line_ = n.line;
  TANDEM_RETURN_IF_ERROR(Step());
  switch (n.type) {
    case Node::Type::kText:
      return Write(n.text);
    case Node::Type::kOutput: {
      TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*n.expr, scope));
      return Write(PyStr(v));
    }
    case Node::Type::kIf:
      for (size_t i = 0; i < n.conds.size(); ++i) {
        TANDEM_ASSIGN_OR_RETURN(Value c, Eval(*n.conds[i], scope));
        if (Truthy(c)) return ExecBody(n.branches[i], scope);
      }
      if (n.branches.size() > n.conds.size()) return ExecBody(n.branches.back(), scope);
      return absl::OkStatus();
    case Node::Type::kFor:
      return ExecFor(n, scope);
    case Node::Type::kSet: {
      TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*n.expr, scope));
      line_ = n.line;
      return Assign(n.target, v, scope);
    }
    case Node::Type::kSetBlock: {
      TANDEM_ASSIGN_OR_RETURN(std::string text, Capture(n.body, NewScope(scope)));
      TANDEM_ASSIGN_OR_RETURN(Value v, ApplyFilters(n.filters, Value::Str(std::move(text)), scope));
      line_ = n.line;
      return Assign(n.target, v, scope);
    }
    case Node::Type::kMacro: {
      const Node* macro = &n;
      std::weak_ptr<Scope> closure = scope;  // Weak: the scope holds the macro itself.
      scope->vars[n.text] = Value::Function(n.text, [macro, closure](Renderer& r, CallArgs& args) {
        return r.CallMacro(*macro, closure.lock(), args);
      });
      return absl::OkStatus();
    }
    case Node::Type::kBreak:
      jump_ = Jump::kBreak;
      return absl::OkStatus();
    case Node::Type::kContinue:
      jump_ = Jump::kContinue;
      return absl::OkStatus();
    case Node::Type::kWith: {
      std::vector<Value> values;
      for (const auto& v : n.with_values) {
        TANDEM_ASSIGN_OR_RETURN(Value value, Eval(*v, scope));
        values.push_back(std::move(value));
      }
      ScopePtr inner = NewScope(scope);
      for (size_t i = 0; i < values.size(); ++i) {
        TANDEM_RETURN_IF_ERROR(Assign(n.with_targets[i], values[i], inner));
      }
      return ExecBody(n.body, inner);
    }
    case Node::Type::kFilterBlock: {
      TANDEM_ASSIGN_OR_RETURN(std::string text, Capture(n.body, NewScope(scope)));
      TANDEM_ASSIGN_OR_RETURN(Value v, ApplyFilters(n.filters, Value::Str(std::move(text)), scope));
      return Write(PyStr(v));
    }
    case Node::Type::kPassThrough:
      // Rendered like the body of a call block, which has a scope of its own.
      return ExecBody(n.body, NewScope(scope));
  }
  return absl::OkStatus();
}

absl::Status Renderer::ExecFor(const Node& n, const ScopePtr& scope) {
  TANDEM_ASSIGN_OR_RETURN(Value seq, Eval(*n.expr, scope));
  line_ = n.line;
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<const ValueList> items, Iterate(seq));
  if (n.cond) {
    // `for x in xs if cond`: loop.* then describe the filtered sequence.
    auto kept = std::make_shared<ValueList>();
    for (const Value& item : *items) {
      TANDEM_RETURN_IF_ERROR(Step());
      ScopePtr probe = NewScope(scope);
      TANDEM_RETURN_IF_ERROR(Assign(n.target, item, probe));
      TANDEM_ASSIGN_OR_RETURN(Value keep, Eval(*n.cond, probe));
      if (Truthy(keep)) kept->push_back(item);
    }
    items = std::move(kept);
  }
  const int64_t length = static_cast<int64_t>(items->size());
  for (int64_t i = 0; i < length; ++i) {
    line_ = n.line;
    TANDEM_RETURN_IF_ERROR(Step());
    ScopePtr inner = NewScope(scope);
    auto info = std::make_shared<LoopInfo>();
    info->index0 = i;
    info->length = length;
    info->items = items;
    inner->vars["loop"] = Value::Loop(std::move(info));
    TANDEM_RETURN_IF_ERROR(Assign(n.target, (*items)[i], inner));
    TANDEM_RETURN_IF_ERROR(ExecBody(n.body, inner));
    if (jump_ == Jump::kBreak) {
      jump_ = Jump::kNone;
      break;
    }
    jump_ = Jump::kNone;
  }
  if (length == 0 && !n.else_body.empty()) return ExecBody(n.else_body, NewScope(scope));
  return absl::OkStatus();
}

// How deeply containers nest in `v`, following namespaces, loops and bound methods as they are
// now; -1 if `target` is reachable from it. Heights are memoized by identity, so shared
// substructures are measured once.
int HeightReaching(const Value& v, const void* target,
                   absl::flat_hash_map<const void*, int>* heights) {
  std::vector<const Value*> children;
  switch (v.kind()) {
    case Kind::kList:
      for (const Value& c : v.list()) children.push_back(&c);
      break;
    case Kind::kDict:
    case Kind::kNamespace:
      for (const auto& [k, c] : v.dict()) {
        children.push_back(&k);
        children.push_back(&c);
      }
      break;
    case Kind::kLoop:
      for (const Value& c : *v.loop().items) children.push_back(&c);
      break;
    case Kind::kCallable:
      if (v.callable().receiver) children.push_back(v.callable().receiver.get());
      break;
    default:
      return 0;
  }
  const void* id = v.identity();
  if (id == target) return -1;
  if (auto it = heights->find(id); it != heights->end()) return it->second;
  int height = 0;
  for (const Value* c : children) {
    int h = HeightReaching(*c, target, heights);
    if (h < 0) return -1;
    height = std::max(height, h + 1);
  }
  (*heights)[id] = height;
  return height;
}

absl::Status Renderer::Assign(const Target& target, const Value& value, const ScopePtr& scope) {
  switch (target.kind) {
    case Target::Kind::kName:
      TANDEM_RETURN_IF_ERROR(CheckNesting(value.nesting()));
      scope->vars[target.names[0]] = value;
      return absl::OkStatus();
    case Target::Kind::kTuple: {
      TANDEM_RETURN_IF_ERROR(CheckNesting(value.nesting()));
      TANDEM_ASSIGN_OR_RETURN(auto items, Iterate(value));
      if (items->size() != target.names.size()) {
        return Fail(absl::StrCat(items->size() < target.names.size() ? "not enough" : "too many",
                                 " values to unpack (expected ", target.names.size(), ", got ",
                                 items->size(), ")"));
      }
      for (size_t i = 0; i < items->size(); ++i) scope->vars[target.names[i]] = (*items)[i];
      return absl::OkStatus();
    }
    case Target::Kind::kNamespaceAttr: {
      Value ns = Lookup(target.names[0], scope);
      if (ns.is_undefined()) return UndefinedError(ns);
      if (!ns.is(Kind::kNamespace)) return Fail("cannot assign attribute on non-namespace object");
      // Namespaces are the only mutable values, so this is where a value could come to contain
      // itself or grow deeper than its recorded nesting: measure what it holds now.
      absl::flat_hash_map<const void*, int> heights;
      int height = HeightReaching(value, ns.identity(), &heights);
      if (height < 0) return Fail("a namespace cannot contain itself");
      TANDEM_RETURN_IF_ERROR(CheckNesting(height));
      ValueDict& attrs = ns.namespace_attrs();
      for (auto& [k, v] : attrs) {
        if (k.is_string() && k.str() == target.attr) {
          v = value;
          return absl::OkStatus();
        }
      }
      attrs.emplace_back(Value::Str(target.attr), value);
      return absl::OkStatus();
    }
  }
  return absl::OkStatus();
}

Value Renderer::Lookup(const std::string& name, const ScopePtr& scope) const {
  for (const Scope* s = scope.get(); s != nullptr; s = s->parent.get()) {
    auto it = s->vars.find(name);
    if (it != s->vars.end()) return it->second;
  }
  auto it = Globals().find(name);
  if (it != Globals().end()) return it->second;
  return Value::Undefined(absl::StrCat("'", name, "' is undefined"));
}

absl::StatusOr<Value> Renderer::CallMacro(const Node& macro, const ScopePtr& closure,
                                          CallArgs& args) {
  if (closure == nullptr) {
    return Fail(absl::StrCat("macro '", macro.text, "' called after its scope ended"));
  }
  const size_t n = macro.params.size();
  if (args.positional.size() > n) {
    return Fail(absl::StrCat("macro '", macro.text, "' takes not more than ", n, " argument(s)"));
  }
  std::vector<std::optional<Value>> bound(n);
  for (size_t i = 0; i < args.positional.size(); ++i) bound[i] = std::move(args.positional[i]);
  for (auto& [key, value] : args.keyword) {
    auto it = std::find(macro.params.begin(), macro.params.end(), key);
    if (it == macro.params.end()) {
      return Fail(absl::StrCat("macro '", macro.text, "' takes no keyword argument '", key, "'"));
    }
    bound[it - macro.params.begin()] = std::move(value);
  }
  ScopePtr scope = NewScope(closure);
  for (size_t i = 0; i < n; ++i) {
    Value v;
    if (bound[i]) {
      v = std::move(*bound[i]);
    } else if (macro.defaults[i]) {
      TANDEM_ASSIGN_OR_RETURN(v, Eval(*macro.defaults[i], scope));
    } else {
      v = Value::Undefined(absl::StrCat("parameter '", macro.params[i], "' was not provided"));
    }
    scope->vars[macro.params[i]] = std::move(v);
  }
  TANDEM_ASSIGN_OR_RETURN(std::string text, Capture(macro.body, scope));
  return Value::Str(std::move(text));
}

// ---- expressions ----------------------------------------------------------------------------

absl::StatusOr<Value> Renderer::Eval(const Expr& e, const ScopePtr& scope) {
  DepthGuard guard(this);
  TANDEM_RETURN_IF_ERROR(guard.Check());
  switch (e.op) {
    case Expr::Op::kLiteral:
      return e.literal;
    case Expr::Op::kName:
      return Lookup(e.name, scope);
    case Expr::Op::kList:
    case Expr::Op::kTuple: {
      ValueList items;
      items.reserve(e.args.size());
      for (const auto& a : e.args) {
        TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*a, scope));
        items.push_back(std::move(v));
      }
      Value list = Value::List(std::move(items), e.op == Expr::Op::kTuple ? Value::Flavor::kTuple
                                                                          : Value::Flavor::kList);
      TANDEM_RETURN_IF_ERROR(CheckNesting(list.nesting()));
      return list;
    }
    case Expr::Op::kDict: {
      ValueDict items;
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        TANDEM_ASSIGN_OR_RETURN(Value k, Eval(*e.args[i], scope));
        TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*e.args[i + 1], scope));
        bool replaced = false;
        for (auto& [k2, v2] : items) {
          if (PyEquals(k2, k)) {
            v2 = v;
            replaced = true;
            break;
          }
        }
        if (!replaced) items.emplace_back(std::move(k), std::move(v));
      }
      Value dict = Value::Dict(std::move(items));
      TANDEM_RETURN_IF_ERROR(CheckNesting(dict.nesting()));
      return dict;
    }
    case Expr::Op::kGetAttr: {
      TANDEM_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0], scope));
      line_ = e.line;
      return GetAttr(obj, e.name);
    }
    case Expr::Op::kGetItem: {
      TANDEM_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0], scope));
      TANDEM_ASSIGN_OR_RETURN(Value key, Eval(*e.args[1], scope));
      line_ = e.line;
      return GetItem(obj, key);
    }
    case Expr::Op::kSlice:
      return EvalSlice(e, scope);
    case Expr::Op::kCall:
      return EvalCall(e, scope);
    case Expr::Op::kFilter: {
      TANDEM_ASSIGN_OR_RETURN(Value input, Eval(*e.args[0], scope));
      TANDEM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, 1, scope));
      line_ = e.line;
      return ApplyFilter(e.name, input, args);
    }
    case Expr::Op::kTest: {
      TANDEM_ASSIGN_OR_RETURN(Value input, Eval(*e.args[0], scope));
      TANDEM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, 1, scope));
      line_ = e.line;
      TANDEM_ASSIGN_OR_RETURN(bool result, ApplyTest(e.name, input, args));
      return Value::Bool(result);
    }
    case Expr::Op::kNeg:
    case Expr::Op::kPos: {
      TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*e.args[0], scope));
      line_ = e.line;
      if (v.is_undefined()) return UndefinedError(v);
      if (!v.is_number()) {
        return Fail(absl::StrCat("bad operand type for unary ", e.op == Expr::Op::kNeg ? "-" : "+",
                                 ": '", TypeName(v), "'"));
      }
      if (e.op == Expr::Op::kPos) return v.is_bool() ? Value::Int(v.as_int()) : v;
      if (v.is(Kind::kFloat)) return Value::Float(-v.as_double());
      if (v.as_int() == std::numeric_limits<int64_t>::min()) return Fail("integer overflow");
      return Value::Int(-v.as_int());
    }
    case Expr::Op::kNot: {
      TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*e.args[0], scope));
      return Value::Bool(!Truthy(v));
    }
    case Expr::Op::kAnd:
    case Expr::Op::kOr: {
      TANDEM_ASSIGN_OR_RETURN(Value left, Eval(*e.args[0], scope));
      if (Truthy(left) == (e.op == Expr::Op::kOr)) return left;
      return Eval(*e.args[1], scope);
    }
    case Expr::Op::kBinary: {
      TANDEM_ASSIGN_OR_RETURN(Value a, Eval(*e.args[0], scope));
      TANDEM_ASSIGN_OR_RETURN(Value b, Eval(*e.args[1], scope));
      line_ = e.line;
      return Arith(e.name, a, b);
    }
    case Expr::Op::kCompare: {
      TANDEM_ASSIGN_OR_RETURN(Value left, Eval(*e.args[0], scope));
      for (size_t i = 0; i < e.compare_ops.size(); ++i) {
        TANDEM_ASSIGN_OR_RETURN(Value right, Eval(*e.args[i + 1], scope));
        line_ = e.line;
        const std::string& op = e.compare_ops[i];
        bool result;
        if (op == "==" || op == "!=") {
          result = PyEquals(left, right) == (op == "==");
        } else if (op == "in" || op == "not in") {
          TANDEM_ASSIGN_OR_RETURN(bool in, Contains(right, left));
          result = in == (op == "in");
        } else if (op == "<" || op == ">=") {
          TANDEM_ASSIGN_OR_RETURN(bool less, Less(left, right));
          result = less == (op == "<");
        } else {
          TANDEM_ASSIGN_OR_RETURN(bool greater, Less(right, left));
          result = greater == (op == ">");
        }
        if (!result) return Value::Bool(false);
        left = std::move(right);
      }
      return Value::Bool(true);
    }
    case Expr::Op::kConcat: {
      std::string s;
      for (const auto& a : e.args) {
        TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*a, scope));
        s += PyStr(v);
        TANDEM_RETURN_IF_ERROR(CheckSize(s.size()));
      }
      return Value::Str(std::move(s));
    }
    case Expr::Op::kCond: {
      TANDEM_ASSIGN_OR_RETURN(Value c, Eval(*e.args[1], scope));
      if (Truthy(c)) return Eval(*e.args[0], scope);
      if (e.args[2]) return Eval(*e.args[2], scope);
      return Value::Undefined(
          "the inline if-expression evaluated to false and no else section "
          "was defined");
    }
  }
  return Fail("unhandled expression");
}

absl::StatusOr<CallArgs> Renderer::EvalArgs(const Expr& e, size_t first, const ScopePtr& scope) {
  CallArgs args;
  for (size_t i = first; i < e.args.size(); ++i) {
    TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*e.args[i], scope));
    args.positional.push_back(std::move(v));
  }
  for (const auto& [key, expr] : e.kwargs) {
    TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*expr, scope));
    args.keyword.emplace_back(key, std::move(v));
  }
  return args;
}

absl::StatusOr<Value> Renderer::EvalCall(const Expr& e, const ScopePtr& scope) {
  const Expr& callee = *e.args[0];
  Value fn;
  if (callee.op == Expr::Op::kGetAttr) {
    TANDEM_ASSIGN_OR_RETURN(Value obj, Eval(*callee.args[0], scope));
    line_ = callee.line;
    TANDEM_ASSIGN_OR_RETURN(fn, GetAttr(obj, callee.name));
  } else {
    TANDEM_ASSIGN_OR_RETURN(fn, Eval(callee, scope));
  }
  TANDEM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(e, 1, scope));
  line_ = e.line;
  return CallValue(fn, args);
}

absl::StatusOr<Value> Renderer::CallValue(const Value& fn, CallArgs& args) {
  if (fn.is(Kind::kCallable)) return fn.callable().fn(*this, args);
  if (fn.is_undefined()) return UndefinedError(fn);
  return Fail(absl::StrCat("'", TypeName(fn), "' object is not callable"));
}

absl::StatusOr<Value> Renderer::ApplyFilters(const std::vector<ExprPtr>& filters, Value value,
                                             const ScopePtr& scope) {
  for (const auto& f : filters) {
    TANDEM_ASSIGN_OR_RETURN(CallArgs args, EvalArgs(*f, 1, scope));
    line_ = f->line;
    TANDEM_ASSIGN_OR_RETURN(value, ApplyFilter(f->name, value, args));
  }
  return value;
}

// Python's slice.indices() followed by the walk it describes.
absl::StatusOr<std::vector<int64_t>> SliceIndices(Renderer& r, int64_t n,
                                                  std::optional<int64_t> start,
                                                  std::optional<int64_t> stop,
                                                  std::optional<int64_t> step_opt) {
  int64_t step = step_opt.value_or(1);
  if (step == 0) return r.Fail("slice step cannot be zero");
  auto clamp = [&](std::optional<int64_t> v, int64_t def) {
    if (!v) return def;
    int64_t x = *v;
    if (x < 0) {
      x += n;
      if (x < 0) x = step < 0 ? -1 : 0;
    } else if (x >= n) {
      x = step < 0 ? n - 1 : n;
    }
    return x;
  };
  int64_t b = clamp(start, step > 0 ? 0 : n - 1);
  int64_t e = clamp(stop, step > 0 ? n : -1);
  std::vector<int64_t> out;
  for (int64_t i = b; step > 0 ? i < e : i > e; i += step) out.push_back(i);
  return out;
}

absl::StatusOr<Value> Renderer::EvalSlice(const Expr& e, const ScopePtr& scope) {
  TANDEM_ASSIGN_OR_RETURN(Value obj, Eval(*e.args[0], scope));
  std::optional<int64_t> bounds[3];
  bool valid = true;
  for (int k = 0; k < 3; ++k) {
    if (!e.args[k + 1]) continue;
    TANDEM_ASSIGN_OR_RETURN(Value v, Eval(*e.args[k + 1], scope));
    if (v.is(Kind::kInt) || v.is_bool()) {
      bounds[k] = v.as_int();
    } else if (!v.is(Kind::kNone)) {
      valid = false;
    }
  }
  line_ = e.line;
  if (obj.is_undefined()) return UndefinedError(obj);
  if (!valid) return Value::Undefined("slice indices must be integers or None");
  if (obj.is_string()) {
    std::vector<size_t> starts = CodePointStarts(obj.str());
    TANDEM_ASSIGN_OR_RETURN(auto idx, SliceIndices(*this, static_cast<int64_t>(starts.size()),
                                                   bounds[0], bounds[1], bounds[2]));
    std::string out;
    for (int64_t i : idx) {
      size_t b = starts[i];
      size_t end = static_cast<size_t>(i) + 1 < starts.size() ? starts[i + 1] : obj.str().size();
      out.append(obj.str(), b, end - b);
    }
    return Value::Str(std::move(out));
  }
  if (obj.is_list() && obj.flavor() != Value::Flavor::kIterator) {
    TANDEM_ASSIGN_OR_RETURN(auto idx, SliceIndices(*this, static_cast<int64_t>(obj.list().size()),
                                                   bounds[0], bounds[1], bounds[2]));
    ValueList out;
    out.reserve(idx.size());
    for (int64_t i : idx) out.push_back(obj.list()[i]);
    return Value::List(std::move(out), obj.flavor());
  }
  return Value::Undefined(absl::StrCat("'", TypeName(obj), "' object is not subscriptable"));
}

absl::StatusOr<std::shared_ptr<const ValueList>> Renderer::Iterate(const Value& v) const {
  switch (v.kind()) {
    case Kind::kList:
      return v.list_ptr();
    case Kind::kDict: {
      auto keys = std::make_shared<ValueList>();
      for (const auto& [k, val] : v.dict()) keys->push_back(k);
      return std::shared_ptr<const ValueList>(std::move(keys));
    }
    case Kind::kString: {
      auto chars = std::make_shared<ValueList>();
      const std::string& s = v.str();
      for (size_t i = 0; i < s.size();) {
        size_t len = Utf8SeqLen(static_cast<unsigned char>(s[i]));
        chars->push_back(Value::Str(s.substr(i, len)));
        i += len;
      }
      return std::shared_ptr<const ValueList>(std::move(chars));
    }
    case Kind::kUndefined:
      return std::make_shared<const ValueList>();
    default:
      return Fail(absl::StrCat("'", TypeName(v), "' object is not iterable"));
  }
}

bool IsStrMethod(std::string_view name) {
  static constexpr std::string_view kMethods[] = {
      "startswith", "endswith", "split",      "rsplit",  "strip",   "lstrip",  "rstrip", "upper",
      "lower",      "title",    "capitalize", "replace", "find",    "rfind",   "count",  "join",
      "splitlines", "isdigit",  "isalpha",    "isalnum", "isspace", "islower", "isupper"};
  return std::find(std::begin(kMethods), std::end(kMethods), name) != std::end(kMethods);
}

bool IsDictMethod(std::string_view name) {
  return name == "items" || name == "keys" || name == "values" || name == "get";
}

// Dict attributes that would mutate it: the sandbox hides them, so they read as undefined even
// when the dict has such a key.
bool IsUnsafeDictAttr(std::string_view name) {
  return name == "pop" || name == "popitem" || name == "update" || name == "clear" ||
         name == "setdefault" || name == "copy" || name == "fromkeys";
}

Value BoundMethod(const Value& self, const std::string& name) {
  auto receiver = std::make_shared<const Value>(self);
  return Value::Function(
      name,
      [receiver, name](Renderer& r, CallArgs& args) { return r.CallMethod(*receiver, name, args); },
      receiver);
}

absl::StatusOr<Value> Renderer::GetAttr(const Value& obj, const std::string& name) const {
  switch (obj.kind()) {
    case Kind::kUndefined:
      return UndefinedError(obj);
    case Kind::kDict: {
      if (IsDictMethod(name)) return BoundMethod(obj, name);
      if (!IsUnsafeDictAttr(name)) {
        if (const Value* v = DictFind(obj.dict(), name)) return *v;
      }
      break;
    }
    case Kind::kString:
      if (IsStrMethod(name)) return BoundMethod(obj, name);
      break;
    case Kind::kNamespace:
      if (const Value* v = DictFind(obj.dict(), name)) return *v;
      break;
    case Kind::kLoop:
      return LoopAttr(obj, name);
    default:
      break;
  }
  return Value::Undefined(
      absl::StrCat("'", TypeName(obj), " object' has no attribute '", name, "'"));
}

absl::StatusOr<Value> Renderer::GetItem(const Value& obj, const Value& key) const {
  if (obj.is_undefined()) return UndefinedError(obj);
  if (obj.is_dict()) {
    if (const Value* v = DictFind(obj.dict(), key)) return *v;
  } else if ((key.is(Kind::kInt) || key.is_bool()) &&
             ((obj.is_list() && obj.flavor() != Value::Flavor::kIterator) || obj.is_string())) {
    int64_t i = key.as_int();
    if (obj.is_list()) {
      int64_t n = static_cast<int64_t>(obj.list().size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) return obj.list()[i];
    } else {
      std::vector<size_t> starts = CodePointStarts(obj.str());
      int64_t n = static_cast<int64_t>(starts.size());
      if (i < 0) i += n;
      if (i >= 0 && i < n) {
        size_t end = i + 1 < n ? starts[i + 1] : obj.str().size();
        return Value::Str(obj.str().substr(starts[i], end - starts[i]));
      }
    }
    return Value::Undefined(absl::StrCat(TypeName(obj), " object has no element ", i));
  }
  // obj[name] falls back to obj.name, as in Jinja.
  if (key.is_string() && !obj.is_dict()) return GetAttr(obj, key.str());
  if (key.is_string() && IsDictMethod(key.str())) return BoundMethod(obj, key.str());
  return Value::Undefined(
      absl::StrCat("'", TypeName(obj), " object' has no attribute ", PyRepr(key)));
}

absl::StatusOr<Value> Renderer::AttrPath(const Value& item, const Value& path) const {
  if (!path.is_string()) return GetItem(item, path);
  Value v = item;
  size_t start = 0;
  const std::string& p = path.str();
  while (true) {
    size_t dot = p.find('.', start);
    std::string part = p.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(), IsAsciiDigit);
    Value key = numeric ? Value::Int(std::strtoll(part.c_str(), nullptr, 10)) : Value::Str(part);
    TANDEM_ASSIGN_OR_RETURN(v, GetItem(v, key));
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

absl::StatusOr<Value> Renderer::LoopAttr(const Value& loop, const std::string& name) const {
  const LoopInfo& l = loop.loop();
  if (name == "index") return Value::Int(l.index0 + 1);
  if (name == "index0") return Value::Int(l.index0);
  if (name == "revindex") return Value::Int(l.length - l.index0);
  if (name == "revindex0") return Value::Int(l.length - l.index0 - 1);
  if (name == "first") return Value::Bool(l.index0 == 0);
  if (name == "last") return Value::Bool(l.index0 == l.length - 1);
  if (name == "length") return Value::Int(l.length);
  if (name == "depth") return Value::Int(l.depth0 + 1);
  if (name == "depth0") return Value::Int(l.depth0);
  if (name == "previtem") {
    if (l.index0 == 0) return Value::Undefined("there is no previous item");
    return (*l.items)[l.index0 - 1];
  }
  if (name == "nextitem") {
    if (l.index0 + 1 >= l.length) return Value::Undefined("there is no next item");
    return (*l.items)[l.index0 + 1];
  }
  if (name == "cycle") {
    int64_t index0 = l.index0;
    return Value::Function("cycle", [index0](Renderer& r, CallArgs& a) -> absl::StatusOr<Value> {
      if (a.positional.empty()) return r.Fail("no items for cycling given");
      return a.positional[index0 % a.positional.size()];
    });
  }
  return Value::Undefined(absl::StrCat("'LoopContext object' has no attribute '", name, "'"));
}

// Python's `format % args` for the conversions templates use: %s %r %a %d %i %u %x %X %o %c
// %e %E %f %F %g %G %%, with flags, width, precision and %(key)s lookups in a dict.
absl::StatusOr<Value> PyPercentFormat(const Renderer& r, const std::string& format,
                                      const Value& args) {
  const bool mapping = args.is_dict();
  std::vector<Value> positional;
  if (args.is_list() && args.flavor() == Value::Flavor::kTuple) {
    positional = args.list();
  } else {
    positional.push_back(args);
  }
  size_t next = 0;
  std::string out;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%') {
      out.push_back(format[i]);
      continue;
    }
    if (++i >= format.size()) return r.Fail("incomplete format");
    if (format[i] == '%') {
      out.push_back('%');
      continue;
    }
    std::optional<Value> value;
    if (format[i] == '(') {
      size_t close = format.find(')', i);
      if (close == std::string::npos) return r.Fail("incomplete format key");
      if (!mapping) return r.Fail("format requires a mapping");
      const Value* v = DictFind(args.dict(), std::string_view(format).substr(i + 1, close - i - 1));
      if (v == nullptr)
        return r.Fail(absl::StrCat("KeyError: '", format.substr(i + 1, close - i - 1), "'"));
      value = *v;
      i = close + 1;
    }
    std::string flags;
    while (i < format.size() &&
           std::string_view("-+ #0").find(format[i]) != std::string_view::npos) {
      flags.push_back(format[i++]);
    }
    std::string width, precision;
    bool has_precision = false;
    while (i < format.size() && IsAsciiDigit(format[i])) width.push_back(format[i++]);
    if (i < format.size() && format[i] == '.') {
      has_precision = true;
      ++i;
      while (i < format.size() && IsAsciiDigit(format[i])) precision.push_back(format[i++]);
    }
    if (width.size() > 4 || precision.size() > 4) return r.Fail("format width too large");
    while (i < format.size() && (format[i] == 'h' || format[i] == 'l' || format[i] == 'L')) ++i;
    if (i >= format.size()) return r.Fail("incomplete format");
    const char conv = format[i];
    if (!value) {
      if (next >= positional.size()) return r.Fail("not enough arguments for format string");
      value = positional[next++];
    }
    const Value& v = *value;
    std::string piece;
    // printf with a spec built only from the digits and flags parsed above.
    auto c_format = [&](const char* length, char c, auto arg) {
      std::string spec = absl::StrCat("%", flags, width, has_precision ? "." : "", precision,
                                      length, std::string(1, c));
      int n = std::snprintf(nullptr, 0, spec.c_str(), arg);
      std::string buf(n > 0 ? n : 0, '\0');
      std::snprintf(buf.data(), buf.size() + 1, spec.c_str(), arg);
      return buf;
    };
    switch (conv) {
      case 's':
      case 'r':
      case 'a': {
        std::string text = conv == 's' ? PyStr(v) : PyRepr(v);
        if (has_precision) {
          size_t keep = precision.empty() ? 0 : std::stoul(precision);
          std::vector<size_t> starts = CodePointStarts(text);
          if (keep < starts.size()) text.resize(starts[keep]);
        }
        size_t w = width.empty() ? 0 : std::stoul(width);
        size_t len = CodePointCount(text);
        if (len < w) {
          bool left = flags.find('-') != std::string::npos;
          text = left ? text + std::string(w - len, ' ') : std::string(w - len, ' ') + text;
        }
        piece = std::move(text);
        break;
      }
      case 'd':
      case 'i':
      case 'u':
      case 'x':
      case 'X':
      case 'o':
      case 'c': {
        if (!v.is_number()) {
          return r.Fail(absl::StrCat("%", std::string(1, conv),
                                     " format: a number is required, not ", TypeName(v)));
        }
        if (v.is(Kind::kFloat) && conv != 'd' && conv != 'i' && conv != 'u') {
          return r.Fail(absl::StrCat("%", std::string(1, conv), " format: an integer is required"));
        }
        long long n = v.is(Kind::kFloat) ? static_cast<long long>(std::trunc(v.as_double()))
                                         : static_cast<long long>(v.as_int());
        if (conv == 'c') {
          if (n < 0 || n > 0x10FFFF) return r.Fail("%c arg not in range(0x110000)");
          AppendUtf8(static_cast<uint32_t>(n), &piece);
        } else {
          piece = c_format("ll", conv == 'u' || conv == 'i' ? 'd' : conv, n);
        }
        break;
      }
      case 'e':
      case 'E':
      case 'f':
      case 'F':
      case 'g':
      case 'G':
        if (!v.is_number()) {
          return r.Fail(absl::StrCat("must be real number, not ", TypeName(v)));
        }
        piece = c_format("", conv, v.as_double());
        break;
      default:
        return r.Fail(absl::StrCat("unsupported format character '", std::string(1, conv), "'"));
    }
    out += piece;
    TANDEM_RETURN_IF_ERROR(r.CheckSize(out.size()));
  }
  if (!mapping && next < positional.size()) {
    return r.Fail("not all arguments converted during string formatting");
  }
  return Value::Str(std::move(out));
}

// ---- operators ------------------------------------------------------------------------------

absl::StatusOr<Value> Renderer::Arith(absl::string_view op, const Value& a, const Value& b) const {
  if (a.is_undefined()) return UndefinedError(a);
  if (b.is_undefined()) return UndefinedError(b);
  auto unsupported = [&] {
    return Fail(absl::StrCat("unsupported operand type(s) for ", op, ": '", TypeName(a), "' and '",
                             TypeName(b), "'"));
  };
  if (a.is_number() && b.is_number()) {
    bool is_float = a.is(Kind::kFloat) || b.is(Kind::kFloat);
    if (!is_float && op != "/" && op != "**") {
      int64_t x = a.as_int(), y = b.as_int(), r = 0;
      bool overflow = false;
      if (op == "+") {
        overflow = __builtin_add_overflow(x, y, &r);
      } else if (op == "-") {
        overflow = __builtin_sub_overflow(x, y, &r);
      } else if (op == "*") {
        overflow = __builtin_mul_overflow(x, y, &r);
      } else {  // "//" and "%" round toward negative infinity, as in Python.
        if (y == 0) return Fail("integer division or modulo by zero");
        if (x == std::numeric_limits<int64_t>::min() && y == -1) return Fail("integer overflow");
        int64_t q = x / y, m = x % y;
        if (m != 0 && ((m < 0) != (y < 0))) {
          --q;
          m += y;
        }
        r = op == "//" ? q : m;
      }
      if (overflow) return Fail("integer overflow");
      return Value::Int(r);
    }
    if (op == "**" && !is_float) {
      int64_t base = a.as_int(), exp = b.as_int();
      if (exp >= 0) {
        int64_t r = 1;
        while (exp > 0) {
          if ((exp & 1) && __builtin_mul_overflow(r, base, &r)) return Fail("integer overflow");
          exp >>= 1;
          if (exp > 0 && __builtin_mul_overflow(base, base, &base)) return Fail("integer overflow");
        }
        return Value::Int(r);
      }
    }
    double x = a.as_double(), y = b.as_double();
    if (op == "+") return Value::Float(x + y);
    if (op == "-") return Value::Float(x - y);
    if (op == "*") return Value::Float(x * y);
    if (op == "/") {
      if (y == 0) return Fail("division by zero");
      return Value::Float(x / y);
    }
    if (op == "**") {
      if (x == 0 && y < 0) return Fail("0.0 cannot be raised to a negative power");
      double r = std::pow(x, y);
      if (std::isnan(r) && !std::isnan(x) && !std::isnan(y)) {
        return Fail("negative number cannot be raised to a fractional power");
      }
      return Value::Float(r);
    }
    if (y == 0) return Fail("float modulo or division by zero");
    // Python's float floor division and modulo: the remainder takes the divisor's sign.
    double mod = std::fmod(x, y);
    double div = (x - mod) / y;
    if (mod != 0) {
      if ((y < 0) != (mod < 0)) {
        mod += y;
        div -= 1.0;
      }
    } else {
      mod = std::copysign(0.0, y);
    }
    if (op == "%") return Value::Float(mod);
    double floordiv;
    if (div != 0) {
      floordiv = std::floor(div);
      if (div - floordiv > 0.5) floordiv += 1.0;
    } else {
      floordiv = std::copysign(0.0, x / y);
    }
    return Value::Float(floordiv);
  }
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      TANDEM_RETURN_IF_ERROR(CheckSize(a.str().size() + b.str().size()));
      return Value::Str(a.str() + b.str());
    }
    if (a.is_list() && b.is_list() && a.flavor() == b.flavor() &&
        a.flavor() != Value::Flavor::kIterator) {
      TANDEM_RETURN_IF_ERROR(CheckSize(a.list().size() + b.list().size()));
      ValueList items = a.list();
      items.insert(items.end(), b.list().begin(), b.list().end());
      return Value::List(std::move(items), a.flavor());
    }
    return unsupported();
  }
  if (op == "*") {
    const Value* seq = a.is_number() ? &b : &a;
    const Value* count = a.is_number() ? &a : &b;
    if ((count->is(Kind::kInt) || count->is_bool()) &&
        (seq->is_string() || (seq->is_list() && seq->flavor() != Value::Flavor::kIterator))) {
      int64_t n = std::max<int64_t>(0, count->as_int());
      size_t unit = seq->is_string() ? seq->str().size() : seq->list().size();
      if (unit > 0 && static_cast<uint64_t>(n) > limits_.max_output_bytes / unit) {
        TANDEM_RETURN_IF_ERROR(CheckSize(limits_.max_output_bytes + 1));
      }
      if (seq->is_string()) {
        std::string s;
        s.reserve(unit * n);
        for (int64_t i = 0; i < n; ++i) s += seq->str();
        return Value::Str(std::move(s));
      }
      ValueList items;
      for (int64_t i = 0; i < n; ++i)
        items.insert(items.end(), seq->list().begin(), seq->list().end());
      return Value::List(std::move(items), seq->flavor());
    }
  }
  if (op == "%" && a.is_string()) return PyPercentFormat(*this, a.str(), b);
  return unsupported();
}

absl::StatusOr<bool> Renderer::Less(const Value& a, const Value& b) const {
  if (a.is_undefined()) return UndefinedError(a);
  if (b.is_undefined()) return UndefinedError(b);
  if (a.is_number() && b.is_number()) {
    if (a.is(Kind::kFloat) || b.is(Kind::kFloat)) return a.as_double() < b.as_double();
    return a.as_int() < b.as_int();
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str();  // UTF-8 keeps code point order.
  if (a.is_list() && b.is_list() && a.flavor() == b.flavor() &&
      a.flavor() != Value::Flavor::kIterator) {
    size_t n = std::min(a.list().size(), b.list().size());
    for (size_t i = 0; i < n; ++i) {
      if (!PyEquals(a.list()[i], b.list()[i])) return Less(a.list()[i], b.list()[i]);
    }
    return a.list().size() < b.list().size();
  }
  return Fail(absl::StrCat("'<' not supported between instances of '", TypeName(a), "' and '",
                           TypeName(b), "'"));
}

absl::StatusOr<bool> Renderer::Contains(const Value& container, const Value& item) const {
  switch (container.kind()) {
    case Kind::kUndefined:
      return false;
    case Kind::kString:
      if (!item.is_string()) {
        return Fail(
            absl::StrCat("'in <string>' requires string as left operand, not ", TypeName(item)));
      }
      return container.str().find(item.str()) != std::string::npos;
    case Kind::kList:
      for (const Value& v : container.list()) {
        if (PyEquals(v, item)) return true;
      }
      return false;
    case Kind::kDict:
      return DictFind(container.dict(), item) != nullptr;
    default:
      return Fail(absl::StrCat("argument of type '", TypeName(container), "' is not iterable"));
  }
}

absl::Status Renderer::Sort(std::vector<std::pair<Value, Value>>* keyed, bool reverse) const {
  absl::Status error;
  std::stable_sort(keyed->begin(), keyed->end(), [&](const auto& x, const auto& y) {
    if (!error.ok()) return false;
    absl::StatusOr<bool> less = reverse ? Less(y.first, x.first) : Less(x.first, y.first);
    if (!less.ok()) {
      error = less.status();
      return false;
    }
    return *less;
  });
  return error;
}

// ---- string helpers shared by filters and methods -------------------------------------------

// str.split(sep, maxsplit) / str.rsplit(...). No separator splits on runs of whitespace.
absl::StatusOr<ValueList> PySplit(Renderer& r, const std::string& s,
                                  const std::optional<Value>& sep, int64_t maxsplit,
                                  bool from_right) {
  std::vector<std::string> parts;
  if (!sep || sep->is(Kind::kNone)) {
    if (!from_right) {
      size_t pos = 0;
      while (true) {
        pos += SpaceRunFrom(s, pos);
        if (pos >= s.size()) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          parts.push_back(s.substr(pos));
          break;
        }
        size_t end = pos;
        while (end < s.size()) {
          size_t len;
          if (IsPySpace(DecodeAt(s, end, &len))) break;
          end += len;
        }
        parts.push_back(s.substr(pos, end - pos));
        pos = end;
      }
    } else {
      size_t end = s.size();
      while (true) {
        end = RStripSpace(std::string_view(s).substr(0, end)).size();
        if (end == 0) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          parts.push_back(s.substr(0, end));
          break;
        }
        size_t start = end;
        while (start > 0) {
          size_t prev = start - 1;
          while (prev > 0 && (static_cast<unsigned char>(s[prev]) & 0xC0) == 0x80) --prev;
          size_t len;
          if (IsPySpace(DecodeAt(s, prev, &len))) break;
          start = prev;
        }
        parts.push_back(s.substr(start, end - start));
        end = start;
      }
      std::reverse(parts.begin(), parts.end());
    }
  } else {
    if (!sep->is_string()) return r.Fail("must be str or None");
    const std::string& d = sep->str();
    if (d.empty()) return r.Fail("empty separator");
    if (!from_right) {
      size_t pos = 0;
      while (true) {
        size_t hit = s.find(d, pos);
        if (hit == std::string::npos ||
            (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit)) {
          parts.push_back(s.substr(pos));
          break;
        }
        parts.push_back(s.substr(pos, hit - pos));
        pos = hit + d.size();
      }
    } else {
      size_t end = s.size();
      while (true) {
        size_t hit = end >= d.size() ? s.rfind(d, end - d.size()) : std::string::npos;
        if (hit == std::string::npos ||
            (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit)) {
          parts.push_back(s.substr(0, end));
          break;
        }
        parts.push_back(s.substr(hit + d.size(), end - hit - d.size()));
        end = hit;
      }
      std::reverse(parts.begin(), parts.end());
    }
  }
  ValueList out;
  for (auto& p : parts) out.push_back(Value::Str(std::move(p)));
  return out;
}

absl::StatusOr<std::string> PyStrip(Renderer& r, const std::string& s,
                                    const std::optional<Value>& chars, bool left, bool right) {
  if (!chars || chars->is(Kind::kNone)) {
    std::string_view v = s;
    if (left) v = LStripSpace(v);
    if (right) v = RStripSpace(v);
    return std::string(v);
  }
  if (!chars->is_string()) return r.Fail("strip arg must be None or str");
  return StripChars(s, chars->str(), left, right);
}

// str.splitlines(): splits on every Python line boundary.
std::vector<std::string> PySplitLines(const std::string& s, bool keepends) {
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t i = 0; i < s.size();) {
    size_t len;
    uint32_t cp = DecodeAt(s, i, &len);
    bool brk = cp == '\n' || cp == '\r' || cp == '\v' || cp == '\f' || (cp >= 0x1C && cp <= 0x1E) ||
               cp == 0x85 || cp == 0x2028 || cp == 0x2029;
    if (!brk) {
      i += len;
      continue;
    }
    size_t end = i + len;
    if (cp == '\r' && end < s.size() && s[end] == '\n') ++end;
    lines.push_back(s.substr(start, (keepends ? end : i) - start));
    start = i = end;
  }
  if (start < s.size()) lines.push_back(s.substr(start));
  return lines;
}

std::string PyReplace(const std::string& s, const std::string& old, const std::string& repl,
                      int64_t count) {
  std::string out;
  int64_t done = 0;
  if (old.empty()) {
    // Python inserts the replacement before every character and at the end.
    std::vector<size_t> starts = CodePointStarts(s);
    for (size_t k = 0; k <= starts.size(); ++k) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      if (k < starts.size()) {
        size_t end = k + 1 < starts.size() ? starts[k + 1] : s.size();
        out.append(s, starts[k], end - starts[k]);
      }
    }
    return out;
  }
  size_t pos = 0;
  while (count < 0 || done < count) {
    size_t hit = s.find(old, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += repl;
    pos = hit + old.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::string PyCapitalize(const std::string& s) {
  std::string out = AsciiLower(s);
  if (!out.empty() && out[0] >= 'a' && out[0] <= 'z') out[0] = static_cast<char>(out[0] - 32);
  return out;
}

// str.title(): a letter after a letter is lowercased, any other letter uppercased.
std::string PyTitle(const std::string& s) {
  std::string out = s;
  bool prev_cased = false;
  for (char& c : out) {
    if (IsAsciiAlpha(c)) {
      c = prev_cased ? static_cast<char>(c | 0x20) : static_cast<char>(c & ~0x20);
      prev_cased = true;
    } else {
      prev_cased = false;
    }
  }
  return out;
}

// Python's int(str, base): optional surrounding whitespace and sign, single underscores
// between digits, and a 0x/0o/0b prefix matching the base.
std::optional<int64_t> ParsePyInt(std::string_view s, int base) {
  s = RStripSpace(LStripSpace(s));
  bool neg = false;
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) {
    neg = s[0] == '-';
    s.remove_prefix(1);
  }
  if (s.size() > 2 && s[0] == '0') {
    char p = s[1] | 0x20;
    if ((p == 'x' && (base == 16 || base == 0)) || (p == 'o' && (base == 8 || base == 0)) ||
        (p == 'b' && (base == 2 || base == 0))) {
      base = p == 'x' ? 16 : p == 'o' ? 8 : 2;
      s.remove_prefix(2);
      if (!s.empty() && s[0] == '_') s.remove_prefix(1);
    }
  }
  if (base == 0) base = 10;
  if (s.empty() || base < 2 || base > 36) return std::nullopt;
  uint64_t v = 0;
  bool prev_digit = false;
  for (char c : s) {
    if (c == '_') {
      if (!prev_digit) return std::nullopt;
      prev_digit = false;
      continue;
    }
    int d = IsAsciiDigit(c) ? c - '0' : IsAsciiAlpha(c) ? (c | 0x20) - 'a' + 10 : 99;
    if (d >= base) return std::nullopt;
    if (v > (static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) - d) / base) {
      return std::nullopt;
    }
    v = v * base + d;
    prev_digit = true;
  }
  if (!prev_digit) return std::nullopt;
  return neg ? -static_cast<int64_t>(v) : static_cast<int64_t>(v);
}

// Python's float(str).
std::optional<double> ParsePyFloat(std::string_view s) {
  s = RStripSpace(LStripSpace(s));
  std::string clean;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c == '_') {
      if (i == 0 || i + 1 == s.size() || !IsAsciiDigit(s[i - 1]) || !IsAsciiDigit(s[i + 1])) {
        return std::nullopt;
      }
      continue;
    }
    if (c == 'x' || c == 'X' || c == 'p' || c == 'P') return std::nullopt;
    clean.push_back(c);
  }
  if (clean.empty()) return std::nullopt;
  char* end = nullptr;
  double d = std::strtod(clean.c_str(), &end);
  if (end != clean.c_str() + clean.size()) return std::nullopt;
  return d;
}

std::string HtmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

// ---- methods --------------------------------------------------------------------------------

absl::StatusOr<Value> Renderer::CallMethod(const Value& self, const std::string& name,
                                           CallArgs& args) {
  if (self.is_string()) return StrMethod(self.str(), name, args);
  if (self.is_dict()) {
    if (name == "get") {
      TANDEM_ASSIGN_OR_RETURN(Params p, Bind("get", args, {"key", "default"}));
      if (!p[0]) return Fail("get() expected at least 1 argument");
      if (const Value* v = DictFind(self.dict(), *p[0])) return *v;
      return p[1] ? *p[1] : Value::None();
    }
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {}));
    ValueList out;
    for (const auto& [k, v] : self.dict()) {
      if (name == "keys") {
        out.push_back(k);
      } else if (name == "values") {
        out.push_back(v);
      } else {
        out.push_back(Value::List({k, v}, Value::Flavor::kTuple));
      }
    }
    return Value::List(std::move(out));
  }
  return Fail(absl::StrCat("'", TypeName(self), "' object has no method '", name, "'"));
}

absl::StatusOr<Value> Renderer::StrMethod(const std::string& s, const std::string& name,
                                          CallArgs& args) {
  if (name == "startswith" || name == "endswith") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"prefix", "start", "end"}));
    if (!p[0]) return Fail(absl::StrCat(name, "() takes at least 1 argument"));
    std::string sub = s;
    if ((p[1] && !p[1]->is(Kind::kNone)) || (p[2] && !p[2]->is(Kind::kNone))) {
      std::vector<size_t> starts = CodePointStarts(s);
      TANDEM_ASSIGN_OR_RETURN(int64_t b, IntParam(p[1], "start", 0));
      TANDEM_ASSIGN_OR_RETURN(int64_t e,
                              IntParam(p[2], "end", static_cast<int64_t>(starts.size())));
      TANDEM_ASSIGN_OR_RETURN(auto idx,
                              SliceIndices(*this, static_cast<int64_t>(starts.size()), b, e, 1));
      sub.clear();
      for (int64_t i : idx) {
        size_t end = static_cast<size_t>(i) + 1 < starts.size() ? starts[i + 1] : s.size();
        sub.append(s, starts[i], end - starts[i]);
      }
      if (idx.empty() && b > static_cast<int64_t>(starts.size())) return Value::Bool(false);
    }
    std::vector<std::string> affixes;
    if (p[0]->is_string()) {
      affixes.push_back(p[0]->str());
    } else if (p[0]->is_list() && p[0]->flavor() == Value::Flavor::kTuple) {
      for (const Value& v : p[0]->list()) {
        if (!v.is_string()) return Fail(absl::StrCat(name, "() needs a str or a tuple of str"));
        affixes.push_back(v.str());
      }
    } else {
      return Fail(absl::StrCat(std::string(name), " first arg must be str or a tuple of str, not ",
                               TypeName(*p[0])));
    }
    for (const std::string& a : affixes) {
      bool hit = name == "startswith" ? sub.compare(0, a.size(), a) == 0
                                      : sub.size() >= a.size() &&
                                            sub.compare(sub.size() - a.size(), a.size(), a) == 0;
      if (hit) return Value::Bool(true);
    }
    return Value::Bool(false);
  }
  if (name == "split" || name == "rsplit") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"sep", "maxsplit"}));
    TANDEM_ASSIGN_OR_RETURN(int64_t maxsplit, IntParam(p[1], "maxsplit", -1));
    TANDEM_ASSIGN_OR_RETURN(ValueList parts, PySplit(*this, s, p[0], maxsplit, name == "rsplit"));
    return Value::List(std::move(parts));
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"chars"}));
    TANDEM_ASSIGN_OR_RETURN(std::string out,
                            PyStrip(*this, s, p[0], name != "rstrip", name != "lstrip"));
    return Value::Str(std::move(out));
  }
  if (name == "replace") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"old", "new", "count"}));
    if (!p[0] || !p[1] || !p[0]->is_string() || !p[1]->is_string()) {
      return Fail("replace() takes two str arguments");
    }
    TANDEM_ASSIGN_OR_RETURN(int64_t count, IntParam(p[2], "count", -1));
    std::string out = PyReplace(s, p[0]->str(), p[1]->str(), count);
    TANDEM_RETURN_IF_ERROR(CheckSize(out.size()));
    return Value::Str(std::move(out));
  }
  if (name == "find" || name == "rfind" || name == "count") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"sub"}));
    if (!p[0] || !p[0]->is_string()) return Fail(absl::StrCat(name, "() takes a str argument"));
    const std::string& sub = p[0]->str();
    if (name == "count") {
      if (sub.empty()) return Value::Int(static_cast<int64_t>(CodePointCount(s)) + 1);
      int64_t n = 0;
      for (size_t pos = s.find(sub); pos != std::string::npos;
           pos = s.find(sub, pos + sub.size())) {
        ++n;
      }
      return Value::Int(n);
    }
    size_t hit = name == "find" ? s.find(sub) : s.rfind(sub);
    if (hit == std::string::npos) return Value::Int(-1);
    return Value::Int(static_cast<int64_t>(CodePointCount(std::string_view(s).substr(0, hit))));
  }
  if (name == "join") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"iterable"}));
    if (!p[0]) return Fail("join() takes exactly one argument");
    TANDEM_ASSIGN_OR_RETURN(auto items, Iterate(*p[0]));
    std::string out;
    for (size_t i = 0; i < items->size(); ++i) {
      const Value& v = (*items)[i];
      if (!v.is_string()) {
        return Fail(
            absl::StrCat("sequence item ", i, ": expected str instance, ", TypeName(v), " found"));
      }
      if (i > 0) out += s;
      out += v.str();
      TANDEM_RETURN_IF_ERROR(CheckSize(out.size()));
    }
    return Value::Str(std::move(out));
  }
  if (name == "splitlines") {
    TANDEM_ASSIGN_OR_RETURN(Params p, Bind(name, args, {"keepends"}));
    ValueList out;
    for (std::string& line : PySplitLines(s, BoolParam(p[0], false))) {
      out.push_back(Value::Str(std::move(line)));
    }
    return Value::List(std::move(out));
  }
  TANDEM_ASSIGN_OR_RETURN(Params none, Bind(name, args, {}));
  if (name == "upper") return Value::Str(AsciiUpper(s));
  if (name == "lower") return Value::Str(AsciiLower(s));
  if (name == "title") return Value::Str(PyTitle(s));
  if (name == "capitalize") return Value::Str(PyCapitalize(s));
  auto all = [&](auto pred) {
    return Value::Bool(!s.empty() && std::all_of(s.begin(), s.end(), pred));
  };
  if (name == "isdigit") return all(IsAsciiDigit);
  if (name == "isalpha") return all(IsAsciiAlpha);
  if (name == "isalnum") return all([](char c) { return IsAsciiAlpha(c) || IsAsciiDigit(c); });
  if (name == "isspace") {
    return Value::Bool(!s.empty() && SpaceRunFrom(s, 0) == s.size());
  }
  if (name == "islower" || name == "isupper") {
    bool cased = false;
    for (char c : s) {
      if (!IsAsciiAlpha(c)) continue;
      cased = true;
      bool lower = c >= 'a' && c <= 'z';
      if (lower != (name == "islower")) return Value::Bool(false);
    }
    return Value::Bool(cased);
  }
  return Fail(absl::StrCat("'str' object has no method '", name, "'"));
}

// ---- filters --------------------------------------------------------------------------------

using FilterFn = absl::StatusOr<Value> (*)(Renderer&, const Value&, CallArgs&);
using TestFn = absl::StatusOr<bool> (*)(Renderer&, const Value&, CallArgs&);

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
    style.item_separator = ",";
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

// ---- tests ----------------------------------------------------------------------------------

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

bool IsKnownTest(std::string_view name) { return Tests().contains(name); }

absl::StatusOr<bool> Renderer::ApplyTest(const std::string& name, const Value& input,
                                         CallArgs& args) {
  auto it = Tests().find(name);
  if (it == Tests().end()) return Fail(absl::StrCat("no test named '", name, "'"));
  return it->second(*this, input, args);
}

// ---------------------------------------------------------------------------------------------
// Public entry points
// ---------------------------------------------------------------------------------------------

class ParsedTemplate final : public JinjaTemplate {
 public:
  ParsedTemplate(Body body, const JinjaLimits& limits) : body_(std::move(body)), limits_(limits) {}

  absl::StatusOr<std::string> Render(const nlohmann::json& context) const override {
    return RenderValue(FromJson(context));
  }
  absl::StatusOr<std::string> RenderOrdered(const nlohmann::ordered_json& context) const override {
    return RenderValue(FromJson(context));
  }

 private:
  absl::StatusOr<std::string> RenderValue(const std::optional<Value>& maybe_context) const {
    if (!maybe_context) {
      return absl::InvalidArgumentError(
          absl::StrCat("template context nests deeper than ", kMaxValueNesting, " levels"));
    }
    const Value& context = *maybe_context;
    if (!context.is_dict())
      return absl::InvalidArgumentError("template context must be a JSON object");
    auto root = std::make_shared<Scope>();
    for (const auto& [k, v] : context.dict()) root->vars[k.str()] = v;
    std::string out;
    Renderer renderer(limits_, &out);
    TANDEM_RETURN_IF_ERROR(renderer.ExecBody(body_, root));
    return out;
  }

  const Body body_;
  const JinjaLimits limits_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<JinjaTemplate>> JinjaTemplate::Parse(std::string_view source) {
  return Parse(source, JinjaLimits{});
}

absl::StatusOr<std::unique_ptr<JinjaTemplate>> JinjaTemplate::Parse(std::string_view source,
                                                                    const JinjaLimits& limits) {
  TANDEM_ASSIGN_OR_RETURN(std::vector<Token> tokens, Lexer(source).Run());
  TANDEM_ASSIGN_OR_RETURN(Body body, Parser(std::move(tokens)).ParseTemplate());
  return std::unique_ptr<JinjaTemplate>(new ParsedTemplate(std::move(body), limits));
}

}  // namespace tandem::engine
