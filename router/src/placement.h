// Where a request goes and whether it is let in: pure functions over one snapshot of the worker
// pools (router/src/worker_pool.h produces it). They do no I/O and read no clock, so every
// choice the router makes can be tested with a snapshot built by hand.
//
// KV-aware routing adds what the workers' prefix caches hold of the prompt (PrefixHits, from the
// router's KV-event index, kv_index.h) as one more input.
//
//   std::shared_ptr<const PoolSnapshot> pools = pool.Snapshot();
//   TANDEM_RETURN_IF_ERROR(AdmitByTtft(*pools, prompt_tokens * n, options.admission_ttft));
//   PrefixHits hits = index.Lookup(prompt, cache_salt);
//   for (const WorkerView* d : RankDecode(*pools, EstimateBlocks(prompt_len, n),
//                                         {Routing::kKvAware, &hits, prompt_len, n})) ...
//   PrefillPick p = PickPrefill(*pools, {Routing::kKvAware, &hits, prompt_len, n});
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/router/disaggregated_generator.h"  // Routing
#include "tandem/v1/worker.pb.h"

namespace tandem::router {

struct WorkerHandle;  // channel and stubs of one worker (worker_pool.h)

// Answered Submits a prefill worker's latency model needs before admission trusts it.
inline constexpr int kMinModelSamples = 8;

// One worker as the poller last saw it, plus the work the router sent it since.
struct WorkerView {
  std::shared_ptr<WorkerHandle> handle;  // what a flight calls; placement never reads it
  std::string id;                        // the etcd worker id, or the listed address
  std::string address;
  bool up = false;  // its last Stats call was answered, and no call failed since
  tandem::v1::WorkerStats stats;
  // Work sent since the last Stats, so that a burst of requests between two polls spreads:
  // prompt tokens on a prefill worker, reserved blocks on a decode worker.
  int64_t pending_load = 0;
  int pending_requests = 0;
  // Prefill workers: time to first token ~ (queued prompt tokens + the request's own) x
  // seconds_per_token, an exponentially weighted average over `samples` answered Submits.
  double seconds_per_token = 0.0;
  int samples = 0;
};

// Both pools at one moment; immutable once published.
struct PoolSnapshot {
  std::vector<WorkerView> decode;
  std::vector<WorkerView> prefill;
};

// Per worker id, how many leading tokens of a prompt the worker holds in full cached KV blocks
// (KvIndex::Lookup). A worker absent holds none (or is not known to hold any).
struct PrefixHits {
  absl::flat_hash_map<std::string, int64_t> cached_tokens;
  int64_t On(const WorkerView& w) const {
    auto it = cached_tokens.find(w.id);
    return it == cached_tokens.end() ? 0 : it->second;
  }
};

// One request as placement sees it.
struct RouteRequest {
  Routing routing = Routing::kLoad;
  const PrefixHits* hits = nullptr;  // kv-aware only; null: nothing is cached anywhere
  int64_t prompt_tokens = 0;
  int n = 1;
};

// Why a worker was chosen, for tandem_router_routing_decisions_total: kLoad (--routing load),
// kKvHit (kv-aware, the worker holds part of the prompt), kKvMiss (kv-aware, it holds none).
enum class RouteReason { kLoad, kKvHit, kKvMiss };
const char* RouteReasonName(RouteReason reason);
RouteReason ReasonFor(const RouteRequest& request, const WorkerView& chosen);

// KV-aware decode ranking: a sequence in a decode worker's running batch (it slows every step
// of every sequence there) weighs as much as this many prompt tokens of KV to move to it.
inline constexpr int64_t kDecodeSeqCostTokens = 512;

// Prompt tokens worker `w` would compute for `request`: all of them x n under load routing
// (the estimate pending_load has always used); kv-aware, the prompt minus what `w` holds (at
// least its last token, whose logits the first token needs), plus one token per further sample.
int64_t PrefillTokens(const RouteRequest& request, const WorkerView& w);
// Prompt tokens of KV that would move to decode worker `w`: (prompt - what `w` holds) x n.
int64_t TokensToMove(const RouteRequest& request, const WorkerView& w);

// KV blocks a prompt of `prompt_len` tokens needs over `n` samples at the default block size
// of 16: an estimate for ranking only (the decode worker decides).
int EstimateBlocks(int prompt_len, int n);

// Decode workers that are up and not draining (a draining worker refuses new work), in the
// order to ask them: those with `blocks_needed` free blocks first; among those alike, the
// smallest running batch, then the most free blocks. Empty when none is.
// KV-aware (request.routing), "among those alike" orders by TokensToMove +
// kDecodeSeqCostTokens x running batch instead, then the most free blocks.
std::vector<const WorkerView*> RankDecode(const PoolSnapshot& pools, int blocks_needed,
                                          const RouteRequest& request = {});

// The prefill worker that is up and not draining with the least work: queued prompt tokens plus what it would
// compute for `request` (PrefillTokens: under load routing the same for all, so the fewest
// queued tokens win; kv-aware, a worker holding the prompt's prefix computes less). The first
// listed wins a tie. worker nullptr when none is up.
struct PrefillPick {
  const WorkerView* worker = nullptr;
  int64_t queued = 0;          // its queued and pending prompt tokens
  int64_t compute_tokens = 0;  // PrefillTokens(request, *worker)
};
PrefillPick PickPrefill(const PoolSnapshot& pools, const RouteRequest& request = {});

// The time to first token the best prefill worker would give a request adding `tokens` prompt
// tokens (prompt length x n), draining workers aside; nullopt when it cannot be told (no prefill
// worker up, or one whose latency model has fewer than kMinModelSamples samples).
std::optional<double> PredictTtft(const PoolSnapshot& pools, int64_t tokens);

// Admission by predicted time to first token: ResourceExhausted (HTTP 529/503 with Retry-After)
// when the prediction exceeds `target_seconds`; OK when there is no target or no prediction.
absl::Status AdmitByTtft(const PoolSnapshot& pools, int64_t tokens,
                         std::optional<double> target_seconds);

}  // namespace tandem::router
