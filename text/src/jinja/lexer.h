// The lexer: splits the source into text and the contents of {{ }}, {% %} tags (comments vanish),
// applying whitespace control as Jinja2 does with trim_blocks and lstrip_blocks:
//   "{%-" / "{{-" / "{#-"  strip all whitespace before the tag;
//   "-%}" / "-}}" / "-#}"  strip all whitespace after it;
//   "%}" / "#}"            drop one newline right after it (trim_blocks; "+%}" keeps it);
//   "{%" / "{#"            drop spaces between the start of the line and the tag when nothing
//                          else is on that line before it (lstrip_blocks; "{%+" keeps them).
// Newlines are normalized to "\n" and one trailing newline is dropped, as Jinja2 does.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tandem::text::jinja {

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

// An error in the template's source, at `line`: "template line N: msg".
absl::Status SyntaxError(int line, absl::string_view msg);

// The tokens of `source`, ending with kEof; an error for unterminated tags, comments and raw
// blocks, unbalanced brackets, characters outside the grammar and malformed literals.
absl::StatusOr<std::vector<Token>> Tokenize(std::string_view source);

}  // namespace tandem::text::jinja
