// Where a request goes and whether it is let in: pure functions over one snapshot of the worker
// pools (router/src/worker_pool.h produces it). They do no I/O and read no clock, so every
// choice the router makes can be tested with a snapshot built by hand.
//
//   std::shared_ptr<const PoolSnapshot> pools = pool.Snapshot();
//   TANDEM_RETURN_IF_ERROR(AdmitByTtft(*pools, prompt_tokens * n, options.admission_ttft));
//   for (const WorkerView* d : RankDecode(*pools, EstimateBlocks(prompt_len, n))) ...
//   const WorkerView* p = PickPrefill(*pools);
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
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

// KV blocks a prompt of `prompt_len` tokens needs over `n` samples at the default block size
// of 16: an estimate for ranking only (the decode worker decides).
int EstimateBlocks(int prompt_len, int n);

// Decode workers that are up, in the order to ask them: those with `blocks_needed` free blocks
// first; among those alike, the smallest running batch, then the most free blocks. Empty when
// none is up.
std::vector<const WorkerView*> RankDecode(const PoolSnapshot& pools, int blocks_needed);

// The prefill worker that is up with the fewest queued prompt tokens; nullptr when none is up.
const WorkerView* PickPrefill(const PoolSnapshot& pools);

// The time to first token the best prefill worker would give a request adding `tokens` prompt
// tokens (prompt length x n); nullopt when it cannot be told (no prefill worker up, or one whose
// latency model has fewer than kMinModelSamples samples).
std::optional<double> PredictTtft(const PoolSnapshot& pools, int64_t tokens);

// Admission by predicted time to first token: ResourceExhausted (HTTP 529/503 with Retry-After)
// when the prediction exceeds `target_seconds`; OK when there is no target or no prediction.
absl::Status AdmitByTtft(const PoolSnapshot& pools, int64_t tokens,
                         std::optional<double> target_seconds);

}  // namespace tandem::router
