#include "tandem/decode_worker/decode_worker.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "tandem/base/host_port.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/engine_metrics.h"
#include "tandem/engine/model_runner.h"
#include "tandem/kvtransfer/agent.h"
#include "tandem/metrics/registry.h"
#include "tandem/proto/kv_layout_check.h"
#include "tandem/proto/wire.h"
#include "tandem/v1/decode.grpc.pb.h"
#include "tandem/worker/status_server.h"

namespace tandem::decode_worker {
namespace {

// The engine loop wakes at least this often, so deadlines are enforced while idle.
constexpr auto kIdleWake = std::chrono::milliseconds(20);
// A Start handler checks for a cancelled call at least this often.
constexpr auto kStreamPoll = std::chrono::milliseconds(50);
// An expired reservation keeps its blocks this much longer, so that prefill transfers still in
// flight (prefill workers use expires_unix_ms as their transfer deadline) land in blocks nobody
// else owns yet.
constexpr int64_t kExpiryGraceMs = 2000;
// Upper bound of ReserveRequest.n: what the engine accepts.
constexpr int kMaxReserveSamples = engine::kMaxSamplesPerRequest;
// The KV cache's region id in the transfer agent.
constexpr uint64_t kKvRegionId = 0;
// Longest DecodeWorkerOptions::handoff_ttl.
constexpr absl::Duration kMaxHandoffTtl = absl::Seconds(30);
// A Handoff's transfer (connect included) takes at most this, and never past the target
// reservation's expiry.
constexpr absl::Duration kHandoffTransferMax = absl::Seconds(10);

absl::Status Stopped() { return absl::UnavailableError("the decode worker has shut down"); }

int64_t NowUnixMs() { return absl::ToUnixMillis(absl::Now()); }

// The events of one Start call, filled by the engine loop and drained by the call's handler.
struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<tandem::v1::TokenEvent> events;  // guarded by mu
  bool done = false;                          // guarded by mu: the last event is queued

  void Push(std::vector<tandem::v1::TokenEvent> batch, bool last) {
    {
      std::lock_guard<std::mutex> lock(mu);
      for (tandem::v1::TokenEvent& e : batch) events.push_back(std::move(e));
      if (last) done = true;
    }
    cv.notify_all();
  }
};

// Blocks set aside for a request whose prompt KV is being written by a prefill worker.
struct Reservation {
  std::string request_id;
  int num_prompt_tokens = 0;
  int n = 1;
  std::vector<engine::BlockTable> blocks;  // one table per sample
  int64_t expires_unix_ms = 0;

  int num_blocks() const {
    int total = 0;
    for (const engine::BlockTable& b : blocks) total += static_cast<int>(b.size());
    return total;
  }
};

// A sample parked for KV handoff: the blocks holding the KV of its first num_kv_tokens tokens.
struct ParkedSample {
  engine::BlockTable blocks;
  int num_kv_tokens = 0;
  bool transferring = false;  // a Handoff reads the blocks; nothing may free them meanwhile
};

// A request parked while draining (its stream ended with a KvHandoff).
struct Parked {
  int64_t expires_unix_ms = 0;
  std::map<int, ParkedSample> samples;  // by sample index; emptied as they are handed off
};

// A started request, as the engine loop tracks it.
struct Running {
  std::shared_ptr<Stream> stream;
  std::vector<bool> finished;  // per sample
  int num_prompt_tokens = 0;
  int num_generation_tokens = 0;
};

class DecodeWorkerImpl;

// The gRPC face; every call goes to the worker.
class Service final : public tandem::v1::DecodeWorker::Service {
 public:
  explicit Service(DecodeWorkerImpl* worker) : worker_(worker) {}

  grpc::Status Reserve(grpc::ServerContext*, const tandem::v1::ReserveRequest* request,
                       tandem::v1::ReserveResponse* response) override;
  grpc::Status Release(grpc::ServerContext*, const tandem::v1::ReleaseRequest* request,
                       tandem::v1::ReleaseResponse* response) override;
  grpc::Status Start(grpc::ServerContext* context, const tandem::v1::StartRequest* request,
                     grpc::ServerWriter<tandem::v1::TokenEvent>* writer) override;
  grpc::Status Cancel(grpc::ServerContext*, const tandem::v1::CancelRequest* request,
                      tandem::v1::CancelResponse* response) override;
  grpc::Status Stats(grpc::ServerContext*, const tandem::v1::StatsRequest*,
                     tandem::v1::WorkerStats* stats) override;
  grpc::Status Handshake(grpc::ServerContext*, const tandem::v1::HandshakeRequest* request,
                         tandem::v1::HandshakeResponse* response) override;
  grpc::Status Handoff(grpc::ServerContext*, const tandem::v1::HandoffRequest* request,
                       tandem::v1::HandoffResponse* response) override;

 private:
  DecodeWorkerImpl* worker_;
};

struct Metrics {
  metrics::Registry registry;
  engine::EngineMetrics engine{registry};  // KV, batch, preemptions, step times
  prometheus::Gauge* kv_reserved = nullptr;
  prometheus::Gauge* reservations = nullptr;
  prometheus::Counter* requests = nullptr;
  prometheus::Counter* expired = nullptr;
  prometheus::Counter* generation_tokens = nullptr;
  prometheus::Gauge* batch_limit = nullptr;
  prometheus::Gauge* tpot_target = nullptr;
  prometheus::Gauge* step_gap = nullptr;
  prometheus::Counter* slo_refusals = nullptr;
  prometheus::Counter* handoffs = nullptr;
  prometheus::Counter* handoff_bytes = nullptr;
  prometheus::Counter* handoff_seconds = nullptr;
  prometheus::Counter* parked_expired = nullptr;

  Metrics() {
    kv_reserved = &registry.Gauge("tandem_kv_cache_blocks_reserved",
                                    "KV cache blocks held by reservations not yet started.");
    reservations = &registry.Gauge("tandem_decode_reservations", "Live KV reservations.");
    requests = &registry.Counter("tandem_decode_requests_total", "Requests started (Start).");
    expired = &registry.Counter("tandem_decode_reservations_expired_total",
                                  "Reservations released because nobody started them in time.");
    generation_tokens =
        &registry.Counter("tandem_generation_tokens_total", "Tokens generated, all samples.");
    batch_limit = &registry.Gauge(
        "tandem_decode_batch_limit",
        "Sequences a decode step may run: max_num_seqs, or the TPOT controller's lower cap.");
    tpot_target = &registry.Gauge("tandem_decode_tpot_target_seconds",
                                    "The TPOT target the batch is sized for (0: none).");
    step_gap = &registry.Gauge(
        "tandem_step_gap_seconds",
        "Recent mean time between engine steps while work was pending (the worker's loop).");
    slo_refusals = &registry.Counter(
        "tandem_decode_reserve_refused_slo_total",
        "Reserve calls refused because the running batch was at the TPOT controller's cap.");
    handoffs = &registry.Counter(
        "tandem_decode_kv_handoffs_total",
        "Samples parked while draining whose KV a Handoff moved to another decode worker.");
    handoff_bytes = &registry.Counter("tandem_decode_kv_handoff_bytes_total",
                                        "KV bytes moved by Handoff calls.");
    handoff_seconds = &registry.Counter("tandem_decode_kv_handoff_seconds_total",
                                          "Time spent moving KV in Handoff calls.");
    parked_expired = &registry.Counter(
        "tandem_decode_parked_expired_total",
        "Samples parked while draining whose KV nobody took before handoff_ttl (freed).");
  }
};

class DecodeWorkerImpl final : public DecodeWorker {
 public:
  ~DecodeWorkerImpl() override { ShutdownImpl(absl::ZeroDuration(), /*park=*/false); }

  absl::Status Init(DecodeWorkerOptions options);

  std::string grpc_address() const override { return grpc_address_; }
  int metrics_port() const override { return metrics_server_ ? metrics_server_->port() : 0; }
  tandem::v1::WorkerStats Stats() const override;
  void Shutdown(absl::Duration grace) override { ShutdownImpl(grace, /*park=*/true); }

  // RPC bodies, called on gRPC threads.
  absl::StatusOr<tandem::v1::KvReservation> Reserve(const tandem::v1::ReserveRequest& request);
  absl::StatusOr<bool> Release(const std::string& reservation_id);
  absl::Status Start(const tandem::v1::StartRequest& request, std::shared_ptr<Stream> stream);
  // The Start call of `request_id` has gone (cancelled or unwritable): abort it if it still
  // runs with `stream`.
  void AbandonStream(const std::string& request_id, const std::shared_ptr<Stream>& stream);
  absl::StatusOr<bool> Cancel(const std::string& request_id, const std::string& reason);
  absl::StatusOr<tandem::v1::HandshakeResponse> Handshake(
      const tandem::v1::HandshakeRequest& request) const;
  absl::StatusOr<tandem::v1::HandoffResponse> Handoff(const tandem::v1::HandoffRequest& request);

 private:
  void ShutdownImpl(absl::Duration grace, bool park);
  // Runs `fn` on the engine loop thread and returns its result, or `if_stopped` once the loop
  // has stopped. Never called on the loop thread itself.
  template <typename T>
  T RunOnEngine(std::function<T()> fn, T if_stopped) {
    auto promise = std::make_shared<std::promise<T>>();
    std::future<T> future = promise->get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (loop_exited_) return if_stopped;
      tasks_.push_back([promise, fn = std::move(fn)] { promise->set_value(fn()); });
    }
    cv_.notify_all();
    return future.get();
  }

  // The bodies of Reserve and Start, on the loop thread.
  absl::StatusOr<tandem::v1::KvReservation> ReserveOnLoop(const tandem::v1::ReserveRequest& request,
                                                          int64_t expires_unix_ms);
  absl::Status StartOnLoop(const tandem::v1::StartRequest& request, std::shared_ptr<Stream> stream);
  void Loop();
  void ExpireReservations();
  void StepEngine();
  void RecordStepMetrics();
  // Whether `n` more samples would push the running batch past the TPOT controller's cap.
  bool OverBatchLimit(int n) const;
  // Ends a running request: aborts it in the engine (freeing its blocks) and closes its stream
  // with an ABORT finish for every unfinished sample, carrying `error` when not OK.
  void EndRunning(const std::string& request_id, const absl::Status& error);
  // The last events of a request that ends unfinished: an ABORT finish for every unfinished
  // sample, usage on the last, and `error` there when not OK.
  static std::vector<tandem::v1::TokenEvent> FinalEvents(const std::string& request_id,
                                                         const Running& running,
                                                         const absl::Status& error);
  // Parks a running request for KV handoff and ends its stream with a KvHandoff. False (nothing
  // changed) when the engine cannot park it now.
  bool ParkRunning(const std::string& request_id);
  // Frees parked samples past their expiry (not those being transferred).
  void ExpireParked();
  // Frees the parked samples of a request that no Handoff is reading; true if it had any.
  bool FreeParked(const std::string& request_id);
  void UpdateParkedCount();
  void FreeReservation(Reservation& reservation);
  // Engine-thread view of the worker's state.
  tandem::v1::WorkerStats ComputeStats() const;
  void PublishStats();
  // The /metrics exposition, its KV and batch series refreshed from the published snapshot.
  std::string RenderMetrics();

  DecodeWorkerOptions options_;
  std::string grpc_address_;

  // Owned by the engine loop thread once it runs (created and destroyed outside it).
  std::unique_ptr<engine::LlmEngine> engine_;
  std::map<std::string, Reservation> reservations_;      // by reservation id
  std::map<std::string, std::string> reserved_request_;  // request id -> reservation id
  std::map<std::string, Running> running_;               // by request id
  int64_t next_reservation_ = 0;
  std::map<std::string, Parked> parked_;  // by request id

  std::unique_ptr<kvtransfer::Agent> agent_;
  std::string region_descriptor_;
  tandem::v1::KvLayout layout_;
  bool memory_registered_ = false;

  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  Metrics metrics_;
  std::unique_ptr<worker::StatusServer> metrics_server_;  // /health and /metrics

  // Refuses Reserve and Start once false. Set by Shutdown, read on the engine thread.
  std::atomic<bool> accepting_{true};
  std::atomic<int> num_running_{0};
  std::atomic<int> num_parked_{0};  // parked samples (loop thread writes, Shutdown reads)

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool stop_ = false;                        // guarded by mu_
  bool loop_exited_ = false;                 // guarded by mu_
  tandem::v1::WorkerStats snapshot_;         // guarded by mu_
  std::thread loop_;

  std::once_flag shutdown_once_;
};

absl::Status DecodeWorkerImpl::Init(DecodeWorkerOptions options) {
  options_ = std::move(options);
  if (options_.worker_id.empty()) options_.worker_id = absl::StrCat("decode-", getpid());
  if (options_.max_reservation_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("max_reservation_ttl must be positive");
  }
  if (options_.handoff_ttl < absl::ZeroDuration() || options_.handoff_ttl > kMaxHandoffTtl) {
    return absl::InvalidArgumentError(
        absl::StrCat("handoff_ttl must be in [0, ", absl::FormatDuration(kMaxHandoffTtl),
                     "], got ", absl::FormatDuration(options_.handoff_ttl)));
  }
  options_.engine.role = engine::EngineRole::kDecode;
  TANDEM_ASSIGN_OR_RETURN(engine_, engine::LlmEngine::Create(options_.engine));
  layout_ = proto::EngineKvLayout(engine_->config(), engine_->kv_layout().block_size,
                                  engine_->kv_layout().dtype);

  kvtransfer::AgentOptions agent_options;
  agent_options.backend = options_.kv_backend;
  agent_options.name = options_.worker_id;
  agent_options.listen_host = options_.kv_listen_host;
  TANDEM_ASSIGN_OR_RETURN(agent_, kvtransfer::Agent::Create(agent_options));
  TANDEM_ASSIGN_OR_RETURN(
      region_descriptor_,
      agent_->RegisterMemory(kKvRegionId, engine_->kv_cache(), engine_->kv_cache_bytes()));
  memory_registered_ = true;
  snapshot_ = ComputeStats();
  metrics_.tpot_target->Set(options_.engine.tpot_slo_seconds);
  metrics_.batch_limit->Set(options_.engine.max_num_seqs);

  // The loop runs before any RPC can arrive; from here on a failed Init is undone by the
  // destructor's Shutdown.
  loop_ = std::thread([this] { Loop(); });

  service_ = std::make_unique<Service>(this);
  TANDEM_ASSIGN_OR_RETURN(proto::StartedServer started,
                          proto::StartGrpcServer(options_.grpc_address, service_.get(),
                                                 options_.tls));
  server_ = std::move(started.server);
  grpc_address_ = std::move(started.address);

  if (!options_.metrics_address.empty()) {
    TANDEM_ASSIGN_OR_RETURN(metrics_server_, worker::StatusServer::Create(
                                                 options_.metrics_address,
                                                 [this] { return !accepting_.load(); },
                                                 [this] { return RenderMetrics(); }));
  }
  return absl::OkStatus();
}

std::string DecodeWorkerImpl::RenderMetrics() {
  const tandem::v1::WorkerStats stats = Stats();
  // From the published snapshot (reservations included), not the engine's own counts.
  metrics_.engine.kv_used.Set(stats.kv_blocks_used());
  metrics_.engine.kv_capacity.Set(stats.kv_blocks_total());
  metrics_.engine.running.Set(stats.running());
  metrics_.engine.waiting.Set(stats.waiting());
  metrics::AdvanceTo(metrics_.engine.preemptions, static_cast<double>(stats.preemptions_total()));
  metrics_.kv_reserved->Set(stats.kv_blocks_reserved());
  metrics_.reservations->Set(stats.reservations());
  return metrics_.registry.Render();
}

// --- the engine loop --------------------------------------------------------------------------

void DecodeWorkerImpl::Loop() {
  while (true) {
    std::deque<std::function<void()>> tasks;
    bool stop = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (tasks_.empty() && !stop_ && !engine_->has_unfinished()) cv_.wait_for(lock, kIdleWake);
      tasks.swap(tasks_);
      stop = stop_;
    }
    for (std::function<void()>& task : tasks) task();
    ExpireReservations();
    ExpireParked();
    if (engine_->has_unfinished()) StepEngine();
    RecordStepMetrics();
    PublishStats();
    if (stop) {
      std::lock_guard<std::mutex> lock(mu_);
      if (tasks_.empty()) {
        loop_exited_ = true;
        break;
      }
    }
  }
  // Nothing outlives the loop: requests still running (none after a normal Shutdown) end with
  // an error, reservations are freed.
  std::vector<std::string> ids;
  for (const auto& [id, running] : running_) ids.push_back(id);
  for (const std::string& id : ids) {
    EndRunning(id, absl::UnavailableError("the decode worker shut down"));
  }
  for (auto& [id, reservation] : reservations_) FreeReservation(reservation);
  reservations_.clear();
  reserved_request_.clear();
  // No Handoff runs any more (the gRPC server is down): parked blocks go too.
  for (auto& [id, parked] : parked_) {
    for (auto& [index, sample] : parked.samples) engine_->FreeReservation(sample.blocks);
  }
  parked_.clear();
  UpdateParkedCount();
  PublishStats();
}

void DecodeWorkerImpl::ExpireParked() {
  if (parked_.empty()) return;
  const int64_t now = NowUnixMs();
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (now > it->second.expires_unix_ms) {
      auto& samples = it->second.samples;
      for (auto s = samples.begin(); s != samples.end();) {
        if (s->second.transferring) {
          ++s;
          continue;
        }
        engine_->FreeReservation(s->second.blocks);
        metrics_.parked_expired->Increment();
        s = samples.erase(s);
      }
    }
    it = it->second.samples.empty() ? parked_.erase(it) : std::next(it);
  }
  UpdateParkedCount();
  PublishStats();
}

bool DecodeWorkerImpl::FreeParked(const std::string& request_id) {
  auto it = parked_.find(request_id);
  if (it == parked_.end()) return false;
  auto& samples = it->second.samples;
  for (auto s = samples.begin(); s != samples.end();) {
    if (s->second.transferring) {
      ++s;  // the Handoff in progress frees it (or leaves it to expire)
      continue;
    }
    engine_->FreeReservation(s->second.blocks);
    s = samples.erase(s);
  }
  if (samples.empty()) parked_.erase(it);
  UpdateParkedCount();
  return true;
}

void DecodeWorkerImpl::UpdateParkedCount() {
  int count = 0;
  for (const auto& [id, parked] : parked_) count += static_cast<int>(parked.samples.size());
  num_parked_.store(count);
}

void DecodeWorkerImpl::ExpireReservations() {
  const int64_t now = NowUnixMs();
  for (auto it = reservations_.begin(); it != reservations_.end();) {
    if (now > it->second.expires_unix_ms + kExpiryGraceMs) {
      FreeReservation(it->second);
      reserved_request_.erase(it->second.request_id);
      it = reservations_.erase(it);
      metrics_.expired->Increment();
    } else {
      ++it;
    }
  }
}

void DecodeWorkerImpl::FreeReservation(Reservation& reservation) {
  for (engine::BlockTable& blocks : reservation.blocks) engine_->FreeReservation(blocks);
  reservation.blocks.clear();
}

void DecodeWorkerImpl::RecordStepMetrics() {
  const engine::EngineStats stats = engine_->stats();
  metrics_.engine.RecordSteps(stats);  // the counts come from the snapshot at each scrape
  metrics_.batch_limit->Set(stats.batch_limit);
  metrics_.step_gap->Set(stats.step_gap_seconds);
}

bool DecodeWorkerImpl::OverBatchLimit(int n) const {
  if (options_.engine.tpot_slo_seconds <= 0) return false;
  const engine::EngineStats stats = engine_->stats();
  int reserved = 0;
  for (const auto& [id, reservation] : reservations_) reserved += reservation.n;
  const int committed = stats.running + stats.waiting + reserved;
  // An idle worker takes any request; a busy one only what fits under the cap, so requests
  // beyond it queue at the router (before their prefill), not here between their first and
  // second tokens.
  return committed > 0 && committed + n > stats.batch_limit;
}

void DecodeWorkerImpl::StepEngine() {
  absl::StatusOr<std::vector<engine::RequestOutput>> outputs = engine_->Step();
  if (!outputs.ok()) {
    // The step failed as a whole: every running request ends with the error, so its stream
    // reports it and its blocks are freed.
    std::vector<std::string> ids;
    for (const auto& [id, running] : running_) ids.push_back(id);
    for (const std::string& id : ids) EndRunning(id, outputs.status());
    return;
  }
  for (engine::RequestOutput& out : *outputs) {
    auto it = running_.find(out.request_id);
    if (it == running_.end()) continue;  // aborted since (first tokens of an ended request)
    Running& running = it->second;
    std::vector<tandem::v1::TokenEvent> events;
    for (engine::ChoiceDelta& delta : out.choices) {
      tandem::v1::TokenEvent& event = events.emplace_back();
      event.set_request_id(out.request_id);
      event.set_index(delta.index);
      for (int32_t t : delta.token_ids) event.add_token_ids(t);
      event.set_text(std::move(delta.text));
      for (float lp : delta.logprobs) event.add_logprobs(lp);
      for (const std::vector<engine::TokenLogprob>& top : delta.top_logprobs) {
        tandem::v1::TopLogprobs* entries = event.add_top_logprobs();
        for (const engine::TokenLogprob& t : top) {
          tandem::v1::TokenLogprob* entry = entries->add_entries();
          entry->set_token_id(t.token);
          entry->set_logprob(t.logprob);
        }
      }
      event.set_finish_reason(proto::ToProto(delta.finish_reason));
      if (delta.finish_reason != engine::FinishReason::kNone && delta.index >= 0 &&
          delta.index < static_cast<int>(running.finished.size())) {
        running.finished[delta.index] = true;
      }
      metrics_.generation_tokens->Increment(static_cast<double>(delta.token_ids.size()));
    }
    running.num_generation_tokens = out.num_generation_tokens;
    if (out.finished && !events.empty()) {
      tandem::v1::Usage* usage = events.back().mutable_usage();
      usage->set_prompt_tokens(running.num_prompt_tokens);
      usage->set_completion_tokens(running.num_generation_tokens);
    }
    std::shared_ptr<Stream> stream = running.stream;
    if (out.finished) {
      running_.erase(it);
      num_running_.store(static_cast<int>(running_.size()));
      // The engine has freed the request's blocks: Stats must say so before the client reads
      // the last event.
      PublishStats();
    }
    stream->Push(std::move(events), out.finished);
  }
}

void DecodeWorkerImpl::EndRunning(const std::string& request_id, const absl::Status& error) {
  auto it = running_.find(request_id);
  if (it == running_.end()) return;
  engine_->Abort(request_id);
  Running running = std::move(it->second);
  running_.erase(it);
  num_running_.store(static_cast<int>(running_.size()));
  std::vector<tandem::v1::TokenEvent> events = FinalEvents(request_id, running, error);
  PublishStats();
  running.stream->Push(std::move(events), /*last=*/true);
}

std::vector<tandem::v1::TokenEvent> DecodeWorkerImpl::FinalEvents(const std::string& request_id,
                                                                  const Running& running,
                                                                  const absl::Status& error) {
  std::vector<tandem::v1::TokenEvent> events;
  for (size_t i = 0; i < running.finished.size(); ++i) {
    if (running.finished[i]) continue;
    tandem::v1::TokenEvent& event = events.emplace_back();
    event.set_request_id(request_id);
    event.set_index(static_cast<int>(i));
    event.set_finish_reason(tandem::v1::FINISH_REASON_ABORT);
  }
  if (events.empty()) {  // every sample had finished; the request's last event is still owed
    tandem::v1::TokenEvent& event = events.emplace_back();
    event.set_request_id(request_id);
  }
  tandem::v1::TokenEvent& last = events.back();
  last.mutable_usage()->set_prompt_tokens(running.num_prompt_tokens);
  last.mutable_usage()->set_completion_tokens(running.num_generation_tokens);
  if (!error.ok()) *last.mutable_error() = proto::ToProto(error);
  return events;
}

bool DecodeWorkerImpl::ParkRunning(const std::string& request_id) {
  auto it = running_.find(request_id);
  if (it == running_.end()) return false;
  absl::StatusOr<std::vector<engine::ParkedSample>> samples = engine_->Park(request_id);
  if (!samples.ok()) return false;
  Running running = std::move(it->second);
  running_.erase(it);
  num_running_.store(static_cast<int>(running_.size()));
  Parked parked;
  parked.expires_unix_ms = NowUnixMs() + absl::ToInt64Milliseconds(options_.handoff_ttl);
  tandem::v1::KvHandoff handoff;
  handoff.set_expires_unix_ms(parked.expires_unix_ms);
  handoff.set_worker_id(options_.worker_id);
  for (engine::ParkedSample& sample : *samples) {
    tandem::v1::KvHandoff::Sample* wire = handoff.add_samples();
    wire->set_index(sample.choice_index);
    wire->mutable_generated_token_ids()->Add(sample.state.generated.begin(),
                                             sample.state.generated.end());
    wire->set_sampler_state(proto::SamplerStateBytes(sample.state.rng_state));
    wire->set_num_kv_tokens(sample.state.num_kv_tokens);
    if (sample.state.num_kv_tokens > 0) {
      parked.samples[sample.choice_index] = {std::move(sample.state.blocks),
                                             sample.state.num_kv_tokens, false};
    }
  }
  if (!parked.samples.empty()) parked_[request_id] = std::move(parked);
  UpdateParkedCount();
  std::vector<tandem::v1::TokenEvent> events = FinalEvents(
      request_id, running,
      absl::UnavailableError("the decode worker is draining; the request's KV is parked for "
                             "handoff"));
  *events.back().mutable_handoff() = std::move(handoff);
  PublishStats();
  running.stream->Push(std::move(events), /*last=*/true);
  return true;
}

tandem::v1::WorkerStats DecodeWorkerImpl::ComputeStats() const {
  const engine::EngineStats engine_stats = engine_->stats();
  tandem::v1::WorkerStats stats;
  stats.set_role(tandem::v1::WORKER_ROLE_DECODE);
  stats.set_worker_id(options_.worker_id);
  stats.set_running(engine_stats.running);
  stats.set_waiting(engine_stats.waiting);
  stats.set_kv_blocks_used(engine_stats.kv_blocks_used);
  stats.set_kv_blocks_total(engine_stats.kv_blocks_total);
  int reserved = 0;
  for (const auto& [id, reservation] : reservations_) reserved += reservation.num_blocks();
  stats.set_kv_blocks_reserved(reserved);
  stats.set_reservations(static_cast<int>(reservations_.size()));
  stats.set_preemptions_total(engine_stats.preemptions);
  return stats;
}

void DecodeWorkerImpl::PublishStats() {
  tandem::v1::WorkerStats stats = ComputeStats();
  std::lock_guard<std::mutex> lock(mu_);
  snapshot_ = std::move(stats);
}

tandem::v1::WorkerStats DecodeWorkerImpl::Stats() const {
  // The snapshot is published after every change the engine loop makes (before any RPC that
  // made it returns, and before a stream's last event is queued).
  std::lock_guard<std::mutex> lock(mu_);
  tandem::v1::WorkerStats stats = snapshot_;
  stats.set_draining(!accepting_.load());
  return stats;
}

// --- RPC bodies -------------------------------------------------------------------------------

absl::StatusOr<tandem::v1::KvReservation> DecodeWorkerImpl::Reserve(
    const tandem::v1::ReserveRequest& request) {
  if (request.request_id().empty()) return absl::InvalidArgumentError("request_id is empty");
  if (request.num_prompt_tokens() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_prompt_tokens must be positive, got ", request.num_prompt_tokens()));
  }
  if (request.n() < 0 || request.n() > kMaxReserveSamples) {
    return absl::InvalidArgumentError(
        absl::StrCat("n must be in [0, ", kMaxReserveSamples, "], got ", request.n()));
  }
  if (request.max_tokens() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_tokens must not be negative, got ", request.max_tokens()));
  }
  const int64_t now = NowUnixMs();
  if (request.deadline_unix_ms() > 0 && request.deadline_unix_ms() <= now) {
    return absl::DeadlineExceededError(absl::StrCat("the reservation deadline passed ",
                                                    now - request.deadline_unix_ms(), " ms ago"));
  }
  int64_t expires = now + absl::ToInt64Milliseconds(options_.max_reservation_ttl);
  if (request.deadline_unix_ms() > 0) expires = std::min(expires, request.deadline_unix_ms());

  return RunOnEngine<absl::StatusOr<tandem::v1::KvReservation>>(
      [&] { return ReserveOnLoop(request, expires); }, Stopped());
}

absl::StatusOr<tandem::v1::KvReservation> DecodeWorkerImpl::ReserveOnLoop(
    const tandem::v1::ReserveRequest& request, int64_t expires) {
  if (!accepting_.load()) {
    return absl::UnavailableError("the decode worker is shutting down");
  }
  const int64_t total = static_cast<int64_t>(request.num_prompt_tokens()) + request.max_tokens();
  if (total > engine_->max_model_len()) {
    return absl::InvalidArgumentError(absl::StrCat("num_prompt_tokens + max_tokens = ", total,
                                                   " exceeds the model's context length ",
                                                   engine_->max_model_len()));
  }
  if (reserved_request_.count(request.request_id()) > 0 ||
      running_.count(request.request_id()) > 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("request ", request.request_id(), " already exists here"));
  }
  if (OverBatchLimit(std::max(1, request.n()))) {
    metrics_.slo_refusals->Increment();
    return absl::ResourceExhaustedError(
        absl::StrCat("the running batch is at its TPOT limit of ", engine_->stats().batch_limit,
                     " sequences"));
  }
  Reservation reservation;
  reservation.request_id = request.request_id();
  reservation.num_prompt_tokens = request.num_prompt_tokens();
  reservation.n = std::max(1, request.n());
  reservation.expires_unix_ms = expires;
  for (int i = 0; i < reservation.n; ++i) {
    absl::StatusOr<engine::BlockTable> blocks = engine_->ReserveBlocks(request.num_prompt_tokens());
    if (!blocks.ok()) {
      FreeReservation(reservation);
      return absl::ResourceExhaustedError(
          absl::StrCat("not enough free KV blocks for ", reservation.n, " x ",
                       request.num_prompt_tokens(), " prompt tokens: ", blocks.status().message()));
    }
    reservation.blocks.push_back(std::move(*blocks));
  }
  const std::string id = absl::StrCat(options_.worker_id, "-", next_reservation_++);
  tandem::v1::KvReservation out;
  out.set_reservation_id(id);
  for (const engine::BlockTable& blocks : reservation.blocks) {
    for (int32_t b : blocks) out.add_block_ids(b);
  }
  out.set_blocks_per_choice(static_cast<int>(reservation.blocks.front().size()));
  tandem::v1::TransferEndpoint* endpoint = out.mutable_endpoint();
  endpoint->set_backend(options_.kv_backend);
  endpoint->set_address(agent_->address());
  endpoint->add_region_descriptors(region_descriptor_);
  endpoint->set_num_blocks(engine_->kv_layout().num_blocks);
  *endpoint->mutable_layout() = layout_;
  out.set_expires_unix_ms(expires);
  reserved_request_[reservation.request_id] = id;
  reservations_[id] = std::move(reservation);
  PublishStats();
  return out;
}

absl::StatusOr<bool> DecodeWorkerImpl::Release(const std::string& reservation_id) {
  return RunOnEngine<absl::StatusOr<bool>>(
      [&]() -> absl::StatusOr<bool> {
        auto it = reservations_.find(reservation_id);
        // An expired reservation is left to the expiry sweep: a late transfer may land in it.
        if (it == reservations_.end() || NowUnixMs() > it->second.expires_unix_ms) return false;
        FreeReservation(it->second);
        reserved_request_.erase(it->second.request_id);
        reservations_.erase(it);
        PublishStats();
        return true;
      },
      Stopped());
}

absl::Status DecodeWorkerImpl::Start(const tandem::v1::StartRequest& request,
                                     std::shared_ptr<Stream> stream) {
  if (request.request_id().empty()) return absl::InvalidArgumentError("request_id is empty");
  return RunOnEngine<absl::Status>([&] { return StartOnLoop(request, std::move(stream)); },
                                   Stopped());
}

absl::Status DecodeWorkerImpl::StartOnLoop(const tandem::v1::StartRequest& request,
                                           std::shared_ptr<Stream> stream) {
  if (!accepting_.load()) {
    return absl::UnavailableError("the decode worker is shutting down");
  }
  auto it = reservations_.find(request.reservation_id());
  if (it == reservations_.end() || NowUnixMs() > it->second.expires_unix_ms) {
    return absl::NotFoundError(absl::StrCat("reservation '", request.reservation_id(),
                                            "' is unknown, released or expired"));
  }
  Reservation& reservation = it->second;
  if (request.choices_size() != reservation.n) {
    return absl::InvalidArgumentError(absl::StrCat("the reservation is for ", reservation.n,
                                                   " samples but ", request.choices_size(),
                                                   " choices were sent"));
  }
  if (running_.count(request.request_id()) > 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("request ", request.request_id(), " is already running"));
  }
  engine::GenerateRequest generate;
  generate.request_id = request.request_id();
  generate.prompt_tokens.assign(request.prompt_token_ids().begin(),
                                request.prompt_token_ids().end());
  generate.params = proto::FromProto(request.sampling());
  if (!request.sampling().has_n()) generate.params.n = reservation.n;
  std::vector<engine::PrefilledChoice> choices(reservation.n);
  std::vector<bool> seen(reservation.n, false);
  for (const tandem::v1::PrefilledChoice& wire : request.choices()) {
    if (wire.index() < 0 || wire.index() >= reservation.n || seen[wire.index()]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "choice index ", wire.index(), " is out of range or repeated (n = ", reservation.n, ")"));
    }
    seen[wire.index()] = true;
    absl::StatusOr<engine::PrefilledChoice> choice = proto::FromProto(wire);
    if (!choice.ok()) return choice.status();
    const int prompt_len = request.prompt_token_ids_size();
    if (choice->generated.empty()) {
      if (prompt_len != reservation.num_prompt_tokens) {
        return absl::InvalidArgumentError(
            absl::StrCat("the prompt has ", prompt_len, " tokens but the reservation is for ",
                         reservation.num_prompt_tokens));
      }
    } else {
      // A continuation after a KV handoff: the reservation holds the KV of the first
      // num_prompt_tokens tokens of prompt + generated.
      const int total = prompt_len + static_cast<int>(choice->generated.size());
      if (reservation.num_prompt_tokens >= total) {
        return absl::InvalidArgumentError(absl::StrCat(
            "choice ", wire.index(), " continues ", prompt_len, " prompt + ",
            choice->generated.size(), " generated tokens, but the reservation holds the KV of ",
            reservation.num_prompt_tokens, " (want fewer than all)"));
      }
      choice->num_kv_tokens = reservation.num_prompt_tokens;
    }
    choice->blocks = reservation.blocks[wire.index()];
    choices[wire.index()] = std::move(*choice);
  }
  // On refusal the reservation stays as it was (Release or expiry frees it).
  TANDEM_RETURN_IF_ERROR(engine_->AddPrefilled(std::move(generate), std::move(choices)));
  // The engine owns the blocks now.
  Running running;
  running.stream = std::move(stream);
  running.finished.assign(reservation.n, false);
  running.num_prompt_tokens = request.prompt_token_ids_size();
  reserved_request_.erase(reservation.request_id);
  reservations_.erase(it);
  running_[request.request_id()] = std::move(running);
  num_running_.store(static_cast<int>(running_.size()));
  metrics_.requests->Increment();
  PublishStats();
  return absl::OkStatus();
}

void DecodeWorkerImpl::AbandonStream(const std::string& request_id,
                                     const std::shared_ptr<Stream>& stream) {
  // Fails only once the loop has stopped, which has ended every request already.
  RunOnEngine<bool>(
      [&] {
        auto it = running_.find(request_id);
        if (it == running_.end() || it->second.stream != stream) return false;
        EndRunning(request_id, absl::CancelledError("the Start call was cancelled"));
        return true;
      },
      false);
}

absl::StatusOr<bool> DecodeWorkerImpl::Cancel(const std::string& request_id,
                                              const std::string& reason) {
  return RunOnEngine<absl::StatusOr<bool>>(
      [&]() -> absl::StatusOr<bool> {
        bool found = false;
        if (running_.count(request_id) > 0) {
          EndRunning(request_id, absl::OkStatus());
          found = true;
        }
        if (FreeParked(request_id)) found = true;
        auto it = reserved_request_.find(request_id);
        if (it != reserved_request_.end()) {
          auto r = reservations_.find(it->second);
          if (r != reservations_.end() && NowUnixMs() <= r->second.expires_unix_ms) {
            FreeReservation(r->second);
            reservations_.erase(r);
            reserved_request_.erase(it);
            found = true;
          }
        }
        PublishStats();
        return found;
      },
      Stopped());
}

absl::StatusOr<tandem::v1::HandshakeResponse> DecodeWorkerImpl::Handshake(
    const tandem::v1::HandshakeRequest& request) const {
  absl::Status compatible = proto::CheckLayoutCompatible(request.layout(), layout_);
  if (!compatible.ok()) {
    return absl::Status(compatible.code(),
                        absl::StrCat(std::string(compatible.message()), " (worker ",
                                     request.worker_id(), " -> ", options_.worker_id, ")"));
  }
  tandem::v1::HandshakeResponse response;
  response.set_worker_id(options_.worker_id);
  *response.mutable_layout() = layout_;
  return response;
}

absl::StatusOr<tandem::v1::HandoffResponse> DecodeWorkerImpl::Handoff(
    const tandem::v1::HandoffRequest& request) {
  const std::string& id = request.request_id();
  const int index = request.index();
  if (id.empty()) return absl::InvalidArgumentError("request_id is empty");
  const tandem::v1::KvReservation& reservation = request.reservation();
  const tandem::v1::TransferEndpoint& endpoint = reservation.endpoint();
  TANDEM_RETURN_IF_ERROR(proto::CheckTransferEndpoint(
      layout_, options_.kv_backend, endpoint, "reservation.endpoint", "this decode worker"));
  if (endpoint.region_descriptors_size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("reservation.endpoint has ", endpoint.region_descriptors_size(),
                     " region descriptors; a handoff writes into a decode worker's one region"));
  }
  struct Plan {
    std::vector<kvtransfer::Range> ranges;
    int num_kv_tokens = 0;
    absl::Time deadline;
  };
  // Claims the sample (so that nothing frees its blocks while they are read) and plans the copy.
  absl::StatusOr<Plan> plan = RunOnEngine<absl::StatusOr<Plan>>(
      [&]() -> absl::StatusOr<Plan> {
        auto it = parked_.find(id);
        if (it == parked_.end() || NowUnixMs() > it->second.expires_unix_ms) {
          return absl::NotFoundError(absl::StrCat("request ", id,
                                                  " has no parked KV here (unknown, handed off, "
                                                  "cancelled or expired)"));
        }
        auto sample = it->second.samples.find(index);
        if (sample == it->second.samples.end()) {
          return absl::NotFoundError(
              absl::StrCat("sample ", index, " of request ", id, " is not parked here"));
        }
        ParkedSample& parked = sample->second;
        if (parked.transferring) {
          return absl::AbortedError(absl::StrCat("sample ", index, " of request ", id,
                                                 " is being handed off already"));
        }
        const int block_size = engine_->kv_layout().block_size;
        const int need = (parked.num_kv_tokens + block_size - 1) / block_size;
        const int per_choice = reservation.blocks_per_choice();
        if (per_choice < need) {
          return absl::InvalidArgumentError(absl::StrCat(
              "the reservation has ", per_choice, " blocks per sample but the KV of ",
              parked.num_kv_tokens, " tokens takes ", need, " blocks of ", block_size));
        }
        const int64_t first = static_cast<int64_t>(request.target_index()) * per_choice;
        if (request.target_index() < 0 || first + per_choice > reservation.block_ids_size()) {
          return absl::InvalidArgumentError(
              absl::StrCat("target_index ", request.target_index(), " is outside the ",
                           reservation.block_ids_size(), " block ids of the reservation (",
                           per_choice, " per sample)"));
        }
        // The endpoint's layout was checked equal to this worker's; only its size differs.
        engine::KvCacheLayout dst = engine_->cache_layout();
        dst.num_blocks = endpoint.num_blocks();
        const engine::BlockTable src_blocks(parked.blocks.begin(), parked.blocks.begin() + need);
        const engine::BlockTable dst_blocks(reservation.block_ids().begin() + first,
                                            reservation.block_ids().begin() + first + need);
        TANDEM_ASSIGN_OR_RETURN(
            std::vector<engine::KvCopyRange> ranges,
            engine::KvBlockCopyRanges(engine_->cache_layout(), dst, src_blocks, dst_blocks));
        Plan out;
        for (const engine::KvCopyRange& r : ranges) {
          out.ranges.push_back({r.src_offset, r.dst_offset, r.bytes});
        }
        out.num_kv_tokens = parked.num_kv_tokens;
        out.deadline = absl::Now() + kHandoffTransferMax;
        if (reservation.expires_unix_ms() > 0) {
          out.deadline =
              std::min(out.deadline, absl::FromUnixMillis(reservation.expires_unix_ms()));
        }
        parked.transferring = true;
        return out;
      },
      Stopped());
  if (!plan.ok()) return plan.status();

  uint64_t bytes = 0;
  for (const kvtransfer::Range& r : plan->ranges) bytes += r.bytes;
  const absl::Time begin = absl::Now();
  absl::Status moved = [&]() -> absl::Status {
    TANDEM_ASSIGN_OR_RETURN(kvtransfer::PeerId peer,
                            agent_->Connect(endpoint.address(), plan->deadline));
    auto handle = agent_->Submit(peer, kKvRegionId, endpoint.region_descriptors(0),
                                 std::move(plan->ranges), plan->deadline);
    absl::Status status = handle.ok() ? (*handle)->Wait() : handle.status();
    // Closing the connection also cancels whatever a failed transfer still had in flight, so
    // nothing reads the parked blocks once they are given back below.
    agent_->Disconnect(peer).IgnoreError();
    return status;
  }();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - begin);
  RunOnEngine<bool>(
      [&] {
        auto it = parked_.find(id);
        if (it == parked_.end()) return false;
        auto sample = it->second.samples.find(index);
        if (sample == it->second.samples.end()) return false;
        if (moved.ok()) {
          engine_->FreeReservation(sample->second.blocks);
          it->second.samples.erase(sample);
          metrics_.handoffs->Increment();
          metrics_.handoff_bytes->Increment(static_cast<double>(bytes));
          metrics_.handoff_seconds->Increment(seconds);
        } else {
          sample->second.transferring = false;  // stays parked until it expires
        }
        if (it->second.samples.empty()) parked_.erase(it);
        UpdateParkedCount();
        PublishStats();
        return true;
      },
      false);
  if (!moved.ok()) {
    const absl::StatusCode code = moved.code() == absl::StatusCode::kInvalidArgument
                                      ? absl::StatusCode::kInvalidArgument
                                      : absl::StatusCode::kUnavailable;
    return absl::Status(code, absl::StrCat("handing off sample ", index, " of request ", id,
                                           ": ", std::string(moved.message())));
  }
  tandem::v1::HandoffResponse response;
  response.set_num_kv_tokens(plan->num_kv_tokens);
  response.set_kv_transfer_bytes(static_cast<int64_t>(bytes));
  response.set_kv_transfer_seconds(seconds);
  return response;
}

void DecodeWorkerImpl::ShutdownImpl(absl::Duration grace, bool park) {
  std::call_once(shutdown_once_, [&] {
    accepting_.store(false);
    const absl::Time deadline = absl::Now() + grace;
    const bool handoff = park && options_.handoff_ttl > absl::ZeroDuration();
    if (loop_.joinable()) {
      while (num_running_.load() > 0 && absl::Now() < deadline) {
        absl::SleepFor(absl::Milliseconds(10));
      }
      // Whatever still runs is parked for KV handoff, or ends with an error event; unstarted
      // reservations are freed.
      RunOnEngine<bool>(
          [this, handoff] {
            std::vector<std::string> ids;
            for (const auto& [id, running] : running_) ids.push_back(id);
            for (const std::string& id : ids) {
              if (handoff && ParkRunning(id)) continue;
              EndRunning(id, absl::UnavailableError("the decode worker is shutting down"));
            }
            for (auto& [id, reservation] : reservations_) FreeReservation(reservation);
            reservations_.clear();
            reserved_request_.clear();
            PublishStats();
            return true;
          },
          false);
      // The router moves parked samples with Handoff (the server still answers); each is
      // freed when handed off, cancelled or expired.
      const absl::Time parked_deadline =
          absl::Now() + options_.handoff_ttl + kHandoffTransferMax + absl::Seconds(1);
      while (num_parked_.load() > 0 && absl::Now() < parked_deadline) {
        absl::SleepFor(absl::Milliseconds(10));
      }
    }
    // Start handlers now hold their stream's last event; a client that does not read it in a
    // second has its call cancelled.
    if (server_ != nullptr)
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    if (loop_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
      }
      cv_.notify_all();
      loop_.join();
    }
    if (metrics_server_ != nullptr) metrics_server_->Stop();
    if (memory_registered_) {
      (void)agent_->DeregisterMemory(kKvRegionId);
      memory_registered_ = false;
    }
    agent_.reset();
  });
}

// --- gRPC -------------------------------------------------------------------------------------

grpc::Status Service::Reserve(grpc::ServerContext*, const tandem::v1::ReserveRequest* request,
                              tandem::v1::ReserveResponse* response) {
  absl::StatusOr<tandem::v1::KvReservation> reservation = worker_->Reserve(*request);
  if (!reservation.ok()) return proto::ToGrpcStatus(reservation.status());
  *response->mutable_reservation() = std::move(*reservation);
  return grpc::Status::OK;
}

grpc::Status Service::Release(grpc::ServerContext*, const tandem::v1::ReleaseRequest* request,
                              tandem::v1::ReleaseResponse* response) {
  absl::StatusOr<bool> released = worker_->Release(request->reservation_id());
  if (!released.ok()) return proto::ToGrpcStatus(released.status());
  response->set_released(*released);
  return grpc::Status::OK;
}

grpc::Status Service::Start(grpc::ServerContext* context, const tandem::v1::StartRequest* request,
                            grpc::ServerWriter<tandem::v1::TokenEvent>* writer) {
  auto stream = std::make_shared<Stream>();
  absl::Status started = worker_->Start(*request, stream);
  if (!started.ok()) return proto::ToGrpcStatus(started);
  while (true) {
    std::deque<tandem::v1::TokenEvent> events;
    bool done = false;
    {
      std::unique_lock<std::mutex> lock(stream->mu);
      stream->cv.wait_for(lock, kStreamPoll,
                          [&] { return !stream->events.empty() || stream->done; });
      events.swap(stream->events);
      done = stream->done;
    }
    for (const tandem::v1::TokenEvent& event : events) {
      if (!writer->Write(event)) {
        worker_->AbandonStream(request->request_id(), stream);
        return grpc::Status(grpc::StatusCode::CANCELLED, "the client stopped reading");
      }
    }
    if (done) return grpc::Status::OK;
    if (context->IsCancelled()) {
      worker_->AbandonStream(request->request_id(), stream);
      return grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled");
    }
  }
}

grpc::Status Service::Cancel(grpc::ServerContext*, const tandem::v1::CancelRequest* request,
                             tandem::v1::CancelResponse* response) {
  absl::StatusOr<bool> found = worker_->Cancel(request->request_id(), request->reason());
  if (!found.ok()) return proto::ToGrpcStatus(found.status());
  response->set_found(*found);
  return grpc::Status::OK;
}

grpc::Status Service::Stats(grpc::ServerContext*, const tandem::v1::StatsRequest*,
                            tandem::v1::WorkerStats* stats) {
  *stats = worker_->Stats();
  return grpc::Status::OK;
}

grpc::Status Service::Handshake(grpc::ServerContext*, const tandem::v1::HandshakeRequest* request,
                                tandem::v1::HandshakeResponse* response) {
  absl::StatusOr<tandem::v1::HandshakeResponse> result = worker_->Handshake(*request);
  if (!result.ok()) return proto::ToGrpcStatus(result.status());
  *response = std::move(*result);
  return grpc::Status::OK;
}

grpc::Status Service::Handoff(grpc::ServerContext*, const tandem::v1::HandoffRequest* request,
                              tandem::v1::HandoffResponse* response) {
  absl::StatusOr<tandem::v1::HandoffResponse> result = worker_->Handoff(*request);
  if (!result.ok()) return proto::ToGrpcStatus(result.status());
  *response = std::move(*result);
  return grpc::Status::OK;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DecodeWorker>> DecodeWorker::Create(DecodeWorkerOptions options) {
  auto worker = std::make_unique<DecodeWorkerImpl>();
  TANDEM_RETURN_IF_ERROR(worker->Init(std::move(options)));
  return std::unique_ptr<DecodeWorker>(std::move(worker));
}

}  // namespace tandem::decode_worker
