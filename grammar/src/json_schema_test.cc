// JSON schema and regex -> grammar: random schemas and documents, valid and mutated, against an
// independent validator and nlohmann-json's parser; regexes against std::regex.
#include "tandem/grammar/json_schema.h"

#include <regex>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/byte_vocab.h"
#include "testing/schema_fuzz.h"

namespace tandem::grammar {
namespace {

using testing::CompileGbnf;
using ::testing::HasSubstr;
using testing::Matches;
using testing::ordered_json;

std::shared_ptr<const CompiledGrammar> CompileSchema(const ordered_json& schema) {
  auto gbnf = JsonSchemaToGbnf(schema);
  EXPECT_TRUE(gbnf.ok()) << gbnf.status() << "\n" << schema.dump();
  return gbnf.ok() ? CompileGbnf(*gbnf) : nullptr;
}

// An exponent of three or more digits outside strings (the grammars allow two, so that every
// number fits a double).
bool HasLongExponent(std::string_view text) {
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    if (in_string) {
      if (text[i] == '\\') {
        ++i;
      } else if (text[i] == '"') {
        in_string = false;
      }
      continue;
    }
    if (text[i] == '"') {
      in_string = true;
    } else if ((text[i] == 'e' || text[i] == 'E') && i + 1 < text.size()) {
      size_t j = i + 1;
      if (text[j] == '-' || text[j] == '+') ++j;
      size_t digits = 0;
      while (j < text.size() && text[j] >= '0' && text[j] <= '9') ++j, ++digits;
      if (digits >= 3) return true;
    }
  }
  return false;
}

// Whether `text` is a JSON document valid against the schema, by nlohmann-json and the test's
// own validator. The grammars produce no whitespace before or after the document.
bool ExpectedValid(const ordered_json& schema, std::string_view text) {
  if (HasLongExponent(text) || testing::HasDuplicateKeys(text)) return false;
  const std::string_view kWhitespace = " \t\n\r";
  if (text.empty() || kWhitespace.find(text.front()) != std::string_view::npos ||
      kWhitespace.find(text.back()) != std::string_view::npos) {
    return false;
  }
  ordered_json doc = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  return !doc.is_discarded() && testing::Validate(schema, schema, doc);
}

TEST(JsonSchemaTest, RandomSchemasAcceptValidAndRejectInvalidDocuments) {
  testing::SchemaFuzzer fuzz(20261125);
  int valid_seen = 0, invalid_seen = 0;
  for (int round = 0; round < 400; ++round) {
    ordered_json schema = fuzz.Schema();
    auto g = CompileSchema(schema);
    ASSERT_NE(g, nullptr);
    for (int d = 0; d < 8; ++d) {
      ordered_json doc = fuzz.Document(schema, schema);
      ASSERT_TRUE(testing::Validate(schema, schema, doc)) << doc.dump();
      for (const std::string& text : {doc.dump(), doc.dump(2)}) {
        EXPECT_TRUE(Matches(g, text)) << "schema " << schema.dump() << "\ndoc " << text;
        ++valid_seen;
      }
      // Text mutations: one byte inserted, deleted or replaced, or the text cut short.
      static const std::string kAlphabet = "{}[]\",:0123456789.-eE \\ntrufalsk\x01\xC3";
      for (int m = 0; m < 6; ++m) {
        std::string text = fuzz.Coin() ? doc.dump() : doc.dump(2);
        size_t at = fuzz.Uniform(0, text.size());
        char c = kAlphabet[fuzz.Uniform(0, kAlphabet.size() - 1)];
        switch (fuzz.Uniform(0, 3)) {
          case 0:
            text.insert(at, 1, c);
            break;
          case 1:
            if (at < text.size()) text.erase(at, 1);
            break;
          case 2:
            if (at < text.size()) text[at] = c;
            break;
          default:
            text.resize(at);
        }
        bool expected = ExpectedValid(schema, text);
        invalid_seen += !expected;
        EXPECT_EQ(Matches(g, text), expected) << "schema " << schema.dump() << "\ndoc " << text;
      }
      // Structural mutations: a value replaced by a random one.
      ordered_json other = fuzz.AnyValue(0);
      std::string text = other.dump();
      bool expected = ExpectedValid(schema, text);
      invalid_seen += !expected;
      EXPECT_EQ(Matches(g, text), expected) << "schema " << schema.dump() << "\ndoc " << text;
    }
  }
  EXPECT_GT(valid_seen, 1000);
  EXPECT_GT(invalid_seen, 1000);
}

TEST(JsonSchemaTest, RecursiveRefs) {
  ordered_json schema = ordered_json::parse(R"({
    "$defs": {"node": {"type": "object", "properties": {
      "value": {"type": "integer"},
      "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
      "required": ["value"], "additionalProperties": false}},
    "$ref": "#/$defs/node"})");
  auto g = CompileSchema(schema);
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(
      Matches(g, R"({"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]})"));
  EXPECT_FALSE(Matches(g, R"({"value": 1, "children": [{"children": []}]})"));
}

TEST(JsonSchemaTest, RulesOfSeveralSchemasShareOneGrammar) {
  // Two schemas' rules under their own names, with $refs, in one grammar with the lexical
  // rules once: each name matches its own schema's documents only.
  const auto a = testing::ordered_json::parse(
      R"({"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"],
          "$defs": {"n": {"type": "string", "maxLength": 2}}})");
  const auto b = testing::ordered_json::parse(
      R"({"type": "object", "properties": {"y": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
          "required": ["y"], "$defs": {"n": {"type": "integer"}}})");
  auto rules_a = JsonSchemaToGbnfRules(a, "tool-a");
  auto rules_b = JsonSchemaToGbnfRules(b, "tool-b");
  ASSERT_TRUE(rules_a.ok() && rules_b.ok());
  EXPECT_THAT(*rules_a, ::testing::Not(::testing::HasSubstr("\nws ::=")));
  auto g = CompileGbnf("root ::= \"A\" tool-a | \"B\" tool-b\n" + *rules_a + *rules_b +
                       JsonLexicalGbnf());
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(Matches(g, R"(A{"x": "ok"})"));
  EXPECT_TRUE(Matches(g, R"(B{"y": [1, 2]})"));
  EXPECT_FALSE(Matches(g, R"(A{"x": "long"})"));
  EXPECT_FALSE(Matches(g, R"(B{"y": ["s"]})"));
  EXPECT_FALSE(Matches(g, R"(A{"y": [1]})"));
  EXPECT_EQ(GbnfLiteral("a\"b\\\n"), R"("a\"b\\\x0A")");
}

TEST(JsonSchemaTest, JsonObjectIsAnyObject) {
  auto g = CompileGbnf(JsonObjectGbnf());
  EXPECT_TRUE(Matches(g, R"({"a": [1, 2.5e3, "x\u00e9\n", null, true, {}], "b": {"c": false}})"));
  EXPECT_TRUE(Matches(g, "{}"));
  EXPECT_FALSE(Matches(g, "[1]"));
  EXPECT_FALSE(Matches(g, R"({"a": 01})"));
  EXPECT_FALSE(Matches(g, R"({"a": "\x"})"));
  EXPECT_FALSE(Matches(g, R"({"a" 1})"));
}

TEST(JsonSchemaTest, StringPatternsMatchUnescapedCharacters) {
  ordered_json schema = {{"type", "string"}, {"pattern", "^[a-z]+\"\\d{2}$"}};
  auto g = CompileSchema(schema);
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(Matches(g, R"("ab\"12")"));
  EXPECT_FALSE(Matches(g, R"("ab"12")"));
  EXPECT_FALSE(Matches(g, R"("ab\"123")"));
}

struct BadSchema {
  const char* schema;
  const char* error;
};

class JsonSchemaErrorTest : public ::testing::TestWithParam<BadSchema> {};

TEST_P(JsonSchemaErrorTest, NamesTheProblem) {
  auto gbnf = JsonSchemaToGbnf(std::string_view(GetParam().schema));
  ASSERT_FALSE(gbnf.ok());
  EXPECT_EQ(gbnf.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(gbnf.status().message()), HasSubstr(GetParam().error));
}

INSTANTIATE_TEST_SUITE_P(
    Errors, JsonSchemaErrorTest,
    ::testing::Values(
        BadSchema{"{", "not valid JSON"},
        BadSchema{R"({"type": "strin"})", "at '#': unknown type 'strin'"},
        BadSchema{R"({"type": "object", "properties": {"a": {"type": "integer", "minimum": 3}}})",
                  "at '#/properties/a': keyword 'minimum' is not supported"},
        BadSchema{R"({"type": "object", "properties": {"a": {}}, "required": ["b"]})",
                  "required property 'b' is not in 'properties'"},
        BadSchema{R"({"type": "object", "properties": {"a": {}}, "additionalProperties": true})",
                  "'additionalProperties' must be false or absent"},
        BadSchema{R"({"$ref": "#/$defs/missing"})", "$ref '#/$defs/missing' points nowhere"},
        BadSchema{R"({"$ref": "http://example.com/s.json"})", "is not local"},
        BadSchema{R"({"type": "array", "minItems": 3, "maxItems": 1})",
                  "'maxItems' is below 'minItems'"},
        BadSchema{R"({"type": "array", "minItems": -1})", "'minItems' must be an integer"},
        BadSchema{R"({"enum": []})", "'enum' must be a non-empty array"},
        BadSchema{R"({"allOf": [{}]})", "keyword 'allOf' is not supported"},
        BadSchema{R"({"type": "string", "pattern": "(a)\\1"})", "backreferences are not supported"},
        BadSchema{"false", "matches nothing"},
        BadSchema{"3", "a schema must be an object or a boolean"}));

TEST(RegexTest, AgreesWithStdRegex) {
  const std::vector<std::string> patterns = {
      "[a-c]+x?", "(ab|cd)*e",    "\\d{2,4}-\\w+",        "[^0-9]{1,3}",
      "a.c",      "(?:x|y|z){3}", "^\\s*[A-Z][a-z]*\\.$", "(foo|bar)?baz+",
      "[\\d.]+",  "a{2,}b{0,1}"};
  testing::SchemaFuzzer fuzz(7);
  const std::string alphabet = "abcdexyzABZ019.- _\n\t";
  for (const std::string& pattern : patterns) {
    auto gbnf = RegexToGbnf(pattern);
    ASSERT_TRUE(gbnf.ok()) << pattern << ": " << gbnf.status();
    auto g = CompileGbnf(*gbnf);
    ASSERT_NE(g, nullptr) << pattern;
    std::regex re(pattern);
    for (int i = 0; i < 3000; ++i) {
      std::string text;
      int n = fuzz.Uniform(0, 7);
      for (int k = 0; k < n; ++k) text += alphabet[fuzz.Uniform(0, alphabet.size() - 1)];
      EXPECT_EQ(Matches(g, text), std::regex_match(text, re)) << pattern << " on '" << text << "'";
    }
  }
}

TEST(JsonSchemaTest, DeepNestingIsAnErrorNotACrash) {
  std::string schema;
  for (int i = 0; i < 5000; ++i) schema += R"({"type": "array", "items": )";
  schema += "{}" + std::string(5000, '}');
  auto gbnf = JsonSchemaToGbnf(std::string_view(schema));
  ASSERT_FALSE(gbnf.ok());
  EXPECT_THAT(std::string(gbnf.status().message()), HasSubstr("nested too deeply"));
}

TEST(RegexTest, RefusesWhatItCannotExpress) {
  EXPECT_THAT(
      std::string(
          RegexToGbnf(std::string(100000, '(') + std::string(100000, ')')).status().message()),
      HasSubstr("nested too deeply"));
  EXPECT_THAT(std::string(RegexToGbnf("a(?=b)").status().message()),
              HasSubstr("column 2: lookaround"));
  EXPECT_THAT(std::string(RegexToGbnf("\\bword").status().message()), HasSubstr("not supported"));
  EXPECT_THAT(std::string(RegexToGbnf("(ab").status().message()), HasSubstr("missing ')'"));
  EXPECT_THAT(std::string(RegexToGbnf("ab)").status().message()), HasSubstr("unbalanced ')'"));
  EXPECT_THAT(std::string(RegexToGbnf("a**").status().message()), HasSubstr("nested quantifier"));
}

}  // namespace
}  // namespace tandem::grammar
