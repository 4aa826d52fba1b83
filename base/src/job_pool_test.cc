#include "tandem/base/job_pool.h"

#include <atomic>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace tandem::base {
namespace {

TEST(JobPoolTest, RunsEveryJobOffTheCallersThread) {
  std::atomic<int> ran{0};
  std::atomic<int> on_caller{0};
  const std::thread::id caller = std::this_thread::get_id();
  {
    JobPool pool(2);
    for (int i = 0; i < 100; ++i) {
      ASSERT_TRUE(pool.Post([&] {
        if (std::this_thread::get_id() == caller) on_caller.fetch_add(1);
        ran.fetch_add(1);
      }));
    }
    absl::Notification last;
    ASSERT_TRUE(pool.Post([&] { last.Notify(); }));
    last.WaitForNotification();
  }
  EXPECT_EQ(ran.load(), 100);
  EXPECT_EQ(on_caller.load(), 0);
}

// A job that blocks holds one thread only: with two threads, a second job runs meanwhile.
TEST(JobPoolTest, ABlockedJobDoesNotHoldTheOthers) {
  JobPool pool(2);
  absl::Notification release, blocked_started, other_ran;
  ASSERT_TRUE(pool.Post([&] {
    blocked_started.Notify();
    release.WaitForNotification();
  }));
  blocked_started.WaitForNotification();
  ASSERT_TRUE(pool.Post([&] { other_ran.Notify(); }));
  other_ran.WaitForNotification();  // would hang if the blocked job held the pool
  release.Notify();
}

// Work owed an answer gets one: a job the pool never started runs its `dropped` instead, once;
// a job that was running finishes; nothing is accepted after Stop.
TEST(JobPoolTest, StopRunsTheDroppedFunctionOfJobsNotStarted) {
  JobPool pool(1);
  absl::Notification running, release;
  std::atomic<int> ran{0}, dropped{0};
  ASSERT_TRUE(pool.Post(
      [&] {
        running.Notify();
        release.WaitForNotification();
        ran.fetch_add(1);
      },
      [&] { dropped.fetch_add(100); }));
  running.WaitForNotification();
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(pool.Post([&] { ran.fetch_add(1); }, [&] { dropped.fetch_add(1); }));
  }
  std::thread stopper([&] { pool.Stop(); });
  // Stop waits for the running job; the five queued ones are dropped, not run.
  while (dropped.load() < 5) std::this_thread::yield();
  EXPECT_FALSE(pool.Post([&] { ran.fetch_add(1000); }, [&] { dropped.fetch_add(1000); }));
  release.Notify();
  stopper.join();
  EXPECT_EQ(ran.load(), 1);
  EXPECT_EQ(dropped.load(), 5);
  pool.Stop();  // again: returns at once
}

}  // namespace
}  // namespace tandem::base
