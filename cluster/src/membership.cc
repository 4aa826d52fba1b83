#include "tandem/cluster/membership.h"

#include <cstdio>
#include <map>
#include <mutex>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"

namespace tandem::cluster {

namespace {

struct Change {
  std::string role;
  std::string id;
  std::optional<WorkerInfo> info;
};

}  // namespace

struct Membership::State {
  std::string cluster;
  std::string prefix;
  MembershipCallback on_change;
  mutable std::mutex mu;
  // role -> id -> info.
  std::map<std::string, std::map<std::string, WorkerInfo>> workers;
  int64_t revision = 0;
  // Serializes callbacks with Stop().
  std::mutex callback_mu;
  bool stopped = false;

  // Splits "<prefix><role>/<id>"; false for keys of another shape.
  bool ParseKey(const std::string& key, std::string& role, std::string& id) const {
    if (!absl::StartsWith(key, prefix)) return false;
    const std::string rest = key.substr(prefix.size());
    const size_t slash = rest.find('/');
    if (slash == std::string::npos) return false;
    role = rest.substr(0, slash);
    id = rest.substr(slash + 1);
    return IsWorkerRole(role) && !id.empty() && id.find('/') == std::string::npos;
  }

  std::optional<WorkerInfo> Parse(const KeyValue& kv, const std::string& role,
                                  const std::string& id) const {
    absl::StatusOr<WorkerInfo> info = WorkerInfoFromJson(kv.value);
    if (info.ok() && (info->role != role || info->id != id)) {
      info = absl::InvalidArgumentError(
          absl::StrCat("its value names ", info->role, "/", info->id));
    }
    if (!info.ok()) {
      std::fprintf(stderr, "tandem: membership: ignoring %s: %s\n", kv.key.c_str(),
                   std::string(info.status().message()).c_str());
      return std::nullopt;
    }
    info->lease = kv.lease;
    info->mod_revision = kv.mod_revision;
    return *std::move(info);
  }

  // Applies `info` (nullopt: absent) for role/id under mu; appends a change when it is one.
  void ApplyLocked(const std::string& role, const std::string& id,
                   std::optional<WorkerInfo> info, std::vector<Change>& changes) {
    auto& pool = workers[role];
    auto it = pool.find(id);
    if (!info) {
      if (it == pool.end()) return;
      pool.erase(it);
      changes.push_back({role, id, std::nullopt});
      return;
    }
    const bool changed = it == pool.end() || !it->second.SameAs(*info);
    pool[id] = *info;
    if (changed) changes.push_back({role, id, std::move(info)});
  }

  // Replaces the whole view with `kvs` (a listing at `at_revision`).
  std::vector<Change> ApplySnapshot(const std::vector<KeyValue>& kvs, int64_t at_revision) {
    std::vector<Change> changes;
    std::lock_guard lock(mu);
    std::map<std::string, std::map<std::string, std::optional<WorkerInfo>>> seen;
    for (const KeyValue& kv : kvs) {
      std::string role, id;
      if (!ParseKey(kv.key, role, id)) continue;
      seen[role][id] = Parse(kv, role, id);
    }
    // Removals first (workers gone from the listing), then additions and updates.
    for (auto& [role, pool] : workers) {
      std::vector<std::string> gone;
      for (const auto& [id, info] : pool) {
        auto r = seen.find(role);
        if (r == seen.end() || !r->second.contains(id) || !r->second[id].has_value()) {
          gone.push_back(id);
        }
      }
      for (const std::string& id : gone) ApplyLocked(role, id, std::nullopt, changes);
    }
    for (auto& [role, pool] : seen) {
      for (auto& [id, info] : pool) {
        if (info) ApplyLocked(role, id, std::move(info), changes);
      }
    }
    revision = at_revision;
    return changes;
  }

  std::vector<Change> ApplyEvents(const std::vector<WatchEvent>& events, int64_t at_revision) {
    std::vector<Change> changes;
    std::lock_guard lock(mu);
    for (const WatchEvent& event : events) {
      std::string role, id;
      if (!ParseKey(event.kv.key, role, id)) continue;
      std::optional<WorkerInfo> info;
      if (event.type == WatchEvent::Type::kPut) info = Parse(event.kv, role, id);
      ApplyLocked(role, id, std::move(info), changes);
    }
    revision = std::max(revision, at_revision);
    return changes;
  }

  void Deliver(const std::vector<Change>& changes) {
    std::lock_guard lock(callback_mu);
    if (stopped || !on_change) return;
    for (const Change& change : changes) on_change(change.role, change.id, change.info);
  }
};

Membership::Membership(std::shared_ptr<EtcdClient> etcd, std::string cluster,
                       MembershipCallback on_change)
    : etcd_(std::move(etcd)), state_(std::make_unique<State>()) {
  state_->prefix = WorkersPrefix(cluster);
  state_->cluster = std::move(cluster);
  state_->on_change = std::move(on_change);
}

absl::StatusOr<std::unique_ptr<Membership>> Membership::Start(std::shared_ptr<EtcdClient> etcd,
                                                              const std::string& cluster,
                                                              MembershipCallback on_change) {
  if (etcd == nullptr) return absl::InvalidArgumentError("membership needs an etcd client");
  TANDEM_RETURN_IF_ERROR(ValidateKeySegment("cluster name", cluster));
  std::unique_ptr<Membership> membership(
      new Membership(std::move(etcd), cluster, std::move(on_change)));
  State* state = membership->state_.get();
  TANDEM_ASSIGN_OR_RETURN(RangeResult listing, membership->etcd_->GetPrefix(state->prefix));
  state->Deliver(state->ApplySnapshot(listing.kvs, listing.revision));
  membership->watcher_ = membership->etcd_->Watch(
      state->prefix, listing.revision + 1, [state](const WatchUpdate& update) {
        state->Deliver(update.resync ? state->ApplySnapshot(update.snapshot, update.revision)
                                     : state->ApplyEvents(update.events, update.revision));
      });
  return membership;
}

Membership::~Membership() { Stop(); }

void Membership::Stop() {
  {
    std::lock_guard lock(state_->callback_mu);
    state_->stopped = true;
  }
  if (watcher_ != nullptr) watcher_->Stop();
}

std::vector<WorkerInfo> Membership::Workers(const std::string& role) const {
  std::lock_guard lock(state_->mu);
  std::vector<WorkerInfo> out;
  auto it = state_->workers.find(role);
  if (it == state_->workers.end()) return out;
  for (const auto& [id, info] : it->second) out.push_back(info);
  return out;
}

std::optional<WorkerInfo> Membership::Find(const std::string& role, const std::string& id) const {
  std::lock_guard lock(state_->mu);
  auto it = state_->workers.find(role);
  if (it == state_->workers.end()) return std::nullopt;
  auto worker = it->second.find(id);
  if (worker == it->second.end()) return std::nullopt;
  return worker->second;
}

int64_t Membership::revision() const {
  std::lock_guard lock(state_->mu);
  return state_->revision;
}

}  // namespace tandem::cluster
