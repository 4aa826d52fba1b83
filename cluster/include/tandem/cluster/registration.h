// A worker's registration in etcd: its WorkerInfo under
// /tandem/<cluster>/workers/<role>/<id>, attached to a lease it keeps alive.
//
//   TANDEM_ASSIGN_OR_RETURN(auto etcd, EtcdClient::Create({.endpoints = flags.etcd}));
//   RegistrationOptions options{.cluster = "default", .worker = info,
//                               .on_lost = [](absl::Status why) { /* stop taking work */ }};
//   TANDEM_ASSIGN_OR_RETURN(auto registration,
//                           WorkerRegistration::Register(std::move(etcd), options));
//   ...
//   registration->Unregister();  // on drain / SIGTERM, before shutting the worker down
//
// Registration is create-if-absent: a key that exists (a live worker with the same id and role)
// makes Register fail with AlreadyExists. The lease is renewed every `keepalive_interval`
// (TTL/3 by default). When it is lost (etcd says it is gone, or no renewal succeeded for a whole
// TTL, e.g. because etcd was unreachable) `on_lost` is called and the registration then tries,
// every TTL/3, to register again (revoking the old lease first, so a key that outlived it
// does not block the new one); `on_reregistered` is called when that succeeds.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tandem/cluster/etcd_client.h"
#include "tandem/cluster/worker_info.h"

namespace tandem::cluster {

struct RegistrationOptions {
  // Names the key prefix /tandem/<cluster>/; [A-Za-z0-9._-].
  std::string cluster = "default";
  // What to publish; id ([A-Za-z0-9._-]), role ("prefill"/"decode") and address are required.
  WorkerInfo worker;
  // Lease TTL (whole seconds; etcd raises TTLs below its minimum, 1.5 election timeouts).
  absl::Duration ttl = absl::Seconds(10);
  // Renewal period; zero: ttl / 3.
  absl::Duration keepalive_interval = absl::ZeroDuration();
  // Called once per loss, from a registration thread; it must not call Unregister/Abandon or
  // destroy the registration (signal another thread to do so).
  std::function<void(absl::Status)> on_lost;
  // Called after the key was written again following a loss (same thread as on_lost).
  std::function<void()> on_reregistered;
};

class WorkerRegistration {
 public:
  // Grants a lease, creates the key (AlreadyExists when it exists) and starts renewing.
  static absl::StatusOr<std::unique_ptr<WorkerRegistration>> Register(
      std::shared_ptr<EtcdClient> etcd, RegistrationOptions options);
  // Unregisters (best effort) unless Unregister or Abandon was called.
  ~WorkerRegistration();

  // Stops renewing and revokes the lease, which deletes the key at once. OK when the lease had
  // expired already. Idempotent.
  absl::Status Unregister();
  // Stops renewing without revoking: the key stays until the lease expires (a crashed worker).
  void Abandon();

  // The key this worker is registered under.
  const std::string& key() const { return key_; }
  // The current lease (0 while lost and not registered again).
  int64_t lease() const;
  // Whether the key is believed to be in etcd (registered and the lease not lost).
  bool registered() const;

 private:
  struct State;
  WorkerRegistration(std::shared_ptr<EtcdClient> etcd, RegistrationOptions options);
  // Grants a lease and creates the key on it; starts the keeper.
  absl::Status RegisterOnce();
  void Supervise();
  void StopRenewing();

  std::shared_ptr<EtcdClient> etcd_;
  const RegistrationOptions options_;
  const std::string key_;
  const std::string value_;
  std::unique_ptr<State> state_;
};

}  // namespace tandem::cluster
