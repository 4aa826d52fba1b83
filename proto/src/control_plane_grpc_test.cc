// A real gRPC round trip over loopback TCP: a test-only DecodeWorker serves Stats, Handshake and
// Start, and a client calls it through a channel, as the router and prefill workers will.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tandem/proto/kv_layout_check.h"
#include "tandem/proto/wire.h"
#include "tandem/v1/decode.grpc.pb.h"

namespace tandem::proto {
namespace {

using ::google::protobuf::util::MessageDifferencer;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

tandem::v1::KvLayout DecodeLayout() {
  tandem::v1::KvLayout layout;
  layout.set_dtype(tandem::v1::KV_DTYPE_BF16);
  layout.set_block_size(16);
  layout.set_num_layers(32);
  layout.set_num_kv_heads(8);
  layout.set_head_dim(128);
  layout.set_tp_size(1);
  layout.set_tp_rank(0);
  layout.set_total_kv_heads(8);
  layout.set_layout_name("layer[2][blocks][block_size][kv_heads][head_dim]");
  return layout;
}

// Serves fixed stats, checks handshakes against DecodeLayout(), and answers Start by streaming
// the prefilled first token of each choice, then one more token and the finish.
class FakeDecodeWorker final : public tandem::v1::DecodeWorker::Service {
 public:
  grpc::Status Stats(grpc::ServerContext*, const tandem::v1::StatsRequest*,
                     tandem::v1::WorkerStats* stats) override {
    stats->set_role(tandem::v1::WORKER_ROLE_DECODE);
    stats->set_worker_id("decode-0");
    stats->set_running(3);
    stats->set_waiting(1);
    stats->set_kv_blocks_used(100);
    stats->set_kv_blocks_total(4096);
    stats->set_kv_blocks_reserved(12);
    return grpc::Status::OK;
  }

  grpc::Status Handshake(grpc::ServerContext*, const tandem::v1::HandshakeRequest* request,
                         tandem::v1::HandshakeResponse* response) override {
    absl::Status compatible = CheckLayoutCompatible(request->layout(), DecodeLayout());
    if (!compatible.ok()) return ToGrpcStatus(compatible);
    response->set_worker_id("decode-0");
    *response->mutable_layout() = DecodeLayout();
    return grpc::Status::OK;
  }

  grpc::Status Start(grpc::ServerContext*, const tandem::v1::StartRequest* request,
                     grpc::ServerWriter<tandem::v1::TokenEvent>* writer) override {
    if (request->reservation_id() != "res-1") {
      return ToGrpcStatus(absl::NotFoundError("unknown reservation"));
    }
    const engine::SamplingParams params = FromProto(request->sampling());
    for (const tandem::v1::PrefilledChoice& choice : request->choices()) {
      tandem::v1::TokenEvent event;
      event.set_request_id(request->request_id());
      event.set_index(choice.index());
      event.add_token_ids(choice.first_token().token_id());
      event.add_token_ids(params.max_tokens);  // proves the sampling params arrived
      event.set_finish_reason(tandem::v1::FINISH_REASON_LENGTH);
      if (choice.index() == request->choices_size() - 1) {
        event.mutable_usage()->set_prompt_tokens(request->prompt_token_ids_size());
        event.mutable_usage()->set_completion_tokens(2 * request->choices_size());
      }
      if (!writer->Write(event)) return grpc::Status(grpc::StatusCode::CANCELLED, "router gone");
    }
    return grpc::Status::OK;
  }
};

class ControlPlaneGrpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0) << "no port was bound";
    stub_ = tandem::v1::DecodeWorker::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  // Every call has a deadline, as in production: a hung server fails the test, not CI.
  static void SetDeadline(grpc::ClientContext* context) {
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  }

  FakeDecodeWorker service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<tandem::v1::DecodeWorker::Stub> stub_;
};

TEST_F(ControlPlaneGrpcTest, StatsArriveOverTheChannel) {
  grpc::ClientContext context;
  SetDeadline(&context);
  tandem::v1::WorkerStats stats;
  grpc::Status status = stub_->Stats(&context, tandem::v1::StatsRequest{}, &stats);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(stats.role(), tandem::v1::WORKER_ROLE_DECODE);
  EXPECT_EQ(stats.worker_id(), "decode-0");
  EXPECT_EQ(stats.running(), 3);
  EXPECT_EQ(stats.waiting(), 1);
  EXPECT_EQ(stats.kv_blocks_total() - stats.kv_blocks_used(), 3996);
  EXPECT_EQ(stats.kv_blocks_reserved(), 12);
}

TEST_F(ControlPlaneGrpcTest, HandshakeWithMatchingLayoutReturnsTheWorkersLayout) {
  grpc::ClientContext context;
  SetDeadline(&context);
  tandem::v1::HandshakeRequest request;
  request.set_worker_id("prefill-0");
  *request.mutable_layout() = DecodeLayout();
  tandem::v1::HandshakeResponse response;
  grpc::Status status = stub_->Handshake(&context, request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.worker_id(), "decode-0");
  EXPECT_TRUE(MessageDifferencer::Equals(response.layout(), DecodeLayout()));
}

TEST_F(ControlPlaneGrpcTest, HandshakeWithMismatchedLayoutIsFailedPreconditionNamingFields) {
  grpc::ClientContext context;
  SetDeadline(&context);
  tandem::v1::HandshakeRequest request;
  request.set_worker_id("prefill-0");
  *request.mutable_layout() = DecodeLayout();
  request.mutable_layout()->set_head_dim(64);
  request.mutable_layout()->set_dtype(tandem::v1::KV_DTYPE_F32);
  tandem::v1::HandshakeResponse response;
  grpc::Status status = stub_->Handshake(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(),
              AllOf(HasSubstr("head_dim 64 vs 128"), HasSubstr("dtype F32 vs BF16")));
  EXPECT_EQ(FromGrpcStatus(status).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(response.has_layout());
}

TEST_F(ControlPlaneGrpcTest, HandshakeWithoutLayoutIsInvalidArgument) {
  grpc::ClientContext context;
  SetDeadline(&context);
  tandem::v1::HandshakeRequest request;  // an old or broken peer that states no layout
  tandem::v1::HandshakeResponse response;
  grpc::Status status = stub_->Handshake(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("dtype UNSPECIFIED"));
}

TEST_F(ControlPlaneGrpcTest, StartStreamsTokenEventsInOrderWithUsageLast) {
  grpc::ClientContext context;
  SetDeadline(&context);
  tandem::v1::StartRequest request;
  request.set_request_id("req-9");
  request.set_reservation_id("res-1");
  for (int t : {1, 2, 3, 4, 5}) request.add_prompt_token_ids(t);
  engine::SamplingParams params;
  params.max_tokens = 2;
  params.n = 2;
  *request.mutable_sampling() = ToProto(params);
  for (int i = 0; i < 2; ++i) {
    tandem::v1::PrefilledChoice* choice = request.add_choices();
    choice->set_index(i);
    choice->mutable_first_token()->set_token_id(100 + i);
  }
  std::unique_ptr<grpc::ClientReader<tandem::v1::TokenEvent>> reader =
      stub_->Start(&context, request);
  std::vector<tandem::v1::TokenEvent> events;
  tandem::v1::TokenEvent event;
  while (reader->Read(&event)) events.push_back(event);
  grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].request_id(), "req-9");
  EXPECT_EQ(events[0].index(), 0);
  EXPECT_THAT(events[0].token_ids(), ElementsAre(100, 2));
  EXPECT_FALSE(events[0].has_usage());
  EXPECT_EQ(events[1].index(), 1);
  EXPECT_THAT(events[1].token_ids(), ElementsAre(101, 2));
  EXPECT_EQ(events[1].finish_reason(), tandem::v1::FINISH_REASON_LENGTH);
  ASSERT_TRUE(events[1].has_usage());
  EXPECT_EQ(events[1].usage().prompt_tokens(), 5);
  EXPECT_EQ(events[1].usage().completion_tokens(), 4);
}

TEST_F(ControlPlaneGrpcTest, StartOfUnknownReservationEndsTheCallWithNotFound) {
  grpc::ClientContext context;
  SetDeadline(&context);
  tandem::v1::StartRequest request;
  request.set_reservation_id("res-expired");
  auto reader = stub_->Start(&context, request);
  tandem::v1::TokenEvent event;
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ControlPlaneGrpcTest, UnimplementedMethodFailsLoudly) {
  // A worker that does not serve Reserve must refuse, not hand out an empty reservation.
  grpc::ClientContext context;
  SetDeadline(&context);
  tandem::v1::ReserveResponse response;
  grpc::Status status = stub_->Reserve(&context, tandem::v1::ReserveRequest{}, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

}  // namespace
}  // namespace tandem::proto
