// A worker's KV cache as the transfer layer sees it: a kvtransfer agent with the engine's whole
// cache registered as one region, the layout both sides check at the handshake, and the
// connections this worker opened to other workers' agents (one per address, reused).
//
//   TANDEM_ASSIGN_OR_RETURN(auto kv, KvEndpoint::Create(
//       {.backend = "ucx", .name = "prefill-1", .listen_host = "10.0.0.5"}, *engine));
//   TANDEM_RETURN_IF_ERROR(kv->CheckReceiver(reservation.endpoint(), "reservation.endpoint"));
//   TANDEM_ASSIGN_OR_RETURN(kvtransfer::PeerId peer, kv->Peer(address, deadline));
//   auto handle = kv->Push(peer, descriptor, ranges, deadline);
//   ...
//   kv->Close();  // after the last transfer: waits until nothing reads the cache
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tandem/engine/kv_cache_layout.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/kvtransfer/agent.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::worker {

class KvEndpoint {
 public:
  struct Options {
    // The kvtransfer backend ("ucx", "local", "cuda_ipc"); peers must use the same.
    std::string backend = "ucx";
    // The agent's name in messages (the worker id).
    std::string name;
    // "prefill" or "decode", for messages ("this prefill worker").
    std::string role;
    // ucx: where the agent's listener binds (reachable by the peers).
    std::string listen_host = "127.0.0.1";
  };

  // Creates the agent and registers `engine`'s KV cache, which must outlive the endpoint (or
  // its Close()).
  static absl::StatusOr<std::unique_ptr<KvEndpoint>> Create(const Options& options,
                                                            engine::LlmEngine& engine);
  // The same for a cache of `cache_layout` at `cache` held by rank `tp_rank` of a
  // tensor-parallel group (a follower's runner).
  static absl::StatusOr<std::unique_ptr<KvEndpoint>> Create(
      const Options& options, const text::ModelConfig& config,
      const engine::KvCacheLayout& cache_layout, int tp_rank, void* cache);
  // Close().
  ~KvEndpoint();

  // The cache's layout as the handshake states it, and every byte offset into it.
  const tandem::v1::KvLayout& layout() const { return layout_; }
  const engine::KvCacheLayout& cache_layout() const { return cache_layout_; }
  const std::string& backend() const { return options_.backend; }

  // Where peers push into this cache: backend, agent address, the region's descriptor, the
  // number of blocks and the layout (what a reservation hands out); on rank 0 of a
  // tensor-parallel group, with every rank's endpoint (SetGroup).
  tandem::v1::TransferEndpoint Describe() const;
  // Rank 0 of a tensor-parallel group: every rank's endpoint (GatherRankEndpoints), rank r's at
  // [r], and their caches' layouts. Before serving.
  void SetGroup(std::vector<tandem::v1::TransferEndpoint> ranks,
                std::vector<engine::KvCacheLayout> layouts) {
    group_ = std::move(ranks);
    group_layouts_ = std::move(layouts);
  }
  // Each rank's cache layout (this cache's alone without a group).
  std::vector<engine::KvCacheLayout> group_layouts() const {
    return group_layouts_.empty() ? std::vector<engine::KvCacheLayout>{cache_layout_}
                                  : group_layouts_;
  }

  // The Handshake RPC of a worker named `worker_id`: OK with this side's id and layout when
  // pages can go from the sender to the receiver (this side sends when `this_side_sends`),
  // otherwise the layout check's error naming both workers.
  absl::StatusOr<tandem::v1::HandshakeResponse> Handshake(
      const tandem::v1::HandshakeRequest& request, const std::string& worker_id,
      bool this_side_sends) const;
  // Checks a receiver's endpoint before anything is pushed to it (proto::CheckTransferEndpoint
  // with this cache as the sender); `name` is how messages call it.
  absl::Status CheckReceiver(const tandem::v1::TransferEndpoint& endpoint,
                             const std::string& name) const;

  // A connection to the agent at `address`, reused across calls; `fresh` closes a cached one
  // and connects again. Thread-safe; connecting does not hold up calls for other addresses.
  absl::StatusOr<kvtransfer::PeerId> Peer(const std::string& address, absl::Time deadline,
                                          bool fresh = false);
  // Whether a connection to `address` is cached (Peer returns it without connecting).
  // Thread-safe.
  bool Connected(const std::string& address) const;
  // Forgets and closes the cached connection `peer` to `address` (a failed one), unless it was
  // replaced meanwhile. Thread-safe.
  void DropPeer(const std::string& address, kvtransfer::PeerId peer);

  // Pushes `ranges` of this cache into the peer's region `descriptor`, due by `deadline`.
  absl::StatusOr<std::unique_ptr<kvtransfer::TransferHandle>> Push(
      kvtransfer::PeerId peer, const std::string& descriptor, std::vector<kvtransfer::Range> ranges,
      absl::Time deadline);
  // A connection of its own (not cached), for a transfer that must be cut on its own by
  // Disconnect.
  kvtransfer::Agent& agent() { return *agent_; }

  // Deregisters the cache, which waits until no transfer reads it, and destroys the agent
  // (failing handles still held with Cancelled). Idempotent.
  void Close();

 private:
  KvEndpoint() = default;

  Options options_;
  tandem::v1::KvLayout layout_;
  engine::KvCacheLayout cache_layout_;
  int64_t num_blocks_ = 0;
  std::string descriptor_;
  std::unique_ptr<kvtransfer::Agent> agent_;
  bool registered_ = false;
  std::vector<tandem::v1::TransferEndpoint> group_;
  std::vector<engine::KvCacheLayout> group_layouts_;

  mutable std::mutex peers_mu_;
  std::map<std::string, kvtransfer::PeerId> peers_;  // guarded by peers_mu_
};

}  // namespace tandem::worker
