// JSON schema and regular expressions -> GBNF grammars (then ParseGbnf -> Grammar).
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace tandem::grammar {

// The GBNF of documents valid against `schema`, for the subset OpenAI's structured outputs
// allow: `type` (one or a list) object / string / number / integer / boolean / null / array;
// `properties` and `required` (properties come in the schema's order; without `properties` and
// with `additionalProperties` not false an object is any object; with `properties`,
// `additionalProperties` must be false or absent); `enum`, `const`; `minLength` /
// `maxLength`; `pattern` (RegexToGbnf, matched against the unescaped characters); `format`
// (a free string); `items`, `minItems`, `maxItems`; `anyOf`; local `$ref` into `$defs` /
// `definitions` (recursion allowed). Annotations (`title`, `description`, `default`,
// `examples`, ...) are ignored. Other constraints (`minimum`, `allOf`, `oneOf`, ...) are an
// InvalidArgument naming the keyword and its JSON pointer. No whitespace before or after the
// document, at most 20 characters between tokens; integers have at most 18 digits, fractions 16,
// exponents 2 (so every number fits a double).
absl::StatusOr<std::string> JsonSchemaToGbnf(const nlohmann::ordered_json& schema);
// The same; a nlohmann::json object holds its keys sorted, so properties come sorted by name.
absl::StatusOr<std::string> JsonSchemaToGbnf(const nlohmann::json& schema);
absl::StatusOr<std::string> JsonSchemaToGbnf(std::string_view schema_text);

// The rules of `schema` for a larger grammar (e.g. tool calls wrapping several functions'
// parameters): documents valid against it are rule `name`, the rules it needs are named
// `name-...`, and JSON's lexical rules (JsonLexicalGbnf) are left out for the caller to append
// once. `name` must be a GBNF rule name ([a-zA-Z0-9_-]+) that the caller's rules do not use as a
// prefix.
absl::StatusOr<std::string> JsonSchemaToGbnfRules(const nlohmann::ordered_json& schema,
                                                  std::string_view name);
// JSON's lexical rules every schema grammar uses: ws, string, char, integer, number, boolean,
// null, value, object, array.
std::string JsonLexicalGbnf();

// `s` as a GBNF string literal: `"` and `\` escaped, control characters as \xHH.
std::string GbnfLiteral(std::string_view s);

// The GBNF of any JSON object (response_format json_object).
std::string JsonObjectGbnf();

// The GBNF of strings matching `regex` entirely: literals, `.`, classes with ranges and
// negation, \d \w \s (and negations), escapes, groups ((?:...) and named), `|`, `*` `+` `?`
// `{m,n}` (lazy and possessive suffixes ignored), `^` at the start and `$` at the end.
// Backreferences, lookaround and \b are an InvalidArgument naming the column.
absl::StatusOr<std::string> RegexToGbnf(std::string_view regex);

// A GBNF expression (groups, no rules) matching the characters `regex` matches as they appear
// inside a JSON string: `"`, `\` and control characters as their JSON escapes.
absl::StatusOr<std::string> RegexToJsonStringGbnf(std::string_view regex);

}  // namespace tandem::grammar
