// Backend sampling through a runner whose backend memory is not host memory: the CUDA
// backend's path (rows and edits uploaded, tokens and log-probabilities copied back from
// backend memory, nothing else) on the CPU backend behind a wrapper that declares its memory
// device memory. Each step's tokens must be those the host Sampler draws from the same logits
// with the same streams. On a GPU the conformance suite's SampleRows cases check the kernels.
#include <algorithm>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "device_like_backend.h"
#include "tandem/engine/block_manager.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/model_runner.h"
#include "tandem/engine/sampler.h"
#include "tandem/kernels/backend.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

const ModelRunnerOptions kOptions{.max_num_batched_tokens = 128,
                                  .max_num_seqs = 4,
                                  .num_kv_blocks = 32,
                                  .block_size = 16,
                                  .weight_dtype = DType::kF32};

TEST(BackendSamplingTest, DeviceMemoryRunnerDrawsTheHostSamplersTokens) {
  auto checkpoint = Checkpoint::Open(testing::TinyModel("llama", DType::kF32));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const int vocab = (*checkpoint)->config().vocab_size;
  const std::vector<int32_t> eos = (*checkpoint)->config().eos_token_ids;
  auto cpu = kernels::CreateCpuBackend({.num_threads = 1});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto host_runner = ModelRunner::Create(**checkpoint, cpu->get(), kOptions);
  ASSERT_TRUE(host_runner.ok()) << host_runner.status();
  std::unique_ptr<kernels::Backend> device = testing::DeviceLike();
  ModelRunnerOptions options = kOptions;
  options.backend_sampling = true;
  auto device_runner = ModelRunner::Create(**checkpoint, device.get(), options);
  ASSERT_TRUE(device_runner.ok()) << device_runner.status();
  ASSERT_FALSE((*device_runner)->kv_cache_on_host());

  // Three samples: greedy with top log-probabilities, seeded top-k/top-p with penalties, and
  // seeded min-p with a logit bias; each runner has its own copies.
  std::vector<std::shared_ptr<const SamplingParams>> params = {
      std::make_shared<SamplingParams>(SamplingParams{.temperature = 0, .logprobs = 5}),
      std::make_shared<SamplingParams>(SamplingParams{.temperature = 0.8f,
                                                      .top_p = 0.9f,
                                                      .top_k = 20,
                                                      .repetition_penalty = 1.3f,
                                                      .frequency_penalty = 0.5f,
                                                      .logprobs = 2}),
      std::make_shared<SamplingParams>(SamplingParams{
          .temperature = 1.1f, .min_p = 0.05f, .logprobs = 0, .logit_bias = {{3, 4.0f}}}),
  };
  BlockManager host_blocks(kOptions.num_kv_blocks, kOptions.block_size);
  BlockManager device_blocks(kOptions.num_kv_blocks, kOptions.block_size);
  std::vector<Sequence> host_seqs(params.size()), device_seqs(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    for (std::vector<Sequence>* seqs : {&host_seqs, &device_seqs}) {
      Sequence& seq = (*seqs)[i];
      for (int t = 0; t < 17 + 9 * static_cast<int>(i); ++t) {
        seq.tokens.push_back((t * 31 + static_cast<int>(i) * 7 + 2) % vocab);
      }
      seq.num_prompt_tokens = static_cast<int>(seq.tokens.size());
      seq.params = params[i];
      seq.rng = SamplerRng(100 + i);
    }
  }
  Sampler host_sampler(eos), device_sampler(eos);
  std::vector<float> row(vocab);
  for (int step = 0; step < 12; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    SchedulerStep host_step, device_step;
    for (size_t i = 0; i < params.size(); ++i) {
      for (auto [seqs, blocks, plan] : {std::tuple{&host_seqs, &host_blocks, &host_step},
                                        std::tuple{&device_seqs, &device_blocks, &device_step}}) {
        Sequence& seq = (*seqs)[i];
        const int n = static_cast<int>(seq.tokens.size()) - seq.num_computed_tokens;
        ASSERT_TRUE(blocks->Append(seq.block_table, seq.num_computed_tokens, n).ok());
        plan->seqs.push_back({&seq, n, true});
        plan->num_tokens += n;
      }
    }
    // Every third step sample 1 is drawn on the host from the one row of logits that comes
    // back; the others always in the backend.
    const bool host_row = step % 3 == 1;
    std::vector<kernels::SampleRowParams> rows;
    std::vector<kernels::LogitEdit> edits;
    std::vector<int32_t> host_rows;
    for (size_t i = 0; i < params.size(); ++i) {
      if (host_row && i == 1) {
        host_rows.push_back(static_cast<int32_t>(rows.size()));
        rows.emplace_back();
      } else {
        rows.push_back(device_sampler.BackendRow(device_seqs[i], vocab, &edits));
      }
    }
    (*device_runner)->set_backend_sampling(rows, edits, host_rows);
    auto returned = (*device_runner)->Execute(device_step);
    ASSERT_TRUE(returned.ok()) << returned.status();
    ASSERT_EQ(returned->size(), host_rows.size() * vocab) << "logits of other rows copied back";
    const ModelRunner::BackendSamples drawn = (*device_runner)->backend_samples();
    ASSERT_EQ(drawn.tokens.size(), params.size());
    std::vector<float> device_row(returned->begin(), returned->end());

    auto logits = (*host_runner)->Execute(host_step);
    ASSERT_TRUE(logits.ok()) << logits.status();
    ASSERT_EQ(logits->size(), params.size() * vocab);
    for (size_t i = 0; i < params.size(); ++i) {
      Sequence& seq = host_seqs[i];
      row.assign(logits->begin() + i * vocab, logits->begin() + (i + 1) * vocab);
      if (host_row && i == 1) {
        EXPECT_EQ(device_row, row) << "the host row's logits";
        const int32_t want = host_sampler.Sample(row, seq);
        EXPECT_EQ(device_sampler.Sample(device_row, device_seqs[i]), want);
        for (std::vector<Sequence>* seqs : {&host_seqs, &device_seqs}) {
          Sequence& s = (*seqs)[i];
          s.num_computed_tokens = static_cast<int>(s.tokens.size());
          s.tokens.push_back(want);
        }
        continue;
      }
      const int32_t want = host_sampler.Sample(row, seq);
      EXPECT_EQ(drawn.tokens[i].token, want) << "sample " << i;
      EXPECT_EQ(drawn.tokens[i].logprob, seq.last_logprob) << "sample " << i;
      const int top = std::max(0, params[i]->logprobs);
      for (int k = 0; k < top; ++k) {
        const kernels::TokenLogprob& got = drawn.top[i * kernels::kMaxSampleLogprobs + k];
        EXPECT_EQ(got.token, seq.last_top_logprobs[k].token) << "sample " << i << " top " << k;
        EXPECT_EQ(got.logprob, seq.last_top_logprobs[k].logprob) << "sample " << i;
      }
      for (std::vector<Sequence>* seqs : {&host_seqs, &device_seqs}) {
        Sequence& s = (*seqs)[i];
        s.num_computed_tokens = static_cast<int>(s.tokens.size());
        s.tokens.push_back(want);
      }
    }
  }
}

}  // namespace
}  // namespace tandem::engine
