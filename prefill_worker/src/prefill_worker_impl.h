// The prefill worker's internals, shared by its RPC half (prefill_worker.cc) and its engine-loop
// half (prefill_push.cc: steps, the layer-by-layer KV push, answers). Nothing outside
// prefill_worker/ includes this.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "tandem/engine/engine_metrics.h"
#include "tandem/kvtransfer/agent.h"
#include "tandem/metrics/registry.h"
#include "tandem/prefill_worker/prefill_worker.h"
#include "tandem/v1/prefill.grpc.pb.h"
#include "tandem/worker/grpc_call.h"
#include "tandem/worker/tensor_parallel_kv.h"
#include "tandem/worker/worker_core.h"

namespace tandem::prefill_worker::internal {

using engine::KvWritten;
using engine::PrefillHandoff;
using worker::UnaryCall;

// How long the loop sleeps between polls when it only waits for transfers.
inline constexpr absl::Duration kTransferPoll = absl::Microseconds(500);
// The worker's own cap on a request's life (a Submit and reservation without deadlines).
inline constexpr absl::Duration kMaxRequestTime = absl::Minutes(10);
// Connecting to a decode worker's agent takes at most this (and never past the request's
// deadline).
inline constexpr absl::Duration kConnectTimeout = absl::Seconds(10);
// How often the loop asks the followers of a tensor-parallel group how their connects go while
// a request waits for them.
inline constexpr absl::Duration kFollowerConnectPoll = absl::Milliseconds(1);
// At shutdown, transfers of cancelled requests get this long to finish before their requests
// are answered anyway; destroying the agent then cancels what is left.
inline constexpr absl::Duration kShutdownDrain = absl::Seconds(5);

inline absl::Status ShuttingDown() {
  return absl::UnavailableError("the prefill worker is shutting down");
}

// How a transfer failure fails its request: a decode worker that is gone (or a connection that
// was closed) is UNAVAILABLE; a passed deadline stays DEADLINE_EXCEEDED; the rest keep their code.
inline absl::Status TransferFailure(const std::string& request_id, const absl::Status& status) {
  absl::StatusCode code = status.code();
  // A closed connection (Cancelled) or one another request already dropped (NotFound) both
  // mean the decode worker went away.
  if (code == absl::StatusCode::kCancelled || code == absl::StatusCode::kNotFound) {
    code = absl::StatusCode::kUnavailable;
  }
  return absl::Status(code, absl::StrCat("request ", request_id,
                                         ": KV transfer failed: ", std::string(status.message())));
}

// One request on the engine loop (owned by the loop thread once added).
struct Job {
  std::string id;
  uint64_t serial = 0;  // tells this Submit call from a later one with the same id
  // Set (on a gRPC thread) when the client cancels the Submit call.
  std::shared_ptr<std::atomic<bool>> call_cancelled = std::make_shared<std::atomic<bool>>(false);
  engine::GenerateRequest request;  // moved into the engine on admission
  // An embedding (TASK_EMBED): no reservation and nothing pushed; it ends with `embedding`.
  bool embed = false;
  std::vector<float> embedding;
  int n = 1;
  int prompt_len = 0;
  UnaryCall<tandem::v1::SubmitResponse>* call = nullptr;        // answered once, by Complete
  std::vector<UnaryCall<tandem::v1::CancelResponse>*> cancels;  // Cancel calls waiting for it

  // Where the KV goes: each rank of the decode worker's tensor-parallel group (one rank
  // without), and which rank of this worker's group sends which heads to which of them.
  struct Destination {
    std::string address;
    kvtransfer::PeerId peer = 0;  // 0: this rank sends it nothing (a follower does)
    bool reconnected = false;
    std::vector<std::string> descriptors;  // one for all layers, or one per layer
    engine::KvCacheLayout layout;          // its cache
  };
  std::vector<Destination> dsts;
  std::vector<engine::KvHeadRun> runs;
  // The addresses of the decode ranks the followers push to (sorted; empty when rank 0 sends
  // every head); the request enters the engine once the followers have reached them all.
  std::vector<std::string> follower_addresses;
  // The reservation's endpoint, for the followers' orders (a group of this worker's only).
  tandem::v1::TransferEndpoint endpoint;
  std::vector<int32_t> dst_blocks;  // n x blocks_per_choice
  int blocks_per_choice = 0;
  // Leading prompt tokens the decode worker already holds (its prefix cache): never pushed.
  int dst_cached_tokens = 0;
  // The request fails past `deadline`; its transfers may finish until `transfer_deadline`, the
  // reservation's expiry (after it the decode worker may reuse the blocks).
  absl::Time deadline;
  absl::Time transfer_deadline;

  // Progress.
  bool admitted = false;
  std::vector<int> computed;  // per sample: prompt tokens whose KV is written (all layers)
  std::vector<bool> started;  // per sample: a step has computed some of it
  int cached_tokens = 0;      // prompt tokens of all samples this worker's cache held
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
  // Some run's source is a follower rank.
  bool followers_push() const { return !follower_addresses.empty(); }
  // Every sample has its first token (an embedding: its vector).
  bool all_sampled() const {
    return embed ? !embedding.empty() : static_cast<int>(handoffs.size()) == n;
  }
};

// A finished job's answers, sent once the stats reflect its freed blocks.
struct Answer {
  UnaryCall<tandem::v1::SubmitResponse>* call;
  absl::StatusOr<tandem::v1::SubmitResponse> result;
  std::vector<UnaryCall<tandem::v1::CancelResponse>*> cancels;
};
struct Metrics {
  metrics::Registry registry;
  engine::EngineMetrics engine{registry};  // KV, batch, preemptions, step times
  prometheus::Gauge& queued_tokens = registry.Gauge("tandem_prefill_queued_tokens",
                                                    "Prompt tokens accepted and not yet computed.");
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
  prometheus::Histogram& prefill_seconds =
      registry.Histogram("tandem_prefill_seconds",
                         "Seconds from a request's first chunk scheduled to its first token.",
                         metrics::LatencyBuckets());
  prometheus::Gauge& token_budget = registry.Gauge(
      "tandem_prefill_token_budget",
      "Tokens a prefill step may take: max_num_batched_tokens, or the TTFT controller's lower "
      "budget.");
  prometheus::Gauge& ttft_target = registry.Gauge("tandem_prefill_ttft_target_seconds",
                                                  "The TTFT target steps are sized for (0: none).");

  prometheus::Counter& Requests(absl::StatusCode code) {
    return registry.Counter("tandem_prefill_requests_total",
                            "Submit calls answered, by status code.",
                            {{"code", absl::StatusCodeToString(code)}});
  }
};

class PrefillWorkerImpl;

// The gRPC face, on the callback API: no call holds a thread while its request runs.
class Service final
    : public worker::WithStatsAndHandshake<tandem::v1::PrefillWorker::CallbackService,
                                           PrefillWorkerImpl> {
 public:
  using WithStatsAndHandshake::WithStatsAndHandshake;
  grpc::ServerUnaryReactor* Submit(grpc::CallbackServerContext* context,
                                   const tandem::v1::SubmitRequest* request,
                                   tandem::v1::SubmitResponse* response) override;
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* context,
                                   const tandem::v1::CancelRequest* request,
                                   tandem::v1::CancelResponse* response) override;
};

class PrefillWorkerImpl final : public PrefillWorker {
 public:
  ~PrefillWorkerImpl() override { Shutdown(absl::ZeroDuration()); }

  absl::Status Start(PrefillWorkerOptions options);

  std::string grpc_address() const override { return core_->grpc_address(); }
  int metrics_port() const override { return core_->metrics_port(); }
  tandem::v1::WorkerStats Stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    tandem::v1::WorkerStats stats = stats_;
    stats.set_draining(!core_->accepting());
    return stats;
  }
  void Shutdown(absl::Duration grace) override;

  // --- the gRPC handlers (gRPC threads; each answers its call now or from the loop) ---
  void Submit(const grpc::CallbackServerContext& context, const tandem::v1::SubmitRequest& request,
              UnaryCall<tandem::v1::SubmitResponse>* call);
  void Cancel(const tandem::v1::CancelRequest& request,
              UnaryCall<tandem::v1::CancelResponse>* call);
  absl::StatusOr<tandem::v1::HandshakeResponse> Handshake(
      const tandem::v1::HandshakeRequest& request) const {
    return core_->kv().Handshake(request, core_->options().worker_id, /*this_side_sends=*/true);
  }
  grpc::ServerWriteReactor<tandem::v1::KvEventBatch>* KvEvents() {
    return core_->kv_events().Subscribe(core_->loop());
  }

 private:
  // On the preparer: builds the Submit's job and hands it to the loop, or answers the error.
  void Admit(const tandem::v1::SubmitRequest& request, absl::Time call_deadline,
             UnaryCall<tandem::v1::SubmitResponse>* call);
  // Checks a Submit against this worker and builds its job (compiling its grammar, connecting
  // to the decode worker).
  absl::StatusOr<std::unique_ptr<Job>> PrepareJob(const tandem::v1::SubmitRequest& request,
                                                  absl::Time call_deadline);
  // Checks a generation's reservation against its prompt (job.n, job.prompt_len) and this
  // worker's block size, and records where the KV goes.
  absl::Status TakeReservation(const tandem::v1::KvReservation& reservation, Job& job);

  // --- the engine loop (loop thread only) ---
  absl::Duration Iterate();
  void AddJob(std::unique_ptr<Job> job);
  // Fails the request `id` (the Submit call `serial` when not 0) with `reason`; a Cancel call
  // given as `waiter` is answered once the request is over.
  void CancelJob(const std::string& id, uint64_t serial, absl::Status reason,
                 UnaryCall<tandem::v1::CancelResponse>* waiter);
  // The on_layer_kv_written hook: posts the layer's new pages of every request it wrote.
  void OnLayerWritten(int layer, std::span<const KvWritten> written);
  // What a step's written tokens are, prompt tokens [begin, end) of sample `w.choice_index`
  // that the decode worker lacks; begin >= end when nothing is to be pushed (or the job is
  // not this worker's to push).
  std::pair<int, int> PushRange(const Job& job, const KvWritten& w) const;
  void Post(Job& job, size_t dst, int layer, std::vector<kvtransfer::Range> ranges);
  // With a tensor-parallel group: the followers' part of the step (the
  // tensor_parallel_step_attachment hook), and their reports of it.
  std::string FollowerOrders(std::span<const KvWritten> written);
  void FollowerReports(std::span<const std::string> reports);
  // Whether the followers are connected to every decode rank they push the job's KV to.
  bool FollowersReach(const Job& job) const;
  // Between steps: asks the followers to connect to the decode ranks of the jobs waiting for
  // that (connect-only orders), admits those whose ranks every follower has reached and fails
  // those a follower could not reach.
  void ReachFollowers();
  // Hands the job's request to the engine.
  void AddToEngine(Job& job);
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
  // Ends every job that is done (or has failed and has nothing in flight any more); returns
  // their answers, to send once the stats reflect the freed blocks.
  std::vector<Answer> FinishJobs(bool force);
  Answer Complete(Job& job);
  void UpdateStats();

  std::unique_ptr<worker::WorkerCore> core_;  // engine, KV endpoint, loop, servers
  engine::LlmEngine* engine_ = nullptr;       // core_'s
  engine::KvCacheLayout cache_layout_;  // this worker's cache; a decode worker's differs in size
  // Every rank's cache of this worker's tensor-parallel group (this one's alone without).
  std::vector<engine::KvCacheLayout> group_layouts_;
  int num_layers_ = 0;
  Metrics metrics_;
  Service service_{this};

  mutable std::mutex mu_;
  std::condition_variable idle_;     // Shutdown: a call finished
  std::set<std::string> in_flight_;  // guarded by mu_; request ids of Submit calls
  uint64_t next_serial_ = 1;         // guarded by mu_
  tandem::v1::WorkerStats stats_;    // guarded by mu_

  // Loop thread only.
  std::map<std::string, std::unique_ptr<Job>, std::less<>> jobs_;
  // Jobs waiting for the followers to reach their decode ranks (ReachFollowers), by id.
  std::vector<std::string> awaiting_followers_;
  // Decode ranks every follower that pushes to them has reached; an address leaves it when a
  // follower's push of a job going there fails.
  std::set<std::string> followers_reached_;
  absl::Time last_reach_ = absl::InfinitePast();  // connect-only orders last sent
  absl::Time step_start_;                                               // of the step running
  std::vector<std::unique_ptr<kvtransfer::TransferHandle>> abandoned_;  // outlive the agent
};

}  // namespace tandem::prefill_worker::internal
