// The nccl backend's control protocol (handshake, announce/accept/refuse, done, hang-ups,
// deadlines, deregistration) between real agents over TCP, on a test double of the NCCL link
// that matches sends and receives in order in host memory, as NCCL does on devices. The NCCL
// links themselves are tested on GPUs (nccl_link_test.cc, label gpu).
#include "kvtransfer/src/nccl/nccl_agent.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::kvtransfer::nccl {
namespace {

using ::testing::HasSubstr;

// Where the two ends of each link meet. Shared by the factories of the agents of one test.
class HostLinks {
 public:
  struct Pair {
    int joined = 0;
    bool broken = false;
    struct Op {
      Span span;
      uint64_t batch = 0;
    };
    std::deque<Op> posted[2][2];             // [rank][0 receive, 1 send]
    std::map<uint64_t, int> outstanding[2];  // per rank: batch -> operations not yet matched
  };

  // While held, nothing is matched: transfers stay in flight until Release.
  void Hold() {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = true;
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = false;
    for (auto& [id, pair] : pairs_) MatchLocked(*pair);
    cv_.notify_all();
  }
  // While landing is held, sends still match and complete on the sending side, but the bytes
  // reach the receiver (and its receives complete) only at ReleaseLanding: as with NCCL, a
  // finished send does not mean the receiver has the bytes.
  void HoldLanding() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_landing_ = true;
  }
  void ReleaseLanding() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_landing_ = false;
    for (Landing& l : landing_) Land(l);
    landing_.clear();
  }
  // Joins fail with this reason (as NCCL refuses two ranks on one GPU).
  void FailJoins(std::string why) {
    std::lock_guard<std::mutex> lock(mu_);
    join_failure_ = std::move(why);
  }
  int matched_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return matched_bytes_;
  }

  struct Landing {
    std::shared_ptr<Pair> pair;
    Span to, from;
    int rank = 0;
    uint64_t batch = 0;
  };
  void Land(const Landing& l) {
    std::memcpy(l.to.data, l.from.data, l.from.bytes);
    --l.pair->outstanding[l.rank][l.batch];
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool held_ = false;
  bool hold_landing_ = false;
  std::vector<Landing> landing_;
  std::string join_failure_;
  int matched_bytes_ = 0;
  std::map<std::string, std::shared_ptr<Pair>> pairs_;
  std::map<const Pair*, std::shared_ptr<Pair>> pairs_by_ptr_;

  // Copies every send that has its receive, in order; a size mismatch breaks the link (a
  // protocol bug: NCCL would hang or fail there).
  void MatchLocked(Pair& p) {
    if (held_ || p.broken) return;
    for (int from = 0; from < 2; ++from) {
      std::deque<Pair::Op>& sends = p.posted[from][1];
      std::deque<Pair::Op>& receives = p.posted[1 - from][0];
      while (!sends.empty() && !receives.empty()) {
        if (sends.front().span.bytes != receives.front().span.bytes) {
          p.broken = true;
          return;
        }
        matched_bytes_ += static_cast<int>(sends.front().span.bytes);
        --p.outstanding[from][sends.front().batch];
        Landing l{pairs_by_ptr_.at(&p), receives.front().span, sends.front().span, 1 - from,
                  receives.front().batch};
        if (hold_landing_) {
          landing_.push_back(l);
        } else {
          Land(l);
        }
        sends.pop_front();
        receives.pop_front();
      }
    }
  }
};

class HostLink : public PairLink {
 public:
  HostLink(HostLinks* links, std::shared_ptr<HostLinks::Pair> pair, int rank)
      : links_(links), pair_(std::move(pair)), rank_(rank) {}
  ~HostLink() override { Abort(); }

  absl::StatusOr<uint64_t> Post(bool send, const std::vector<Span>& spans) override {
    std::lock_guard<std::mutex> lock(links_->mu_);
    if (pair_->broken) return absl::UnavailableError("host link broken");
    const uint64_t batch = ++last_batch_;
    for (const Span& s : spans) pair_->posted[rank_][send ? 1 : 0].push_back({s, batch});
    pair_->outstanding[rank_][batch] = static_cast<int>(spans.size());
    links_->MatchLocked(*pair_);
    return batch;
  }

  std::optional<absl::Status> Poll(uint64_t ticket) override {
    std::lock_guard<std::mutex> lock(links_->mu_);
    if (pair_->broken) return absl::UnavailableError("host link broken");
    for (const auto& [batch, left] : pair_->outstanding[rank_]) {
      if (batch <= ticket && left > 0) return std::nullopt;
    }
    return absl::OkStatus();
  }

  void Abort() override {
    std::lock_guard<std::mutex> lock(links_->mu_);
    pair_->broken = true;
  }

 private:
  HostLinks* const links_;
  const std::shared_ptr<HostLinks::Pair> pair_;
  const int rank_;
  uint64_t last_batch_ = 0;
};

class HostLinkFactory : public PairLinkFactory {
 public:
  explicit HostLinkFactory(HostLinks* links) : links_(links) {}

  absl::Status CheckMemory(const void*, size_t) override { return absl::OkStatus(); }

  absl::StatusOr<std::string> NewLinkId() override {
    std::lock_guard<std::mutex> lock(links_->mu_);
    return absl::StrCat("link-", links_->pairs_.size() + 1, "-", reinterpret_cast<uintptr_t>(this));
  }

  absl::StatusOr<std::unique_ptr<PairLink>> Join(const std::string& id, int rank,
                                                 absl::Time deadline,
                                                 const std::atomic<bool>& cancel) override {
    std::unique_lock<std::mutex> lock(links_->mu_);
    if (!links_->join_failure_.empty()) return absl::UnavailableError(links_->join_failure_);
    std::shared_ptr<HostLinks::Pair>& pair = links_->pairs_[id];
    if (pair == nullptr) {
      pair = std::make_shared<HostLinks::Pair>();
      links_->pairs_by_ptr_[pair.get()] = pair;
    }
    std::shared_ptr<HostLinks::Pair> p = pair;
    ++p->joined;
    links_->cv_.notify_all();
    while (p->joined < 2) {
      if (cancel.load()) return absl::CancelledError("join cancelled");
      if (absl::Now() >= deadline) return absl::DeadlineExceededError("join timed out");
      links_->cv_.wait_for(lock, std::chrono::milliseconds(5));
    }
    return std::make_unique<HostLink>(links_, p, rank);
  }

 private:
  HostLinks* const links_;
};

absl::Time In(absl::Duration d) { return absl::Now() + d; }

class NcclAgentTest : public ::testing::Test {
 protected:
  std::unique_ptr<Agent> NewAgent(const std::string& name) {
    absl::StatusOr<std::unique_ptr<Agent>> agent = CreateNcclAgentWith(
        {.backend = "nccl", .name = name}, std::make_unique<HostLinkFactory>(&links_));
    EXPECT_TRUE(agent.ok()) << agent.status();
    return agent.ok() ? std::move(*agent) : nullptr;
  }

  void SetUp() override {
    sender_ = NewAgent("prefill");
    receiver_ = NewAgent("decode");
    src_.resize(1 << 16);
    std::iota(src_.begin(), src_.end(), 1);
    dst_.assign(1 << 16, 0);
    ASSERT_TRUE(sender_->RegisterMemory(1, src_.data(), src_.size()).ok());
    absl::StatusOr<std::string> d = receiver_->RegisterMemory(7, dst_.data(), dst_.size());
    ASSERT_TRUE(d.ok()) << d.status();
    descriptor_ = *d;
    absl::StatusOr<PeerId> peer = sender_->Connect(receiver_->address(), In(absl::Seconds(10)));
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  void TearDown() override {
    links_.Release();  // before the agents go, so nothing waits on a held link
    links_.ReleaseLanding();
  }

  absl::Status Push(std::vector<Range> ranges, absl::Duration timeout = absl::Seconds(10)) {
    absl::StatusOr<std::unique_ptr<TransferHandle>> h =
        sender_->Submit(peer_, 1, descriptor_, std::move(ranges), In(timeout));
    if (!h.ok()) return h.status();
    return (*h)->Wait();
  }

  HostLinks links_;
  std::unique_ptr<Agent> sender_, receiver_;
  std::vector<uint8_t> src_, dst_;
  std::string descriptor_;
  PeerId peer_ = 0;
};

TEST_F(NcclAgentTest, PushesRangesIntoThePeersRegionAndNothingElse) {
  ASSERT_TRUE(Push({{.src_offset = 0, .dst_offset = 100, .bytes = 4096},
                    {.src_offset = 4096, .dst_offset = 4196, .bytes = 4096},  // coalesced
                    {.src_offset = 30000, .dst_offset = 60000, .bytes = 5000}})
                  .ok());
  for (int i = 0; i < 8192; ++i) ASSERT_EQ(dst_[100 + i], src_[i]) << i;
  for (int i = 0; i < 5000; ++i) ASSERT_EQ(dst_[60000 + i], src_[30000 + i]) << i;
  const int written = std::count_if(dst_.begin(), dst_.end(), [](uint8_t b) { return b != 0; });
  const int expected =
      std::count_if(src_.begin(), src_.begin() + 8192, [](uint8_t b) { return b != 0; }) +
      std::count_if(src_.begin() + 30000, src_.begin() + 35000, [](uint8_t b) { return b != 0; });
  EXPECT_EQ(written, expected);
  EXPECT_EQ(links_.matched_bytes(), 8192 + 5000);
}

TEST_F(NcclAgentTest, OkMeansTheBytesHaveLandedNotThatTheSendsAreDone) {
  links_.HoldLanding();
  absl::StatusOr<std::unique_ptr<TransferHandle>> h =
      sender_->Submit(peer_, 1, descriptor_, {{.bytes = 4096}}, In(absl::Seconds(30)));
  ASSERT_TRUE(h.ok());
  // The sends match and complete on the sender's side...
  for (int i = 0; i < 10000 && links_.matched_bytes() < 4096; ++i)
    absl::SleepFor(absl::Milliseconds(1));
  ASSERT_EQ(links_.matched_bytes(), 4096);
  absl::SleepFor(absl::Milliseconds(20));  // time for a wrong early OK to show
  // ... but the receiver does not have the bytes yet, so the transfer is not done.
  EXPECT_FALSE((*h)->Poll().has_value());
  links_.ReleaseLanding();
  ASSERT_TRUE((*h)->Wait().ok());
  EXPECT_EQ(0, std::memcmp(dst_.data(), src_.data(), 4096));
}

TEST_F(NcclAgentTest, ManyTransfersInFlightAllLandInOrder) {
  std::vector<std::unique_ptr<TransferHandle>> handles;
  for (int i = 0; i < 40; ++i) {
    // Each transfer writes its own 1 KiB slot from a different source offset.
    absl::StatusOr<std::unique_ptr<TransferHandle>> h = sender_->Submit(
        peer_, 1, descriptor_,
        {{.src_offset = uint64_t(i) * 997, .dst_offset = uint64_t(i) * 1024, .bytes = 1024}},
        In(absl::Seconds(10)));
    ASSERT_TRUE(h.ok()) << h.status();
    handles.push_back(std::move(*h));
  }
  for (auto& h : handles) ASSERT_TRUE(h->Wait().ok());
  for (int i = 0; i < 40; ++i) {
    ASSERT_EQ(0, std::memcmp(&dst_[i * 1024], &src_[i * 997], 1024)) << "transfer " << i;
  }
}

TEST_F(NcclAgentTest, RangesOutsideEitherRegionAreRefusedBeforeAnythingMoves) {
  absl::Status s = Push({{.src_offset = 0, .dst_offset = 0, .bytes = 10},
                         {.src_offset = 0, .dst_offset = (1 << 16) - 4, .bytes = 8}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = Push({{.src_offset = (1 << 16) - 4, .dst_offset = 0, .bytes = 8}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = Push({{.src_offset = 0, .dst_offset = ~uint64_t{0}, .bytes = 2}});  // overflow
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(links_.matched_bytes(), 0);
  EXPECT_TRUE(std::all_of(dst_.begin(), dst_.end(), [](uint8_t b) { return b == 0; }));
  // Nothing to move is done at once.
  EXPECT_TRUE(Push({}).ok());
}

TEST_F(NcclAgentTest, TheReceiverRefusesAStaleOrMissingRegionAndTheConnectionGoesOn) {
  const std::string stale = descriptor_;
  ASSERT_TRUE(receiver_->DeregisterMemory(7).ok());
  absl::StatusOr<std::string> fresh = receiver_->RegisterMemory(7, dst_.data(), dst_.size());
  ASSERT_TRUE(fresh.ok());
  absl::Status s = Push({{.src_offset = 0, .dst_offset = 0, .bytes = 64}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("stale"));

  descriptor_ = *fresh;
  ASSERT_TRUE(Push({{.src_offset = 0, .dst_offset = 0, .bytes = 64}}).ok());
  EXPECT_EQ(0, std::memcmp(dst_.data(), src_.data(), 64));

  ASSERT_TRUE(receiver_->DeregisterMemory(7).ok());
  s = Push({{.src_offset = 0, .dst_offset = 0, .bytes = 64}});
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("region 7 of decode is not registered"));
  EXPECT_EQ(links_.matched_bytes(), 64);
}

TEST_F(NcclAgentTest, DescriptorsOfAnotherAgentOrBackendAreRefused) {
  std::unique_ptr<Agent> other = NewAgent("other");
  std::vector<uint8_t> buffer(1024);
  absl::StatusOr<std::string> foreign = other->RegisterMemory(7, buffer.data(), buffer.size());
  ASSERT_TRUE(foreign.ok());
  absl::StatusOr<std::unique_ptr<TransferHandle>> h =
      sender_->Submit(peer_, 1, *foreign, {{.bytes = 8}}, In(absl::Seconds(5)));
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(h.status().message(), HasSubstr("belongs to agent"));

  absl::StatusOr<std::unique_ptr<Agent>> local = Agent::Create({.backend = "local", .name = "l"});
  ASSERT_TRUE(local.ok());
  absl::StatusOr<std::string> local_descriptor =
      (*local)->RegisterMemory(7, buffer.data(), buffer.size());
  ASSERT_TRUE(local_descriptor.ok());
  h = sender_->Submit(peer_, 1, *local_descriptor, {{.bytes = 8}}, In(absl::Seconds(5)));
  ASSERT_FALSE(h.ok());
  EXPECT_THAT(h.status().message(), HasSubstr("\"local\" backend, not \"nccl\""));
  h = sender_->Submit(peer_ + 1, 1, descriptor_, {{.bytes = 8}}, In(absl::Seconds(5)));
  EXPECT_EQ(h.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(NcclAgentTest, ConnectRefusesBadAddressesOtherIncarnationsAndSilence) {
  absl::StatusOr<PeerId> p = sender_->Connect("ucx:127.0.0.1:1#12", In(absl::Seconds(2)));
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << p.status();

  // The receiver's host and port with another incarnation: a restarted peer is not the old one.
  std::string address = receiver_->address();
  address = address.substr(0, address.rfind('#') + 1) + "00000000000000aa";
  p = sender_->Connect(address, In(absl::Seconds(5)));
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable) << p.status();
  EXPECT_THAT(p.status().message(), HasSubstr("another agent incarnation"));

  std::string gone_address;
  {
    std::unique_ptr<Agent> gone = NewAgent("gone");
    gone_address = gone->address();
  }
  p = sender_->Connect(gone_address, In(absl::Seconds(5)));
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable) << p.status();

  p = sender_->Connect(receiver_->address(), absl::Now() - absl::Seconds(1));
  EXPECT_EQ(p.status().code(), absl::StatusCode::kDeadlineExceeded) << p.status();
}

// A TCP listener that is not an agent: it accepts and then says nothing, or says `reply`.
class NotAnAgent {
 public:
  explicit NotAnAgent(std::string reply) : reply_(std::move(reply)) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&address), length), 0);
    EXPECT_EQ(listen(fd_, 4), 0);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&address), &length);
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] {
      const int c = accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      if (!reply_.empty()) (void)!write(c, reply_.data(), reply_.size());
      char sink[256];
      while (read(c, sink, sizeof(sink)) > 0) {
      }
      close(c);
    });
  }
  ~NotAnAgent() {
    shutdown(fd_, SHUT_RDWR);
    close(fd_);
    thread_.join();
  }
  std::string address() const {
    return absl::StrFormat("nccl:x@127.0.0.1:%d#%016x", port_, 0x1234);
  }

 private:
  std::string reply_;
  int fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

TEST_F(NcclAgentTest, ConnectToSomethingElseFailsByTheDeadlineInsteadOfHanging) {
  {
    NotAnAgent silent("");
    absl::StatusOr<PeerId> p = sender_->Connect(silent.address(), In(absl::Milliseconds(300)));
    EXPECT_EQ(p.status().code(), absl::StatusCode::kDeadlineExceeded) << p.status();
  }
  {
    NotAnAgent chatty(std::string(24, 'x'));  // a reply of a hello's size, not a hello
    absl::StatusOr<PeerId> p = sender_->Connect(chatty.address(), In(absl::Seconds(10)));
    EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable) << p.status();
    EXPECT_THAT(p.status().message(), HasSubstr("another agent incarnation"));
  }
}

TEST_F(NcclAgentTest, ALinkThatCannotBeMadeIsReportedByConnect) {
  links_.FailJoins("Duplicate GPU detected: both ranks on one device");
  std::unique_ptr<Agent> third = NewAgent("third");
  const absl::Time start = absl::Now();
  absl::StatusOr<PeerId> p = third->Connect(receiver_->address(), In(absl::Seconds(30)));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kUnavailable) << p.status();
  EXPECT_THAT(p.status().message(), HasSubstr("Duplicate GPU detected"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(25));  // reported, not waited out
}

TEST_F(NcclAgentTest, ATransferPastItsDeadlineIsCutOffWhenItsRegionIsDeregistered) {
  links_.Hold();
  absl::StatusOr<std::unique_ptr<TransferHandle>> h =
      sender_->Submit(peer_, 1, descriptor_, {{.bytes = 4096}}, In(absl::Milliseconds(300)));
  ASSERT_TRUE(h.ok());
  EXPECT_FALSE((*h)->Poll().has_value());
  EXPECT_EQ((*h)->Wait().code(), absl::StatusCode::kDeadlineExceeded);
  // The sends still hold the region; deregistering closes their connection instead of waiting
  // for a link that is not moving.
  ASSERT_TRUE(sender_->DeregisterMemory(1).ok());
  // The receiver let go of its side too: its region can be deregistered.
  ASSERT_TRUE(receiver_->DeregisterMemory(7).ok());
  ASSERT_TRUE(sender_->RegisterMemory(2, src_.data(), src_.size()).ok());
  absl::StatusOr<std::unique_ptr<TransferHandle>> later =
      sender_->Submit(peer_, 2, descriptor_, {{.bytes = 8}}, In(absl::Seconds(5)));
  absl::Status s = later.ok() ? (*later)->Wait() : later.status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(links_.matched_bytes(), 0);
}

TEST_F(NcclAgentTest, APeerThatGoesAwayMidTransferFailsItWithUnavailable) {
  links_.Hold();
  absl::StatusOr<std::unique_ptr<TransferHandle>> h =
      sender_->Submit(peer_, 1, descriptor_, {{.bytes = 4096}}, In(absl::Seconds(60)));
  ASSERT_TRUE(h.ok());
  EXPECT_FALSE((*h)->Poll().has_value());
  const absl::Time start = absl::Now();
  receiver_.reset();
  absl::Status s = (*h)->Wait();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
  // The source region is free again.
  EXPECT_TRUE(sender_->DeregisterMemory(1).ok());
}

TEST_F(NcclAgentTest, DisconnectAndDestructionCancelWhatIsInFlight) {
  links_.Hold();
  absl::StatusOr<std::unique_ptr<TransferHandle>> h =
      sender_->Submit(peer_, 1, descriptor_, {{.bytes = 4096}}, In(absl::Seconds(60)));
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(sender_->Disconnect(peer_).ok());
  EXPECT_EQ((*h)->Wait().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(sender_->Disconnect(peer_).code(), absl::StatusCode::kNotFound);

  absl::StatusOr<PeerId> again = sender_->Connect(receiver_->address(), In(absl::Seconds(10)));
  ASSERT_TRUE(again.ok()) << again.status();
  h = sender_->Submit(*again, 1, descriptor_, {{.bytes = 4096}}, In(absl::Seconds(60)));
  ASSERT_TRUE(h.ok());
  sender_.reset();  // the handle outlives its agent
  EXPECT_EQ((*h)->Wait().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(links_.matched_bytes(), 0);
}

TEST(NcclAgentCreateTest, TheNcclLinksNeedACudaDevice) {
  absl::StatusOr<std::unique_ptr<Agent>> agent = Agent::Create({.backend = "nccl"});
  if (agent.ok()) GTEST_SKIP() << "a CUDA device is present; nccl_link_test covers it";
  EXPECT_THAT(agent.status().message(), HasSubstr("nccl"));
  EXPECT_TRUE(agent.status().code() == absl::StatusCode::kFailedPrecondition ||
              agent.status().code() == absl::StatusCode::kInvalidArgument)
      << agent.status();
}

}  // namespace
}  // namespace tandem::kvtransfer::nccl
