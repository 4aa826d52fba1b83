// Test doubles of a decode and a prefill worker: in-process tandem.v1 servers on gRPC's callback
// API whose behaviour each test scripts, and which count what the router asked of them. Tokens
// follow one rule on every worker, so a request that moves keeps one sequence: the token at
// generation position p is 100 + p, its text "<100+p>" (the prompt is kPromptLen tokens; a
// continuation's prompt carries the tokens generated so far). An embedding (TASK_EMBED) is the
// prompt's tokens divided by 10, one float each (EmbeddingOf).
#pragma once

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "tandem/v1/decode.grpc.pb.h"
#include "tandem/v1/prefill.grpc.pb.h"

namespace tandem::router::fakes {

inline constexpr int kPromptLen = 4;

inline std::string TokenText(int token) { return "<" + std::to_string(token) + ">"; }

inline std::vector<float> EmbeddingOf(const std::vector<int32_t>& prompt) {
  std::vector<float> out;
  for (int32_t t : prompt) out.push_back(static_cast<float>(t) / 10);
  return out;
}

// How a decode worker's Start stream ends.
enum class StreamMode {
  kFinish,  // streams every token the request has left, then its usage
  kDie,     // streams `after` tokens, then the call fails UNAVAILABLE and the worker is gone
  kDrain,   // streams `after` tokens, then parks the request for KV hand-off (error + handoff)
  kHold,    // streams `after` tokens, then waits until the call is cancelled
};

// Debian's libgrpc is not built with ThreadSanitizer, so the order in which it runs a fake's
// handlers and reactions (each after the server started, one reaction after another) is
// invisible to it. These state that order where the fakes rely on it: Published by the thread
// that hands an object to gRPC, Reached by a handler or reaction before it touches the object.
// Nothing in other builds.
void Published(const void* object);
void Reached(const void* object);

// What both fakes share: their lock, a condition to wait on, and counting a call.
class FakeWorker {
 public:
  std::mutex mu;
  std::condition_variable changed;
  int cancels = 0;

  // mu, held by a handler or reaction on a gRPC thread: reached before it locks, published
  // after it unlocks, so that the test's teardown after the server's Shutdown (which waits for
  // every reaction) is ordered after it too (see Published).
  class Locked {
   public:
    explicit Locked(FakeWorker* worker) : worker_(worker) {
      Reached(worker_);
      worker_->mu.lock();
    }
    ~Locked() {
      worker_->mu.unlock();
      Published(worker_);
    }
    Locked(const Locked&) = delete;
    Locked& operator=(const Locked&) = delete;

   private:
    FakeWorker* worker_;
  };
  Locked Lock() { return Locked(this); }

  // Wakes WaitFor, from a gRPC thread (published like Locked).
  void Changed() {
    changed.notify_all();
    Published(this);
  }

  // Waits until `ready` (checked under mu) holds.
  void WaitFor(const std::function<bool()>& ready);

 protected:
  // Adds one to `counter` (a member, under mu) and answers OK.
  grpc::ServerUnaryReactor* CountAndAnswer(grpc::CallbackServerContext* context, int& counter);
};

class FakeDecode final : public tandem::v1::DecodeWorker::CallbackService, public FakeWorker {
 public:
  // Scripting (set before the request starts, or under mu).
  int total_blocks = 1000;
  grpc::StatusCode reserve_code = grpc::StatusCode::OK;
  bool hold_reserve = false;  // Reserve answers only at AnswerHeldReserve()
  StreamMode mode = StreamMode::kFinish;
  int after = 0;

  // What the router did; read under mu.
  std::set<std::string> live;  // reservations neither released, nor started and ended
  int reserves = 0;
  int releases = 0;
  int starts = 0;
  int handoffs = 0;
  int stream_cancelled = 0;  // Start calls the router cancelled
  bool gone = false;         // answers nothing but UNAVAILABLE
  std::vector<tandem::v1::StartRequest> started;
  std::function<void()> held_reserve;  // set while a Reserve is held

  void AnswerHeldReserve();

  grpc::ServerUnaryReactor* Reserve(grpc::CallbackServerContext* context,
                                    const tandem::v1::ReserveRequest* request,
                                    tandem::v1::ReserveResponse* response) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* context,
                                    const tandem::v1::ReleaseRequest* request,
                                    tandem::v1::ReleaseResponse* response) override;
  grpc::ServerWriteReactor<tandem::v1::TokenEvent>* Start(
      grpc::CallbackServerContext* context, const tandem::v1::StartRequest* request) override;
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* context,
                                   const tandem::v1::CancelRequest* request,
                                   tandem::v1::CancelResponse* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* context,
                                  const tandem::v1::StatsRequest* request,
                                  tandem::v1::WorkerStats* response) override;
  grpc::ServerUnaryReactor* Handoff(grpc::CallbackServerContext* context,
                                    const tandem::v1::HandoffRequest* request,
                                    tandem::v1::HandoffResponse* response) override;

 private:
  class StartReactor;
  int next_reservation_ = 0;
};

class FakePrefill final : public tandem::v1::PrefillWorker::CallbackService, public FakeWorker {
 public:
  bool hold_submit = false;  // Submit answers only when cancelled
  grpc::StatusCode submit_code = grpc::StatusCode::OK;  // how Submit answers

  int submits = 0;
  int held = 0;  // Submits being held now
  std::vector<int> prompt_lengths;
  std::vector<tandem::v1::SubmitRequest> submitted;

  grpc::ServerUnaryReactor* Submit(grpc::CallbackServerContext* context,
                                   const tandem::v1::SubmitRequest* request,
                                   tandem::v1::SubmitResponse* response) override;
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* context,
                                   const tandem::v1::CancelRequest* request,
                                   tandem::v1::CancelResponse* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* context,
                                  const tandem::v1::StatsRequest* request,
                                  tandem::v1::WorkerStats* response) override;
};

// An in-process server for one service on 127.0.0.1 (a free port).
class FakeServer {
 public:
  // `worker` is a FakeDecode or a FakePrefill, scripted before this.
  template <typename Worker>
  explicit FakeServer(Worker* worker)
      : FakeServer(static_cast<grpc::Service*>(worker), static_cast<FakeWorker*>(worker)) {}
  ~FakeServer();
  const std::string& address() const { return address_; }

 private:
  FakeServer(grpc::Service* service, FakeWorker* worker);

  FakeWorker* worker_;

  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

}  // namespace tandem::router::fakes
