#include "kernels/src/cpu/thread_pool.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::kernels::cpu {
namespace {

TEST(ThreadPoolTest, RejectsZeroThreads) { EXPECT_FALSE(ThreadPool::Create(0).ok()); }

TEST(ThreadPoolTest, EveryIndexRunsExactlyOnceOverManyCalls) {
  for (int threads : {1, 2, 4}) {
    auto pool = ThreadPool::Create(threads);
    ASSERT_TRUE(pool.ok());
    ASSERT_EQ((*pool)->num_threads(), threads);
    // Back-to-back calls of varying shape, as a decode step issues them: a call must never see
    // chunks of the previous one.
    for (int call = 0; call < 3000; ++call) {
      const int64_t n = 1 + (call * 37) % 101;
      const int64_t grain = 1 + call % 7;
      std::vector<std::atomic<int>> hits(n);
      std::atomic<int> bad_thread{0};
      (*pool)->ParallelFor(n, grain, [&](int64_t begin, int64_t end, int thread) {
        if (thread < 0 || thread >= threads) bad_thread.fetch_add(1);
        if (threads > 1 && n > grain) EXPECT_LE(end - begin, grain);
        for (int64_t i = begin; i < end; ++i) hits[i].fetch_add(1);
      });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "call " << call << " i " << i;
      ASSERT_EQ(bad_thread.load(), 0);
    }
  }
}

TEST(ThreadPoolTest, ThreadIndexIsExclusiveWhileAChunkRuns) {
  auto pool = ThreadPool::Create(3);
  ASSERT_TRUE(pool.ok());
  std::vector<std::atomic<int>> in_use(3);
  std::atomic<int> clashes{0};
  for (int call = 0; call < 200; ++call) {
    (*pool)->ParallelFor(64, 1, [&](int64_t, int64_t, int thread) {
      if (in_use[thread].fetch_add(1) != 0) clashes.fetch_add(1);
      volatile int spin = 0;
      for (int i = 0; i < 2000; ++i) spin = spin + i;
      in_use[thread].fetch_sub(1);
    });
  }
  EXPECT_EQ(clashes.load(), 0);
}

TEST(ThreadPoolTest, WorkersWakeAfterSleeping) {
  auto pool = ThreadPool::Create(2);
  ASSERT_TRUE(pool.ok());
  for (int round = 0; round < 3; ++round) {
    // Longer than the spin window, so the worker is asleep when the next call comes.
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::atomic<int> sum{0};
    (*pool)->ParallelFor(1000, 10, [&](int64_t begin, int64_t end, int) {
      for (int64_t i = begin; i < end; ++i) sum.fetch_add(static_cast<int>(i));
    });
    EXPECT_EQ(sum.load(), 999 * 1000 / 2);
  }
}

}  // namespace
}  // namespace tandem::kernels::cpu
