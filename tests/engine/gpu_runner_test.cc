// The model runner on the CUDA backend against the CPU backend's fp32 path, on synthetic
// checkpoints whose head_dim (64) has CUDA attention kernels. Needs a GPU (ctest label gpu);
// without one every test skips.
//
// Both backends compute the same function here: float checkpoints run with their weights
// widened to fp32 (cuBLAS SGEMM, no TF32), quantised ones through kernels that read x in fp32.
// With 16-bit weights the CUDA backend rounds prefill activations to bf16 for the tensor cores
// (Backend::LinearRoundsX) and the CPU backend does not, so the two legitimately part ways on
// near-ties; that path is checked against Hugging Face transformers instead
// (GpuHfExport below and scripts/gpu_hf_compare.py).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tandem/engine/block_manager.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/engine/model_runner.h"
#include "tandem/kernels/backend.h"
#include "tandem/kernels/cuda_backend.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

// max |a - b| / max |b|: the logits' error relative to their scale.
double RelativeError(std::span<const float> a, std::span<const float> b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    diff = std::max(diff, std::abs(double{a[i]} - b[i]));
    scale = std::max(scale, std::abs(double{b[i]}));
  }
  return diff / scale;
}

int32_t Argmax(std::span<const float> row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

// Of the quantised kernels (dequantisation in a different order) and of fp32 (summation order).
constexpr double kMaxLogitError = 1e-2;
constexpr double kMaxLogitErrorF32 = 1e-4;
constexpr int kSteps = 32;

class GpuRunnerTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    // "arch+quant": a small weight-only quantised checkpoint (int8, awq, gptq, gptq-act-order),
    // run through the CUDA dequantising kernel.
    const std::string& param = GetParam();
    if (const size_t plus = param.find('+'); plus != std::string::npos) {
      const std::string quant = param.substr(plus + 1);
      const bool act_order = quant == "gptq-act-order";
      // The small preset: head_dim 64 (the tiny preset's 16 has no CUDA attention kernel).
      model_ = testing::TinyQuantModel(param.substr(0, plus), act_order ? "gptq" : quant,
                                       DType::kF16, act_order, /*sym=*/true, /*group_size=*/128,
                                       "small");
      return;
    }
    model_ = testing::TinyModel(param, DType::kBF16, "small");
    weight_dtype_ = DType::kF32;
  }
  double max_logit_error() const {
    return weight_dtype_ == DType::kF32 ? kMaxLogitErrorF32 : kMaxLogitError;
  }
  std::string model_;
  std::optional<DType> weight_dtype_;  // unset (the checkpoint's) for quantised checkpoints
};

// Two sequences, one prefilled in two chunks, then decoded together for kSteps greedy steps;
// a third forked from the first by copying its last block (copy-on-write) must follow it.
TEST_P(GpuRunnerTest, LogitsMatchCpuAndGreedyTokensAgree) {
  auto checkpoint = Checkpoint::Open(model_);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const text::ModelConfig& config = (*checkpoint)->config();
  auto cpu = kernels::CreateCpuBackend({});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto gpu = kernels::CreateCudaBackend({.max_seqs = 8, .max_blocks_per_seq = 64});
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const ModelRunnerOptions options{.max_num_batched_tokens = 256,
                                   .max_num_seqs = 8,
                                   .num_kv_blocks = 128,
                                   .block_size = 16,
                                   .weight_dtype = weight_dtype_};
  auto cpu_runner = ModelRunner::Create(**checkpoint, cpu->get(), options);
  ASSERT_TRUE(cpu_runner.ok()) << cpu_runner.status();
  auto gpu_runner = ModelRunner::Create(**checkpoint, gpu->get(), options);
  ASSERT_TRUE(gpu_runner.ok()) << gpu_runner.status();
  EXPECT_TRUE((*cpu_runner)->kv_cache_on_host());
  EXPECT_FALSE((*gpu_runner)->kv_cache_on_host());

  // Runs `step` on both runners; checks the logits agree and returns the CPU's greedy tokens.
  auto run = [&](const SchedulerStep& step, const std::string& what) -> std::vector<int32_t> {
    auto want = (*cpu_runner)->Execute(step);
    EXPECT_TRUE(want.ok()) << want.status();
    auto got = (*gpu_runner)->Execute(step);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!want.ok() || !got.ok()) return {};
    EXPECT_EQ(got->size(), want->size());
    std::vector<int32_t> tokens;
    const size_t vocab = config.vocab_size;
    for (size_t r = 0; r * vocab < want->size(); ++r) {
      const auto w = want->subspan(r * vocab, vocab);
      const auto g = got->subspan(r * vocab, vocab);
      EXPECT_LE(RelativeError(g, w), max_logit_error()) << what << ", row " << r;
      EXPECT_EQ(Argmax(g), Argmax(w)) << what << ", row " << r;
      tokens.push_back(Argmax(w));
    }
    return tokens;
  };

  BlockManager blocks(options.num_kv_blocks, options.block_size);
  std::vector<Sequence> seqs(3);
  for (int i = 0; i < 2; ++i) {
    for (int t = 0; t < 40 + 23 * i; ++t) seqs[i].tokens.push_back((t * 37 + i * 11 + 5) % 300);
    seqs[i].num_prompt_tokens = static_cast<int>(seqs[i].tokens.size());
  }
  // Step 1: the first 24 tokens of sequence 0 (no sample) and all of sequence 1.
  SchedulerStep first;
  ASSERT_TRUE(blocks.Append(seqs[0].block_table, 0, 24).ok());
  ASSERT_TRUE(blocks.Append(seqs[1].block_table, 0, seqs[1].num_prompt_tokens).ok());
  first.seqs = {{&seqs[0], 24, false}, {&seqs[1], seqs[1].num_prompt_tokens, true}};
  first.num_tokens = 24 + seqs[1].num_prompt_tokens;
  std::vector<int32_t> sampled = run(first, "prefill chunk 1");
  ASSERT_EQ(sampled.size(), 1u);
  seqs[0].num_computed_tokens = 24;
  seqs[1].num_computed_tokens = seqs[1].num_prompt_tokens;
  seqs[1].tokens.push_back(sampled[0]);
  // Step 2: the rest of sequence 0.
  SchedulerStep second;
  const int rest = seqs[0].num_prompt_tokens - 24;
  ASSERT_TRUE(blocks.Append(seqs[0].block_table, 24, rest).ok());
  second.seqs = {{&seqs[0], rest, true}};
  second.num_tokens = rest;
  sampled = run(second, "prefill chunk 2");
  ASSERT_EQ(sampled.size(), 1u);
  seqs[0].num_computed_tokens = seqs[0].num_prompt_tokens;
  seqs[0].tokens.push_back(sampled[0]);
  // Sequence 2 shares sequence 0's full blocks and gets a copy of its partial last block.
  seqs[2].tokens = seqs[0].tokens;
  seqs[2].num_prompt_tokens = seqs[0].num_prompt_tokens;
  seqs[2].num_computed_tokens = seqs[0].num_computed_tokens;
  seqs[2].block_table = blocks.Fork(seqs[0].block_table);

  for (int step = 0; step < kSteps; ++step) {
    SchedulerStep decode;
    for (int i = 0; i < 3; ++i) {
      Sequence& seq = seqs[i];
      const int pos = seq.num_computed_tokens;
      auto cow = blocks.Append(seq.block_table, pos, 1);
      ASSERT_TRUE(cow.ok()) << cow.status();
      if (cow->first >= 0) decode.block_copies.push_back(*cow);
      decode.seqs.push_back({&seq, 1, true});
    }
    decode.num_tokens = 3;
    if (step == 0) {
      ASSERT_EQ(decode.block_copies.size(), 1u) << "the fork's shared partial block is copied";
    }
    sampled = run(decode, "decode step " + std::to_string(step));
    ASSERT_EQ(sampled.size(), 3u);
    EXPECT_EQ(sampled[2], sampled[0]) << "the fork follows its parent, step " << step;
    for (int i = 0; i < 3; ++i) {
      seqs[i].num_computed_tokens++;
      seqs[i].tokens.push_back(sampled[i]);
    }
  }
}

// The whole engine on Device::kCuda generates the CPU engine's greedy tokens.
TEST_P(GpuRunnerTest, EngineGreedyTokensEqualCpu) {
  std::vector<std::vector<int32_t>> tokens;
  for (Device device : {Device::kCpu, Device::kCuda}) {
    auto engine = LlmEngine::Create({.model_dir = model_,
                                     .device = device,
                                     .kv_cache_bytes = 64ll << 20,
                                     .dtype = weight_dtype_,
                                     .max_num_batched_tokens = 64});
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->kv_cache_on_host(), device == Device::kCpu);
    SamplingParams greedy{.temperature = 0, .max_tokens = kSteps, .ignore_eos = true};
    std::vector<GenerateRequest> requests;
    for (int r = 0; r < 3; ++r) {
      std::vector<int32_t> prompt;
      for (int t = 0; t < 20 + 50 * r; ++t) prompt.push_back((t * 13 + r * 101 + 1) % 500);
      requests.push_back({"r" + std::to_string(r), std::move(prompt), greedy});
    }
    auto out = GenerateAll(**engine, std::move(requests));
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->size(), 3u);
    if (device == Device::kCuda) {
      // Its decode steps replayed CUDA graphs (of 1, 2 and 4 rows as requests finish).
      EXPECT_GT((*engine)->stats().graph_steps, 0);
      EXPECT_GE((*engine)->stats().graphs_captured, 1);
    }
    for (const RequestOutput& o : *out) {
      ASSERT_EQ(o.choices[0].token_ids.size(), static_cast<size_t>(kSteps));
      tokens.push_back(o.choices[0].token_ids);
    }
  }
  for (int r = 0; r < 3; ++r) EXPECT_EQ(tokens[3 + r], tokens[r]) << "request " << r;
}

// Decode steps replayed from CUDA graphs give the logits of the same steps run kernel by kernel
// on the same GPU, at every batch size of the plan (padded to 1, 2, 4 or 8 rows), with blocks
// shared after a fork; the graphs' attention splits every row's keys by the longest context a
// graph serves, so the sums' order differs from the eager step's and the logits agree to
// rounding, with the same greedy tokens.
TEST_P(GpuRunnerTest, StepGraphsGiveTheEagerLogits) {
  auto checkpoint = Checkpoint::Open(model_);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const int vocab = (*checkpoint)->config().vocab_size;
  auto eager_backend = kernels::CreateCudaBackend({.max_seqs = 8, .max_blocks_per_seq = 64});
  ASSERT_TRUE(eager_backend.ok()) << eager_backend.status();
  auto graph_backend = kernels::CreateCudaBackend({.max_seqs = 8, .max_blocks_per_seq = 64});
  ASSERT_TRUE(graph_backend.ok()) << graph_backend.status();
  ModelRunnerOptions options{.max_num_batched_tokens = 256,
                             .max_num_seqs = 8,
                             .num_kv_blocks = 128,
                             .block_size = 16,
                             .weight_dtype = weight_dtype_};
  auto eager = ModelRunner::Create(**checkpoint, eager_backend->get(), options);
  ASSERT_TRUE(eager.ok()) << eager.status();
  options.graph_batch_sizes = {1, 2, 4, 8};
  options.max_blocks_per_seq = 64;
  auto graphed = ModelRunner::Create(**checkpoint, graph_backend->get(), options);
  ASSERT_TRUE(graphed.ok()) << graphed.status();

  BlockManager blocks(options.num_kv_blocks, options.block_size);
  std::vector<Sequence> seqs(8);
  for (int i = 0; i < 6; ++i) {
    for (int t = 0; t < 9 + 31 * i; ++t) seqs[i].tokens.push_back((t * 29 + i * 7 + 1) % 400);
    seqs[i].num_prompt_tokens = static_cast<int>(seqs[i].tokens.size());
  }
  const std::vector<std::vector<int>> plan = {
      {0, 1, 2, 3, 4, 5}, {0}, {1, 2}, {0, 1, 2}, {3, 4, 5, 0, 1}, {0}, {2, 3},
      {6, 7, 0, 1, 2, 3, 4, 5}, {5}, {1, 2, 3, 4}, {7, 6}, {0, 1, 2, 3, 4, 5, 6, 7}, {4},
  };
  for (size_t p = 0; p < plan.size(); ++p) {
    SCOPED_TRACE(::testing::Message() << "step " << p);
    if (p == 7) {
      // Sequences 6 and 7 fork from 0 and 1, each getting a copy of the partial last block.
      for (int i : {6, 7}) {
        const Sequence& parent = seqs[i - 6];
        seqs[i].tokens = parent.tokens;
        seqs[i].num_prompt_tokens = parent.num_prompt_tokens;
        seqs[i].num_computed_tokens = parent.num_computed_tokens;
        seqs[i].block_table = blocks.Fork(parent.block_table);
      }
    }
    SchedulerStep step;
    for (int i : plan[p]) {
      Sequence& seq = seqs[i];
      const int n = static_cast<int>(seq.tokens.size()) - seq.num_computed_tokens;
      auto cow = blocks.Append(seq.block_table, seq.num_computed_tokens, n);
      ASSERT_TRUE(cow.ok()) << cow.status();
      if (cow->first >= 0) step.block_copies.push_back(*cow);
      step.seqs.push_back({&seq, n, true});
      step.num_tokens += n;
    }
    auto got = (*graphed)->Execute(step);
    ASSERT_TRUE(got.ok()) << got.status();
    const std::vector<float> graph_logits(got->begin(), got->end());
    auto want = (*eager)->Execute(step);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_EQ(graph_logits.size(), want->size());
    for (size_t r = 0; r < step.seqs.size(); ++r) {
      const auto w = want->subspan(r * vocab, vocab);
      const std::span<const float> g(graph_logits.data() + r * vocab, vocab);
      EXPECT_LE(RelativeError(g, w), max_logit_error()) << "row " << r;
      EXPECT_EQ(Argmax(g), Argmax(w)) << "row " << r;
      Sequence& seq = *step.seqs[r].seq;
      seq.num_computed_tokens = static_cast<int>(seq.tokens.size());
      seq.tokens.push_back(Argmax(w));
    }
  }
  EXPECT_EQ((*graphed)->graphs_captured(), 4);
  EXPECT_GE((*graphed)->graph_replays(), 6);
}

// Sampling in the CUDA backend (--sampling-device backend, the default there) draws the tokens
// that host sampling draws from the same device's logits: greedy, seeded with top-k, top-p,
// min-p and penalties, n = 2, with log-probabilities; every token of that engine drawn on the
// device.
TEST_P(GpuRunnerTest, DeviceSamplingDrawsTheHostsTokens) {
  std::vector<RequestOutput> outputs[2];
  int64_t backend_tokens = 0;
  for (int i = 0; i < 2; ++i) {
    const SamplingDevice where = i == 0 ? SamplingDevice::kHost : SamplingDevice::kBackend;
    auto engine = LlmEngine::Create({.model_dir = model_,
                                     .device = Device::kCuda,
                                     .kv_cache_bytes = 64ll << 20,
                                     .dtype = weight_dtype_,
                                     .max_num_batched_tokens = 64,
                                     .sampling_device = where});
    ASSERT_TRUE(engine.ok()) << engine.status();
    const std::vector<SamplingParams> params = {
        {.temperature = 0, .max_tokens = 16, .ignore_eos = true, .logprobs = 5},
        {.temperature = 0.8f, .top_p = 0.9f, .top_k = 40, .min_p = 0.02f,
         .repetition_penalty = 1.2f, .seed = 3, .max_tokens = 16, .ignore_eos = true,
         .n = 2, .logprobs = 2},
        {.temperature = 1.0f, .presence_penalty = 0.5f, .seed = 4, .max_tokens = 16,
         .ignore_eos = true, .logprobs = 0},
        {.temperature = 0.7f, .top_p = 0.5f, .seed = 5, .max_tokens = 16, .ignore_eos = true},
    };
    std::vector<GenerateRequest> requests;
    for (size_t r = 0; r < params.size(); ++r) {
      std::vector<int32_t> prompt;
      for (size_t t = 0; t < 10 + 30 * r; ++t) prompt.push_back((t * 17 + r * 53 + 3) % 500);
      requests.push_back({"r" + std::to_string(r), std::move(prompt), params[r]});
    }
    auto out = GenerateAll(**engine, std::move(requests));
    ASSERT_TRUE(out.ok()) << out.status();
    outputs[i] = std::move(out).value();
    if (i == 1) backend_tokens = (*engine)->stats().backend_sampled_tokens;
  }
  int64_t tokens = 0;
  ASSERT_EQ(outputs[1].size(), outputs[0].size());
  for (size_t r = 0; r < outputs[0].size(); ++r) {
    ASSERT_EQ(outputs[1][r].choices.size(), outputs[0][r].choices.size());
    for (size_t c = 0; c < outputs[0][r].choices.size(); ++c) {
      const ChoiceDelta& host = outputs[0][r].choices[c];
      const ChoiceDelta& device = outputs[1][r].choices[c];
      SCOPED_TRACE(::testing::Message() << "request " << r << " choice " << c);
      EXPECT_EQ(device.token_ids, host.token_ids);
      tokens += static_cast<int64_t>(device.token_ids.size());
      ASSERT_EQ(device.logprobs.size(), host.logprobs.size());
      for (size_t t = 0; t < host.logprobs.size(); ++t) {
        EXPECT_NEAR(device.logprobs[t], host.logprobs[t], 1e-4) << "token " << t;
      }
      ASSERT_EQ(device.top_logprobs.size(), host.top_logprobs.size());
      for (size_t t = 0; t < host.top_logprobs.size(); ++t) {
        ASSERT_EQ(device.top_logprobs[t].size(), host.top_logprobs[t].size());
        for (size_t k = 0; k < host.top_logprobs[t].size(); ++k) {
          EXPECT_EQ(device.top_logprobs[t][k].token, host.top_logprobs[t][k].token);
          EXPECT_NEAR(device.top_logprobs[t][k].logprob, host.top_logprobs[t][k].logprob, 1e-4);
        }
      }
    }
  }
  EXPECT_EQ(backend_tokens, tokens);
}

// For the comparison with Hugging Face transformers on the device (scripts/gpu_hf_compare.py,
// run by scripts/gpu-check): with TANDEM_HF_EXPORT_DIR set, writes under $DIR/<arch>/ the
// checkpoint's path, a prompt, the GPU runner's last-row logits over it with fp32 and with bf16
// weights, and the GPU engine's kHfGreedyTokens greedy tokens (fp32). Skips otherwise.
constexpr int kHfGreedyTokens = 64;

TEST(GpuHfExport, WritesLogitsAndGreedyTokens) {
  const char* root = std::getenv("TANDEM_HF_EXPORT_DIR");
  if (root == nullptr) GTEST_SKIP() << "TANDEM_HF_EXPORT_DIR not set";
  if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const std::string arch : {"llama", "qwen3"}) {
    const std::string model = testing::TinyModel(arch, DType::kF32, "small");
    const std::string dir = std::string(root) + "/" + arch;
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/model_dir") << std::filesystem::absolute(model).string();
    auto checkpoint = Checkpoint::Open(model);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    const int vocab = (*checkpoint)->config().vocab_size;
    std::vector<int32_t> prompt;
    for (int t = 0; t < 57; ++t) prompt.push_back((t * 37 + 5) % std::min(vocab, 3000));
    {
      std::ofstream out(dir + "/prompt");
      for (int32_t t : prompt) out << t << " ";
    }
    for (DType weights : {DType::kF32, DType::kBF16}) {
      auto gpu = kernels::CreateCudaBackend({.max_seqs = 1, .max_blocks_per_seq = 64});
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      auto runner = ModelRunner::Create(**checkpoint, gpu->get(),
                                        {.max_num_batched_tokens = 128,
                                         .max_num_seqs = 1,
                                         .num_kv_blocks = 16,
                                         .block_size = 16,
                                         .weight_dtype = weights,
                                         .kv_cache_dtype = weights});
      ASSERT_TRUE(runner.ok()) << runner.status();
      BlockManager blocks(16, 16);
      Sequence seq;
      seq.tokens = prompt;
      seq.num_prompt_tokens = static_cast<int>(prompt.size());
      ASSERT_TRUE(blocks.Append(seq.block_table, 0, seq.num_prompt_tokens).ok());
      SchedulerStep step;
      step.seqs = {{&seq, seq.num_prompt_tokens, true}};
      step.num_tokens = seq.num_prompt_tokens;
      auto logits = (*runner)->Execute(step);
      ASSERT_TRUE(logits.ok()) << logits.status();
      ASSERT_EQ(logits->size(), static_cast<size_t>(vocab));
      std::ofstream out(dir + "/logits_" + DTypeFlagName(weights) + ".f32", std::ios::binary);
      out.write(reinterpret_cast<const char*>(logits->data()),
                static_cast<std::streamsize>(logits->size() * sizeof(float)));
    }
    auto engine = LlmEngine::Create({.model_dir = model,
                                     .device = Device::kCuda,
                                     .kv_cache_bytes = 64ll << 20,
                                     .dtype = DType::kF32,
                                     .max_num_batched_tokens = 128});
    ASSERT_TRUE(engine.ok()) << engine.status();
    std::vector<GenerateRequest> requests;
    requests.push_back(
        {"hf", prompt, {.temperature = 0, .max_tokens = kHfGreedyTokens, .ignore_eos = true}});
    auto out = GenerateAll(**engine, std::move(requests));
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ((*out)[0].choices[0].token_ids.size(), static_cast<size_t>(kHfGreedyTokens));
    std::ofstream greedy(dir + "/greedy_float32");
    for (int32_t t : (*out)[0].choices[0].token_ids) greedy << t << " ";
  }
}

INSTANTIATE_TEST_SUITE_P(Architectures, GpuRunnerTest,
                         ::testing::Values("llama", "qwen2", "qwen3", "llama+int8", "llama+awq",
                                           "qwen3+gptq", "llama+gptq-act-order"));

}  // namespace
}  // namespace tandem::engine
