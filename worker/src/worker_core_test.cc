#include "tandem/worker/worker_core.h"

#include <chrono>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tandem/v1/prefill.grpc.pb.h"
#include "tandem/worker/grpc_call.h"
#include "test_models.h"

namespace tandem::worker {
namespace {

WorkerOptions TinyOptions() {
  WorkerOptions options;
  options.engine.model_dir = testing::TinyModel("qwen3", DType::kBF16);
  options.engine.num_threads = 1;
  options.engine.kv_cache_bytes = 1 << 20;
  options.kv_backend = "local";
  return options;
}

// Answers Stats at once with whether the core still accepts work.
class StatsService final : public tandem::v1::PrefillWorker::CallbackService {
 public:
  explicit StatsService(const WorkerCore* core) : core_(core) {}
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext*, const tandem::v1::StatsRequest*,
                                  tandem::v1::WorkerStats* response) override {
    tandem::v1::WorkerStats stats;
    stats.set_draining(!core_->accepting());
    return AnswerNow(response, absl::StatusOr<tandem::v1::WorkerStats>(stats));
  }

 private:
  const WorkerCore* core_;
};

grpc::Status CallStats(const std::string& address, tandem::v1::WorkerStats* stats) {
  auto stub = tandem::v1::PrefillWorker::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return stub->Stats(&context, tandem::v1::StatsRequest(), stats);
}

TEST(WorkerCoreTest, CreatesTheEngineInItsRoleAndNamesTheWorker) {
  auto core = WorkerCore::Create(TinyOptions(), engine::EngineRole::kDecode);
  ASSERT_TRUE(core.ok()) << core.status();
  EXPECT_EQ((*core)->options().engine.role, engine::EngineRole::kDecode);
  EXPECT_THAT((*core)->options().worker_id, ::testing::StartsWith("decode-"));
  EXPECT_EQ((*core)->kv().Describe().num_blocks(), (*core)->engine().cache_layout().num_blocks);
  EXPECT_TRUE((*core)->accepting());
}

TEST(WorkerCoreTest, ShutdownRefusesWorkThenWindsDownWhileTheLoopAndServerStillRun) {
  WorkerOptions options = TinyOptions();
  options.worker_id = "w";
  auto created = WorkerCore::Create(options, engine::EngineRole::kPrefill);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<WorkerCore> core = std::move(created).value();
  StatsService service(core.get());
  int finished = 0;  // loop thread, then read after Shutdown joined it
  EngineLoop::Options loop;
  loop.finish = [&] { ++finished; };
  ASSERT_TRUE(core->Serve(std::move(loop), &service, [] { return std::string(); }).ok());
  const std::string address = core->grpc_address();
  tandem::v1::WorkerStats stats;
  ASSERT_TRUE(CallStats(address, &stats).ok());
  EXPECT_FALSE(stats.draining());

  int wind_downs = 0;
  core->Shutdown([&] {
    ++wind_downs;
    // 1. New work is refused already; 2. the loop and the server still answer.
    EXPECT_FALSE(core->accepting());
    EXPECT_EQ(core->loop().Call<int>([] { return 7; }, -1), 7);
    tandem::v1::WorkerStats during;
    EXPECT_TRUE(CallStats(address, &during).ok());
    EXPECT_TRUE(during.draining());
    EXPECT_EQ(finished, 0);
  });
  EXPECT_EQ(wind_downs, 1);
  // 3. The loop has drained and finished; 4. the server is gone.
  EXPECT_EQ(finished, 1);
  EXPECT_EQ(core->loop().Call<int>([] { return 7; }, -1), -1);
  EXPECT_FALSE(CallStats(address, &stats).ok());
  core->Shutdown([&] { ++wind_downs; });  // once only
  EXPECT_EQ(wind_downs, 1);
}

TEST(WorkerCoreTest, BadOptionsFailWithoutHanging) {
  WorkerOptions options = TinyOptions();
  options.kv_backend = "carrier-pigeon";
  EXPECT_EQ(WorkerCore::Create(options, engine::EngineRole::kDecode).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = TinyOptions();
  options.grpc_address = "no-port-here";
  auto core = WorkerCore::Create(options, engine::EngineRole::kDecode);
  ASSERT_TRUE(core.ok()) << core.status();
  StatsService service(core->get());
  EXPECT_FALSE((*core)->Serve({}, &service, [] { return std::string(); }).ok());
  // Destroying the half-served core stops its loop.
}

}  // namespace
}  // namespace tandem::worker
