// The names of the builtin filters (filters.cc) and tests (tests.cc). The parser checks them,
// so that, as in Jinja2, a template naming one that does not exist fails when it is parsed, even
// in a branch that never runs.
#pragma once

#include <string_view>

namespace tandem::text::jinja {

// Whether `value | name` names a filter ("d" and "e" included, as aliases).
bool IsKnownFilter(std::string_view name);
// Whether `value is name` names a test.
bool IsKnownTest(std::string_view name);

}  // namespace tandem::text::jinja
