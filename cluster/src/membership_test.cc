// WorkerRegistration and Membership against a real etcd.
#include "tandem/cluster/membership.h"

#include <atomic>
#include <mutex>
#include <vector>

#include "etcd_test_server.h"
#include "gtest/gtest.h"
#include "tandem/cluster/registration.h"

namespace tandem::cluster {
namespace {

using std::chrono::milliseconds;
using testing::EtcdServer;
using testing::WaitFor;

constexpr absl::Duration kTtl = absl::Seconds(2);
// How long a wait for something that must happen may last before the test calls it a hang.
// Generous: these waits return as soon as the condition holds, and a loaded machine (or a
// sanitizer build) may be slow.
constexpr milliseconds kHang{30000};

WorkerInfo Worker(const std::string& role, const std::string& id, int port) {
  WorkerInfo info;
  info.id = id;
  info.role = role;
  info.address = absl::StrCat("127.0.0.1:", port);
  info.metrics_address = absl::StrCat("127.0.0.1:", port + 1000);
  info.kv_backend = "ucx";
  info.kv_blocks_total = 512;
  return info;
}

// Records Membership callbacks.
struct Recorder {
  struct Call {
    std::string role, id;
    std::optional<WorkerInfo> info;
  };
  std::mutex mu;
  std::vector<Call> calls;

  MembershipCallback Callback() {
    return [this](const std::string& role, const std::string& id,
                  const std::optional<WorkerInfo>& info) {
      std::lock_guard lock(mu);
      calls.push_back({role, id, info});
    };
  }
  // Waits for a call about role/id that is a join/update (present) or a leave (!present).
  bool WaitForCall(const std::string& role, const std::string& id, bool present,
                   milliseconds timeout) {
    return WaitFor(
        [&] {
          std::lock_guard lock(mu);
          for (const Call& call : calls) {
            if (call.role == role && call.id == id && call.info.has_value() == present) {
              return true;
            }
          }
          return false;
        },
        timeout);
  }
  size_t size() {
    std::lock_guard lock(mu);
    return calls.size();
  }
  void Clear() {
    std::lock_guard lock(mu);
    calls.clear();
  }
};

class MembershipTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_.Start();
    ASSERT_FALSE(HasFatalFailure());
    etcd_ = Client();
  }
  std::shared_ptr<EtcdClient> Client() {
    auto client = EtcdClient::Create({.endpoints = server_.url(), .timeout = absl::Seconds(2)});
    EXPECT_TRUE(client.ok()) << client.status();
    return std::shared_ptr<EtcdClient>(std::move(*client));
  }
  absl::StatusOr<std::unique_ptr<WorkerRegistration>> Register(
      const WorkerInfo& info, std::function<void(absl::Status)> on_lost = nullptr,
      std::function<void()> on_reregistered = nullptr, absl::Duration ttl = kTtl) {
    RegistrationOptions options;
    options.cluster = "test";
    options.worker = info;
    options.ttl = ttl;
    options.on_lost = std::move(on_lost);
    options.on_reregistered = std::move(on_reregistered);
    return WorkerRegistration::Register(Client(), std::move(options));
  }

  EtcdServer server_;
  std::shared_ptr<EtcdClient> etcd_;
};

TEST_F(MembershipTest, RegistrationIsCreateIfAbsentAndKeptAlive) {
  auto registration = Register(Worker("decode", "d1", 7002));
  ASSERT_TRUE(registration.ok()) << registration.status();
  const std::string key = "/tandem/test/workers/decode/d1";
  EXPECT_EQ((*registration)->key(), key);
  auto stored = etcd_->Get(key);
  ASSERT_TRUE(stored.ok() && stored->has_value());
  EXPECT_EQ((*stored)->lease, (*registration)->lease());
  auto info = WorkerInfoFromJson((*stored)->value);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_TRUE(info->SameAs(Worker("decode", "d1", 7002)));

  // A second worker with the same id and role is refused; the first is untouched.
  auto duplicate = Register(Worker("decode", "d1", 7003));
  EXPECT_TRUE(absl::IsAlreadyExists(duplicate.status())) << duplicate.status();
  // The same id in the other pool is another key.
  auto other_role = Register(Worker("prefill", "d1", 7001));
  EXPECT_TRUE(other_role.ok()) << other_role.status();

  // Renewals keep the key past three TTLs.
  std::this_thread::sleep_for(milliseconds(3 * 2000 + 500));
  stored = etcd_->Get(key);
  ASSERT_TRUE(stored.ok() && stored->has_value());
  EXPECT_EQ((*stored)->lease, (*registration)->lease());
  EXPECT_TRUE((*registration)->registered());

  // Unregister deletes the key at once.
  ASSERT_TRUE((*registration)->Unregister().ok());
  EXPECT_FALSE(etcd_->Get(key)->has_value());
  EXPECT_TRUE((*registration)->Unregister().ok());  // idempotent
  EXPECT_TRUE(Register(Worker("decode", "d1", 7003)).ok());
}

TEST_F(MembershipTest, RegistrationRefusesBadDescriptors) {
  EXPECT_TRUE(absl::IsInvalidArgument(Register(Worker("router", "r1", 1)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(Register(Worker("decode", "a/b", 1)).status()));
  EXPECT_TRUE(absl::IsInvalidArgument(Register(Worker("decode", "", 1)).status()));
  WorkerInfo no_address = Worker("decode", "d", 1);
  no_address.address.clear();
  EXPECT_TRUE(absl::IsInvalidArgument(Register(no_address).status()));
}

TEST_F(MembershipTest, LostLeaseIsReportedAndRegisteredAgain) {
  std::atomic<int> lost = 0, reregistered = 0;
  absl::Status why;
  std::mutex mu;
  auto registration = Register(
      Worker("prefill", "p1", 7001),
      [&](absl::Status status) {
        std::lock_guard lock(mu);
        why = status;
        ++lost;
      },
      [&] { ++reregistered; });
  ASSERT_TRUE(registration.ok()) << registration.status();
  const int64_t first_lease = (*registration)->lease();
  // Revoked behind its back (an operator, or etcd expiring it): etcd says the lease is gone.
  ASSERT_TRUE(etcd_->LeaseRevoke(first_lease).ok());
  ASSERT_TRUE(WaitFor([&] { return lost.load() == 1; }, kHang));
  {
    std::lock_guard lock(mu);
    EXPECT_TRUE(absl::IsNotFound(why)) << why;
  }
  ASSERT_TRUE(WaitFor([&] { return reregistered.load() == 1; }, kHang));
  EXPECT_TRUE((*registration)->registered());
  EXPECT_NE((*registration)->lease(), first_lease);
  auto stored = etcd_->Get((*registration)->key());
  ASSERT_TRUE(stored.ok() && stored->has_value());
  EXPECT_EQ((*stored)->lease, (*registration)->lease());
}

TEST_F(MembershipTest, SeesJoinsUpdatesAndLeaves) {
  auto early = Register(Worker("prefill", "p1", 7001));
  ASSERT_TRUE(early.ok()) << early.status();
  // Keys of other clusters and malformed values are not workers.
  ASSERT_TRUE(etcd_->Put("/tandem/other/workers/decode/x",
                         WorkerInfoToJson(Worker("decode", "x", 1))).ok());
  ASSERT_TRUE(etcd_->Put("/tandem/test/workers/decode/bad", "not json").ok());

  Recorder recorder;
  auto membership = Membership::Start(etcd_, "test", recorder.Callback());
  ASSERT_TRUE(membership.ok()) << membership.status();
  // The initial listing is reported before Start returns.
  ASSERT_EQ(recorder.size(), 1u);
  EXPECT_EQ(recorder.calls[0].id, "p1");
  ASSERT_EQ((*membership)->Workers("prefill").size(), 1u);
  EXPECT_TRUE((*membership)->Workers("decode").empty());
  recorder.Clear();

  // Join.
  auto d1 = Register(Worker("decode", "d1", 7002));
  ASSERT_TRUE(d1.ok());
  ASSERT_TRUE(recorder.WaitForCall("decode", "d1", true, kHang));
  auto found = (*membership)->Find("decode", "d1");
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->address, "127.0.0.1:7002");
  EXPECT_EQ(found->kv_blocks_total, 512);
  EXPECT_EQ(found->lease, (*d1)->lease());

  // Update (same key, new content).
  WorkerInfo bigger = Worker("decode", "d1", 7002);
  bigger.kv_blocks_total = 1024;
  recorder.Clear();
  ASSERT_TRUE(etcd_->Put((*d1)->key(), WorkerInfoToJson(bigger), (*d1)->lease()).ok());
  ASSERT_TRUE(recorder.WaitForCall("decode", "d1", true, kHang));
  EXPECT_EQ((*membership)->Find("decode", "d1")->kv_blocks_total, 1024);

  // Leave by Unregister: the key is gone from etcd when Unregister returns (no waiting for the
  // lease to expire), and the watch reports the leave.
  recorder.Clear();
  ASSERT_TRUE((*d1)->Unregister().ok());
  EXPECT_FALSE(etcd_->Get((*d1)->key())->has_value());
  ASSERT_TRUE(recorder.WaitForCall("decode", "d1", false, kHang));
  EXPECT_FALSE((*membership)->Find("decode", "d1").has_value());

  // Leave by lease expiry (renewals stopped, as when a worker dies): Abandon leaves the key in
  // etcd, and the leave is reported once the lease expires. The TTL is long enough that the key
  // is certainly still there right after Abandon (renewed at most TTL/3 before it).
  auto d2 = Register(Worker("decode", "d2", 7004), nullptr, nullptr, absl::Seconds(6));
  ASSERT_TRUE(d2.ok());
  ASSERT_TRUE(recorder.WaitForCall("decode", "d2", true, kHang));
  const auto start = std::chrono::steady_clock::now();
  (*d2)->Abandon();
  EXPECT_TRUE(etcd_->Get((*d2)->key())->has_value());
  EXPECT_TRUE((*membership)->Find("decode", "d2").has_value());
  ASSERT_TRUE(recorder.WaitForCall("decode", "d2", false, kHang));
  std::printf("lease-expiry leave seen %.2f s after Abandon (TTL 6 s)\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  EXPECT_TRUE((*membership)->Workers("decode").empty());
  EXPECT_EQ((*membership)->Workers("prefill").size(), 1u);
  EXPECT_GE((*membership)->revision(), 1);
}

TEST_F(MembershipTest, SurvivesEtcdRestart) {
  std::atomic<int> lost = 0, reregistered = 0;
  absl::Status why;
  std::mutex mu;
  auto p1 = Register(
      Worker("prefill", "p1", 7001),
      [&](absl::Status status) {
        std::lock_guard lock(mu);
        why = status;
        ++lost;
      },
      [&] { ++reregistered; });
  ASSERT_TRUE(p1.ok()) << p1.status();
  auto d1 = Register(Worker("decode", "d1", 7002));
  ASSERT_TRUE(d1.ok()) << d1.status();
  Recorder recorder;
  auto membership = Membership::Start(etcd_, "test", recorder.Callback());
  ASSERT_TRUE(membership.ok()) << membership.status();
  ASSERT_EQ(recorder.size(), 2u);

  // etcd goes away for longer than the TTL: the registration reports the lease lost.
  server_.Kill();
  const auto killed = std::chrono::steady_clock::now();
  ASSERT_TRUE(WaitFor([&] { return lost.load() >= 1; }, kHang));
  std::printf("lease loss reported %.2f s after etcd died (TTL 2 s)\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count());
  {
    std::lock_guard lock(mu);
    EXPECT_TRUE(absl::IsUnavailable(why)) << why;
  }
  EXPECT_FALSE((*p1)->registered());

  // etcd comes back with its data: p1 registers again, the watch resumes, and a worker that
  // joins now is seen.
  server_.Start();
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(WaitFor([&] { return reregistered.load() >= 1; }, kHang));
  recorder.Clear();
  auto d2 = Register(Worker("decode", "d2", 7004));
  ASSERT_TRUE(d2.ok()) << d2.status();
  ASSERT_TRUE(recorder.WaitForCall("decode", "d2", true, kHang));
  ASSERT_TRUE((*d1)->Unregister().ok());
  ASSERT_TRUE(recorder.WaitForCall("decode", "d1", false, kHang));

  // The snapshot equals what etcd holds.
  auto listing = etcd_->GetPrefix(WorkersPrefix("test"));
  ASSERT_TRUE(listing.ok()) << listing.status();
  ASSERT_EQ(listing->kvs.size(), 2u);
  ASSERT_TRUE(WaitFor([&] { return (*membership)->revision() >= listing->revision; },
                      kHang));
  auto decode = (*membership)->Workers("decode");
  auto prefill = (*membership)->Workers("prefill");
  ASSERT_EQ(decode.size(), 1u);
  EXPECT_EQ(decode[0].id, "d2");
  ASSERT_EQ(prefill.size(), 1u);
  EXPECT_EQ(prefill[0].id, "p1");
  EXPECT_EQ(prefill[0].lease, (*p1)->lease());
}

}  // namespace
}  // namespace tandem::cluster
