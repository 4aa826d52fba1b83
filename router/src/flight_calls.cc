// The calls a flight makes, each on gRPC's callback API: it starts the call and returns, and
// the completion continues the flight.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "flight.h"
#include "tandem/proto/wire.h"

namespace tandem::router {
namespace {

std::chrono::system_clock::time_point GrpcDeadline(absl::Time t) { return absl::ToChronoTime(t); }

// One unary call's context and messages, alive until its completion has run.
template <typename Request, typename Response>
struct Unary {
  explicit Unary(absl::Time deadline) { context->set_deadline(GrpcDeadline(deadline)); }
  std::shared_ptr<grpc::ClientContext> context = std::make_shared<grpc::ClientContext>();
  Request request;
  Response response;
};

}  // namespace

struct Flight::ReserveJob {
  const engine::GenerateRequest* r;  // the flight's current_ or a hand-off's request (kept alive)
  std::shared_ptr<const engine::GenerateRequest> owned;
  int prompt_len = 0;
  // Whether the blocks are for the prompt's KV (the worker may share its cached prefix) rather
  // than for a handoff's, which fills every block.
  bool lookup_prefix = false;
  int max_tokens = 0;
  const WorkerHandle* exclude = nullptr;
  absl::Time give_up;
  absl::Duration backoff = absl::Milliseconds(5);
  absl::Status last = absl::UnavailableError("no decode worker is up");
  std::vector<std::shared_ptr<WorkerHandle>> order;  // this round's decode workers, best first
  std::vector<RouteReason> reasons;                  // why each of them (order's indexes)
  size_t next = 0;
  absl::Duration wait;
  std::function<void(absl::StatusOr<Reserved>)> then;
};

void Flight::Reserve(const engine::GenerateRequest& r, int num_tokens, int max_tokens,
                     const WorkerHandle* exclude, absl::Duration wait,
                     std::function<void(absl::StatusOr<Reserved>)> then) {
  auto job = std::make_shared<ReserveJob>();
  job->owned = std::make_shared<const engine::GenerateRequest>(r);
  job->r = job->owned.get();
  job->prompt_len = num_tokens > 0 ? num_tokens : static_cast<int>(r.prompt_tokens.size());
  job->lookup_prefix = num_tokens <= 0;
  job->max_tokens = max_tokens >= 0 ? max_tokens : r.params.max_tokens;
  job->exclude = exclude;
  job->wait = wait;
  job->give_up = absl::Now() + wait;
  job->then = std::move(then);
  ReserveRound(std::move(job));
}

void Flight::ReserveRound(std::shared_ptr<ReserveJob> job) {
  std::shared_ptr<const PoolSnapshot> pools = env_.pool->Snapshot();
  if (pools->decode.empty()) {
    return job->then(absl::UnavailableError("no decode worker is registered"));
  }
  job->order.clear();
  job->reasons.clear();
  job->next = 0;
  // The prompt's KV (the flight's current_, whose cached prefix hits_ holds) is routed as asked;
  // a handoff's KV by load (no worker holds any of it).
  const RouteRequest route =
      job->lookup_prefix ? Route() : RouteRequest{.prompt_tokens = job->prompt_len,
                                                  .n = job->r->params.n};
  for (const WorkerView* w :
       RankDecode(*pools, EstimateBlocks(job->prompt_len, job->r->params.n), route)) {
    if (w->handle.get() != job->exclude) {
      job->order.push_back(w->handle);
      job->reasons.push_back(ReasonFor(route, *w));
    }
  }
  ReserveNext(std::move(job));
}

void Flight::ReserveNext(std::shared_ptr<ReserveJob> job) {
  if (job->next == job->order.size()) {
    // Every worker up was asked: wait for room (or for one to come up), then ask again.
    if (absl::Now() + job->backoff < job->give_up) {
      const absl::Duration pause = job->backoff;
      job->backoff = std::min(job->backoff * 2, absl::Milliseconds(100));
      return Pause(pause, [this, job] {
        if (Cancelled()) return job->then(absl::CancelledError("request aborted"));
        ReserveRound(job);
      });
    }
    if (job->last.code() == absl::StatusCode::kResourceExhausted) {
      return job->then(absl::ResourceExhaustedError(
          absl::StrCat("no decode worker had room for the request's KV cache within ",
                       absl::FormatDuration(job->wait), " (", job->last.message(), ")")));
    }
    return job->then(absl::UnavailableError(
        absl::StrCat("no decode worker could take the request: ", job->last.message())));
  }
  const RouteReason reason = job->reasons[job->next];
  std::shared_ptr<WorkerHandle> w = job->order[job->next++];
  using Call = Unary<tandem::v1::ReserveRequest, tandem::v1::ReserveResponse>;
  auto call = std::make_shared<Call>(absl::Now() + absl::Seconds(10));
  tandem::v1::ReserveRequest& request = call->request;
  request.set_request_id(job->r->request_id);
  request.set_num_prompt_tokens(job->prompt_len);
  request.set_max_tokens(job->max_tokens);
  request.set_n(job->r->params.n);
  if (job->lookup_prefix) {
    // A prompt to prefill (not a handoff's KV): the worker shares what its prefix cache holds.
    request.mutable_prompt_token_ids()->Add(job->r->prompt_tokens.begin(),
                                            job->r->prompt_tokens.end());
    request.set_cache_salt(job->r->cache_salt);
  }
  request.set_deadline_unix_ms(absl::ToUnixMillis(absl::Now() + env_.options.prefill_timeout));
  // Not cancelled from Abort: a Reserve cut short could still have reserved, unseen. It is
  // quick; an abort meanwhile is handled by releasing what it returns.
  w->decode->async()->Reserve(
      call->context.get(), &call->request, &call->response,
      [self = shared_from_this(), job, w, call, reason](grpc::Status status) {
        auto step = self->Step();
        if (status.ok()) {
          Reserved reserved{w, call->response.reservation()};
          if (job->lookup_prefix) self->CountRoute(1, reason);
          if (self->Cancelled()) {
            return self->Release(reserved, /*pending=*/false, [job] {
              job->then(absl::CancelledError("request aborted"));
            });
          }
          self->env_.pool->AddPending(*w, reserved.reservation.block_ids_size(), 1);
          return job->then(std::move(reserved));
        }
        job->last = proto::FromGrpcStatus(status);
        if (job->last.code() == absl::StatusCode::kUnavailable) self->env_.pool->MarkDown(*w);
        if (self->Cancelled()) return job->then(absl::CancelledError("request aborted"));
        // A request no decode worker could ever hold is refused as it is; the others wait.
        if (job->last.code() == absl::StatusCode::kInvalidArgument) return job->then(job->last);
        self->ReserveNext(job);
      });
}

void Flight::Release(const Reserved& reserved, bool pending, Then then) {
  using Call = Unary<tandem::v1::ReleaseRequest, tandem::v1::ReleaseResponse>;
  auto call = std::make_shared<Call>(absl::Now() + absl::Seconds(5));
  call->request.set_reservation_id(reserved.reservation.reservation_id());
  if (pending) {
    env_.pool->AddPending(*reserved.worker, -reserved.reservation.block_ids_size(), -1);
  }
  // Best effort: a reservation nobody releases expires on the worker.
  reserved.worker->decode->async()->Release(
      call->context.get(), &call->request, &call->response,
      [self = shared_from_this(), call, then = std::move(then)](grpc::Status) {
        auto step = self->Step();
        then();
      });
}

void Flight::CancelOn(const WorkerHandle& worker, const std::string& request_id,
                      const std::string& reason, absl::Duration timeout, Then then) {
  using Call = Unary<tandem::v1::CancelRequest, tandem::v1::CancelResponse>;
  auto call = std::make_shared<Call>(absl::Now() + timeout);
  call->request.set_request_id(request_id);
  call->request.set_reason(reason);
  auto done = [self = shared_from_this(), call, then = std::move(then)](grpc::Status) {
    auto step = self->Step();
    then();
  };
  if (worker.decode) {
    worker.decode->async()->Cancel(call->context.get(), &call->request, &call->response,
                                   std::move(done));
  } else {
    worker.prefill->async()->Cancel(call->context.get(), &call->request, &call->response,
                                    std::move(done));
  }
}

void Flight::Prefill(const engine::GenerateRequest& r,
                     const std::shared_ptr<WorkerHandle>& prefill, int64_t queued_ahead,
                     int64_t tokens, const tandem::v1::KvReservation& reservation,
                     std::function<void(absl::Status, tandem::v1::SubmitResponse&)> then) {
  using Call = Unary<tandem::v1::SubmitRequest, tandem::v1::SubmitResponse>;
  const bool embed = r.task == engine::RequestTask::kEmbed;
  // A generation's KV must have landed before its reservation expires; an embedding has none.
  const absl::Time deadline = embed ? absl::Now() + env_.options.prefill_timeout
                                    : absl::FromUnixMillis(reservation.expires_unix_ms());
  auto call = std::make_shared<Call>(deadline + absl::Seconds(1));
  tandem::v1::SubmitRequest& request = call->request;
  request.set_request_id(r.request_id);
  request.mutable_prompt_token_ids()->Add(r.prompt_tokens.begin(), r.prompt_tokens.end());
  *request.mutable_sampling() = proto::ToProto(r.params);
  if (!embed) *request.mutable_reservation() = reservation;
  request.set_cache_salt(r.cache_salt);
  request.set_deadline_unix_ms(absl::ToUnixMillis(deadline));
  request.set_task(proto::ToProto(r.task));
  if (!BeginCall(call->context)) {
    return then(absl::CancelledError("request aborted"), call->response);
  }
  env_.pool->AddPending(*prefill, tokens, 1);
  const absl::Time sent = absl::Now();
  prefill->prefill->async()->Submit(
      call->context.get(), &call->request, &call->response,
      [self = shared_from_this(), call, prefill, tokens, queued_ahead, sent,
       then = std::move(then)](grpc::Status status) {
        auto step = self->Step();
        const double seconds = absl::ToDoubleSeconds(absl::Now() - sent);
        self->env_.pool->AddPending(*prefill, -tokens, -1);
        self->EndCall();
        if (status.ok()) {
          self->env_.pool->Learn(*prefill, seconds, queued_ahead + tokens);
          return then(absl::OkStatus(), call->response);
        }
        absl::Status failed = proto::FromGrpcStatus(status);
        then(absl::Status(failed.code(), absl::StrCat("prefill worker ", prefill->address, ": ",
                                                      failed.message())),
             call->response);
      });
}

void Flight::Pause(absl::Duration d, Then then) {
  auto alarm = std::make_shared<grpc::Alarm>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cancelled_) {
      alarm.reset();
    } else {
      pause_ = alarm;
    }
  }
  if (alarm == nullptr) return then();
  // Runs when the time is up, or at once (ok false) when Abort cancels it.
  alarm->Set(GrpcDeadline(absl::Now() + d),
             [self = shared_from_this(), then = std::move(then)](bool) {
               auto step = self->Step();
               then();
             });
}

bool Flight::BeginCall(std::shared_ptr<grpc::ClientContext> context) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled_) return false;
  call_ = std::move(context);
  return true;
}

void Flight::EndCall() {
  std::lock_guard<std::mutex> lock(mu_);
  call_.reset();
}

bool Flight::Cancelled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cancelled_;
}

void Flight::Abort() {
  std::shared_ptr<grpc::ClientContext> call;
  std::shared_ptr<grpc::Alarm> pause;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    call = call_;
    pause = std::move(pause_);
  }
  // Outside the lock: either may complete the flight's step on this thread.
  if (call != nullptr) call->TryCancel();
  if (pause != nullptr) pause->Cancel();
}

RouteRequest Flight::Route() const {
  return {.routing = env_.routing,
          .hits = &hits_,
          .prompt_tokens = static_cast<int64_t>(current_.prompt_tokens.size()),
          .n = current_.params.n};
}

void Flight::CountRoute(int pool, RouteReason reason) const {
  if (env_.counters != nullptr) {
    env_.counters->routed[pool][static_cast<int>(reason)].fetch_add(1);
  }
}

void Flight::Deliver(const engine::RequestOutput& output, const absl::Status& status) {
  if (Cancelled()) return;
  callback_(output, status);
}

}  // namespace tandem::router
