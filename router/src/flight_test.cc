// The Flight state machine against fake decode and prefill workers (in-process gRPC servers,
// flight_test_workers.h): the path of a request, migration when a decode worker goes away
// mid-stream, KV hand-off when one drains, retries running out, no room anywhere, and an abort
// in each state, which must leave no reservation behind.
#include "flight.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "flight_test_workers.h"

namespace tandem::router {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::tandem::router::fakes::FakeDecode;
using ::tandem::router::fakes::FakePrefill;
using ::tandem::router::fakes::FakeServer;
using ::tandem::router::fakes::kPromptLen;
using ::tandem::router::fakes::StreamMode;
using ::tandem::router::fakes::TokenText;

// What the client of one flight saw, and the states the flight went through.
struct Client {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<int32_t> tokens;
  std::string text;
  std::vector<engine::FinishReason> finishes;
  std::vector<float> embedding;
  int num_prompt_tokens = 0;
  absl::Status status;
  bool finished = false;
  int outputs = 0;
  bool done = false;  // on_done ran
  std::vector<FlightState> states;
  // Runs on the thread that makes the change of state, when the flight enters this state.
  std::map<FlightState, std::function<void()>> on_enter;

  void WaitDone() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  }
};

class FlightTest : public ::testing::Test {
 protected:
  // Two decode workers ("a" preferred: more KV blocks) and one prefill worker.
  void SetUp() override {
    decode_b_.total_blocks = 500;
  }

  void StartPool(int decode_workers = 2) {
    servers_.push_back(std::make_unique<FakeServer>(&decode_a_));
    std::vector<std::string> decode = {servers_.back()->address()};
    if (decode_workers > 1) {
      servers_.push_back(std::make_unique<FakeServer>(&decode_b_));
      decode.push_back(servers_.back()->address());
    }
    servers_.push_back(std::make_unique<FakeServer>(&prefill_));
    // A Stats answer is awaited for long, so that a slow machine never has a live fake counted
    // down (a fake that is gone answers UNAVAILABLE at once).
    auto pool = WorkerPool::Create({.prefill_addresses = {servers_.back()->address()},
                                    .decode_addresses = decode,
                                    .stats_timeout = absl::Seconds(60)});
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
    // Every fake that is not gone is up before the request starts.
    auto all_up = [&] {
      std::shared_ptr<const PoolSnapshot> pools = pool_->Snapshot();
      int up = 0;
      for (const WorkerView& w : pools->decode) up += w.up ? 1 : 0;
      for (const WorkerView& w : pools->prefill) up += w.up ? 1 : 0;
      int expected = 1 + (decode_a_.gone ? 0 : 1) + (decode_workers > 1 ? 1 : 0);
      return up == expected;
    };
    while (!all_up()) pool_->PollOnce(absl::Seconds(60));
    env_.pool = pool_.get();
    env_.counters = &counters_;
    env_.detokenize = [](const std::vector<int32_t>& tokens, bool) {
      std::string text;
      for (int32_t t : tokens) text += TokenText(t);
      return text;
    };
    env_.on_state = [this](const std::string&, FlightState state) {
      std::function<void()> hook;
      {
        std::lock_guard<std::mutex> lock(client_.mu);
        client_.states.push_back(state);
        auto it = client_.on_enter.find(state);
        if (it != client_.on_enter.end()) hook = it->second;
      }
      if (hook) hook();
    };
  }

  // The flight, once Launch has returned it (a hook may run before).
  std::shared_ptr<Flight> CurrentFlight() {
    std::unique_lock<std::mutex> lock(flight_mu_);
    flight_set_.wait(lock, [&] { return flight_ != nullptr; });
    return flight_;
  }

  std::shared_ptr<Flight> Launch(int max_tokens, engine::StructuredOutput constraint = {}) {
    engine::GenerateRequest request;
    request.request_id = "req";
    request.prompt_tokens = {1, 2, 3, 4};
    request.params.max_tokens = max_tokens;
    request.params.structured = std::move(constraint);
    return Launch(std::move(request));
  }

  // An embedding request of the prompt kEmbedPrompt.
  std::shared_ptr<Flight> LaunchEmbed() {
    engine::GenerateRequest request;
    request.request_id = "emb";
    request.prompt_tokens = kEmbedPrompt;
    request.task = engine::RequestTask::kEmbed;
    return Launch(std::move(request));
  }
  inline static const std::vector<int32_t> kEmbedPrompt = {5, 6, 7, 8, 9};

  std::shared_ptr<Flight> Launch(engine::GenerateRequest request) {
    std::shared_ptr<Flight> flight = Flight::Launch(
        &env_, std::move(request),
        [this](const engine::RequestOutput& out, const absl::Status& status) {
          std::lock_guard<std::mutex> lock(client_.mu);
          client_.cv.notify_all();
          ++client_.outputs;
          client_.status = status;
          client_.finished = out.finished;
          client_.embedding = out.embedding;
          client_.num_prompt_tokens = out.num_prompt_tokens;
          for (const engine::ChoiceDelta& d : out.choices) {
            client_.tokens.insert(client_.tokens.end(), d.token_ids.begin(), d.token_ids.end());
            client_.text += d.text;
            if (d.finish_reason != engine::FinishReason::kNone) {
              client_.finishes.push_back(d.finish_reason);
            }
          }
        },
        [this] {
          {
            std::lock_guard<std::mutex> lock(client_.mu);
            client_.done = true;
          }
          client_.cv.notify_all();
        });
    {
      std::lock_guard<std::mutex> lock(flight_mu_);
      flight_ = flight;
    }
    flight_set_.notify_all();
    return flight;
  }

  static std::vector<int32_t> Expected(int n) {
    std::vector<int32_t> tokens;
    for (int i = 0; i < n; ++i) tokens.push_back(100 + i);
    return tokens;
  }

  size_t LiveReservations() {
    size_t live = 0;
    for (FakeDecode* d : {&decode_a_, &decode_b_}) {
      std::lock_guard<std::mutex> lock(d->mu);
      live += d->live.size();
    }
    return live;
  }

  FakeDecode decode_a_;
  FakeDecode decode_b_;
  FakePrefill prefill_;
  std::vector<std::unique_ptr<FakeServer>> servers_;
  std::unique_ptr<WorkerPool> pool_;
  FlightCounters counters_;
  FlightEnv env_{.options = {.admission_timeout = absl::Seconds(30), .max_retries = 3}};
  Client client_;
  std::mutex flight_mu_;
  std::condition_variable flight_set_;
  std::shared_ptr<Flight> flight_;  // guarded by flight_mu_
};

TEST_F(FlightTest, RelaysEveryTokenOfTheBestDecodeWorker) {
  StartPool();
  Launch(5);
  client_.WaitDone();
  EXPECT_TRUE(client_.status.ok());
  EXPECT_TRUE(client_.finished);
  EXPECT_EQ(client_.tokens, Expected(5));
  EXPECT_EQ(client_.text, "<100><101><102><103><104>");
  EXPECT_THAT(client_.finishes, ElementsAre(engine::FinishReason::kLength));
  EXPECT_THAT(client_.states,
              ElementsAre(FlightState::kReserving, FlightState::kPrefilling,
                          FlightState::kStreaming, FlightState::kDone));
  std::lock_guard<std::mutex> lock(decode_a_.mu);
  EXPECT_EQ(decode_a_.starts, 1);
  EXPECT_EQ(decode_b_.starts, 0);
  EXPECT_TRUE(decode_a_.live.empty());
}

TEST_F(FlightTest, MigratesWhenTheDecodeWorkerGoesAwayMidStream) {
  decode_a_.mode = StreamMode::kDie;
  decode_a_.after = 2;
  StartPool();
  Launch(6);
  client_.WaitDone();
  EXPECT_TRUE(client_.status.ok()) << client_.status;
  // No gap and no repeat: two tokens from "a", the other four from "b".
  EXPECT_EQ(client_.tokens, Expected(6));
  EXPECT_THAT(client_.finishes, ElementsAre(engine::FinishReason::kLength));
  EXPECT_THAT(client_.states, ::testing::Contains(FlightState::kMigrating));
  EXPECT_EQ(counters_.migrations.load(), 1);
  {
    // The prompt was prefilled again with the two tokens it had generated.
    std::lock_guard<std::mutex> lock(prefill_.mu);
    EXPECT_THAT(prefill_.prompt_lengths, ElementsAre(kPromptLen, kPromptLen + 2));
  }
  {
    std::lock_guard<std::mutex> lock(decode_b_.mu);
    ASSERT_EQ(decode_b_.starts, 1);
    EXPECT_EQ(decode_b_.started[0].sampling().max_tokens(), 4);
  }
  EXPECT_EQ(LiveReservations(), 0u);
}

TEST_F(FlightTest, AConstrainedSampleRecomputedElsewhereReplaysItsTokensUnderItsGrammar) {
  decode_a_.mode = StreamMode::kDie;
  decode_a_.after = 2;
  StartPool();
  Launch(6, {engine::ConstraintKind::kRegex, "[a-z]+"});
  client_.WaitDone();
  EXPECT_TRUE(client_.status.ok()) << client_.status;
  EXPECT_EQ(client_.tokens, Expected(6));
  std::lock_guard<std::mutex> lock(decode_b_.mu);
  ASSERT_EQ(decode_b_.starts, 1);
  // The two tokens now ending the prompt were generated under the constraint: the new workers'
  // matchers accept them before the first new token.
  const tandem::v1::StructuredOutput& c = decode_b_.started[0].sampling().structured_output();
  EXPECT_EQ(c.kind(), tandem::v1::StructuredOutput::KIND_REGEX);
  EXPECT_EQ(c.source(), "[a-z]+");
  EXPECT_EQ(c.replay_prompt_tokens(), 2);
}

TEST_F(FlightTest, HandsTheKvOffWhenTheDecodeWorkerDrains) {
  decode_a_.mode = StreamMode::kDrain;
  decode_a_.after = 2;
  StartPool();
  Launch(6);
  client_.WaitDone();
  EXPECT_TRUE(client_.status.ok()) << client_.status;
  EXPECT_EQ(client_.tokens, Expected(6));
  EXPECT_THAT(client_.finishes, ElementsAre(engine::FinishReason::kLength));
  EXPECT_THAT(client_.states, ::testing::Contains(FlightState::kHandingOff));
  EXPECT_THAT(client_.states, ::testing::Not(::testing::Contains(FlightState::kMigrating)));
  EXPECT_EQ(counters_.kv_handoffs.load(), 1);
  EXPECT_EQ(counters_.kv_handoff_bytes.load(), 4096);
  EXPECT_EQ(counters_.migrations.load(), 0);
  {
    // Nothing was computed again: one prefill, the KV moved, and "b" continues the sample.
    std::lock_guard<std::mutex> lock(prefill_.mu);
    EXPECT_EQ(prefill_.submits, 1);
  }
  {
    std::lock_guard<std::mutex> lock(decode_a_.mu);
    EXPECT_EQ(decode_a_.handoffs, 1);
  }
  {
    std::lock_guard<std::mutex> lock(decode_b_.mu);
    ASSERT_EQ(decode_b_.starts, 1);
    ASSERT_EQ(decode_b_.started[0].choices_size(), 1);
    EXPECT_THAT(decode_b_.started[0].choices(0).generated_token_ids(), ElementsAre(100, 101));
  }
  EXPECT_EQ(LiveReservations(), 0u);
}

TEST_F(FlightTest, FailsWithTheWorkersErrorWhenRetriesRunOut) {
  env_.options.max_retries = 1;
  for (FakeDecode* d : {&decode_a_, &decode_b_}) {
    d->mode = StreamMode::kDie;
    d->after = 2;
  }
  StartPool();
  Launch(8);
  client_.WaitDone();
  // What streamed before the second worker went away reached the client, then the error.
  EXPECT_EQ(client_.tokens, Expected(4));
  EXPECT_EQ(client_.status.code(), absl::StatusCode::kUnavailable) << client_.status;
  EXPECT_THAT(std::string(client_.status.message()), HasSubstr("decode worker"));
  EXPECT_TRUE(client_.finished);
  EXPECT_EQ(counters_.migrations.load(), 1);
  EXPECT_EQ(LiveReservations(), 0u);
}

TEST_F(FlightTest, RefusedWhenNoDecodeWorkerHasRoom) {
  env_.options.admission_timeout = absl::Milliseconds(50);
  decode_a_.reserve_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  decode_b_.reserve_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  StartPool();
  Launch(4);
  client_.WaitDone();
  EXPECT_EQ(client_.status.code(), absl::StatusCode::kResourceExhausted) << client_.status;
  EXPECT_THAT(std::string(client_.status.message()), HasSubstr("no decode worker had room"));
  EXPECT_TRUE(client_.tokens.empty());
  std::lock_guard<std::mutex> lock(prefill_.mu);
  EXPECT_EQ(prefill_.submits, 0);
}

TEST_F(FlightTest, UnavailableWhenNoDecodeWorkerIsUp) {
  env_.options.admission_timeout = absl::Milliseconds(50);
  decode_a_.gone = true;
  StartPool(/*decode_workers=*/1);
  Launch(4);
  client_.WaitDone();
  EXPECT_EQ(client_.status.code(), absl::StatusCode::kUnavailable) << client_.status;
  EXPECT_THAT(std::string(client_.status.message()), HasSubstr("no decode worker could take"));
}

TEST_F(FlightTest, AbortWhileReservingReleasesWhatTheReserveGot) {
  decode_a_.hold_reserve = true;
  StartPool();
  Launch(4);
  decode_a_.WaitFor([&] { return decode_a_.held_reserve != nullptr; });
  EXPECT_EQ(flight_->state(), FlightState::kReserving);
  flight_->Abort();
  decode_a_.AnswerHeldReserve();
  client_.WaitDone();
  EXPECT_EQ(client_.outputs, 0);
  EXPECT_EQ(LiveReservations(), 0u);
  std::lock_guard<std::mutex> lock(prefill_.mu);
  EXPECT_EQ(prefill_.submits, 0);
}

TEST_F(FlightTest, AbortWhilePrefillingCancelsThePrefillAndReleases) {
  prefill_.hold_submit = true;
  StartPool();
  Launch(4);
  prefill_.WaitFor([&] { return prefill_.held == 1; });
  EXPECT_EQ(flight_->state(), FlightState::kPrefilling);
  flight_->Abort();
  client_.WaitDone();
  EXPECT_EQ(client_.outputs, 0);
  EXPECT_EQ(LiveReservations(), 0u);
  // Released only after the prefill worker's Cancel answered (it then writes no more into the
  // blocks).
  std::lock_guard<std::mutex> lock(prefill_.mu);
  EXPECT_GE(prefill_.cancels, 1);
}

TEST_F(FlightTest, AbortWhileStreamingCancelsTheStream) {
  decode_a_.mode = StreamMode::kHold;
  decode_a_.after = 1;
  StartPool();
  Launch(4);
  {
    std::unique_lock<std::mutex> lock(client_.mu);
    client_.cv.wait(lock, [&] { return !client_.tokens.empty(); });
  }
  EXPECT_EQ(flight_->state(), FlightState::kStreaming);
  flight_->Abort();
  client_.WaitDone();
  EXPECT_EQ(client_.tokens, Expected(1));
  // The worker hears of the cancelled call (in its own time) and the stream's blocks go.
  decode_a_.WaitFor([&] { return decode_a_.stream_cancelled == 1 && decode_a_.live.empty(); });
}

TEST_F(FlightTest, AbortWhileMigratingGoesNowhereElse) {
  decode_a_.mode = StreamMode::kDie;
  decode_a_.after = 1;
  client_.on_enter[FlightState::kMigrating] = [this] { CurrentFlight()->Abort(); };
  StartPool();
  Launch(4);
  client_.WaitDone();
  EXPECT_EQ(client_.tokens, Expected(1));
  EXPECT_EQ(client_.states.back(), FlightState::kDone);
  EXPECT_EQ(LiveReservations(), 0u);
  std::lock_guard<std::mutex> lock(decode_b_.mu);
  EXPECT_EQ(decode_b_.reserves, 0);
}

TEST_F(FlightTest, AbortWhileHandingOffReleasesTheTargetAndFreesTheParkedKv) {
  decode_a_.mode = StreamMode::kDrain;
  decode_a_.after = 2;
  client_.on_enter[FlightState::kHandingOff] = [this] { CurrentFlight()->Abort(); };
  StartPool();
  Launch(6);
  client_.WaitDone();
  EXPECT_EQ(client_.tokens, Expected(2));
  EXPECT_EQ(LiveReservations(), 0u);
  {
    std::lock_guard<std::mutex> lock(decode_a_.mu);
    EXPECT_EQ(decode_a_.handoffs, 0);
    EXPECT_GE(decode_a_.cancels, 1);  // the parked blocks are freed, not left to expire
  }
  std::lock_guard<std::mutex> lock(decode_b_.mu);
  EXPECT_EQ(decode_b_.starts, 0);
}

// An embedding goes to the prefill worker alone, without a reservation: no decode worker hears
// of it, and its vector and prompt length arrive in one finished output.
TEST_F(FlightTest, AnEmbeddingGoesToAPrefillWorkerOnly) {
  StartPool();
  LaunchEmbed();
  client_.WaitDone();
  EXPECT_TRUE(client_.status.ok()) << client_.status;
  EXPECT_TRUE(client_.finished);
  EXPECT_EQ(client_.outputs, 1);
  EXPECT_EQ(client_.embedding, fakes::EmbeddingOf(kEmbedPrompt));
  EXPECT_EQ(client_.num_prompt_tokens, 5);
  EXPECT_TRUE(client_.tokens.empty());
  EXPECT_THAT(client_.finishes, ElementsAre(engine::FinishReason::kStop));
  EXPECT_THAT(client_.states, ElementsAre(FlightState::kPrefilling, FlightState::kDone));
  for (FakeDecode* d : {&decode_a_, &decode_b_}) {
    std::lock_guard<std::mutex> lock(d->mu);
    EXPECT_EQ(d->reserves, 0);
    EXPECT_EQ(d->starts, 0);
  }
  std::lock_guard<std::mutex> lock(prefill_.mu);
  ASSERT_EQ(prefill_.submitted.size(), 1u);
  const tandem::v1::SubmitRequest& submit = prefill_.submitted[0];
  EXPECT_EQ(submit.task(), tandem::v1::TASK_EMBED);
  EXPECT_FALSE(submit.has_reservation());
  EXPECT_GT(submit.deadline_unix_ms(), absl::ToUnixMillis(absl::Now()));
  EXPECT_EQ(counters_.routed[0][static_cast<int>(RouteReason::kLoad)].load(), 1);
}

// A prefill worker that refuses an embedding (bad input it alone can tell) fails it with its
// error, at once and once: nothing is retried, no decode worker is asked.
TEST_F(FlightTest, AnEmbeddingTheWorkerRefusesFailsWithItsError) {
  prefill_.submit_code = grpc::StatusCode::INVALID_ARGUMENT;
  StartPool();
  LaunchEmbed();
  client_.WaitDone();
  EXPECT_EQ(client_.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(client_.status.message()), HasSubstr("refuses"));
  EXPECT_TRUE(client_.finished);
  EXPECT_TRUE(client_.embedding.empty());
  std::lock_guard<std::mutex> lock(prefill_.mu);
  EXPECT_EQ(prefill_.submits, 1);
  std::lock_guard<std::mutex> lock_a(decode_a_.mu);
  EXPECT_EQ(decode_a_.reserves, 0);
}

TEST_F(FlightTest, AbortWhileEmbeddingCancelsTheSubmit) {
  prefill_.hold_submit = true;
  StartPool();
  LaunchEmbed();
  prefill_.WaitFor([&] { return prefill_.held == 1; });
  EXPECT_EQ(flight_->state(), FlightState::kPrefilling);
  flight_->Abort();
  client_.WaitDone();
  EXPECT_EQ(client_.outputs, 0);
  // The held Submit hears of the cancelled call.
  prefill_.WaitFor([&] { return prefill_.held == 0; });
  std::lock_guard<std::mutex> lock(decode_a_.mu);
  EXPECT_EQ(decode_a_.reserves, 0);
}

}  // namespace
}  // namespace tandem::router
