// The Agent contract over the cuda_ipc backend, with device memory: between agents of one
// process and into another process (this binary re-run as a peer). Needs a GPU (ctest label
// gpu); without one every test skips.
#include <cuda_runtime.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/kvtransfer/agent.h"

extern char** environ;

namespace tandem::kvtransfer {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kLongDeadline = absl::Seconds(60);
constexpr unsigned char kPoison = 0xEE;

bool HaveDevice() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

std::vector<unsigned char> RandomBytes(size_t size, uint64_t seed) {
  std::vector<unsigned char> bytes(size);
  std::mt19937_64 rng(seed);
  for (unsigned char& b : bytes) b = static_cast<unsigned char>(rng());
  return bytes;
}

// A cudaMalloc allocation (the start of one, as cuda_ipc requires), freed on destruction.
class DeviceBytes {
 public:
  explicit DeviceBytes(size_t size) : size_(size) {
    EXPECT_EQ(cudaMalloc(&data_, size), cudaSuccess);
  }
  ~DeviceBytes() { cudaFree(data_); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;

  void* get() const { return data_; }
  size_t size() const { return size_; }
  void Set(const std::vector<unsigned char>& host) {
    ASSERT_EQ(cudaMemcpy(data_, host.data(), size_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<unsigned char> Get() const {
    std::vector<unsigned char> host(size_);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, size_, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  void* data_ = nullptr;
  size_t size_;
};

// 300 non-overlapping ranges of random size in random 4 KiB slots; `expected` gets them applied.
std::vector<Range> RandomRanges(const std::vector<unsigned char>& src,
                                std::vector<unsigned char>& expected, uint64_t seed) {
  constexpr size_t kSlot = 4096;
  std::mt19937_64 rng(seed);
  std::vector<size_t> slots(expected.size() / kSlot);
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = i;
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<Range> ranges;
  for (size_t i = 0; i < std::min<size_t>(300, slots.size()); ++i) {
    const uint64_t bytes = 1 + rng() % (kSlot - 1);
    const uint64_t dst = slots[i] * kSlot + rng() % (kSlot - bytes + 1);
    const uint64_t src_offset = rng() % (src.size() - bytes + 1);
    ranges.push_back({src_offset, dst, bytes});
    std::memcpy(expected.data() + dst, src.data() + src_offset, bytes);
  }
  return ranges;
}

class CudaIpcAgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
  }

  std::unique_ptr<Agent> NewAgent(const std::string& name) {
    absl::StatusOr<std::unique_ptr<Agent>> agent =
        Agent::Create({.backend = "cuda_ipc", .name = name});
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? std::move(agent).value() : nullptr;
  }

  // A sender with random device bytes in region 1, a receiver with poisoned device bytes in
  // region 2, connected.
  void SetUpPair(size_t src_bytes, size_t dst_bytes) {
    sender_ = NewAgent("sender");
    receiver_ = NewAgent("receiver");
    ASSERT_NE(sender_, nullptr);
    ASSERT_NE(receiver_, nullptr);
    src_host_ = RandomBytes(src_bytes, src_bytes);
    src_ = std::make_unique<DeviceBytes>(src_bytes);
    src_->Set(src_host_);
    dst_ = std::make_unique<DeviceBytes>(dst_bytes);
    dst_->Set(std::vector<unsigned char>(dst_bytes, kPoison));
    ASSERT_TRUE(sender_->RegisterMemory(1, src_->get(), src_bytes).ok());
    absl::StatusOr<std::string> descriptor = receiver_->RegisterMemory(2, dst_->get(), dst_bytes);
    ASSERT_TRUE(descriptor.ok()) << descriptor.status();
    descriptor_ = *descriptor;
    absl::StatusOr<PeerId> peer =
        sender_->Connect(receiver_->address(), absl::Now() + kLongDeadline);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  absl::Status Push(std::vector<Range> ranges, absl::Duration timeout = kLongDeadline) {
    auto handle = sender_->Submit(peer_, 1, descriptor_, std::move(ranges), absl::Now() + timeout);
    if (!handle.ok()) return handle.status();
    return (*handle)->Wait();
  }

  bool DestinationUntouched() {
    const std::vector<unsigned char> now = dst_->Get();
    return std::all_of(now.begin(), now.end(), [](unsigned char b) { return b == kPoison; });
  }

  std::unique_ptr<Agent> sender_, receiver_;
  std::vector<unsigned char> src_host_;
  std::unique_ptr<DeviceBytes> src_, dst_;
  std::string descriptor_;
  PeerId peer_ = 0;
};

TEST_F(CudaIpcAgentTest, RandomRangesArriveExactlyAndNothingElseIsWritten) {
  SetUpPair(8 << 20, 4 << 20);
  std::vector<unsigned char> expected(dst_->size(), kPoison);
  std::vector<Range> ranges = RandomRanges(src_host_, expected, 42);
  ASSERT_TRUE(Push(ranges).ok());
  EXPECT_TRUE(dst_->Get() == expected);
}

TEST_F(CudaIpcAgentTest, RangesOutsideEitherRegionAreRefusedAndNothingIsWritten) {
  SetUpPair(1 << 20, 1 << 20);
  for (const Range& bad : {Range{(1 << 20) - 10, 0, 11}, Range{0, (1 << 20) - 10, 11},
                           Range{0, ~uint64_t{0} - 4, 8}}) {
    const absl::Status status = Push({{0, 0, 64}, bad});
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  }
  EXPECT_TRUE(DestinationUntouched());
}

TEST_F(CudaIpcAgentTest, GarbledOrForeignDescriptorIsRefused) {
  SetUpPair(1 << 16, 1 << 16);
  std::string garbled = descriptor_;
  garbled[garbled.size() / 2] ^= 0x10;
  auto handle = sender_->Submit(peer_, 1, garbled, {{0, 0, 16}}, absl::Now() + kLongDeadline);
  EXPECT_TRUE(absl::IsInvalidArgument(handle.status())) << handle.status();
  // A third agent's descriptor, sent to the receiver: bound to its owner, refused.
  std::unique_ptr<Agent> third = NewAgent("third");
  DeviceBytes other(1 << 16);
  absl::StatusOr<std::string> foreign = third->RegisterMemory(9, other.get(), other.size());
  ASSERT_TRUE(foreign.ok()) << foreign.status();
  handle = sender_->Submit(peer_, 1, *foreign, {{0, 0, 16}}, absl::Now() + kLongDeadline);
  EXPECT_TRUE(absl::IsInvalidArgument(handle.status())) << handle.status();
  // Another backend's descriptor.
  auto local = Agent::Create({.backend = "local", .name = "host"});
  ASSERT_TRUE(local.ok());
  std::vector<unsigned char> host(64);
  absl::StatusOr<std::string> host_descriptor = (*local)->RegisterMemory(1, host.data(), 64);
  ASSERT_TRUE(host_descriptor.ok());
  handle = sender_->Submit(peer_, 1, *host_descriptor, {{0, 0, 16}}, absl::Now() + kLongDeadline);
  EXPECT_TRUE(absl::IsInvalidArgument(handle.status())) << handle.status();
  EXPECT_TRUE(DestinationUntouched());
}

TEST_F(CudaIpcAgentTest, HostMemoryHereAndDeviceMemoryOnHostBackendsAreRefused) {
  std::unique_ptr<Agent> agent = NewAgent("a");
  std::vector<unsigned char> host(4096);
  absl::StatusOr<std::string> d = agent->RegisterMemory(1, host.data(), host.size());
  EXPECT_TRUE(absl::IsInvalidArgument(d.status())) << d.status();
  DeviceBytes device(4096);
  for (const char* backend : {"local", "ucx"}) {
    auto other = Agent::Create({.backend = backend, .name = "host"});
    ASSERT_TRUE(other.ok()) << other.status();
    d = (*other)->RegisterMemory(1, device.get(), device.size());
    EXPECT_TRUE(absl::IsInvalidArgument(d.status())) << backend << ": " << d.status();
    EXPECT_THAT(d.status().message(), HasSubstr("need a host KV cache")) << backend;
  }
}

TEST_F(CudaIpcAgentTest, UnknownRegionOrPeerIsNotFoundAndDeregisteredRegionIsNotSent) {
  SetUpPair(1 << 16, 1 << 16);
  auto handle = sender_->Submit(peer_ + 100, 1, descriptor_, {{0, 0, 8}}, absl::Now() + kLongDeadline);
  EXPECT_TRUE(absl::IsNotFound(handle.status())) << handle.status();
  handle = sender_->Submit(peer_, 77, descriptor_, {{0, 0, 8}}, absl::Now() + kLongDeadline);
  EXPECT_TRUE(absl::IsNotFound(handle.status())) << handle.status();
  ASSERT_TRUE(Push({{0, 0, 8}}).ok());
  ASSERT_TRUE(sender_->DeregisterMemory(1).ok());
  EXPECT_TRUE(absl::IsNotFound(Push({{0, 0, 8}})));
  EXPECT_TRUE(absl::IsNotFound(sender_->DeregisterMemory(1)));
}

TEST_F(CudaIpcAgentTest, ConnectToAGoneOrRestartedAgentIsUnavailable) {
  std::unique_ptr<Agent> a = NewAgent("a");
  std::string address;
  {
    std::unique_ptr<Agent> gone = NewAgent("gone");
    address = gone->address();
  }
  EXPECT_TRUE(absl::IsUnavailable(a->Connect(address, absl::Now() + kLongDeadline).status()));
  std::unique_ptr<Agent> b = NewAgent("b");
  const std::string restarted = b->address().substr(0, b->address().rfind('#') + 1) +
                                "0123456789abcdef";
  EXPECT_TRUE(absl::IsUnavailable(a->Connect(restarted, absl::Now() + kLongDeadline).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(a->Connect("ucx:1.2.3.4:5", absl::Now() + kLongDeadline)
                                          .status()));
  EXPECT_TRUE(absl::IsDeadlineExceeded(
      a->Connect(b->address(), absl::Now() - absl::Seconds(1)).status()));
}

TEST_F(CudaIpcAgentTest, PeerDestroyedAfterConnectIsUnavailable) {
  SetUpPair(1 << 16, 1 << 16);
  receiver_.reset();
  // The hang-up reaches the sender's socket asynchronously; poll for it (60 s: a hang bound).
  absl::Status status;
  for (const absl::Time until = absl::Now() + absl::Seconds(60); absl::Now() < until;) {
    status = Push({{0, 0, 8}});
    if (absl::IsUnavailable(status)) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
}

TEST_F(CudaIpcAgentTest, PassedDeadlineAndDisconnectAreReportedAndTheAgentStillWorks) {
  SetUpPair(1 << 16, 1 << 16);
  EXPECT_TRUE(absl::IsDeadlineExceeded(Push({{0, 0, 8}}, -absl::Seconds(1))));
  ASSERT_TRUE(sender_->Disconnect(peer_).ok());
  EXPECT_TRUE(absl::IsNotFound(Push({{0, 0, 8}})));
  EXPECT_TRUE(absl::IsNotFound(sender_->Disconnect(peer_)));
  auto again = sender_->Connect(receiver_->address(), absl::Now() + kLongDeadline);
  ASSERT_TRUE(again.ok()) << again.status();
  peer_ = *again;
  EXPECT_TRUE(Push({{0, 0, 4096}}).ok());
}

TEST_F(CudaIpcAgentTest, HandleOutlivingItsAgentReportsAFinalStatus) {
  SetUpPair(64 << 20, 64 << 20);
  auto handle =
      sender_->Submit(peer_, 1, descriptor_, {{0, 0, 64 << 20}}, absl::Now() + kLongDeadline);
  ASSERT_TRUE(handle.ok()) << handle.status();
  sender_.reset();
  const absl::Status status = (*handle)->Wait();
  EXPECT_TRUE(status.ok() || absl::IsCancelled(status)) << status;
  EXPECT_EQ((*handle)->Wait(), status) << "the final status is sticky";
}

// --- Another process ------------------------------------------------------------------------
// The peer: registers poisoned device memory, prints "ADDRESS DESCRIPTOR_HEX", and on each
// line "check" from stdin prints the hex of its region's bytes' FNV-1a hash; exits at EOF.

uint64_t Fnv1a(const std::vector<unsigned char>& bytes) {
  uint64_t hash = 14695981039346656037ull;
  for (unsigned char b : bytes) hash = (hash ^ b) * 1099511628211ull;
  return hash;
}

constexpr size_t kPeerBytes = 4 << 20;

TEST(CudaIpcPeerProcess, Serve) {
  if (std::getenv("TANDEM_CUDA_IPC_PEER") == nullptr) GTEST_SKIP() << "run by the tests below";
  auto agent = Agent::Create({.backend = "cuda_ipc", .name = "peer"});
  ASSERT_TRUE(agent.ok()) << agent.status();
  DeviceBytes region(kPeerBytes);
  region.Set(std::vector<unsigned char>(kPeerBytes, kPoison));
  auto descriptor = (*agent)->RegisterMemory(2, region.get(), region.size());
  ASSERT_TRUE(descriptor.ok()) << descriptor.status();
  std::printf("%s %s\n", (*agent)->address().c_str(), absl::BytesToHexString(*descriptor).c_str());
  std::fflush(stdout);
  char line[64];
  while (std::fgets(line, sizeof(line), stdin) != nullptr) {
    std::printf("%016llx\n", static_cast<unsigned long long>(Fnv1a(region.Get())));
    std::fflush(stdout);
  }
}

class CudaIpcTwoProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveDevice()) GTEST_SKIP() << "no CUDA device";
    int to_child[2], from_child[2];
    ASSERT_EQ(pipe(to_child), 0);
    ASSERT_EQ(pipe(from_child), 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    posix_spawn_file_actions_addclose(&actions, to_child[1]);
    posix_spawn_file_actions_addclose(&actions, from_child[0]);
    std::vector<std::string> env_strings = {"TANDEM_CUDA_IPC_PEER=1"};
    for (char** e = environ; *e != nullptr; ++e) env_strings.push_back(*e);
    std::vector<char*> env;
    for (std::string& e : env_strings) env.push_back(e.data());
    env.push_back(nullptr);
    std::string self = "/proc/self/exe", filter = "--gtest_filter=CudaIpcPeerProcess.Serve";
    char* argv[] = {self.data(), filter.data(), nullptr};
    ASSERT_EQ(posix_spawn(&child_, self.c_str(), &actions, nullptr, argv, env.data()), 0);
    posix_spawn_file_actions_destroy(&actions);
    close(to_child[0]);
    close(from_child[1]);
    to_child_ = fdopen(to_child[1], "w");
    from_child_ = fdopen(from_child[0], "r");
    // gtest's own lines come first; ours starts with "cuda_ipc:".
    std::string first;
    for (char buf[8192]; std::fgets(buf, sizeof(buf), from_child_) != nullptr;) {
      if (std::strncmp(buf, "cuda_ipc:", 9) == 0) {
        first = buf;
        break;
      }
    }
    std::vector<std::string> parts = absl::StrSplit(absl::StripTrailingAsciiWhitespace(first), ' ');
    ASSERT_EQ(parts.size(), 2u) << "peer said: " << first;
    address_ = parts[0];
    descriptor_ = absl::HexStringToBytes(parts[1]);
    sender_ = std::move(Agent::Create({.backend = "cuda_ipc", .name = "sender"})).value();
    src_host_ = RandomBytes(kPeerBytes, 5);
    src_ = std::make_unique<DeviceBytes>(kPeerBytes);
    src_->Set(src_host_);
    ASSERT_TRUE(sender_->RegisterMemory(1, src_->get(), src_->size()).ok());
  }

  void TearDown() override {
    if (to_child_ != nullptr) std::fclose(to_child_);
    if (from_child_ != nullptr) std::fclose(from_child_);
    if (child_ > 0) {
      kill(child_, SIGKILL);
      waitpid(child_, nullptr, 0);
    }
  }

  uint64_t PeerHash() {
    std::fputs("check\n", to_child_);
    std::fflush(to_child_);
    char buf[8192];
    while (std::fgets(buf, sizeof(buf), from_child_) != nullptr) {
      if (std::strlen(buf) == 17) return std::strtoull(buf, nullptr, 16);
    }
    ADD_FAILURE() << "the peer process said nothing";
    return 0;
  }

  pid_t child_ = 0;
  FILE* to_child_ = nullptr;
  FILE* from_child_ = nullptr;
  std::string address_, descriptor_;
  std::unique_ptr<Agent> sender_;
  std::vector<unsigned char> src_host_;
  std::unique_ptr<DeviceBytes> src_;
};

TEST_F(CudaIpcTwoProcessTest, TransferIntoAnotherProcessIsVerifiedByThatProcess) {
  auto peer = sender_->Connect(address_, absl::Now() + kLongDeadline);
  ASSERT_TRUE(peer.ok()) << peer.status();
  std::vector<unsigned char> expected(kPeerBytes, kPoison);
  for (uint64_t seed : {1, 2}) {  // the second reuses the opened handle
    std::vector<Range> ranges = RandomRanges(src_host_, expected, seed);
    auto handle = sender_->Submit(*peer, 1, descriptor_, ranges, absl::Now() + kLongDeadline);
    ASSERT_TRUE(handle.ok()) << handle.status();
    ASSERT_TRUE((*handle)->Wait().ok());
    EXPECT_EQ(PeerHash(), Fnv1a(expected)) << "seed " << seed;
  }
}

TEST_F(CudaIpcTwoProcessTest, PeerKilledAfterConnectIsUnavailable) {
  auto peer = sender_->Connect(address_, absl::Now() + kLongDeadline);
  ASSERT_TRUE(peer.ok()) << peer.status();
  kill(child_, SIGKILL);
  waitpid(child_, nullptr, 0);
  child_ = 0;
  auto handle = sender_->Submit(*peer, 1, descriptor_, {{0, 0, 4096}}, absl::Now() + kLongDeadline);
  const absl::Status status = handle.ok() ? (*handle)->Wait() : handle.status();
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
}

}  // namespace
}  // namespace tandem::kvtransfer
