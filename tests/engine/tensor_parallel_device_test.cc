// Tensor parallelism on a backend whose memory is not host memory, on the CPU: the runner's
// path for the CUDA backend (a device communicator carrying the activations, the host one the
// step plans; the step's ints uploaded, the gathered logits reordered by strided copies in
// backend memory and copied back) runs here on the CPU backend behind a test wrapper that
// declares its memory device memory (so the runner reaches it only through the Copy* methods),
// with a second Gloo group standing in for NCCL. A tp=2 group gives the logits of one runner
// holding the whole model; a group without a device communicator is refused.
// tensor_parallel_gpu_test runs the same on two GPUs over NCCL.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tandem/collective/gloo_communicator.h"
#include "tandem/engine/block_manager.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/model_runner.h"
#include "device_like_backend.h"
#include "tandem/kernels/backend.h"
#include "tensor_parallel_support.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

using testing::DeviceLike;

// max |a - b| / max |b|.
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

constexpr int kTp = 2;
constexpr int kSteps = 16;

const ModelRunnerOptions kOptions{.max_num_batched_tokens = 64,
                                  .max_num_seqs = 4,
                                  .num_kv_blocks = 32,
                                  .block_size = 16,
                                  .weight_dtype = DType::kF32};

// Two sequences prefilled (the first in two chunks), then decoded together greedily; every
// step's logits from the group's leader against one runner's.
TEST(TensorParallelDeviceTest, DeviceCommunicatorGivesOneRunnersLogits) {
  for (const std::string arch : {"llama", "qwen2"}) {
    SCOPED_TRACE(arch);
    const std::string model = testing::TinyModel(arch, DType::kF32);
    auto checkpoint = Checkpoint::Open(model);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    const int vocab = (*checkpoint)->config().vocab_size;
    auto cpu = kernels::CreateCpuBackend({.num_threads = 1});
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto single = ModelRunner::Create(**checkpoint, cpu->get(), kOptions);
    ASSERT_TRUE(single.ok()) << single.status();

    testing::TempDir host_dir("tp_device_test"), device_dir("tp_device_test");
    absl::Status follower_status;
    uint64_t follower_device_calls = 0;
    std::jthread follower([&] {
      auto host = collective::CreateGlooCommunicator(
          {.rank = 1, .size = kTp, .file_store_dir = host_dir.path()});
      auto device = collective::CreateGlooCommunicator(
          {.rank = 1, .size = kTp, .file_store_dir = device_dir.path()});
      if (!host.ok() || !device.ok()) {
        follower_status = host.ok() ? device.status() : host.status();
        return;
      }
      auto ckpt = Checkpoint::Open(model);
      if (!ckpt.ok()) {
        follower_status = ckpt.status();
        return;
      }
      std::unique_ptr<kernels::Backend> backend = DeviceLike();
      auto runner = ModelRunner::Create(
          **ckpt, backend.get(),
          {.tensor_parallel = host->get(), .device_collective = device->get()});
      if (!runner.ok()) {
        follower_status = runner.status();
        return;
      }
      follower_status = (*runner)->RunFollower();
      follower_device_calls = (*device)->stats().calls;
    });

    auto host = collective::CreateGlooCommunicator(
        {.rank = 0, .size = kTp, .file_store_dir = host_dir.path()});
    ASSERT_TRUE(host.ok()) << host.status();
    auto device = collective::CreateGlooCommunicator(
        {.rank = 0, .size = kTp, .file_store_dir = device_dir.path()});
    ASSERT_TRUE(device.ok()) << device.status();
    std::unique_ptr<kernels::Backend> backend = DeviceLike();
    ModelRunnerOptions options = kOptions;
    options.tensor_parallel = host->get();
    options.device_collective = device->get();
    auto leader = ModelRunner::Create(**checkpoint, backend.get(), options);
    ASSERT_TRUE(leader.ok()) << leader.status();
    EXPECT_FALSE((*leader)->kv_cache_on_host());
    EXPECT_EQ((*leader)->shard().size, kTp);

    // Runs `step` on both; checks the logits agree and returns the single runner's argmaxes.
    auto run = [&](const SchedulerStep& step, const std::string& what) {
      std::vector<int32_t> tokens;
      auto want = (*single)->Execute(step);
      EXPECT_TRUE(want.ok()) << want.status();
      if (!want.ok()) return tokens;
      // Copied: the leader's span is its own, but keep both while comparing.
      const std::vector<float> expected(want->begin(), want->end());
      auto got = (*leader)->Execute(step);
      EXPECT_TRUE(got.ok()) << got.status();
      if (!got.ok()) return tokens;
      EXPECT_EQ(got->size(), expected.size()) << what;
      if (got->size() != expected.size()) return tokens;
      for (size_t r = 0; r * vocab < expected.size(); ++r) {
        const std::span<const float> w(expected.data() + r * vocab, vocab);
        const auto g = got->subspan(r * vocab, vocab);
        EXPECT_LE(RelativeError(g, w), 1e-4) << what << ", row " << r;
        EXPECT_EQ(Argmax(g), Argmax(w)) << what << ", row " << r;
        tokens.push_back(Argmax(w));
      }
      return tokens;
    };

    BlockManager blocks(kOptions.num_kv_blocks, kOptions.block_size);
    std::vector<Sequence> seqs(2);
    for (int i = 0; i < 2; ++i) {
      for (int t = 0; t < 30 + 9 * i; ++t) seqs[i].tokens.push_back((t * 37 + i * 11 + 5) % vocab);
      seqs[i].num_prompt_tokens = static_cast<int>(seqs[i].tokens.size());
    }
    SchedulerStep first;
    ASSERT_TRUE(blocks.Append(seqs[0].block_table, 0, 20).ok());
    ASSERT_TRUE(blocks.Append(seqs[1].block_table, 0, seqs[1].num_prompt_tokens).ok());
    first.seqs = {{&seqs[0], 20, false}, {&seqs[1], seqs[1].num_prompt_tokens, true}};
    first.num_tokens = 20 + seqs[1].num_prompt_tokens;
    std::vector<int32_t> sampled = run(first, "prefill chunk 1");
    ASSERT_EQ(sampled.size(), 1u);
    seqs[0].num_computed_tokens = 20;
    seqs[1].num_computed_tokens = seqs[1].num_prompt_tokens;
    seqs[1].tokens.push_back(sampled[0]);
    SchedulerStep second;
    const int rest = seqs[0].num_prompt_tokens - 20;
    ASSERT_TRUE(blocks.Append(seqs[0].block_table, 20, rest).ok());
    second.seqs = {{&seqs[0], rest, true}};
    second.num_tokens = rest;
    sampled = run(second, "prefill chunk 2");
    ASSERT_EQ(sampled.size(), 1u);
    seqs[0].num_computed_tokens = seqs[0].num_prompt_tokens;
    seqs[0].tokens.push_back(sampled[0]);
    for (int step = 0; step < kSteps; ++step) {
      SchedulerStep decode;
      for (Sequence& seq : seqs) {
        auto cow = blocks.Append(seq.block_table, seq.num_computed_tokens, 1);
        ASSERT_TRUE(cow.ok()) << cow.status();
        decode.seqs.push_back({&seq, 1, true});
      }
      decode.num_tokens = 2;
      sampled = run(decode, "decode step " + std::to_string(step));
      ASSERT_EQ(sampled.size(), 2u);
      for (int i = 0; i < 2; ++i) {
        seqs[i].num_computed_tokens++;
        seqs[i].tokens.push_back(sampled[i]);
      }
    }
    // The activations went over the device communicator.
    EXPECT_GT((*device)->stats().calls, 0u);
    leader->reset();  // releases the follower
    follower.join();
    EXPECT_TRUE(follower_status.ok()) << follower_status;
    EXPECT_EQ(follower_device_calls, (*device)->stats().calls);
  }
}

// Without a device communicator a backend of device memory is refused on every rank, before any
// collective, saying what it needs.
TEST(TensorParallelDeviceTest, DeviceBackendWithoutDeviceCommunicatorIsRefused) {
  const std::string model = testing::TinyModel("llama", DType::kF32);
  testing::TempDir dir("tp_device_test");
  std::vector<absl::Status> status(kTp);
  {
    std::vector<std::jthread> ranks;
    for (int rank = 0; rank < kTp; ++rank) {
      ranks.emplace_back([&, rank] {
        auto host = collective::CreateGlooCommunicator(
            {.rank = rank, .size = kTp, .file_store_dir = dir.path()});
        auto ckpt = Checkpoint::Open(model);
        if (!host.ok() || !ckpt.ok()) {
          status[rank] = host.ok() ? ckpt.status() : host.status();
          return;
        }
        std::unique_ptr<kernels::Backend> backend = DeviceLike();
        ModelRunnerOptions options = kOptions;
        options.tensor_parallel = host->get();
        status[rank] = ModelRunner::Create(**ckpt, backend.get(), options).status();
      });
    }
  }
  for (int rank = 0; rank < kTp; ++rank) {
    EXPECT_EQ(status[rank].code(), absl::StatusCode::kFailedPrecondition)
        << "rank " << rank << ": " << status[rank];
    EXPECT_NE(status[rank].message().find("needs a device communicator (NCCL)"),
              std::string::npos)
        << status[rank];
  }
}

// A device communicator whose ranks are not the group's is refused on every rank.
TEST(TensorParallelDeviceTest, DeviceCommunicatorOfOtherRanksIsRefused) {
  const std::string model = testing::TinyModel("llama", DType::kF32);
  testing::TempDir dir("tp_device_test"), device_dir("tp_device_test");
  std::vector<absl::Status> status(kTp);
  {
    std::vector<std::jthread> ranks;
    for (int rank = 0; rank < kTp; ++rank) {
      ranks.emplace_back([&, rank] {
        auto host = collective::CreateGlooCommunicator(
            {.rank = rank, .size = kTp, .file_store_dir = dir.path()});
        // The device group numbers the ranks the other way round.
        auto device = collective::CreateGlooCommunicator(
            {.rank = kTp - 1 - rank, .size = kTp, .file_store_dir = device_dir.path()});
        auto ckpt = Checkpoint::Open(model);
        if (!host.ok() || !device.ok() || !ckpt.ok()) {
          status[rank] = absl::InternalError("setup failed");
          return;
        }
        std::unique_ptr<kernels::Backend> backend = DeviceLike();
        ModelRunnerOptions options = kOptions;
        options.tensor_parallel = host->get();
        options.device_collective = device->get();
        status[rank] = ModelRunner::Create(**ckpt, backend.get(), options).status();
      });
    }
  }
  for (int rank = 0; rank < kTp; ++rank) {
    EXPECT_EQ(status[rank].code(), absl::StatusCode::kInvalidArgument)
        << "rank " << rank << ": " << status[rank];
  }
}

}  // namespace
}  // namespace tandem::engine
