#include "flight_test_workers.h"

#include <chrono>

#include "tandem/base/tsan.h"

namespace tandem::router::fakes {

void Published(const void* object) { TsanRelease(object); }

void Reached(const void* object) { TsanAcquire(object); }

namespace {

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Answers a unary call at once (outside any lock of the fake's).
grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, grpc::Status status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(std::move(status));
  return reactor;
}

grpc::Status Gone() { return grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker gone"); }

}  // namespace

void FakeDecode::AnswerHeldReserve() {
  std::function<void()> answer;
  {
    auto lock = Lock();
    answer = std::move(held_reserve);
    held_reserve = nullptr;
  }
  if (answer) answer();
}

void FakeWorker::WaitFor(const std::function<bool()>& ready) {
  std::unique_lock<std::mutex> lock(mu);
  changed.wait(lock, ready);
}

grpc::ServerUnaryReactor* FakeWorker::CountAndAnswer(grpc::CallbackServerContext* context,
                                                     int& counter) {
  {
    auto lock = Lock();
    ++counter;
  }
  Changed();
  return Answer(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* FakeDecode::Reserve(grpc::CallbackServerContext* context,
                                              const tandem::v1::ReserveRequest* request,
                                              tandem::v1::ReserveResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  grpc::Status status;
  bool hold = false;
  {
    auto lock = Lock();
    ++reserves;
    if (gone) {
      status = Gone();
    } else if (reserve_code != grpc::StatusCode::OK) {
      status = grpc::Status(reserve_code, "scripted refusal (no room)");
    } else {
      tandem::v1::KvReservation& r = *response->mutable_reservation();
      r.set_reservation_id("res-" + std::to_string(++next_reservation_));
      const int per_choice = (request->num_prompt_tokens() + 15) / 16;
      const int n = std::max(1, request->n());
      for (int i = 0; i < per_choice * n; ++i) r.add_block_ids(i);
      r.set_blocks_per_choice(per_choice);
      r.set_expires_unix_ms(NowMs() + 60000);
      live.insert(r.reservation_id());
      if (hold_reserve) {
        hold = true;
        held_reserve = [reactor] { reactor->Finish(grpc::Status::OK); };
      }
    }
  }
  Changed();
  if (!hold) reactor->Finish(status);
  return reactor;
}

grpc::ServerUnaryReactor* FakeDecode::Release(grpc::CallbackServerContext* context,
                                              const tandem::v1::ReleaseRequest* request,
                                              tandem::v1::ReleaseResponse* response) {
  {
    auto lock = Lock();
    ++releases;
    response->set_released(live.erase(request->reservation_id()) > 0);
  }
  Changed();
  return Answer(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* FakeDecode::Cancel(grpc::CallbackServerContext* context,
                                             const tandem::v1::CancelRequest* request,
                                             tandem::v1::CancelResponse* response) {
  return CountAndAnswer(context, cancels);
}

grpc::ServerUnaryReactor* FakeDecode::Stats(grpc::CallbackServerContext* context,
                                            const tandem::v1::StatsRequest* request,
                                            tandem::v1::WorkerStats* response) {
  auto lock = Lock();
  if (gone) return Answer(context, Gone());
  response->set_role(tandem::v1::WORKER_ROLE_DECODE);
  response->set_kv_blocks_total(total_blocks);
  response->set_kv_blocks_used(reserve_code == grpc::StatusCode::OK ? 0 : total_blocks);
  return Answer(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* FakeDecode::Handoff(grpc::CallbackServerContext* context,
                                              const tandem::v1::HandoffRequest* request,
                                              tandem::v1::HandoffResponse* response) {
  response->set_num_kv_tokens(1);
  response->set_kv_transfer_bytes(4096);
  return CountAndAnswer(context, handoffs);
}

// Streams the request's tokens one event each, then ends as the worker's mode says.
class FakeDecode::StartReactor : public grpc::ServerWriteReactor<tandem::v1::TokenEvent> {
 public:
  StartReactor(FakeDecode* worker, const tandem::v1::StartRequest& request)
      : worker_(worker), request_(request) {
    const int generated =
        request.choices_size() > 0 ? request.choices(0).generated_token_ids_size() : 0;
    // A continuation's prompt holds the tokens generated before it moved.
    first_position_ = request.prompt_token_ids_size() - kPromptLen + generated;
    to_send_ = request.sampling().max_tokens() - generated;
    {
      auto lock = worker_->Lock();
      mode_ = worker_->mode;
      after_ = worker_->after;
      if (worker_->gone) {
        Finish(Gone());
        return;
      }
      if (worker_->live.count(request.reservation_id()) == 0) {
        Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown reservation"));
        return;
      }
    }
    Published(this);  // before the first write: OnCancel may run on another thread from then
    Next();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return FinishOnce(grpc::Status::CANCELLED);
    if (ending_) return FinishOnce(grpc::Status::OK);
    Next();
  }

  void OnCancel() override {
    Reached(this);
    {
      auto lock = worker_->Lock();
      ++worker_->stream_cancelled;
    }
    worker_->Changed();
    std::lock_guard<std::mutex> lock(mu_);
    context_cancelled_ = true;
    if (holding_) FinishLocked(grpc::Status::CANCELLED);
  }

  void OnDone() override { delete this; }

 private:
  void Next() {
    event_.Clear();
    event_.set_request_id(request_.request_id());
    const bool stop_here = mode_ != StreamMode::kFinish && sent_ == after_;
    if (!stop_here && sent_ < to_send_) {
      const int token = 100 + first_position_ + sent_;
      event_.add_token_ids(token);
      event_.set_text(TokenText(token));
      ++sent_;
      if (sent_ == to_send_) {
        event_.set_finish_reason(tandem::v1::FINISH_REASON_LENGTH);
        event_.mutable_usage()->set_completion_tokens(sent_);
        ending_ = true;
      }
      StartWrite(&event_);
      return;
    }
    switch (mode_) {
      case StreamMode::kDie: {
        auto lock = worker_->Lock();
        worker_->gone = true;
        break;
      }
      case StreamMode::kDrain: {
        event_.mutable_error()->set_code(grpc::StatusCode::UNAVAILABLE);
        event_.mutable_error()->set_message("draining");
        tandem::v1::KvHandoff& handoff = *event_.mutable_handoff();
        tandem::v1::KvHandoff::Sample& s = *handoff.add_samples();
        s.set_index(0);
        const int generated =
            request_.choices_size() > 0 ? request_.choices(0).generated_token_ids_size() : 0;
        for (int i = 0; i < generated; ++i) {
          s.add_generated_token_ids(request_.choices(0).generated_token_ids(i));
        }
        for (int i = 0; i < sent_; ++i) s.add_generated_token_ids(100 + first_position_ + i);
        s.set_num_kv_tokens(request_.prompt_token_ids_size() + s.generated_token_ids_size() - 1);
        handoff.set_expires_unix_ms(NowMs() + 30000);
        ending_ = true;
        StartWrite(&event_);
        return;
      }
      case StreamMode::kHold: {
        std::lock_guard<std::mutex> lock(mu_);
        holding_ = true;
        // Cancelled before it got here: OnCancel found nothing held.
        if (context_cancelled_) FinishLocked(grpc::Status::CANCELLED);
        return;
      }
      case StreamMode::kFinish:
        break;
    }
    FinishOnce(mode_ == StreamMode::kDie ? Gone() : grpc::Status::OK);
  }

  void FinishOnce(grpc::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    FinishLocked(std::move(status));
  }
  // The reservation is used up when the stream ends (before the router can hear of it).
  void FinishLocked(grpc::Status status) {
    if (finished_) return;
    finished_ = true;
    {
      auto lock = worker_->Lock();
      worker_->live.erase(request_.reservation_id());
    }
    worker_->Changed();
    Finish(std::move(status));
  }

  FakeDecode* worker_;
  tandem::v1::StartRequest request_;
  tandem::v1::TokenEvent event_;
  StreamMode mode_ = StreamMode::kFinish;
  int after_ = 0;
  int first_position_ = 0;
  int to_send_ = 0;
  int sent_ = 0;
  bool ending_ = false;
  std::mutex mu_;
  bool holding_ = false;            // guarded by mu_
  bool finished_ = false;           // guarded by mu_
  bool context_cancelled_ = false;  // guarded by mu_
};

grpc::ServerWriteReactor<tandem::v1::TokenEvent>* FakeDecode::Start(
    grpc::CallbackServerContext* context, const tandem::v1::StartRequest* request) {
  {
    auto lock = Lock();
    ++starts;
    started.push_back(*request);
  }
  Changed();
  return new StartReactor(this, *request);
}

// A Submit held until the router cancels it.
class HeldSubmit : public grpc::ServerUnaryReactor {
 public:
  explicit HeldSubmit(FakePrefill* worker) : worker_(worker) { Published(this); }
  void OnCancel() override {
    Reached(this);
    {
      auto lock = worker_->Lock();
      --worker_->held;
    }
    worker_->Changed();
    Finish(grpc::Status::CANCELLED);
  }
  void OnDone() override { delete this; }

 private:
  FakePrefill* worker_;
};

grpc::ServerUnaryReactor* FakePrefill::Submit(grpc::CallbackServerContext* context,
                                              const tandem::v1::SubmitRequest* request,
                                              tandem::v1::SubmitResponse* response) {
  bool hold = false;
  grpc::StatusCode code = grpc::StatusCode::OK;
  {
    auto lock = Lock();
    ++submits;
    prompt_lengths.push_back(request->prompt_token_ids_size());
    submitted.push_back(*request);
    hold = hold_submit;
    code = submit_code;
    if (hold) ++held;
  }
  Changed();
  if (hold) return new HeldSubmit(this);
  if (code != grpc::StatusCode::OK) {
    return Answer(context, grpc::Status(code, "the fake prefill worker refuses it"));
  }
  if (request->task() == tandem::v1::TASK_EMBED) {
    for (float x :
         EmbeddingOf({request->prompt_token_ids().begin(), request->prompt_token_ids().end()})) {
      response->add_embedding(x);
    }
    response->set_num_prompt_tokens(request->prompt_token_ids_size());
    return Answer(context, grpc::Status::OK);
  }
  const int n = std::max(1, request->sampling().n());
  for (int i = 0; i < n; ++i) response->add_choices()->set_index(i);
  response->set_num_prompt_tokens(request->prompt_token_ids_size());
  return Answer(context, grpc::Status::OK);
}

grpc::ServerUnaryReactor* FakePrefill::Cancel(grpc::CallbackServerContext* context,
                                              const tandem::v1::CancelRequest* request,
                                              tandem::v1::CancelResponse* response) {
  return CountAndAnswer(context, cancels);
}

grpc::ServerUnaryReactor* FakePrefill::Stats(grpc::CallbackServerContext* context,
                                             const tandem::v1::StatsRequest* request,
                                             tandem::v1::WorkerStats* response) {
  response->set_role(tandem::v1::WORKER_ROLE_PREFILL);
  return Answer(context, grpc::Status::OK);
}

FakeServer::FakeServer(grpc::Service* service, FakeWorker* worker) : worker_(worker) {
  Published(worker);  // what the test scripted, and the worker's lock, before any call
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service);
  server_ = builder.BuildAndStart();
  address_ = "127.0.0.1:" + std::to_string(port);
}

FakeServer::~FakeServer() {
  server_->Shutdown();  // returns once every call's reactions are done
  Reached(worker_);
}

}  // namespace tandem::router::fakes
