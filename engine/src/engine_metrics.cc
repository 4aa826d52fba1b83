#include "tandem/engine/engine_metrics.h"

#include <string>

namespace tandem::engine {

EngineMetrics::EngineMetrics(metrics::Registry& registry)
    : kv_used(registry.Gauge("tandem_kv_cache_blocks_used",
                             "KV cache blocks in use (on a decode worker, reserved ones too).")),
      kv_capacity(registry.Gauge("tandem_kv_cache_blocks_capacity", "KV cache blocks in all.")),
      running(registry.Gauge("tandem_num_requests_running", "Sequences in the running batch.")),
      waiting(registry.Gauge("tandem_num_requests_waiting",
                             "Sequences waiting for admission to the running batch.")),
      preemptions(registry.Counter("tandem_preemptions_total",
                                   "Sequences preempted (their KV dropped and recomputed).")),
      prefix_queries_(registry.Counter(
          "tandem_prefix_cache_queries_tokens_total",
          "Prompt tokens looked up in the prefix cache as sequences were admitted.")),
      prefix_hits_(registry.Counter("tandem_prefix_cache_hits_tokens_total",
                                    "Prompt tokens found in the prefix cache (or shared with "
                                    "another sample), not computed.")),
      step_seconds_(registry.Histogram("tandem_step_seconds",
                                       "Measured engine steps (schedule, forward pass, sampling).",
                                       {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075,
                                        0.1, 0.15, 0.25, 0.5, 1.0, 2.5})),
      samples_(registry.Gauge("tandem_step_latency_model_samples",
                              "Steps the latency model has been fitted on.")),
      error_ratio_(registry.Gauge(
          "tandem_step_latency_model_error_ratio",
          "Recent mean of |predicted - measured| / measured step time, predicted before each "
          "step.")),
      spec_(registry),
      sampling_(registry),
      collective_seconds_(registry.Counter(
          "tandem_tensor_parallel_collective_seconds_total",
          "Wall time rank 0 of a tensor-parallel group spent in collectives (step plans, "
          "all-reduces, the logits' all-gather).")),
      collective_bytes_(
          registry.Counter("tandem_tensor_parallel_collective_bytes_total",
                           "Payload bytes of rank 0's tensor-parallel collectives.")) {
  const char* names[] = {"intercept", "per_token", "per_seq", "per_context_token"};
  for (int i = 0; i < StepLatencyModel::kNumTerms; ++i) {
    terms_[i] = &registry.Gauge(
        "tandem_step_latency_model_seconds",
        "Fitted step time terms: seconds, and seconds per batch token, per sequence and per "
        "context token.",
        {{"term", names[i]}});
  }
}

void EngineMetrics::Record(const EngineStats& stats) {
  kv_used.Set(stats.kv_blocks_used);
  kv_capacity.Set(stats.kv_blocks_total);
  running.Set(stats.running);
  waiting.Set(stats.waiting);
  metrics::AdvanceTo(preemptions, static_cast<double>(stats.preemptions));
  RecordSteps(stats);
}

void EngineMetrics::RecordSteps(const EngineStats& stats) {
  metrics::AdvanceTo(prefix_queries_, static_cast<double>(stats.prefix_cache_queries_tokens));
  metrics::AdvanceTo(prefix_hits_, static_cast<double>(stats.prefix_cache_hits_tokens));
  spec_.Record(stats);
  sampling_.Record(stats);
  metrics::AdvanceTo(collective_seconds_, stats.collective_seconds);
  metrics::AdvanceTo(collective_bytes_, static_cast<double>(stats.collective_bytes));
  if (stats.steps == steps_seen_) return;
  steps_seen_ = stats.steps;
  step_seconds_.Observe(stats.last_step_seconds);
  const auto terms = stats.step_model.terms();
  for (int i = 0; i < StepLatencyModel::kNumTerms; ++i) terms_[i]->Set(terms[i]);
  samples_.Set(static_cast<double>(stats.step_model_samples));
  error_ratio_.Set(stats.step_model_error_ratio);
}

}  // namespace tandem::engine
