#include "kv_index.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/time/clock.h"
#include "tandem/engine/prefix_hash.h"
#include "worker_pool.h"

namespace tandem::router {

// --- KvIndex ---

void KvIndex::Apply(const std::string& worker, const tandem::v1::KvEventBatch& batch) {
  std::lock_guard<std::mutex> lock(mu_);
  Worker& w = workers_[worker];
  if (batch.reset()) w.hashes.clear();
  if (batch.block_size() > 0) w.block_size = batch.block_size();
  for (uint64_t h : batch.removed()) w.hashes.erase(h);
  for (uint64_t h : batch.stored()) {
    if (w.hashes.size() >= max_blocks_per_worker_ && !w.hashes.contains(h)) {
      ++dropped_;
      continue;
    }
    w.hashes.insert(h);
  }
}

void KvIndex::Drop(const std::string& worker) {
  std::lock_guard<std::mutex> lock(mu_);
  workers_.erase(worker);
}

PrefixHits KvIndex::Lookup(std::span<const int32_t> prompt, std::string_view cache_salt) const {
  PrefixHits hits;
  const uint64_t root = engine::PrefixRoot(cache_salt);
  // The prompt's chain per block size (every worker of a deployment usually has the same).
  std::map<int, std::vector<uint64_t>> chains;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, w] : workers_) {
    if (w.block_size <= 0 || w.hashes.empty()) continue;
    auto [it, fresh] = chains.try_emplace(w.block_size);
    if (fresh) engine::ExtendBlockHashes(root, prompt, w.block_size, it->second);
    size_t n = 0;
    while (n < it->second.size() && w.hashes.contains(it->second[n])) ++n;
    if (n > 0) hits.cached_tokens[id] = static_cast<int64_t>(n) * w.block_size;
  }
  return hits;
}

std::map<std::string, int64_t> KvIndex::Entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, int64_t> entries;
  for (const auto& [id, w] : workers_) entries[id] = static_cast<int64_t>(w.hashes.size());
  return entries;
}

int64_t KvIndex::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

// --- KvSubscriptions ---

// One worker's subscription: one KvEvents call at a time (a Call, gRPC's reactor, which deletes
// itself when done). After a call ends the next one is started by Retry(), which the pool's
// poller runs every round, once the back-off has passed: no timer, no thread of its own.
class KvSubscriptions::Subscription final : public std::enable_shared_from_this<Subscription> {
 public:
  Subscription(KvSubscriptions* owner, std::shared_ptr<WorkerHandle> worker)
      : owner_(owner), worker_(std::move(worker)) {}

  // Starts a call when none runs, the subscription is not stopped and `now` is past the
  // back-off since the last call ended.
  void Retry(absl::Time now) {
    Call* call;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopped_ || calling_ || now < retry_at_) return;
      calling_ = true;
      owner_->Enter();  // until OnCallDone
      call = NewCallLocked();
    }
    Go(call);
  }

  void Stop() {
    std::shared_ptr<grpc::ClientContext> context;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
      synced_ = false;
      context = context_;
    }
    // No batch is applied from now on; what was applied goes.
    owner_->index_->Drop(worker_->id);
    if (context != nullptr) context->TryCancel();
  }

  bool synced() const {
    std::lock_guard<std::mutex> lock(mu_);
    return synced_;
  }

 private:
  class Call;

  // A KvEvents call with a fresh context (context_). Requires mu_. Go(call) starts it, without
  // mu_ held: gRPC may run its reactions on the calling thread.
  Call* NewCallLocked();
  void Go(Call* call);

  // A batch of the current call (on a gRPC thread).
  void OnBatch(const tandem::v1::KvEventBatch& batch) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    owner_->index_->Apply(worker_->id, batch);
    if (batch.reset()) backoff_ = absl::Milliseconds(100);  // a healthy stream again
    synced_ = true;
  }

  // The current call is over (on a gRPC thread).
  void OnCallDone(const grpc::Status& status) {
    bool stopped;
    {
      std::lock_guard<std::mutex> lock(mu_);
      context_.reset();
      calling_ = false;
      synced_ = false;
      stopped = stopped_;
      retry_at_ = absl::Now() + backoff_;
      backoff_ = std::min(backoff_ * 2, absl::Seconds(2));
      if (!stopped && status.error_code() == grpc::StatusCode::UNIMPLEMENTED && !warned_) {
        warned_ = true;
        std::fprintf(stderr,
                     "tandem router: %s worker %s does not publish KV events (%s); routing to it "
                     "by load only\n",
                     worker_->role.c_str(), worker_->address.c_str(),
                     status.error_message().c_str());
      }
    }
    // Its entries may be stale from here on: forgotten until the next stream's snapshot.
    if (!stopped) owner_->index_->Drop(worker_->id);
    owner_->Leave();
  }

  KvSubscriptions* owner_;
  std::shared_ptr<WorkerHandle> worker_;
  // Held by each operation and reaction of this subscription's calls (Call), taken before mu_.
  std::recursive_mutex step_mu_;
  mutable std::mutex mu_;
  bool stopped_ = false;                              // guarded by mu_
  bool calling_ = false;                              // guarded by mu_: a call runs
  bool synced_ = false;                               // guarded by mu_
  bool warned_ = false;                               // guarded by mu_
  absl::Time retry_at_ = absl::InfinitePast();        // guarded by mu_
  absl::Duration backoff_ = absl::Milliseconds(100);  // guarded by mu_
  std::shared_ptr<grpc::ClientContext> context_;      // guarded by mu_: the call in progress
};

class KvSubscriptions::Subscription::Call final
    : public grpc::ClientReadReactor<tandem::v1::KvEventBatch> {
 public:
  Call(std::shared_ptr<Subscription> subscription, std::shared_ptr<grpc::ClientContext> context)
      : subscription_(std::move(subscription)), context_(std::move(context)) {}

  void Go(const WorkerHandle& worker) {
    std::lock_guard<std::recursive_mutex> step(subscription_->step_mu_);
    if (worker.decode) {
      worker.decode->async()->KvEvents(context_.get(), &request_, this);
    } else {
      worker.prefill->async()->KvEvents(context_.get(), &request_, this);
    }
    StartRead(&batch_);
    StartCall();
  }

 private:
  // Reactions run one at a time, on whichever gRPC thread (or inline, on the thread that starts
  // an operation); the subscription's step_mu_ states that order to readers such as
  // ThreadSanitizer that cannot see gRPC's own.
  void OnReadDone(bool ok) override {
    std::lock_guard<std::recursive_mutex> step(subscription_->step_mu_);
    if (!ok) return;  // the stream ended: OnDone follows
    subscription_->OnBatch(batch_);
    StartRead(&batch_);
  }
  void OnDone(const grpc::Status& status) override {
    std::shared_ptr<Subscription> subscription = subscription_;  // outlives the lock
    {
      std::lock_guard<std::recursive_mutex> step(subscription->step_mu_);
      subscription_.reset();
      subscription->OnCallDone(status);
    }
    delete this;
  }

  std::shared_ptr<Subscription> subscription_;
  std::shared_ptr<grpc::ClientContext> context_;
  tandem::v1::KvEventsRequest request_;
  tandem::v1::KvEventBatch batch_;
};

KvSubscriptions::Subscription::Call* KvSubscriptions::Subscription::NewCallLocked() {
  context_ = std::make_shared<grpc::ClientContext>();
  return new Call(shared_from_this(), context_);
}

void KvSubscriptions::Subscription::Go(Call* call) { call->Go(*worker_); }

KvSubscriptions::~KvSubscriptions() {
  std::map<std::string, std::shared_ptr<Subscription>> subscriptions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    subscriptions.swap(subscriptions_);
  }
  for (auto& [id, s] : subscriptions) s->Stop();
  std::unique_lock<std::mutex> lock(mu_);
  idle_.wait(lock, [&] { return live_ == 0; });
}

void KvSubscriptions::Start(std::shared_ptr<WorkerHandle> worker) {
  auto subscription = std::make_shared<Subscription>(this, worker);
  std::shared_ptr<Subscription> replaced;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<Subscription>& slot = subscriptions_[worker->id];
    replaced = std::move(slot);
    slot = subscription;
  }
  if (replaced != nullptr) replaced->Stop();
  subscription->Retry(absl::Now());
}

void KvSubscriptions::Stop(const std::string& id) {
  std::shared_ptr<Subscription> stopped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = subscriptions_.find(id);
    if (it == subscriptions_.end()) return;
    stopped = std::move(it->second);
    subscriptions_.erase(it);
  }
  stopped->Stop();
}

void KvSubscriptions::Retry() {
  std::vector<std::shared_ptr<Subscription>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, s] : subscriptions_) all.push_back(s);
  }
  const absl::Time now = absl::Now();
  for (const std::shared_ptr<Subscription>& s : all) s->Retry(now);
}

int KvSubscriptions::synced() const {
  std::vector<std::shared_ptr<Subscription>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, s] : subscriptions_) all.push_back(s);
  }
  int n = 0;
  for (const std::shared_ptr<Subscription>& s : all) n += s->synced() ? 1 : 0;
  return n;
}

void KvSubscriptions::Enter() {
  std::lock_guard<std::mutex> lock(mu_);
  ++live_;
}

void KvSubscriptions::Leave() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--live_ == 0) idle_.notify_all();
}

}  // namespace tandem::router
