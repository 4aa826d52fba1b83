// KV transfer for workers whose engine is a tensor-parallel group (`tandem prefill --tp N`,
// `tandem decode --tp N`): every rank registers its own cache (its KV heads) with an agent of its
// own, the group's endpoints are gathered on rank 0, and pages move between each (source rank,
// destination rank) pair that shares heads, in parallel, layer by layer.
//
//   - A decode group's reservation lists every rank's endpoint (TransferEndpoint.tp_ranks).
//   - A prefill group's rank 0 pushes its own heads; with each step's plan it sends its followers
//     a KvPushOrders (ModelRunner::set_step_attachment), and each follower pushes its heads of
//     the step's writes as each layer is computed, waits for them when the step is done and
//     reports failures back (KvPushReport).
//   - Before a request goes to decode ranks its followers have not reached, rank 0 sends them
//     connect-only orders between steps; they connect in the background and rank 0 admits the
//     request once all have, so no step waits for a follower's connect.
//
// A follower process runs:
//   return RunKvFollower(engine_options, {.backend = "ucx", .name = "prefill-0/rank1"});
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/collective/communicator.h"
#include "tandem/engine/kv_cache_layout.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/kvtransfer/agent.h"
#include "tandem/v1/kv_layout.pb.h"
#include "tandem/worker/kv_endpoint.h"

namespace tandem::worker {

// Every rank's endpoint (rank r's at [r]); every rank of the group calls it once, at the same
// point: after its KV endpoint exists, before the group's first step.
absl::StatusOr<std::vector<tandem::v1::TransferEndpoint>> GatherRankEndpoints(
    collective::Communicator& comm, const tandem::v1::TransferEndpoint& mine);

// A cache layout as a handshake states it, in engine terms, with `num_blocks` blocks.
// InvalidArgument for a dtype this build does not hold KV in.
absl::StatusOr<engine::KvCacheLayout> CacheLayoutOf(const tandem::v1::KvLayout& layout,
                                                    int num_blocks);

// The endpoints of each rank of a receiver: its tp_ranks, or itself when it is one rank.
std::vector<const tandem::v1::TransferEndpoint*> RankEndpoints(
    const tandem::v1::TransferEndpoint& endpoint);

// Each rank's cache layout (CacheLayoutOf of its layout and number of blocks), rank r's at [r].
absl::StatusOr<std::vector<engine::KvCacheLayout>> RankLayouts(
    std::span<const tandem::v1::TransferEndpoint* const> ranks);
absl::StatusOr<std::vector<engine::KvCacheLayout>> RankLayouts(
    const std::vector<tandem::v1::TransferEndpoint>& ranks);

// Appends the ranges that move `run`'s heads of prompt tokens [begin, end) of one sample, K and
// V of layer `layer` (written into layer `dst_layer` of the destination's region), from `from`
// into `to`. src_blocks[i] and dst_blocks[i] hold the sample's logical block first_block + i.
// Stops at the end of either block list.
void AppendTokenRanges(const engine::KvCacheLayout& from, const engine::KvCacheLayout& to,
                       const engine::KvHeadRun& run, int layer, int dst_layer, int begin, int end,
                       int first_block, std::span<const int32_t> src_blocks,
                       std::span<const int32_t> dst_blocks, std::vector<kvtransfer::Range>& out);

// The bytes `run` moves of `tokens` tokens in one layer (K and V).
uint64_t RunBytes(const engine::KvCacheLayout& from, const engine::KvHeadRun& run, int tokens);

// A follower rank (1..) of a prefill or decode worker's tensor-parallel group: loads its shard
// (engine::TensorParallelFollower), registers its cache with an agent of `kv`'s backend, takes
// part in GatherRankEndpoints, then runs the leader's steps, pushing its heads of each step's
// KvPushOrders. Returns OK when the leader's engine is destroyed, or the group's error.
absl::Status RunKvFollower(const engine::EngineOptions& options, const KvEndpoint::Options& kv);

}  // namespace tandem::worker
