// The nccl backend on real devices (ctest label gpu). With one GPU: device memory only, and two
// agents on the same device get NCCL's refusal from Connect instead of a hang. With two or
// more: ranges pushed from device 0 into device 1 land exactly, one at a time and many in
// flight. Without a device every test skips.
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/kvtransfer/agent.h"

namespace tandem::kvtransfer {
namespace {

using ::testing::HasSubstr;

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

std::unique_ptr<Agent> AgentOn(int device, const std::string& name) {
  EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Create({.backend = "nccl", .name = name});
  EXPECT_TRUE(agent.ok()) << agent.status();
  return agent.ok() ? std::move(*agent) : nullptr;
}

struct DeviceBuffer {
  DeviceBuffer(int device, size_t bytes) : device(device), bytes(bytes) {
    cudaSetDevice(device);
    EXPECT_EQ(cudaMalloc(&data, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemset(data, 0, bytes), cudaSuccess);
  }
  ~DeviceBuffer() {
    cudaSetDevice(device);
    cudaFree(data);
  }
  std::vector<uint8_t> Read() const {
    std::vector<uint8_t> out(bytes);
    cudaSetDevice(device);
    EXPECT_EQ(cudaMemcpy(out.data(), data, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }
  int device;
  size_t bytes;
  void* data = nullptr;
};

TEST(NcclLinkTest, RegistersDeviceMemoryOnly) {
  if (DeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  std::unique_ptr<Agent> agent = AgentOn(0, "a");
  ASSERT_NE(agent, nullptr);
  std::vector<uint8_t> host(4096);
  absl::StatusOr<std::string> d = agent->RegisterMemory(1, host.data(), host.size());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(d.status().message(), HasSubstr("device memory only"));
  DeviceBuffer device(0, 4096);
  EXPECT_TRUE(agent->RegisterMemory(1, device.data, device.bytes).ok());
}

TEST(NcclLinkTest, TwoAgentsOnOneDeviceGetNcclsRefusalFromConnect) {
  if (DeviceCount() < 1) GTEST_SKIP() << "no CUDA device";
  if (DeviceCount() >= 2) GTEST_SKIP() << "covered by the two-device tests";
  std::unique_ptr<Agent> a = AgentOn(0, "a");
  std::unique_ptr<Agent> b = AgentOn(0, "b");
  ASSERT_TRUE(a != nullptr && b != nullptr);
  const absl::Time start = absl::Now();
  absl::StatusOr<PeerId> peer = a->Connect(b->address(), absl::Now() + absl::Seconds(60));
  ASSERT_FALSE(peer.ok());
  EXPECT_THAT(peer.status().message(), HasSubstr("ncclCommInitRankConfig"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(55)) << "waited out instead of refused";
}

TEST(NcclLinkTest, RangesPushedBetweenTwoDevicesLandExactly) {
  if (DeviceCount() < 2) GTEST_SKIP() << "needs two CUDA devices";
  std::unique_ptr<Agent> sender = AgentOn(0, "prefill");
  std::unique_ptr<Agent> receiver = AgentOn(1, "decode");
  ASSERT_TRUE(sender != nullptr && receiver != nullptr);
  constexpr size_t kBytes = size_t{8} << 20;
  DeviceBuffer src(0, kBytes), dst(1, kBytes);
  std::vector<uint8_t> pattern(kBytes);
  std::iota(pattern.begin(), pattern.end(), 3);
  cudaSetDevice(0);
  ASSERT_EQ(cudaMemcpy(src.data, pattern.data(), kBytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE(sender->RegisterMemory(1, src.data, kBytes).ok());
  absl::StatusOr<std::string> d = receiver->RegisterMemory(2, dst.data, kBytes);
  ASSERT_TRUE(d.ok()) << d.status();
  absl::StatusOr<PeerId> peer =
      sender->Connect(receiver->address(), absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(peer.ok()) << peer.status();

  // One transfer of scattered ranges, then 32 in flight at once.
  absl::StatusOr<std::unique_ptr<TransferHandle>> h =
      sender->Submit(*peer, 1, *d,
                     {{.src_offset = 0, .dst_offset = 4096, .bytes = 1 << 20},
                      {.src_offset = 5 << 20, .dst_offset = 2 << 20, .bytes = 12345}},
                     absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE((*h)->Wait().ok());
  std::vector<uint8_t> got = dst.Read();
  EXPECT_TRUE(std::equal(pattern.begin(), pattern.begin() + (1 << 20), got.begin() + 4096));
  EXPECT_TRUE(std::equal(pattern.begin() + (5 << 20), pattern.begin() + (5 << 20) + 12345,
                         got.begin() + (2 << 20)));
  EXPECT_EQ(got[4095], 0);

  std::vector<std::unique_ptr<TransferHandle>> many;
  for (uint64_t i = 0; i < 32; ++i) {
    h = sender->Submit(
        *peer, 1, *d,
        {{.src_offset = i * 100003, .dst_offset = (4 << 20) + i * 65536, .bytes = 65536}},
        absl::Now() + absl::Seconds(60));
    ASSERT_TRUE(h.ok()) << h.status();
    many.push_back(std::move(*h));
  }
  for (auto& t : many) ASSERT_TRUE(t->Wait().ok());
  got = dst.Read();
  for (uint64_t i = 0; i < 32; ++i) {
    EXPECT_TRUE(std::equal(pattern.begin() + i * 100003, pattern.begin() + i * 100003 + 65536,
                           got.begin() + (4 << 20) + i * 65536))
        << "transfer " << i;
  }
}

}  // namespace
}  // namespace tandem::kvtransfer
