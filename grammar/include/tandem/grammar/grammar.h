// The grammar IR: context-free grammars over bytes, and the GBNF parser that builds them.
#pragma once

#include <bitset>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::grammar {

// One symbol of a sequence: a set of bytes (matches one byte in the set) or a reference to a
// rule. Unicode character classes are lowered to byte sequences by the parser, so the matcher
// only ever sees bytes.
struct Element {
  enum class Kind { kBytes, kRule };
  Kind kind = Kind::kBytes;
  std::bitset<256> bytes;  // kBytes
  int rule = -1;           // kRule: index into Grammar::rules

  static Element Bytes(const std::bitset<256>& set) { return {Kind::kBytes, set, -1}; }
  static Element Byte(uint8_t b) {
    std::bitset<256> set;
    set.set(b);
    return Bytes(set);
  }
  static Element Rule(int index) { return {Kind::kRule, {}, index}; }
};

using Sequence = std::vector<Element>;  // empty: matches the empty string

struct Rule {
  std::string name;
  std::vector<Sequence> alternatives;
};

// A grammar: rules by index, `root` the start rule. Repetitions and groups are already lowered
// to auxiliary rules (named "<rule>_<n>"), e.g. `a ::= "x"*` becomes `a ::= a_1` and
// `a_1 ::= "x" a_1 | ""`, so every rule is a plain list of alternatives.
//   TANDEM_ASSIGN_OR_RETURN(Grammar g, ParseGbnf("root ::= \"yes\" | \"no\""));
struct Grammar {
  std::vector<Rule> rules;
  int root = 0;

  // The grammar in GBNF, one rule a line (byte sets printed as classes of \xHH escapes).
  std::string ToString() const;
  // InvalidArgument when a rule can derive itself as its own leftmost symbol (directly or
  // through rules that can be empty): the pushdown matcher would never stop expanding it.
  absl::Status CheckNoLeftRecursion() const;
};

// Parses llama.cpp's GBNF: `name ::= alternatives` rules, `|`, sequences, `( )` groups,
// postfix `*` `+` `?` `{m}` `{m,}` `{m,n}`, string literals and `[...]` classes (ranges, `^`
// negation) with escapes \n \r \t \\ \" \] \[ \- \xHH \uHHHH \UHHHHHHHH, `.` (any character),
// `#` comments. A rule ends at the end of its line unless inside parentheses or continued by a
// line starting (or ending) with `|`. Errors say "line L, column C: what".
absl::StatusOr<Grammar> ParseGbnf(std::string_view text, std::string_view root_rule = "root");

}  // namespace tandem::grammar
