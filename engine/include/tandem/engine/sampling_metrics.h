// How the device runs the end of a step: where tokens are drawn (`--sampling-device`) and how
// many decode steps replayed a CUDA graph (`--enforce-eager` off), as metric families defined
// once: every engine exports them (a worker's EngineMetrics), and so does the API server for
// the engine or the pools behind it (the router sums its prefill workers', which draw first
// tokens, and its decode workers').
//
//   metrics::Registry registry;
//   engine::SamplingMetrics sampling(registry);
//   sampling.Record(generator.stats());  // from one thread
#pragma once

#include "prometheus/counter.h"
#include "tandem/engine/request.h"
#include "tandem/metrics/registry.h"

namespace tandem::engine {

class SamplingMetrics {
 public:
  // Registers tandem_sampled_tokens_total{device="backend"|"host"} and
  // tandem_graph_steps_total.
  explicit SamplingMetrics(metrics::Registry& registry);

  // Advances both series to `stats`' totals (never down). Not thread-safe.
  void Record(const EngineStats& stats);

 private:
  prometheus::Counter& backend_;
  prometheus::Counter& host_;
  prometheus::Counter& graph_steps_;
};

}  // namespace tandem::engine
