// KV events: the worker's side of the KvEvents stream (docs/protocol.md, "KV events"). The engine's
// block manager records which block hashes enter and leave its prefix cache; after every engine
// loop iteration the hub hands them to each subscriber's stream, and a new subscriber first gets
// a snapshot of every hash cached when it subscribed. Each stream is a ServerWriteReactor on
// gRPC's callback API with at most one write in flight: changes made meanwhile are merged into
// one net change per hash, so a slow reader gets fewer, larger messages; one that falls more
// than `max_pending` net changes behind is cut off (RESOURCE_EXHAUSTED) and subscribes again,
// starting from a fresh snapshot. No thread waits for a subscriber.
//
//   KvEventHub hub(engine.block_manager());       // before the loop starts: recording begins
//   return hub.Subscribe(loop);                   // the KvEvents handler (gRPC thread)
//   loop iterate: { Step(); hub.Publish(); }      // the loop thread
//   hub.Close();                                  // shutdown, before the gRPC server stops
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "tandem/engine/block_manager.h"
#include "tandem/v1/worker.pb.h"
#include "tandem/worker/engine_loop.h"

namespace tandem::worker {

// Most hashes in one KvEventBatch (a snapshot takes as many messages as it needs).
inline constexpr size_t kKvEventBatchMax = 65536;

class KvEventStream;

class KvEventHub {
 public:
  // Starts recording `blocks`' events (when it caches prefixes). `max_pending`: the net changes
  // a subscriber may have waiting before it is cut off.
  explicit KvEventHub(engine::BlockManager& blocks, size_t max_pending = 1 << 20);
  // Close().
  ~KvEventHub();
  KvEventHub(const KvEventHub&) = delete;
  KvEventHub& operator=(const KvEventHub&) = delete;

  // A new subscription (the KvEvents handler's reactor, to return to gRPC). Its snapshot is
  // taken on `loop`, after the events published so far; refused with UNAVAILABLE once the hub
  // is closed or the loop has finished. Any thread.
  grpc::ServerWriteReactor<tandem::v1::KvEventBatch>* Subscribe(EngineLoop& loop);
  // The loop thread: hands the events recorded since the last call to every subscriber, and
  // forgets subscribers whose stream has ended.
  void Publish();
  // Ends every stream with UNAVAILABLE (the worker is shutting down); later subscriptions are
  // refused. Idempotent; any thread.
  void Close();
  // Streams open now. Any thread.
  size_t subscribers() const;

 private:
  engine::BlockManager& blocks_;
  const size_t max_pending_;
  mutable std::mutex mu_;
  bool closed_ = false;                                   // guarded by mu_
  std::vector<std::shared_ptr<KvEventStream>> streams_;  // guarded by mu_
};

}  // namespace tandem::worker
