// One request on its way through the disaggregated pools, as a state machine driven by gRPC's
// callback API: no thread waits for it. Each step starts one call and returns; the call's
// completion (on one of gRPC's threads) takes the next step.
//
//   reserving ──> prefilling ──> streaming ──> done
//       ^                            │
//       │  (a worker went away)      ├──> handing off ──> streaming   (a draining decode
//       └──────── migrating <────────┘        │                        worker parked the KV)
//                                             └──> migrating (the hand-off failed: recompute)
//
// reserving:   Reserve the prompt's KV blocks on the best decode worker (placement.h), trying
//              the others and waiting for room up to admission_timeout.
// prefilling:  Submit the prompt to the prefill worker with the least work (queued tokens, plus
//              with KV-aware routing what it would compute of this prompt); its KV lands in the
//              reservation.
// streaming:   Start on the decode worker and relay its TokenEvents to the callback.
// handing off: the decode worker drained and parked the unfinished samples with their KV:
//              Reserve on another decode worker, Handoff the KV there, Start again.
// migrating:   a worker went away: after a short pause the request starts over (nothing was
//              streamed yet) or each unfinished sample continues elsewhere, its prompt plus the
//              tokens so far prefilled again, so the client's stream has no gap and no repeat.
// done:        every sample finished, the request failed, or it was aborted. Every path that
//              leaves a reservation unused releases it before `done`.
//
// An embedding request (engine::RequestTask::kEmbed) samples nothing and keeps its KV where it
// was computed: it goes prefilling ──> done, Submitted (TASK_EMBED) to the prefill worker with
// the least work without a reservation; no decode worker hears of it. Its one output carries the
// vector. A prefill worker that went away sends it through migrating to another one.
//
// Abort() cancels the call in flight (Submit or Start; a Reserve or Handoff is let finish and
// what it reserved is released) and any pause; the callback hears nothing more.
//
//   auto flight = Flight::Launch(&env, std::move(request), callback, [&] { Forget(id); });
//   flight->Abort();
#pragma once

#include <grpcpp/alarm.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tandem/engine/generator.h"
#include "worker_pool.h"

namespace tandem::router {

enum class FlightState { kReserving, kPrefilling, kStreaming, kHandingOff, kMigrating, kDone };
const char* FlightStateName(FlightState state);

struct FlightOptions {
  // How long a request may wait for KV room on some decode worker (ResourceExhausted after).
  absl::Duration admission_timeout = absl::Seconds(30);
  // Time a reservation may take to be prefilled and started; also the prefill's deadline.
  absl::Duration prefill_timeout = absl::Seconds(60);
  // Longest token stream from a decode worker.
  absl::Duration stream_timeout = absl::Minutes(30);
  // How many times a request may go on elsewhere after a worker went away under it.
  int max_retries = 3;
};

// Failovers over all flights (GeneratorCounters).
struct FlightCounters {
  std::atomic<int64_t> prefill_retries{0};
  std::atomic<int64_t> migrations{0};
  std::atomic<int64_t> kv_handoffs{0};
  std::atomic<int64_t> kv_handoff_bytes{0};
  // Workers chosen, by pool (0 prefill, 1 decode) and RouteReason.
  std::atomic<int64_t> routed[2][3] = {};
};

// What every flight shares; outlives them all.
struct FlightEnv {
  WorkerPool* pool = nullptr;
  FlightOptions options;
  // kv-aware: prefill and decode workers are scored with what their prefix caches hold of the
  // prompt (pool->kv_index()); load: by load alone.
  Routing routing = Routing::kLoad;
  FlightCounters* counters = nullptr;
  // The text of tokens (the tokenizer's Decode), for what a worker that went away held back.
  std::function<std::string(const std::vector<int32_t>& tokens, bool skip_special_tokens)>
      detokenize;
  // Called at every change of state, on the thread that makes it (optional).
  std::function<void(const std::string& request_id, FlightState state)> on_state;
};

class Flight : public std::enable_shared_from_this<Flight> {
 public:
  // Starts `request` and returns at once (the first calls may complete before it returns).
  // Outputs arrive through `callback` on gRPC's threads; `on_done` runs once, last, when the
  // flight holds no reservation and makes no call any more.
  static std::shared_ptr<Flight> Launch(const FlightEnv* env, engine::GenerateRequest request,
                                        engine::OutputCallback callback,
                                        std::function<void()> on_done);

  // Cancels the request; safe from any thread, at any time, more than once.
  void Abort();

  FlightState state() const;

  // Public for the implementation's helpers; not part of the interface.
  Flight(const FlightEnv* env, engine::GenerateRequest request, engine::OutputCallback callback,
         std::function<void()> on_done);

 private:
  struct Sample {
    std::vector<int32_t> generated;  // tokens sent to the client
    std::string delivered;           // text sent to the client
    std::string carried;  // text to prepend to the next text (held back by a worker that went away)
    bool done = false;
  };
  // How one decode stream ended.
  struct StreamEnd {
    bool finished = false;  // the attempt's last event arrived
    absl::Status error;     // otherwise why not (OK when aborted by the client)
    // A draining worker parked the stream's unfinished samples with their KV: what the last
    // event said, the worker, and the stream's worker-side request id.
    std::optional<tandem::v1::KvHandoff> handoff;
    std::shared_ptr<WorkerHandle> worker;
    std::string worker_request_id;
    bool any_event = false;  // the stream delivered at least one event
  };
  struct Reserved {
    std::shared_ptr<WorkerHandle> worker;
    tandem::v1::KvReservation reservation;
  };
  struct ReserveJob;
  struct HandoffJob;
  class StartStream;
  using Then = std::function<void()>;

  // --- the request's course (flight.cc) ---
  void SetState(FlightState state);
  void Attempt();
  // Attempt's course for an embedding request: Submit, then the vector or the failure.
  void Embed();
  void OnStreamEnd(StreamEnd end);
  void RetryAfterPause(const absl::Status& why);
  void ContinueElsewhere();
  void Finish();
  void HandOff(const StreamEnd& parked, std::function<void(StreamEnd, bool started)> then);
  void HandoffSample(std::shared_ptr<HandoffJob> job, size_t i);
  void AbandonHandoff(std::shared_ptr<HandoffJob> job, absl::Status why);

  // --- calls (flight_calls.cc) ---
  // Reserves on some decode worker: `num_tokens`/`max_tokens` (defaults: the request's), not on
  // `exclude`, waiting for room up to `wait`.
  void Reserve(const engine::GenerateRequest& r, int num_tokens, int max_tokens,
               const WorkerHandle* exclude, absl::Duration wait,
               std::function<void(absl::StatusOr<Reserved>)> then);
  void ReserveRound(std::shared_ptr<ReserveJob> job);
  void ReserveNext(std::shared_ptr<ReserveJob> job);
  void Release(const Reserved& reserved, bool pending, Then then);
  void CancelOn(const WorkerHandle& worker, const std::string& request_id,
                const std::string& reason, absl::Duration timeout, Then then);
  // `tokens`: the prompt tokens the prefill worker is expected to compute (its pending load).
  // An embedding request goes without `reservation` (pass an empty one) and with
  // options.prefill_timeout as its deadline.
  void Prefill(const engine::GenerateRequest& r, const std::shared_ptr<WorkerHandle>& prefill,
               int64_t queued_ahead, int64_t tokens, const tandem::v1::KvReservation& reservation,
               std::function<void(absl::Status, tandem::v1::SubmitResponse&)> then);
  // Starts `start` on reserved.worker (whose reservation it consumes) and relays its stream.
  void Relay(const Reserved& reserved, tandem::v1::StartRequest start,
             std::function<void(StreamEnd)> then);
  // A pause (cut short by Abort).
  void Pause(absl::Duration d, Then then);

  // --- relaying (flight_stream.cc) ---
  // Handles one event of the stream; false: stop (end.error says why).
  bool OnEvent(const tandem::v1::TokenEvent& event, StreamEnd& end, std::vector<int>& aborted);
  StreamEnd OnStreamDone(StreamEnd end, const std::vector<int>& aborted, const grpc::Status& status,
                         const WorkerHandle& decode);

  // The call in flight that Abort cancels; false (nothing set) if already cancelled.
  bool BeginCall(std::shared_ptr<grpc::ClientContext> context);
  void EndCall();
  bool Cancelled() const;
  // How current_ is routed: env_.routing, with what the workers' caches hold of its prompt.
  RouteRequest Route() const;
  void CountRoute(int pool, RouteReason reason) const;
  // The prefill worker for current_ (PickPrefill over the pool's last snapshot), counted in the
  // routing metrics; `worker` is null when none is up.
  struct PrefillChoice {
    std::shared_ptr<WorkerHandle> worker;
    int64_t queued_ahead = 0;  // work queued on it before this request
    int64_t tokens = 0;        // prompt tokens it will compute
  };
  PrefillChoice ChoosePrefill() const;
  // Calls the callback unless the request was aborted.
  void Deliver(const engine::RequestOutput& output, const absl::Status& status);
  bool AllDone() const;
  bool AnyGenerated() const;

  const FlightEnv& env_;
  const engine::GenerateRequest original_;
  const engine::OutputCallback callback_;
  std::function<void()> on_done_;

  // Held by every step (each completion of a call or pause that continues the flight): steps
  // come one at a time, on whichever gRPC thread, and this orders them for readers such as
  // ThreadSanitizer that cannot see gRPC's own ordering. Recursive: a call may complete on the
  // thread that starts it, inside the step that starts it.
  std::unique_lock<std::recursive_mutex> Step() {
    return std::unique_lock<std::recursive_mutex>(step_mu_);
  }
  std::recursive_mutex step_mu_;

  // Touched only by the step in progress (one at a time).
  engine::RequestOutput output_;
  std::vector<Sample> sample_;  // by the request's sample index
  std::vector<int> samples_;    // the running attempt's sample i is the request's samples_[i]
  engine::GenerateRequest current_;  // the attempt's request (a continuation after a migration)
  engine::GenerateRequest base_;     // what the streaming worker holds (a hand-off continues it)
  PrefixHits hits_;                  // what the workers' caches hold of current_'s prompt
  int attempt_ = 0;
  int retries_ = 0;

  mutable std::mutex mu_;
  FlightState state_ = FlightState::kReserving;       // guarded by mu_
  bool cancelled_ = false;                            // guarded by mu_
  std::shared_ptr<grpc::ClientContext> call_;         // guarded by mu_
  std::shared_ptr<grpc::Alarm> pause_;                // guarded by mu_
};

}  // namespace tandem::router
