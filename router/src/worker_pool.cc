#include "worker_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "tandem/cluster/etcd_client.h"

namespace tandem::router {
namespace {

// gRPC 1.51 runs the callback API's completions on a pool of threads ("nexting_thread") that it
// starts with the first channel making a callback call and stops, joining them, when the last
// such channel is destroyed. A flight's completion may hold the last reference to a
// WorkerHandle (a worker that has left the pool, or a pool being torn down), so a channel can
// be destroyed on one of those very threads; were it the last, the pool would join itself and
// abort the process in grpc_cq_internal_unref ("prior > 0": flight_test, about once in 250
// runs). One channel that has made a callback call and is never destroyed keeps the count above
// zero for the life of the process.
void PinCallbackThreads() {
  struct Anchor {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<tandem::v1::DecodeWorker::Stub> stub;
    grpc::ClientContext context;
    tandem::v1::StatsRequest request;
    tandem::v1::WorkerStats response;
  };
  static std::once_flag once;
  std::call_once(once, [] {
    static Anchor* anchor = new Anchor();  // never destroyed, on purpose (above)
    anchor->channel = grpc::CreateChannel("unix:/nonexistent/tandem-callback-anchor",
                                          grpc::InsecureChannelCredentials());
    anchor->stub = tandem::v1::DecodeWorker::NewStub(anchor->channel);
    // Fails at once (its deadline has passed); only the call's start matters.
    anchor->context.set_deadline(std::chrono::system_clock::now());
    anchor->stub->async()->Stats(&anchor->context, &anchor->request, &anchor->response,
                                 [](grpc::Status) {});
  });
}

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerPool>> WorkerPool::Create(const WorkerPoolOptions& options) {
  PinCallbackThreads();
  std::unique_ptr<WorkerPool> pool(new WorkerPool(options));
  TANDEM_RETURN_IF_ERROR(pool->Init());
  return pool;
}

absl::Status WorkerPool::Init() {
  TANDEM_ASSIGN_OR_RETURN(credentials_, proto::MakeChannelCredentials(options_.tls));
  if (options_.kv_events) {
    kv_index_ = std::make_unique<KvIndex>(options_.kv_index_max_blocks);
    kv_subscriptions_ = std::make_unique<KvSubscriptions>(kv_index_.get());
  }
  for (const std::string& address : options_.decode_addresses) Add("decode", address, address);
  for (const std::string& address : options_.prefill_addresses) Add("prefill", address, address);
  if (!options_.etcd_endpoints.empty()) {
    // Workers come and go through etcd; those registered now are added before Start returns.
    TANDEM_ASSIGN_OR_RETURN(
        std::unique_ptr<cluster::EtcdClient> etcd,
        cluster::EtcdClient::Create({.endpoints = options_.etcd_endpoints, .tls = options_.tls}));
    TANDEM_ASSIGN_OR_RETURN(
        membership_, cluster::Membership::Start(
                         std::shared_ptr<cluster::EtcdClient>(std::move(etcd)), options_.cluster,
                         [this](const std::string& role, const std::string& id,
                                const std::optional<cluster::WorkerInfo>& info) {
                           if (info) {
                             std::fprintf(stderr, "tandem router: %s worker %s at %s joined\n",
                                          role.c_str(), id.c_str(), info->address.c_str());
                             Add(role, id, info->address);
                           } else {
                             std::fprintf(stderr, "tandem router: %s worker %s left\n",
                                          role.c_str(), id.c_str());
                             Remove(role, id);
                           }
                         }));
    PollOnce(std::min(options_.stats_timeout, absl::Milliseconds(500)));
  } else {
    // The router serves with the workers that answer; one that does not yet is skipped until
    // the poller finds it up.
    for (const std::string& worker : PollOnce(options_.stats_timeout)) {
      std::fprintf(stderr,
                   "tandem router: worker %s does not answer yet; serving with the others and "
                   "taking it in when it answers\n",
                   worker.c_str());
    }
  }
  poller_ = std::thread([this] { PollLoop(); });
  return absl::OkStatus();
}

WorkerPool::~WorkerPool() {
  if (membership_) membership_->Stop();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  poll_wake_.notify_all();
  if (poller_.joinable()) poller_.join();
  kv_subscriptions_.reset();  // ends every KV events stream and waits for it
}

std::shared_ptr<const PoolSnapshot> WorkerPool::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (snapshot_ == nullptr) {
    auto built = std::make_shared<PoolSnapshot>();
    built->decode.reserve(decode_.size());
    built->prefill.reserve(prefill_.size());
    for (const Entry& e : decode_) built->decode.push_back(e.view);
    for (const Entry& e : prefill_) built->prefill.push_back(e.view);
    snapshot_ = std::move(built);
  }
  return snapshot_;
}

WorkerPool::Entry* WorkerPool::Find(const WorkerHandle& worker) {
  for (Entry& e : worker.role == "decode" ? decode_ : prefill_) {
    if (e.view.handle.get() == &worker) return &e;
  }
  return nullptr;  // it left the pool
}

void WorkerPool::AddPending(const WorkerHandle& worker, int64_t load, int requests) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Entry* e = Find(worker)) {
    e->view.pending_load += load;
    e->view.pending_requests += requests;
    Changed();
  }
}

void WorkerPool::MarkDown(const WorkerHandle& worker) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Entry* e = Find(worker); e != nullptr && e->view.up) {
    e->view.up = false;
    Changed();
  }
}

void WorkerPool::MarkDownIfUnreachable(const WorkerHandle& worker) {
  const grpc_connectivity_state state = worker.channel->GetState(/*try_to_connect=*/false);
  if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN ||
      state == GRPC_CHANNEL_IDLE) {
    MarkDown(worker);
  }
}

void WorkerPool::Learn(const WorkerHandle& worker, double seconds, int64_t tokens) {
  if (tokens <= 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  Entry* e = Find(worker);
  if (e == nullptr) return;
  const double observed = seconds / static_cast<double>(tokens);
  WorkerView& v = e->view;
  v.seconds_per_token = v.samples == 0 ? observed : 0.8 * v.seconds_per_token + 0.2 * observed;
  ++v.samples;
  Changed();
}

void WorkerPool::Add(const std::string& role, const std::string& id, const std::string& address) {
  if (role != "decode" && role != "prefill") return;
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, 64 << 20);
  // A worker restarted at the same address is reached again within a second.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  proto::AddTlsChannelArgs(options_.tls, &args);
  auto handle = std::make_shared<WorkerHandle>();
  handle->role = role;
  handle->id = id;
  handle->address = address;
  handle->channel = grpc::CreateCustomChannel(address, credentials_, args);
  if (role == "decode") {
    handle->decode = tandem::v1::DecodeWorker::NewStub(handle->channel);
  } else {
    handle->prefill = tandem::v1::PrefillWorker::NewStub(handle->channel);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Entry>& pool = role == "decode" ? decode_ : prefill_;
    for (const Entry& e : pool) {
      if (e.view.id == id && e.view.address == address) return;  // unchanged
    }
    std::erase_if(pool, [&](const Entry& e) { return e.view.id == id; });
    Entry& e = pool.emplace_back();
    e.view.handle = handle;
    e.view.id = id;
    e.view.address = address;
    Changed();
  }
  // Replaces the subscription of a worker that moved to another address.
  if (kv_subscriptions_) kv_subscriptions_->Start(std::move(handle));
}

void WorkerPool::Remove(const std::string& role, const std::string& id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Entry>& pool = role == "decode" ? decode_ : prefill_;
    if (std::erase_if(pool, [&](const Entry& e) { return e.view.id == id; }) == 0) return;
    Changed();
  }
  // Its index goes with it.
  if (kv_subscriptions_) kv_subscriptions_->Stop(id);
}

std::vector<std::string> WorkerPool::PollOnce(absl::Duration timeout) {
  struct Poll {
    std::shared_ptr<WorkerHandle> worker;
    grpc::ClientContext context;
    tandem::v1::StatsRequest request;
    tandem::v1::WorkerStats stats;
    grpc::Status status;
  };
  std::vector<std::unique_ptr<Poll>> polls;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Entry& e : decode_) polls.push_back(std::make_unique<Poll>(e.view.handle));
    for (const Entry& e : prefill_) polls.push_back(std::make_unique<Poll>(e.view.handle));
  }
  // Every worker at once (no thread per worker; a hung one delays nobody else's answer); gRPC
  // runs each callback by the deadline at the latest.
  std::mutex answered_mu;
  std::condition_variable answered_cv;
  size_t answered = 0;
  for (const std::unique_ptr<Poll>& poll : polls) {
    Poll& p = *poll;
    p.context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    auto done = [&p, &answered_mu, &answered_cv, &answered](grpc::Status status) {
      p.status = std::move(status);
      std::lock_guard<std::mutex> lock(answered_mu);
      ++answered;
      answered_cv.notify_all();
    };
    if (p.worker->decode) {
      p.worker->decode->async()->Stats(&p.context, &p.request, &p.stats, std::move(done));
    } else {
      p.worker->prefill->async()->Stats(&p.context, &p.request, &p.stats, std::move(done));
    }
  }
  {
    std::unique_lock<std::mutex> lock(answered_mu);
    answered_cv.wait(lock, [&] { return answered == polls.size(); });
  }
  std::vector<std::string> missing;
  std::lock_guard<std::mutex> lock(mu_);
  for (const std::unique_ptr<Poll>& poll : polls) {
    Entry* e = Find(*poll->worker);
    if (e == nullptr) continue;  // it left meanwhile
    WorkerView& w = e->view;
    w.up = poll->status.ok();
    if (w.up) {
      w.stats = poll->stats;
      if (!e->answered_once && e->missed_first) {
        std::fprintf(stderr, "tandem router: worker %s answers; taken in\n", w.address.c_str());
      }
      e->answered_once = true;
    } else {
      if (!e->answered_once) e->missed_first = true;
      missing.push_back(absl::StrCat(w.address, " (", poll->status.error_message(), ")"));
    }
  }
  Changed();
  return missing;
}

void WorkerPool::PollLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    lock.unlock();
    PollOnce(options_.stats_timeout);
    // KV events streams that ended are opened again (after their back-off).
    if (kv_subscriptions_) kv_subscriptions_->Retry();
    lock.lock();
    poll_wake_.wait_for(lock, absl::ToChronoMilliseconds(options_.stats_interval),
                        [&] { return stopping_; });
  }
}

}  // namespace tandem::router
