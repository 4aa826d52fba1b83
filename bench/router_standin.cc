// A decode and prefill worker stand-in for router benchmarks (bench/router_streams.py): one
// tandem.v1 server on gRPC's callback API that reserves without limit, prefills at once and
// streams each request's tokens on a fixed schedule, token i of a stream at start + i x interval.
// Each event's text is " s<scheduled>w<written> " (CLOCK_REALTIME microseconds): when the token
// was due and when this process handed it to gRPC, so a client on the same machine can tell the
// router's added latency from the stand-in's own lateness. Not a worker: no model, no KV.
//
//   tandem_bench_router_standin --port 7100 --interval-ms 100
#include <grpcpp/alarm.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tandem/v1/decode.grpc.pb.h"
#include "tandem/v1/prefill.grpc.pb.h"

namespace {

using Clock = std::chrono::system_clock;

int64_t Micros(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

std::chrono::milliseconds g_interval{100};
std::atomic<int64_t> g_reservations{0};

grpc::ServerUnaryReactor* Ok(grpc::CallbackServerContext* context) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

// One Start stream: an alarm per token, a write per alarm.
class Stream : public grpc::ServerWriteReactor<tandem::v1::TokenEvent> {
 public:
  Stream(const tandem::v1::StartRequest& request)
      : request_id_(request.request_id()),
        tokens_(std::max(1, request.sampling().max_tokens())),
        start_(Clock::now()) {
    Schedule();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return Finish(grpc::Status::CANCELLED);
    if (++sent_ == tokens_) return Finish(grpc::Status::OK);
    Schedule();
  }
  void OnCancel() override { alarm_.Cancel(); }
  void OnDone() override { delete this; }

 private:
  void Schedule() {
    const Clock::time_point due = start_ + g_interval * sent_;
    alarm_.Set(due, [this, due](bool ok) {
      if (!ok) return Finish(grpc::Status::CANCELLED);
      event_.Clear();
      event_.set_request_id(request_id_);
      event_.add_token_ids(10 + sent_ % 50);
      char text[64];
      std::snprintf(text, sizeof(text), " s%lldw%lld ", static_cast<long long>(Micros(due)),
                    static_cast<long long>(Micros(Clock::now())));
      event_.set_text(text);
      if (sent_ + 1 == tokens_) {
        event_.set_finish_reason(tandem::v1::FINISH_REASON_LENGTH);
        event_.mutable_usage()->set_completion_tokens(tokens_);
      }
      StartWrite(&event_);
    });
  }

  std::string request_id_;
  int tokens_;
  int sent_ = 0;
  Clock::time_point start_;
  grpc::Alarm alarm_;
  tandem::v1::TokenEvent event_;
};

class Decode final : public tandem::v1::DecodeWorker::CallbackService {
  grpc::ServerUnaryReactor* Reserve(grpc::CallbackServerContext* context,
                                    const tandem::v1::ReserveRequest* request,
                                    tandem::v1::ReserveResponse* response) override {
    tandem::v1::KvReservation& r = *response->mutable_reservation();
    r.set_reservation_id("r" + std::to_string(++g_reservations));
    r.add_block_ids(0);
    r.set_blocks_per_choice(1);
    r.set_expires_unix_ms(Micros(Clock::now()) / 1000 + 60000);
    return Ok(context);
  }
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* context,
                                    const tandem::v1::ReleaseRequest*,
                                    tandem::v1::ReleaseResponse*) override {
    return Ok(context);
  }
  grpc::ServerWriteReactor<tandem::v1::TokenEvent>* Start(
      grpc::CallbackServerContext*, const tandem::v1::StartRequest* request) override {
    return new Stream(*request);
  }
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* context,
                                   const tandem::v1::CancelRequest*,
                                   tandem::v1::CancelResponse*) override {
    return Ok(context);
  }
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* context,
                                  const tandem::v1::StatsRequest*,
                                  tandem::v1::WorkerStats* response) override {
    response->set_role(tandem::v1::WORKER_ROLE_DECODE);
    response->set_kv_blocks_total(1 << 30);
    return Ok(context);
  }
};

class Prefill final : public tandem::v1::PrefillWorker::CallbackService {
  grpc::ServerUnaryReactor* Submit(grpc::CallbackServerContext* context,
                                   const tandem::v1::SubmitRequest* request,
                                   tandem::v1::SubmitResponse* response) override {
    for (int i = 0; i < std::max(1, request->sampling().n()); ++i) {
      response->add_choices()->set_index(i);
    }
    response->set_num_prompt_tokens(request->prompt_token_ids_size());
    return Ok(context);
  }
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* context,
                                   const tandem::v1::CancelRequest*,
                                   tandem::v1::CancelResponse*) override {
    return Ok(context);
  }
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* context,
                                  const tandem::v1::StatsRequest*,
                                  tandem::v1::WorkerStats* response) override {
    response->set_role(tandem::v1::WORKER_ROLE_PREFILL);
    return Ok(context);
  }
};

}  // namespace

int main(int argc, char** argv) {
  int port = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--port") == 0) {
      port = std::atoi(argv[i + 1]);
    } else if (std::strcmp(argv[i], "--interval-ms") == 0) {
      g_interval = std::chrono::milliseconds(std::atoi(argv[i + 1]));
    } else {
      std::fprintf(stderr, "usage: %s --port PORT [--interval-ms MS]\n", argv[0]);
      return 2;
    }
  }
  if (argc % 2 == 0 || g_interval.count() <= 0) {
    std::fprintf(stderr, "usage: %s --port PORT [--interval-ms MS]\n", argv[0]);
    return 2;
  }
  Decode decode;
  Prefill prefill;
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort("127.0.0.1:" + std::to_string(port), grpc::InsecureServerCredentials(),
                           &bound);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, 1 << 20);
  builder.RegisterService(&decode);
  builder.RegisterService(&prefill);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound == 0) {
    std::fprintf(stderr, "tandem_bench_router_standin: cannot listen on port %d\n", port);
    return 1;
  }
  std::printf("standin listening on 127.0.0.1:%d, a token every %lld ms\n", bound,
              static_cast<long long>(g_interval.count()));
  std::fflush(stdout);
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  int signal = 0;
  sigwait(&signals, &signal);
  server->Shutdown(Clock::now() + std::chrono::seconds(1));
  return 0;
}
