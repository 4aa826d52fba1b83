#include "tandem/router/openai_request.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::router {
namespace {

using ::nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kVocab = 1000;

absl::StatusOr<CompletionRequest> Completion(const std::string& body) {
  absl::StatusOr<json> parsed = ParseJsonObject(body);
  if (!parsed.ok()) return parsed.status();
  return ParseCompletionRequest(*parsed, ApiKind::kCompletion, kVocab);
}

absl::StatusOr<CompletionRequest> Chat(const std::string& body) {
  absl::StatusOr<json> parsed = ParseJsonObject(body);
  if (!parsed.ok()) return parsed.status();
  return ParseCompletionRequest(*parsed, ApiKind::kChat, kVocab);
}

TEST(ParseJsonObjectTest, SyntaxErrorsGiveThePositionButNotTheInput) {
  const std::string secret(5000, 'x');
  absl::StatusOr<json> r = ParseJsonObject("{\"prompt\": \"" + secret + "\" oops}");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("not valid JSON"));
  EXPECT_THAT(r.status().message(), HasSubstr("at byte"));
  EXPECT_THAT(r.status().message(),
              Not(HasSubstr("xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx")));
  EXPECT_LT(r.status().message().size(), 200u);
}

TEST(ParseJsonObjectTest, RefusesEmptyNonObjectsDeepNestingAndNonFiniteNumbers) {
  EXPECT_THAT(ParseJsonObject("").status().message(), HasSubstr("empty"));
  EXPECT_THAT(ParseJsonObject("[1, 2]").status().message(), HasSubstr("must be a JSON object"));
  EXPECT_THAT(ParseJsonObject(std::string(100000, '[')).status().message(),
              HasSubstr("nests deeper"));
  EXPECT_FALSE(ParseJsonObject(R"({"temperature": NaN})").ok());
  EXPECT_FALSE(ParseJsonObject(R"({"temperature": Infinity})").ok());
  EXPECT_FALSE(ParseJsonObject(R"({"temperature": 1e999})").ok());
  EXPECT_FALSE(ParseJsonObject("{\"prompt\": \"\xff\xfe\"}").ok());  // invalid UTF-8
  // Brackets inside strings are text, not nesting.
  EXPECT_TRUE(ParseJsonObject("{\"prompt\": \"" + std::string(100, '[') + "\"}").ok());
}

TEST(ParseCompletionRequestTest, ReadsEveryField) {
  absl::StatusOr<CompletionRequest> r = Completion(R"({
    "model": "m", "prompt": "hi", "max_tokens": 7, "n": 2, "temperature": 0.5, "top_p": 0.9,
    "top_k": 5, "min_p": 0.1, "presence_penalty": 1, "frequency_penalty": -1,
    "repetition_penalty": 1.2, "seed": 42, "stop": ["a", "b"], "logprobs": 3, "stream": true,
    "stream_options": {"include_usage": true}, "user": "ignored", "best_of": 2, "echo": false,
    "cache_salt": "tenant-7"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r->model, "m");
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_EQ(*r->prompts[0].text, "hi");
  EXPECT_EQ(r->params.max_tokens, 7);
  EXPECT_EQ(r->params.n, 2);
  EXPECT_FLOAT_EQ(r->params.temperature, 0.5f);
  EXPECT_EQ(r->params.top_k, 5);
  EXPECT_EQ(*r->params.seed, 42u);
  EXPECT_EQ(r->params.stop, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(r->params.logprobs, 3);
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  EXPECT_EQ(r->cache_salt, "tenant-7");
}

TEST(ParseCompletionRequestTest, ReadsLogitBias) {
  absl::StatusOr<CompletionRequest> r =
      Completion(R"({"prompt": "hi", "logit_bias": {"7": -100, "999": 2.5, "0": 100}})");
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<engine::TokenBias> bias = r->params.logit_bias;
  std::sort(bias.begin(), bias.end(), [](const engine::TokenBias& a, const engine::TokenBias& b) {
    return a.token < b.token;
  });
  EXPECT_EQ(bias, (std::vector<engine::TokenBias>{{0, 100.0f}, {7, -100.0f}, {999, 2.5f}}));
}

TEST(ParseCompletionRequestTest, PromptMayBeTokenIds) {
  absl::StatusOr<CompletionRequest> r = Completion(R"({"prompt": [1, 2, 3]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_EQ(r->prompts[0].tokens, (std::vector<int32_t>{1, 2, 3}));
  r = Completion(R"({"prompt": [[4, 5]]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 1u);
  EXPECT_EQ(r->prompts[0].tokens, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(ParamOf(Completion(R"({"prompt": [1, 5000]})").status()), "prompt");
}

TEST(ParseCompletionRequestTest, ABatchOfPrompts) {
  absl::StatusOr<CompletionRequest> r = Completion(R"({"prompt": ["a", "bc", ""]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 3u);
  EXPECT_EQ(*r->prompts[1].text, "bc");
  EXPECT_EQ(*r->prompts[2].text, "");
  r = Completion(R"({"prompt": [[1], [2, 3]]})");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->prompts.size(), 2u);
  EXPECT_EQ(r->prompts[1].tokens, (std::vector<int32_t>{2, 3}));
}

TEST(ParseCompletionRequestTest, EchoBestOfAndSuffix) {
  absl::StatusOr<CompletionRequest> r =
      Completion(R"({"prompt": "a", "echo": true, "best_of": 3, "n": 2, "suffix": "z"})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->echo);
  EXPECT_EQ(r->best_of, 3);
  EXPECT_EQ(r->params.n, 2);
  EXPECT_EQ(r->suffix, "z");
  r = Completion(R"({"prompt": "a", "best_of": 1})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->best_of, 0) << "best_of equal to n changes nothing";
}

struct BadField {
  const char* body;
  const char* param;
  const char* message;
};

class BadCompletionFieldTest : public ::testing::TestWithParam<BadField> {};

TEST_P(BadCompletionFieldTest, IsRefusedNamingTheParameter) {
  absl::StatusOr<CompletionRequest> r = Completion(GetParam().body);
  ASSERT_FALSE(r.ok()) << GetParam().body;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParamOf(r.status()), GetParam().param) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Fields, BadCompletionFieldTest,
    ::testing::Values(
        BadField{R"({})", "prompt", "prompt is required"},
        BadField{R"({"prompt": 5})", "prompt", "prompt must be"},
        BadField{R"({"prompt": []})", "prompt", "must not be empty"},
        BadField{R"({"prompt": ["a", [1]]})", "prompt", "prompt[1] must be a string"},
        BadField{R"({"prompt": [[1], []]})", "prompt", "prompt[1] must not be empty"},
        BadField{R"({"prompt": [[1], "a"]})", "prompt", "prompt[1] must be an array"},
        BadField{R"({"prompt": [[1], [9999]]})", "prompt", "outside the vocabulary"},
        BadField{R"({"prompt": "x", "model": 3})", "model", "model must be a string"},
        BadField{R"({"prompt": "x", "temperature": "hot"})", "temperature", "must be a number"},
        BadField{R"({"prompt": "x", "temperature": 5})", "temperature", "temperature must be"},
        BadField{R"({"prompt": "x", "temperature": -1})", "temperature", "temperature must be"},
        BadField{R"({"prompt": "x", "temperature": 1e300})", "temperature", "temperature must be"},
        BadField{R"({"prompt": "x", "temperature": true})", "temperature", "must be a number"},
        BadField{R"({"prompt": "x", "top_p": 0})", "top_p", "top_p must be"},
        BadField{R"({"prompt": "x", "top_k": 1.5})", "top_k", "must be an integer"},
        BadField{R"({"prompt": "x", "top_k": -2})", "top_k", "top_k must be"},
        BadField{R"({"prompt": "x", "min_p": 2})", "min_p", "min_p must be"},
        BadField{R"({"prompt": "x", "presence_penalty": 3})", "presence_penalty", "must be"},
        BadField{R"({"prompt": "x", "frequency_penalty": -3})", "frequency_penalty", "must be"},
        BadField{R"({"prompt": "x", "repetition_penalty": 0})", "repetition_penalty", "must be"},
        BadField{R"({"prompt": "x", "max_tokens": 0})", "max_tokens", "max_tokens must be"},
        BadField{R"({"prompt": "x", "max_tokens": -5})", "max_tokens", "max_tokens must be"},
        BadField{R"({"prompt": "x", "max_tokens": 99999999999999})", "max_tokens", "must be"},
        BadField{R"({"prompt": "x", "max_tokens": "10"})", "max_tokens", "must be an integer"},
        BadField{R"({"prompt": "x", "n": 0})", "n", "n must be"},
        BadField{R"({"prompt": "x", "n": 1000})", "n", "n must be"},
        BadField{R"({"prompt": "x", "logprobs": 21})", "logprobs", "logprobs must be"},
        BadField{R"({"prompt": "x", "logprobs": true})", "logprobs", "must be an integer"},
        BadField{R"({"prompt": "x", "seed": "s"})", "seed", "seed must be an integer"},
        BadField{R"({"prompt": "x", "cache_salt": 5})", "cache_salt", "must be a string"},
        BadField{R"({"prompt": "x", "stop": 5})", "stop", "stop must be"},
        BadField{R"({"prompt": "x", "stop": [1]})", "stop", "stop must be"},
        BadField{R"({"prompt": "x", "stop": [""]})", "stop", "stop string"},
        BadField{R"({"prompt": "x", "stop": ["a","b","c","d","e","f","g","h","i","j","k","l",
                    "m","n","o","p","q"]})",
                 "stop", "at most 16"},
        BadField{R"({"prompt": "x", "stream": "yes"})", "stream", "must be a boolean"},
        BadField{R"({"prompt": "x", "stream_options": {"include_usage": true}})", "stream_options",
                 "only allowed when stream"},
        BadField{R"({"prompt": "x", "echo": true, "logprobs": 1})", "echo", "prompt's logprobs"},
        BadField{R"({"prompt": "x", "echo": 1})", "echo", "must be a boolean"},
        BadField{R"({"prompt": "x", "suffix": 2})", "suffix", "must be a string"},
        BadField{R"({"prompt": "x", "best_of": 3, "stream": true})", "best_of",
                 "cannot be streamed"},
        BadField{R"({"prompt": "x", "best_of": 1, "n": 2})", "best_of", "at least n"},
        BadField{R"({"prompt": "x", "best_of": 17})", "best_of", "best_of must be"},
        BadField{R"({"prompt": "x", "logit_bias": [1]})", "logit_bias", "must be an object"},
        BadField{R"({"prompt": "x", "logit_bias": {"a1": 5}})", "logit_bias", "not a token id"},
        BadField{R"({"prompt": "x", "logit_bias": {"-1": 5}})", "logit_bias", "not a token id"},
        BadField{R"({"prompt": "x", "logit_bias": {"1000": 5}})", "logit_bias", "[0, 1000)"},
        BadField{R"({"prompt": "x", "logit_bias": {"1": "5"}})", "logit_bias", "must be a number"},
        BadField{R"({"prompt": "x", "logit_bias": {"1": 101}})", "logit_bias", "[-100, 100]"},
        BadField{R"({"prompt": "x", "min_tokens": 20, "max_tokens": 5})", "min_tokens",
                 "min_tokens must be"},
        BadField{R"({"prompt": "x", "stop_token_ids": [-1]})", "stop_token_ids", "vocabulary"}));

TEST(ParseChatRequestTest, JoinsTextPartsAndMapsDeveloperToSystem) {
  absl::StatusOr<CompletionRequest> r = Chat(R"({"messages": [
      {"role": "developer", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
      {"role": "assistant", "content": null}],
      "logprobs": true, "top_logprobs": 2, "max_completion_tokens": 9})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->messages[0]["role"], "system");
  EXPECT_EQ(r->messages[1]["content"], "a\nb");
  EXPECT_EQ(r->messages[2]["content"], "");
  EXPECT_EQ(r->params.logprobs, 2);
  EXPECT_EQ(*r->max_tokens, 9);
  EXPECT_FALSE(r->add_special_tokens);
}

TEST(ParseChatRequestTest, KeepsToolCallsAndToolResultsForTheTemplate) {
  absl::StatusOr<CompletionRequest> r = Chat(R"({"messages": [
      {"role": "user", "content": "weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]}],
      "tools": [{"type": "function", "function": {"name": "get_weather"}}],
      "tool_choice": "auto", "parallel_tool_calls": false})");
  ASSERT_TRUE(r.ok()) << r.status();
  const nlohmann::json& call = r->messages[1]["tool_calls"][0];
  EXPECT_EQ(call["id"], "call_1");
  EXPECT_EQ(call["function"]["name"], "get_weather");
  // Templates render the arguments as an object (tojson), so the JSON text is parsed.
  EXPECT_EQ(call["function"]["arguments"], nlohmann::json({{"city", "Oslo"}}));
  EXPECT_EQ(r->messages[1]["content"], "");
  EXPECT_EQ(r->messages[2]["role"], "tool");
  EXPECT_EQ(r->messages[2]["tool_call_id"], "call_1");
  EXPECT_EQ(r->messages[2]["content"], "sunny");
  EXPECT_EQ(r->tools.names, std::vector<std::string>{"get_weather"});
  EXPECT_EQ(r->tools.choice, ToolChoice::kAuto);
  EXPECT_FALSE(r->tools.parallel);
  EXPECT_TRUE(r->tools.parsed());
  EXPECT_FALSE(r->tools.forced());
}

TEST(ParseCompletionRequestTest, ToolsAreForChatOnly) {
  absl::StatusOr<CompletionRequest> r =
      Completion(R"({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]})");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(ParamOf(r.status()), "tools");
  EXPECT_THAT(r.status().message(), HasSubstr("only supported on /v1/chat/completions"));
}

class BadChatFieldTest : public ::testing::TestWithParam<BadField> {};

TEST_P(BadChatFieldTest, IsRefusedNamingTheParameter) {
  absl::StatusOr<CompletionRequest> r = Chat(GetParam().body);
  ASSERT_FALSE(r.ok()) << GetParam().body;
  EXPECT_EQ(ParamOf(r.status()), GetParam().param) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    Fields, BadChatFieldTest,
    ::testing::Values(
        BadField{R"({})", "messages", "messages is required"},
        BadField{R"({"messages": "hi"})", "messages", "must be an array"},
        BadField{R"({"messages": []})", "messages", "must not be empty"},
        BadField{R"({"messages": [1]})", "messages", "must be an object"},
        BadField{R"({"messages": [{"content": "x"}]})", "messages", "role must be a string"},
        BadField{R"({"messages": [{"role": "king", "content": "x"}]})", "messages",
                 "must be one of"},
        BadField{R"({"messages": [{"role": "user"}]})", "messages", "content is required"},
        BadField{R"({"messages": [{"role": "user", "content": 5}]})", "messages",
                 "must be a string or an array"},
        BadField{R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
                 "messages", "only 'text' parts"},
        BadField{R"({"messages": [{"role": "tool"}]})", "messages", "content is required"},
        BadField{R"({"messages": [{"role": "function", "content": "x"}]})", "messages",
                 "use role 'tool'"},
        BadField{R"({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})",
                 "messages", "only allowed on assistant messages"},
        BadField{R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
                    "function": {"arguments": "{}"}}]}]})",
                 "messages", "messages[0].tool_calls[0].function.name must be a string"},
        BadField{R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
                    "function": {"name": "f", "arguments": 5}}]}]})",
                 "messages", "arguments must be a string of JSON"},
        BadField{R"({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]})",
                 "messages", "tool_call_id must be a string"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}], "tools": [{}]})", "tools",
                 "tools[0].type must be 'function'"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})",
                 "tool_choice", "needs tools"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}], "functions": [{}]})",
                 "functions", "use tools"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 1})", "logprobs",
                 "must be a boolean"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})",
                 "top_logprobs", "requires logprobs"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true,
                    "top_logprobs": 50})",
                 "top_logprobs", "top_logprobs must be"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}],
                    "response_format": {"type": "yaml"}})",
                 "response_format", "must be text, json_object or json_schema"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}],
                    "response_format": {"type": "json_schema"}})",
                 "response_format", "json_schema must be an object"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": "a"}}})",
                 "response_format", "schema must be a JSON schema object"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}],
                    "response_format": {"type": "json_schema", "json_schema":
                      {"name": "a", "strict": "yes", "schema": {"type": "object"}}}})",
                 "response_format", "strict must be a boolean"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}],
                    "response_format": {"type": "json_schema", "json_schema":
                      {"name": "a", "schema": {"type": "object", "minProperties": 2}}}})",
                 "response_format", "minProperties"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}],
                    "guided_json": {"type": "strnig"}})",
                 "guided_json", "strnig"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}], "guided_json": "{oops"})",
                 "guided_json", "not valid JSON"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}], "guided_regex": "(a"})",
                 "guided_regex", "guided_regex: "},
        BadField{R"({"messages": [{"role": "user", "content": "x"}], "guided_regex": 5})",
                 "guided_regex", "must be a string"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}],
                    "guided_grammar": "root ::= missing"})",
                 "guided_grammar", "missing"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}], "guided_choice": []})",
                 "guided_choice", "non-empty array of strings"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}], "guided_choice": ["a", 1]})",
                 "guided_choice", "non-empty array of strings"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}],
                    "structured_outputs": {"regex": "[", "choice": ["a"]}})",
                 "structured_outputs.choice", "only one structured-output constraint"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}],
                    "response_format": {"type": "json_object"}, "guided_regex": "a"})",
                 "guided_regex", "response_format and guided_regex"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}],
                    "structured_outputs": {"json_object": 1}})",
                 "structured_outputs.json_object", "must be a boolean"},
        BadField{R"({"messages": [{"role": "user", "content": "x"}], "structured_outputs": 3})",
                 "structured_outputs", "must be an object"}));

TEST(ParseStructuredOutputTest, EachSpellingGivesItsConstraint) {
  struct Case {
    std::string fields;
    engine::ConstraintKind kind;
    std::string source;
  };
  const std::vector<Case> cases = {
      {R"("response_format": {"type": "text"})", engine::ConstraintKind::kNone, ""},
      {R"("response_format": {"type": "json_object"})", engine::ConstraintKind::kJsonObject, ""},
      {R"("response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": true,
          "schema": {"type": "object", "properties": {"z": {"type": "string"},
          "a": {"type": "integer"}}}}})",
       engine::ConstraintKind::kJsonSchema,
       R"({"type":"object","properties":{"z":{"type":"string"},"a":{"type":"integer"}}})"},
      {R"("guided_json": {"type": "object", "properties": {"b": {"type": "null"}}})",
       engine::ConstraintKind::kJsonSchema,
       R"({"type":"object","properties":{"b":{"type":"null"}}})"},
      {R"("guided_json": "{\"type\": \"integer\"}")", engine::ConstraintKind::kJsonSchema,
       R"({"type": "integer"})"},
      {R"("guided_regex": "[0-9]+")", engine::ConstraintKind::kRegex, "[0-9]+"},
      {R"("guided_grammar": "root ::= \"a\"")", engine::ConstraintKind::kGrammar, "root ::= \"a\""},
      {R"("guided_choice": ["yes", "no \"way\"\n"])", engine::ConstraintKind::kGrammar,
       "root ::= \"yes\" | \"no \\\"way\\\"\\x0a\"\n"},
      {R"("structured_outputs": {"json": {"type": "boolean"}})",
       engine::ConstraintKind::kJsonSchema, R"({"type":"boolean"})"},
      {R"("structured_outputs": {"regex": "a|b"})", engine::ConstraintKind::kRegex, "a|b"},
      {R"("structured_outputs": {"choice": ["x"]})", engine::ConstraintKind::kGrammar,
       "root ::= \"x\"\n"},
      {R"("structured_outputs": {"json_object": true})", engine::ConstraintKind::kJsonObject, ""},
  };
  for (const Case& c : cases) {
    for (ApiKind kind : {ApiKind::kCompletion, ApiKind::kChat}) {
      const std::string body =
          absl::StrCat(kind == ApiKind::kChat ? R"({"messages": [{"role": "user", "content": "x"}])"
                                              : R"({"prompt": "x")",
                       ", ", c.fields, "}");
      absl::StatusOr<json> parsed = ParseJsonObject(body);
      ASSERT_TRUE(parsed.ok()) << body;
      // With the raw body, a schema keeps the client's order of properties.
      absl::StatusOr<CompletionRequest> r = ParseCompletionRequest(*parsed, kind, kVocab, body);
      ASSERT_TRUE(r.ok()) << r.status() << "\n" << body;
      EXPECT_EQ(r->params.structured.kind, c.kind) << body;
      EXPECT_EQ(r->params.structured.source, c.source) << body;
      EXPECT_EQ(r->params.structured.replay_prompt_tokens, 0);
    }
  }
}

TEST(ParseChatRequestTest, CapsTheNumberOfMessages) {
  json messages = json::array();
  for (int i = 0; i <= kMaxMessagesPerRequest; ++i) {
    messages.push_back({{"role", "user"}, {"content", "x"}});
  }
  absl::StatusOr<CompletionRequest> r =
      ParseCompletionRequest(json{{"messages", messages}}, ApiKind::kChat, kVocab);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("at most 256"));
}

TEST(AttachParamTest, ContextOverflowNamesThePromptWithOpenAiCode) {
  absl::Status s = AttachParam(
      absl::InvalidArgumentError("this model's maximum context length is 512 tokens, but the "
                                 "prompt has 600 tokens and max_tokens is 16 (616 in all)"),
      ApiKind::kChat);
  EXPECT_EQ(ParamOf(s), "messages");
  EXPECT_EQ(ErrorCodeOf(s), "context_length_exceeded");
}

TEST(ErrorBodyTest, HasTheOpenAiShape) {
  json body = json::parse(ErrorBody(400, "temperature must be in [0, 2]", "temperature"));
  EXPECT_EQ(body["error"]["message"], "temperature must be in [0, 2]");
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  EXPECT_EQ(body["error"]["param"], "temperature");
  EXPECT_TRUE(body["error"]["code"].is_null());
}

}  // namespace
}  // namespace tandem::router

namespace tandem::router {
namespace {

TEST(ResponsesToChatTest, InputItemsBecomeMessages) {
  auto body = nlohmann::ordered_json::parse(R"({
      "model": "m", "instructions": "be brief", "max_output_tokens": 5, "store": true,
      "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{\"a\":1}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
      "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
      "tool_choice": {"type": "function", "name": "w"},
      "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}})");
  absl::StatusOr<nlohmann::ordered_json> chat = ResponsesToChat(body);
  ASSERT_TRUE(chat.ok()) << chat.status();
  const nlohmann::ordered_json& m = (*chat)["messages"];
  ASSERT_EQ(m.size(), 4u);
  EXPECT_EQ(m[0], nlohmann::ordered_json({{"role", "system"}, {"content", "be brief"}}));
  EXPECT_EQ(m[1]["content"], "weather?");
  EXPECT_EQ(m[2]["role"], "assistant");
  ASSERT_EQ(m[2]["tool_calls"].size(), 2u) << "calls of one turn are one message";
  EXPECT_EQ(m[2]["tool_calls"][0]["id"], "c1");
  EXPECT_EQ(m[2]["tool_calls"][0]["function"]["arguments"], "{\"a\":1}");
  EXPECT_EQ(m[3], nlohmann::ordered_json(
                      {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "sunny"}}));
  EXPECT_EQ((*chat)["max_tokens"], 5);
  EXPECT_EQ((*chat)["tools"][0]["function"]["name"], "w");
  EXPECT_EQ((*chat)["tool_choice"]["function"]["name"], "w");
  EXPECT_EQ((*chat)["response_format"]["json_schema"]["name"], "s");
  EXPECT_FALSE(chat->contains("store"));
  // The translation is a chat request the parser accepts.
  absl::StatusOr<CompletionRequest> r =
      ParseCompletionRequest(nlohmann::json::parse(chat->dump()), ApiKind::kChat, kVocab);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tools.choice, ToolChoice::kFunction);
}

TEST(ResponsesToChatTest, RefusesWhatItCannotServe) {
  auto refused = [](const std::string& text, const std::string& param) {
    absl::StatusOr<nlohmann::ordered_json> chat =
        ResponsesToChat(nlohmann::ordered_json::parse(text));
    ASSERT_FALSE(chat.ok()) << text;
    EXPECT_EQ(ParamOf(chat.status()), param) << chat.status();
  };
  refused(R"({"input": "x", "previous_response_id": "resp_1"})", "previous_response_id");
  refused(R"({"input": "x", "background": true})", "background");
  refused(R"({"model": "m"})", "input");
  refused(R"({"input": 5})", "input");
  refused(R"({"input": [{"type": "input_image"}]})", "input");
  refused(R"({"input": [{"role": "user", "content": [{"type": "input_file"}]}]})", "input");
  refused(R"({"input": "x", "tools": [{"type": "file_search"}]})", "tools");
  refused(R"({"input": "x", "tool_choice": {"type": "web_search"}})", "tool_choice");
  refused(R"({"input": "x", "text": {"format": {"type": "xml"}}})", "text");
}

absl::StatusOr<EmbeddingRequest> Embeddings(const std::string& body) {
  absl::StatusOr<json> parsed = ParseJsonObject(body);
  if (!parsed.ok()) return parsed.status();
  return ParseEmbeddingRequest(*parsed, kVocab, /*hidden_size=*/64);
}

TEST(ParseEmbeddingRequestTest, TakesEveryInputShapeOpenAiDefines) {
  auto one = Embeddings(R"({"model": "m", "input": "hello", "user": "u-1"})");
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ(one->inputs.size(), 1u);
  EXPECT_EQ(one->inputs[0].text, "hello");
  EXPECT_FALSE(one->base64);
  EXPECT_EQ(one->model, "m");
  auto strings = Embeddings(R"({"input": ["a", "b", "c"], "encoding_format": "base64"})");
  ASSERT_TRUE(strings.ok()) << strings.status();
  EXPECT_EQ(strings->inputs.size(), 3u);
  EXPECT_TRUE(strings->base64);
  auto ids = Embeddings(R"({"input": [1, 2, 3], "dimensions": 64})");
  ASSERT_TRUE(ids.ok()) << ids.status();
  ASSERT_EQ(ids->inputs.size(), 1u);
  EXPECT_EQ(ids->inputs[0].tokens, (std::vector<int32_t>{1, 2, 3}));
  auto arrays = Embeddings(R"({"input": [[1, 2], [3]], "truncate_prompt_tokens": -1})");
  ASSERT_TRUE(arrays.ok()) << arrays.status();
  ASSERT_EQ(arrays->inputs.size(), 2u);
  EXPECT_EQ(arrays->inputs[1].tokens, (std::vector<int32_t>{3}));
  EXPECT_EQ(arrays->truncate_prompt_tokens, -1);
}

TEST(ParseEmbeddingRequestTest, RefusesWhatItCannotServeNamingTheField) {
  struct Case {
    const char* body;
    const char* param;
    const char* message;
  };
  for (const Case& c : std::vector<Case>{
           {R"({})", "input", "input is required"},
           {R"({"input": ""})", "input", "must not be an empty string"},
           {R"({"input": []})", "input", "must not be an empty array"},
           {R"({"input": ["a", ""]})", "input", "input[1] must not be an empty string"},
           {R"({"input": [[1], []]})", "input", "input[1] must not be empty"},
           {R"({"input": ["a", [1]]})", "input", "input[1] must be a string"},
           {R"({"input": [5000]})", "input", "outside the vocabulary"},
           {R"({"input": 7})", "input", "input must be a string"},
           {R"({"input": [{"a": 1}]})", "input", "input must be a string"},
           {R"({"input": "a", "model": 3})", "model", "model must be a string"},
           {R"({"input": "a", "encoding_format": "int8"})", "encoding_format", "\"base64\""},
           {R"({"input": "a", "dimensions": 32})", "dimensions", "hidden size, 64"},
           {R"({"input": "a", "dimensions": "64"})", "dimensions", "integer"},
           {R"({"input": "a", "user": 5})", "user", "user must be a string"},
           {R"({"input": "a", "truncate_prompt_tokens": 0})", "truncate_prompt_tokens", "-1"},
           {R"({"input": "a", "normalize": false})", "normalize", "normalised"},
       }) {
    auto r = Embeddings(c.body);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.body;
    EXPECT_EQ(ParamOf(r.status()), c.param) << c.body;
    EXPECT_THAT(r.status().message(), HasSubstr(c.message)) << c.body;
  }
  std::string many = "{\"input\": [";
  for (int i = 0; i <= kMaxEmbeddingInputs; ++i) absl::StrAppend(&many, i ? "," : "", "\"x\"");
  many += "]}";
  auto r = Embeddings(many);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("at most 2048"));
}

}  // namespace
}  // namespace tandem::router
