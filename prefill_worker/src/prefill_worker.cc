#include "tandem/prefill_worker/prefill_worker.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "tandem/base/host_port.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/engine_metrics.h"
#include "tandem/kvtransfer/agent.h"
#include "tandem/metrics/registry.h"
#include "tandem/proto/kv_layout_check.h"
#include "tandem/proto/wire.h"
#include "tandem/v1/prefill.grpc.pb.h"
#include "tandem/worker/status_server.h"

namespace tandem::prefill_worker {
namespace {

using engine::KvWritten;
using engine::PrefillHandoff;

// The region id of the whole KV cache in this worker's agent.
constexpr uint64_t kCacheRegion = 0;
// The loop wakes at least this often, so deadlines are enforced with nothing else going on.
constexpr absl::Duration kIdleWake = absl::Milliseconds(20);
// How long the loop sleeps between polls when it only waits for transfers.
constexpr absl::Duration kTransferPoll = absl::Microseconds(500);
// A handler waiting for its request checks the call for cancellation this often.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(50);
// The worker's own cap on a request's life (a Submit and reservation without deadlines).
constexpr absl::Duration kMaxRequestTime = absl::Minutes(10);
// Connecting to a decode worker's agent takes at most this (and never past the request's
// deadline).
constexpr absl::Duration kConnectTimeout = absl::Seconds(10);
// At shutdown, transfers of cancelled requests get this long to finish before their requests
// are answered anyway; destroying the agent then cancels what is left.
constexpr absl::Duration kShutdownDrain = absl::Seconds(5);

absl::Time FromUnixMillisOrInfinite(int64_t ms) {
  return ms > 0 ? absl::FromUnixMillis(ms) : absl::InfiniteFuture();
}

// How a transfer failure fails its request: a decode worker that is gone (or a connection that
// was closed) is UNAVAILABLE; a passed deadline stays DEADLINE_EXCEEDED; the rest keep their code.
absl::Status TransferFailure(const std::string& request_id, const absl::Status& status) {
  absl::StatusCode code = status.code();
  // A closed connection (Cancelled) or one another request already dropped (NotFound) both
  // mean the decode worker went away.
  if (code == absl::StatusCode::kCancelled || code == absl::StatusCode::kNotFound) {
    code = absl::StatusCode::kUnavailable;
  }
  return absl::Status(code, absl::StrCat("request ", request_id,
                                         ": KV transfer failed: ", std::string(status.message())));
}

// A Submit call as its handler thread and the engine loop share it: the loop fills the result
// and then notifies.
struct Call {
  absl::Notification done;
  absl::Status status;
  tandem::v1::SubmitResponse response;
};

// One request on the engine loop (owned by the loop thread once queued).
struct Job {
  std::string id;
  engine::GenerateRequest request;  // moved into the engine on admission
  int n = 1;
  int prompt_len = 0;
  std::shared_ptr<Call> call;

  // Where the KV goes.
  std::string peer_address;
  kvtransfer::PeerId peer = 0;
  bool reconnected = false;
  std::vector<std::string> descriptors;  // one for all layers, or one per layer
  std::vector<int32_t> dst_blocks;       // n x blocks_per_choice
  int blocks_per_choice = 0;
  int64_t dst_num_blocks = 0;
  // The request fails past `deadline`; its transfers may finish until `transfer_deadline`, the
  // reservation's expiry (after it the decode worker may reuse the blocks).
  absl::Time deadline;
  absl::Time transfer_deadline;

  // Progress.
  bool admitted = false;
  std::vector<int> computed;  // per sample: prompt tokens whose KV is written (all layers)
  std::deque<std::unique_ptr<kvtransfer::TransferHandle>> handles;  // oldest first
  std::vector<PrefillHandoff> handoffs;                             // samples done
  std::vector<bool> sample_done;
  uint64_t bytes = 0;
  absl::Status failure;  // not OK: the request is failing (cancel, deadline, transfer error)

  // Timings.
  absl::Time received;
  absl::Time scheduled = absl::InfiniteFuture();  // first step that computed it
  absl::Time compute_done = absl::InfiniteFuture();
  absl::Time first_post = absl::InfiniteFuture();
  absl::Time last_done = absl::InfinitePast();

  bool failing() const { return !failure.ok(); }
  bool all_sampled() const { return static_cast<int>(handoffs.size()) == n; }
};

// What the handler threads ask of the loop.
struct Command {
  enum class Kind { kAdd, kCancel } kind = Kind::kAdd;
  std::unique_ptr<Job> job;  // kAdd
  std::string request_id;    // kCancel
  absl::Status reason;       // kCancel
};

struct Metrics {
  metrics::Registry registry;
  engine::EngineMetrics engine{registry};  // KV, batch, preemptions, step times
  prometheus::Gauge& queued_tokens = registry.Gauge(
      "tandem_prefill_queued_tokens", "Prompt tokens accepted and not yet computed.");
  prometheus::Counter& prompt_tokens = registry.Counter(
      "tandem_prompt_tokens_total", "Prompt tokens of the requests prefilled successfully.");
  prometheus::Counter& transfer_bytes =
      registry.Counter("tandem_kv_transfer_bytes_total", "KV bytes pushed to decode workers.");
  prometheus::Counter& transfer_seconds = registry.Counter(
      "tandem_kv_transfer_seconds_total",
      "Seconds from each request's first KV page posted to its last acknowledged, summed.");
  prometheus::Counter& exposed_seconds = registry.Counter(
      "tandem_kv_transfer_exposed_seconds_total",
      "Of tandem_kv_transfer_seconds_total, the seconds after prefill compute ended.");
  prometheus::Histogram& prefill_seconds = registry.Histogram(
      "tandem_prefill_seconds", "Seconds from a request's first chunk scheduled to its first token.",
      metrics::LatencyBuckets());
  prometheus::Gauge& token_budget = registry.Gauge(
      "tandem_prefill_token_budget",
      "Tokens a prefill step may take: max_num_batched_tokens, or the TTFT controller's lower "
      "budget.");
  prometheus::Gauge& ttft_target = registry.Gauge(
      "tandem_prefill_ttft_target_seconds", "The TTFT target steps are sized for (0: none).");

  prometheus::Counter& Requests(absl::StatusCode code) {
    return registry.Counter("tandem_prefill_requests_total",
                            "Submit calls answered, by status code.",
                            {{"code", absl::StatusCodeToString(code)}});
  }
};

class PrefillWorkerImpl;

class Service final : public tandem::v1::PrefillWorker::Service {
 public:
  explicit Service(PrefillWorkerImpl* worker) : worker_(worker) {}
  grpc::Status Submit(grpc::ServerContext* context, const tandem::v1::SubmitRequest* request,
                      tandem::v1::SubmitResponse* response) override;
  grpc::Status Cancel(grpc::ServerContext* context, const tandem::v1::CancelRequest* request,
                      tandem::v1::CancelResponse* response) override;
  grpc::Status Stats(grpc::ServerContext* context, const tandem::v1::StatsRequest* request,
                     tandem::v1::WorkerStats* response) override;
  grpc::Status Handshake(grpc::ServerContext* context, const tandem::v1::HandshakeRequest* request,
                         tandem::v1::HandshakeResponse* response) override;

 private:
  PrefillWorkerImpl* worker_;
};

class PrefillWorkerImpl final : public PrefillWorker {
 public:
  explicit PrefillWorkerImpl(PrefillWorkerOptions options) : options_(std::move(options)) {
    if (options_.worker_id.empty()) options_.worker_id = absl::StrCat("prefill-", getpid());
  }
  ~PrefillWorkerImpl() override { Shutdown(absl::ZeroDuration()); }

  absl::Status Start();

  std::string grpc_address() const override { return grpc_address_; }
  int metrics_port() const override { return http_ ? http_->port() : 0; }
  tandem::v1::WorkerStats Stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    tandem::v1::WorkerStats stats = stats_;
    stats.set_draining(!accepting_);
    return stats;
  }
  void Shutdown(absl::Duration grace) override;

  // --- the gRPC handlers (any thread) ---
  absl::StatusOr<tandem::v1::SubmitResponse> Submit(grpc::ServerContext& context,
                                                    const tandem::v1::SubmitRequest& request);
  absl::StatusOr<bool> Cancel(grpc::ServerContext& context, const std::string& request_id,
                              const std::string& reason);
  absl::StatusOr<tandem::v1::HandshakeResponse> Handshake(
      const tandem::v1::HandshakeRequest& request) const;

 private:
  // Checks a Submit against this worker and builds its job (connecting to the decode worker).
  absl::StatusOr<std::unique_ptr<Job>> PrepareJob(grpc::ServerContext& context,
                                                  const tandem::v1::SubmitRequest& request);
  // A connection to the agent at `address`, cached; `fresh` replaces a cached one.
  absl::StatusOr<kvtransfer::PeerId> PeerFor(const std::string& address, absl::Time deadline,
                                             bool fresh);
  // Forgets (and closes) a cached connection that failed.
  void DropPeer(const std::string& address, kvtransfer::PeerId peer);
  void Enqueue(Command command);

  // --- the engine loop (loop thread only) ---
  void Loop();
  void HandleCommand(Command& command);
  // The on_layer_kv_written hook: posts the layer's new pages of every request it wrote.
  void OnLayerWritten(int layer, std::span<const KvWritten> written);
  void Post(Job& job, int layer, std::vector<kvtransfer::Range> ranges);
  // Polls a job's handles oldest first, dropping the finished ones; a failure fails the job.
  // With `all`, polls past unfinished ones too (a failing job waits for every handle).
  void PollHandles(Job& job, bool all);
  void Fail(Job& job, absl::Status status);
  // Frees the blocks of the job's handed-off samples once no transfer of the job is in flight
  // (the response needs only their first tokens).
  void ReleaseIdleHandoffs(Job& job);
  // Waits for the transfers of every job holding handed-off blocks and frees those blocks.
  // Returns whether there were any.
  bool WaitForHeldBlocks();
  // A transfer of the job failed.
  void HandleFailed(Job& job, const absl::Status& status);
  void AfterStep(const std::vector<engine::RequestOutput>& outputs);
  // Answers every job that is done (or has failed and has nothing in flight any more). Returns
  // the calls to notify once the stats reflect the freed blocks.
  std::vector<std::shared_ptr<Call>> FinishJobs(bool force);
  void Complete(Job& job, std::vector<std::shared_ptr<Call>>& notify);
  void UpdateStats();

  PrefillWorkerOptions options_;
  std::unique_ptr<engine::LlmEngine> engine_;  // destroyed last: the agent reads its cache
  tandem::v1::KvLayout layout_;
  engine::KvCacheLayout cache_layout_;  // this worker's cache; a decode worker's differs in size
  int num_layers_ = 0;
  std::unique_ptr<kvtransfer::Agent> agent_;
  Metrics metrics_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string grpc_address_;
  std::unique_ptr<worker::StatusServer> http_;  // /health and /metrics

  std::mutex peers_mu_;
  std::map<std::string, kvtransfer::PeerId> peers_;  // guarded by peers_mu_

  mutable std::mutex mu_;
  std::condition_variable wake_;                            // the loop: commands or stop
  std::condition_variable idle_;                            // Shutdown: a call finished
  std::vector<Command> commands_;                           // guarded by mu_
  std::map<std::string, std::shared_ptr<Call>> in_flight_;  // guarded by mu_; by request id
  bool accepting_ = true;                                   // guarded by mu_
  bool stop_ = false;                                       // guarded by mu_
  tandem::v1::WorkerStats stats_;                           // guarded by mu_

  std::thread loop_;
  std::mutex shutdown_mu_;
  bool shut_down_ = false;  // guarded by shutdown_mu_

  // Loop thread only.
  std::map<std::string, std::unique_ptr<Job>, std::less<>> jobs_;
  absl::Time step_start_;                                               // of the step running
  std::vector<std::unique_ptr<kvtransfer::TransferHandle>> abandoned_;  // outlive the agent
};

// ---------------------------------------------------------------------------------------------
// Start and shutdown

absl::Status PrefillWorkerImpl::Start() {
  engine::EngineOptions engine_options = options_.engine;
  engine_options.role = engine::EngineRole::kPrefill;
  engine_options.on_layer_kv_written = [this](int layer, std::span<const KvWritten> written) {
    OnLayerWritten(layer, written);
  };
  TANDEM_ASSIGN_OR_RETURN(engine_, engine::LlmEngine::Create(engine_options));
  cache_layout_ = engine_->cache_layout();
  num_layers_ = cache_layout_.num_layers;
  layout_ = proto::EngineKvLayout(engine_->config(), engine_->kv_layout().block_size,
                                  engine_->kv_layout().dtype);

  kvtransfer::AgentOptions agent_options;
  agent_options.backend = options_.kv_backend;
  agent_options.name = options_.worker_id;
  agent_options.listen_host = options_.kv_listen_host;
  TANDEM_ASSIGN_OR_RETURN(agent_, kvtransfer::Agent::Create(agent_options));
  TANDEM_RETURN_IF_ERROR(
      agent_->RegisterMemory(kCacheRegion, engine_->kv_cache(), engine_->kv_cache_bytes())
          .status());

  metrics_.ttft_target.Set(engine_options.ttft_slo_seconds);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.set_role(tandem::v1::WORKER_ROLE_PREFILL);
    stats_.set_worker_id(options_.worker_id);
  }
  UpdateStats();

  if (!options_.metrics_address.empty()) {
    TANDEM_ASSIGN_OR_RETURN(http_, worker::StatusServer::Create(
                                       options_.metrics_address,
                                       [this] {
                                         std::lock_guard<std::mutex> lock(mu_);
                                         return !accepting_;
                                       },
                                       [this] { return metrics_.registry.Render(); }));
  }

  // The loop runs before the first call can arrive, so every accepted call gets its answer.
  loop_ = std::thread([this] { Loop(); });
  service_ = std::make_unique<Service>(this);
  TANDEM_ASSIGN_OR_RETURN(proto::StartedServer started,
                          proto::StartGrpcServer(options_.grpc_address, service_.get(),
                                                 options_.tls));
  server_ = std::move(started.server);
  grpc_address_ = std::move(started.address);

  return absl::OkStatus();
}

void PrefillWorkerImpl::Shutdown(absl::Duration grace) {
  std::lock_guard<std::mutex> shutdown_lock(shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  {
    std::unique_lock<std::mutex> lock(mu_);
    accepting_ = false;
    // Requests in flight may finish within the grace period.
    const auto until = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(grace);
    idle_.wait_until(lock, until, [&] { return in_flight_.empty(); });
    // The loop cancels the rest, waits for their transfers, answers every call and exits.
    stop_ = true;
  }
  wake_.notify_all();
  if (loop_.joinable()) loop_.join();
  if (server_) {
    // Every call has its answer now; handlers return within one cancellation poll.
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }
  if (http_) http_->Stop();
  if (agent_) {
    // Returns once no posted transfer reads the cache any more.
    agent_->DeregisterMemory(kCacheRegion).IgnoreError();
    agent_.reset();
  }
  abandoned_.clear();
  UpdateStats();
}

// ---------------------------------------------------------------------------------------------
// Handlers

absl::StatusOr<kvtransfer::PeerId> PrefillWorkerImpl::PeerFor(const std::string& address,
                                                              absl::Time deadline, bool fresh) {
  std::optional<kvtransfer::PeerId> stale;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(address);
    if (it != peers_.end()) {
      if (!fresh) return it->second;
      stale = it->second;
      peers_.erase(it);
    }
  }
  if (stale.has_value()) agent_->Disconnect(*stale).IgnoreError();
  // Connect without holding the lock: a slow peer must not hold up connections to others.
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::PeerId peer, agent_->Connect(address, deadline));
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto [it, inserted] = peers_.emplace(address, peer);
  if (!inserted && it->second != peer) {
    // Another request connected at the same time: use one connection.
    agent_->Disconnect(peer).IgnoreError();
  }
  return it->second;
}

void PrefillWorkerImpl::DropPeer(const std::string& address, kvtransfer::PeerId peer) {
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(address);
    if (it == peers_.end() || it->second != peer) return;
    peers_.erase(it);
  }
  agent_->Disconnect(peer).IgnoreError();
}

absl::StatusOr<std::unique_ptr<Job>> PrefillWorkerImpl::PrepareJob(
    grpc::ServerContext& context, const tandem::v1::SubmitRequest& request) {
  const tandem::v1::KvReservation& reservation = request.reservation();
  const tandem::v1::TransferEndpoint& endpoint = reservation.endpoint();
  if (request.request_id().empty()) {
    return absl::InvalidArgumentError("request_id must not be empty");
  }
  TANDEM_RETURN_IF_ERROR(proto::CheckTransferEndpoint(layout_, options_.kv_backend, endpoint,
                                                      "reservation.endpoint",
                                                      "this prefill worker"));

  auto job = std::make_unique<Job>();
  job->received = absl::Now();
  job->id = request.request_id();
  job->request.request_id = request.request_id();
  job->request.arrival = std::chrono::steady_clock::now();
  job->request.prompt_tokens.assign(request.prompt_token_ids().begin(),
                                    request.prompt_token_ids().end());
  job->request.params = proto::FromProto(request.sampling());
  TANDEM_RETURN_IF_ERROR(engine_->Validate(job->request));
  job->n = job->request.params.n;
  job->prompt_len = static_cast<int>(job->request.prompt_tokens.size());

  const int bs = cache_layout_.block_size;
  const int blocks_per_choice = (job->prompt_len + bs - 1) / bs;
  if (reservation.blocks_per_choice() != blocks_per_choice) {
    return absl::InvalidArgumentError(absl::StrCat(
        "reservation.blocks_per_choice is ", reservation.blocks_per_choice(), " but ",
        job->prompt_len, " prompt tokens take ", blocks_per_choice, " blocks of ", bs));
  }
  const int64_t want_blocks = static_cast<int64_t>(job->n) * blocks_per_choice;
  if (reservation.block_ids_size() != want_blocks) {
    return absl::InvalidArgumentError(
        absl::StrCat("reservation has ", reservation.block_ids_size(), " block ids; n = ", job->n,
                     " samples of ", blocks_per_choice, " blocks need ", want_blocks));
  }
  std::set<int32_t> seen;
  for (int32_t id : reservation.block_ids()) {
    if (id < 0 || id >= endpoint.num_blocks()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "reservation block id ", id, " is outside [0, ", endpoint.num_blocks(), ")"));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("reservation block id ", id, " appears more than once"));
    }
  }
  job->dst_blocks.assign(reservation.block_ids().begin(), reservation.block_ids().end());
  job->blocks_per_choice = blocks_per_choice;
  job->dst_num_blocks = endpoint.num_blocks();
  job->descriptors.assign(endpoint.region_descriptors().begin(),
                          endpoint.region_descriptors().end());
  job->peer_address = endpoint.address();

  // The deadline: the Submit's, the reservation's expiry, the call's, and this worker's cap.
  absl::Time deadline =
      std::min({FromUnixMillisOrInfinite(request.deadline_unix_ms()),
                FromUnixMillisOrInfinite(reservation.expires_unix_ms()),
                absl::FromChrono(context.deadline()), job->received + kMaxRequestTime});
  if (deadline <= job->received) {
    return absl::DeadlineExceededError(
        absl::StrCat("request ", job->id, " arrived after its deadline"));
  }
  job->deadline = deadline;
  job->transfer_deadline = std::min(FromUnixMillisOrInfinite(reservation.expires_unix_ms()),
                                    job->received + kMaxRequestTime);
  job->computed.assign(job->n, 0);
  job->sample_done.assign(job->n, false);

  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) return absl::UnavailableError("the prefill worker is shutting down");
    if (in_flight_.count(job->id) > 0) {
      return absl::AlreadyExistsError(absl::StrCat("request ", job->id, " is already in flight"));
    }
  }
  auto peer = PeerFor(job->peer_address, std::min(deadline, absl::Now() + kConnectTimeout), false);
  if (!peer.ok()) {
    return absl::Status(peer.status().code(),
                        absl::StrCat("request ", job->id, ": cannot reach the decode worker: ",
                                     std::string(peer.status().message())));
  }
  job->peer = *peer;
  return job;
}

void PrefillWorkerImpl::Enqueue(Command command) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands_.push_back(std::move(command));
  }
  wake_.notify_all();
}

absl::StatusOr<tandem::v1::SubmitResponse> PrefillWorkerImpl::Submit(
    grpc::ServerContext& context, const tandem::v1::SubmitRequest& request) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) return absl::UnavailableError("the prefill worker is shutting down");
  }
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Job> job, PrepareJob(context, request));
  std::shared_ptr<Call> call = std::make_shared<Call>();
  job->call = call;
  const std::string id = job->id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!accepting_) return absl::UnavailableError("the prefill worker is shutting down");
    if (!in_flight_.emplace(id, call).second) {
      return absl::AlreadyExistsError(absl::StrCat("request ", id, " is already in flight"));
    }
    commands_.push_back({Command::Kind::kAdd, std::move(job), "", absl::OkStatus()});
  }
  wake_.notify_all();

  bool cancel_sent = false;
  while (!call->done.WaitForNotificationWithTimeout(kCancelPoll)) {
    if (!cancel_sent && context.IsCancelled()) {
      Enqueue(
          {Command::Kind::kCancel, nullptr, id,
           absl::CancelledError(absl::StrCat("request ", id, ": the Submit call was cancelled"))});
      cancel_sent = true;
    }
  }
  if (!call->status.ok()) return call->status;
  return call->response;
}

absl::StatusOr<bool> PrefillWorkerImpl::Cancel(grpc::ServerContext& context,
                                               const std::string& request_id,
                                               const std::string& reason) {
  std::shared_ptr<Call> call;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = in_flight_.find(request_id);
    if (it == in_flight_.end()) return false;
    call = it->second;
  }
  Enqueue({Command::Kind::kCancel, nullptr, request_id,
           absl::CancelledError(absl::StrCat("request ", request_id, " was cancelled",
                                             reason.empty() ? "" : ": ", reason))});
  // Answer once the request is over (its transfers final, its blocks freed), so that the caller
  // may release the reservation right after.
  while (!call->done.WaitForNotificationWithTimeout(kCancelPoll)) {
    if (context.IsCancelled()) break;
  }
  return true;
}

absl::StatusOr<tandem::v1::HandshakeResponse> PrefillWorkerImpl::Handshake(
    const tandem::v1::HandshakeRequest& request) const {
  TANDEM_RETURN_IF_ERROR(proto::CheckLayoutCompatible(layout_, request.layout()));
  tandem::v1::HandshakeResponse response;
  response.set_worker_id(options_.worker_id);
  *response.mutable_layout() = layout_;
  return response;
}

grpc::Status Service::Submit(grpc::ServerContext* context, const tandem::v1::SubmitRequest* request,
                             tandem::v1::SubmitResponse* response) {
  auto result = worker_->Submit(*context, *request);
  if (!result.ok()) return proto::ToGrpcStatus(result.status());
  *response = std::move(result).value();
  return grpc::Status::OK;
}

grpc::Status Service::Cancel(grpc::ServerContext* context, const tandem::v1::CancelRequest* request,
                             tandem::v1::CancelResponse* response) {
  auto found = worker_->Cancel(*context, request->request_id(), request->reason());
  if (!found.ok()) return proto::ToGrpcStatus(found.status());
  response->set_found(*found);
  return grpc::Status::OK;
}

grpc::Status Service::Stats(grpc::ServerContext*, const tandem::v1::StatsRequest*,
                            tandem::v1::WorkerStats* response) {
  *response = worker_->Stats();
  return grpc::Status::OK;
}

grpc::Status Service::Handshake(grpc::ServerContext*, const tandem::v1::HandshakeRequest* request,
                                tandem::v1::HandshakeResponse* response) {
  auto result = worker_->Handshake(*request);
  if (!result.ok()) return proto::ToGrpcStatus(result.status());
  *response = std::move(result).value();
  return grpc::Status::OK;
}

// ---------------------------------------------------------------------------------------------
// The engine loop

void PrefillWorkerImpl::Loop() {
  std::optional<absl::Time> stop_since;
  while (true) {
    std::vector<Command> commands;
    {
      std::unique_lock<std::mutex> lock(mu_);
      const bool busy = engine_->has_unfinished() && !stop_;
      const bool transfers = std::any_of(jobs_.begin(), jobs_.end(),
                                         [](const auto& j) { return !j.second->handles.empty(); });
      if (!busy && commands_.empty() && !stop_) {
        wake_.wait_for(lock, absl::ToChronoNanoseconds(transfers ? kTransferPoll : kIdleWake));
      }
      commands.swap(commands_);
      if (stop_ && !stop_since.has_value()) stop_since = absl::Now();
    }
    for (Command& command : commands) HandleCommand(command);

    const absl::Time now = absl::Now();
    for (auto& [id, job] : jobs_) {
      if (stop_since.has_value()) {
        Fail(*job, absl::UnavailableError(
                       absl::StrCat("request ", id, ": the prefill worker is shutting down")));
      } else if (!job->failing() && now >= job->deadline) {
        Fail(*job,
             absl::DeadlineExceededError(absl::StrCat("request ", id, " passed its deadline (",
                                                      absl::FormatTime(job->deadline), ")")));
      }
    }

    if (engine_->has_unfinished() && !stop_since.has_value()) {
      step_start_ = absl::Now();
      auto outputs = engine_->Step();
      if (!outputs.ok() && WaitForHeldBlocks()) {
        // The scheduler found no room because handed-off samples still hold blocks while their
        // pages are in flight; those are free now, so the next step goes on.
      } else if (!outputs.ok()) {
        for (auto& [id, job] : jobs_) {
          Fail(*job, absl::InternalError(absl::StrCat("request ", id, ": engine step failed: ",
                                                      std::string(outputs.status().message()))));
        }
      } else {
        AfterStep(*outputs);
      }
    }

    for (auto& [id, job] : jobs_) {
      PollHandles(*job, job->failing());
      ReleaseIdleHandoffs(*job);
    }
    const bool force = stop_since.has_value() && absl::Now() - *stop_since > kShutdownDrain;
    std::vector<std::shared_ptr<Call>> notify = FinishJobs(force);
    UpdateStats();
    if (!notify.empty()) {
      for (const std::shared_ptr<Call>& call : notify) call->done.Notify();
      idle_.notify_all();
    }
    if (stop_since.has_value() && jobs_.empty()) break;
  }
  // Submits queued after the last iteration are answered too.
  std::vector<Command> commands;
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands.swap(commands_);
  }
  for (Command& command : commands) {
    if (command.kind != Command::Kind::kAdd) continue;
    command.job->call->status = absl::UnavailableError("the prefill worker is shutting down");
    {
      std::lock_guard<std::mutex> lock(mu_);
      in_flight_.erase(command.job->id);
    }
    command.job->call->done.Notify();
  }
  idle_.notify_all();
}

void PrefillWorkerImpl::HandleCommand(Command& command) {
  if (command.kind == Command::Kind::kCancel) {
    auto it = jobs_.find(command.request_id);
    if (it != jobs_.end()) Fail(*it->second, command.reason);
    return;
  }
  std::unique_ptr<Job> job = std::move(command.job);
  Job& ref = *job;
  auto [it, inserted] = jobs_.emplace(job->id, std::move(job));
  if (!inserted) {  // in_flight_ refuses duplicates before they get here
    ref.call->status = absl::AlreadyExistsError(absl::StrCat("request ", ref.id, " exists"));
    ref.call->done.Notify();
    return;
  }
  absl::Status added = engine_->AddRequest(ref.request);
  if (!added.ok()) {
    Fail(ref, added);
  } else {
    ref.admitted = true;
  }
}

void PrefillWorkerImpl::Fail(Job& job, absl::Status status) {
  if (job.failure.ok()) job.failure = std::move(status);
}

void PrefillWorkerImpl::OnLayerWritten(int layer, std::span<const KvWritten> written) {
  // One transfer per request and layer, with a range per (K or V, block) piece of its tokens.
  std::map<Job*, std::vector<kvtransfer::Range>> posts;
  const int bs = cache_layout_.block_size;
  for (const KvWritten& w : written) {
    auto it = jobs_.find(w.request_id);
    if (it == jobs_.end()) continue;
    Job& job = *it->second;
    if (job.failing() || w.choice_index < 0 || w.choice_index >= job.n) continue;
    if (layer == 0) {
      job.scheduled = std::min(job.scheduled, step_start_);
      if (w.begin < job.computed[w.choice_index]) {
        // The sample was preempted and is being recomputed: what it posts now must land after
        // what it posted before, so let the earlier transfers finish first.
        for (auto& handle : job.handles) {
          absl::Status status = handle->Wait();
          if (!status.ok()) HandleFailed(job, status);
        }
        job.handles.clear();
        job.last_done = absl::Now();
        if (job.failing()) continue;
      }
    }
    const int end = std::min(w.end, job.prompt_len);
    std::vector<kvtransfer::Range>& ranges = posts[&job];
    // The decode worker's cache: one region, or one region per layer.
    engine::KvCacheLayout dst = cache_layout_;
    dst.num_blocks = static_cast<int>(job.dst_num_blocks);
    const int dst_layer = job.descriptors.size() > 1 ? 0 : layer;
    for (int half = 0; half < 2; ++half) {
      for (int t = w.begin; t < end;) {
        const int logical = t / bs;
        const int slot = t % bs;
        const int count = std::min(end, (logical + 1) * bs) - t;
        if (logical >= static_cast<int>(w.blocks->size()) || logical >= job.blocks_per_choice) {
          break;
        }
        const int32_t src_block = (*w.blocks)[logical];
        const int32_t dst_block =
            job.dst_blocks[static_cast<size_t>(w.choice_index) * job.blocks_per_choice + logical];
        ranges.push_back({cache_layout_.Offset(layer, half, src_block, slot),
                          dst.Offset(dst_layer, half, dst_block, slot),
                          static_cast<uint64_t>(count) * cache_layout_.row_bytes()});
        t += count;
      }
    }
    if (layer == num_layers_ - 1) job.computed[w.choice_index] = end;
  }
  for (auto& [job, ranges] : posts) {
    if (!ranges.empty() && !job->failing()) Post(*job, layer, std::move(ranges));
  }
}

void PrefillWorkerImpl::Post(Job& job, int layer, std::vector<kvtransfer::Range> ranges) {
  const std::string& descriptor =
      job.descriptors.size() > 1 ? job.descriptors[layer] : job.descriptors[0];
  uint64_t bytes = 0;
  for (const kvtransfer::Range& r : ranges) bytes += r.bytes;
  const absl::Time posted = absl::Now();
  auto handle = agent_->Submit(job.peer, kCacheRegion, descriptor, ranges, job.transfer_deadline);
  // NotFound: another request dropped the cached connection after it failed.
  auto gone = [](const absl::Status& s) {
    return s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kNotFound;
  };
  if (!handle.ok() && gone(handle.status()) && !job.reconnected) {
    // The cached connection is gone (e.g. closed after an earlier failure): connect once more.
    job.reconnected = true;
    auto peer = PeerFor(job.peer_address, std::min(job.deadline, absl::Now() + kConnectTimeout),
                        /*fresh=*/true);
    if (!peer.ok()) {
      Fail(job, TransferFailure(job.id, peer.status()));
      return;
    }
    job.peer = *peer;
    handle = agent_->Submit(job.peer, kCacheRegion, descriptor, std::move(ranges),
                            job.transfer_deadline);
  }
  if (!handle.ok()) {
    if (handle.status().code() == absl::StatusCode::kUnavailable) {
      DropPeer(job.peer_address, job.peer);
    }
    Fail(job, TransferFailure(job.id, handle.status()));
    return;
  }
  job.first_post = std::min(job.first_post, posted);
  job.bytes += bytes;
  job.handles.push_back(std::move(handle).value());
  PollHandles(job, false);
}

void PrefillWorkerImpl::PollHandles(Job& job, bool all) {
  for (auto it = job.handles.begin(); it != job.handles.end();) {
    std::optional<absl::Status> status = (*it)->Poll();
    if (!status.has_value()) {
      if (!all) return;
      ++it;
      continue;
    }
    if (status->ok()) {
      job.last_done = absl::Now();
    } else {
      HandleFailed(job, *status);
    }
    it = job.handles.erase(it);
  }
}

void PrefillWorkerImpl::ReleaseIdleHandoffs(Job& job) {
  if (!job.handles.empty()) return;
  for (PrefillHandoff& handoff : job.handoffs) {
    if (handoff.blocks.empty()) continue;
    engine_->ReleaseHandoff(handoff);
    handoff.blocks.clear();
  }
}

bool PrefillWorkerImpl::WaitForHeldBlocks() {
  bool held = false;
  for (auto& [id, job] : jobs_) {
    const bool holds = std::any_of(job->handoffs.begin(), job->handoffs.end(),
                                   [](const PrefillHandoff& h) { return !h.blocks.empty(); });
    if (!holds) continue;
    held = true;
    for (auto& handle : job->handles) {
      absl::Status status = handle->Wait();  // bounded by the transfer deadline
      if (status.ok()) {
        job->last_done = absl::Now();
      } else {
        HandleFailed(*job, status);
      }
    }
    job->handles.clear();
    ReleaseIdleHandoffs(*job);
  }
  return held;
}

void PrefillWorkerImpl::HandleFailed(Job& job, const absl::Status& status) {
  // The connection is gone, or a transfer outlived the reservation and may still be landing in
  // blocks the decode worker is about to reuse: closing the connection stops it (and a later
  // request connects again).
  if (status.code() == absl::StatusCode::kUnavailable ||
      status.code() == absl::StatusCode::kCancelled ||
      status.code() == absl::StatusCode::kDeadlineExceeded) {
    DropPeer(job.peer_address, job.peer);
  }
  Fail(job, TransferFailure(job.id, status));
}

void PrefillWorkerImpl::AfterStep(const std::vector<engine::RequestOutput>& outputs) {
  const absl::Time now = absl::Now();
  for (PrefillHandoff& handoff : engine_->TakeHandoffs()) {
    auto it = jobs_.find(handoff.request_id);
    if (it == jobs_.end()) {
      engine_->ReleaseHandoff(handoff);  // not ours (cannot happen): never leak its blocks
      continue;
    }
    Job& job = *it->second;
    job.sample_done[handoff.choice_index] = true;
    job.handoffs.push_back(std::move(handoff));
  }
  // A sample whose first token already ends it (EOS, a stop id or string, max_tokens 1) is
  // finished by the engine instead of handed off; its blocks are freed and the decode worker
  // only needs the token to finish it the same way.
  for (const engine::RequestOutput& out : outputs) {
    auto it = jobs_.find(out.request_id);
    if (it == jobs_.end()) continue;
    Job& job = *it->second;
    for (const engine::ChoiceDelta& delta : out.choices) {
      if (delta.finish_reason == engine::FinishReason::kNone ||
          delta.finish_reason == engine::FinishReason::kPrefilled || delta.token_ids.empty() ||
          delta.index < 0 || delta.index >= job.n || job.sample_done[delta.index]) {
        continue;
      }
      PrefillHandoff handoff;
      handoff.request_id = job.id;
      handoff.choice_index = delta.index;
      handoff.first_token = delta.token_ids[0];
      if (!delta.logprobs.empty()) handoff.first_logprob = delta.logprobs[0];
      if (!delta.top_logprobs.empty()) handoff.first_top_logprobs = delta.top_logprobs[0];
      job.sample_done[delta.index] = true;
      job.handoffs.push_back(std::move(handoff));
    }
  }
  for (auto& [id, job] : jobs_) {
    if (job->all_sampled() && job->compute_done == absl::InfiniteFuture()) job->compute_done = now;
  }
}

std::vector<std::shared_ptr<Call>> PrefillWorkerImpl::FinishJobs(bool force) {
  std::vector<std::shared_ptr<Call>> notify;
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    Job& job = *it->second;
    const bool ready =
        job.failing() ? job.handles.empty() || force : job.all_sampled() && job.handles.empty();
    if (!ready) {
      ++it;
      continue;
    }
    Complete(job, notify);
    it = jobs_.erase(it);
  }
  return notify;
}

void PrefillWorkerImpl::Complete(Job& job, std::vector<std::shared_ptr<Call>>& notify) {
  // Nothing reads the request's blocks any more (or, forced at shutdown, destroying the agent
  // stops what still does before the cache goes away): free them.
  for (auto& handle : job.handles) abandoned_.push_back(std::move(handle));
  job.handles.clear();
  if (job.admitted) engine_->Abort(job.id);  // no-op once every sample is handed off
  for (const PrefillHandoff& handoff : job.handoffs) {
    if (!handoff.blocks.empty()) engine_->ReleaseHandoff(handoff);
  }
  Call& call = *job.call;
  if (job.failing()) {
    call.status = job.failure;
  } else {
    std::sort(job.handoffs.begin(), job.handoffs.end(),
              [](const PrefillHandoff& a, const PrefillHandoff& b) {
                return a.choice_index < b.choice_index;
              });
    tandem::v1::SubmitResponse& response = call.response;
    for (const PrefillHandoff& handoff : job.handoffs) {
      *response.add_choices() = proto::ToProto(handoff.choice_index, handoff);
    }
    response.set_num_prompt_tokens(job.prompt_len);
    response.set_kv_transfer_bytes(job.bytes);
    double transfer = 0, exposed = 0;
    if (job.bytes > 0 && job.first_post != absl::InfiniteFuture()) {
      transfer =
          absl::ToDoubleSeconds(std::max(job.last_done - job.first_post, absl::ZeroDuration()));
      exposed =
          absl::ToDoubleSeconds(std::max(job.last_done - job.compute_done, absl::ZeroDuration()));
    }
    const absl::Time scheduled = std::min(job.scheduled, job.compute_done);
    response.set_kv_transfer_seconds(transfer);
    response.set_kv_transfer_exposed_seconds(exposed);
    response.set_prefill_seconds(absl::ToDoubleSeconds(job.compute_done - scheduled));
    response.set_queue_seconds(
        absl::ToDoubleSeconds(std::max(scheduled - job.received, absl::ZeroDuration())));
    metrics_.prompt_tokens.Increment(job.prompt_len);
    metrics_.transfer_bytes.Increment(static_cast<double>(job.bytes));
    metrics_.transfer_seconds.Increment(transfer);
    metrics_.exposed_seconds.Increment(exposed);
    metrics_.prefill_seconds.Observe(response.prefill_seconds());
  }
  metrics_.Requests(call.status.code()).Increment();
  {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.erase(job.id);
  }
  notify.push_back(job.call);
}

void PrefillWorkerImpl::UpdateStats() {
  if (!engine_) return;
  const engine::EngineStats engine_stats = engine_->stats();
  int64_t queued = 0;
  for (const auto& [id, job] : jobs_) {
    if (job->failing()) continue;
    for (int c = 0; c < job->n; ++c) {
      if (!job->sample_done[c]) queued += job->prompt_len - job->computed[c];
    }
  }
  metrics_.engine.Record(engine_stats);
  metrics_.queued_tokens.Set(static_cast<double>(queued));
  metrics_.token_budget.Set(engine_stats.token_budget);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.set_queued_prefill_tokens(queued);
  stats_.set_running(engine_stats.running);
  stats_.set_waiting(engine_stats.waiting);
  stats_.set_kv_blocks_used(engine_stats.kv_blocks_used);
  stats_.set_kv_blocks_total(engine_stats.kv_blocks_total);
  stats_.set_preemptions_total(engine_stats.preemptions);
}

}  // namespace

absl::StatusOr<std::unique_ptr<PrefillWorker>> PrefillWorker::Create(PrefillWorkerOptions options) {
  auto worker = std::make_unique<PrefillWorkerImpl>(std::move(options));
  TANDEM_RETURN_IF_ERROR(worker->Start());
  return worker;
}

}  // namespace tandem::prefill_worker
