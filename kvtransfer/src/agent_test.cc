// Fault-injection tests of the Agent contract, run against every backend, plus tests that put a
// UCX peer in another process (tandem_kvtransfer_peer) so it can be stopped and killed.
#include "tandem/kvtransfer/agent.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

extern char** environ;

namespace tandem::kvtransfer {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

// Generous: the machine running the tests may be loaded; failures are expected long before.
constexpr absl::Duration kLongDeadline = absl::Seconds(60);

constexpr unsigned char kPoison = 0xEE;

std::vector<unsigned char> RandomBytes(size_t size, uint64_t seed) {
  std::vector<unsigned char> bytes(size);
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    const uint64_t word = rng();
    std::memcpy(bytes.data() + i, &word, 8);
  }
  for (; i < size; ++i) bytes[i] = static_cast<unsigned char>(rng());
  return bytes;
}

// Applies `ranges` to `dst` as the transfer should.
void ApplyRanges(const std::vector<unsigned char>& src, std::vector<unsigned char>& dst,
                 const std::vector<Range>& ranges) {
  for (const Range& r : ranges) {
    std::memcpy(dst.data() + r.dst_offset, src.data() + r.src_offset, r.bytes);
  }
}

bool AllPoison(const std::vector<unsigned char>& bytes) {
  return std::all_of(bytes.begin(), bytes.end(), [](unsigned char b) { return b == kPoison; });
}

// Submit's error, or else the handle's final status.
absl::Status SubmitAndWait(Agent& agent, PeerId peer, uint64_t region,
                           const std::string& descriptor, std::vector<Range> ranges,
                           absl::Time deadline) {
  absl::StatusOr<std::unique_ptr<TransferHandle>> handle =
      agent.Submit(peer, region, descriptor, std::move(ranges), deadline);
  if (!handle.ok()) return handle.status();
  return (*handle)->Wait();
}

// Another agent's address with its incarnation replaced: what a restarted peer looks like.
std::string WithOtherIncarnation(const std::string& address) {
  const size_t hash = address.rfind('#');
  std::string other = address.substr(0, hash + 1) + "0123456789abcdef";
  return other == address ? address.substr(0, hash + 1) + "0123456789abcde0" : other;
}

class AgentTest : public ::testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<Agent> NewAgent(const std::string& name) {
    absl::StatusOr<std::unique_ptr<Agent>> agent =
        Agent::Create({.backend = GetParam(), .name = name});
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? std::move(agent).value() : nullptr;
  }

  // A sender with random bytes in region 1 and a receiver with poisoned bytes in region 2,
  // connected.
  void SetUpPair(size_t src_bytes, size_t dst_bytes) {
    sender_ = NewAgent("sender");
    receiver_ = NewAgent("receiver");
    ASSERT_NE(sender_, nullptr);
    ASSERT_NE(receiver_, nullptr);
    src_ = RandomBytes(src_bytes, /*seed=*/src_bytes);
    dst_.assign(dst_bytes, kPoison);
    ASSERT_TRUE(sender_->RegisterMemory(1, src_.data(), src_.size()).ok());
    absl::StatusOr<std::string> descriptor = receiver_->RegisterMemory(2, dst_.data(), dst_.size());
    ASSERT_TRUE(descriptor.ok()) << descriptor.status();
    descriptor_ = *descriptor;
    absl::StatusOr<PeerId> peer =
        sender_->Connect(receiver_->address(), absl::Now() + kLongDeadline);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  absl::Status Push(std::vector<Range> ranges, absl::Duration timeout = kLongDeadline) {
    return SubmitAndWait(*sender_, peer_, 1, descriptor_, std::move(ranges), absl::Now() + timeout);
  }

  std::unique_ptr<Agent> sender_;
  std::unique_ptr<Agent> receiver_;
  std::vector<unsigned char> src_;
  std::vector<unsigned char> dst_;
  std::string descriptor_;
  PeerId peer_ = 0;
};

TEST_P(AgentTest, UnknownBackendIsRefusedByName) {
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Create({.backend = "carrier-pigeon"});
  EXPECT_TRUE(absl::IsInvalidArgument(agent.status()));
  EXPECT_THAT(agent.status().message(), HasSubstr("carrier-pigeon"));
}

// cuda_ipc is its own suite (cuda_ipc/cuda_ipc_agent_test.cc, device memory, label gpu); here:
// what Create says where it cannot run.
TEST(CudaIpcAgentTest, CreateSaysWhyItCannotRun) {
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Create({.backend = "cuda_ipc"});
  if (!TANDEM_KVTRANSFER_CUDA_IPC_BUILT) {
    EXPECT_TRUE(absl::IsInvalidArgument(agent.status())) << agent.status();
    EXPECT_THAT(agent.status().message(), HasSubstr("cuda_ipc backend not built"));
  } else if (!agent.ok()) {
    EXPECT_TRUE(absl::IsFailedPrecondition(agent.status())) << agent.status();
    EXPECT_THAT(agent.status().message(), HasSubstr("no CUDA device"));
  } else {
    GTEST_SKIP() << "cuda_ipc runs here; cuda_ipc_agent_test covers it";
  }
}

TEST_P(AgentTest, ManyRandomRangesArriveExactlyAndNothingElseIsWritten) {
  constexpr size_t kSlot = 4096;
  constexpr size_t kSlots = 1024;
  SetUpPair(8 << 20, kSlot * kSlots);
  std::mt19937_64 rng(42);
  std::vector<size_t> slots(kSlots);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  // 700 of the slots get one range each, of random size and position inside the slot, so the
  // destination ranges never overlap and poisoned gaps are left between them.
  std::vector<Range> ranges;
  for (size_t i = 0; i < 700; ++i) {
    const uint64_t bytes = 1 + rng() % kSlot;
    const uint64_t dst = slots[i] * kSlot + rng() % (kSlot - bytes + 1);
    const uint64_t src = rng() % (src_.size() - bytes + 1);
    ranges.push_back({src, dst, bytes});
  }
  std::vector<unsigned char> expected = dst_;
  ApplyRanges(src_, expected, ranges);
  ASSERT_TRUE(Push(ranges).ok());
  EXPECT_TRUE(dst_ == expected);
}

TEST_P(AgentTest, LargeTransferOf64MiBArrivesExactly) {
  constexpr size_t kBytes = 64 << 20;
  SetUpPair(kBytes, kBytes);
  // 16 KiB blocks in reverse order, as a non-contiguous block table would ask for.
  constexpr size_t kBlock = 16 << 10;
  std::vector<Range> ranges;
  for (size_t i = 0; i < kBytes / kBlock; ++i) {
    ranges.push_back({i * kBlock, kBytes - (i + 1) * kBlock, kBlock});
  }
  std::vector<unsigned char> expected = dst_;
  ApplyRanges(src_, expected, ranges);
  ASSERT_TRUE(Push(ranges).ok());
  EXPECT_TRUE(dst_ == expected);
  // And as one range.
  ASSERT_TRUE(Push({{0, 0, kBytes}}).ok());
  EXPECT_TRUE(dst_ == src_);
}

TEST_P(AgentTest, RangeOutsideTheSourceIsRefusedAndNothingIsWritten) {
  SetUpPair(1 << 20, 1 << 20);
  const absl::Status status = Push({{0, 0, 4096}, {(1 << 20) - 100, 8192, 200}});
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("range 1 reads"));
  EXPECT_TRUE(AllPoison(dst_));
}

TEST_P(AgentTest, RangeOutsideTheDestinationIsRefusedAndNothingIsWritten) {
  SetUpPair(1 << 20, 64 << 10);
  for (const Range& bad : std::vector<Range>{{0, (64 << 10) - 10, 11},
                                             {0, 64 << 10, 1},
                                             {0, ~uint64_t{0} - 2, 8},
                                             {0, 0, (64 << 10) + 1}}) {
    const absl::Status status = Push({{0, 0, 4096}, bad});
    EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  }
  EXPECT_TRUE(AllPoison(dst_));
}

TEST_P(AgentTest, GarbledOrForeignDescriptorIsRefused) {
  SetUpPair(1 << 20, 1 << 20);
  std::string flipped = descriptor_;
  flipped[flipped.size() / 2] ^= 0x40;
  for (const std::string& bad : {std::string(), std::string("not a descriptor"), flipped,
                                 descriptor_.substr(0, descriptor_.size() - 1)}) {
    EXPECT_TRUE(absl::IsInvalidArgument(
        SubmitAndWait(*sender_, peer_, 1, bad, {{0, 0, 64}}, absl::Now() + kLongDeadline)));
  }
  // A valid descriptor of a third agent, used towards the peer: it would write into the wrong
  // process (or the wrong agent's memory), so it is refused.
  std::unique_ptr<Agent> third = NewAgent("third");
  std::vector<unsigned char> third_memory(1 << 20, kPoison);
  absl::StatusOr<std::string> third_descriptor =
      third->RegisterMemory(2, third_memory.data(), third_memory.size());
  ASSERT_TRUE(third_descriptor.ok());
  const absl::Status status = SubmitAndWait(*sender_, peer_, 1, *third_descriptor, {{0, 0, 64}},
                                            absl::Now() + kLongDeadline);
  EXPECT_TRUE(absl::IsInvalidArgument(status)) << status;
  EXPECT_THAT(status.message(), HasSubstr("not to peer"));
  // A descriptor of the other backend.
  const std::string other_backend = GetParam() == "ucx" ? "local" : "ucx";
  absl::StatusOr<std::unique_ptr<Agent>> other = Agent::Create({.backend = other_backend});
  ASSERT_TRUE(other.ok());
  absl::StatusOr<std::string> other_descriptor =
      (*other)->RegisterMemory(2, third_memory.data(), third_memory.size());
  ASSERT_TRUE(other_descriptor.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(SubmitAndWait(*sender_, peer_, 1, *other_descriptor,
                                                    {{0, 0, 64}}, absl::Now() + kLongDeadline)));
  EXPECT_TRUE(AllPoison(dst_));
  EXPECT_TRUE(AllPoison(third_memory));
}

TEST_P(AgentTest, UnknownRegionOrPeerIsNotFound) {
  SetUpPair(1 << 20, 1 << 20);
  EXPECT_TRUE(absl::IsNotFound(SubmitAndWait(*sender_, peer_, /*region=*/99, descriptor_,
                                             {{0, 0, 64}}, absl::Now() + kLongDeadline)));
  EXPECT_TRUE(absl::IsNotFound(SubmitAndWait(*sender_, peer_ + 100, 1, descriptor_, {{0, 0, 64}},
                                             absl::Now() + kLongDeadline)));
  EXPECT_TRUE(absl::IsAlreadyExists(sender_->RegisterMemory(1, src_.data(), 16).status()));
  EXPECT_TRUE(absl::IsNotFound(sender_->DeregisterMemory(99)));
  EXPECT_TRUE(AllPoison(dst_));
}

TEST_P(AgentTest, DeregisteredRegionCannotBeSentFrom) {
  SetUpPair(1 << 20, 1 << 20);
  ASSERT_TRUE(sender_->DeregisterMemory(1).ok());
  EXPECT_TRUE(absl::IsNotFound(Push({{0, 0, 64}})));
  EXPECT_TRUE(AllPoison(dst_));
}

TEST_P(AgentTest, ConnectToAnAgentThatIsGoneFailsWithinTheDeadline) {
  std::string gone_address;
  {
    std::unique_ptr<Agent> gone = NewAgent("gone");
    ASSERT_NE(gone, nullptr);
    gone_address = gone->address();
  }
  std::unique_ptr<Agent> agent = NewAgent("client");
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  const absl::StatusOr<PeerId> peer = agent->Connect(gone_address, deadline);
  EXPECT_THAT(peer.status().code(),
              AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
      << peer.status();
  EXPECT_LT(absl::Now(), deadline + absl::Seconds(5));
  // Not an address of this backend at all: refused without waiting.
  const absl::Status nonsense = agent->Connect("nonsense", deadline).status();
  EXPECT_THAT(nonsense.code(),
              AnyOf(absl::StatusCode::kInvalidArgument, absl::StatusCode::kUnavailable))
      << nonsense;
}

TEST_P(AgentTest, ConnectToARestartedPeerIsRefused) {
  std::unique_ptr<Agent> server = NewAgent("server");
  std::unique_ptr<Agent> client = NewAgent("client");
  const absl::StatusOr<PeerId> peer =
      client->Connect(WithOtherIncarnation(server->address()), absl::Now() + kLongDeadline);
  EXPECT_TRUE(absl::IsUnavailable(peer.status())) << peer.status();
  // The real incarnation is still reachable.
  EXPECT_TRUE(client->Connect(server->address(), absl::Now() + kLongDeadline).ok());
}

TEST_P(AgentTest, PeerDestroyedAfterConnectFailsTransfersWithoutHanging) {
  SetUpPair(1 << 20, 1 << 20);
  receiver_.reset();
  // UCX learns of the loss asynchronously, so the first attempts may still be posted; within
  // the deadline every backend must report the peer as gone, and no attempt may hang.
  const absl::Time give_up = absl::Now() + kLongDeadline;
  absl::Status status;
  while (absl::Now() < give_up) {
    status = Push({{0, 0, 4096}}, absl::Seconds(20));
    if (!status.ok()) break;
  }
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
}

TEST_P(AgentTest, DisconnectedPeerIsNotFoundAndCanBeConnectedAgain) {
  SetUpPair(1 << 20, 1 << 20);
  ASSERT_TRUE(sender_->Disconnect(peer_).ok());
  EXPECT_TRUE(absl::IsNotFound(Push({{0, 0, 64}})));
  EXPECT_TRUE(absl::IsNotFound(sender_->Disconnect(peer_)));
  absl::StatusOr<PeerId> again =
      sender_->Connect(receiver_->address(), absl::Now() + kLongDeadline);
  ASSERT_TRUE(again.ok());
  peer_ = *again;
  ASSERT_TRUE(Push({{0, 0, 64}}).ok());
  EXPECT_TRUE(std::equal(dst_.begin(), dst_.begin() + 64, src_.begin()));
}

// A deadline passing while bytes are in flight is UcxPeerProcessTest's (a stopped peer holds the
// transfer there for certain); the local backend copies on the submitting thread.
TEST_P(AgentTest, PassedDeadlineIsReportedAndTheAgentStillWorks) {
  constexpr size_t kBytes = 4 << 20;
  SetUpPair(kBytes, kBytes);
  // Already passed when submitted: refused, and nothing is written.
  EXPECT_TRUE(absl::IsDeadlineExceeded(Push({{0, 0, 4096}}, -absl::Seconds(1))));
  EXPECT_TRUE(AllPoison(dst_));

  // The next transfer, into a fresh region.
  std::vector<unsigned char> fresh(1 << 20, kPoison);
  absl::StatusOr<std::string> fresh_descriptor =
      receiver_->RegisterMemory(3, fresh.data(), fresh.size());
  ASSERT_TRUE(fresh_descriptor.ok());
  ASSERT_TRUE(SubmitAndWait(*sender_, peer_, 1, *fresh_descriptor, {{4096, 0, 1 << 20}},
                            absl::Now() + kLongDeadline)
                  .ok());
  EXPECT_TRUE(std::equal(fresh.begin(), fresh.end(), src_.begin() + 4096));
  // The source region can be deregistered (and freed) even though a transfer from it timed out.
  EXPECT_TRUE(sender_->DeregisterMemory(1).ok());
}

TEST_P(AgentTest, HandleOutlivingItsAgentReportsAFinalStatus) {
  SetUpPair(1 << 20, 1 << 20);
  absl::StatusOr<std::unique_ptr<TransferHandle>> handle =
      sender_->Submit(peer_, 1, descriptor_, {{0, 0, 1 << 20}}, absl::Now() + kLongDeadline);
  ASSERT_TRUE(handle.ok());
  sender_.reset();
  const absl::Status status = (*handle)->Wait();
  EXPECT_THAT(status.code(), AnyOf(absl::StatusCode::kOk, absl::StatusCode::kCancelled)) << status;
}

INSTANTIATE_TEST_SUITE_P(Backends, AgentTest, ::testing::Values("local", "ucx"),
                         [](const auto& info) { return info.param; });

// ---- A UCX peer in another process ----

uint64_t Fnv1a(const unsigned char* data, size_t size) {
  uint64_t hash = 14695981039346656037ull;
  for (size_t i = 0; i < size; ++i) {
    hash ^= data[i];
    hash *= 1099511628211ull;
  }
  return hash;
}

// tandem_kvtransfer_peer as a child process, talked to over its stdin and stdout.
class PeerProcess {
 public:
  // Starts the peer with a region of `bytes`; fails the test if it does not come up.
  static std::unique_ptr<PeerProcess> Start(size_t bytes, const std::string& transports) {
    auto peer = std::unique_ptr<PeerProcess>(new PeerProcess());
    int to_child[2], from_child[2];
    EXPECT_EQ(pipe2(to_child, O_CLOEXEC), 0);
    EXPECT_EQ(pipe2(from_child, O_CLOEXEC), 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    std::vector<std::string> args = {TANDEM_KVTRANSFER_PEER, absl::StrCat("--bytes=", bytes)};
    if (!transports.empty()) args.push_back("--transports=" + transports);
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    // posix_spawn rather than fork: this process has UCX threads, and the child only execs.
    const int rc = posix_spawn(&peer->pid_, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(to_child[0]);
    close(from_child[1]);
    peer->to_child_ = to_child[1];
    peer->from_child_ = from_child[0];
    EXPECT_EQ(rc, 0) << "cannot start " << TANDEM_KVTRANSFER_PEER;
    if (rc != 0) return nullptr;
    std::optional<std::string> address = peer->ReadLine();
    std::optional<std::string> descriptor = peer->ReadLine();
    if (!address || !descriptor || !absl::StartsWith(*address, "address ") ||
        !absl::StartsWith(*descriptor, "descriptor ")) {
      ADD_FAILURE() << "peer did not start";
      return nullptr;
    }
    peer->address_ = address->substr(8);
    peer->descriptor_ = absl::HexStringToBytes(descriptor->substr(11));
    return peer;
  }

  ~PeerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    close(to_child_);
    close(from_child_);
  }

  const std::string& address() const { return address_; }
  const std::string& descriptor() const { return descriptor_; }

  // FNV-1a of the peer's bytes [offset, offset + bytes), computed by the peer.
  std::optional<uint64_t> Checksum(size_t offset, size_t bytes) {
    const std::string command = absl::StrCat("checksum ", offset, " ", bytes, "\n");
    if (write(to_child_, command.data(), command.size()) != static_cast<ssize_t>(command.size())) {
      return std::nullopt;
    }
    std::optional<std::string> line = ReadLine();
    uint64_t value = 0;
    if (!line || !absl::StartsWith(*line, "checksum ") ||
        !absl::SimpleHexAtoi(line->substr(9), &value)) {
      return std::nullopt;
    }
    return value;
  }

  void Signal(int signal) { kill(pid_, signal); }

  // Kills the peer and waits until it is gone.
  void Kill() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  PeerProcess() = default;

  // One line from the peer's stdout, or nullopt after a minute or at EOF.
  std::optional<std::string> ReadLine() {
    const absl::Time deadline = absl::Now() + kLongDeadline;
    while (true) {
      const size_t newline = buffer_.find('\n');
      if (newline != std::string::npos) {
        std::string line = buffer_.substr(0, newline);
        buffer_.erase(0, newline + 1);
        return line;
      }
      pollfd fd = {from_child_, POLLIN, 0};
      const int timeout_ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now()));
      if (timeout_ms <= 0 || poll(&fd, 1, timeout_ms) <= 0) return std::nullopt;
      char chunk[4096];
      const ssize_t n = read(from_child_, chunk, sizeof(chunk));
      if (n <= 0) return std::nullopt;
      buffer_.append(chunk, n);
    }
  }

  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buffer_;
  std::string address_;
  std::string descriptor_;
};

class UcxPeerProcessTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { signal(SIGPIPE, SIG_IGN); }

  // A sender agent with `bytes` of random data in region 1, connected to `peer`.
  void SetUpSender(PeerProcess& peer, size_t bytes, const std::string& transports = "") {
    absl::StatusOr<std::unique_ptr<Agent>> agent =
        Agent::Create({.backend = "ucx", .name = "sender", .ucx_transports = transports});
    ASSERT_TRUE(agent.ok()) << agent.status();
    sender_ = std::move(agent).value();
    src_ = RandomBytes(bytes, /*seed=*/7);
    ASSERT_TRUE(sender_->RegisterMemory(1, src_.data(), src_.size()).ok());
    absl::StatusOr<PeerId> connected =
        sender_->Connect(peer.address(), absl::Now() + kLongDeadline);
    ASSERT_TRUE(connected.ok()) << connected.status();
    peer_ = *connected;
  }

  std::unique_ptr<Agent> sender_;
  std::vector<unsigned char> src_;
  PeerId peer_ = 0;
};

TEST_F(UcxPeerProcessTest, TransferIntoAnotherProcessIsVerifiedByThatProcess) {
  constexpr size_t kBytes = 16 << 20;
  std::unique_ptr<PeerProcess> peer = PeerProcess::Start(kBytes, "");
  ASSERT_NE(peer, nullptr);
  SetUpSender(*peer, kBytes);
  std::mt19937_64 rng(3);
  std::vector<Range> ranges;
  for (size_t slot = 0; slot < kBytes / 65536; ++slot) {
    if (rng() % 3 == 0) continue;  // Leave some of the peer's region untouched (zero).
    const uint64_t bytes = 1 + rng() % 65536;
    ranges.push_back({rng() % (kBytes - bytes + 1), slot * 65536, bytes});
  }
  std::vector<unsigned char> expected(kBytes, 0);
  ApplyRanges(src_, expected, ranges);
  ASSERT_TRUE(
      SubmitAndWait(*sender_, peer_, 1, peer->descriptor(), ranges, absl::Now() + kLongDeadline)
          .ok());
  // Wait returned OK, so the bytes must already be visible to the peer.
  EXPECT_EQ(peer->Checksum(0, kBytes), Fnv1a(expected.data(), kBytes));
  EXPECT_EQ(peer->Checksum(65536, 4096), Fnv1a(expected.data() + 65536, 4096));
}

TEST_F(UcxPeerProcessTest, ConnectToAKilledPeerFailsWithinTheDeadline) {
  std::unique_ptr<PeerProcess> peer = PeerProcess::Start(1 << 20, "");
  ASSERT_NE(peer, nullptr);
  const std::string address = peer->address();
  peer->Kill();
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Create({.backend = "ucx"});
  ASSERT_TRUE(agent.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  const absl::Status status = (*agent)->Connect(address, deadline).status();
  EXPECT_THAT(status.code(),
              AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded))
      << status;
  EXPECT_LT(absl::Now(), deadline + absl::Seconds(5));
}

TEST_F(UcxPeerProcessTest, PeerKilledAfterConnectFailsTransfersWithUnavailable) {
  std::unique_ptr<PeerProcess> peer = PeerProcess::Start(1 << 20, "");
  ASSERT_NE(peer, nullptr);
  SetUpSender(*peer, 1 << 20);
  peer->Kill();
  const absl::Time give_up = absl::Now() + kLongDeadline;
  absl::Status status;
  while (absl::Now() < give_up) {
    status = SubmitAndWait(*sender_, peer_, 1, peer->descriptor(), {{0, 0, 4096}},
                           absl::Now() + absl::Seconds(20));
    if (!status.ok()) break;
  }
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
}

// Over TCP the peer must read every byte itself, so a stopped peer holds a large transfer in
// flight for certain; killing it then must fail the transfer, not hang it.
TEST_F(UcxPeerProcessTest, PeerKilledMidTransferFailsTheTransfer) {
  constexpr size_t kBytes = 256 << 20;
  std::unique_ptr<PeerProcess> peer = PeerProcess::Start(kBytes, "tcp");
  ASSERT_NE(peer, nullptr);
  SetUpSender(*peer, kBytes, "tcp");
  peer->Signal(SIGSTOP);
  std::vector<Range> ranges;
  for (size_t offset = 0; offset < kBytes; offset += 64 << 10) {
    ranges.push_back({offset, offset, 64 << 10});
  }
  const absl::Time deadline = absl::Now() + kLongDeadline;
  absl::StatusOr<std::unique_ptr<TransferHandle>> handle =
      sender_->Submit(peer_, 1, peer->descriptor(), ranges, deadline);
  ASSERT_TRUE(handle.ok()) << handle.status();
  EXPECT_FALSE((*handle)->Poll().has_value()) << "256 MiB cannot reach a stopped process";
  peer->Kill();
  const absl::Status status = (*handle)->Wait();
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_LT(absl::Now(), deadline);
}

TEST_F(UcxPeerProcessTest, PeerKilledDuringATransferOverDefaultTransportsNeverHangs) {
  constexpr size_t kBytes = 128 << 20;
  std::unique_ptr<PeerProcess> peer = PeerProcess::Start(kBytes, "");
  ASSERT_NE(peer, nullptr);
  SetUpSender(*peer, kBytes);
  const absl::Time deadline = absl::Now() + kLongDeadline;
  absl::StatusOr<std::unique_ptr<TransferHandle>> handle =
      sender_->Submit(peer_, 1, peer->descriptor(), {{0, 0, kBytes}}, deadline);
  ASSERT_TRUE(handle.ok()) << handle.status();
  peer->Kill();
  // Shared-memory transports may finish before the kill lands; otherwise the loss is reported.
  const absl::Status status = (*handle)->Wait();
  EXPECT_THAT(status.code(), AnyOf(absl::StatusCode::kOk, absl::StatusCode::kUnavailable))
      << status;
  EXPECT_LT(absl::Now(), deadline);
}

// The deadline passes while the stopped peer holds 32 MiB in flight (over TCP it must read every
// byte itself); once it runs again, the same connection carries the next transfer.
TEST_F(UcxPeerProcessTest, DeadlinePassingMidTransferIsReportedAndTheAgentStillWorks) {
  constexpr size_t kBytes = 64 << 20;
  constexpr size_t kAbandoned = 32 << 20;
  std::unique_ptr<PeerProcess> peer = PeerProcess::Start(kBytes, "tcp");
  ASSERT_NE(peer, nullptr);
  SetUpSender(*peer, kBytes, "tcp");
  peer->Signal(SIGSTOP);
  std::vector<Range> ranges;
  for (size_t offset = 0; offset < kAbandoned; offset += 4096) {
    ranges.push_back({offset, offset, 4096});
  }
  const absl::Status late =
      SubmitAndWait(*sender_, peer_, 1, peer->descriptor(), ranges, absl::Now() + absl::Seconds(1));
  EXPECT_TRUE(absl::IsDeadlineExceeded(late)) << late;
  peer->Signal(SIGCONT);

  // Past the abandoned ranges, so whatever of them still lands cannot overwrite it.
  constexpr size_t kFresh = 48 << 20;
  ASSERT_TRUE(SubmitAndWait(*sender_, peer_, 1, peer->descriptor(), {{0, kFresh, 1 << 20}},
                            absl::Now() + kLongDeadline)
                  .ok());
  EXPECT_EQ(peer->Checksum(kFresh, 1 << 20), Fnv1a(src_.data(), 1 << 20));
}

// DeregisterMemory must not return while UCX may still read the region; a transfer whose
// deadline passed is cancelled by closing its connection.
TEST_F(UcxPeerProcessTest, DeregisterCancelsATimedOutTransferToAStuckPeer) {
  constexpr size_t kBytes = 64 << 20;
  std::unique_ptr<PeerProcess> peer = PeerProcess::Start(kBytes, "tcp");
  ASSERT_NE(peer, nullptr);
  SetUpSender(*peer, kBytes, "tcp");
  peer->Signal(SIGSTOP);
  const absl::Status late = SubmitAndWait(*sender_, peer_, 1, peer->descriptor(), {{0, 0, kBytes}},
                                          absl::Now() + absl::Seconds(1));
  EXPECT_TRUE(absl::IsDeadlineExceeded(late)) << late;
  const absl::Time before = absl::Now();
  EXPECT_TRUE(sender_->DeregisterMemory(1).ok());
  EXPECT_LT(absl::Now() - before, absl::Seconds(30));
  // The connection was closed to cancel the transfer.
  std::vector<unsigned char> other(4096);
  ASSERT_TRUE(sender_->RegisterMemory(2, other.data(), other.size()).ok());
  EXPECT_TRUE(absl::IsUnavailable(SubmitAndWait(*sender_, peer_, 2, peer->descriptor(),
                                                {{0, 0, 4096}}, absl::Now() + kLongDeadline)));
  peer->Signal(SIGCONT);
}

}  // namespace
}  // namespace tandem::kvtransfer
