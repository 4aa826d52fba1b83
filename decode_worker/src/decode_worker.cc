#include "tandem/decode_worker/decode_worker.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/engine_metrics.h"
#include "tandem/kvtransfer/agent.h"
#include "tandem/metrics/registry.h"
#include "tandem/proto/convert.h"
#include "tandem/v1/decode.grpc.pb.h"
#include "tandem/worker/grpc_call.h"
#include "token_stream.h"

namespace tandem::decode_worker {
namespace {

using worker::UnaryCall;

// An expired reservation keeps its blocks this much longer, so that prefill transfers still in
// flight (prefill workers use its expiry as their transfer deadline) land in blocks nobody else
// owns yet.
constexpr absl::Duration kExpiryGrace = absl::Seconds(2);
// Upper bound of ReserveRequest.n: what the engine accepts.
constexpr int kMaxReserveSamples = engine::kMaxSamplesPerRequest;
// Longest DecodeWorkerOptions::handoff_ttl.
constexpr absl::Duration kMaxHandoffTtl = absl::Seconds(30);
// A Handoff's transfer (connect included) takes at most this, and never past the target
// reservation's expiry.
constexpr absl::Duration kHandoffTransferMax = absl::Seconds(10);

absl::Status Stopped() { return absl::UnavailableError("the decode worker has shut down"); }
absl::Status ShuttingDown() { return absl::UnavailableError("the decode worker is shutting down"); }

// Blocks set aside for a request whose prompt KV is being written by a prefill worker.
struct Reservation {
  std::string request_id;
  int num_prompt_tokens = 0;
  int n = 1;
  std::vector<engine::BlockTable> blocks;  // one table per sample
  absl::Time expires;

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
  absl::Time expires;
  std::map<int, ParkedSample> samples;  // by sample index; emptied as they are handed off
};

// A started request, as the engine loop tracks it.
struct Running {
  std::shared_ptr<TokenStream> stream;
  std::vector<bool> finished;  // per sample
  int num_prompt_tokens = 0;
  int num_generation_tokens = 0;
};

// The deadline keys of the engine loop.
std::string ReservationKey(const std::string& id) { return absl::StrCat("reservation/", id); }
std::string ParkedKey(const std::string& request_id) { return absl::StrCat("parked/", request_id); }

class DecodeWorkerImpl;

// The gRPC face on the callback API (no call holds a thread while the engine works for it),
// except Handoff: a drain-time transfer that waits for the KV to land on a gRPC thread.
using AsyncService = tandem::v1::DecodeWorker::WithCallbackMethod_Reserve<
    tandem::v1::DecodeWorker::WithCallbackMethod_Release<
        tandem::v1::DecodeWorker::WithCallbackMethod_Start<
            tandem::v1::DecodeWorker::WithCallbackMethod_Cancel<
                tandem::v1::DecodeWorker::WithCallbackMethod_Stats<
                    tandem::v1::DecodeWorker::WithCallbackMethod_Handshake<
                        tandem::v1::DecodeWorker::Service>>>>>>;

class Service final : public AsyncService {
 public:
  explicit Service(DecodeWorkerImpl* worker) : worker_(worker) {}

  grpc::ServerUnaryReactor* Reserve(grpc::CallbackServerContext*,
                                    const tandem::v1::ReserveRequest* request,
                                    tandem::v1::ReserveResponse* response) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext*,
                                    const tandem::v1::ReleaseRequest* request,
                                    tandem::v1::ReleaseResponse* response) override;
  grpc::ServerWriteReactor<tandem::v1::TokenEvent>* Start(
      grpc::CallbackServerContext*, const tandem::v1::StartRequest* request) override;
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext*,
                                   const tandem::v1::CancelRequest* request,
                                   tandem::v1::CancelResponse* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext*, const tandem::v1::StatsRequest*,
                                  tandem::v1::WorkerStats* response) override;
  grpc::ServerUnaryReactor* Handshake(grpc::CallbackServerContext*,
                                      const tandem::v1::HandshakeRequest* request,
                                      tandem::v1::HandshakeResponse* response) override;
  grpc::Status Handoff(grpc::ServerContext*, const tandem::v1::HandoffRequest* request,
                       tandem::v1::HandoffResponse* response) override;

 private:
  DecodeWorkerImpl* worker_;
};

struct Metrics {
  metrics::Registry registry;
  engine::EngineMetrics engine{registry};  // KV, batch, preemptions, step times
  prometheus::Gauge& kv_reserved = registry.Gauge(
      "tandem_kv_cache_blocks_reserved", "KV cache blocks held by reservations not yet started.");
  prometheus::Gauge& reservations =
      registry.Gauge("tandem_decode_reservations", "Live KV reservations.");
  prometheus::Counter& requests =
      registry.Counter("tandem_decode_requests_total", "Requests started (Start).");
  prometheus::Counter& expired =
      registry.Counter("tandem_decode_reservations_expired_total",
                       "Reservations released because nobody started them in time.");
  prometheus::Counter& generation_tokens =
      registry.Counter("tandem_generation_tokens_total", "Tokens generated, all samples.");
  prometheus::Gauge& batch_limit = registry.Gauge(
      "tandem_decode_batch_limit",
      "Sequences a decode step may run: max_num_seqs, or the TPOT controller's lower cap.");
  prometheus::Gauge& tpot_target = registry.Gauge(
      "tandem_decode_tpot_target_seconds", "The TPOT target the batch is sized for (0: none).");
  prometheus::Gauge& step_gap = registry.Gauge(
      "tandem_step_gap_seconds",
      "Recent mean time between engine steps while work was pending (the worker's loop).");
  prometheus::Counter& slo_refusals = registry.Counter(
      "tandem_decode_reserve_refused_slo_total",
      "Reserve calls refused because the running batch was at the TPOT controller's cap.");
  prometheus::Counter& handoffs = registry.Counter(
      "tandem_decode_kv_handoffs_total",
      "Samples parked while draining whose KV a Handoff moved to another decode worker.");
  prometheus::Counter& handoff_bytes =
      registry.Counter("tandem_decode_kv_handoff_bytes_total", "KV bytes moved by Handoff calls.");
  prometheus::Counter& handoff_seconds = registry.Counter(
      "tandem_decode_kv_handoff_seconds_total", "Time spent moving KV in Handoff calls.");
  prometheus::Counter& parked_expired = registry.Counter(
      "tandem_decode_parked_expired_total",
      "Samples parked while draining whose KV nobody took before handoff_ttl (freed).");
};

class DecodeWorkerImpl final : public DecodeWorker {
 public:
  ~DecodeWorkerImpl() override { ShutdownImpl(absl::ZeroDuration(), /*park=*/false); }

  absl::Status Init(DecodeWorkerOptions options);

  std::string grpc_address() const override { return core_->grpc_address(); }
  int metrics_port() const override { return core_->metrics_port(); }
  tandem::v1::WorkerStats Stats() const override;
  void Shutdown(absl::Duration grace) override { ShutdownImpl(grace, /*park=*/true); }

  // RPC bodies, called on gRPC threads; those given a call answer it now or from the loop.
  void Reserve(const tandem::v1::ReserveRequest& request,
               UnaryCall<tandem::v1::ReserveResponse>* call);
  void Release(const std::string& reservation_id, UnaryCall<tandem::v1::ReleaseResponse>* call);
  grpc::ServerWriteReactor<tandem::v1::TokenEvent>* Start(const tandem::v1::StartRequest& request);
  void Cancel(const std::string& request_id, UnaryCall<tandem::v1::CancelResponse>* call);
  absl::StatusOr<tandem::v1::HandshakeResponse> Handshake(
      const tandem::v1::HandshakeRequest& request) const {
    return core_->kv().Handshake(request, core_->options().worker_id, /*this_side_sends=*/false);
  }
  absl::StatusOr<tandem::v1::HandoffResponse> Handoff(const tandem::v1::HandoffRequest& request);

 private:
  struct HandoffPlan {
    std::vector<kvtransfer::Range> ranges;
    int num_kv_tokens = 0;
    absl::Time deadline;
  };

  void ShutdownImpl(absl::Duration grace, bool park);
  // Loop thread: the bodies of the RPCs.
  absl::StatusOr<tandem::v1::KvReservation> ReserveOnLoop(const tandem::v1::ReserveRequest& request,
                                                          absl::Time expires);
  absl::StatusOr<bool> ReleaseOnLoop(const std::string& reservation_id);
  absl::Status StartOnLoop(const tandem::v1::StartRequest& request,
                           std::shared_ptr<TokenStream> stream);
  absl::StatusOr<bool> CancelOnLoop(const std::string& request_id);
  // Claims a parked sample (nothing frees its blocks while they are read) and plans the copy.
  absl::StatusOr<HandoffPlan> PlanHandoff(const tandem::v1::HandoffRequest& request);
  // After the copy: frees the sample's blocks when it landed, or leaves it parked to expire.
  void EndHandoff(const std::string& id, int index, bool moved, uint64_t bytes, double seconds);
  // The Start call of `request_id` has gone (cancelled or unwritable): ends the request if it
  // still runs with `stream`.
  void AbandonStream(const std::string& request_id, const TokenStream* stream);
  // One iteration of the loop: a step when there is work, then the metrics and stats.
  absl::Duration Iterate();
  // After the last iteration: ends what is left and frees every block.
  void FinishLoop();
  void StepEngine();
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
  // Frees the parked samples of a request that no Handoff is reading (`expired`: counted as
  // such); true if it had any.
  bool FreeParked(const std::string& request_id, bool expired);
  void UpdateParkedCount();
  // Frees a reservation's blocks and forgets it.
  void DropReservation(std::map<std::string, Reservation>::iterator it);
  // Engine-thread view of the worker's state.
  tandem::v1::WorkerStats ComputeStats() const;
  void PublishStats();
  // The /metrics exposition, its KV and batch series refreshed from the published snapshot.
  std::string RenderMetrics();

  DecodeWorkerOptions options_;
  std::unique_ptr<worker::WorkerCore> core_;  // engine, KV endpoint, loop, servers
  engine::LlmEngine* engine_ = nullptr;       // core_'s
  Metrics metrics_;
  Service service_{this};

  // Loop thread only.
  std::map<std::string, Reservation> reservations_;      // by reservation id
  std::map<std::string, std::string> reserved_request_;  // request id -> reservation id
  std::map<std::string, Running> running_;               // by request id
  int64_t next_reservation_ = 0;
  std::map<std::string, Parked> parked_;  // by request id

  std::atomic<int> num_running_{0};
  std::atomic<int> num_parked_{0};  // parked samples (loop thread writes, Shutdown reads)

  mutable std::mutex mu_;
  tandem::v1::WorkerStats snapshot_;  // guarded by mu_
};

absl::Status DecodeWorkerImpl::Init(DecodeWorkerOptions options) {
  if (options.max_reservation_ttl <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("max_reservation_ttl must be positive");
  }
  if (options.handoff_ttl < absl::ZeroDuration() || options.handoff_ttl > kMaxHandoffTtl) {
    return absl::InvalidArgumentError(
        absl::StrCat("handoff_ttl must be in [0, ", absl::FormatDuration(kMaxHandoffTtl),
                     "], got ", absl::FormatDuration(options.handoff_ttl)));
  }
  options_ = options;
  TANDEM_ASSIGN_OR_RETURN(core_, worker::WorkerCore::Create(std::move(options),
                                                            engine::EngineRole::kDecode));
  options_.worker_id = core_->options().worker_id;
  engine_ = &core_->engine();
  snapshot_ = ComputeStats();
  metrics_.tpot_target.Set(options_.engine.tpot_slo_seconds);
  metrics_.batch_limit.Set(options_.engine.max_num_seqs);

  worker::EngineLoop::Options loop;
  loop.iterate = [this] { return Iterate(); };
  loop.finish = [this] { FinishLoop(); };
  return core_->Serve(std::move(loop), &service_, [this] { return RenderMetrics(); });
}

std::string DecodeWorkerImpl::RenderMetrics() {
  const tandem::v1::WorkerStats stats = Stats();
  // From the published snapshot (reservations included), not the engine's own counts.
  metrics_.engine.kv_used.Set(stats.kv_blocks_used());
  metrics_.engine.kv_capacity.Set(stats.kv_blocks_total());
  metrics_.engine.running.Set(stats.running());
  metrics_.engine.waiting.Set(stats.waiting());
  metrics::AdvanceTo(metrics_.engine.preemptions, static_cast<double>(stats.preemptions_total()));
  metrics_.kv_reserved.Set(stats.kv_blocks_reserved());
  metrics_.reservations.Set(stats.reservations());
  return metrics_.registry.Render();
}

// --- the engine loop --------------------------------------------------------------------------

absl::Duration DecodeWorkerImpl::Iterate() {
  if (engine_->has_unfinished()) StepEngine();
  const engine::EngineStats stats = engine_->stats();
  metrics_.engine.RecordSteps(stats);  // the counts come from the snapshot at each scrape
  metrics_.batch_limit.Set(stats.batch_limit);
  metrics_.step_gap.Set(stats.step_gap_seconds);
  PublishStats();
  return engine_->has_unfinished() ? absl::ZeroDuration() : absl::InfiniteDuration();
}

void DecodeWorkerImpl::FinishLoop() {
  // Nothing outlives the loop: requests still running (none after a normal Shutdown) end with
  // an error, reservations are freed.
  std::vector<std::string> ids;
  for (const auto& [id, running] : running_) ids.push_back(id);
  for (const std::string& id : ids) {
    EndRunning(id, absl::UnavailableError("the decode worker shut down"));
  }
  while (!reservations_.empty()) DropReservation(reservations_.begin());
  // No Handoff runs any more (its calls find the loop stopped): parked blocks go too.
  for (auto& [id, parked] : parked_) {
    for (auto& [index, sample] : parked.samples) engine_->FreeReservation(sample.blocks);
  }
  parked_.clear();
  UpdateParkedCount();
  PublishStats();
}

bool DecodeWorkerImpl::FreeParked(const std::string& request_id, bool expired) {
  auto it = parked_.find(request_id);
  if (it == parked_.end()) return false;
  auto& samples = it->second.samples;
  for (auto s = samples.begin(); s != samples.end();) {
    if (s->second.transferring) {
      ++s;  // the Handoff in progress frees it (or leaves it to expire)
      continue;
    }
    engine_->FreeReservation(s->second.blocks);
    if (expired) metrics_.parked_expired.Increment();
    s = samples.erase(s);
  }
  if (samples.empty()) {
    parked_.erase(it);
    core_->loop().ClearDeadline(ParkedKey(request_id));
  }
  UpdateParkedCount();
  PublishStats();
  return true;
}

void DecodeWorkerImpl::UpdateParkedCount() {
  int count = 0;
  for (const auto& [id, parked] : parked_) count += static_cast<int>(parked.samples.size());
  num_parked_.store(count);
}

void DecodeWorkerImpl::DropReservation(std::map<std::string, Reservation>::iterator it) {
  for (engine::BlockTable& blocks : it->second.blocks) engine_->FreeReservation(blocks);
  core_->loop().ClearDeadline(ReservationKey(it->first));
  reserved_request_.erase(it->second.request_id);
  reservations_.erase(it);
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
      metrics_.generation_tokens.Increment(static_cast<double>(delta.token_ids.size()));
    }
    running.num_generation_tokens = out.num_generation_tokens;
    if (out.finished && !events.empty()) {
      tandem::v1::Usage* usage = events.back().mutable_usage();
      usage->set_prompt_tokens(running.num_prompt_tokens);
      usage->set_completion_tokens(running.num_generation_tokens);
    }
    std::shared_ptr<TokenStream> stream = running.stream;
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
  parked.expires = absl::Now() + options_.handoff_ttl;
  tandem::v1::KvHandoff handoff;
  handoff.set_expires_unix_ms(absl::ToUnixMillis(parked.expires));
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
  if (!parked.samples.empty()) {
    core_->loop().SetDeadline(ParkedKey(request_id), parked.expires,
                              [this, request_id] { FreeParked(request_id, /*expired=*/true); });
    parked_[request_id] = std::move(parked);
  }
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
  // made it is answered, and before a stream's last event is queued).
  std::lock_guard<std::mutex> lock(mu_);
  tandem::v1::WorkerStats stats = snapshot_;
  stats.set_draining(!core_->accepting());
  return stats;
}

// --- RPC bodies -------------------------------------------------------------------------------

void DecodeWorkerImpl::Reserve(const tandem::v1::ReserveRequest& request,
                               UnaryCall<tandem::v1::ReserveResponse>* call) {
  const absl::Status valid = [&]() -> absl::Status {
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
    return absl::OkStatus();
  }();
  if (!valid.ok()) return call->Answer(valid);
  const absl::Time now = absl::Now();
  const absl::Time deadline = worker::FromUnixMillisOrInfinite(request.deadline_unix_ms());
  if (deadline <= now) {
    return call->Answer(absl::DeadlineExceededError(absl::StrCat(
        "the reservation deadline passed ", absl::FormatDuration(now - deadline), " ago")));
  }
  const absl::Time expires = std::min(now + options_.max_reservation_ttl, deadline);
  worker::AnswerOnLoop<tandem::v1::ReserveResponse>(
      core_->loop(), call,
      [this, request, expires]() -> absl::StatusOr<tandem::v1::ReserveResponse> {
        TANDEM_ASSIGN_OR_RETURN(tandem::v1::KvReservation reservation,
                                ReserveOnLoop(request, expires));
        tandem::v1::ReserveResponse response;
        *response.mutable_reservation() = std::move(reservation);
        return response;
      },
      Stopped());
}

absl::StatusOr<tandem::v1::KvReservation> DecodeWorkerImpl::ReserveOnLoop(
    const tandem::v1::ReserveRequest& request, absl::Time expires) {
  if (!core_->accepting()) return ShuttingDown();
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
    metrics_.slo_refusals.Increment();
    return absl::ResourceExhaustedError(
        absl::StrCat("the running batch is at its TPOT limit of ", engine_->stats().batch_limit,
                     " sequences"));
  }
  Reservation reservation;
  reservation.request_id = request.request_id();
  reservation.num_prompt_tokens = request.num_prompt_tokens();
  reservation.n = std::max(1, request.n());
  reservation.expires = expires;
  for (int i = 0; i < reservation.n; ++i) {
    absl::StatusOr<engine::BlockTable> blocks = engine_->ReserveBlocks(request.num_prompt_tokens());
    if (!blocks.ok()) {
      for (engine::BlockTable& b : reservation.blocks) engine_->FreeReservation(b);
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
  *out.mutable_endpoint() = core_->kv().Describe();
  out.set_expires_unix_ms(absl::ToUnixMillis(expires));
  reserved_request_[reservation.request_id] = id;
  reservations_[id] = std::move(reservation);
  // Unstarted, it keeps its blocks a grace period past its expiry (late transfers may land).
  core_->loop().SetDeadline(ReservationKey(id), expires + kExpiryGrace, [this, id] {
    auto it = reservations_.find(id);
    if (it == reservations_.end()) return;
    DropReservation(it);
    metrics_.expired.Increment();
    PublishStats();
  });
  PublishStats();
  return out;
}

void DecodeWorkerImpl::Release(const std::string& reservation_id,
                               UnaryCall<tandem::v1::ReleaseResponse>* call) {
  worker::AnswerOnLoop<tandem::v1::ReleaseResponse>(
      core_->loop(), call,
      [this, reservation_id]() -> absl::StatusOr<tandem::v1::ReleaseResponse> {
        TANDEM_ASSIGN_OR_RETURN(bool released, ReleaseOnLoop(reservation_id));
        tandem::v1::ReleaseResponse response;
        response.set_released(released);
        return response;
      },
      Stopped());
}

absl::StatusOr<bool> DecodeWorkerImpl::ReleaseOnLoop(const std::string& reservation_id) {
  auto it = reservations_.find(reservation_id);
  // An expired reservation is left to the expiry sweep: a late transfer may land in it.
  if (it == reservations_.end() || absl::Now() > it->second.expires) return false;
  DropReservation(it);
  PublishStats();
  return true;
}

grpc::ServerWriteReactor<tandem::v1::TokenEvent>* DecodeWorkerImpl::Start(
    const tandem::v1::StartRequest& request) {
  const std::string id = request.request_id();
  // The client going away ends the request; the stream is compared so that a later Start of
  // the same id is not ended by an earlier call.
  std::shared_ptr<TokenStream> stream = TokenStream::Create([this, id](const TokenStream* gone) {
    core_->loop().Post([this, id, gone] { AbandonStream(id, gone); });
  });
  if (id.empty()) {
    stream->Fail(absl::InvalidArgumentError("request_id is empty"));
  } else if (!core_->loop().Post([this, request, stream] {
               absl::Status started = StartOnLoop(request, stream);
               if (!started.ok()) stream->Fail(started);
             })) {
    stream->Fail(Stopped());
  }
  return stream->reactor();
}
absl::Status DecodeWorkerImpl::StartOnLoop(const tandem::v1::StartRequest& request,
                                           std::shared_ptr<TokenStream> stream) {
  if (!core_->accepting()) return ShuttingDown();
  auto it = reservations_.find(request.reservation_id());
  if (it == reservations_.end() || absl::Now() > it->second.expires) {
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
  core_->loop().ClearDeadline(ReservationKey(it->first));
  reserved_request_.erase(reservation.request_id);
  reservations_.erase(it);
  running_[request.request_id()] = std::move(running);
  num_running_.store(static_cast<int>(running_.size()));
  metrics_.requests.Increment();
  PublishStats();
  return absl::OkStatus();
}


void DecodeWorkerImpl::AbandonStream(const std::string& request_id, const TokenStream* stream) {
  auto it = running_.find(request_id);
  if (it == running_.end() || it->second.stream.get() != stream) return;
  EndRunning(request_id, absl::CancelledError("the Start call was cancelled"));
}

void DecodeWorkerImpl::Cancel(const std::string& request_id,
                              UnaryCall<tandem::v1::CancelResponse>* call) {
  worker::AnswerOnLoop<tandem::v1::CancelResponse>(
      core_->loop(), call,
      [this, request_id]() -> absl::StatusOr<tandem::v1::CancelResponse> {
        TANDEM_ASSIGN_OR_RETURN(bool found, CancelOnLoop(request_id));
        tandem::v1::CancelResponse response;
        response.set_found(found);
        return response;
      },
      Stopped());
}

absl::StatusOr<bool> DecodeWorkerImpl::CancelOnLoop(const std::string& request_id) {
  bool found = false;
  if (running_.count(request_id) > 0) {
    EndRunning(request_id, absl::OkStatus());
    found = true;
  }
  if (FreeParked(request_id, /*expired=*/false)) found = true;
  auto it = reserved_request_.find(request_id);
  if (it != reserved_request_.end()) {
    auto r = reservations_.find(it->second);
    // An expired reservation is left to the expiry sweep: a late transfer may land in it.
    if (r != reservations_.end() && absl::Now() <= r->second.expires) {
      DropReservation(r);
      found = true;
    }
  }
  PublishStats();
  return found;
}

absl::StatusOr<DecodeWorkerImpl::HandoffPlan> DecodeWorkerImpl::PlanHandoff(
    const tandem::v1::HandoffRequest& request) {
  const std::string& id = request.request_id();
  const int index = request.index();
  const tandem::v1::KvReservation& reservation = request.reservation();
  auto it = parked_.find(id);
  if (it == parked_.end() || absl::Now() > it->second.expires) {
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
    return absl::AbortedError(
        absl::StrCat("sample ", index, " of request ", id, " is being handed off already"));
  }
  const engine::KvCacheLayout& src = core_->kv().cache_layout();
  const int block_size = src.block_size;
  const int need = (parked.num_kv_tokens + block_size - 1) / block_size;
  const int per_choice = reservation.blocks_per_choice();
  if (per_choice < need) {
    return absl::InvalidArgumentError(
        absl::StrCat("the reservation has ", per_choice, " blocks per sample but the KV of ",
                     parked.num_kv_tokens, " tokens takes ", need, " blocks of ", block_size));
  }
  const int64_t first = static_cast<int64_t>(request.target_index()) * per_choice;
  if (request.target_index() < 0 || first + per_choice > reservation.block_ids_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "target_index ", request.target_index(), " is outside the ", reservation.block_ids_size(),
        " block ids of the reservation (", per_choice, " per sample)"));
  }
  // The endpoint's layout was checked equal to this worker's; only its size differs.
  engine::KvCacheLayout dst = src;
  dst.num_blocks = reservation.endpoint().num_blocks();
  const engine::BlockTable src_blocks(parked.blocks.begin(), parked.blocks.begin() + need);
  const engine::BlockTable dst_blocks(reservation.block_ids().begin() + first,
                                      reservation.block_ids().begin() + first + need);
  TANDEM_ASSIGN_OR_RETURN(std::vector<engine::KvCopyRange> ranges,
                          engine::KvBlockCopyRanges(src, dst, src_blocks, dst_blocks));
  HandoffPlan plan;
  for (const engine::KvCopyRange& r : ranges) {
    plan.ranges.push_back({r.src_offset, r.dst_offset, r.bytes});
  }
  plan.num_kv_tokens = parked.num_kv_tokens;
  plan.deadline = std::min(absl::Now() + kHandoffTransferMax,
                           worker::FromUnixMillisOrInfinite(reservation.expires_unix_ms()));
  parked.transferring = true;
  return plan;
}

void DecodeWorkerImpl::EndHandoff(const std::string& id, int index, bool moved, uint64_t bytes,
                                  double seconds) {
  auto it = parked_.find(id);
  if (it == parked_.end()) return;
  auto sample = it->second.samples.find(index);
  if (sample == it->second.samples.end()) return;
  if (moved) {
    engine_->FreeReservation(sample->second.blocks);
    it->second.samples.erase(sample);
    metrics_.handoffs.Increment();
    metrics_.handoff_bytes.Increment(static_cast<double>(bytes));
    metrics_.handoff_seconds.Increment(seconds);
  } else {
    // Stays parked until it expires (its expiry may have passed during the copy).
    sample->second.transferring = false;
    core_->loop().SetDeadline(ParkedKey(id), it->second.expires,
                              [this, id] { FreeParked(id, /*expired=*/true); });
  }
  if (it->second.samples.empty()) {
    parked_.erase(it);
    core_->loop().ClearDeadline(ParkedKey(id));
  }
  UpdateParkedCount();
  PublishStats();
}

absl::StatusOr<tandem::v1::HandoffResponse> DecodeWorkerImpl::Handoff(
    const tandem::v1::HandoffRequest& request) {
  const std::string& id = request.request_id();
  const int index = request.index();
  if (id.empty()) return absl::InvalidArgumentError("request_id is empty");
  const tandem::v1::TransferEndpoint& endpoint = request.reservation().endpoint();
  TANDEM_RETURN_IF_ERROR(core_->kv().CheckReceiver(endpoint, "reservation.endpoint"));
  if (endpoint.region_descriptors_size() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("reservation.endpoint has ", endpoint.region_descriptors_size(),
                     " region descriptors; a handoff writes into a decode worker's one region"));
  }
  absl::StatusOr<HandoffPlan> plan = core_->loop().Call<absl::StatusOr<HandoffPlan>>(
      [&] { return PlanHandoff(request); }, Stopped());
  if (!plan.ok()) return plan.status();

  uint64_t bytes = 0;
  for (const kvtransfer::Range& r : plan->ranges) bytes += r.bytes;
  const absl::Time begin = absl::Now();
  absl::Status moved = [&]() -> absl::Status {
    // A connection of its own: closing it also cancels whatever a failed transfer still has in
    // flight, so nothing reads the parked blocks once they are given back.
    kvtransfer::Agent& agent = core_->kv().agent();
    TANDEM_ASSIGN_OR_RETURN(kvtransfer::PeerId peer, agent.Connect(endpoint.address(), plan->deadline));
    auto handle = core_->kv().Push(peer, endpoint.region_descriptors(0), std::move(plan->ranges),
                                   plan->deadline);
    absl::Status status = handle.ok() ? (*handle)->Wait() : handle.status();
    agent.Disconnect(peer).IgnoreError();
    return status;
  }();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - begin);
  core_->loop().Call<bool>(
      [&] {
        EndHandoff(id, index, moved.ok(), bytes, seconds);
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
  if (core_ == nullptr) return;
  core_->Shutdown([&] {
    const absl::Time deadline = absl::Now() + grace;
    const bool handoff = park && options_.handoff_ttl > absl::ZeroDuration();
    while (num_running_.load() > 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    // Whatever still runs is parked for KV handoff, or ends with an error event; unstarted
    // reservations are freed.
    core_->loop().Call<bool>(
        [this, handoff] {
          std::vector<std::string> ids;
          for (const auto& [id, running] : running_) ids.push_back(id);
          for (const std::string& id : ids) {
            if (handoff && ParkRunning(id)) continue;
            EndRunning(id, ShuttingDown());
          }
          while (!reservations_.empty()) DropReservation(reservations_.begin());
          PublishStats();
          return true;
        },
        false);
    // The router moves parked samples with Handoff (the server still answers); each is freed
    // when handed off, cancelled or expired.
    const absl::Time parked_deadline =
        absl::Now() + options_.handoff_ttl + kHandoffTransferMax + absl::Seconds(1);
    while (num_parked_.load() > 0 && absl::Now() < parked_deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
  });
}

// --- gRPC -------------------------------------------------------------------------------------

grpc::ServerUnaryReactor* Service::Reserve(grpc::CallbackServerContext*,
                                           const tandem::v1::ReserveRequest* request,
                                           tandem::v1::ReserveResponse* response) {
  auto* call = new UnaryCall<tandem::v1::ReserveResponse>(response);
  worker_->Reserve(*request, call);
  return call;
}

grpc::ServerUnaryReactor* Service::Release(grpc::CallbackServerContext*,
                                           const tandem::v1::ReleaseRequest* request,
                                           tandem::v1::ReleaseResponse* response) {
  auto* call = new UnaryCall<tandem::v1::ReleaseResponse>(response);
  worker_->Release(request->reservation_id(), call);
  return call;
}

grpc::ServerWriteReactor<tandem::v1::TokenEvent>* Service::Start(
    grpc::CallbackServerContext*, const tandem::v1::StartRequest* request) {
  return worker_->Start(*request);
}

grpc::ServerUnaryReactor* Service::Cancel(grpc::CallbackServerContext*,
                                          const tandem::v1::CancelRequest* request,
                                          tandem::v1::CancelResponse* response) {
  auto* call = new UnaryCall<tandem::v1::CancelResponse>(response);
  worker_->Cancel(request->request_id(), call);
  return call;
}

grpc::ServerUnaryReactor* Service::Stats(grpc::CallbackServerContext*,
                                         const tandem::v1::StatsRequest*,
                                         tandem::v1::WorkerStats* response) {
  return worker::AnswerNow(response, absl::StatusOr<tandem::v1::WorkerStats>(worker_->Stats()));
}

grpc::ServerUnaryReactor* Service::Handshake(grpc::CallbackServerContext*,
                                             const tandem::v1::HandshakeRequest* request,
                                             tandem::v1::HandshakeResponse* response) {
  return worker::AnswerNow(response, worker_->Handshake(*request));
}

grpc::Status Service::Handoff(grpc::ServerContext*, const tandem::v1::HandoffRequest* request,
                              tandem::v1::HandoffResponse* response) {
  return worker::Answer(worker_->Handoff(*request), response);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DecodeWorker>> DecodeWorker::Create(DecodeWorkerOptions options) {
  auto worker = std::make_unique<DecodeWorkerImpl>();
  TANDEM_RETURN_IF_ERROR(worker->Init(std::move(options)));
  return std::unique_ptr<DecodeWorker>(std::move(worker));
}

}  // namespace tandem::decode_worker
