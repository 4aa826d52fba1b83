#include "tandem/worker/engine_loop.h"

#include <atomic>
#include <condition_variable>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::worker {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

// A clock the test moves by hand.
class FakeClock {
 public:
  absl::Time Now() {
    std::lock_guard<std::mutex> lock(mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    std::lock_guard<std::mutex> lock(mu_);
    now_ += d;
  }

 private:
  std::mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
};

std::unique_ptr<EngineLoop> Started(EngineLoop::Options options) {
  auto loop = std::make_unique<EngineLoop>(std::move(options));
  loop->Start();
  return loop;
}

// Runs nothing, waits for one full iteration to pass: a function posted after the first one
// runs only after the deadline sweep and `iterate` of the first one's iteration.
void Barrier(EngineLoop& loop) {
  ASSERT_TRUE(loop.Call<bool>([] { return true; }, false));
  ASSERT_TRUE(loop.Call<bool>([] { return true; }, false));
}

TEST(EngineLoopTest, PostedFunctionsRunOnTheLoopThreadInOrder) {
  auto loop = Started({});
  std::vector<int> ran;  // loop thread only
  std::atomic<bool> all_on_loop{true};
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(loop->Post([&, i] {
      if (!loop->on_loop_thread()) all_on_loop = false;
      ran.push_back(i);
    }));
  }
  const int count = loop->Call<int>([&] { return static_cast<int>(ran.size()); }, -1);
  EXPECT_EQ(count, 100);
  EXPECT_TRUE(all_on_loop.load());
  EXPECT_FALSE(loop->on_loop_thread());
  std::vector<int> want(100);
  for (int i = 0; i < 100; ++i) want[i] = i;
  EXPECT_EQ(loop->Call<std::vector<int>>([&] { return ran; }, {}), want);
}

TEST(EngineLoopTest, CallsFromManyThreadsEachGetTheirOwnAnswer) {
  auto loop = Started({});
  int counter = 0;  // loop thread only
  std::vector<int> answers(8);
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        int last = 0;
        for (int i = 0; i < 50; ++i) last = loop->Call<int>([&] { return ++counter; }, -1);
        answers[t] = last;
      });
    }
  }
  EXPECT_EQ(loop->Call<int>([&] { return counter; }, -1), 400);
  for (int a : answers) EXPECT_GT(a, 0);
}

TEST(EngineLoopTest, DeadlinesFireOnceTheirTimeComesInTimeOrder) {
  FakeClock clock;
  EngineLoop::Options options;
  options.clock = [&] { return clock.Now(); };
  auto loop = Started(std::move(options));
  std::vector<std::string> fired;  // loop thread only
  const absl::Time t0 = clock.Now();
  ASSERT_TRUE(loop->Call<bool>(
      [&] {
        loop->SetDeadline("late", t0 + absl::Seconds(3), [&] { fired.push_back("late"); });
        loop->SetDeadline("early", t0 + absl::Seconds(1), [&] { fired.push_back("early"); });
        loop->SetDeadline("cleared", t0 + absl::Seconds(1), [&] { fired.push_back("cleared"); });
        loop->SetDeadline("moved", t0 + absl::Seconds(1), [&] { fired.push_back("moved@1"); });
        // Set again under the same key: the later time and function replace the first.
        loop->SetDeadline("moved", t0 + absl::Seconds(2), [&] { fired.push_back("moved@2"); });
        loop->ClearDeadline("cleared");
        return true;
      },
      false));
  Barrier(*loop);
  EXPECT_THAT(loop->Call<std::vector<std::string>>([&] { return fired; }, {}), IsEmpty());

  clock.Advance(absl::Milliseconds(2500));
  loop->Wake();
  Barrier(*loop);
  EXPECT_THAT(loop->Call<std::vector<std::string>>([&] { return fired; }, {}),
              ElementsAre("early", "moved@2"));

  clock.Advance(absl::Seconds(10));
  loop->Wake();
  Barrier(*loop);
  EXPECT_THAT(loop->Call<std::vector<std::string>>([&] { return fired; }, {}),
              ElementsAre("early", "moved@2", "late"));
}

TEST(EngineLoopTest, ADeadlineInThePastFiresAtTheNextIterationAndMaySetAnother) {
  FakeClock clock;
  EngineLoop::Options options;
  options.clock = [&] { return clock.Now(); };
  auto loop = Started(std::move(options));
  std::vector<std::string> fired;
  ASSERT_TRUE(loop->Call<bool>(
      [&] {
        loop->SetDeadline("a", clock.Now() - absl::Seconds(1), [&] {
          fired.push_back("a");
          // Rearmed from its own expiry, for the future: does not fire in this sweep.
          loop->SetDeadline("a", clock.Now() + absl::Seconds(1), [&] { fired.push_back("a2"); });
        });
        return true;
      },
      false));
  Barrier(*loop);
  EXPECT_THAT(loop->Call<std::vector<std::string>>([&] { return fired; }, {}), ElementsAre("a"));
  clock.Advance(absl::Seconds(1));
  loop->Wake();
  Barrier(*loop);
  EXPECT_THAT(loop->Call<std::vector<std::string>>([&] { return fired; }, {}),
              ElementsAre("a", "a2"));
}

TEST(EngineLoopTest, IterateRunsUntilItsWorkIsDoneWithoutAnyPost) {
  std::promise<void> done;
  int work = 5;  // loop thread only
  EngineLoop::Options options;
  options.iterate = [&] {
    if (work == 0) return absl::InfiniteDuration();
    if (--work == 0) done.set_value();
    return absl::ZeroDuration();
  };
  auto loop = Started(std::move(options));
  // The loop does all five units with nothing posted or woken after its first iteration.
  EXPECT_EQ(done.get_future().wait_for(std::chrono::seconds(30)), std::future_status::ready);
}

TEST(EngineLoopTest, AnIdleLoopStillIteratesByItself) {
  std::mutex mu;
  std::condition_variable cv;
  int iterations = 0;
  EngineLoop::Options options;
  options.idle_wake = absl::Milliseconds(1);
  options.iterate = [&] {
    {
      std::lock_guard<std::mutex> lock(mu);
      ++iterations;
    }
    cv.notify_all();
    return absl::InfiniteDuration();
  };
  auto loop = Started(std::move(options));
  std::unique_lock<std::mutex> lock(mu);
  // A bound for a hang, not a speed assumption: nothing else wakes the loop.
  EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return iterations >= 5; }));
}

TEST(EngineLoopTest, StopDrainsUntilTheWorkerSaysSoThenFinishes) {
  std::atomic<bool> drained{false};
  std::atomic<int> finished{0};
  EngineLoop::Options options;
  options.drained = [&] { return drained.load(); };
  options.finish = [&] { finished.fetch_add(1); };
  auto loop = Started(std::move(options));

  EXPECT_FALSE(loop->Call<bool>([&] { return loop->stopping(); }, true));
  loop->RequestStop();
  // Draining: posted functions still run, and the loop knows it is stopping.
  EXPECT_TRUE(loop->Call<bool>([&] { return loop->stopping(); }, false));
  EXPECT_TRUE(loop->Call<bool>([&] { return loop->stop_since().has_value(); }, false));
  EXPECT_EQ(finished.load(), 0);

  drained = true;
  loop->Wake();
  loop->Stop();
  EXPECT_EQ(finished.load(), 1);
  // Finished: nothing runs any more, callers get the stopped answer at once.
  bool ran = false;
  EXPECT_FALSE(loop->Post([&] { ran = true; }));
  EXPECT_EQ(loop->Call<int>([] { return 1; }, -1), -1);
  EXPECT_FALSE(ran);
  loop->Stop();  // idempotent
  EXPECT_EQ(finished.load(), 1);
}

TEST(EngineLoopTest, ShutdownWithWorkPendingRunsEverythingPostedBeforeFinish) {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<void> blocked;
  int ran = 0;  // loop thread only
  int ran_at_finish = -1;
  EngineLoop::Options options;
  options.finish = [&] { ran_at_finish = ran; };
  auto loop = Started(std::move(options));
  // The loop is held inside the first function while the rest queue up behind it.
  ASSERT_TRUE(loop->Post([&] {
    blocked.set_value();
    released.wait();
    ++ran;
  }));
  blocked.get_future().wait();
  for (int i = 0; i < 999; ++i) ASSERT_TRUE(loop->Post([&] { ++ran; }));
  std::jthread stopper([&] { loop->Stop(); });
  release.set_value();
  stopper.join();
  EXPECT_EQ(ran_at_finish, 1000);
}

TEST(EngineLoopTest, DestroyingARunningLoopStopsIt) {
  std::atomic<int> finished{0};
  {
    EngineLoop::Options options;
    options.finish = [&] { finished.fetch_add(1); };
    auto loop = Started(std::move(options));
    ASSERT_TRUE(loop->Post([] {}));
  }
  EXPECT_EQ(finished.load(), 1);
}

}  // namespace
}  // namespace tandem::worker
