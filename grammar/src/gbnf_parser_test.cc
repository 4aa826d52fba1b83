// The GBNF parser: what grammars mean (checked by matching texts) and how bad ones are refused.
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/grammar/grammar.h"
#include "testing/byte_vocab.h"

namespace tandem::grammar {
namespace {

using testing::CompileGbnf;
using ::testing::HasSubstr;
using testing::Matches;

TEST(GbnfParserTest, AlternativesSequencesAndGroups) {
  auto g = CompileGbnf(R"(root ::= "yes" | "no" | ("may" "be")
)");
  EXPECT_TRUE(Matches(g, "yes"));
  EXPECT_TRUE(Matches(g, "no"));
  EXPECT_TRUE(Matches(g, "maybe"));
  EXPECT_FALSE(Matches(g, "ye"));
  EXPECT_FALSE(Matches(g, "yess"));
  EXPECT_FALSE(Matches(g, ""));
}

TEST(GbnfParserTest, Repetitions) {
  auto g = CompileGbnf(R"(root ::= "a"* "b"+ "c"? d{2} e{1,3} f{2,}
d ::= "d"
e ::= "e"
f ::= "f")");
  EXPECT_TRUE(Matches(g, "bddeff"));
  EXPECT_TRUE(Matches(g, "aaabbbcddeeefffff"));
  EXPECT_FALSE(Matches(g, "ddeff"));      // b+ needs one
  EXPECT_FALSE(Matches(g, "bdeff"));      // d{2}
  EXPECT_FALSE(Matches(g, "bddeeeeff"));  // e{1,3}
  EXPECT_FALSE(Matches(g, "bddef"));      // f{2,}
  EXPECT_FALSE(Matches(g, "bbcceff"));
}

TEST(GbnfParserTest, CharacterClassesAndEscapes) {
  auto g = CompileGbnf(R"(root ::= [a-c0-9_]+ [^a-z] "\n\t\"\\\x41\u00e9" . [é-ë]
)");
  EXPECT_TRUE(Matches(g, "ab9_X\n\t\"\\Aé日ê"));
  EXPECT_TRUE(Matches(g, "c%\n\t\"\\Aé\x01ë"));
  EXPECT_FALSE(Matches(g, "d%\n\t\"\\Aéxë"));  // d not in [a-c0-9_]
  EXPECT_FALSE(Matches(g, "ab\n\t\"\\Aéxë"));  // [^a-z] missing... 'b' is a letter
  EXPECT_FALSE(Matches(g, "a%\n\t\"\\Aéxì"));  // ì outside [é-ë]
  // `.` and negated classes match whole UTF-8 characters, never a lone byte.
  EXPECT_FALSE(Matches(g, "a%\n\t\"\\A\xC3\xA9\xE6\xEB"));
}

TEST(GbnfParserTest, RulesSpanLinesInsideParenthesesAndAfterBars) {
  auto g = CompileGbnf(R"(# a comment
root ::= (
    "x" # inside
    "y"
  )
  | "z"
other ::= "unused"
)");
  EXPECT_TRUE(Matches(g, "xy"));
  EXPECT_TRUE(Matches(g, "z"));
  EXPECT_FALSE(Matches(g, "x"));
}

TEST(GbnfParserTest, RecursionThatIsNotLeftRecursion) {
  auto g = CompileGbnf(R"g(root ::= "(" root ")" | "")g");
  EXPECT_TRUE(Matches(g, ""));
  EXPECT_TRUE(Matches(g, "((()))"));
  EXPECT_FALSE(Matches(g, "(()"));
}

struct BadGrammar {
  const char* text;
  const char* error;
};

class GbnfErrorTest : public ::testing::TestWithParam<BadGrammar> {};

TEST_P(GbnfErrorTest, NamesTheProblemAndWhere) {
  auto g = ParseGbnf(GetParam().text);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(g.status().message()), HasSubstr(GetParam().error));
}

INSTANTIATE_TEST_SUITE_P(
    Errors, GbnfErrorTest,
    ::testing::Values(
        BadGrammar{"root ::= \"a\" undefined-rule",
                   "line 1, column 14: undefined rule 'undefined-rule'"},
        BadGrammar{"root ::= \"a\"\nroot ::= \"b\"",
                   "line 2, column 1: rule 'root' is defined twice"},
        BadGrammar{"root = \"a\"", "line 1, column 6: expected '::='"},
        BadGrammar{"root ::= \"abc", "line 1, column 14: unterminated string literal"},
        BadGrammar{"root ::= [a-", "unterminated character class"},
        BadGrammar{"root ::= [z-a]", "line 1, column 14: character range is reversed"},
        BadGrammar{"root ::= (\"a\"", "expected ')'"},
        BadGrammar{"root ::= \"a\" )", "line 1, column 14: expected the end of the line"},
        BadGrammar{"root ::= * \"a\"", "line 1, column 10: '*' has nothing to repeat"},
        BadGrammar{"root ::= \"a\"{3,2}", "n < m"},
        BadGrammar{"root ::= \"a\"{99999}", "repetition bound over 10000"},
        BadGrammar{"root ::= \"\\q\"", "line 1, column 11: unknown escape '\\q'"},
        BadGrammar{"root ::= \"\\xZZ\"", "expected 2 hex digits"},
        BadGrammar{"start ::= \"a\"", "grammar has no root rule 'root'"},
        BadGrammar{"root ::= root \"a\" | \"b\"", "rule 'root' is left-recursive"},
        BadGrammar{"root ::= x\nx ::= y? root \"a\"\ny ::= \"b\"", "is left-recursive"},
        BadGrammar{"root ::= (\"a\"?)* \"b\"", "is left-recursive"},
        BadGrammar{"root ::= [^\\x00-\\U0010FFFF]", "character class matches nothing"}));

// llama.cpp's grammars/json.gbnf as published: multi-line rules, comments, an empty first
// alternative, ambiguous alternatives.
TEST(GbnfParserTest, ParsesLlamaCppJsonGrammar) {
  auto g = CompileGbnf(R"g(root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
)g");
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(Matches(
      g, "{\"a\": [1, -2.5e3, \"x\\u00e9\\n\", null, true, {}],\n  \"b\": {\"c\": false}}"));
  EXPECT_TRUE(Matches(g, "{}"));
  EXPECT_FALSE(Matches(g, "{\"a\": \"\x7F\"}"));
  EXPECT_FALSE(Matches(g, "{\"a\" 1}"));
  EXPECT_FALSE(Matches(g, "[1]"));
}

TEST(GbnfParserTest, ToStringReparsesToTheSameLanguage) {
  auto g = ParseGbnf(R"(root ::= ("ab" | [x-z])* "!")");
  ASSERT_TRUE(g.ok()) << g.status();
  auto again = CompileGbnf(g->ToString());
  ASSERT_NE(again, nullptr);
  EXPECT_TRUE(Matches(again, "abzab!"));
  EXPECT_FALSE(Matches(again, "abw!"));
}

}  // namespace
}  // namespace tandem::grammar

namespace tandem::grammar {
namespace {

TEST(GbnfParserTest, DeepNestingIsAnErrorNotACrash) {
  std::string text = "root ::= " + std::string(100000, '(') + "\"a\"" + std::string(100000, ')');
  auto g = ParseGbnf(text);
  ASSERT_FALSE(g.ok());
  EXPECT_THAT(std::string(g.status().message()), ::testing::HasSubstr("nested too deeply"));
}

TEST(GbnfParserTest, LongChainsOfRulesMatch) {
  // 50,000 rules each naming the next: expanding them must not recurse once per rule.
  std::string text = "root ::= r0\n";
  for (int i = 0; i < 50000; ++i)
    text += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + "\n";
  text += "r50000 ::= \"z\"\n";
  auto g = testing::CompileGbnf(text);
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(testing::Matches(g, "z"));
  EXPECT_FALSE(testing::Matches(g, "y"));
}

}  // namespace
}  // namespace tandem::grammar
