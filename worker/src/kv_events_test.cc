#include "tandem/worker/kv_events.h"

#include <chrono>
#include <memory>
#include <numeric>
#include <set>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tandem/engine/block_manager.h"
#include "tandem/proto/tls.h"
#include "tandem/v1/prefill.grpc.pb.h"
#include "tandem/worker/engine_loop.h"

namespace tandem::worker {
namespace {

// A service answering only KvEvents, from a hub over a bare block manager and its loop.
class EventsService final : public tandem::v1::PrefillWorker::CallbackService {
 public:
  EventsService(KvEventHub* hub, EngineLoop* loop) : hub_(hub), loop_(loop) {}
  grpc::ServerWriteReactor<tandem::v1::KvEventBatch>* KvEvents(
      grpc::CallbackServerContext*, const tandem::v1::KvEventsRequest*) override {
    return hub_->Subscribe(*loop_);
  }

 private:
  KvEventHub* hub_;
  EngineLoop* loop_;
};

class KvEventsTest : public ::testing::Test {
 protected:
  static constexpr int kBlockSize = 4;

  // The loop publishes after every iteration, as WorkerCore's does.
  std::unique_ptr<EngineLoop> MakeLoop() {
    EngineLoop::Options options;
    options.iterate = [this] {
      hub_.Publish();
      return absl::InfiniteDuration();
    };
    return std::make_unique<EngineLoop>(std::move(options));
  }

  void SetUp() override {
    loop_->Start();
    auto started = proto::StartGrpcServer("127.0.0.1:0", &service_, {});
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = std::move(started->server);
    stub_ = tandem::v1::PrefillWorker::NewStub(
        grpc::CreateChannel(started->address, grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    hub_.Close();
    if (server_) server_->Shutdown();
    loop_->Stop();
  }

  // On the loop: caches `n` full blocks of fresh tokens (n stored events) and frees them.
  std::vector<uint64_t> CacheBlocks(int n, int32_t first_token) {
    return loop_->Call<std::vector<uint64_t>>(
        [&] {
          std::vector<int32_t> tokens(n * kBlockSize);
          std::iota(tokens.begin(), tokens.end(), first_token);
          std::vector<uint64_t> hashes;
          engine::ExtendBlockHashes(engine::PrefixRoot(""), tokens, kBlockSize, hashes);
          engine::BlockTable table;
          EXPECT_TRUE(blocks_.Append(table, 0, n * kBlockSize).ok());
          blocks_.CacheFullBlocks(table, hashes);
          blocks_.Free(table);
          return hashes;
        },
        {});
  }

  engine::BlockManager blocks_{64, kBlockSize, /*enable_prefix_caching=*/true};
  KvEventHub hub_{blocks_, /*max_pending=*/8};
  std::unique_ptr<EngineLoop> loop_ = MakeLoop();
  EventsService service_{&hub_, loop_.get()};
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<tandem::v1::PrefillWorker::Stub> stub_;
};

std::set<uint64_t> Stored(const tandem::v1::KvEventBatch& batch) {
  return {batch.stored().begin(), batch.stored().end()};
}

// A subscriber that falls more than max_pending changes behind is cut off with
// RESOURCE_EXHAUSTED; subscribing again starts from a snapshot that holds everything.
TEST_F(KvEventsTest, ASubscriberTooFarBehindIsCutOffAndResyncsFromASnapshot) {
  // Deadlines only bound a broken build (a stream that never ends fails, not hangs).
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(60);
  grpc::ClientContext context;
  context.set_deadline(deadline);
  auto reader = stub_->KvEvents(&context, tandem::v1::KvEventsRequest());
  tandem::v1::KvEventBatch batch;
  ASSERT_TRUE(reader->Read(&batch));
  EXPECT_TRUE(batch.reset());
  EXPECT_EQ(batch.block_size(), kBlockSize);
  EXPECT_EQ(batch.stored_size(), 0);

  // Within the bound: the changes arrive.
  const std::vector<uint64_t> few = CacheBlocks(3, 1);
  std::set<uint64_t> seen;
  while (seen.size() < few.size() && reader->Read(&batch)) {
    EXPECT_FALSE(batch.reset());
    const std::set<uint64_t> stored = Stored(batch);
    seen.insert(stored.begin(), stored.end());
  }
  EXPECT_EQ(seen, std::set<uint64_t>(few.begin(), few.end()));

  // 9 changes at once, over the bound of 8: the stream ends.
  const std::vector<uint64_t> many = CacheBlocks(9, 1000);
  while (reader->Read(&batch)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);

  grpc::ClientContext again_context;
  again_context.set_deadline(deadline);
  auto again = stub_->KvEvents(&again_context, tandem::v1::KvEventsRequest());
  ASSERT_TRUE(again->Read(&batch));
  EXPECT_TRUE(batch.reset());
  std::set<uint64_t> want(few.begin(), few.end());
  want.insert(many.begin(), many.end());
  EXPECT_EQ(Stored(batch), want);
  again_context.TryCancel();
  while (again->Read(&batch)) {
  }
  again->Finish();
}

}  // namespace
}  // namespace tandem::worker
