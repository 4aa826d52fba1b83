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
      host_(registry.Counter("tandem_sampled_tokens_total", kHelp, {{"device", "host"}})),
      graph_steps_(registry.Counter(
          "tandem_graph_steps_total",
          "Decode steps replayed from a captured CUDA graph (padded to a captured batch size) "
          "instead of launched kernel by kernel; 0 with --enforce-eager or on the CPU.")) {}

void SamplingMetrics::Record(const EngineStats& stats) {
  metrics::AdvanceTo(backend_, static_cast<double>(stats.backend_sampled_tokens));
  metrics::AdvanceTo(host_, static_cast<double>(stats.host_sampled_tokens));
  metrics::AdvanceTo(graph_steps_, static_cast<double>(stats.graph_steps));
}

}  // namespace tandem::engine
