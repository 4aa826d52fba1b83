// A test-controlled pause point for an engine, so a test can catch a request in the middle of
// its work (mid-prefill, mid-generation) on purpose, whatever the speed of the machine.
//
// Plug it into EngineOptions::before_step; the engine then asks the gate at the start of every
// step that has work. A gate starts open. While it is closed the engine skips its steps: no
// request makes progress, but the loop that owns the engine goes on taking commands (cancels,
// reservations, a drain, the deadline sweep), so a test can act on a paused request and watch
// the result without racing the engine. Example:
//
//   auto gate = std::make_shared<StepGate>();
//   options.engine.before_step = gate->Hook();
//   gate->Allow(2);                 // two more steps, then pause
//   ... submit a long prompt ...
//   ASSERT_TRUE(gate->WaitPaused());  // two chunks computed; nothing more will be
//   ... cancel it, drain the worker, let its deadline pass: the loop handles each at once ...
//   gate->Open();                   // or Allow(1) to step once more
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "absl/time/time.h"

// std::mutex rather than absl::Mutex: ThreadSanitizer sees the former's happens-before edges
// (Debian's abseil is not built with TSan, so its locks are invisible to it).
namespace tandem::testing {

class StepGate : public std::enable_shared_from_this<StepGate> {
 public:
  // The function to set as EngineOptions::before_step (it keeps the gate alive).
  std::function<bool()> Hook() {
    return [self = shared_from_this()] { return self->Pass(); };
  }

  // Lets `steps` more steps run, then pauses. Allow(0) pauses before the next step.
  void Allow(int64_t steps) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      allowed_ = steps;
      if (steps != 0) paused_ = false;  // a later WaitPaused waits for the next pause
    }
    changed_.notify_all();
  }

  // Lets every step run from now on.
  void Open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      allowed_ = -1;
      paused_ = false;
    }
    changed_.notify_all();
  }

  // Waits until the engine has skipped a step at the gate (it has work and is paused); false
  // if that does not happen within `timeout`, a bound for a hang, not a speed assumption.
  bool WaitPaused(absl::Duration timeout = absl::Seconds(120)) {
    std::unique_lock<std::mutex> lock(mu_);
    return changed_.wait_for(lock, absl::ToChronoNanoseconds(timeout), [&] { return paused_; });
  }

  // Steps that have run so far.
  int64_t passed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return passed_;
  }

  // Engine side: true when the step may run, false to skip it. A paused engine is asked again
  // at most every millisecond, so its loop stays responsive without spinning.
  bool Pass() {
    std::unique_lock<std::mutex> lock(mu_);
    if (allowed_ == 0) {
      if (!paused_) {
        paused_ = true;
        changed_.notify_all();
      }
      if (!changed_.wait_for(lock, std::chrono::milliseconds(1), [&] { return allowed_ != 0; })) {
        return false;
      }
    }
    if (allowed_ > 0) --allowed_;
    ++passed_;
    return true;
  }

 private:
  mutable std::mutex mu_;
  std::condition_variable changed_;
  int64_t allowed_ = -1;  // -1: open; otherwise steps still allowed before pausing
  bool paused_ = false;   // the engine skipped a step since the last Allow/Open
  int64_t passed_ = 0;
};

}  // namespace tandem::testing
