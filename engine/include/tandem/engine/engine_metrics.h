// The metric families every engine exports, each defined once: KV blocks, the batch,
// preemptions, and the measured step times with the online step latency model the SLO
// controllers use. Prefill and decode workers and the colocated server register them in their
// own metrics::Registry.
//
//   metrics::Registry registry;
//   engine::EngineMetrics engine_metrics(registry);
//   ... after each engine step, on the engine thread:
//   engine_metrics.Record(engine->stats());
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "tandem/engine/llm_engine.h"
#include "tandem/engine/sampling_metrics.h"
#include "tandem/engine/speculative_metrics.h"
#include "tandem/engine/step_latency_model.h"
#include "tandem/metrics/registry.h"

namespace tandem::engine {

class EngineMetrics {
 public:
  // Registers tandem_kv_cache_blocks_{used,capacity}, tandem_num_requests_{running,waiting},
  // tandem_preemptions_total, tandem_prefix_cache_{queries,hits}_tokens_total,
  // tandem_step_seconds, tandem_step_latency_model_{seconds{term},samples,error_ratio} and
  // speculative decoding's tandem_spec_{proposed,accepted}_tokens_total,
  // tandem_spec_verify_steps_total, tandem_spec_{proposed,accepted}_tokens_by_position_total
  // {position} and tandem_spec_mean_accepted_length.
  // tandem_tensor_parallel_collective_{seconds,bytes}_total and
  // tandem_sampled_tokens_total{device}.
  explicit EngineMetrics(metrics::Registry& registry);

  // Sets the KV, batch and preemption series from `stats`, then RecordSteps(stats).
  void Record(const EngineStats& stats);
  // Advances the prefix cache and speculative decoding counters, observes the steps run since the
  // last call (the last one's time stands for any missed) and refreshes the latency model's gauges.
  // Not thread-safe: call from one thread.
  void RecordSteps(const EngineStats& stats);

  // The KV, batch and preemption series, for an owner that keeps the counts elsewhere (a decode
  // worker's published snapshot) and calls RecordSteps only.
  prometheus::Gauge& kv_used;
  prometheus::Gauge& kv_capacity;
  prometheus::Gauge& running;
  prometheus::Gauge& waiting;
  prometheus::Counter& preemptions;

 private:
  prometheus::Counter& prefix_queries_;
  prometheus::Counter& prefix_hits_;
  prometheus::Histogram& step_seconds_;
  std::array<prometheus::Gauge*, StepLatencyModel::kNumTerms> terms_{};
  prometheus::Gauge& samples_;
  prometheus::Gauge& error_ratio_;
  SpeculativeMetrics spec_;
  SamplingMetrics sampling_;
  prometheus::Counter& collective_seconds_;
  prometheus::Counter& collective_bytes_;
  int64_t steps_seen_ = 0;
};

}  // namespace tandem::engine
