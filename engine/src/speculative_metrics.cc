#include "tandem/engine/speculative_metrics.h"

#include <string>

namespace tandem::engine {

SpeculativeMetrics::SpeculativeMetrics(metrics::Registry& registry)
    : registry_(registry),
      proposed_(registry.Counter(
          "tandem_spec_proposed_tokens_total",
          "Speculative decoding: draft tokens proposed and verified by a target step.")),
      accepted_(registry.Counter("tandem_spec_accepted_tokens_total",
                                 "Speculative decoding: draft tokens accepted.")),
      verify_steps_(registry.Counter(
          "tandem_spec_verify_steps_total",
          "Speculative decoding: sequence-steps that verified at least one draft token.")),
      mean_accepted_length_(registry.Gauge(
          "tandem_spec_mean_accepted_length",
          "Speculative decoding: tokens a verifying sequence-step produced on average since "
          "start (accepted draft tokens plus the one the target sampled).")) {}

void SpeculativeMetrics::Record(const EngineStats& stats) {
  metrics::AdvanceTo(proposed_, static_cast<double>(stats.spec_proposed_tokens));
  metrics::AdvanceTo(accepted_, static_cast<double>(stats.spec_accepted_tokens));
  metrics::AdvanceTo(verify_steps_, static_cast<double>(stats.spec_verify_steps));
  if (stats.spec_verify_steps > 0) {
    mean_accepted_length_.Set(1.0 + static_cast<double>(stats.spec_accepted_tokens) /
                                        static_cast<double>(stats.spec_verify_steps));
  }
  metrics::Registry& registry = registry_;
  while (proposed_by_position_.size() < stats.spec_proposed_by_position.size()) {
    const std::string position = std::to_string(proposed_by_position_.size());
    proposed_by_position_.push_back(&registry.Counter(
        "tandem_spec_proposed_tokens_by_position_total",
        "Speculative decoding: sequence-steps that proposed a draft token at this position "
        "(0: the first after the last real token).",
        {{"position", position}}));
    accepted_by_position_.push_back(&registry.Counter(
        "tandem_spec_accepted_tokens_by_position_total",
        "Speculative decoding: sequence-steps whose draft token at this position was accepted.",
        {{"position", position}}));
  }
  for (size_t i = 0; i < stats.spec_proposed_by_position.size(); ++i) {
    metrics::AdvanceTo(*proposed_by_position_[i],
                       static_cast<double>(stats.spec_proposed_by_position[i]));
    if (i < stats.spec_accepted_by_position.size()) {
      metrics::AdvanceTo(*accepted_by_position_[i],
                         static_cast<double>(stats.spec_accepted_by_position[i]));
    }
  }
}

}  // namespace tandem::engine
