#include "tandem/collective/gloo_communicator.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace tandem::collective {
namespace {

// A fresh directory for one group's file store, removed afterwards.
class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "gloo_test_XXXXXX").string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

enum class Rendezvous { kFileStore, kTcpStore };

// Runs body(rank, comm) on one thread per rank, each with its own communicator; joins them all.
// `timeout` is the collectives'; joining may take a minute.
void RunGroup(int size, Rendezvous how, absl::Duration timeout,
              const std::function<void(int, Communicator&)>& body) {
  TempDir dir;
  std::unique_ptr<TcpStoreServer> server;
  if (how == Rendezvous::kTcpStore) {
    auto started = TcpStoreServer::Start("127.0.0.1:0");
    ASSERT_TRUE(started.ok()) << started.status();
    server = std::move(started).value();
  }
  std::vector<std::jthread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      GlooOptions options{
          .rank = rank, .size = size, .timeout = timeout, .connect_timeout = absl::Minutes(1)};
      absl::StatusOr<std::unique_ptr<Communicator>> comm;
      if (how == Rendezvous::kFileStore) {
        options.file_store_dir = dir.path();
        comm = CreateGlooCommunicator(options);
      } else if (rank == 0) {
        comm = CreateGlooCommunicatorWithServer(options, *server);
      } else {
        options.leader_address = server->address();
        comm = CreateGlooCommunicator(options);
      }
      ASSERT_TRUE(comm.ok()) << comm.status();
      EXPECT_EQ((*comm)->rank(), rank);
      EXPECT_EQ((*comm)->size(), size);
      body(rank, **comm);
    });
  }
}

class GlooGroupTest : public ::testing::TestWithParam<std::tuple<int, Rendezvous>> {};

TEST_P(GlooGroupTest, EveryCollectiveGivesTheSameResultOnEveryRank) {
  const auto [size, how] = GetParam();
  RunGroup(size, how, absl::Seconds(60), [size = size](int rank, Communicator& comm) {
    // All-reduce: rank r contributes (r + 1) * i, over more than one Gloo segment.
    std::vector<float> values(300000);
    for (size_t i = 0; i < values.size(); ++i)
      values[i] = static_cast<float>((rank + 1) * (i % 97));
    ASSERT_TRUE(comm.AllReduceSum(values.data(), values.size()).ok());
    const float ranks_sum = size * (size + 1) / 2.0f;
    for (size_t i = 0; i < values.size(); i += 997) {
      ASSERT_EQ(values[i], ranks_sum * static_cast<float>(i % 97)) << "element " << i;
    }
    // All-gather: each rank's 5 ints land at its offset.
    std::vector<int32_t> mine(5);
    std::iota(mine.begin(), mine.end(), 100 * rank);
    std::vector<int32_t> all(5 * size, -1);
    ASSERT_TRUE(comm.AllGather(mine.data(), all.data(), mine.size() * sizeof(int32_t)).ok());
    for (int r = 0; r < size; ++r) {
      for (int i = 0; i < 5; ++i) EXPECT_EQ(all[r * 5 + i], 100 * r + i);
    }
    // Broadcast from every root in turn.
    for (int root = 0; root < size; ++root) {
      std::string text = rank == root ? absl::StrCat("from rank ", root) : std::string(11, '?');
      text.resize(11);
      ASSERT_TRUE(comm.Broadcast(text.data(), text.size(), root).ok());
      EXPECT_EQ(text, absl::StrCat("from rank ", root).substr(0, 11));
    }
    // All-gather of byte strings of different lengths (an empty one among them).
    auto strings = comm.AllGatherBytes(std::string(static_cast<size_t>(rank) * 7, 'a' + rank), 64);
    ASSERT_TRUE(strings.ok()) << strings.status();
    ASSERT_EQ(strings->size(), static_cast<size_t>(size));
    for (int r = 0; r < size; ++r) {
      EXPECT_EQ((*strings)[r], std::string(static_cast<size_t>(r) * 7, 'a' + r));
    }
    // Past the slots: refused on this rank before anything is sent.
    EXPECT_EQ(comm.AllGatherBytes(std::string(65, 'x'), 64).status().code(),
              absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(comm.Barrier().ok());
    EXPECT_GE(comm.stats().calls, static_cast<uint64_t>(3 + size));
    EXPECT_GE(comm.stats().bytes, values.size() * sizeof(float));
    EXPECT_TRUE(comm.health().ok());
  });
}

INSTANTIATE_TEST_SUITE_P(SizesAndStores, GlooGroupTest,
                         ::testing::Combine(::testing::Values(2, 3, 4),
                                            ::testing::Values(Rendezvous::kFileStore,
                                                              Rendezvous::kTcpStore)),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param), "Ranks",
                                               std::get<1>(info.param) == Rendezvous::kFileStore
                                                   ? "FileStore"
                                                   : "TcpStore");
                         });

TEST(GlooCommunicatorTest, AGroupOfOneNeedsNoPeer) {
  RunGroup(1, Rendezvous::kFileStore, absl::Seconds(10), [](int, Communicator& comm) {
    float x[2] = {1.5f, 2.5f};
    ASSERT_TRUE(comm.AllReduceSum(x, 2).ok());
    EXPECT_EQ(x[1], 2.5f);
    float y[2];
    ASSERT_TRUE(comm.AllGather(x, y, sizeof(x)).ok());
    EXPECT_EQ(y[0], 1.5f);
    EXPECT_TRUE(comm.Broadcast(x, sizeof(x), 0).ok());
    EXPECT_TRUE(comm.Barrier().ok());
  });
}

// A rank that stops taking part (alive, but never calling the collective): the others fail at
// the group's timeout, and stay failed. The first to fail does so with DeadlineExceeded; Gloo
// closes a pair whose operation timed out, so a rank whose own deadline had not fired yet may
// see that closed connection first and fail with Unavailable. Neither waits longer.
TEST(GlooCommunicatorTest, ARankThatStopsMakesTheOthersTimeOut) {
  absl::Notification others_done;
  absl::Mutex mu;
  std::vector<absl::Status> failures;
  RunGroup(3, Rendezvous::kTcpStore, absl::Milliseconds(500), [&](int rank, Communicator& comm) {
    if (rank == 2) {
      others_done.WaitForNotification();  // keeps its connections open, calls nothing
      return;
    }
    float x = 1;
    const absl::Status status = comm.AllReduceSum(&x, 1);
    EXPECT_TRUE(status.code() == absl::StatusCode::kDeadlineExceeded ||
                status.code() == absl::StatusCode::kUnavailable)
        << status;
    EXPECT_NE(status.message().find("all-reduce on rank"), std::string::npos) << status;
    // Out of step now: every later call returns the first error.
    EXPECT_EQ(comm.Barrier(), status);
    EXPECT_EQ(comm.health(), status);
    absl::MutexLock lock(&mu);
    failures.push_back(status);
    if (failures.size() == 2) others_done.Notify();
  });
  ASSERT_EQ(failures.size(), 2u);
  // No connection had closed before the first deadline fired: that failure is a timeout.
  const bool a_timeout = failures[0].code() == absl::StatusCode::kDeadlineExceeded ||
                         failures[1].code() == absl::StatusCode::kDeadlineExceeded;
  EXPECT_TRUE(a_timeout) << failures[0] << " / " << failures[1];
}

// A rank whose communicator goes away (its connections close, as when its process exits): the
// others fail with Unavailable, even when they would wait forever for it.
TEST(GlooCommunicatorTest, ARankThatLeavesFailsTheOthersAtOnce) {
  RunGroup(3, Rendezvous::kFileStore, absl::Hours(1), [&](int rank, Communicator& comm) {
    float x = 1;
    ASSERT_TRUE(comm.AllReduceSum(&x, 1).ok());
    if (rank == 1) return;  // RunGroup's thread destroys its communicator
    int32_t step = 0;
    // Rank 1 is root: it will never send.
    absl::Status status = comm.Broadcast(&step, sizeof(step), 1, absl::InfiniteDuration());
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  });
}

// The same with a real process that is killed (SIGKILL) after joining the group.
TEST(GlooCommunicatorTest, AKilledRankProcessFailsTheLeaderAtOnce) {
  auto started = TcpStoreServer::Start("127.0.0.1:0");
  ASSERT_TRUE(started.ok()) << started.status();
  const std::string address = (*started)->address();
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto comm = CreateGlooCommunicator(
        {.rank = 1, .size = 2, .leader_address = address, .timeout = absl::Seconds(60)});
    if (!comm.ok()) ::_exit(2);
    float x = 2;
    if (!(*comm)->AllReduceSum(&x, 1).ok()) ::_exit(3);
    ::raise(SIGKILL);
    ::_exit(4);
  }
  auto comm = CreateGlooCommunicatorWithServer({.rank = 0, .size = 2, .timeout = absl::Seconds(60)},
                                               **started);
  ASSERT_TRUE(comm.ok()) << comm.status();
  float x = 1;
  ASSERT_TRUE((*comm)->AllReduceSum(&x, 1).ok());
  EXPECT_EQ(x, 3.0f);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == SIGKILL) << wstatus;
  int32_t step = 0;
  absl::Status status = (*comm)->Broadcast(&step, sizeof(step), 0, absl::InfiniteDuration());
  if (status.ok()) status = (*comm)->AllReduceSum(&x, 1);  // a send may still be buffered
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
}

TEST(GlooCommunicatorTest, ARankThatNeverJoinsFailsTheRendezvous) {
  TempDir dir;
  auto comm = CreateGlooCommunicator({.rank = 0,
                                      .size = 2,
                                      .file_store_dir = dir.path(),
                                      .connect_timeout = absl::Milliseconds(300)});
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_NE(comm.status().message().find("rendezvous of rank 0 of 2"), std::string::npos)
      << comm.status();
  auto tcp = CreateGlooCommunicator({.rank = 1,
                                     .size = 2,
                                     .leader_address = "127.0.0.1:1",
                                     .connect_timeout = absl::Milliseconds(300)});
  ASSERT_FALSE(tcp.ok());
  EXPECT_EQ(tcp.status().code(), absl::StatusCode::kDeadlineExceeded) << tcp.status();
  EXPECT_NE(tcp.status().message().find("no rendezvous store at 127.0.0.1:1"), std::string::npos)
      << tcp.status();
}

TEST(GlooCommunicatorTest, RefusesOptionsThatCannotWork) {
  TempDir dir;
  auto bad_rank = CreateGlooCommunicator({.rank = 2, .size = 2, .file_store_dir = dir.path()});
  EXPECT_EQ(bad_rank.status().code(), absl::StatusCode::kInvalidArgument);
  auto both = CreateGlooCommunicator(
      {.rank = 0, .size = 2, .file_store_dir = dir.path(), .leader_address = "127.0.0.1:0"});
  EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument);
  auto neither = CreateGlooCommunicator({.rank = 0, .size = 2});
  EXPECT_EQ(neither.status().code(), absl::StatusCode::kInvalidArgument);
  auto bad_address = CreateGlooCommunicator({.rank = 0, .size = 2, .leader_address = "nope"});
  EXPECT_EQ(bad_address.status().code(), absl::StatusCode::kInvalidArgument)
      << bad_address.status();
}

}  // namespace
}  // namespace tandem::collective
