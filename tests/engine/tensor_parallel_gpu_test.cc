// Tensor parallelism on the CUDA backend: a tp=2 group on two GPUs (threads here, as processes
// would be: each rank its own Gloo communicator, which carries the step plans and bootstraps
// the NCCL group the engine joins on its backend's stream, rank r on GPU r) gives the greedy
// tokens of one CPU engine holding the whole model, with logprobs close, on synthetic
// checkpoints whose head_dim (64) has CUDA attention kernels, with fp32 weights (cuBLAS SGEMM,
// no TF32; the row-parallel sums add the partial products in another order). Needs two GPUs
// (ctest label gpu); with fewer every test skips, saying how many it found.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tandem/collective/gloo_communicator.h"
#include "tandem/collective/nccl_communicator.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/kernels/cuda_backend.h"
#include "tensor_parallel_support.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

constexpr int kSteps = 32;
constexpr int kTp = 2;
// Of fp32 on two devices against the CPU: summation order only.
constexpr double kMaxLogprobError = 1e-3;

std::vector<GenerateRequest> Requests() {
  std::vector<GenerateRequest> requests;
  for (int r = 0; r < 3; ++r) {
    std::vector<int32_t> prompt;
    for (int t = 0; t < 20 + 50 * r; ++t) prompt.push_back((t * 13 + r * 101 + 1) % 500);
    SamplingParams greedy{
        .temperature = 0, .max_tokens = kSteps, .ignore_eos = true, .logprobs = 2};
    requests.push_back({absl::StrCat("r", r), std::move(prompt), greedy});
  }
  return requests;
}

EngineOptions Options(const std::string& model, Device device) {
  // Chunks of 64 tokens, so that the longer prompts span several steps.
  return {.model_dir = model,
          .device = device,
          .num_threads = 2,
          .kv_cache_bytes = 64ll << 20,
          .dtype = DType::kF32,
          .max_num_batched_tokens = 64};
}

class TensorParallelGpuTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const int devices = kernels::CudaDeviceCount();
    if (devices < kTp) GTEST_SKIP() << "needs two CUDA devices, found " << devices;
    if (!collective::NcclBuilt()) GTEST_SKIP() << "this build has no NCCL";
  }
};

TEST_P(TensorParallelGpuTest, GivesTheTokensOfOneCpuEngine) {
  const std::string model = testing::TinyModel(GetParam(), DType::kBF16, "small");
  std::vector<RequestOutput> expected;
  {
    auto single = LlmEngine::Create(Options(model, Device::kCpu));
    ASSERT_TRUE(single.ok()) << single.status();
    auto out = GenerateAll(**single, Requests());
    ASSERT_TRUE(out.ok()) << out.status();
    expected = std::move(out).value();
  }

  testing::TempDir dir("tp_gpu_test");
  absl::Status follower_status;
  std::vector<RequestOutput> got;
  {
    std::jthread follower([&] {
      auto comm = collective::CreateGlooCommunicator(
          {.rank = 1, .size = kTp, .file_store_dir = dir.path()});
      if (!comm.ok()) {
        follower_status = comm.status();
        return;
      }
      EngineOptions options = Options(model, Device::kCuda);
      options.tensor_parallel = comm->get();
      follower_status = RunTensorParallelFollower(options);  // on GPU 1
    });
    auto comm =
        collective::CreateGlooCommunicator({.rank = 0, .size = kTp, .file_store_dir = dir.path()});
    ASSERT_TRUE(comm.ok()) << comm.status();
    EngineOptions options = Options(model, Device::kCuda);
    options.tensor_parallel = comm->get();
    auto engine = LlmEngine::Create(options);  // on GPU 0
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_FALSE((*engine)->kv_cache_on_host());
    EXPECT_EQ((*engine)->cache_layout().tp_size, kTp);
    auto out = GenerateAll(**engine, Requests());
    EXPECT_TRUE(out.ok()) << out.status();
    if (out.ok()) got = std::move(out).value();
    // The host group carried the plans; the collective stats add the NCCL group's.
    EXPECT_GT((*engine)->stats().collective_bytes,
              static_cast<int64_t>((*comm)->stats().bytes));
    engine->reset();  // releases the follower
  }
  EXPECT_TRUE(follower_status.ok()) << follower_status;

  testing::ExpectTokensOfOneEngine(expected, got, kSteps, kMaxLogprobError);
}

INSTANTIATE_TEST_SUITE_P(Archs, TensorParallelGpuTest,
                         ::testing::Values("llama", "qwen2", "qwen3"));

}  // namespace
}  // namespace tandem::engine
