#include "tandem/worker/grpc_call.h"

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/proto/tls.h"
#include "tandem/v1/prefill.grpc.pb.h"

namespace tandem::worker {
namespace {

TEST(GrpcCallTest, WireTimesConvertBothWays) {
  EXPECT_EQ(FromUnixMillisOrInfinite(0), absl::InfiniteFuture());
  EXPECT_EQ(FromUnixMillisOrInfinite(-5), absl::InfiniteFuture());
  EXPECT_EQ(FromUnixMillisOrInfinite(1'700'000'000'123), absl::FromUnixMillis(1'700'000'000'123));
  EXPECT_EQ(ToUnixMillisOrZero(absl::InfiniteFuture()), 0);
  EXPECT_EQ(ToUnixMillisOrZero(absl::FromUnixMillis(1'700'000'000'123)), 1'700'000'000'123);
}

TEST(GrpcCallTest, AnswerConvertsTheStatus) {
  tandem::v1::WorkerStats stats;
  tandem::v1::WorkerStats value;
  value.set_worker_id("w");
  EXPECT_TRUE(Answer(absl::StatusOr<tandem::v1::WorkerStats>(value), &stats).ok());
  EXPECT_EQ(stats.worker_id(), "w");
  grpc::Status refused =
      Answer(absl::StatusOr<tandem::v1::WorkerStats>(absl::ResourceExhaustedError("full")), &stats);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(refused.error_message(), "full");
}

// A service on the callback API whose calls are answered by an engine loop, as the workers'.
class LoopService final : public tandem::v1::PrefillWorker::CallbackService {
 public:
  explicit LoopService(EngineLoop* loop) : loop_(loop) {}

  // Answered on the loop, saying whether it ran there.
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext*, const tandem::v1::StatsRequest*,
                                  tandem::v1::WorkerStats* response) override {
    auto* call = new UnaryCall<tandem::v1::WorkerStats>(response);
    AnswerOnLoop<tandem::v1::WorkerStats>(
        *loop_, call,
        [this]() -> absl::StatusOr<tandem::v1::WorkerStats> {
          tandem::v1::WorkerStats stats;
          stats.set_worker_id(loop_->on_loop_thread() ? "on-loop" : "elsewhere");
          return stats;
        },
        absl::UnavailableError("stopped"));
    return call;
  }
  // Refused on the loop.
  grpc::ServerUnaryReactor* Handshake(grpc::CallbackServerContext*,
                                      const tandem::v1::HandshakeRequest*,
                                      tandem::v1::HandshakeResponse* response) override {
    auto* call = new UnaryCall<tandem::v1::HandshakeResponse>(response);
    AnswerOnLoop<tandem::v1::HandshakeResponse>(
        *loop_, call,
        []() -> absl::StatusOr<tandem::v1::HandshakeResponse> {
          return absl::FailedPreconditionError("layouts differ");
        },
        absl::UnavailableError("stopped"));
    return call;
  }
  // Reports the deadline the server sees (in kv_transfer_bytes: unix ms, 0 for none) at once.
  grpc::ServerUnaryReactor* Submit(grpc::CallbackServerContext* context,
                                   const tandem::v1::SubmitRequest*,
                                   tandem::v1::SubmitResponse* response) override {
    tandem::v1::SubmitResponse out;
    out.set_kv_transfer_bytes(ToUnixMillisOrZero(CallDeadline(*context)));
    return AnswerNow(response, absl::StatusOr<tandem::v1::SubmitResponse>(out));
  }
  // Left unanswered until the client cancels it; then the loop answers it.
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext*, const tandem::v1::CancelRequest*,
                                   tandem::v1::CancelResponse* response) override {
    auto* call = new UnaryCall<tandem::v1::CancelResponse>(response);
    call->OnCancelled([this, call] {
      cancelled_.set_value();
      loop_->Post([call] { call->Answer(absl::CancelledError("client went away")); });
    });
    received_.set_value();
    return call;
  }

  std::promise<void> received_;
  std::promise<void> cancelled_;

 private:
  EngineLoop* loop_;
};

class GrpcCallServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    loop_ = std::make_unique<EngineLoop>(EngineLoop::Options{});
    loop_->Start();
    service_ = std::make_unique<LoopService>(loop_.get());
    auto started = proto::StartGrpcServer("127.0.0.1:0", service_.get(), proto::TlsFiles{});
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = std::move(started->server);
    stub_ = tandem::v1::PrefillWorker::NewStub(
        grpc::CreateChannel(started->address, grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_.reset();
    loop_->Stop();
  }

  static std::unique_ptr<grpc::ClientContext> Context() {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return context;
  }

  std::unique_ptr<EngineLoop> loop_;
  std::unique_ptr<LoopService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<tandem::v1::PrefillWorker::Stub> stub_;
};

TEST_F(GrpcCallServerTest, CallsAreAnsweredOnTheLoopWithTheirStatus) {
  tandem::v1::WorkerStats stats;
  grpc::Status ok = stub_->Stats(Context().get(), tandem::v1::StatsRequest(), &stats);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(stats.worker_id(), "on-loop");

  tandem::v1::HandshakeResponse handshake;
  grpc::Status refused =
      stub_->Handshake(Context().get(), tandem::v1::HandshakeRequest(), &handshake);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(refused.error_message(), "layouts differ");

  // Once the loop has finished, calls get the stopped answer instead of waiting forever.
  loop_->Stop();
  grpc::Status stopped = stub_->Stats(Context().get(), tandem::v1::StatsRequest(), &stats);
  EXPECT_EQ(stopped.error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(GrpcCallServerTest, TheServerSeesTheClientsDeadlineOrNone) {
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(45);
  grpc::ClientContext with;
  with.set_deadline(deadline);
  tandem::v1::SubmitResponse response;
  ASSERT_TRUE(stub_->Submit(&with, tandem::v1::SubmitRequest(), &response).ok());
  // The wire carries the deadline as a timeout, so the server's copy is close, not equal.
  EXPECT_NEAR(static_cast<double>(response.kv_transfer_bytes()),
              static_cast<double>(absl::ToUnixMillis(absl::FromChrono(deadline))), 5000);

  grpc::ClientContext without;
  ASSERT_TRUE(stub_->Submit(&without, tandem::v1::SubmitRequest(), &response).ok());
  EXPECT_EQ(response.kv_transfer_bytes(), 0);
}

TEST_F(GrpcCallServerTest, AClientCancellingAPendingCallRunsItsCancelHandler) {
  grpc::ClientContext context;
  grpc::Status status;
  {
    std::jthread client([&] {
      tandem::v1::CancelResponse response;
      status = stub_->Cancel(&context, tandem::v1::CancelRequest(), &response);
    });
    service_->received_.get_future().wait();
    context.TryCancel();
    EXPECT_EQ(service_->cancelled_.get_future().wait_for(std::chrono::seconds(30)),
              std::future_status::ready);
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
}

}  // namespace
}  // namespace tandem::worker
