// Structured outputs in the engine: every token a constrained sample produces is one its grammar
// allows (checked by a separate matcher), a finished sample's text is a complete document, a
// max_tokens cut says "length", n > 1 samples are constrained one by one, a sample resumed from
// replayed tokens goes on exactly as it would have, and bad constraints are refused.
#include <regex>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/engine/llm_engine.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

using ::testing::HasSubstr;

// Every value bounded (strings by maxLength, arrays by maxItems), so a document has at most a
// few hundred bytes and a sample must finish it well inside max_tokens.
constexpr char kBoundedSchema[] = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer"},
    "ok": {"type": "boolean"},
    "color": {"enum": ["red", "green", null, 3]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
    "pos": {"type": "object", "properties": {"x": {"type": "number"}},
            "required": ["x"], "additionalProperties": false}
  },
  "required": ["name", "age", "ok", "color", "tags", "pos"],
  "additionalProperties": false
})";

class StructuredOutputTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    EngineOptions options;
    options.model_dir = testing::TinyModel("llama");
    options.num_threads = 2;
    options.kv_cache_bytes = 32ll << 20;
    auto engine = LlmEngine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(engine).value().release();
  }
  static void TearDownTestSuite() {
    delete engine_;
    engine_ = nullptr;
  }

  static GenerateRequest Request(const std::string& id, StructuredOutput constraint,
                                 SamplingParams p = {}) {
    p.structured = std::move(constraint);
    if (p.max_tokens == 16) p.max_tokens = 400;
    return {id, engine_->tokenizer().Encode("Answer in JSON:", true), p};
  }

  // A fresh matcher of the request's grammar accepts every generated token in order (and an
  // EOS, if the sample ended on one, only where the grammar may end).
  static void ExpectTokensAllowed(const GenerateRequest& request, const ChoiceDelta& choice) {
    grammar::GrammarCache cache;
    std::vector<std::string> bytes(engine_->config().vocab_size);
    const text::Tokenizer& tok = engine_->tokenizer();
    std::vector<int32_t> special;
    for (int id = 0; id < tok.vocab_size() && id < engine_->config().vocab_size; ++id) {
      bytes[id] = tok.TokenBytes(id);
      if (tok.IsSpecial(id)) special.push_back(id);
    }
    auto vocab = grammar::TokenVocabulary::Create(bytes, engine_->config().eos_token_ids, special);
    ASSERT_TRUE(vocab.ok()) << vocab.status();
    auto grammar = BuildGrammar(request.params.structured);
    ASSERT_TRUE(grammar.ok()) << grammar.status();
    auto compiled = grammar::CompiledGrammar::Create(*grammar, *vocab);
    ASSERT_TRUE(compiled.ok()) << compiled.status();
    grammar::GrammarMatcher matcher(*compiled, 0);
    for (size_t i = 0; i < choice.token_ids.size(); ++i) {
      ASSERT_TRUE(matcher.AcceptToken(choice.token_ids[i]))
          << "token " << i << " (" << choice.token_ids[i] << ") after '" << choice.text << "'";
    }
    if (choice.finish_reason == FinishReason::kStop) {
      EXPECT_TRUE(matcher.IsTerminated()) << choice.text;
    } else {
      EXPECT_EQ(choice.finish_reason, FinishReason::kLength);
      EXPECT_EQ(static_cast<int>(choice.token_ids.size()), request.params.max_tokens);
    }
  }

  static std::vector<RequestOutput> Run(std::vector<GenerateRequest> requests) {
    auto out = GenerateAll(*engine_, std::move(requests));
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *out : std::vector<RequestOutput>{};
  }

  static LlmEngine* engine_;
};

LlmEngine* StructuredOutputTest::engine_ = nullptr;

TEST_F(StructuredOutputTest, BoundedSchemaGivesValidJsonUnderEverySampler) {
  const StructuredOutput schema{ConstraintKind::kJsonSchema, kBoundedSchema};
  std::vector<SamplingParams> samplers(6);
  samplers[0].temperature = 0;
  samplers[1].seed = 1;
  samplers[2].seed = 2, samplers[2].top_k = 5;
  samplers[3].seed = 3, samplers[3].top_p = 0.5f, samplers[3].temperature = 1.5f;
  samplers[4].seed = 4, samplers[4].repetition_penalty = 1.3f, samplers[4].presence_penalty = 1;
  samplers[4].frequency_penalty = 0.5f, samplers[4].min_p = 0.05f;
  samplers[5].temperature = 0, samplers[5].frequency_penalty = 2, samplers[5].min_tokens = 3;
  std::vector<GenerateRequest> requests;
  for (size_t i = 0; i < samplers.size(); ++i) {
    requests.push_back(Request(absl::StrCat("s", i), schema, samplers[i]));
  }
  std::vector<RequestOutput> out = Run(requests);
  ASSERT_EQ(out.size(), requests.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const ChoiceDelta& c = out[i].choices[0];
    ExpectTokensAllowed(requests[i], c);
    ASSERT_EQ(c.finish_reason, FinishReason::kStop) << i << ": " << c.text;
    nlohmann::json doc = nlohmann::json::parse(c.text, nullptr, false);
    ASSERT_FALSE(doc.is_discarded()) << c.text;
    EXPECT_TRUE(doc["name"].is_string() && doc["age"].is_number_integer() &&
                doc["ok"].is_boolean() && doc["tags"].is_array() && doc["pos"]["x"].is_number())
        << c.text;
  }
}

// The engine computes a step's grammar masks on a thread of its own while the forward pass
// runs; computed after it instead, every output is the same: constrained samples of every
// sampler, n > 1, a regex, unconstrained requests batched with them, and with n-gram
// speculation (rows after an accepted draft take their masks after the prefetched first one).
TEST_F(StructuredOutputTest, MasksComputedDuringTheForwardPassGiveTheSameOutputs) {
  const StructuredOutput schema{ConstraintKind::kJsonSchema, kBoundedSchema};
  std::vector<GenerateRequest> requests;
  for (int i = 0; i < 4; ++i) {
    SamplingParams p;
    p.seed = 10 + i;
    if (i == 0) p.temperature = 0;
    if (i == 1) p.n = 3;
    if (i == 2) p.top_p = 0.7f, p.repetition_penalty = 1.2f;
    requests.push_back(Request(absl::StrCat("schema", i), schema, p));
  }
  SamplingParams regex;
  regex.seed = 7;
  requests.push_back(
      Request("regex", {ConstraintKind::kRegex, "(ab|cd){2,5}-[0-9]{3}"}, regex));
  for (int i = 0; i < 3; ++i) {
    SamplingParams p;
    p.seed = 20 + i;
    p.max_tokens = 24;
    requests.push_back({absl::StrCat("free", i), engine_->tokenizer().Encode("Say more", true), p});
  }
  for (bool speculate : {false, true}) {
    std::vector<std::vector<RequestOutput>> outputs;
    for (bool overlap : {true, false}) {
      EngineOptions options;
      options.model_dir = testing::TinyModel("llama");
      options.num_threads = 2;
      options.kv_cache_bytes = 32ll << 20;
      options.overlap_grammar_masks = overlap;
      if (speculate) {
        options.speculative.method = SpeculativeMethod::kNgram;
        options.speculative.num_speculative_tokens = 3;
        options.speculative.adaptive = false;
      }
      auto engine = LlmEngine::Create(options);
      ASSERT_TRUE(engine.ok()) << engine.status();
      auto out = GenerateAll(**engine, requests);
      ASSERT_TRUE(out.ok()) << out.status();
      outputs.push_back(*std::move(out));
    }
    ASSERT_EQ(outputs[0].size(), requests.size());
    ASSERT_EQ(outputs[1].size(), requests.size());
    for (size_t r = 0; r < requests.size(); ++r) {
      ASSERT_EQ(outputs[0][r].choices.size(), outputs[1][r].choices.size());
      for (size_t c = 0; c < outputs[0][r].choices.size(); ++c) {
        const ChoiceDelta& with = outputs[0][r].choices[c];
        const ChoiceDelta& without = outputs[1][r].choices[c];
        EXPECT_EQ(with.token_ids, without.token_ids)
            << requests[r].request_id << " choice " << c << " speculate " << speculate;
        EXPECT_EQ(with.text, without.text);
        EXPECT_EQ(with.finish_reason, without.finish_reason);
        if (requests[r].params.structured.kind != ConstraintKind::kNone) {
          ExpectTokensAllowed(requests[r], with);
        }
      }
    }
  }
}

TEST_F(StructuredOutputTest, JsonObjectTokensAreAllowedAndFinishedOnesParse) {
  SamplingParams p;
  p.n = 4;
  p.seed = 11;
  p.max_tokens = 200;
  GenerateRequest request = Request("obj", {ConstraintKind::kJsonObject, ""}, p);
  std::vector<RequestOutput> out = Run({request});
  ASSERT_EQ(out[0].choices.size(), 4u);
  for (const ChoiceDelta& c : out[0].choices) {
    ExpectTokensAllowed(request, c);
    ASSERT_FALSE(c.text.empty());
    EXPECT_EQ(c.text[0], '{');
    if (c.finish_reason == FinishReason::kStop) {
      nlohmann::json doc = nlohmann::json::parse(c.text, nullptr, false);
      EXPECT_TRUE(doc.is_object()) << c.text;
    }
  }
  // Samples of n > 1 draw their own streams under their own matchers.
  EXPECT_NE(out[0].choices[0].token_ids, out[0].choices[1].token_ids);
}

TEST_F(StructuredOutputTest, RegexAndGrammarOutputsMatchExactly) {
  SamplingParams p;
  p.n = 3;
  p.seed = 5;
  GenerateRequest regex = Request("re", {ConstraintKind::kRegex, "[a-c]{3}-[0-9]{2,4}"}, p);
  GenerateRequest gbnf =
      Request("g", {ConstraintKind::kGrammar, "root ::= \"yes\" | \"no\" | \"maybe so\"\n"}, p);
  std::vector<RequestOutput> out = Run({regex, gbnf});
  for (const ChoiceDelta& c : out[0].choices) {
    ExpectTokensAllowed(regex, c);
    EXPECT_EQ(c.finish_reason, FinishReason::kStop);
    EXPECT_TRUE(std::regex_match(c.text, std::regex("[a-c]{3}-[0-9]{2,4}"))) << c.text;
  }
  for (const ChoiceDelta& c : out[1].choices) {
    ExpectTokensAllowed(gbnf, c);
    EXPECT_EQ(c.finish_reason, FinishReason::kStop);
    EXPECT_TRUE(c.text == "yes" || c.text == "no" || c.text == "maybe so") << c.text;
  }
}

TEST_F(StructuredOutputTest, MaxTokensCutEndsWithLengthNotStop) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = 4;
  GenerateRequest request = Request(
      "cut",
      {ConstraintKind::kJsonSchema,
       R"({"type":"object","properties":{"s":{"type":"string","minLength":40}},"required":["s"]})"},
      p);
  std::vector<RequestOutput> out = Run({request});
  const ChoiceDelta& c = out[0].choices[0];
  ExpectTokensAllowed(request, c);
  EXPECT_EQ(c.finish_reason, FinishReason::kLength);
  EXPECT_TRUE(nlohmann::json::parse(c.text, nullptr, false).is_discarded()) << c.text;
}

TEST_F(StructuredOutputTest, IgnoreEosStillEndsWhereTheGrammarEnds) {
  SamplingParams p;
  p.seed = 9;
  p.ignore_eos = true;
  GenerateRequest request = Request("ig", {ConstraintKind::kRegex, "(ab|cd)"}, p);
  const ChoiceDelta c = Run({request})[0].choices[0];
  ExpectTokensAllowed(request, c);
  EXPECT_EQ(c.finish_reason, FinishReason::kStop);
  EXPECT_TRUE(c.text == "ab" || c.text == "cd") << c.text;
}

TEST_F(StructuredOutputTest, ReplayedPromptTokensResumeTheSampleExactly) {
  SamplingParams p;
  p.temperature = 0;
  GenerateRequest whole = Request("whole", {ConstraintKind::kJsonSchema, kBoundedSchema}, p);
  const ChoiceDelta full = Run({whole})[0].choices[0];
  ASSERT_EQ(full.finish_reason, FinishReason::kStop);
  ASSERT_GT(full.token_ids.size(), 6u);
  // As a router continues a sample elsewhere: the prompt plus the tokens so far, replayed.
  const int k = static_cast<int>(full.token_ids.size()) / 2;
  GenerateRequest rest = whole;
  rest.request_id = "rest";
  rest.prompt_tokens.insert(rest.prompt_tokens.end(), full.token_ids.begin(),
                            full.token_ids.begin() + k);
  rest.params.structured.replay_prompt_tokens = k;
  rest.params.max_tokens = whole.params.max_tokens - k;
  const ChoiceDelta tail = Run({rest})[0].choices[0];
  EXPECT_EQ(tail.finish_reason, FinishReason::kStop);
  EXPECT_EQ(tail.token_ids, std::vector<int32_t>(full.token_ids.begin() + k, full.token_ids.end()));

  // Replayed tokens the grammar refuses are refused with the request.
  GenerateRequest bad = whole;
  bad.request_id = "bad";
  bad.prompt_tokens = engine_->tokenizer().Encode("x}", true);
  bad.params.structured.replay_prompt_tokens = 1;
  absl::Status status = engine_->AddRequest(bad);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("not allowed by its grammar"));
}

TEST_F(StructuredOutputTest, BadConstraintsAreInvalidArgumentNamingTheProblem) {
  auto refuse = [&](StructuredOutput c, const std::string& expected) {
    absl::Status status = engine_->AddRequest(Request("bad", std::move(c)));
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(), HasSubstr(expected));
  };
  refuse({ConstraintKind::kJsonSchema, R"({"type":"object","minProperties":1})"}, "minProperties");
  refuse({ConstraintKind::kJsonSchema, "{not json"}, "not valid JSON");
  refuse({ConstraintKind::kRegex, "(a"}, "regex");
  refuse({ConstraintKind::kGrammar, "root ::= foo"}, "foo");
  refuse({ConstraintKind::kGrammar, ""}, "must not be empty");
  refuse({ConstraintKind::kJsonObject, "{}"}, "takes no source");
  EXPECT_FALSE(engine_->has_unfinished());
}

TEST_F(StructuredOutputTest, AGrammarCompilesOncePerKindAndSource) {
  const StructuredOutput c{ConstraintKind::kRegex, "[0-9]{3}"};
  SamplingParams p;
  p.temperature = 0;
  const size_t before = engine_->grammar_compilations();
  std::vector<RequestOutput> out =
      Run({Request("a", c, p), Request("b", c, p), Request("c", c, p)});
  EXPECT_EQ(engine_->grammar_compilations(), before + 1);
  for (const RequestOutput& o : out) EXPECT_EQ(o.choices[0].text, out[0].choices[0].text);
  EXPECT_TRUE(std::regex_match(out[0].choices[0].text, std::regex("[0-9]{3}")));
}

}  // namespace
}  // namespace tandem::engine
