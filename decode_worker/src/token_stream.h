// The server side of one Start call on gRPC's callback API: the engine loop pushes a request's
// TokenEvents and the stream writes them, with no thread waiting on the call. At most one write
// is in flight; events pushed meanwhile queue, and one that only adds tokens to a sample whose
// previous event is still queued is merged into it, so a slow reader gets fewer, larger events
// instead of an ever longer queue. The client cancelling the call, or no longer reading,
// abandons the stream: `on_abandoned` runs once so the request can end.
//
//   auto stream = TokenStream::Create(
//       [=](const TokenStream* s) { loop.Post([=] { AbandonStream(id, s); }); });
//   loop.Post([=] { ...; stream->Push(events, /*last=*/finished); });  // engine loop
//   return stream->reactor();                                          // to gRPC
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "tandem/v1/decode.pb.h"
#include "tandem/worker/grpc_call.h"

namespace tandem::decode_worker {

// Queues `event` behind `queue`, merged into the last queued event of its sample when that one
// is still open (no finish reason, usage, error or handoff) and `event` carries no usage,
// error or handoff: its tokens, text and logprobs are appended and its finish reason taken.
// Events of other samples keep their own entries; a request's last event (usage) stays last.
void QueueEvent(std::deque<tandem::v1::TokenEvent>& queue, tandem::v1::TokenEvent event);

class TokenStream : public std::enable_shared_from_this<TokenStream> {
 public:
  // `on_abandoned` runs on a gRPC thread, at most once, when the call ends before its last
  // event was written; it is given the stream (to tell it from a later one of the same id).
  using AbandonedFn = std::function<void(const TokenStream*)>;
  static std::shared_ptr<TokenStream> Create(AbandonedFn on_abandoned);

  // The reactor to return from the Start handler (gRPC owns it; it keeps the stream alive).
  grpc::ServerWriteReactor<tandem::v1::TokenEvent>* reactor();

  // Queues `events` (merging where it can); with `last` the call ends with OK once they are
  // written. Does nothing once the call is over. Any thread.
  void Push(std::vector<tandem::v1::TokenEvent> events, bool last);
  // Ends the call with `status` instead of events (Start refused). Any thread.
  void Fail(const absl::Status& status);

  // Events written so far (one per write). Any thread.
  int64_t writes() const;
  // True once the client has gone away (set before `on_abandoned` runs). Any thread.
  bool abandoned() const;

 private:
  using Reactor = worker::StreamWriteReactor<tandem::v1::TokenEvent, TokenStream>;
  friend Reactor;
  TokenStream() = default;
  // Starts the next write, or ends the call after the last one. Called with `lock` held on mu_;
  // releases it.
  void Pump(std::unique_lock<std::mutex> lock);
  // Ends the call as abandoned by the client. Called with `lock` held; releases it.
  void Abandon(std::unique_lock<std::mutex> lock);
  void OnWriteDone(bool ok);
  void OnCancel();

  Reactor* reactor_ = nullptr;  // gRPC's; valid until finished_
  mutable std::mutex mu_;
  std::deque<tandem::v1::TokenEvent> queue_;  // guarded by mu_
  tandem::v1::TokenEvent in_flight_;          // guarded by mu_ while !writing_
  bool writing_ = false;                      // guarded by mu_
  bool last_ = false;                         // guarded by mu_: the last event is queued
  bool finished_ = false;                     // guarded by mu_: Finish was called
  bool cancelled_ = false;                    // guarded by mu_: abandoned by the client
  int64_t writes_ = 0;                        // guarded by mu_
  AbandonedFn on_abandoned_;                  // guarded by mu_; emptied when run
};

}  // namespace tandem::decode_worker
