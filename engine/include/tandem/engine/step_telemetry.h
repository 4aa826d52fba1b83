// What an engine measures about its own steps, kept apart from the step itself: the time
// between steps while work waits (the owner's loop), each step's measured and predicted time,
// the online step latency model the SLO controllers read, and the optional step trace.
//
//   telemetry.BeginStep();                  // the step starts (after the pause point)
//   telemetry.Scheduled(step);              // its shape: tokens, sequences, context
//   telemetry.FirstToken(id, prompt, t);    // a request's first token was sampled
//   telemetry.EndStep(/*work_left=*/true);  // measured, fitted, traced
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/engine/scheduler.h"
#include "tandem/engine/step_latency_model.h"
#include "tandem/engine/step_trace.h"

namespace tandem::engine {

class StepTelemetry {
 public:
  // `trace` may be null (no trace); `role` names the engine's steps in it. `clock` is what the
  // steps are timed by (EngineOptions::clock); null: std::chrono::steady_clock.
  using Clock = std::function<std::chrono::steady_clock::time_point()>;
  StepTelemetry(std::shared_ptr<StepTrace> trace, std::string_view role, Clock clock = nullptr);

  // The time now, by the telemetry's clock (for the engine's own timings within a step).
  std::chrono::steady_clock::time_point Now() const {
    return clock_ ? clock_() : std::chrono::steady_clock::now();
  }

  // A step starts: the gap since the previous one (while work was pending) is averaged in.
  void BeginStep();
  // The step the scheduler planned.
  void Scheduled(const SchedulerStep& step);
  // A request's first token was sampled in this step (recorded in the trace, if any).
  void FirstToken(const std::string& request_id, int64_t prompt_tokens,
                  std::chrono::steady_clock::time_point added);
  // The step's speculative draft passes took `seconds` (of its time): the latency model learns
  // the target's step without them, and the draft passes' own mean time is kept apart.
  void DraftPasses(int passes, double seconds);
  // The step's tokens are sampled and processed: its time is measured, predicted beforehand by
  // the latency model, and fitted into it. `work_left`: the scheduler still has work.
  void EndStep(bool work_left);

  // Whether first tokens are wanted (a trace is being written).
  bool tracing() const { return trace_ != nullptr; }
  const StepLatencyModel& latency_model() const { return latency_model_; }
  int64_t steps() const { return steps_; }
  double last_step_seconds() const { return last_step_seconds_; }
  // The last step's time without its draft passes (what the latency model was given).
  double last_target_step_seconds() const { return last_target_step_seconds_; }
  double last_predicted_step_seconds() const { return last_predicted_step_seconds_; }
  // Recent mean time between one step's end and the next one's start while work was pending.
  double step_gap_seconds() const { return step_gap_seconds_; }
  int last_step_seqs() const { return last_step_seqs_; }
  // Recent mean time of one draft pass (one proposed token for each speculating sequence); 0
  // before any ran.
  double draft_pass_seconds() const { return draft_pass_seconds_; }

 private:
  struct FirstTokenRecord {
    std::string request_id;
    int64_t prompt_tokens = 0;
    std::chrono::steady_clock::time_point added;
  };

  std::shared_ptr<StepTrace> trace_;
  std::string role_;
  Clock clock_;
  StepLatencyModel latency_model_;
  int64_t steps_ = 0;
  double last_step_seconds_ = 0;
  double last_target_step_seconds_ = 0;
  double last_predicted_step_seconds_ = 0;
  double step_gap_seconds_ = 0;
  int last_step_seqs_ = 0;
  bool pending_after_last_step_ = false;
  std::chrono::steady_clock::time_point last_step_end_;
  // The running step.
  std::chrono::steady_clock::time_point step_start_;
  double gap_seconds_ = -1;  // since the previous step's end; -1 when no work was pending
  int step_tokens_ = 0;
  int step_seqs_ = 0;
  int64_t step_context_ = 0;
  int64_t step_prefill_tokens_ = 0;
  double step_draft_seconds_ = 0;
  double draft_pass_seconds_ = 0;
  std::vector<FirstTokenRecord> first_tokens_;
};

}  // namespace tandem::engine
