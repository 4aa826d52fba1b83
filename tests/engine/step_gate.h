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

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tandem::testing {

class StepGate : public std::enable_shared_from_this<StepGate> {
 public:
  // The function to set as EngineOptions::before_step (it keeps the gate alive).
  std::function<bool()> Hook() {
    return [self = shared_from_this()] { return self->Pass(); };
  }

  // Lets `steps` more steps run, then pauses. Allow(0) pauses before the next step.
  void Allow(int64_t steps) {
    absl::MutexLock lock(&mu_);
    allowed_ = steps;
    if (steps != 0) paused_ = false;  // a later WaitPaused waits for the next pause
  }

  // Lets every step run from now on.
  void Open() {
    absl::MutexLock lock(&mu_);
    allowed_ = -1;
    paused_ = false;
  }

  // Waits until the engine has skipped a step at the gate (it has work and is paused); false
  // if that does not happen within `timeout`, a bound for a hang, not a speed assumption.
  bool WaitPaused(absl::Duration timeout = absl::Seconds(120)) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&paused_), timeout);
  }

  // Steps that have run so far.
  int64_t passed() const {
    absl::MutexLock lock(&mu_);
    return passed_;
  }

  // Engine side: true when the step may run, false to skip it. A paused engine is asked again
  // at most every millisecond, so its loop stays responsive without spinning.
  bool Pass() {
    absl::MutexLock lock(&mu_);
    if (allowed_ == 0) {
      paused_ = true;
      if (!mu_.AwaitWithTimeout(absl::Condition(this, &StepGate::Released),
                                absl::Milliseconds(1))) {
        return false;
      }
    }
    if (allowed_ > 0) --allowed_;
    ++passed_;
    return true;
  }

 private:
  bool Released() const { return allowed_ != 0; }

  mutable absl::Mutex mu_;
  int64_t allowed_ = -1;  // -1: open; otherwise steps still allowed before pausing
  bool paused_ = false;   // the engine skipped a step since the last Allow/Open
  int64_t passed_ = 0;
};

}  // namespace tandem::testing
