// Speculative decoding's metric families, defined once: every engine exports them (a worker's
// EngineMetrics), and so does the API server for the engine or decode pool behind it (the
// router sums its decode workers').
//
//   metrics::Registry registry;
//   engine::SpeculativeMetrics spec(registry);
//   spec.Record(generator.stats());  // from one thread
#pragma once

#include <vector>

#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "tandem/engine/request.h"
#include "tandem/metrics/registry.h"

namespace tandem::engine {

class SpeculativeMetrics {
 public:
  // Registers tandem_spec_{proposed,accepted}_tokens_total, tandem_spec_verify_steps_total,
  // tandem_spec_{proposed,accepted}_tokens_by_position_total{position} (as positions appear)
  // and tandem_spec_mean_accepted_length.
  explicit SpeculativeMetrics(metrics::Registry& registry);

  // Advances the counters to `stats`' totals (never down) and sets the mean accepted length.
  // Not thread-safe: call from one thread (or under the caller's lock).
  void Record(const EngineStats& stats);

 private:
  metrics::Registry& registry_;  // for the per-position series
  prometheus::Counter& proposed_;
  prometheus::Counter& accepted_;
  prometheus::Counter& verify_steps_;
  prometheus::Gauge& mean_accepted_length_;
  std::vector<prometheus::Counter*> proposed_by_position_, accepted_by_position_;
};

}  // namespace tandem::engine
