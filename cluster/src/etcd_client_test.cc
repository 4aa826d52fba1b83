#include "tandem/cluster/etcd_client.h"

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <vector>

#include "etcd_test_server.h"
#include "gtest/gtest.h"

namespace tandem::cluster {
namespace {

using testing::EtcdServer;
using testing::WaitFor;
using std::chrono::milliseconds;

// How long a wait for something that must happen may last before the test calls it a hang.
// Generous: these waits return as soon as the condition holds, and a loaded machine (or a
// sanitizer build) may be slow; the product's timing guarantees are asserted separately.
constexpr milliseconds kHang{30000};

class EtcdClientTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = new EtcdServer();
    server_->Start();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_FALSE(HasFatalFailure());
    auto client = EtcdClient::Create({.endpoints = server_->url(), .timeout = absl::Seconds(2)});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }

  static EtcdServer* server_;
  std::unique_ptr<EtcdClient> client_;
};

EtcdServer* EtcdClientTest::server_ = nullptr;

TEST(EtcdEndpointsTest, ParsesAndRefuses) {
  auto parsed = ParseEndpoints("http://127.0.0.1:2379, 10.0.0.2:2379,http://[::1]:2379/");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed,
            (std::vector<std::string>{"127.0.0.1:2379", "10.0.0.2:2379", "[::1]:2379"}));
  EXPECT_FALSE(ParseEndpoints("").ok());
  EXPECT_FALSE(ParseEndpoints("https://127.0.0.1:2379").ok());
  EXPECT_FALSE(ParseEndpoints("127.0.0.1").ok());
  EXPECT_FALSE(ParseEndpoints("127.0.0.1:0").ok());
  // With TLS every endpoint is https: "http://" is refused, bare HOST:PORT uses TLS.
  auto secure = ParseEndpoints("https://127.0.0.1:2379,10.0.0.2:2379", /*tls=*/true);
  ASSERT_TRUE(secure.ok()) << secure.status();
  EXPECT_EQ(*secure, (std::vector<std::string>{"127.0.0.1:2379", "10.0.0.2:2379"}));
  EXPECT_FALSE(ParseEndpoints("https://127.0.0.1:2379,http://10.0.0.2:2379", true).ok());
  EXPECT_EQ(PrefixRangeEnd("/a/"), "/a0");
  EXPECT_EQ(PrefixRangeEnd(std::string("a\xff", 2)), "b");
  EXPECT_EQ(PrefixRangeEnd(""), std::string(1, '\0'));
}

TEST_F(EtcdClientTest, PutGetPrefixDelete) {
  auto missing = client_->Get("/kv/a");
  ASSERT_TRUE(missing.ok()) << missing.status();
  EXPECT_FALSE(missing->has_value());

  auto rev1 = client_->Put("/kv/a", "1");
  ASSERT_TRUE(rev1.ok()) << rev1.status();
  auto rev2 = client_->Put("/kv/b", "2");
  ASSERT_TRUE(rev2.ok());
  EXPECT_GT(*rev2, *rev1);
  ASSERT_TRUE(client_->Put("/kv/b", "22").ok());
  ASSERT_TRUE(client_->Put("/kv0", "outside").ok());
  ASSERT_TRUE(client_->Put("/kv/c/d", std::string("bin\0ary", 7)).ok());

  auto a = client_->Get("/kv/a");
  ASSERT_TRUE(a.ok() && a->has_value());
  EXPECT_EQ((*a)->value, "1");
  EXPECT_EQ((*a)->create_revision, *rev1);
  EXPECT_EQ((*a)->version, 1);

  auto listing = client_->GetPrefix("/kv/");
  ASSERT_TRUE(listing.ok()) << listing.status();
  ASSERT_EQ(listing->kvs.size(), 3u);
  EXPECT_EQ(listing->kvs[0].key, "/kv/a");
  EXPECT_EQ(listing->kvs[1].key, "/kv/b");
  EXPECT_EQ(listing->kvs[1].value, "22");
  EXPECT_EQ(listing->kvs[1].version, 2);
  EXPECT_EQ(listing->kvs[2].value, std::string("bin\0ary", 7));
  EXPECT_GE(listing->revision, listing->kvs[1].mod_revision);

  auto deleted = client_->Delete("/kv/a");
  ASSERT_TRUE(deleted.ok());
  EXPECT_EQ(*deleted, 1);
  EXPECT_EQ(*client_->Delete("/kv/a"), 0);
  EXPECT_EQ(*client_->DeletePrefix("/kv/"), 2);
  EXPECT_TRUE(client_->GetPrefix("/kv/")->kvs.empty());
  EXPECT_TRUE(client_->Get("/kv0")->has_value());
}

TEST_F(EtcdClientTest, CreateIfAbsent) {
  auto created = client_->CreateIfAbsent("/cia/x", "first");
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(*created);
  created = client_->CreateIfAbsent("/cia/x", "second");
  ASSERT_TRUE(created.ok());
  EXPECT_FALSE(*created);
  EXPECT_EQ((*client_->Get("/cia/x"))->value, "first");

  // A retry of a create on the same lease with the same value is not a conflict.
  auto lease = client_->LeaseGrant(absl::Seconds(5));
  ASSERT_TRUE(lease.ok()) << lease.status();
  EXPECT_TRUE(*client_->CreateIfAbsent("/cia/y", "v", *lease));
  EXPECT_TRUE(*client_->CreateIfAbsent("/cia/y", "v", *lease));
  EXPECT_FALSE(*client_->CreateIfAbsent("/cia/y", "other", *lease));
  EXPECT_FALSE(*client_->CreateIfAbsent("/cia/y", "v", 0));

  // After a delete the key can be created again.
  ASSERT_TRUE(client_->Delete("/cia/x").ok());
  EXPECT_TRUE(*client_->CreateIfAbsent("/cia/x", "third"));
  EXPECT_TRUE(client_->LeaseRevoke(*lease).ok());
}

TEST_F(EtcdClientTest, LeaseExpiryDeletesKeysAndRevokeIsImmediate) {
  auto lease = client_->LeaseGrant(absl::Seconds(1));
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(client_->Put("/lease/a", "x", *lease).ok());
  EXPECT_EQ((*client_->Get("/lease/a"))->lease, *lease);
  // The lease is not renewed: etcd deletes the key once the TTL runs out.
  EXPECT_TRUE(WaitFor([&] { return !client_->Get("/lease/a")->has_value(); }, kHang));
  EXPECT_TRUE(absl::IsNotFound(client_->LeaseRevoke(*lease)));

  auto second = client_->LeaseGrant(absl::Seconds(30));
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(client_->Put("/lease/b", "x", *second).ok());
  ASSERT_TRUE(client_->LeaseRevoke(*second).ok());
  EXPECT_FALSE(client_->Get("/lease/b")->has_value());

  // A put on an unknown lease is refused.
  EXPECT_FALSE(client_->Put("/lease/c", "x", *second).ok());
}

TEST_F(EtcdClientTest, KeepAliveKeepsLeaseAndReportsRevocation) {
  constexpr absl::Duration kTtl = absl::Seconds(2);
  const absl::Time granted = absl::Now();
  auto lease = client_->LeaseGrant(kTtl);
  ASSERT_TRUE(lease.ok());
  ASSERT_TRUE(client_->Put("/ka/a", "x", *lease).ok());
  std::atomic<int> lost_calls = 0;
  absl::Status lost;
  std::mutex mu;
  auto keeper = client_->KeepAlive(*lease, kTtl, absl::Milliseconds(300),
                                   [&](absl::Status why) {
                                     std::lock_guard lock(mu);
                                     lost = why;
                                     ++lost_calls;
                                   });
  // Unrenewed, the lease would be gone one TTL after the grant. Wait until etcd has confirmed
  // it alive later than two TTLs after the grant: only renewals can have kept it.
  ASSERT_TRUE(WaitFor(
      [&] { return lost_calls.load() > 0 || keeper->last_renewed() > granted + 2 * kTtl; },
      kHang));
  EXPECT_EQ(lost_calls.load(), 0);
  EXPECT_TRUE(client_->Get("/ka/a")->has_value());

  // Revoked behind its back: the keeper says the lease is gone, once.
  ASSERT_TRUE(client_->LeaseRevoke(*lease).ok());
  EXPECT_TRUE(WaitFor([&] { return lost_calls.load() >= 1; }, kHang));
  keeper->Stop();
  EXPECT_EQ(lost_calls.load(), 1);
  std::lock_guard lock(mu);
  EXPECT_TRUE(absl::IsNotFound(lost)) << lost;
}

TEST_F(EtcdClientTest, WatchDeliversEventsInOrderFromARevision) {
  auto start = client_->Put("/w/a", "1");
  ASSERT_TRUE(start.ok());
  ASSERT_TRUE(client_->Put("/w/b", "2").ok());
  std::mutex mu;
  std::vector<WatchEvent> events;
  // From the first put: history is replayed, then live events follow.
  auto watcher = client_->Watch("/w/", *start, [&](const WatchUpdate& update) {
    EXPECT_FALSE(update.resync);
    std::lock_guard lock(mu);
    for (const auto& e : update.events) events.push_back(e);
  });
  ASSERT_TRUE(client_->Delete("/w/a").ok());
  ASSERT_TRUE(client_->Put("/w0", "outside").ok());
  auto last = client_->Put("/w/c", "3");
  ASSERT_TRUE(last.ok());
  ASSERT_TRUE(WaitFor(
      [&] {
        std::lock_guard lock(mu);
        return events.size() >= 4;
      },
      kHang));
  watcher->Stop();
  std::lock_guard lock(mu);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].kv.key, "/w/a");
  EXPECT_EQ(events[0].type, WatchEvent::Type::kPut);
  EXPECT_EQ(events[1].kv.key, "/w/b");
  EXPECT_EQ(events[2].kv.key, "/w/a");
  EXPECT_EQ(events[2].type, WatchEvent::Type::kDelete);
  EXPECT_EQ(events[3].kv.value, "3");
  EXPECT_EQ(watcher->next_revision(), *last + 1);
}

TEST_F(EtcdClientTest, WatchFromACompactedRevisionResyncs) {
  auto first = client_->Put("/cw/a", "1");
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(client_->Put("/cw/b", "2").ok());
  ASSERT_TRUE(client_->Delete("/cw/a").ok());
  auto head = client_->Put("/cw/c", "3");
  ASSERT_TRUE(head.ok());
  ASSERT_TRUE(client_->Compact(*head).ok());
  std::mutex mu;
  std::vector<WatchUpdate> updates;
  auto watcher = client_->Watch("/cw/", *first, [&](const WatchUpdate& update) {
    std::lock_guard lock(mu);
    updates.push_back(update);
  });
  ASSERT_TRUE(WaitFor(
      [&] {
        std::lock_guard lock(mu);
        return !updates.empty();
      },
      kHang));
  ASSERT_TRUE(client_->Put("/cw/d", "4").ok());
  ASSERT_TRUE(WaitFor(
      [&] {
        std::lock_guard lock(mu);
        return updates.size() >= 2;
      },
      kHang));
  watcher->Stop();
  std::lock_guard lock(mu);
  ASSERT_TRUE(updates[0].resync);
  ASSERT_EQ(updates[0].snapshot.size(), 2u);
  EXPECT_EQ(updates[0].snapshot[0].key, "/cw/b");
  EXPECT_EQ(updates[0].snapshot[1].key, "/cw/c");
  EXPECT_GE(updates[0].revision, *head);
  ASSERT_FALSE(updates[1].resync);
  ASSERT_EQ(updates[1].events.size(), 1u);
  EXPECT_EQ(updates[1].events[0].kv.key, "/cw/d");
}

TEST_F(EtcdClientTest, FailsOverToTheNextEndpoint) {
  const std::string dead = absl::StrCat("127.0.0.1:", testing::FreeLoopbackPort());
  auto client = EtcdClient::Create(
      {.endpoints = absl::StrCat("http://", dead, ",", server_->url()),
       .timeout = absl::Seconds(2)});
  ASSERT_TRUE(client.ok());
  EXPECT_EQ((*client)->current_endpoint(), dead);
  ASSERT_TRUE((*client)->Put("/fo/a", "1").ok());
  EXPECT_EQ((*client)->current_endpoint(), server_->endpoint());
  EXPECT_EQ((*(*client)->Get("/fo/a"))->value, "1");

  // Only dead endpoints: Unavailable (not a wait for an endpoint to come up: a hang here would
  // time the test out).
  auto nowhere = EtcdClient::Create({.endpoints = dead, .timeout = absl::Seconds(2)});
  ASSERT_TRUE(nowhere.ok());
  auto answer = (*nowhere)->Get("/fo/a");
  EXPECT_TRUE(absl::IsUnavailable(answer.status())) << answer.status();
}

// etcd with --client-cert-auth on https, certificates from tests/tls/make-certs.sh.
class EtcdTlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const char* source = std::getenv("TANDEM_SOURCE_DIR");
    ASSERT_NE(source, nullptr) << "run under ctest (TANDEM_SOURCE_DIR)";
    certs_ = new std::string(absl::StrCat("/tmp/tandem-etcd-tls-", getpid()));
    ASSERT_EQ(std::system(absl::StrCat(source, "/tests/tls/make-certs.sh ", *certs_).c_str()), 0)
        << "tests/tls/make-certs.sh failed (is openssl installed? scripts/install-deps)";
    server_ = new EtcdServer(Files("ca", "server"));
    server_->Start();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    std::filesystem::remove_all(*certs_);
    delete certs_;
  }
  static proto::TlsFiles Files(const std::string& ca, const std::string& leaf) {
    return {.ca = absl::StrCat(*certs_, "/", ca, ".pem"),
            .cert = absl::StrCat(*certs_, "/", leaf, ".pem"),
            .key = absl::StrCat(*certs_, "/", leaf, ".key")};
  }

  static std::string* certs_;
  static EtcdServer* server_;
};

std::string* EtcdTlsTest::certs_ = nullptr;
EtcdServer* EtcdTlsTest::server_ = nullptr;

TEST_F(EtcdTlsTest, MutualTlsClientReadsAndWrites) {
  ASSERT_FALSE(HasFatalFailure());
  auto client = EtcdClient::Create(
      {.endpoints = server_->url(), .timeout = absl::Seconds(2), .tls = Files("ca", "client")});
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->Put("/tls/a", "1").ok());
  auto got = (*client)->Get("/tls/a");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)->value, "1");
}

TEST_F(EtcdTlsTest, RefusesClientsWithoutTheClusterCertificate) {
  ASSERT_FALSE(HasFatalFailure());
  // Plaintext to the TLS port.
  auto plain = EtcdClient::Create({.endpoints = server_->endpoint(), .timeout = absl::Seconds(2)});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE((*plain)->Get("/tls/a").ok());
  // A certificate of another CA.
  auto rogue = EtcdClient::Create(
      {.endpoints = server_->url(), .timeout = absl::Seconds(2), .tls = Files("ca", "rogue")});
  ASSERT_TRUE(rogue.ok()) << rogue.status();
  auto answer = (*rogue)->Get("/tls/a");
  EXPECT_TRUE(absl::IsUnavailable(answer.status())) << answer.status();
  // https without TLS files, and TLS files that cannot be read, are refused at Create.
  auto no_files = EtcdClient::Create({.endpoints = server_->url()});
  EXPECT_TRUE(absl::IsInvalidArgument(no_files.status())) << no_files.status();
  proto::TlsFiles missing = Files("ca", "client");
  missing.key = "/nonexistent/client.key";
  auto unreadable = EtcdClient::Create({.endpoints = server_->url(), .tls = missing});
  EXPECT_TRUE(absl::IsInvalidArgument(unreadable.status())) << unreadable.status();
  EXPECT_NE(unreadable.status().message().find("/nonexistent/client.key"), std::string::npos);
}

}  // namespace
}  // namespace tandem::cluster
