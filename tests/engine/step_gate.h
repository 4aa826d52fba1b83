// A test-controlled pause point for an engine loop, so a test can catch a request in the middle
// of its work (mid-prefill, mid-generation) on purpose, whatever the speed of the machine.
//
// Plug it into EngineOptions::before_step; the engine then calls Pass() at the start of every
// step that has work. A gate starts open. Example:
//
//   auto gate = std::make_shared<StepGate>();
//   options.engine.before_step = gate->Hook();
//   gate->Allow(2);                        // two more steps, then hold the third
//   ... submit a long prompt ...
//   ASSERT_TRUE(gate->WaitHeld());         // two chunks computed, the engine waits
//   ... cancel, drain, let a deadline pass ...
//   gate->Open();                          // or Allow(1) to step once more
//
// A held engine does nothing else (no deadline sweep, no RPCs answered from its thread), so a
// test opens the gate before it shuts the engine's owner down: OpenOnExit() does it on every
// path out of a scope, a failed ASSERT included.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace tandem::testing {

class StepGate : public std::enable_shared_from_this<StepGate> {
 public:
  // The function to set as EngineOptions::before_step (it keeps the gate alive).
  std::function<void()> Hook() {
    return [self = shared_from_this()] { self->Pass(); };
  }

  // Lets `steps` more steps start, then holds the one after them. Allow(0) closes the gate.
  void Allow(int64_t steps) {
    absl::MutexLock lock(&mu_);
    allowed_ = steps;
    if (steps != 0) held_ = false;  // released: a later WaitHeld waits for the next hold
  }

  // Lets every step through from now on (a held one too).
  void Open() {
    absl::MutexLock lock(&mu_);
    allowed_ = -1;
    held_ = false;
  }

  // Waits until the engine is held at the gate; false if it is not within `timeout` (a bound
  // for a hang, not a speed assumption).
  bool WaitHeld(absl::Duration timeout = absl::Seconds(120)) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&held_), timeout);
  }

  // Waits until the engine is held at the gate or `done()` holds (checked under the gate's
  // lock at least every 10 ms); true when held.
  bool WaitHeldOr(const std::function<bool()>& done,
                  absl::Duration timeout = absl::Seconds(120)) {
    const absl::Time until = absl::Now() + timeout;
    absl::MutexLock lock(&mu_);
    while (!held_ && absl::Now() < until) {
      if (done()) return false;
      mu_.AwaitWithTimeout(absl::Condition(&held_), absl::Milliseconds(10));
    }
    return held_;
  }

  // Steps that have passed the gate so far.
  int64_t passed() const {
    absl::MutexLock lock(&mu_);
    return passed_;
  }

  // Opens the gate when the returned object goes out of scope.
  auto OpenOnExit() {
    return absl::MakeCleanup([self = shared_from_this()] { self->Open(); });
  }

  // Engine side: returns when the step may start.
  void Pass() {
    absl::MutexLock lock(&mu_);
    if (allowed_ == 0) {
      held_ = true;
      mu_.Await(absl::Condition(+[](int64_t* allowed) { return *allowed != 0; }, &allowed_));
    }
    if (allowed_ > 0) --allowed_;
    ++passed_;
  }

 private:
  mutable absl::Mutex mu_;
  int64_t allowed_ = -1;  // -1: open; otherwise steps still allowed before holding
  bool held_ = false;     // the engine waits in Pass()
  int64_t passed_ = 0;
};

}  // namespace tandem::testing
