// The rendezvous of a tensor-parallel group on etcd (`--tp-name NAME` with `--etcd`): every rank
// meets the others under /tandem/tp/NAME/ and no rank has to serve a store, so ranks on
// different nodes need only the etcd endpoints they already register with.
//
//   TANDEM_ASSIGN_OR_RETURN(auto store, EtcdRendezvousStore::Create(*etcd, "/tandem/tp/g0/",
//                                                                   rank, absl::Minutes(5)));
//   TANDEM_ASSIGN_OR_RETURN(auto comm, collective::CreateGlooCommunicator(
//       {.rank = rank, .size = n, .store = store.get()}));
//
// Rank 0 starts each incarnation of the group: it deletes what the prefix holds (a previous
// incarnation's keys) and writes a fresh generation token; the other ranks wait for the token
// and keep their keys under it. Every key is attached to a lease the store keeps alive while it
// lives and revokes when destroyed, so a group's keys go with it (a killed rank's after the
// lease's TTL). A rank that read the previous incarnation's token (it started before rank 0 did)
// sees the token change while it waits and fails its Get with Aborted, so its process exits
// and is started again, instead of waiting out the join timeout.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tandem/cluster/etcd_client.h"
#include "tandem/collective/rendezvous_store.h"

namespace tandem::cluster {

class EtcdRendezvousStore : public collective::RendezvousStore {
 public:
  // `prefix` ends with '/'. Ranks other than 0 wait up to `join_timeout` for rank 0's token.
  // `etcd` must outlive the store.
  static absl::StatusOr<std::unique_ptr<EtcdRendezvousStore>> Create(
      EtcdClient& etcd, std::string prefix, int rank, absl::Duration join_timeout,
      absl::Duration lease_ttl = absl::Seconds(30));
  ~EtcdRendezvousStore() override;

  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override;

  // The generation token this rank joined under.
  const std::string& generation() const { return generation_; }

 private:
  EtcdRendezvousStore(EtcdClient& etcd, std::string prefix, int64_t lease,
                      std::unique_ptr<LeaseKeeper> keeper)
      : etcd_(etcd), prefix_(std::move(prefix)), lease_(lease), keeper_(std::move(keeper)) {}

  EtcdClient& etcd_;
  const std::string prefix_;
  const int64_t lease_;
  std::unique_ptr<LeaseKeeper> keeper_;
  std::string generation_;
};

}  // namespace tandem::cluster
