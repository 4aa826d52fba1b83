// How the workers' gRPC services meet Tandem's types: absl::Status results, absl::Time
// deadlines, and unary calls on gRPC's callback API answered later by the engine loop, so that
// no gRPC thread waits for an engine.
//
//   grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext*, const StatsRequest*,
//                                   WorkerStats* response) {
//     return AnswerNow(response, worker->Stats());
//   }
//   grpc::ServerUnaryReactor* Submit(grpc::CallbackServerContext* context,
//                                    const SubmitRequest* request, SubmitResponse* response) {
//     auto* call = new UnaryCall<SubmitResponse>(response);
//     call->OnCancelled([id = request->request_id()] { /* post a cancel to the loop */ });
//     loop->Post([call] { call->Answer(RunIt()); });  // or call->Answer(error) at once
//     return call;
//   }
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "tandem/base/tsan.h"
#include "tandem/proto/status.h"
#include "tandem/v1/worker.pb.h"
#include "tandem/worker/engine_loop.h"

namespace tandem::worker {

// ThreadSanitizer cannot see how libgrpc (not TSan-built) orders a reactor's operation (Finish,
// StartWrite) before the reaction it causes (OnWriteDone, OnDone) on another thread: the
// reactors below state the edge themselves (tandem/base/tsan.h), released before each operation,
// acquired at each reaction.

// A wire timestamp in unix milliseconds as absl::Time; 0 or less (unset) is InfiniteFuture.
absl::Time FromUnixMillisOrInfinite(int64_t ms);
// The wire form of `time` (unix milliseconds); InfiniteFuture becomes 0 (unset).
int64_t ToUnixMillisOrZero(absl::Time time);
// The deadline the client set on the call; InfiniteFuture when none.
absl::Time CallDeadline(const grpc::ServerContextBase& context);

// A synchronous handler's answer: the value moved into `*response`, or the status converted.
template <typename T>
grpc::Status Answer(absl::StatusOr<T> result, T* response) {
  if (!result.ok()) return proto::ToGrpcStatus(result.status());
  *response = std::move(result).value();
  return grpc::Status::OK;
}

// A unary call on the callback API, answered once from any thread. gRPC owns it (it deletes
// itself when the call is done); after Answer() nothing may touch it.
template <typename Response>
class UnaryCall final : public grpc::ServerUnaryReactor {
 public:
  // `response` is gRPC's response message of the call.
  explicit UnaryCall(Response* response) : response_(response) {}

  // Sends the value, or the error converted to a gRPC status. Exactly once.
  void Answer(absl::StatusOr<Response> result) {
    if (!result.ok()) {
      TsanRelease(this);
      Finish(proto::ToGrpcStatus(result.status()));
      return;
    }
    *response_ = std::move(result).value();
    TsanRelease(this);
    Finish(grpc::Status::OK);
  }

  // Runs `fn` once (on a gRPC thread, or here if that already happened) when the client
  // cancels the call or its deadline passes before it is answered. `fn` must not touch this
  // object: capture what identifies the work instead.
  void OnCancelled(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!cancelled_) {
        on_cancel_ = std::move(fn);
        return;
      }
    }
    fn();
  }

 private:
  void OnCancel() override {
    TsanAcquire(this);
    std::function<void()> fn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      fn.swap(on_cancel_);
    }
    if (fn) fn();
    TsanRelease(this);  // OnDone runs after this returns (ordered inside libgrpc)
  }
  void OnDone() override {
    TsanAcquire(this);
    delete this;
  }

  Response* response_;  // gRPC's
  std::mutex mu_;
  bool cancelled_ = false;           // guarded by mu_
  std::function<void()> on_cancel_;  // guarded by mu_
};

// A callback-API handler's answer given at once: returns the reactor to hand back to gRPC.
template <typename Response>
grpc::ServerUnaryReactor* AnswerNow(Response* response, absl::StatusOr<Response> result) {
  auto* call = new UnaryCall<Response>(response);
  call->Answer(std::move(result));
  return call;
}

// A callback-API handler answered later: `start` is given the call and sees that it is answered
// once (now, or from the engine loop). Returns the reactor to hand back to gRPC.
template <typename Response, typename Start>
grpc::ServerUnaryReactor* AnswerLater(Response* response, Start&& start) {
  auto* call = new UnaryCall<Response>(response);
  std::forward<Start>(start)(call);
  return call;
}

// Runs `fn` on the engine loop and answers `call` with its result there, or with `if_stopped`
// at once when the loop has finished. No gRPC thread waits meanwhile.
// A server stream's reactor that hands gRPC's reactions to the object holding the stream's state
// (`Stream::OnWriteDone(bool)` and `Stream::OnCancel()`, which may be private to a stream that
// befriends this class) and keeps that object alive until gRPC is done with the call. gRPC runs
// OnDone only after every other reaction has returned; the released edges at the end of each
// reaction state that ordering (made inside libgrpc) to ThreadSanitizer.
template <typename Message, typename Stream>
class StreamWriteReactor final : public grpc::ServerWriteReactor<Message> {
 public:
  explicit StreamWriteReactor(std::shared_ptr<Stream> stream) : stream_(std::move(stream)) {}

 private:
  void OnWriteDone(bool ok) override {
    TsanAcquire(this);
    stream_->OnWriteDone(ok);
    TsanRelease(this);
  }
  void OnCancel() override {
    TsanAcquire(this);
    stream_->OnCancel();
    TsanRelease(this);
  }
  void OnDone() override {
    TsanAcquire(this);
    delete this;
  }

  std::shared_ptr<Stream> stream_;
};

template <typename Response>
void AnswerOnLoop(EngineLoop& loop, UnaryCall<Response>* call,
                  std::function<absl::StatusOr<Response>()> fn, absl::Status if_stopped) {
  if (!loop.Post([call, fn = std::move(fn)] { call->Answer(fn()); })) {
    call->Answer(std::move(if_stopped));
  }
}

// The methods every worker service answers alike: Stats from the worker's Stats(), Handshake
// from its Handshake(request), both at once, and KvEvents from its KvEvents() (a stream).
// `Base` is the role's generated service on the callback API; the role's service derives from
// this and adds its protocol.
template <typename Base, typename Worker>
class WithStatsAndHandshake : public Base {
 public:
  explicit WithStatsAndHandshake(Worker* worker) : worker_(worker) {}

  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext*, const tandem::v1::StatsRequest*,
                                  tandem::v1::WorkerStats* response) override {
    return AnswerNow(response, absl::StatusOr<tandem::v1::WorkerStats>(worker_->Stats()));
  }
  grpc::ServerUnaryReactor* Handshake(grpc::CallbackServerContext*,
                                      const tandem::v1::HandshakeRequest* request,
                                      tandem::v1::HandshakeResponse* response) override {
    return AnswerNow(response, worker_->Handshake(*request));
  }
  grpc::ServerWriteReactor<tandem::v1::KvEventBatch>* KvEvents(
      grpc::CallbackServerContext*, const tandem::v1::KvEventsRequest*) override {
    return worker_->KvEvents();
  }

 protected:
  Worker* worker_;  // outlives the service
};

}  // namespace tandem::worker
