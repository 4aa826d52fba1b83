// Tensor-parallel ranks meeting on a real etcd (cluster/src/etcd_test_server.h): Gloo groups
// join through EtcdRendezvousStore and all-reduce, a rank that joined a previous incarnation is
// told to start again, a rank whose group never starts gives up, and a group's keys go with it.
#include "tandem/cluster/etcd_rendezvous_store.h"

#include <memory>
#include <thread>
#include <vector>

#include "etcd_test_server.h"
#include "gtest/gtest.h"
#include "tandem/collective/gloo_communicator.h"

namespace tandem::cluster {
namespace {

using testing::EtcdServer;

constexpr char kPrefix[] = "/tandem/tp/test-group/";

class EtcdRendezvousStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_.Start();
    ASSERT_FALSE(HasFatalFailure());
    auto client = EtcdClient::Create({.endpoints = server_.url(), .timeout = absl::Seconds(2)});
    ASSERT_TRUE(client.ok()) << client.status();
    etcd_ = std::move(client).value();
  }

  // Rank `rank` of `size`: its store and its communicator's first all-reduce of {rank + 1}.
  struct Joined {
    absl::Status status;
    float sum = 0;
  };
  Joined Join(int rank, int size, absl::Duration timeout = absl::Seconds(30)) {
    auto store = EtcdRendezvousStore::Create(*etcd_, kPrefix, rank, timeout);
    if (!store.ok()) return {store.status()};
    return JoinWith(**store, rank, size, timeout);
  }
  Joined JoinWith(EtcdRendezvousStore& store, int rank, int size, absl::Duration timeout) {
    auto comm = collective::CreateGlooCommunicator(
        {.rank = rank, .size = size, .store = &store, .connect_timeout = timeout});
    if (!comm.ok()) return {comm.status()};
    float value = static_cast<float>(rank + 1);
    absl::Status reduced = (*comm)->AllReduceSum(&value, 1);
    return {reduced, value};
  }

  EtcdServer server_;
  std::unique_ptr<EtcdClient> etcd_;
};

TEST_F(EtcdRendezvousStoreTest, ThreeRanksJoinAndAllReduceAndTheirKeysGoWithThem) {
  std::vector<Joined> joined(3);
  {
    std::vector<std::thread> ranks;
    // Followers first: they wait for rank 0's generation.
    for (int r : {2, 1, 0}) ranks.emplace_back([&, r] { joined[r] = Join(r, 3); });
    for (std::thread& t : ranks) t.join();
  }
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(joined[r].status.ok()) << "rank " << r << ": " << joined[r].status;
    EXPECT_EQ(joined[r].sum, 6.0f) << "rank " << r;
  }
  // Every store was destroyed, revoking its lease: nothing of the group is left.
  auto left = etcd_->GetPrefix(kPrefix);
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_TRUE(left->kvs.empty()) << left->kvs.size() << " keys left, first " << left->kvs[0].key;
}

TEST_F(EtcdRendezvousStoreTest, ARankOfAPreviousIncarnationIsToldToStartAgain) {
  // What a group killed a moment ago leaves behind until its leases expire.
  ASSERT_TRUE(etcd_->Put(std::string(kPrefix) + "generation", "0123456789abcdef").ok());
  // Rank 1 starts before the new rank 0 and joins the old generation; rank 0 then starts a new
  // one, and rank 1 must fail with Aborted instead of waiting out its join timeout.
  auto follower_store = EtcdRendezvousStore::Create(*etcd_, kPrefix, 1, absl::Seconds(60));
  ASSERT_TRUE(follower_store.ok()) << follower_store.status();
  ASSERT_EQ((*follower_store)->generation(), "0123456789abcdef");
  Joined stale;
  std::thread follower([&] { stale = JoinWith(**follower_store, 1, 2, absl::Seconds(60)); });
  auto leader_store = EtcdRendezvousStore::Create(*etcd_, kPrefix, 0, absl::Seconds(60));
  ASSERT_TRUE(leader_store.ok()) << leader_store.status();
  EXPECT_NE((*leader_store)->generation(), "0123456789abcdef");
  const absl::Time started = absl::Now();
  follower.join();
  EXPECT_FALSE(stale.status.ok());
  EXPECT_NE(stale.status.message().find("started again"), std::string::npos) << stale.status;
  EXPECT_LT(absl::Now() - started, absl::Seconds(30)) << "the stale rank waited out its timeout";
  follower_store->reset();
  leader_store->reset();
  // Started again, the pair joins.
  std::vector<Joined> joined(2);
  std::thread again([&] { joined[1] = Join(1, 2); });
  joined[0] = Join(0, 2);
  again.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(joined[r].status.ok()) << "rank " << r << ": " << joined[r].status;
    EXPECT_EQ(joined[r].sum, 3.0f);
  }
}

TEST_F(EtcdRendezvousStoreTest, AFollowerWhoseLeaderNeverStartsGivesUp) {
  auto store = EtcdRendezvousStore::Create(*etcd_, kPrefix, 1, absl::Seconds(1));
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), absl::StatusCode::kDeadlineExceeded) << store.status();
  EXPECT_NE(store.status().message().find("generation"), std::string::npos) << store.status();
}

TEST_F(EtcdRendezvousStoreTest, APrefixWithoutTrailingSlashIsRefused) {
  auto store = EtcdRendezvousStore::Create(*etcd_, "/tandem/tp/x", 0, absl::Seconds(1));
  EXPECT_EQ(store.status().code(), absl::StatusCode::kInvalidArgument) << store.status();
}

}  // namespace
}  // namespace tandem::cluster
