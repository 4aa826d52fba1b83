#include "text/src/tokenizer/tokenizer_json.h"

#include "absl/strings/str_cat.h"

namespace tandem::text::bpe {

absl::Status Invalid(const std::string& where, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
}

std::string TypeOf(const Json& j) {
  if (!j.is_object()) return "";
  auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

absl::StatusOr<bool> BoolField(const Json& obj, const char* key, bool fallback,
                               const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return Invalid(where, absl::StrCat("'", key, "' must be a boolean"));
  return it->get<bool>();
}

absl::StatusOr<std::string> StringField(const Json& obj, const char* key,
                                        const std::string& where) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_string()) {
    return Invalid(where, absl::StrCat("'", key, "' must be a string"));
  }
  return it->get<std::string>();
}

absl::StatusOr<int32_t> IdValue(const Json& value, const std::string& where) {
  if (!value.is_number_integer() || value.get<int64_t>() < 0 ||
      value.get<int64_t>() >= kMaxTokenId) {
    return Invalid(
        where, absl::StrCat("id ", value.dump(), " is not an integer in [0, ", kMaxTokenId, ")"));
  }
  return static_cast<int32_t>(value.get<int64_t>());
}

}  // namespace tandem::text::bpe
