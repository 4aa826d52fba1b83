// `tojson`'s serializer: Python's json.dumps (see json_dump.h).

#include "text/src/jinja/json_dump.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tandem/base/status_macros.h"
#include "text/src/jinja/utf8.h"

namespace tandem::text::jinja {
namespace {

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

}  // namespace

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

}  // namespace tandem::text::jinja
