#include "placement.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tandem::router {
namespace {

int64_t FreeBlocks(const WorkerView& w) {
  return int64_t{w.stats.kv_blocks_total()} - w.stats.kv_blocks_used() - w.pending_load;
}

// Up and not draining: a draining worker still answers Stats but refuses new work.
bool TakesWork(const WorkerView& w) { return w.up && !w.stats.draining(); }

int64_t Running(const WorkerView& w) { return int64_t{w.stats.running()} + w.pending_requests; }

int64_t Cached(const RouteRequest& request, const WorkerView& w) {
  if (request.routing != Routing::kKvAware || request.hits == nullptr) return 0;
  return std::clamp<int64_t>(request.hits->On(w), 0, request.prompt_tokens);
}

}  // namespace

absl::StatusOr<Routing> ParseRouting(std::string_view name) {
  if (name == "kv-aware") return Routing::kKvAware;
  if (name == "load") return Routing::kLoad;
  return absl::InvalidArgumentError(
      absl::StrCat("--routing must be kv-aware or load, not '", std::string(name), "'"));
}

const char* RoutingName(Routing routing) {
  return routing == Routing::kKvAware ? "kv-aware" : "load";
}

const char* RouteReasonName(RouteReason reason) {
  switch (reason) {
    case RouteReason::kKvHit:
      return "kv_hit";
    case RouteReason::kKvMiss:
      return "kv_miss";
    default:
      return "load";
  }
}

RouteReason ReasonFor(const RouteRequest& request, const WorkerView& chosen) {
  if (request.routing != Routing::kKvAware) return RouteReason::kLoad;
  return Cached(request, chosen) > 0 ? RouteReason::kKvHit : RouteReason::kKvMiss;
}

int64_t PrefillTokens(const RouteRequest& request, const WorkerView& w) {
  const int n = std::max(1, request.n);
  if (request.routing != Routing::kKvAware) return request.prompt_tokens * n;
  // The last prompt token is always computed (its logits give the first token).
  const int64_t cached = std::min(Cached(request, w), std::max<int64_t>(request.prompt_tokens - 1, 0));
  return request.prompt_tokens - cached + (n - 1);
}

int64_t TokensToMove(const RouteRequest& request, const WorkerView& w) {
  return (request.prompt_tokens - Cached(request, w)) * std::max(1, request.n);
}

int EstimateBlocks(int prompt_len, int n) { return std::max(1, n) * ((prompt_len + 15) / 16); }

std::vector<const WorkerView*> RankDecode(const PoolSnapshot& pools, int blocks_needed,
                                          const RouteRequest& request) {
  const bool kv_aware = request.routing == Routing::kKvAware;
  auto cost = [&](const WorkerView& w) {
    return TokensToMove(request, w) + kDecodeSeqCostTokens * Running(w);
  };
  std::vector<const WorkerView*> order;
  for (const WorkerView& w : pools.decode) {
    if (TakesWork(w)) order.push_back(&w);
  }
  std::stable_sort(order.begin(), order.end(), [&](const WorkerView* a, const WorkerView* b) {
    const bool fits_a = FreeBlocks(*a) >= blocks_needed;
    const bool fits_b = FreeBlocks(*b) >= blocks_needed;
    if (fits_a != fits_b) return fits_a;
    if (kv_aware) {
      const int64_t cost_a = cost(*a);
      const int64_t cost_b = cost(*b);
      if (cost_a != cost_b) return cost_a < cost_b;
      return FreeBlocks(*a) > FreeBlocks(*b);
    }
    if (Running(*a) != Running(*b)) return Running(*a) < Running(*b);
    return FreeBlocks(*a) > FreeBlocks(*b);
  });
  return order;
}

PrefillPick PickPrefill(const PoolSnapshot& pools, const RouteRequest& request) {
  PrefillPick best;
  int64_t best_cost = 0;
  for (const WorkerView& w : pools.prefill) {
    if (!TakesWork(w)) continue;
    const int64_t queued = w.stats.queued_prefill_tokens() + w.pending_load;
    const int64_t compute = PrefillTokens(request, w);
    if (best.worker == nullptr || queued + compute < best_cost) {
      best = {.worker = &w, .queued = queued, .compute_tokens = compute};
      best_cost = queued + compute;
    }
  }
  return best;
}

std::optional<double> PredictTtft(const PoolSnapshot& pools, int64_t tokens) {
  std::optional<double> best;
  for (const WorkerView& w : pools.prefill) {
    if (w.up && w.stats.draining()) continue;  // takes no new prompt
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
