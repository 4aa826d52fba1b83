// The decode worker's internals, shared by its engine-loop half (decode_worker.cc) and its
// RPC half (decode_rpc.cc). Nothing outside decode_worker/ includes this.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "tandem/base/job_pool.h"
#include "tandem/decode_worker/decode_worker.h"
#include "tandem/engine/engine_metrics.h"
#include "tandem/worker/tensor_parallel_kv.h"
#include "tandem/kvtransfer/agent.h"
#include "tandem/metrics/registry.h"
#include "tandem/v1/decode.grpc.pb.h"
#include "tandem/worker/grpc_call.h"
#include "tandem/worker/worker_core.h"
#include "token_stream.h"

namespace tandem::decode_worker::internal {

using worker::UnaryCall;

// An expired reservation keeps its blocks this much longer, so that prefill transfers still in
// flight (prefill workers use its expiry as their transfer deadline) land in blocks nobody else
// owns yet.
inline constexpr absl::Duration kExpiryGrace = absl::Seconds(2);
// Upper bound of ReserveRequest.n: what the engine accepts.
inline constexpr int kMaxReserveSamples = engine::kMaxSamplesPerRequest;
// Longest DecodeWorkerOptions::handoff_ttl.
inline constexpr absl::Duration kMaxHandoffTtl = absl::Seconds(30);
// A Handoff's transfer (connect included) takes at most this, and never past the target
// reservation's expiry.
inline constexpr absl::Duration kHandoffTransferMax = absl::Seconds(10);
// Handoffs copying at once; more wait their turn (the router sends one per parked sample).
inline constexpr int kHandoffThreads = 16;

inline absl::Status Stopped() { return absl::UnavailableError("the decode worker has shut down"); }
inline absl::Status ShuttingDown() {
  return absl::UnavailableError("the decode worker is shutting down");
}

// Blocks set aside for a request whose prompt KV is being written by a prefill worker.
struct Reservation {
  std::string request_id;
  int num_prompt_tokens = 0;
  int n = 1;
  std::vector<engine::BlockTable> blocks;  // one table per sample
  absl::Time expires;
  // The prompt's first num_cached_tokens tokens were this worker's cached blocks, shared at the
  // front of every table; Start must bring the same prompt (and cache_salt).
  int num_cached_tokens = 0;
  std::vector<int32_t> cached_prefix;
  std::string cache_salt;

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
inline std::string ReservationKey(const std::string& id) {
  return absl::StrCat("reservation/", id);
}
inline std::string ParkedKey(const std::string& request_id) {
  return absl::StrCat("parked/", request_id);
}

class DecodeWorkerImpl;

// The gRPC face on the callback API: no call holds a gRPC thread while the engine works for it
// (a Handoff's copy waits on the worker's handoff threads).
using AsyncService = tandem::v1::DecodeWorker::WithCallbackMethod_Handoff<
    tandem::v1::DecodeWorker::WithCallbackMethod_Reserve<
    tandem::v1::DecodeWorker::WithCallbackMethod_Release<
        tandem::v1::DecodeWorker::WithCallbackMethod_Start<
            tandem::v1::DecodeWorker::WithCallbackMethod_Cancel<
                tandem::v1::DecodeWorker::WithCallbackMethod_Stats<
                    tandem::v1::DecodeWorker::WithCallbackMethod_Handshake<
                        tandem::v1::DecodeWorker::WithCallbackMethod_KvEvents<
                            tandem::v1::DecodeWorker::Service>>>>>>>>;

class Service final : public worker::WithStatsAndHandshake<AsyncService, DecodeWorkerImpl> {
 public:
  using WithStatsAndHandshake::WithStatsAndHandshake;

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
  grpc::ServerUnaryReactor* Handoff(grpc::CallbackServerContext*,
                                    const tandem::v1::HandoffRequest* request,
                                    tandem::v1::HandoffResponse* response) override;
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
  prometheus::Counter& kv_cached_bytes = registry.Counter(
      "tandem_decode_kv_cached_bytes_total",
      "Prompt KV bytes of started requests that this worker's prefix cache already held, so no "
      "prefill worker sent them.");
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
  prometheus::Counter& handoff_seconds = registry.Counter("tandem_decode_kv_handoff_seconds_total",
                                                          "Time spent moving KV in Handoff calls.");
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
  grpc::ServerWriteReactor<tandem::v1::KvEventBatch>* KvEvents() {
    return core_->kv_events().Subscribe(core_->loop());
  }
  // Runs the copy on the handoff threads and answers `call` there.
  void Handoff(const tandem::v1::HandoffRequest& request,
               UnaryCall<tandem::v1::HandoffResponse>* call);

 private:
  // Moves a parked sample's KV into the reservation the request names; waits for the copy.
  absl::StatusOr<tandem::v1::HandoffResponse> RunHandoff(const tandem::v1::HandoffRequest& request);
  // A parked sample's KV on its way to another decode worker: rank 0's pushes, one per
  // destination rank it writes, and the followers' part of this worker's tensor-parallel group
  // (KvPushOrders, sent between steps; empty without one).
  struct HandoffPlan {
    struct RankPush {
      std::string address;
      std::string descriptor;
      std::vector<kvtransfer::Range> ranges;
    };
    std::vector<RankPush> pushes;
    std::string follower_orders;
    uint64_t bytes = 0;  // every rank's
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

  // Published by the loop after every change (PublishStats); Shutdown waits on them.
  mutable std::mutex mu_;
  std::condition_variable changed_;
  tandem::v1::WorkerStats snapshot_;  // guarded by mu_
  int num_running_ = 0;               // guarded by mu_: started requests still running
  int num_parked_ = 0;                // guarded by mu_: samples parked for KV handoff

  // Handoffs wait for their copies here (connect included, up to kHandoffTransferMax each): a
  // draining worker's parked samples move in parallel, and no gRPC thread waits. Stopped with
  // the worker, after the gRPC server has answered every call. Created by Init just before
  // serving, so that its threads start after what their jobs read is set.
  std::unique_ptr<base::JobPool> handoffs_;
};

}  // namespace tandem::decode_worker::internal
