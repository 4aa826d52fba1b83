// The router's index of what each worker's prefix cache holds, fed by the workers' KV events
// (docs/protocol.md, "KV events"): per worker, the set of block hashes it has cached, so a
// request can be routed where its prompt's prefix already is (placement.h, KV-aware routing).
//
// KvIndex is the data (thread-safe); KvSubscriptions keeps one KvEvents stream open per worker
// in the pools, on gRPC's callback API (a ClientReadReactor per worker, no thread of its own).
// A worker's entries are dropped when its stream ends (the router subscribes again after a
// back-off, from the pool's poller, and starts over from the snapshot the worker sends first)
// and when it leaves the pools.
//
// Memory is bounded: at most `max_blocks_per_worker` hashes per worker (a worker cannot hold
// more blocks than its KV cache has, so the cap only bites on a misconfigured router or a
// misbehaving worker). Hashes stored beyond the cap are not recorded (counted by dropped()):
// routing then misses a hit it could have had, never claims one that is not there.
//
//   KvIndex index(1 << 20);
//   KvSubscriptions subscriptions(&index);
//   subscriptions.Start(handle);                     // a worker joined
//   PrefixHits hits = index.Lookup(prompt, salt);    // per worker id: cached prompt tokens
//   subscriptions.Stop(handle->id);                  // it left: its entries go too
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "placement.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::router {

struct WorkerHandle;

class KvIndex {
 public:
  explicit KvIndex(size_t max_blocks_per_worker = 1 << 20)
      : max_blocks_per_worker_(max_blocks_per_worker) {}

  // Applies one message of `worker`'s KvEvents stream.
  void Apply(const std::string& worker, const tandem::v1::KvEventBatch& batch);
  // Forgets everything about `worker`.
  void Drop(const std::string& worker);
  // Per worker with entries: how many leading tokens of `prompt` (salted with `cache_salt`) it
  // holds in full cached blocks, hashed as the engine does (engine/prefix_hash.h) with that
  // worker's block size.
  PrefixHits Lookup(std::span<const int32_t> prompt, std::string_view cache_salt) const;

  // Hashes held per worker id (workers with a stream open, even an empty one).
  std::map<std::string, int64_t> Entries() const;
  // Hashes not recorded because a worker's entries were at the cap.
  int64_t dropped() const;

 private:
  struct Worker {
    int block_size = 0;
    absl::flat_hash_set<uint64_t> hashes;
  };
  const size_t max_blocks_per_worker_;
  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, Worker> workers_;  // guarded by mu_
  int64_t dropped_ = 0;                                // guarded by mu_
};

// One KvEvents stream per worker, feeding a KvIndex.
class KvSubscriptions {
 public:
  explicit KvSubscriptions(KvIndex* index) : index_(index) {}
  // Stops every stream and waits until their calls are over.
  ~KvSubscriptions();

  // Subscribes to `worker`'s KV events (replacing a subscription under the same id).
  void Start(std::shared_ptr<WorkerHandle> worker);
  // Subscribes again where a stream has ended and its back-off (100 ms, doubling up to 2 s,
  // back to 100 ms once a stream delivers its snapshot) has passed. The pool's poller calls it
  // every round.
  void Retry();
  // Ends the subscription of worker `id` and drops its entries from the index.
  void Stop(const std::string& id);

  // Streams that have delivered their snapshot and are open now.
  int synced() const;

 private:
  class Subscription;
  friend class Subscription;
  void Enter();  // a call of some subscription begins
  void Leave();  // ... and ends

  KvIndex* index_;
  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Subscription>> subscriptions_;  // guarded by mu_
  int live_ = 0;                                                         // guarded by mu_
  std::condition_variable idle_;
};

}  // namespace tandem::router
