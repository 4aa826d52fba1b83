// What a user of one engine relies on: results independent of batching, chunking and
// preemption; stop strings, n, max_tokens, aborts and context limits behaving as documented.
#include <fstream>
#include <random>
#include <set>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/engine/llm_engine.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<LlmEngine> MakeEngine(EngineOptions options = {}) {
  options.model_dir = testing::TinyModel("llama", DType::kBF16);
  if (options.num_threads == 0) options.num_threads = 2;
  auto engine = LlmEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return std::move(engine).value();
}

std::vector<int32_t> RandomPrompt(std::mt19937& rng, int len, int vocab) {
  std::vector<int32_t> p(len);
  for (int32_t& t : p) t = static_cast<int32_t>(rng() % vocab);
  return p;
}

ChoiceDelta RunOne(LlmEngine& engine, std::vector<int32_t> prompt, SamplingParams params) {
  auto out = GenerateAll(engine, {{"one", std::move(prompt), params}});
  EXPECT_TRUE(out.ok()) << out.status();
  return (*out)[0].choices[0];
}

const SamplingParams kGreedy{.temperature = 0, .max_tokens = 24, .ignore_eos = true, .logprobs = 0};
const SamplingParams kSeeded{.temperature = 0.9f,
                             .top_p = 0.95f,
                             .top_k = 50,
                             .seed = 1234,
                             .max_tokens = 24,
                             .ignore_eos = true,
                             .logprobs = 0};

TEST(EngineBatchingTest, TokensDoNotDependOnWhatElseIsBatched) {
  auto engine = MakeEngine({.max_num_batched_tokens = 64});
  const int vocab = engine->config().vocab_size;
  std::mt19937 rng(5);
  const std::vector<int32_t> target = RandomPrompt(rng, 37, vocab);
  for (const SamplingParams& params : {kGreedy, kSeeded}) {
    ChoiceDelta alone = RunOne(*engine, target, params);
    ASSERT_EQ(alone.token_ids.size(), 24u);
    for (int others : {1, 2, 4, 8, 16}) {
      std::vector<GenerateRequest> batch;
      for (int i = 0; i < others; ++i) {
        SamplingParams p{.temperature = (i % 2) ? 0.0f : 1.0f,
                         .seed = static_cast<uint64_t>(i),
                         .max_tokens = 5 + i * 3,
                         .ignore_eos = true};
        batch.push_back({absl::StrCat("other", i),
                         RandomPrompt(rng, 1 + static_cast<int>(rng() % 90), vocab), p});
      }
      // The target joins in the middle, so it shares steps with prefills and decodes.
      batch.insert(batch.begin() + others / 2, {"target", target, params});
      auto out = GenerateAll(*engine, std::move(batch));
      ASSERT_TRUE(out.ok()) << out.status();
      const ChoiceDelta& got = (*out)[others / 2].choices[0];
      EXPECT_EQ(got.token_ids, alone.token_ids) << others << " others, greedy=" << params.greedy();
      EXPECT_EQ(got.logprobs, alone.logprobs) << others << " others";
    }
  }
}

// Requests exercising every part of a draw: greedy and seeded sampling with each truncation,
// penalties, min_tokens holding back EOS, logit_bias, stop ids, n > 1 and log-probabilities.
std::vector<GenerateRequest> SamplingMix(const LlmEngine& engine) {
  std::mt19937 rng(21);
  const int vocab = engine.config().vocab_size;
  std::vector<SamplingParams> params = {
      {.temperature = 0, .max_tokens = 20, .logprobs = 5},
      {.temperature = 0.8f, .top_p = 0.9f, .top_k = 40, .min_p = 0.05f, .seed = 3,
       .max_tokens = 20, .ignore_eos = true, .logprobs = 3},
      {.temperature = 1.0f, .seed = 4, .max_tokens = 20, .ignore_eos = true, .logprobs = 0},
      {.temperature = 0.7f, .top_p = 0.5f, .seed = 5, .max_tokens = 20, .ignore_eos = true},
      {.temperature = 1.2f, .min_p = 0.1f, .seed = 6, .max_tokens = 20, .ignore_eos = true},
      {.temperature = 0.9f, .top_k = 3, .seed = 7, .max_tokens = 12, .ignore_eos = true, .n = 3,
       .logprobs = 2},
      {.temperature = 0, .repetition_penalty = 1.5f, .presence_penalty = 0.7f,
       .frequency_penalty = 0.4f, .max_tokens = 20, .ignore_eos = true, .logprobs = 1},
      {.temperature = 0.6f, .repetition_penalty = 0.8f, .frequency_penalty = -0.5f, .seed = 8,
       .max_tokens = 20, .ignore_eos = true},
      {.temperature = 0, .max_tokens = 20, .min_tokens = 12},
      {.temperature = 1.0f, .presence_penalty = 1.5f, .seed = 10, .max_tokens = 24,
       .ignore_eos = true},
      {.temperature = 1.0f, .frequency_penalty = 1.2f, .seed = 11, .max_tokens = 24,
       .ignore_eos = true},
  };
  SamplingParams biased{.temperature = 0.5f, .seed = 9, .max_tokens = 20, .logprobs = 4};
  biased.logit_bias = {{7, 6.0f}, {11, -100.0f}, {static_cast<int32_t>(vocab - 1), 3.5f}};
  biased.stop_token_ids = {19};
  biased.min_tokens = 5;
  params.push_back(biased);
  std::vector<GenerateRequest> requests;
  for (size_t i = 0; i < params.size(); ++i) {
    requests.push_back(
        {absl::StrCat("r", i), RandomPrompt(rng, 5 + static_cast<int>(i) * 7, vocab), params[i]});
  }
  return requests;
}

int64_t CountTokens(const std::vector<RequestOutput>& outputs) {
  int64_t tokens = 0;
  for (const RequestOutput& out : outputs) {
    for (const ChoiceDelta& c : out.choices) tokens += static_cast<int64_t>(c.token_ids.size());
  }
  return tokens;
}

void ExpectSameOutputs(const std::vector<RequestOutput>& got,
                       const std::vector<RequestOutput>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(got[i].choices.size(), want[i].choices.size()) << want[i].request_id;
    for (size_t c = 0; c < want[i].choices.size(); ++c) {
      const ChoiceDelta& a = got[i].choices[c];
      const ChoiceDelta& b = want[i].choices[c];
      SCOPED_TRACE(::testing::Message() << want[i].request_id << " choice " << c);
      EXPECT_EQ(a.token_ids, b.token_ids);
      EXPECT_EQ(a.logprobs, b.logprobs);
      ASSERT_EQ(a.top_logprobs.size(), b.top_logprobs.size());
      for (size_t t = 0; t < b.top_logprobs.size(); ++t) {
        ASSERT_EQ(a.top_logprobs[t].size(), b.top_logprobs[t].size()) << "token " << t;
        for (size_t k = 0; k < b.top_logprobs[t].size(); ++k) {
          EXPECT_EQ(a.top_logprobs[t][k].token, b.top_logprobs[t][k].token);
          EXPECT_EQ(a.top_logprobs[t][k].logprob, b.top_logprobs[t][k].logprob);
        }
      }
      EXPECT_EQ(a.finish_reason, b.finish_reason);
    }
  }
}

// --sampling-device backend on the CPU: every token drawn by Backend::SampleRows, through the
// same steps as on a GPU, and each the host Sampler's own (tokens, logprobs, top logprobs and
// the seeded streams).
TEST(EngineBatchingTest, SamplingInTheBackendGivesTheHostsTokens) {
  auto host = MakeEngine({.sampling_device = SamplingDevice::kHost});
  auto backend = MakeEngine({.sampling_device = SamplingDevice::kBackend});
  const std::vector<GenerateRequest> requests = SamplingMix(*host);
  auto want = GenerateAll(*host, requests);
  ASSERT_TRUE(want.ok()) << want.status();
  auto got = GenerateAll(*backend, requests);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameOutputs(*got, *want);
  EXPECT_EQ(host->stats().backend_sampled_tokens, 0);
  EXPECT_EQ(backend->stats().backend_sampled_tokens, CountTokens(*got));
  EXPECT_GT(CountTokens(*got), 100);
}

// Samples the backend cannot draw for (a structured-output constraint; a logit_bias naming a
// token twice, whose biases the host adds one after the other) are drawn on the host from their
// own rows of logits, in the same steps as the others, which the backend draws; every output
// is the host engine's.
TEST(EngineBatchingTest, ConstrainedSamplesAreDrawnOnTheHost) {
  auto host = MakeEngine({.sampling_device = SamplingDevice::kHost});
  auto backend = MakeEngine({.sampling_device = SamplingDevice::kBackend});
  std::vector<GenerateRequest> requests = SamplingMix(*host);
  SamplingParams json{.temperature = 0.7f, .seed = 2, .max_tokens = 12};
  json.structured.kind = ConstraintKind::kJsonObject;
  requests.insert(requests.begin() + 3, {"json", host->tokenizer().Encode("{", false), json});
  SamplingParams twice{.temperature = 0.9f, .seed = 12, .max_tokens = 10, .ignore_eos = true};
  twice.logit_bias = {{7, 2.5f}, {9, 1.0f}, {7, 3.25f}};
  requests.insert(requests.begin() + 5, {"twice", {5, 6, 7, 8}, twice});
  auto want = GenerateAll(*host, requests);
  ASSERT_TRUE(want.ok()) << want.status();
  auto got = GenerateAll(*backend, requests);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameOutputs(*got, *want);
  const int64_t constrained = static_cast<int64_t>((*got)[3].choices[0].token_ids.size());
  EXPECT_GT(constrained, 0);
  EXPECT_EQ((*got)[5].choices[0].token_ids.size(), 10u);
  EXPECT_EQ(backend->stats().backend_sampled_tokens, CountTokens(*got) - constrained - 10);
  EXPECT_EQ(backend->stats().host_sampled_tokens, constrained + 10);
}

// With n-gram speculation (a fixed draft length, so that seeded streams repeat), a step's
// sequences with drafts are verified on the host and the others drawn in the backend; the
// outputs are the host engine's.
TEST(EngineBatchingTest, SpeculativeStepsDrawUndraftedSamplesInTheBackend) {
  const SpeculativeOptions ngram{.method = SpeculativeMethod::kNgram,
                                 .num_speculative_tokens = 3,
                                 .adaptive = false};
  auto host = MakeEngine({.speculative = ngram, .sampling_device = SamplingDevice::kHost});
  auto backend = MakeEngine({.speculative = ngram, .sampling_device = SamplingDevice::kBackend});
  std::vector<GenerateRequest> requests = SamplingMix(*host);
  // Prompts that repeat themselves give the proposer matches for some samples and not others.
  for (size_t i = 0; i < requests.size(); i += 2) {
    std::vector<int32_t>& prompt = requests[i].prompt_tokens;
    const std::vector<int32_t> once = prompt;
    for (int k = 0; k < 3; ++k) prompt.insert(prompt.end(), once.begin(), once.end());
  }
  auto want = GenerateAll(*host, requests);
  ASSERT_TRUE(want.ok()) << want.status();
  auto got = GenerateAll(*backend, requests);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameOutputs(*got, *want);
  const EngineStats stats = backend->stats();
  EXPECT_GT(stats.spec_verify_steps, 0);
  EXPECT_GT(stats.backend_sampled_tokens, 0);
  EXPECT_LT(stats.backend_sampled_tokens, CountTokens(*got));
}

TEST(EngineBatchingTest, ChunkedPrefillEqualsUnchunked) {
  std::mt19937 rng(9);
  auto whole = MakeEngine({.max_num_batched_tokens = 512});
  const std::vector<int32_t> prompt = RandomPrompt(rng, 300, whole->config().vocab_size);
  ChoiceDelta expected = RunOne(*whole, prompt, kGreedy);
  for (int chunk : {7, 16, 64}) {
    auto chunked = MakeEngine({.max_num_batched_tokens = chunk});
    ChoiceDelta got = RunOne(*chunked, prompt, kGreedy);
    EXPECT_EQ(got.token_ids, expected.token_ids) << "chunk " << chunk;
    EXPECT_EQ(got.logprobs, expected.logprobs) << "chunk " << chunk;
  }
}

TEST(EngineBatchingTest, PreemptedRequestsRecomputeToTheSameTokens) {
  std::mt19937 rng(11);
  auto roomy = MakeEngine();
  const int vocab = roomy->config().vocab_size;
  std::vector<GenerateRequest> requests;
  for (int i = 0; i < 6; ++i) {
    SamplingParams p = i % 2 ? kGreedy : kSeeded;
    p.max_tokens = 40;
    requests.push_back({absl::StrCat("r", i), RandomPrompt(rng, 40, vocab), p});
  }
  auto expected = GenerateAll(*roomy, requests);
  ASSERT_TRUE(expected.ok());

  // Room for about two sequences at a time: the scheduler must preempt.
  const int64_t block_bytes = ModelRunner::KvBytesPerBlock(roomy->config(), /*block_size=*/16);
  auto tight = MakeEngine({.kv_cache_bytes = 12 * block_bytes});
  auto got = GenerateAll(*tight, requests);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_GT(tight->stats().preemptions, 0);
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ((*got)[i].choices[0].token_ids, (*expected)[i].choices[0].token_ids) << i;
  }
  EXPECT_EQ(tight->stats().kv_blocks_used, 0);
}

TEST(EngineBatchingTest, StreamedTextEqualsTheDecodedTokens) {
  auto engine = MakeEngine();
  SamplingParams p = kSeeded;
  p.max_tokens = 60;
  p.skip_special_tokens = true;
  ChoiceDelta out = RunOne(*engine, engine->tokenizer().Encode("Once upon a time", true), p);
  EXPECT_EQ(out.text, engine->tokenizer().Decode(out.token_ids, true));
  EXPECT_EQ(out.finish_reason, FinishReason::kLength);
}

TEST(EngineBatchingTest, StopStringEndsTheOutputAndIsNotEmitted) {
  auto engine = MakeEngine();
  std::vector<int32_t> prompt = engine->tokenizer().Encode("The cache holds", true);
  SamplingParams p = kGreedy;
  p.max_tokens = 48;
  ChoiceDelta full = RunOne(*engine, prompt, p);
  ASSERT_GE(full.text.size(), 12u);
  // A stop string taken from the middle of the unconstrained output.
  std::string stop = full.text.substr(full.text.size() / 2, 3);
  size_t first = full.text.find(stop);
  p.stop = {stop};
  ChoiceDelta stopped = RunOne(*engine, prompt, p);
  EXPECT_EQ(stopped.text, full.text.substr(0, first));
  EXPECT_EQ(stopped.finish_reason, FinishReason::kStop);
  p.include_stop_str_in_output = true;
  ChoiceDelta included = RunOne(*engine, prompt, p);
  EXPECT_EQ(included.text, full.text.substr(0, first + stop.size()));
}

TEST(EngineBatchingTest, NSamplesAreSeededIndependentlyAndReproducibly) {
  auto engine = MakeEngine();
  SamplingParams p = kSeeded;
  p.n = 4;
  p.temperature = 1.5f;
  p.top_k = 0;
  p.top_p = 1.0f;
  std::vector<int32_t> prompt = engine->tokenizer().Encode("Samples", true);
  auto a = GenerateAll(*engine, {{"a", prompt, p}});
  auto b = GenerateAll(*engine, {{"b", prompt, p}});
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ((*a)[0].choices.size(), 4u);
  std::set<std::vector<int32_t>> distinct;
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ((*a)[0].choices[i].token_ids, (*b)[0].choices[i].token_ids);
    EXPECT_EQ((*a)[0].choices[i].token_ids.size(), 24u);
    distinct.insert((*a)[0].choices[i].token_ids);
  }
  EXPECT_GE(distinct.size(), 2u);
}

TEST(EngineBatchingTest, AbortFreesEveryBlockAtOnce) {
  auto engine = MakeEngine();
  std::mt19937 rng(3);
  SamplingParams p = kGreedy;
  p.max_tokens = 100;
  p.n = 3;
  ASSERT_TRUE(engine->AddRequest({"x", RandomPrompt(rng, 70, 200), p}).ok());
  ASSERT_TRUE(engine->AddRequest({"y", RandomPrompt(rng, 20, 200), kGreedy}).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(engine->Step().ok());
  EXPECT_GT(engine->stats().kv_blocks_used, 0);
  engine->Abort("x");
  engine->Abort("y");
  engine->Abort("unknown");
  EXPECT_EQ(engine->stats().kv_blocks_used, 0);
  EXPECT_FALSE(engine->has_unfinished());
}

TEST(EngineBatchingTest, RefusesRequestsItCannotServe) {
  auto engine = MakeEngine({.max_model_len = 128});
  SamplingParams p{.max_tokens = 100};
  absl::Status too_long = engine->AddRequest({"a", std::vector<int32_t>(40, 1), p});
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_long.message()), HasSubstr("128"));
  EXPECT_THAT(std::string(too_long.message()), HasSubstr("40"));
  EXPECT_THAT(std::string(too_long.message()), HasSubstr("100"));
  EXPECT_EQ(engine->AddRequest({"b", {}, {}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->AddRequest({"c", {1, engine->config().vocab_size}, {}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->AddRequest({"d", {1}, {.top_p = 0}}).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(engine->AddRequest({"e", {1}, {}}).ok());
  EXPECT_EQ(engine->AddRequest({"e", {1}, {}}).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(engine->stats().kv_blocks_used, 0);
}

TEST(EngineBatchingTest, MaxTokensEndsWithLength) {
  auto engine = MakeEngine();
  ChoiceDelta out =
      RunOne(*engine, {1, 2, 3}, {.temperature = 0, .max_tokens = 7, .ignore_eos = true});
  EXPECT_EQ(out.token_ids.size(), 7u);
  EXPECT_EQ(out.finish_reason, FinishReason::kLength);
}

TEST(EngineBatchingTest, StepTraceRecordsEveryStepAndEachFirstToken) {
  const std::string path = ::testing::TempDir() + "/engine_step_trace.jsonl";
  auto trace = StepTrace::Open(path);
  ASSERT_TRUE(trace.ok()) << trace.status();
  auto engine = MakeEngine({.max_num_batched_tokens = 16, .step_trace = *trace});
  const int vocab = engine->config().vocab_size;
  std::mt19937 rng(11);
  const SamplingParams params{.temperature = 0, .max_tokens = 4, .ignore_eos = true};
  auto out = GenerateAll(*engine, {{"long", RandomPrompt(rng, 37, vocab), params},
                                   {"short", RandomPrompt(rng, 5, vocab), params}});
  ASSERT_TRUE(out.ok()) << out.status();

  std::ifstream in(path);
  std::string line;
  int64_t steps = 0, tokens = 0, prefill_tokens = 0;
  std::multiset<int64_t> first_token_prompts;
  std::set<std::string> first_token_ids;
  bool first_step = true;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    EXPECT_EQ(j["role"], "colocated");
    if (j.contains("step_s")) {
      ++steps;
      EXPECT_GT(j["step_s"].get<double>(), 0);
      EXPECT_LE(j["tokens"].get<int64_t>(), 16);
      tokens += j["tokens"].get<int64_t>();
      prefill_tokens += j["prefill_tokens"].get<int64_t>();
      // The engine was idle before its first step; afterwards work was pending throughout.
      if (first_step) EXPECT_LT(j["gap_s"].get<double>(), 0);
      if (!first_step) EXPECT_GE(j["gap_s"].get<double>(), 0);
      first_step = false;
    } else {
      EXPECT_GT(j["first_token_s"].get<double>(), 0);
      first_token_prompts.insert(j["prompt_tokens"].get<int64_t>());
      first_token_ids.insert(j["request_id"].get<std::string>());
    }
  }
  EXPECT_EQ(steps, engine->stats().steps);
  EXPECT_EQ(prefill_tokens, 37 + 5);
  EXPECT_EQ(tokens, 37 + 5 + 2 * 3);  // each request's three tokens after the first
  EXPECT_EQ(first_token_prompts, (std::multiset<int64_t>{5, 37}));
  EXPECT_EQ(first_token_ids, (std::set<std::string>{"long", "short"}));
}

}  // namespace
}  // namespace tandem::engine
