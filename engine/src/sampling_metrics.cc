#include "tandem/engine/sampling_metrics.h"

namespace tandem::engine {
namespace {

constexpr const char* kHelp =
    "Tokens drawn since start, by where: in the backend (on the GPU with --sampling-device "
    "backend, only ids and log-probabilities copied back) or on the host from copied-back "
    "logits.";

}  // namespace

SamplingMetrics::SamplingMetrics(metrics::Registry& registry)
    : backend_(registry.Counter("tandem_sampled_tokens_total", kHelp, {{"device", "backend"}})),
      host_(registry.Counter("tandem_sampled_tokens_total", kHelp, {{"device", "host"}})) {}

void SamplingMetrics::Record(const EngineStats& stats) {
  metrics::AdvanceTo(backend_, static_cast<double>(stats.backend_sampled_tokens));
  metrics::AdvanceTo(host_, static_cast<double>(stats.host_sampled_tokens));
}

}  // namespace tandem::engine
