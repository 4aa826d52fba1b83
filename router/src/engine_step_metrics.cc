#include "tandem/router/engine_step_metrics.h"

namespace tandem::router {

EngineStepMetrics::EngineStepMetrics(MetricsRegistry& registry) {
  step_seconds_ = registry.AddHistogram(
      "tandem_step_seconds", "Measured engine steps (schedule, forward pass, sampling).",
      {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0,
       2.5});
  const char* names[] = {"intercept", "per_token", "per_seq", "per_context_token"};
  for (int i = 0; i < engine::StepLatencyModel::kNumTerms; ++i) {
    terms_[i] = registry.AddGauge(
        "tandem_step_latency_model_seconds",
        "Fitted step time terms: seconds, and seconds per batch token, per sequence and per "
        "context token.",
        {{"term", names[i]}});
  }
  samples_ = registry.AddGauge("tandem_step_latency_model_samples",
                               "Steps the latency model has been fitted on.");
  error_ratio_ = registry.AddGauge(
      "tandem_step_latency_model_error_ratio",
      "Recent mean of |predicted - measured| / measured step time, predicted before each step.");
}

void EngineStepMetrics::Record(const engine::EngineStats& stats) {
  if (stats.steps == steps_seen_) return;
  steps_seen_ = stats.steps;
  step_seconds_->Observe(stats.last_step_seconds);
  for (int i = 0; i < engine::StepLatencyModel::kNumTerms; ++i) {
    terms_[i]->Set(stats.step_model[i]);
  }
  samples_->Set(static_cast<double>(stats.step_model_samples));
  error_ratio_->Set(stats.step_model_error_ratio);
}

}  // namespace tandem::router
