// The router's worker pools: one gRPC channel per prefill and decode worker (listed on the
// command line, or followed live through etcd), a poller that asks every worker for its Stats
// at once on gRPC's callback API, and immutable snapshots of what it last heard plus the work
// the router sent since. Placement and admission (placement.h) read a snapshot; stats() and
// /metrics read one too, so a scrape never does I/O and a hung worker cannot slow it down.
//
//   TANDEM_ASSIGN_OR_RETURN(auto pool, WorkerPool::Create({.decode_addresses = {"d:7002"},
//                                                          .prefill_addresses = {"p:7001"}}));
//   std::shared_ptr<const PoolSnapshot> now = pool->Snapshot();
//   pool->AddPending(*now->decode[0].handle, blocks, 1);  // until the next Stats counts them
#pragma once

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kv_index.h"
#include "placement.h"
#include "tandem/cluster/membership.h"
#include "tandem/proto/tls.h"
#include "tandem/v1/decode.grpc.pb.h"
#include "tandem/v1/prefill.grpc.pb.h"

namespace tandem::router {

// What a flight needs to call one worker. Immutable; lives on while a request uses it, also
// after its worker left the pool.
struct WorkerHandle {
  std::string role;  // "prefill" or "decode"
  std::string id;
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<tandem::v1::DecodeWorker::Stub> decode;    // set for role "decode"
  std::unique_ptr<tandem::v1::PrefillWorker::Stub> prefill;  // set for role "prefill"
};

struct WorkerPoolOptions {
  std::vector<std::string> prefill_addresses;
  std::vector<std::string> decode_addresses;
  // etcd endpoints: the workers registered under /tandem/<cluster>/workers/ join the pools.
  std::string etcd_endpoints;
  std::string cluster = "default";
  proto::TlsFiles tls;
  // How often every worker's Stats are polled (all at once), and how long a poll waits for an
  // answer before the worker counts as down (until it answers again).
  absl::Duration stats_interval = absl::Milliseconds(100);
  absl::Duration stats_timeout = absl::Seconds(1);
  // Follow every worker's KV events into a KvIndex (KV-aware routing), keeping at most this
  // many block hashes per worker.
  bool kv_events = false;
  size_t kv_index_max_blocks = 1 << 20;
};

class WorkerPool {
 public:
  // Connects to every listed worker and polls each once: those that do not answer yet are named
  // on stderr and taken in when they answer. With etcd, reads the registered workers and follows
  // them. Then polls every stats_interval until destroyed.
  static absl::StatusOr<std::unique_ptr<WorkerPool>> Create(const WorkerPoolOptions& options);
  ~WorkerPool();

  // The pools as of now: the last poll round plus the pending work and failures since. Never
  // does I/O; the snapshot stays valid (and unchanged) as long as it is held.
  std::shared_ptr<const PoolSnapshot> Snapshot() const;

  // Work sent to `worker` that its Stats do not show yet (negative: taking it back).
  void AddPending(const WorkerHandle& worker, int64_t load, int requests);
  // A worker that failed a call is down until its next Stats answers.
  void MarkDown(const WorkerHandle& worker);
  // Marks it down only when its channel cannot reach it any more (its process is gone), as
  // opposed to an UNAVAILABLE it answered itself.
  void MarkDownIfUnreachable(const WorkerHandle& worker);
  // A prefill worker answered a Submit that waited behind `tokens` prompt tokens in `seconds`.
  void Learn(const WorkerHandle& worker, double seconds, int64_t tokens);

  // Adds a worker (role "prefill" or "decode"), or points the one with that id at `address`.
  void Add(const std::string& role, const std::string& id, const std::string& address);
  void Remove(const std::string& role, const std::string& id);

  // What each worker's prefix cache holds, from its KV events; null without kv_events.
  const KvIndex* kv_index() const { return kv_index_.get(); }
  // Workers whose KV events stream is open and past its snapshot.
  int kv_streams_synced() const { return kv_subscriptions_ ? kv_subscriptions_->synced() : 0; }

  // One poll round, waiting up to `timeout` for the answers; "ADDRESS (why)" of each worker that
  // did not answer.
  std::vector<std::string> PollOnce(absl::Duration timeout);

 private:
  struct Entry {
    WorkerView view;  // view.handle set
    bool answered_once = false;
    bool missed_first = false;
  };
  explicit WorkerPool(const WorkerPoolOptions& options) : options_(options) {}
  absl::Status Init();
  void PollLoop();
  Entry* Find(const WorkerHandle& worker);  // requires mu_
  void Changed() { snapshot_.reset(); }     // requires mu_

  WorkerPoolOptions options_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  std::unique_ptr<cluster::Membership> membership_;
  std::unique_ptr<KvIndex> kv_index_;
  std::unique_ptr<KvSubscriptions> kv_subscriptions_;  // feeds kv_index_

  mutable std::mutex mu_;
  std::vector<Entry> decode_;   // guarded by mu_
  std::vector<Entry> prefill_;  // guarded by mu_
  // The last snapshot built; reset by every change and rebuilt by the next Snapshot().
  mutable std::shared_ptr<const PoolSnapshot> snapshot_;  // guarded by mu_
  bool stopping_ = false;                                 // guarded by mu_
  std::condition_variable poll_wake_;
  std::thread poller_;
};

}  // namespace tandem::router
