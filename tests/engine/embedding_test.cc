// Embedding requests (RequestTask::kEmbed, the API's /v1/embeddings): the pooled vector is the
// last prompt token's final hidden state, L2-normalised, as the independent float64 NumPy
// forward pass computes it; it does not depend on what else is batched, on chunking or on the
// prefix cache; it produces no token and holds no KV block once finished, in every role.
#include <cmath>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "reference_forward.h"
#include "tandem/engine/llm_engine.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<LlmEngine> MakeEngine(const std::string& model, EngineOptions options = {}) {
  options.model_dir = model;
  options.num_threads = 2;
  auto engine = LlmEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return std::move(engine).value();
}

GenerateRequest Embed(std::string id, std::vector<int32_t> prompt) {
  GenerateRequest r{std::move(id), std::move(prompt), {}};
  r.task = RequestTask::kEmbed;
  return r;
}

// Runs `requests` to the end and returns each one's final output.
std::vector<RequestOutput> RunAll(LlmEngine& engine, std::vector<GenerateRequest> requests) {
  auto out = GenerateAll(engine, std::move(requests));
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : std::vector<RequestOutput>{};
}

std::vector<float> EmbedOne(LlmEngine& engine, std::vector<int32_t> prompt) {
  std::vector<RequestOutput> out = RunAll(engine, {Embed("alone", std::move(prompt))});
  return out.empty() ? std::vector<float>{} : out[0].embedding;
}

double Norm(const std::vector<float>& v) {
  double sum = 0;
  for (float x : v) sum += static_cast<double>(x) * x;
  return std::sqrt(sum);
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<double>& b) {
  double diff = 0;
  for (size_t i = 0; i < b.size(); ++i) diff = std::max(diff, std::abs(a[i] - b[i]));
  return diff;
}

std::vector<int32_t> RandomPrompt(std::mt19937& rng, int len, int vocab) {
  std::vector<int32_t> p(len);
  for (int32_t& t : p) t = static_cast<int32_t>(rng() % vocab);
  return p;
}

class EmbeddingReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(EmbeddingReferenceTest, PooledVectorIsTheLastTokensNormalisedFinalHiddenState) {
  const std::string arch = GetParam();
  const std::string model = testing::TinyModel(arch);
  // Whole in one step, and in chunks of 8 tokens over a 4-token block size.
  for (EngineOptions options :
       {EngineOptions{}, EngineOptions{.block_size = 4, .max_num_batched_tokens = 8}}) {
    auto engine = MakeEngine(model, options);
    const std::vector<int32_t> prompt =
        engine->tokenizer().Encode("The engine reads 42 pages; every page holds 16 tokens.", true);
    ASSERT_GE(prompt.size(), 12u);
    testing::Reference ref = testing::RunReference(model, prompt, 0);
    ASSERT_EQ(ref.embedding.size(), static_cast<size_t>(engine->config().hidden_size));

    std::vector<RequestOutput> out = RunAll(*engine, {Embed("e", prompt)});
    ASSERT_EQ(out.size(), 1u);
    EXPECT_TRUE(out[0].finished);
    EXPECT_EQ(out[0].num_prompt_tokens, static_cast<int>(prompt.size()));
    EXPECT_EQ(out[0].num_generation_tokens, 0);
    ASSERT_EQ(out[0].choices.size(), 1u);
    EXPECT_TRUE(out[0].choices[0].token_ids.empty());
    EXPECT_EQ(out[0].choices[0].finish_reason, FinishReason::kStop);
    ASSERT_EQ(out[0].embedding.size(), ref.embedding.size());
    EXPECT_NEAR(Norm(out[0].embedding), 1.0, 1e-5);
    // Unit vectors: an absolute error is a relative one.
    EXPECT_LE(MaxAbsDiff(out[0].embedding, ref.embedding), 1e-4)
        << arch << " chunk " << options.max_num_batched_tokens;
    // Its blocks went back with the finished request.
    EXPECT_EQ(engine->stats().kv_blocks_used, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, EmbeddingReferenceTest,
                         ::testing::Values("llama", "qwen2", "qwen3"));

TEST(EmbeddingTest, SameTextGivesTheSameVectorAloneAndBatchedAndDifferentTextsDiffer) {
  const std::string model = testing::TinyModel("llama", DType::kBF16);
  for (bool prefix_caching : {true, false}) {
    auto engine =
        MakeEngine(model, {.max_num_batched_tokens = 64, .enable_prefix_caching = prefix_caching});
    const int vocab = engine->config().vocab_size;
    const std::vector<int32_t> target =
        engine->tokenizer().Encode("Tandem pools the last token of the prompt.", true);
    const std::vector<float> alone = EmbedOne(*engine, target);
    ASSERT_EQ(alone.size(), static_cast<size_t>(engine->config().hidden_size));

    std::mt19937 rng(11);
    for (int others : {1, 3, 8}) {
      std::vector<GenerateRequest> batch;
      for (int i = 0; i < others; ++i) {
        // Generation requests decoding and prefilling around it, and other embeddings.
        if (i % 2 == 0) {
          batch.push_back(
              {"gen" + std::to_string(i), RandomPrompt(rng, 9 + 13 * i, vocab),
               SamplingParams{.temperature = 0, .max_tokens = 6 + i, .ignore_eos = true}});
        } else {
          batch.push_back(Embed("emb" + std::to_string(i), RandomPrompt(rng, 5 + 17 * i, vocab)));
        }
      }
      batch.insert(batch.begin() + others / 2, Embed("target", target));
      std::vector<RequestOutput> out = RunAll(*engine, std::move(batch));
      ASSERT_EQ(out.size(), static_cast<size_t>(others + 1));
      const RequestOutput& mine = out[others / 2];
      ASSERT_EQ(mine.request_id, "target");
      // Batch invariance holds bit for bit on the CPU backend.
      EXPECT_EQ(mine.embedding, alone) << others << " others, prefix caching " << prefix_caching;
      for (const RequestOutput& o : out) {
        if (o.request_id.starts_with("gen")) {
          EXPECT_TRUE(o.embedding.empty());
          EXPECT_FALSE(o.choices[0].token_ids.empty());
        } else {
          EXPECT_NEAR(Norm(o.embedding), 1.0, 1e-5) << o.request_id;
        }
      }
    }

    const std::vector<float> other =
        EmbedOne(*engine, engine->tokenizer().Encode("Tandem pools the first token.", true));
    const std::vector<float> one_more_token = EmbedOne(
        *engine, engine->tokenizer().Encode("Tandem pools the last token of the prompt!", true));
    for (const std::vector<float>* v : {&other, &one_more_token}) {
      ASSERT_EQ(v->size(), alone.size());
      double diff = 0;
      for (size_t i = 0; i < alone.size(); ++i)
        diff = std::max<double>(diff, std::abs((*v)[i] - alone[i]));
      EXPECT_GT(diff, 1e-3);
    }
    EXPECT_EQ(engine->stats().kv_blocks_used, 0);
  }
}

TEST(EmbeddingTest, RefusesSamplesAndPromptsLongerThanTheContext) {
  auto engine = MakeEngine(testing::TinyModel("llama"), {.max_model_len = 32});
  GenerateRequest two = Embed("two", {1, 2, 3});
  two.params.n = 2;
  absl::Status s = engine->AddRequest(two);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("n must be 1"));

  s = engine->AddRequest(Embed("long", std::vector<int32_t>(33, 5)));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("maximum context length is 32"));
  EXPECT_EQ(engine->AddRequest(Embed("empty", {})).code(), absl::StatusCode::kInvalidArgument);

  // The whole context is the prompt's: no room is kept for a token, since none is generated.
  std::vector<RequestOutput> out = RunAll(*engine, {Embed("full", std::vector<int32_t>(32, 5))});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_NEAR(Norm(out[0].embedding), 1.0, 1e-5);
}

TEST(EmbeddingTest, PrefillRoleFinishesWithTheVectorAndHandsNothingOff) {
  const std::string model = testing::TinyModel("llama");
  const std::vector<int32_t> prompt = {1, 17, 42, 99, 7, 3, 250, 8, 61};
  const std::vector<float> colocated = EmbedOne(*MakeEngine(model), prompt);
  auto prefill = MakeEngine(model, {.role = EngineRole::kPrefill});
  std::vector<RequestOutput> out = RunAll(
      *prefill,
      {Embed("e", prompt), {"g", prompt, SamplingParams{.temperature = 0, .max_tokens = 4}}});
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].embedding, colocated);
  EXPECT_EQ(out[0].choices[0].finish_reason, FinishReason::kStop);
  // Only the generation request is handed off; the embedding's blocks are free already.
  std::vector<PrefillHandoff> handoffs = prefill->TakeHandoffs();
  ASSERT_EQ(handoffs.size(), 1u);
  EXPECT_EQ(handoffs[0].request_id, "g");
  prefill->ReleaseHandoff(handoffs[0]);
  EXPECT_EQ(prefill->stats().kv_blocks_used, 0);
}

}  // namespace
}  // namespace tandem::engine
