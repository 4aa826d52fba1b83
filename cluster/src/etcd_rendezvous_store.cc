#include "tandem/cluster/etcd_rendezvous_store.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tandem/base/status_macros.h"

namespace tandem::cluster {
namespace {

constexpr char kGenerationKey[] = "generation";
constexpr absl::Duration kFirstPoll = absl::Milliseconds(5);
constexpr absl::Duration kLastPoll = absl::Milliseconds(200);

std::string NewToken() {
  std::random_device device;
  std::mt19937_64 rng((uint64_t{device()} << 32) ^ device() ^
                      static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  return absl::StrCat(absl::Hex(rng(), absl::kZeroPad16));
}

// Polls `key` until it exists, backing off from kFirstPoll to kLastPoll; `still_valid` is
// asked between polls and ends the wait with its error.
template <typename Check>
absl::StatusOr<std::string> WaitFor(EtcdClient& etcd, const std::string& key,
                                    absl::Duration timeout, Check still_valid) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration pause = kFirstPoll;
  while (true) {
    TANDEM_ASSIGN_OR_RETURN(std::optional<KeyValue> kv, etcd.Get(key));
    if (kv.has_value()) return kv->value;
    TANDEM_RETURN_IF_ERROR(still_valid());
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("no ", key, " in etcd after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(std::min(pause, deadline - now));
    pause = std::min(pause * 2, kLastPoll);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<EtcdRendezvousStore>> EtcdRendezvousStore::Create(
    EtcdClient& etcd, std::string prefix, int rank, absl::Duration join_timeout,
    absl::Duration lease_ttl) {
  if (prefix.empty() || prefix.back() != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous prefix '", prefix, "' must end with '/'"));
  }
  TANDEM_ASSIGN_OR_RETURN(const int64_t lease, etcd.LeaseGrant(lease_ttl));
  auto keeper = etcd.KeepAlive(lease, lease_ttl, lease_ttl / 3, [](absl::Status) {});
  std::unique_ptr<EtcdRendezvousStore> store(
      new EtcdRendezvousStore(etcd, std::move(prefix), lease, std::move(keeper)));
  const std::string generation_key = store->prefix_ + kGenerationKey;
  if (rank == 0) {
    TANDEM_RETURN_IF_ERROR(etcd.DeletePrefix(store->prefix_).status());
    store->generation_ = NewToken();
    TANDEM_RETURN_IF_ERROR(etcd.Put(generation_key, store->generation_, lease).status());
  } else {
    TANDEM_ASSIGN_OR_RETURN(store->generation_,
                            WaitFor(etcd, generation_key, join_timeout,
                                    [] { return absl::OkStatus(); }));
  }
  return store;
}

EtcdRendezvousStore::~EtcdRendezvousStore() {
  keeper_->Stop();
  (void)etcd_.LeaseRevoke(lease_);
}

absl::Status EtcdRendezvousStore::Set(const std::string& key, const std::string& value) {
  return etcd_.Put(absl::StrCat(prefix_, generation_, "/", key), value, lease_).status();
}

absl::StatusOr<std::string> EtcdRendezvousStore::Get(const std::string& key,
                                                     absl::Duration timeout) {
  const std::string generation_key = prefix_ + kGenerationKey;
  return WaitFor(etcd_, absl::StrCat(prefix_, generation_, "/", key), timeout,
                 [&]() -> absl::Status {
                   TANDEM_ASSIGN_OR_RETURN(std::optional<KeyValue> current,
                                           etcd_.Get(generation_key));
                   if (current.has_value() && current->value != generation_) {
                     return absl::AbortedError(absl::StrCat(
                         "the group under ", prefix_, " was started again (generation ",
                         current->value, ", this rank joined ", generation_, ")"));
                   }
                   return absl::OkStatus();
                 });
}

}  // namespace tandem::cluster
