#include "tandem/engine/step_telemetry.h"

#include <algorithm>

namespace tandem::engine {

StepTelemetry::StepTelemetry(std::shared_ptr<StepTrace> trace, std::string_view role,
                             Clock clock)
    : trace_(std::move(trace)), role_(role), clock_(std::move(clock)) {}

void StepTelemetry::BeginStep() {
  step_start_ = Now();
  gap_seconds_ = -1;
  if (pending_after_last_step_) {
    gap_seconds_ = std::chrono::duration<double>(step_start_ - last_step_end_).count();
    step_gap_seconds_ = 0.9 * step_gap_seconds_ + 0.1 * std::min(1.0, gap_seconds_);
  }
  first_tokens_.clear();
  step_draft_seconds_ = 0;
}

void StepTelemetry::DraftPasses(int passes, double seconds) {
  if (passes <= 0 || !(seconds >= 0)) return;
  step_draft_seconds_ += seconds;
  const double per_pass = seconds / passes;
  draft_pass_seconds_ =
      draft_pass_seconds_ == 0 ? per_pass : 0.9 * draft_pass_seconds_ + 0.1 * per_pass;
}

void StepTelemetry::Scheduled(const SchedulerStep& step) {
  // The step's shape for the latency model: tokens, sequences, and the context attention reads.
  step_context_ = 0;
  step_prefill_tokens_ = 0;
  for (const ScheduledSequence& s : step.seqs) {
    step_context_ += s.seq->num_computed_tokens + s.num_new_tokens;
    step_prefill_tokens_ += std::clamp<int64_t>(
        s.seq->num_prompt_tokens - s.seq->num_computed_tokens, 0, s.num_new_tokens);
  }
  step_tokens_ = step.num_tokens;
  step_seqs_ = static_cast<int>(step.seqs.size());
}

void StepTelemetry::FirstToken(const std::string& request_id, int64_t prompt_tokens,
                               std::chrono::steady_clock::time_point added) {
  if (trace_ != nullptr) first_tokens_.push_back({request_id, prompt_tokens, added});
}

void StepTelemetry::EndStep(bool work_left) {
  // Measured from Schedule through sampling and output processing: what a decode step adds to
  // every running request's time per output token.
  last_step_seconds_ =
      std::chrono::duration<double>(Now() - step_start_).count();
  last_predicted_step_seconds_ =
      latency_model_.ready()
          ? latency_model_.Predict(step_tokens_, step_seqs_, step_context_) + step_draft_seconds_
          : 0;
  // The target's step: the draft passes are not what the model's shape describes.
  last_target_step_seconds_ = std::max(0.0, last_step_seconds_ - step_draft_seconds_);
  latency_model_.Observe(step_tokens_, step_seqs_, step_context_, last_target_step_seconds_);
  ++steps_;
  last_step_seqs_ = step_seqs_;
  last_step_end_ = Now();
  if (trace_ != nullptr) {
    trace_->RecordStep(role_, {.seconds = last_step_seconds_,
                               .gap_seconds = gap_seconds_,
                               .tokens = step_tokens_,
                               .prefill_tokens = step_prefill_tokens_,
                               .seqs = step_seqs_,
                               .context = step_context_});
    for (const FirstTokenRecord& f : first_tokens_) {
      trace_->RecordFirstToken(
          role_, f.request_id, f.prompt_tokens,
          std::chrono::duration<double>(last_step_end_ - f.added).count());
    }
  }
  pending_after_last_step_ = work_left;
}

}  // namespace tandem::engine
