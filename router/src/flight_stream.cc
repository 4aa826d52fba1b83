// A flight's streaming state: Start on the decode worker through a ClientReadReactor, each
// TokenEvent turned into the client's output as it arrives on gRPC's thread.
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "flight.h"
#include "tandem/proto/wire.h"

namespace tandem::router {

// Reads one Start stream; deletes itself when the call is done.
class Flight::StartStream : public grpc::ClientReadReactor<tandem::v1::TokenEvent> {
 public:
  StartStream(std::shared_ptr<Flight> flight, Reserved reserved,
              std::shared_ptr<grpc::ClientContext> context,
              std::function<void(StreamEnd)> then)
      : flight_(std::move(flight)),
        reserved_(std::move(reserved)),
        context_(std::move(context)),
        then_(std::move(then)) {}

  void Go(tandem::v1::StartRequest start) {
    start_ = std::move(start);
    end_.worker = reserved_.worker;
    end_.worker_request_id = start_.request_id();
    reserved_.worker->decode->async()->Start(context_.get(), &start_, this);
    StartRead(&event_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended: OnDone follows
    auto step = flight_->Step();
    if (!stopped_) {
      end_.any_event = true;
      if (!flight_->OnEvent(event_, end_, aborted_)) {
        // Read on to the stream's end, ignoring the rest; a worker that would go on is stopped.
        stopped_ = true;
        if (!end_.error.ok() && !end_.handoff) context_->TryCancel();
      }
    }
    StartRead(&event_);
  }

  void OnDone(const grpc::Status& status) override {
    std::shared_ptr<Flight> flight = flight_;
    auto step = flight->Step();
    flight_->EndCall();
    const bool unseen = !end_.any_event && flight->Cancelled();
    StreamEnd end = flight_->OnStreamDone(std::move(end_), aborted_, status, *reserved_.worker);
    std::function<void(StreamEnd)> then = std::move(then_);
    Reserved reserved = std::move(reserved_);
    delete this;
    if (unseen) {
      // Cancelled before any event: the worker may never have seen the Start (a call cancelled
      // early does not reach its handler), and then its reservation would hold the blocks until
      // it expired. Release does nothing to a reservation that was started.
      return flight->Release(
          reserved, /*pending=*/false,
          [then = std::move(then), end = std::move(end)]() mutable { then(std::move(end)); });
    }
    then(std::move(end));
  }

 private:
  std::shared_ptr<Flight> flight_;
  Reserved reserved_;
  std::shared_ptr<grpc::ClientContext> context_;
  std::function<void(StreamEnd)> then_;
  tandem::v1::StartRequest start_;
  tandem::v1::TokenEvent event_;
  StreamEnd end_;
  // Samples the worker ended with ABORT: held until the stream's end says why (a draining
  // worker's error means they go on elsewhere, not that they ended).
  std::vector<int> aborted_;
  bool stopped_ = false;
};

void Flight::Relay(const Reserved& reserved, tandem::v1::StartRequest start,
                   std::function<void(StreamEnd)> then) {
  auto context = std::make_shared<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + env_.options.stream_timeout));
  if (!BeginCall(context)) {
    return Release(reserved, /*pending=*/true, [then = std::move(then)] { then(StreamEnd{}); });
  }
  SetState(FlightState::kStreaming);
  auto* stream = new StartStream(shared_from_this(), reserved, std::move(context), std::move(then));
  // The worker's own stats count the blocks from now on.
  env_.pool->AddPending(*reserved.worker, -reserved.reservation.block_ids_size(), -1);
  stream->Go(std::move(start));
}

bool Flight::OnEvent(const tandem::v1::TokenEvent& event, StreamEnd& end,
                     std::vector<int>& aborted) {
  output_.choices.clear();
  if (event.has_error() && event.error().code() != 0) {
    end.error = proto::FromProto(event.error());
    if (event.has_handoff()) end.handoff = event.handoff();
    return false;
  }
  // The attempt's sample i is the request's sample samples_[i].
  if (event.index() < 0 || event.index() >= static_cast<int>(samples_.size())) {
    end.error = absl::InternalError(absl::StrCat("the decode worker sent sample ", event.index(),
                                                 " of ", samples_.size()));
    return false;
  }
  const int index = samples_[event.index()];
  Sample& sample = sample_[index];
  engine::ChoiceDelta delta;
  delta.index = index;
  delta.token_ids.assign(event.token_ids().begin(), event.token_ids().end());
  delta.text = std::move(sample.carried) + event.text();
  sample.carried.clear();
  delta.logprobs.assign(event.logprobs().begin(), event.logprobs().end());
  for (const tandem::v1::TopLogprobs& top : event.top_logprobs()) {
    std::vector<engine::TokenLogprob>& entries = delta.top_logprobs.emplace_back();
    for (const tandem::v1::TokenLogprob& t : top.entries()) {
      entries.push_back({t.token_id(), t.logprob()});
    }
  }
  delta.finish_reason = proto::FromProto(event.finish_reason());
  if (delta.finish_reason == engine::FinishReason::kAbort) {
    aborted.push_back(index);
    delta.finish_reason = engine::FinishReason::kNone;
    if (delta.token_ids.empty() && delta.text.empty() && !event.has_usage()) return true;
  }
  output_.num_generation_tokens += static_cast<int>(delta.token_ids.size());
  sample.generated.insert(sample.generated.end(), delta.token_ids.begin(), delta.token_ids.end());
  sample.delivered += delta.text;
  if (delta.finish_reason != engine::FinishReason::kNone) sample.done = true;
  output_.choices.push_back(std::move(delta));
  // The attempt's last event carries the usage; the stream then ends. The request is finished
  // when every one of its samples is (an attempt may run only some of them).
  if (event.has_usage()) end.finished = true;
  output_.finished = AllDone();
  Deliver(output_, absl::OkStatus());
  return true;
}

Flight::StreamEnd Flight::OnStreamDone(StreamEnd end, const std::vector<int>& aborted,
                                       const grpc::Status& status, const WorkerHandle& decode) {
  output_.choices.clear();
  if (end.finished && end.error.ok() && !aborted.empty() && !Cancelled()) {
    // The worker ended them itself (a Cancel from elsewhere): they end with ABORT.
    for (int index : aborted) {
      if (sample_[index].done) continue;
      sample_[index].done = true;
      engine::ChoiceDelta& delta = output_.choices.emplace_back();
      delta.index = index;
      delta.finish_reason = engine::FinishReason::kAbort;
    }
    output_.finished = AllDone();
    if (!output_.choices.empty()) Deliver(output_, absl::OkStatus());
    output_.choices.clear();
  }
  if (end.finished || Cancelled()) {
    end.error = absl::OkStatus();
    end.handoff.reset();
    return end;
  }
  if (end.error.ok()) {
    end.error = proto::FromGrpcStatus(status);
    // A stream that ends without its last event means the worker went away.
    if (end.error.ok() || absl::IsCancelled(end.error)) {
      end.error =
          absl::UnavailableError(absl::StrCat("the stream ended early (", end.error.message(), ")"));
    }
  }
  if (end.error.code() == absl::StatusCode::kUnavailable) env_.pool->MarkDown(decode);
  end.error = absl::Status(end.error.code(),
                           absl::StrCat("decode worker ", decode.address, ": ", end.error.message()));
  return end;
}

}  // namespace tandem::router
