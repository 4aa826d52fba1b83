// Metrics every worker exports about its engine's steps: the measured step times and the
// online step latency model (engine::StepLatencyModel) the SLO controllers use.
//
//   router::MetricsRegistry registry;
//   router::EngineStepMetrics step(registry);
//   ... after each engine step, on the engine thread:
//   step.Record(engine->stats());
#pragma once

#include <array>
#include <cstdint>

#include "tandem/engine/llm_engine.h"
#include "tandem/engine/step_latency_model.h"
#include "tandem/router/metrics.h"

namespace tandem::router {

class EngineStepMetrics {
 public:
  // Registers tandem_step_seconds and tandem_step_latency_model_{seconds{term},samples,
  // error_ratio}.
  explicit EngineStepMetrics(MetricsRegistry& registry);

  // Observes the steps run since the last call (the last one's time stands for any missed)
  // and refreshes the model's gauges. Not thread-safe: call from one thread.
  void Record(const engine::EngineStats& stats);

 private:
  Histogram* step_seconds_ = nullptr;
  std::array<Gauge*, engine::StepLatencyModel::kNumTerms> terms_{};
  Gauge* samples_ = nullptr;
  Gauge* error_ratio_ = nullptr;
  int64_t steps_seen_ = 0;
};

}  // namespace tandem::router
