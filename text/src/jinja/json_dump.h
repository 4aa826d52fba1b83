// JSON output for `tojson`: Python's json.dumps(value, ensure_ascii, indent, separators,
// sort_keys), which is what Hugging Face installs as the filter.
#pragma once

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "text/src/jinja/value.h"

namespace tandem::text::jinja {

struct JsonStyle {
  bool ensure_ascii = false;
  std::optional<std::string> indent;  // Unset: everything on one line.
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};

// Appends `v`, nested `level` deep, to *out as json.dumps would write it; an error, with
// json.dumps' message, for values JSON cannot hold (undefined, callables, non-scalar keys).
absl::Status DumpJson(const Value& v, const JsonStyle& style, int level, std::string* out);

}  // namespace tandem::text::jinja
