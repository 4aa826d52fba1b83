// The parser: Jinja2's grammar, from loosest to tightest binding:
//   conditional (x if c else y) < or < and < not < comparisons (== != < <= > >= in, not in)
//   < + - < ~ < * / // % < ** < unary - + < primary with .attr [key] (call) |filter `is` test
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "text/src/jinja/ast.h"
#include "text/src/jinja/lexer.h"

namespace tandem::text::jinja {

// The statements of a whole template; an error naming the line for anything outside the
// grammar, unknown tags, filters and tests, unclosed blocks, and nesting deeper than 100.
absl::StatusOr<Body> ParseTemplate(std::vector<Token> tokens);

}  // namespace tandem::text::jinja
