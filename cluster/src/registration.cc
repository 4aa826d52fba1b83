#include "tandem/cluster/registration.h"

#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"

namespace tandem::cluster {

struct WorkerRegistration::State {
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;      // Unregister or Abandon began
  bool finished = false;  // ... and ended
  bool lost = false;      // the keeper reported a loss not yet handled
  absl::Status lost_status;
  bool registered = false;
  int64_t lease = 0;
  std::unique_ptr<LeaseKeeper> keeper;
  std::thread supervisor;
};

WorkerRegistration::WorkerRegistration(std::shared_ptr<EtcdClient> etcd,
                                       RegistrationOptions options)
    : etcd_(std::move(etcd)),
      options_(std::move(options)),
      key_(WorkerKey(options_.cluster, options_.worker.role, options_.worker.id)),
      value_(WorkerInfoToJson(options_.worker)),
      state_(std::make_unique<State>()) {}

absl::StatusOr<std::unique_ptr<WorkerRegistration>> WorkerRegistration::Register(
    std::shared_ptr<EtcdClient> etcd, RegistrationOptions options) {
  if (etcd == nullptr) return absl::InvalidArgumentError("registration needs an etcd client");
  TANDEM_RETURN_IF_ERROR(ValidateKeySegment("cluster name", options.cluster));
  TANDEM_RETURN_IF_ERROR(ValidateKeySegment("worker id", options.worker.id));
  if (!IsWorkerRole(options.worker.role)) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker role must be prefill or decode, got '", options.worker.role, "'"));
  }
  if (options.worker.address.empty()) {
    return absl::InvalidArgumentError("a registered worker needs an address");
  }
  if (options.ttl < absl::Seconds(1)) {
    return absl::InvalidArgumentError("lease TTL must be at least 1 s");
  }
  if (options.keepalive_interval <= absl::ZeroDuration()) {
    options.keepalive_interval = options.ttl / 3;
  }
  std::unique_ptr<WorkerRegistration> registration(
      new WorkerRegistration(std::move(etcd), std::move(options)));
  TANDEM_RETURN_IF_ERROR(registration->RegisterOnce());
  registration->state_->supervisor = std::thread([r = registration.get()] { r->Supervise(); });
  return registration;
}

WorkerRegistration::~WorkerRegistration() {
  bool finished;
  {
    std::lock_guard lock(state_->mu);
    finished = state_->finished;
  }
  if (!finished) {
    if (absl::Status status = Unregister(); !status.ok()) {
      std::fprintf(stderr, "tandem: unregistering %s: %s\n", key_.c_str(),
                   std::string(status.message()).c_str());
    }
  }
}

absl::Status WorkerRegistration::RegisterOnce() {
  TANDEM_ASSIGN_OR_RETURN(int64_t lease, etcd_->LeaseGrant(options_.ttl));
  absl::StatusOr<bool> created = etcd_->CreateIfAbsent(key_, value_, lease);
  if (!created.ok() || !*created) {
    (void)etcd_->LeaseRevoke(lease);
    if (!created.ok()) return created.status();
    return absl::AlreadyExistsError(absl::StrCat(
        "a worker is already registered under ", key_,
        " (another live worker has this id; pick another --worker-id or wait for its lease to "
        "expire)"));
  }
  auto keeper = etcd_->KeepAlive(lease, options_.ttl, options_.keepalive_interval,
                                 [state = state_.get()](absl::Status why) {
                                   std::lock_guard lock(state->mu);
                                   state->lost = true;
                                   state->lost_status = std::move(why);
                                   state->cv.notify_all();
                                 });
  std::lock_guard lock(state_->mu);
  state_->lease = lease;
  state_->registered = true;
  state_->keeper = std::move(keeper);
  return absl::OkStatus();
}

void WorkerRegistration::Supervise() {
  std::unique_lock lock(state_->mu);
  while (true) {
    state_->cv.wait(lock, [&] { return state_->stop || state_->lost; });
    if (state_->stop) return;
    absl::Status why = std::move(state_->lost_status);
    state_->lost = false;
    state_->registered = false;
    const int64_t old_lease = state_->lease;
    state_->lease = 0;
    std::unique_ptr<LeaseKeeper> keeper = std::move(state_->keeper);
    lock.unlock();
    // The keeper's thread has reported and is ending; joining it here is safe.
    if (keeper != nullptr) keeper->Stop();
    keeper.reset();
    if (options_.on_lost) options_.on_lost(why);
    while (true) {
      // A lease etcd still holds (it extends leases across its own restarts) would keep the old
      // key alive and block the new registration: revoke it first.
      (void)etcd_->LeaseRevoke(old_lease);
      absl::Status status = RegisterOnce();
      if (status.ok()) {
        if (options_.on_reregistered) options_.on_reregistered();
        break;
      }
      lock.lock();
      if (state_->cv.wait_for(lock, absl::ToChronoMilliseconds(options_.ttl / 3),
                              [&] { return state_->stop; })) {
        return;
      }
      lock.unlock();
    }
    lock.lock();
  }
}

void WorkerRegistration::StopRenewing() {
  {
    std::lock_guard lock(state_->mu);
    state_->stop = true;
    state_->cv.notify_all();
  }
  if (state_->supervisor.joinable()) state_->supervisor.join();
  std::unique_ptr<LeaseKeeper> keeper;
  {
    std::lock_guard lock(state_->mu);
    keeper = std::move(state_->keeper);
  }
  if (keeper != nullptr) keeper->Stop();
}

absl::Status WorkerRegistration::Unregister() {
  {
    std::lock_guard lock(state_->mu);
    if (state_->finished) return absl::OkStatus();
  }
  StopRenewing();
  int64_t lease;
  {
    std::lock_guard lock(state_->mu);
    lease = state_->lease;
    state_->lease = 0;
    state_->registered = false;
    state_->finished = true;
  }
  if (lease == 0) return absl::OkStatus();
  absl::Status status = etcd_->LeaseRevoke(lease);
  // An expired lease took the key with it: nothing left to do.
  if (absl::IsNotFound(status)) return absl::OkStatus();
  return status;
}

void WorkerRegistration::Abandon() {
  {
    std::lock_guard lock(state_->mu);
    if (state_->finished) return;
  }
  StopRenewing();
  std::lock_guard lock(state_->mu);
  state_->registered = false;
  state_->finished = true;
}

int64_t WorkerRegistration::lease() const {
  std::lock_guard lock(state_->mu);
  return state_->lease;
}

bool WorkerRegistration::registered() const {
  std::lock_guard lock(state_->mu);
  return state_->registered;
}

}  // namespace tandem::cluster
