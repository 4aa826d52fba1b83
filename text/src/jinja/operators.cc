// Operators on values: arithmetic, `%` formatting, ordering and `in` (see renderer.h).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "text/src/jinja/renderer.h"
#include "text/src/jinja/utf8.h"
#include "text/src/jinja/value.h"

namespace tandem::text::jinja {

// ---- string formatting ----------------------------------------------------------------------

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

}  // namespace tandem::text::jinja
