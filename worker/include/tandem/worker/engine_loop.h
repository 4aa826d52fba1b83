// The engine loop every worker runs: one thread owns the engine and all the worker keeps about
// its requests, and every other thread (gRPC handlers and reactors, Shutdown) marshals calls
// onto it. One iteration runs, in order: the functions posted since the last one (in the order
// they were posted), the deadlines that have passed, then the worker's `iterate` (one engine
// step and what follows it). With nothing posted and nothing to step the loop sleeps until the
// earliest deadline, the worker's own wake-up (`iterate`'s answer) or `idle_wake`, whichever
// is first.
//
// Stopping is a drain: once RequestStop() is called, stopping() turns true on the loop thread,
// iterations go on (posted functions still run) until `drained` says the worker is done, then
// `finish` runs and later posts are refused.
//
//   EngineLoop::Options options;
//   options.iterate = [&] { StepEngine(); return engine->has_unfinished()
//                                                   ? absl::ZeroDuration() :
//                                                   absl::InfiniteDuration(); };
//   options.drained = [&] { return jobs.empty(); };
//   auto loop = std::make_unique<EngineLoop>(std::move(options));
//   loop->Start();
//   loop->Post([&] { engine->Abort(id); });
//   absl::StatusOr<int> n = loop->Call<absl::StatusOr<int>>([&] { return 1; }, Stopped());
//   loop->SetDeadline("job/7", deadline, [&] { Fail("job 7"); });   // on the loop thread
//   loop->Stop();
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tandem::worker {

class EngineLoop {
 public:
  struct Options {
    // One iteration's own work, after the posted functions and the deadline sweep: typically
    // one engine step. Returns how long the loop may sleep if nothing is posted meanwhile
    // (ZeroDuration: iterate again at once; InfiniteDuration: until something happens).
    std::function<absl::Duration()> iterate;
    // While stopping, asked after each iteration: true (the default) ends the loop.
    std::function<bool()> drained;
    // Runs on the loop thread after the last iteration; posts made from here on are refused.
    std::function<void()> finish;
    // The longest the loop sleeps with nothing to do.
    absl::Duration idle_wake = absl::Milliseconds(20);
    // The clock deadlines are compared with (absl::Now unless a test replaces it).
    std::function<absl::Time()> clock;
  };

  // The loop thread starts with Start(), so the owner can hold the loop before `iterate` first
  // runs.
  explicit EngineLoop(Options options);
  // Starts the loop thread. Once.
  void Start();
  // Stop().
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Queues `fn` to run on the loop thread after everything posted before it. False once the
  // loop has finished: `fn` is then destroyed without running.
  bool Post(std::function<void()> fn);

  // Runs `fn` on the loop thread and returns its result, or `if_stopped` when the loop has
  // finished before running it. Never call it on the loop thread (it would wait for itself).
  template <typename T>
  T Call(std::function<T()> fn, T if_stopped) {
    auto promise = std::make_shared<std::promise<T>>();
    std::future<T> future = promise->get_future();
    if (!Post([promise, fn = std::move(fn)] { promise->set_value(fn()); })) return if_stopped;
    return future.get();
  }

  // Has the loop iterate once more soon, whatever `iterate` last asked for.
  void Wake();

  // Loop thread only. Runs `on_expiry` on the loop thread in the first iteration whose clock
  // reads `when` or later (after the posted functions); a deadline set again under the same
  // `key` replaces the earlier one. Deadlines of one iteration fire in time order.
  void SetDeadline(std::string key, absl::Time when, std::function<void()> on_expiry);
  // Loop thread only. Forgets the deadline of `key`, if any.
  void ClearDeadline(const std::string& key);
  // Loop thread only: the clock the deadlines use.
  absl::Time Now() const { return options_.clock(); }

  // Begins the drain (see the top of this file) and returns at once. Idempotent.
  void RequestStop();
  // RequestStop() and waits for the loop to finish (`finish` has run). Idempotent; never on the
  // loop thread.
  void Stop();
  // Loop thread only: RequestStop() has been called (seen by this iteration).
  bool stopping() const { return stop_since_.has_value(); }
  // Loop thread only: the clock when the loop first saw RequestStop().
  std::optional<absl::Time> stop_since() const { return stop_since_; }
  // Whether the caller runs on the loop thread.
  bool on_loop_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  void Run();
  // Fires the deadlines whose time has come; returns the earliest one left.
  absl::Time SweepDeadlines();

  Options options_;

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> posted_;  // guarded by mu_
  bool wake_requested_ = false;               // guarded by mu_
  bool stop_requested_ = false;               // guarded by mu_
  bool finished_ = false;                     // guarded by mu_

  // Loop thread only.
  struct Deadline {
    absl::Time when;
    std::function<void()> on_expiry;
  };
  std::map<std::string, Deadline> deadlines_;             // by key
  std::set<std::pair<absl::Time, std::string>> by_time_;  // (when, key) of deadlines_
  std::optional<absl::Time> stop_since_;

  std::thread thread_;
  std::once_flag joined_;
};

}  // namespace tandem::worker
