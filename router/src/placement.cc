#include "placement.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace tandem::router {
namespace {

int64_t FreeBlocks(const WorkerView& w) {
  return int64_t{w.stats.kv_blocks_total()} - w.stats.kv_blocks_used() - w.pending_load;
}

int64_t Running(const WorkerView& w) { return int64_t{w.stats.running()} + w.pending_requests; }

}  // namespace

int EstimateBlocks(int prompt_len, int n) { return std::max(1, n) * ((prompt_len + 15) / 16); }

std::vector<const WorkerView*> RankDecode(const PoolSnapshot& pools, int blocks_needed) {
  std::vector<const WorkerView*> order;
  for (const WorkerView& w : pools.decode) {
    if (w.up) order.push_back(&w);
  }
  std::stable_sort(order.begin(), order.end(), [&](const WorkerView* a, const WorkerView* b) {
    const bool fits_a = FreeBlocks(*a) >= blocks_needed;
    const bool fits_b = FreeBlocks(*b) >= blocks_needed;
    if (fits_a != fits_b) return fits_a;
    if (Running(*a) != Running(*b)) return Running(*a) < Running(*b);
    return FreeBlocks(*a) > FreeBlocks(*b);
  });
  return order;
}

const WorkerView* PickPrefill(const PoolSnapshot& pools) {
  const WorkerView* best = nullptr;
  int64_t best_load = 0;
  for (const WorkerView& w : pools.prefill) {
    if (!w.up) continue;
    const int64_t load = w.stats.queued_prefill_tokens() + w.pending_load;
    if (best == nullptr || load < best_load) {
      best = &w;
      best_load = load;
    }
  }
  return best;
}

std::optional<double> PredictTtft(const PoolSnapshot& pools, int64_t tokens) {
  std::optional<double> best;
  for (const WorkerView& w : pools.prefill) {
    if (!w.up || w.samples < kMinModelSamples) return std::nullopt;  // not yet known
    const double predicted =
        static_cast<double>(w.stats.queued_prefill_tokens() + w.pending_load + tokens) *
        w.seconds_per_token;
    if (!best || predicted < *best) best = predicted;
  }
  return best;
}

absl::Status AdmitByTtft(const PoolSnapshot& pools, int64_t tokens,
                         std::optional<double> target_seconds) {
  if (!target_seconds) return absl::OkStatus();
  const std::optional<double> predicted = PredictTtft(pools, tokens);
  if (predicted && *predicted > *target_seconds) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "the server is overloaded: the predicted time to first token (%.3f s) exceeds the "
        "target of %.3f s; retry later",
        *predicted, *target_seconds));
  }
  return absl::OkStatus();
}

}  // namespace tandem::router
