// The engine against an independent float64 NumPy forward pass reading the same safetensors.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "reference_forward.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/engine/model_runner.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

using testing::Reference;
using testing::RunReference;

// max |a - b| / max |b|
double RelativeError(std::span<const float> a, const std::vector<double>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return diff / scale;
}

class ReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceTest, LogitsAtEveryPositionAndGreedyTokensMatch) {
  const std::string arch = GetParam();
  const std::string model = testing::TinyModel(arch);
  auto checkpoint = Checkpoint::Open(model);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  auto tokenizer = text::Tokenizer::FromFile(model + "/tokenizer.json");
  ASSERT_TRUE(tokenizer.ok());
  std::vector<int32_t> prompt =
      (*tokenizer)->Encode("The engine reads 42 pages; every page holds 16 tokens.", true);
  ASSERT_GE(prompt.size(), 8u);
  const int kSteps = 64;
  Reference ref = RunReference(model, prompt, kSteps);
  ASSERT_EQ(ref.logits.size(), prompt.size());
  ASSERT_EQ(ref.greedy_tokens.size(), static_cast<size_t>(kSteps));

  // Feed the prompt one token per step so every position's logits come out of the decode
  // path over the paged cache, then once more as a single prefill.
  auto backend = kernels::CreateCpuBackend({.num_threads = 2});
  ASSERT_TRUE(backend.ok());
  BlockManager blocks(64, 4);
  auto runner = ModelRunner::Create(**checkpoint, backend->get(), {256, 8, 64, 4});
  ASSERT_TRUE(runner.ok()) << runner.status();
  Sequence seq;
  seq.tokens = prompt;
  seq.num_prompt_tokens = static_cast<int>(prompt.size());
  const int vocab = (*checkpoint)->config().vocab_size;
  for (size_t pos = 0; pos < prompt.size(); ++pos) {
    ASSERT_TRUE(blocks.Append(seq.block_table, static_cast<int>(pos), 1).ok());
    SchedulerStep step;
    step.seqs.push_back({&seq, 1, true});
    step.num_tokens = 1;
    auto logits = (*runner)->Execute(step);
    ASSERT_TRUE(logits.ok());
    ASSERT_EQ(logits->size(), static_cast<size_t>(vocab));
    EXPECT_LE(RelativeError(*logits, ref.logits[pos]), 1e-4) << arch << " position " << pos;
    seq.num_computed_tokens++;
  }
  Sequence whole;
  whole.tokens = prompt;
  ASSERT_TRUE(blocks.Append(whole.block_table, 0, static_cast<int>(prompt.size())).ok());
  SchedulerStep step;
  step.seqs.push_back({&whole, static_cast<int>(prompt.size()), true});
  step.num_tokens = static_cast<int>(prompt.size());
  auto logits = (*runner)->Execute(step);
  ASSERT_TRUE(logits.ok());
  EXPECT_LE(RelativeError(*logits, ref.logits.back()), 1e-4) << arch << " prefill";

  auto engine = LlmEngine::Create({.model_dir = model, .num_threads = 2});
  ASSERT_TRUE(engine.ok()) << engine.status();
  SamplingParams greedy{.temperature = 0, .max_tokens = kSteps, .ignore_eos = true};
  auto out = GenerateAll(**engine, {{"r", prompt, greedy}});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].choices[0].token_ids, ref.greedy_tokens) << arch;
}

INSTANTIATE_TEST_SUITE_P(Architectures, ReferenceTest,
                         ::testing::Values("llama", "mistral", "qwen2", "qwen3"));

}  // namespace
}  // namespace tandem::engine
