// Needs two GPUs (ctest label gpu); with fewer every case skips, saying so.
#include "tandem/collective/nccl_communicator.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tandem/collective/gloo_communicator.h"

namespace tandem::collective {
namespace {

int DeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

TEST(NcclCommunicatorTest, TwoGpusAllReduceGatherAndBroadcast) {
  if (DeviceCount() < 2) GTEST_SKIP() << "needs two CUDA devices, found " << DeviceCount();
  std::string dir = (std::filesystem::temp_directory_path() / "nccl_test_XXXXXX").string();
  ASSERT_NE(::mkdtemp(dir.data()), nullptr);
  constexpr int kSize = 2;
  constexpr size_t kCount = 1 << 20;
  std::vector<std::jthread> ranks;
  for (int rank = 0; rank < kSize; ++rank) {
    ranks.emplace_back([&, rank] {
      auto gloo = CreateGlooCommunicator({.rank = rank, .size = kSize, .file_store_dir = dir});
      ASSERT_TRUE(gloo.ok()) << gloo.status();
      auto nccl = CreateNcclCommunicator(**gloo, {.device = rank});
      ASSERT_TRUE(nccl.ok()) << nccl.status();
      Communicator& comm = **nccl;
      ASSERT_EQ(cudaSetDevice(rank), cudaSuccess);
      std::vector<float> host(kCount);
      for (size_t i = 0; i < kCount; ++i) host[i] = static_cast<float>((rank + 1) * (i % 13));
      float* d = nullptr;
      float* gathered = nullptr;
      ASSERT_EQ(cudaMalloc(&d, kCount * sizeof(float)), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&gathered, kSize * kCount * sizeof(float)), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(d, host.data(), kCount * sizeof(float), cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_TRUE(comm.AllGather(d, gathered, kCount * sizeof(float)).ok());
      ASSERT_TRUE(comm.AllReduceSum(d, kCount).ok());
      ASSERT_EQ(cudaMemcpy(host.data(), d, kCount * sizeof(float), cudaMemcpyDeviceToHost),
                cudaSuccess);
      for (size_t i = 0; i < kCount; i += 4099) EXPECT_EQ(host[i], 3.0f * (i % 13));
      std::vector<float> all(kSize * kCount);
      ASSERT_EQ(
          cudaMemcpy(all.data(), gathered, all.size() * sizeof(float), cudaMemcpyDeviceToHost),
          cudaSuccess);
      EXPECT_EQ(all[kCount + 5], 2.0f * 5);
      EXPECT_EQ(all[5], 5.0f);
      int32_t* word = nullptr;
      ASSERT_EQ(cudaMalloc(&word, sizeof(int32_t)), cudaSuccess);
      int32_t value = rank == 1 ? 42 : 0;
      ASSERT_EQ(cudaMemcpy(word, &value, sizeof(value), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_TRUE(comm.Broadcast(word, sizeof(int32_t), 1).ok());
      ASSERT_EQ(cudaMemcpy(&value, word, sizeof(value), cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(value, 42);
      EXPECT_TRUE(comm.Barrier().ok());
      cudaFree(word);
      cudaFree(gathered);
      cudaFree(d);
    });
  }
  ranks.clear();
  std::filesystem::remove_all(dir);
}

TEST(NcclCommunicatorTest, IsBuilt) { EXPECT_TRUE(NcclBuilt()); }

}  // namespace
}  // namespace tandem::collective
