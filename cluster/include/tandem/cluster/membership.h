// The router's view of the worker pools: every WorkerInfo registered under
// /tandem/<cluster>/workers/, kept current through an etcd watch.
//
//   TANDEM_ASSIGN_OR_RETURN(auto etcd, EtcdClient::Create({.endpoints = "10.0.0.2:2379"}));
//   TANDEM_ASSIGN_OR_RETURN(auto membership, Membership::Start(
//       std::move(etcd), "default",
//       [&](const std::string& role, const std::string& id,
//           const std::optional<WorkerInfo>& info) {
//         if (info) AddOrUpdateWorker(role, *info); else RemoveWorker(role, id);
//       }));
//   std::vector<WorkerInfo> decode = membership->Workers("decode");
//
// Start lists the prefix (failing if etcd cannot be reached) and calls on_change for every
// worker found, on the calling thread, before it returns; it then watches from the listing's
// revision + 1 and calls on_change, on the watch thread, for each later join (info set), update
// (info set, different content) and leave (nullopt: the key was deleted, by Unregister or by
// its lease expiring). A join or leave is seen as soon as etcd applies it, so within one lease
// TTL of a worker stopping. Calls come one at a time, in etcd's order, never while
// Membership's lock is held: on_change may call Workers()/Find(). If the watch stream breaks
// (etcd restarted or an endpoint is down) it resumes from the last revision seen + 1 on any
// endpoint; if that history was compacted it re-lists and reports the differences. Keys whose
// value does not parse (or whose role/id disagree with the key) are ignored, with a line on
// stderr.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/cluster/etcd_client.h"
#include "tandem/cluster/worker_info.h"

namespace tandem::cluster {

using MembershipCallback = std::function<void(
    const std::string& role, const std::string& id, const std::optional<WorkerInfo>& info)>;

class Membership {
 public:
  static absl::StatusOr<std::unique_ptr<Membership>> Start(std::shared_ptr<EtcdClient> etcd,
                                                           const std::string& cluster,
                                                           MembershipCallback on_change);
  // Stops the watch.
  ~Membership();
  // Stops the watch and waits for a callback in progress; no callback follows. Never call from
  // on_change. Idempotent.
  void Stop();

  // The workers of `role` ("prefill" or "decode"), sorted by id.
  std::vector<WorkerInfo> Workers(const std::string& role) const;
  std::optional<WorkerInfo> Find(const std::string& role, const std::string& id) const;
  // The etcd revision the snapshot reflects.
  int64_t revision() const;

  struct State;

 private:
  explicit Membership(std::shared_ptr<EtcdClient> etcd, std::string cluster,
                      MembershipCallback on_change);
  std::shared_ptr<EtcdClient> etcd_;
  std::unique_ptr<State> state_;
  std::unique_ptr<Watcher> watcher_;
};

}  // namespace tandem::cluster
