#include "tandem/router/tool_calls.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/router/openai_request.h"
#include "testing/byte_vocab.h"

namespace tandem::router {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;
using ::testing::HasSubstr;

// A sample's text parsed whole: content, and each call's name and arguments.
struct Parsed {
  std::string content;
  std::vector<std::pair<std::string, std::string>> calls;
  bool operator==(const Parsed&) const = default;
};

void Add(Parsed& into, const ParsedText& got) {
  into.content += got.content;
  for (const ToolCallDelta& d : got.calls) {
    if (d.first) {
      ASSERT_EQ(d.index, static_cast<int>(into.calls.size()));
      ASSERT_TRUE(d.arguments.empty()) << "the first delta carries the name only";
      into.calls.push_back({d.name, ""});
    } else {
      ASSERT_LT(d.index, static_cast<int>(into.calls.size()));
      into.calls[d.index].second += d.arguments;
    }
  }
}

// `text` fed in pieces of `piece` bytes (0: whole).
Parsed ParseIn(ToolCallFormat format, const std::string& text, size_t piece) {
  ToolCallParser parser(format);
  Parsed out;
  if (piece == 0) piece = text.size() + 1;
  for (size_t i = 0; i < text.size(); i += piece) Add(out, parser.Feed(text.substr(i, piece)));
  Add(out, parser.Finish());
  EXPECT_EQ(parser.num_calls(), static_cast<int>(out.calls.size()));
  return out;
}

// Parses `text` whole and in every piece size; all must agree (streaming == non-streaming).
Parsed ParseAllWays(ToolCallFormat format, const std::string& text) {
  Parsed whole = ParseIn(format, text, 0);
  for (size_t piece = 1; piece <= text.size(); ++piece) {
    EXPECT_EQ(ParseIn(format, text, piece), whole) << "piece size " << piece << "\n" << text;
  }
  return whole;
}

TEST(ToolCallParserTest, HermesCallsAndContent) {
  Parsed p = ParseAllWays(ToolCallFormat::kHermes,
                          "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                          "{\"city\": \"Paris\", \"q\": [1, {\"a\": \"}\"}]}}\n</tool_call>\n"
                          "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>");
  EXPECT_EQ(p.content, "Let me check.");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].first, "get_weather");
  EXPECT_EQ(p.calls[0].second, R"({"city": "Paris", "q": [1, {"a": "}"}]})");
  EXPECT_EQ(p.calls[1].first, "get_time");
  EXPECT_EQ(p.calls[1].second, "{}");
}

TEST(ToolCallParserTest, HermesArgumentsBeforeNameAndEscapes) {
  Parsed p = ParseAllWays(
      ToolCallFormat::kHermes,
      "<tool_call>{\"arguments\": {\"s\": \"a\\\"b\\\\\"}, \"name\": \"f\\u0031\"}</tool_call>");
  EXPECT_EQ(p.content, "");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].first, "f1");
  EXPECT_EQ(p.calls[0].second, R"({"s": "a\"b\\"})");
}

TEST(ToolCallParserTest, HermesTextWithoutCallsIsContent) {
  for (const std::string text :
       {"plain answer \n", "a <tool_ mention", "<tool_call> not json",
        "x <tool_call>{\"a\": 1}</tool_call>", "ends with a partial tag <tool_c"}) {
    Parsed p = ParseAllWays(ToolCallFormat::kHermes, text);
    EXPECT_TRUE(p.calls.empty()) << text;
    EXPECT_EQ(p.content, text) << "nothing is lost";
  }
}

TEST(ToolCallParserTest, HermesCallCutShortKeepsWhatArrived) {
  Parsed p = ParseAllWays(ToolCallFormat::kHermes,
                          "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"Par");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].second, R"({"city": "Par)");
  // Cut before the name: no call, the text is content.
  p = ParseAllWays(ToolCallFormat::kHermes, "<tool_call>\n{\"na");
  EXPECT_TRUE(p.calls.empty());
  EXPECT_EQ(p.content, "<tool_call>\n{\"na");
}

TEST(ToolCallParserTest, Llama3JsonCalls) {
  Parsed p = ParseAllWays(ToolCallFormat::kLlama3Json,
                          " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}; "
                          "{\"name\": \"get_time\", \"parameters\": {\"tz\": \"UTC\"}} ");
  EXPECT_EQ(p.content, "");
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0],
            (std::pair<std::string, std::string>{"get_weather", R"({"city": "Rome"})"}));
  EXPECT_EQ(p.calls[1], (std::pair<std::string, std::string>{"get_time", R"({"tz": "UTC"})"}));
  p = ParseAllWays(ToolCallFormat::kLlama3Json,
                   "<|python_tag|>{\"name\": \"f\", \"arguments\": {\"x\": 1}}");
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].second, R"({"x": 1})");
}

TEST(ToolCallParserTest, Llama3JsonTextIsContent) {
  for (const std::string text :
       {"The weather is fine.", "  leading space", "{\"answer\": 42}", "{\"name\": 5}"}) {
    Parsed p = ParseAllWays(ToolCallFormat::kLlama3Json, text);
    EXPECT_TRUE(p.calls.empty()) << text;
    EXPECT_EQ(p.content, text);
  }
}

const char kTools[] = R"({"tools": [
  {"type": "function", "function": {"name": "get_weather", "description": "d",
   "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                  "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}},
  {"type": "function", "function": {"name": "now"}}]})";

TEST(ToolRequestTest, ReadsToolsAndChoice) {
  json body = json::parse(kTools);
  ordered_json ordered = ordered_json::parse(kTools);
  body["tool_choice"] = {{"type", "function"}, {"function", {{"name", "now"}}}};
  ordered["tool_choice"] = body["tool_choice"];
  body["parallel_tool_calls"] = false;
  absl::StatusOr<ToolRequest> r = ParseToolRequest(body, &ordered);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->names, (std::vector<std::string>{"get_weather", "now"}));
  EXPECT_EQ(r->choice, ToolChoice::kFunction);
  EXPECT_EQ(r->function, "now");
  EXPECT_FALSE(r->parallel);
  EXPECT_TRUE(r->forced());
  // The client's key order is kept: "type" before "function", "city" before "unit".
  EXPECT_EQ(r->tools[0].begin().key(), "type");
  EXPECT_EQ(r->parameters[0]["properties"].begin().key(), "city");
  EXPECT_EQ(r->parameters[1], ordered_json::parse(R"({"type":"object","properties":{}})"));
}

TEST(ToolRequestTest, RefusesBadToolsNamingTheField) {
  auto refused = [](const std::string& body_text, const std::string& param,
                    const std::string& message) {
    json body = json::parse(body_text);
    absl::StatusOr<ToolRequest> r = ParseToolRequest(body, nullptr);
    ASSERT_FALSE(r.ok()) << body_text;
    EXPECT_EQ(ParamOf(r.status()), param) << body_text;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(message)) << body_text;
  };
  refused(R"({"tools": {}})", "tools", "tools must be an array");
  refused(R"({"tools": [{"type": "retrieval"}]})", "tools", "tools[0].type must be 'function'");
  refused(R"({"tools": [{"type": "function"}]})", "tools", "tools[0].function must be an object");
  refused(R"({"tools": [{"type": "function", "function": {"name": "a b"}}]})", "tools",
          "tools[0].function.name 'a b' must be");
  refused(R"({"tools": [{"type": "function", "function": {"name": "a"}},
                        {"type": "function", "function": {"name": "a"}}]})",
          "tools", "tools[1].function.name 'a' is used by another tool");
  refused(R"({"tools": [{"type": "function", "function": {"name": "a", "parameters": 3}}]})",
          "tools", "tools[0].function.parameters must be a JSON schema object");
  refused(R"({"tool_choice": "required"})", "tool_choice", "needs tools");
  refused(R"({"tools": [{"type": "function", "function": {"name": "a"}}], "tool_choice": "any"})",
          "tool_choice", "tool_choice must be 'none', 'auto', 'required'");
  refused(R"({"tools": [{"type": "function", "function": {"name": "a"}}],
              "tool_choice": {"type": "function", "function": {"name": "b"}}})",
          "tool_choice", "'b', which is not among the tools");
  refused(R"({"parallel_tool_calls": "yes"})", "parallel_tool_calls", "must be a boolean");
}

TEST(ToolCallGbnfTest, HermesGrammarAcceptsExactlyCallsOfTheTools) {
  json body = json::parse(kTools);
  ToolRequest r = *ParseToolRequest(body, nullptr);
  r.choice = ToolChoice::kRequired;
  absl::StatusOr<std::string> gbnf = ToolCallGbnf(r, ToolCallFormat::kHermes);
  ASSERT_TRUE(gbnf.ok()) << gbnf.status();
  auto compiled = grammar::testing::CompileGbnf(*gbnf);
  ASSERT_NE(compiled, nullptr);
  const std::string weather =
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
  const std::string now = "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
  EXPECT_TRUE(grammar::testing::Matches(compiled, weather));
  EXPECT_TRUE(grammar::testing::Matches(compiled, weather + "\n" + now));
  EXPECT_FALSE(grammar::testing::Matches(compiled, ""));
  EXPECT_FALSE(grammar::testing::Matches(compiled, "hello " + weather));
  EXPECT_FALSE(grammar::testing::Matches(
      compiled, "<tool_call>\n{\"name\": \"other\", \"arguments\": {}}\n</tool_call>"));
  EXPECT_FALSE(grammar::testing::Matches(  // city over maxLength
      compiled,
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Amsterdam\"}}\n"
      "</tool_call>"));
  EXPECT_FALSE(grammar::testing::Matches(  // required city missing
      compiled, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>"));

  r.parallel = false;
  compiled = grammar::testing::CompileGbnf(*ToolCallGbnf(r, ToolCallFormat::kHermes));
  EXPECT_TRUE(grammar::testing::Matches(compiled, now));
  EXPECT_FALSE(grammar::testing::Matches(compiled, weather + "\n" + now));

  r.choice = ToolChoice::kFunction;
  r.function = "now";
  compiled = grammar::testing::CompileGbnf(*ToolCallGbnf(r, ToolCallFormat::kHermes));
  EXPECT_TRUE(grammar::testing::Matches(compiled, now));
  EXPECT_FALSE(grammar::testing::Matches(compiled, weather));
}

TEST(ToolCallGbnfTest, Llama3GrammarAndTheParserAgree) {
  json body = json::parse(kTools);
  ToolRequest r = *ParseToolRequest(body, nullptr);
  r.choice = ToolChoice::kRequired;
  auto compiled = grammar::testing::CompileGbnf(*ToolCallGbnf(r, ToolCallFormat::kLlama3Json));
  ASSERT_NE(compiled, nullptr);
  const std::string call =
      "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\", \"unit\": \"c\"}}";
  EXPECT_TRUE(grammar::testing::Matches(compiled, call));
  EXPECT_FALSE(grammar::testing::Matches(compiled, call + "; " + call));
  Parsed p = ParseAllWays(ToolCallFormat::kLlama3Json, call);
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].second, R"({"city": "Oslo", "unit": "c"})");
}

TEST(ToolCallGbnfTest, AnUnenforceableSchemaNamesTheTool) {
  json body = json::parse(R"({"tools": [{"type": "function", "function": {"name": "f",
      "parameters": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}}}],
      "tool_choice": "required"})");
  ToolRequest r = *ParseToolRequest(body, nullptr);
  absl::StatusOr<std::string> gbnf = ToolCallGbnf(r, ToolCallFormat::kHermes);
  ASSERT_FALSE(gbnf.ok());
  EXPECT_EQ(ParamOf(gbnf.status()), "tools");
  EXPECT_THAT(std::string(gbnf.status().message()),
              HasSubstr("tools[0].function.parameters ('f') cannot be enforced"));
  EXPECT_THAT(std::string(gbnf.status().message()), HasSubstr("minimum"));
}

TEST(ToolCallFormatTest, DetectsTheTemplatesSyntax) {
  EXPECT_EQ(DetectToolCallFormat("{{- '<tool_call>\\n' }}"), ToolCallFormat::kHermes);
  EXPECT_EQ(DetectToolCallFormat(R"({{- '"parameters": ' }})"), ToolCallFormat::kLlama3Json);
  EXPECT_EQ(DetectToolCallFormat("{{ '<|python_tag|>' }}"), ToolCallFormat::kLlama3Json);
  EXPECT_EQ(DetectToolCallFormat("{% for m in messages %}{{ m.content }}{% endfor %}"),
            ToolCallFormat::kNone);
  EXPECT_FALSE(ParseToolCallFormat("mistral").ok());
  EXPECT_EQ(*ParseToolCallFormat("auto"), std::nullopt);
}

}  // namespace
}  // namespace tandem::router
