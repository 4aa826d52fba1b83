#include "token_stream.h"

#include <utility>

#include "tandem/base/tsan.h"
#include "tandem/proto/status.h"
#include "tandem/worker/grpc_call.h"

namespace tandem::decode_worker {
namespace {

// An event after which nothing of its sample may be appended to it.
bool Closes(const tandem::v1::TokenEvent& event) {
  return event.finish_reason() != tandem::v1::FINISH_REASON_NONE || event.has_usage() ||
         event.has_error() || event.has_handoff();
}

// Appends `next` (a later event of the same sample) to `into`.
void Merge(tandem::v1::TokenEvent& into, tandem::v1::TokenEvent& next) {
  into.mutable_token_ids()->MergeFrom(next.token_ids());
  into.mutable_text()->append(next.text());
  into.mutable_logprobs()->MergeFrom(next.logprobs());
  into.mutable_top_logprobs()->MergeFrom(next.top_logprobs());
  into.set_finish_reason(next.finish_reason());
}

}  // namespace

void QueueEvent(std::deque<tandem::v1::TokenEvent>& queue, tandem::v1::TokenEvent event) {
  if (!event.has_usage() && !event.has_error() && !event.has_handoff()) {
    for (auto it = queue.rbegin(); it != queue.rend(); ++it) {
      if (it->index() != event.index()) continue;
      if (Closes(*it)) break;
      Merge(*it, event);
      return;
    }
  }
  queue.push_back(std::move(event));
}

std::shared_ptr<TokenStream> TokenStream::Create(AbandonedFn on_abandoned) {
  std::shared_ptr<TokenStream> stream(new TokenStream());
  stream->on_abandoned_ = std::move(on_abandoned);
  stream->reactor_ = new Reactor(stream);
  return stream;
}

grpc::ServerWriteReactor<tandem::v1::TokenEvent>* TokenStream::reactor() { return reactor_; }

void TokenStream::Push(std::vector<tandem::v1::TokenEvent> events, bool last) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finished_ || last_) return;
  for (tandem::v1::TokenEvent& event : events) QueueEvent(queue_, std::move(event));
  last_ = last;
  Pump(std::move(lock));
}

void TokenStream::Fail(const absl::Status& status) {
  std::unique_lock<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  on_abandoned_ = nullptr;
  lock.unlock();
  TsanRelease(reactor_);
  reactor_->Finish(proto::ToGrpcStatus(status));
}

int64_t TokenStream::writes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return writes_;
}

void TokenStream::Pump(std::unique_lock<std::mutex> lock) {
  if (writing_ || finished_) return;
  if (!queue_.empty()) {
    in_flight_ = std::move(queue_.front());
    queue_.pop_front();
    writing_ = true;
    ++writes_;
    lock.unlock();
    TsanRelease(reactor_);
    reactor_->StartWrite(&in_flight_);  // nothing else touches in_flight_ until OnWriteDone
    return;
  }
  if (!last_) return;
  finished_ = true;
  on_abandoned_ = nullptr;
  lock.unlock();
  TsanRelease(reactor_);
  reactor_->Finish(grpc::Status::OK);
}

void TokenStream::Abandon(std::unique_lock<std::mutex> lock) {
  AbandonedFn on_abandoned;
  on_abandoned.swap(on_abandoned_);
  cancelled_ = true;
  const bool finish = !finished_ && !writing_;
  if (finish) finished_ = true;
  lock.unlock();
  if (on_abandoned) on_abandoned(this);
  if (finish) {
    TsanRelease(reactor_);
    reactor_->Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled"));
  }
}

void TokenStream::OnWriteDone(bool ok) {
  std::unique_lock<std::mutex> lock(mu_);
  writing_ = false;
  // The client stopped reading or went away (a write then in flight ends the call here).
  if (!ok || cancelled_) return Abandon(std::move(lock));
  Pump(std::move(lock));
}

bool TokenStream::abandoned() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cancelled_;
}

void TokenStream::OnCancel() { Abandon(std::unique_lock<std::mutex>(mu_)); }

}  // namespace tandem::decode_worker
