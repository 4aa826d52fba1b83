#include "flight.h"

#include <algorithm>
#include <cstdio>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/proto/wire.h"

namespace tandem::router {

using engine::GenerateRequest;

const char* FlightStateName(FlightState state) {
  switch (state) {
    case FlightState::kReserving: return "reserving";
    case FlightState::kPrefilling: return "prefilling";
    case FlightState::kStreaming: return "streaming";
    case FlightState::kHandingOff: return "handing off";
    case FlightState::kMigrating: return "migrating";
    case FlightState::kDone: return "done";
  }
  return "?";
}

Flight::Flight(const FlightEnv* env, GenerateRequest request, engine::OutputCallback callback,
               std::function<void()> on_done)
    : env_(*env),
      original_(std::move(request)),
      callback_(std::move(callback)),
      on_done_(std::move(on_done)) {
  const int n = original_.params.n;
  output_.request_id = original_.request_id;
  output_.num_prompt_tokens = static_cast<int>(original_.prompt_tokens.size());
  sample_.resize(n);
  for (int i = 0; i < n; ++i) samples_.push_back(i);
  current_ = original_;
}

std::shared_ptr<Flight> Flight::Launch(const FlightEnv* env, GenerateRequest request,
                                       engine::OutputCallback callback,
                                       std::function<void()> on_done) {
  auto flight = std::make_shared<Flight>(env, std::move(request), std::move(callback),
                                         std::move(on_done));
  {
    auto step = flight->Step();
    flight->Attempt();
  }
  return flight;
}

FlightState Flight::state() const {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

void Flight::SetState(FlightState state) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = state;
  }
  if (env_.on_state) env_.on_state(original_.request_id, state);
}

bool Flight::AllDone() const {
  return std::all_of(sample_.begin(), sample_.end(), [](const Sample& s) { return s.done; });
}

bool Flight::AnyGenerated() const {
  return std::any_of(sample_.begin(), sample_.end(),
                     [](const Sample& s) { return !s.generated.empty(); });
}

void Flight::Finish() {
  {
    // The last pause's alarm holds its callback, and that holds the flight.
    std::lock_guard<std::mutex> lock(mu_);
    pause_.reset();
  }
  SetState(FlightState::kDone);
  std::function<void()> on_done = std::move(on_done_);
  if (on_done) on_done();
}

// Runs current_ (the request, or a continuation after a migration) through Reserve, Submit and
// Start, relaying its events; its end goes to OnStreamEnd.
void Flight::Attempt() {
  base_ = current_;
  hits_ = {};
  if (env_.routing == Routing::kKvAware && env_.pool->kv_index() != nullptr) {
    hits_ = env_.pool->kv_index()->Lookup(current_.prompt_tokens, current_.cache_salt);
  }
  if (current_.task == engine::RequestTask::kEmbed) return Embed();
  SetState(FlightState::kReserving);
  Reserve(current_, -1, -1, nullptr, env_.options.admission_timeout,
          [this, self = shared_from_this()](absl::StatusOr<Reserved> reserved) {
    if (!reserved.ok()) {
      StreamEnd end;
      end.error = absl::IsCancelled(reserved.status()) ? absl::OkStatus() : reserved.status();
      return OnStreamEnd(std::move(end));
    }
    SetState(FlightState::kPrefilling);
    const PrefillChoice choice = ChoosePrefill();
    std::shared_ptr<WorkerHandle> prefill = choice.worker;
    auto decode = std::make_shared<Reserved>(std::move(reserved).value());
    // After a failed prefill the blocks go back only once the prefill worker has stopped
    // writing into them: its Cancel answers after the request's transfers have ended (a
    // cancelled or failed Submit call alone does not say so).
    auto failed = [this, decode, prefill](absl::Status why) {
      auto release = [this, decode, why] {
        Release(*decode, /*pending=*/true, [this, why] {
          StreamEnd end;
          end.error = Cancelled() ? absl::OkStatus() : why;
          OnStreamEnd(std::move(end));
        });
      };
      if (prefill == nullptr) return release();
      CancelOn(*prefill, current_.request_id, "router: request ended before its prefill was used",
               absl::Seconds(10), [this, prefill, why, release] {
                 if (why.code() == absl::StatusCode::kUnavailable) {
                   env_.pool->MarkDownIfUnreachable(*prefill);
                 }
                 release();
               });
    };
    if (prefill == nullptr) return failed(absl::UnavailableError("no prefill worker is up"));
    Prefill(current_, prefill, choice.queued_ahead, choice.tokens, decode->reservation,
            [this, decode, failed](absl::Status status, tandem::v1::SubmitResponse& prefilled) {
      if (!status.ok()) return failed(std::move(status));
      tandem::v1::StartRequest start;
      start.set_request_id(current_.request_id);
      start.set_reservation_id(decode->reservation.reservation_id());
      start.mutable_prompt_token_ids()->Add(current_.prompt_tokens.begin(),
                                            current_.prompt_tokens.end());
      *start.mutable_sampling() = proto::ToProto(current_.params);
      start.set_cache_salt(current_.cache_salt);
      *start.mutable_choices() = prefilled.choices();
      Relay(*decode, std::move(start), [this](StreamEnd end) { OnStreamEnd(std::move(end)); });
    });
  });
}

Flight::PrefillChoice Flight::ChoosePrefill() const {
  PrefillChoice choice;
  std::shared_ptr<const PoolSnapshot> pools = env_.pool->Snapshot();
  const RouteRequest route = Route();
  const PrefillPick pick = PickPrefill(*pools, route);
  if (pick.worker != nullptr) {
    choice.worker = pick.worker->handle;
    choice.queued_ahead = pick.queued;
    choice.tokens = pick.compute_tokens;
    CountRoute(0, ReasonFor(route, *pick.worker));
  }
  return choice;
}

// Submits current_, an embedding request, to the prefill worker with the least work; its answer
// finishes the request. A failure goes to OnStreamEnd (another worker when this one went away).
void Flight::Embed() {
  SetState(FlightState::kPrefilling);
  const PrefillChoice choice = ChoosePrefill();
  std::shared_ptr<WorkerHandle> prefill = choice.worker;
  if (prefill == nullptr) {
    StreamEnd end;
    end.error = absl::UnavailableError("no prefill worker is up");
    return OnStreamEnd(std::move(end));
  }
  Prefill(current_, prefill, choice.queued_ahead, choice.tokens, tandem::v1::KvReservation(),
          [this, prefill](absl::Status status, tandem::v1::SubmitResponse& response) {
    StreamEnd end;
    if (status.ok() && response.embedding().empty()) {
      // A prefill worker that predates embeddings would have answered a generation's response.
      status = absl::FailedPreconditionError(absl::StrCat(
          "prefill worker ", prefill->address, " answered no embedding; it may not serve them"));
    }
    if (!status.ok()) {
      if (status.code() == absl::StatusCode::kUnavailable) {
        env_.pool->MarkDownIfUnreachable(*prefill);
      }
      end.error = Cancelled() ? absl::OkStatus() : std::move(status);
      return OnStreamEnd(std::move(end));
    }
    sample_[0].done = true;
    output_.choices.clear();
    engine::ChoiceDelta& delta = output_.choices.emplace_back();
    delta.index = 0;
    delta.finish_reason = engine::FinishReason::kStop;
    output_.finished = true;
    output_.num_prompt_tokens = response.num_prompt_tokens();
    output_.embedding.assign(response.embedding().begin(), response.embedding().end());
    Deliver(output_, absl::OkStatus());
    Finish();
  });
}

// What follows one stream's end: done, a failure for the client, or going on elsewhere.
void Flight::OnStreamEnd(StreamEnd end) {
  if (Cancelled() || AllDone()) return Finish();
  if (end.finished) return ContinueElsewhere();  // another sample still has to go on
  if (end.error.ok()) return Finish();           // aborted by the client
  const bool worker_gone = end.error.code() == absl::StatusCode::kUnavailable;
  if (!worker_gone || retries_ >= env_.options.max_retries) {
    output_.choices.clear();
    output_.finished = true;
    Deliver(output_, end.error);
    return Finish();
  }
  ++retries_;
  if (!end.handoff.has_value() || !AnyGenerated()) return RetryAfterPause(end.error);
  // The draining worker kept the KV: move it instead of computing it again.
  HandOff(end, [this, why = end.error](StreamEnd moved, bool started) {
    ++attempt_;  // that id may be known on the workers now
    if (started) return OnStreamEnd(std::move(moved));
    if (Cancelled()) return Finish();
    std::fprintf(stderr, "tandem router: request %s: KV handoff failed (%s); recomputing\n",
                 original_.request_id.c_str(), std::string(moved.error.message()).c_str());
    RetryAfterPause(why);
  });
}

void Flight::RetryAfterPause(const absl::Status& why) {
  (AnyGenerated() ? env_.counters->migrations : env_.counters->prefill_retries).fetch_add(1);
  SetState(FlightState::kMigrating);
  // Give the poller a moment to see which workers are left before trying again.
  Pause(absl::Milliseconds(20 * retries_), [this, self = shared_from_this(), why] {
    std::fprintf(stderr, "tandem router: request %s goes on elsewhere: %s\n",
                 original_.request_id.c_str(), std::string(why.message()).c_str());
    if (Cancelled()) return Finish();
    ContinueElsewhere();
  });
}

// Sets up the next attempt: the whole request again when nothing was streamed, else the first
// unfinished sample on its own, its tokens appended to the prompt and what is left of its budget.
void Flight::ContinueElsewhere() {
  // The next attempt gets a fresh id on the workers (the old one may still be known there).
  current_ = original_;
  current_.request_id = absl::StrCat(original_.request_id, "~", ++attempt_);
  if (!AnyGenerated()) return Attempt();
  for (;;) {
    int index = 0;
    while (sample_[index].done) ++index;
    Sample& sample = sample_[index];
    const int used = static_cast<int>(sample.generated.size());
    if (used >= original_.params.max_tokens) {
      // Its last token arrived but not its finish: it ended by length.
      sample.done = true;
      output_.choices.clear();
      engine::ChoiceDelta& delta = output_.choices.emplace_back();
      delta.index = index;
      delta.finish_reason = engine::FinishReason::kLength;
      output_.finished = AllDone();
      Deliver(output_, absl::OkStatus());
      if (output_.finished) return Finish();
      continue;
    }
    samples_ = {index};
    current_.prompt_tokens.insert(current_.prompt_tokens.end(), sample.generated.begin(),
                                  sample.generated.end());
    current_.params.n = 1;
    current_.params.max_tokens = original_.params.max_tokens - used;
    current_.params.min_tokens = std::max(0, original_.params.min_tokens - used);
    // A constrained sample's grammar resumes after the tokens now in the prompt.
    if (current_.params.structured.active()) {
      current_.params.structured.replay_prompt_tokens =
          original_.params.structured.replay_prompt_tokens + used;
    }
    // Text the old worker held back (a partial character, a possible stop string) is carried
    // into the first text of the continuation.
    const std::string full =
        env_.detokenize(sample.generated, original_.params.skip_special_tokens);
    if (full.size() > sample.delivered.size() &&
        full.compare(0, sample.delivered.size(), sample.delivered) == 0) {
      sample.carried = full.substr(sample.delivered.size());
    }
    return Attempt();
  }
}


struct Flight::HandoffJob {
  StreamEnd parked;
  GenerateRequest r;                // base_ with the hand-off's id and the moved samples' n
  std::vector<int> samples;         // the request's samples to move (by its own index)
  std::vector<tandem::v1::KvHandoff::Sample> wire;  // what the worker parked of each
  std::shared_ptr<Reserved> target;
  int64_t bytes = 0;
  std::function<void(StreamEnd, bool)> then;
};

// Moves the samples a draining decode worker parked (parked.handoff) to another decode worker
// and continues them there: Reserve for their KV tokens (not on the draining worker), Handoff
// on the draining worker into that reservation, then Start with base_'s prompt and sampling and
// a continuation per sample carrying the tokens it generated, relaying the new stream.
// `started` is false when a step before the stream failed (the reservation is then released,
// the parked blocks are cancelled on the draining worker, the caller recomputes).
void Flight::HandOff(const StreamEnd& parked, std::function<void(StreamEnd, bool)> then) {
  SetState(FlightState::kHandingOff);
  auto job = std::make_shared<HandoffJob>();
  job->parked = parked;
  job->then = std::move(then);
  auto fail = [this, job](absl::Status why) { AbandonHandoff(job, std::move(why)); };
  const tandem::v1::KvHandoff& handoff = *parked.handoff;
  for (const tandem::v1::KvHandoff::Sample& s : handoff.samples()) {
    if (s.index() < 0 || s.index() >= static_cast<int>(samples_.size())) {
      return fail(absl::InternalError(absl::StrCat("handoff of unknown sample ", s.index())));
    }
    const int index = samples_[s.index()];
    const Sample& sample = sample_[index];
    if (sample.done) continue;
    // The client must have every token the worker generated, in order: they end its stream.
    const int g = s.generated_token_ids_size();
    if (g > static_cast<int>(sample.generated.size()) ||
        !std::equal(s.generated_token_ids().begin(), s.generated_token_ids().end(),
                    sample.generated.end() - g)) {
      return fail(absl::InternalError("the parked tokens differ from those streamed"));
    }
    if (s.num_kv_tokens() <= 0) return fail(absl::UnavailableError("a sample has no KV"));
    // One reservation holds samples of one length (samples that decoded together).
    if (!job->wire.empty() && s.num_kv_tokens() != job->wire.front().num_kv_tokens()) {
      return fail(absl::UnavailableError("parked samples hold different KV lengths"));
    }
    job->samples.push_back(index);
    job->wire.push_back(s);
  }
  int unfinished = 0;
  for (int index : samples_) unfinished += sample_[index].done ? 0 : 1;
  if (job->samples.empty() || static_cast<int>(job->samples.size()) != unfinished) {
    return fail(absl::UnavailableError("not every unfinished sample was parked"));
  }
  const int kv_tokens = job->wire.front().num_kv_tokens();
  job->r = base_;
  job->r.request_id = absl::StrCat(original_.request_id, "~", attempt_ + 1);
  job->r.params.n = static_cast<int>(job->samples.size());
  const int prompt_len = static_cast<int>(job->r.prompt_tokens.size());

  // 1. Room for the KV on another decode worker, quickly: the parked KV expires soon.
  const absl::Time expires = absl::FromUnixMillis(handoff.expires_unix_ms());
  Reserve(job->r, kv_tokens, prompt_len + job->r.params.max_tokens - kv_tokens,
          parked.worker.get(),
          std::clamp(expires - absl::Now() - absl::Milliseconds(500), absl::ZeroDuration(),
                     absl::Seconds(1)),
          [this, self = shared_from_this(), job, fail](absl::StatusOr<Reserved> reserved) {
            if (!reserved.ok()) return fail(reserved.status());
            job->target = std::make_shared<Reserved>(std::move(reserved).value());
            HandoffSample(job, 0);
          });
}

// Frees what is still parked on the draining worker at once instead of at its expiry (best
// effort), then reports the hand-off as not started.
void Flight::AbandonHandoff(std::shared_ptr<HandoffJob> job, absl::Status why) {
  CancelOn(*job->parked.worker, job->parked.worker_request_id, "router: KV handoff abandoned",
           absl::Seconds(2), [job, why = std::move(why)] {
             StreamEnd end;
             end.error = why;
             job->then(std::move(end), false);
           });
}

// 2. The draining worker pushes sample i's KV into its slice of the reservation; 3. once all
// are there, Start on the target. Not cancelled by Abort: the reservation may only be released
// once no transfer writes into it.
void Flight::HandoffSample(std::shared_ptr<HandoffJob> job, size_t i) {
  auto fail = [this, job](absl::Status why) { AbandonHandoff(job, std::move(why)); };
  const int k = static_cast<int>(job->samples.size());
  if (i < job->samples.size()) {
    using Call = std::tuple<std::shared_ptr<grpc::ClientContext>, tandem::v1::HandoffRequest,
                            tandem::v1::HandoffResponse>;
    auto call = std::make_shared<Call>(std::make_shared<grpc::ClientContext>(),
                                       tandem::v1::HandoffRequest(), tandem::v1::HandoffResponse());
    auto& [context, request, response] = *call;
    context->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(15)));
    request.set_request_id(job->parked.worker_request_id);
    request.set_index(job->wire[i].index());
    *request.mutable_reservation() = job->target->reservation;
    request.set_target_index(static_cast<int>(i));
    job->parked.worker->decode->async()->Handoff(
        context.get(), &request, &response,
        [this, self = shared_from_this(), job, i, call, fail](grpc::Status status) {
          auto step = Step();
          if (!status.ok() || Cancelled()) {
            absl::Status why = status.ok() ? absl::CancelledError("request aborted")
                                           : proto::FromGrpcStatus(status);
            return Release(*job->target, /*pending=*/true, [fail, why] { fail(why); });
          }
          job->bytes += std::get<2>(*call).kv_transfer_bytes();
          HandoffSample(job, i + 1);
        });
    return;
  }
  // 3. Continue on the target: the same prompt, the generated tokens as the continuation.
  tandem::v1::StartRequest start;
  start.set_request_id(job->r.request_id);
  start.set_reservation_id(job->target->reservation.reservation_id());
  start.mutable_prompt_token_ids()->Add(job->r.prompt_tokens.begin(), job->r.prompt_tokens.end());
  *start.mutable_sampling() = proto::ToProto(job->r.params);
  start.set_cache_salt(job->r.cache_salt);
  for (int j = 0; j < k; ++j) {
    tandem::v1::PrefilledChoice* choice = start.add_choices();
    choice->set_index(j);
    choice->set_sampler_state(job->wire[j].sampler_state());
    *choice->mutable_generated_token_ids() = job->wire[j].generated_token_ids();
  }
  std::vector<int> previous = samples_;
  samples_ = job->samples;
  Relay(*job->target, std::move(start),
        [this, job, fail, k, previous = std::move(previous)](StreamEnd end) {
          if (!end.any_event && !end.finished && !Cancelled()) {
            // Start refused it, or its worker went away, before anything streamed: the
            // reservation may still be there (Relay already took it off the pending load).
            samples_ = previous;
            return Release(*job->target, /*pending=*/false, [fail, why = end.error] { fail(why); });
          }
          env_.counters->kv_handoffs.fetch_add(k);
          env_.counters->kv_handoff_bytes.fetch_add(job->bytes);
          job->then(std::move(end), true);
        });
}

}  // namespace tandem::router
