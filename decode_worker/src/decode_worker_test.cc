// The decode worker over real gRPC: a prefill-role engine in the test plays the prefill worker
// (computes the prompt, pushes its KV into the reserved blocks through a kvtransfer agent), and
// the worker's streamed output must equal a colocated engine's, with no KV block left behind.
#include "tandem/decode_worker/decode_worker.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "step_gate.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/engine/model_runner.h"
#include "tandem/engine/prefix_hash.h"
#include "tandem/kvtransfer/agent.h"
#include "tandem/proto/wire.h"
#include "tandem/v1/decode.grpc.pb.h"
#include "kv_events_stream.h"
#include "test_models.h"

namespace tandem::decode_worker {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kKvBytes = 8ll << 20;

engine::EngineOptions EngineOptionsFor(engine::EngineRole role) {
  engine::EngineOptions options;
  options.model_dir = testing::TinyModel("qwen3", DType::kBF16);
  options.num_threads = 2;
  options.kv_cache_bytes = kKvBytes;
  // The block counts the tests work out (RefusesBadInput's full cache) are those of an fp32
  // cache; --kv-cache-dtype auto would hold this bf16 checkpoint's KV in bf16, twice the blocks.
  options.kv_cache_dtype = DType::kF32;
  options.max_num_batched_tokens = 64;  // prompts span several prefill chunks
  options.role = role;
  return options;
}

std::unique_ptr<engine::LlmEngine> MakeEngine(engine::EngineRole role) {
  auto engine = engine::LlmEngine::Create(EngineOptionsFor(role));
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

std::vector<int32_t> RandomPrompt(int length, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> prompt(length);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % vocab);
  return prompt;
}

std::unique_ptr<grpc::ClientContext> Context(absl::Duration timeout = absl::Seconds(60)) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  return context;
}

// What one Start call streamed.
struct StartResult {
  std::vector<tandem::v1::TokenEvent> events;
  grpc::Status status;
};

// Each sample's tokens, text, logprobs and finish reason, in sample order.
struct SampleOutput {
  std::vector<int32_t> token_ids;
  std::string text;
  std::vector<float> logprobs;
  tandem::v1::FinishReason finish_reason = tandem::v1::FINISH_REASON_NONE;
};

std::vector<SampleOutput> Collect(const std::vector<tandem::v1::TokenEvent>& events, int n) {
  std::vector<SampleOutput> out(n);
  for (const tandem::v1::TokenEvent& e : events) {
    if (e.index() < 0 || e.index() >= n) {
      ADD_FAILURE() << "event for sample " << e.index();
      continue;
    }
    SampleOutput& s = out[e.index()];
    EXPECT_EQ(s.finish_reason, tandem::v1::FINISH_REASON_NONE) << "event after the finish";
    s.token_ids.insert(s.token_ids.end(), e.token_ids().begin(), e.token_ids().end());
    s.text += e.text();
    s.logprobs.insert(s.logprobs.end(), e.logprobs().begin(), e.logprobs().end());
    if (e.finish_reason() != tandem::v1::FINISH_REASON_NONE) s.finish_reason = e.finish_reason();
  }
  return out;
}

// A GET over a plain socket; returns the whole response (status line, headers, body).
std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request =
        absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buf[4096];
      ssize_t got;
      while ((got = read(fd, buf, sizeof(buf))) > 0) response.append(buf, got);
    }
  }
  close(fd);
  return response;
}

// The value of an unlabelled series in a /metrics response, or -1 when absent.
double MetricValue(const std::string& response, const std::string& name) {
  const std::string key = absl::StrCat("\n", name, " ");
  const size_t at = response.find(key);
  if (at == std::string::npos) return -1;
  return std::stod(response.substr(at + key.size()));
}

class DecodeWorkerTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    DecodeWorkerOptions options;
    options.engine = EngineOptionsFor(engine::EngineRole::kColocated);  // the worker sets decode
    // Tests that must catch a stream mid-generation pause the worker's engine here.
    gate_ = std::make_shared<testing::StepGate>();
    options.engine.before_step = gate_->Hook();
    options.worker_id = "decode-test";
    options.kv_backend = GetParam();
    options.metrics_address = "127.0.0.1:0";
    auto worker = DecodeWorker::Create(options);
    ASSERT_TRUE(worker.ok()) << worker.status();
    worker_ = std::move(worker).value();
    ASSERT_GT(worker_->metrics_port(), 0);
    stub_ = tandem::v1::DecodeWorker::NewStub(
        grpc::CreateChannel(worker_->grpc_address(), grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    gate_->Open();
    if (worker_ == nullptr) return;
    // Nothing leaks, whatever the test did.
    EXPECT_TRUE(WaitForStats([](const tandem::v1::WorkerStats& s) {
      return s.kv_blocks_used() == 0 && s.reservations() == 0 && s.running() == 0;
    })) << RpcStats().DebugString();
    worker_.reset();
  }

  tandem::v1::WorkerStats RpcStats() {
    tandem::v1::WorkerStats stats;
    grpc::Status status = stub_->Stats(Context().get(), {}, &stats);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return stats;
  }

  // Polls the Stats RPC until `done` holds, for up to `timeout` (a bound for a hang).
  bool WaitForStats(const std::function<bool(const tandem::v1::WorkerStats&)>& done,
                    absl::Duration timeout = absl::Seconds(60)) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      if (done(RpcStats())) return true;
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  grpc::Status Reserve(const std::string& request_id, int num_prompt_tokens, int max_tokens, int n,
                       tandem::v1::KvReservation* reservation, int64_t deadline_unix_ms = 0) {
    return ReserveOn(*stub_, request_id, num_prompt_tokens, max_tokens, n, reservation,
                     deadline_unix_ms);
  }

  // With `prompt` (and `cache_salt`), the worker shares the blocks its prefix cache holds.
  static grpc::Status ReserveOn(tandem::v1::DecodeWorker::Stub& stub, const std::string& request_id,
                                int num_prompt_tokens, int max_tokens, int n,
                                tandem::v1::KvReservation* reservation,
                                int64_t deadline_unix_ms = 0,
                                const std::vector<int32_t>& prompt = {},
                                const std::string& cache_salt = "") {
    tandem::v1::ReserveRequest request;
    request.set_request_id(request_id);
    request.set_num_prompt_tokens(num_prompt_tokens);
    request.set_max_tokens(max_tokens);
    request.set_n(n);
    request.set_deadline_unix_ms(deadline_unix_ms);
    request.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
    request.set_cache_salt(cache_salt);
    tandem::v1::ReserveResponse response;
    grpc::Status status = stub.Reserve(Context().get(), request, &response);
    *reservation = response.reservation();
    return status;
  }

  // Plays the prefill worker: computes `request` on a prefill-role engine, pushes each sample's
  // prompt KV into its slice of the reservation (but for the blocks the worker already holds:
  // num_cached_tokens), and returns the prefilled choices for Start.
  std::vector<tandem::v1::PrefilledChoice> Prefill(const engine::GenerateRequest& request,
                                                   const tandem::v1::KvReservation& reservation) {
    std::vector<tandem::v1::PrefilledChoice> choices;
    if (prefill_ == nullptr) prefill_ = MakeEngine(engine::EngineRole::kPrefill);
    if (sender_ == nullptr) {
      auto sender = kvtransfer::Agent::Create({.backend = GetParam(), .name = "prefill-test"});
      EXPECT_TRUE(sender.ok()) << sender.status();
      if (!sender.ok()) return choices;
      sender_ = std::move(sender).value();
      EXPECT_TRUE(
          sender_->RegisterMemory(1, prefill_->kv_cache(), prefill_->kv_cache_bytes()).ok());
    }
    const tandem::v1::TransferEndpoint& endpoint = reservation.endpoint();
    EXPECT_EQ(endpoint.backend(), GetParam());
    EXPECT_EQ(endpoint.region_descriptors_size(), 1);
    const absl::Time deadline = absl::FromUnixMillis(reservation.expires_unix_ms());
    auto peer = sender_->Connect(endpoint.address(), deadline);
    EXPECT_TRUE(peer.ok()) << peer.status();
    if (!peer.ok()) return choices;

    EXPECT_TRUE(prefill_->AddRequest(request).ok());
    std::vector<engine::PrefillHandoff> handoffs;
    while (static_cast<int>(handoffs.size()) < request.params.n && prefill_->has_unfinished()) {
      EXPECT_TRUE(prefill_->Step().ok());
      for (engine::PrefillHandoff& h : prefill_->TakeHandoffs()) handoffs.push_back(h);
    }
    EXPECT_EQ(static_cast<int>(handoffs.size()), request.params.n);
    engine::KvCacheLayout dst = prefill_->cache_layout();  // the worker's, but for its size
    dst.num_blocks = endpoint.num_blocks();
    const int per_choice = reservation.blocks_per_choice();
    const int cached = reservation.num_cached_tokens() / dst.block_size;
    for (const engine::PrefillHandoff& h : handoffs) {
      engine::BlockTable dst_blocks(
          reservation.block_ids().begin() + h.choice_index * per_choice + cached,
          reservation.block_ids().begin() + (h.choice_index + 1) * per_choice);
      engine::BlockTable src_blocks(h.blocks.begin() + cached, h.blocks.end());
      auto ranges =
          engine::KvBlockCopyRanges(prefill_->cache_layout(), dst, src_blocks, dst_blocks);
      EXPECT_TRUE(ranges.ok()) << ranges.status();
      if (ranges.ok()) {
        std::vector<kvtransfer::Range> wire;
        for (const engine::KvCopyRange& r : *ranges) {
          wire.push_back({r.src_offset, r.dst_offset, r.bytes});
        }
        auto handle =
            sender_->Submit(*peer, 1, endpoint.region_descriptors(0), std::move(wire), deadline);
        EXPECT_TRUE(handle.ok()) << handle.status();
        if (handle.ok()) EXPECT_TRUE((*handle)->Wait().ok());
      }
      prefill_->ReleaseHandoff(h);
      choices.push_back(proto::ToProto(h.choice_index, h));
    }
    EXPECT_EQ(prefill_->stats().kv_blocks_used, 0);
    return choices;
  }

  tandem::v1::StartRequest StartRequestFor(const engine::GenerateRequest& request,
                                           const tandem::v1::KvReservation& reservation,
                                           std::vector<tandem::v1::PrefilledChoice> choices) {
    tandem::v1::StartRequest start;
    start.set_request_id(request.request_id);
    start.set_reservation_id(reservation.reservation_id());
    for (int32_t t : request.prompt_tokens) start.add_prompt_token_ids(t);
    *start.mutable_sampling() = proto::ToProto(request.params);
    for (tandem::v1::PrefilledChoice& c : choices) *start.add_choices() = std::move(c);
    return start;
  }

  StartResult RunStart(const tandem::v1::StartRequest& start) {
    StartResult result;
    auto context = Context();
    auto reader = stub_->Start(context.get(), start);
    tandem::v1::TokenEvent event;
    while (reader->Read(&event)) result.events.push_back(event);
    result.status = reader->Finish();
    return result;
  }

  // Reserve, prefill and push, then Start with a long generation on the worker whose engine
  // `gate` pauses (the fixture's by default); returns once the first event (the prefilled first
  // token) arrived, with the call open and the stream paused there until the test lets it go.
  struct OpenStream {
    std::unique_ptr<grpc::ClientContext> context;
    std::unique_ptr<grpc::ClientReader<tandem::v1::TokenEvent>> reader;
    std::vector<tandem::v1::TokenEvent> events;
  };
  OpenStream StartLong(const std::string& request_id, int n,
                       tandem::v1::DecodeWorker::Stub* stub = nullptr,
                       testing::StepGate* gate = nullptr) {
    if (stub == nullptr) stub = stub_.get();
    if (gate == nullptr) gate = gate_.get();
    OpenStream open;
    auto colocated_vocab = 512;
    engine::GenerateRequest request{request_id, RandomPrompt(40, colocated_vocab, 3), {}};
    request.params.max_tokens = 2000;
    request.params.ignore_eos = true;
    request.params.temperature = 0;
    request.params.n = n;
    tandem::v1::KvReservation reservation;
    grpc::Status reserved = ReserveOn(*stub, request_id, 40, 2000, n, &reservation);
    EXPECT_TRUE(reserved.ok()) << reserved.error_message();
    if (!reserved.ok()) return open;
    tandem::v1::StartRequest start =
        StartRequestFor(request, reservation, Prefill(request, reservation));
    gate->Allow(0);
    open.context = Context();
    open.reader = stub->Start(open.context.get(), start);
    tandem::v1::TokenEvent event;
    EXPECT_TRUE(open.reader->Read(&event));
    open.events.push_back(event);
    return open;
  }

  // A second decode worker of the same backend (the one a drain hands KV away from).
  std::unique_ptr<DecodeWorker> MakeWorker(const std::string& id, absl::Duration handoff_ttl,
                                           std::function<bool()> before_step = nullptr) {
    DecodeWorkerOptions options;
    options.engine = EngineOptionsFor(engine::EngineRole::kDecode);
    options.engine.before_step = std::move(before_step);
    options.worker_id = id;
    options.kv_backend = GetParam();
    options.handoff_ttl = handoff_ttl;
    auto worker = DecodeWorker::Create(options);
    EXPECT_TRUE(worker.ok()) << worker.status();
    return worker.ok() ? std::move(worker).value() : nullptr;
  }

  static std::unique_ptr<tandem::v1::DecodeWorker::Stub> StubFor(const DecodeWorker& worker) {
    return tandem::v1::DecodeWorker::NewStub(
        grpc::CreateChannel(worker.grpc_address(), grpc::InsecureChannelCredentials()));
  }

  static grpc::Status Handoff(tandem::v1::DecodeWorker::Stub& stub, const std::string& request_id,
                              int index, const tandem::v1::KvReservation& reservation,
                              int target_index = 0, tandem::v1::HandoffResponse* out = nullptr) {
    tandem::v1::HandoffRequest request;
    request.set_request_id(request_id);
    request.set_index(index);
    *request.mutable_reservation() = reservation;
    request.set_target_index(target_index);
    tandem::v1::HandoffResponse response;
    grpc::Status status = stub.Handoff(Context().get(), request, &response);
    if (out != nullptr) *out = response;
    return status;
  }

  std::unique_ptr<DecodeWorker> worker_;
  std::shared_ptr<testing::StepGate> gate_;
  std::unique_ptr<tandem::v1::DecodeWorker::Stub> stub_;
  std::unique_ptr<engine::LlmEngine> prefill_;
  std::unique_ptr<kvtransfer::Agent> sender_;
};

TEST_P(DecodeWorkerTest, StreamEqualsColocatedOutput) {
  auto colocated = MakeEngine(engine::EngineRole::kColocated);
  ASSERT_NE(colocated, nullptr);
  const int vocab = colocated->config().vocab_size;
  std::vector<engine::GenerateRequest> requests;
  {
    engine::GenerateRequest greedy{"greedy", RandomPrompt(150, vocab, 1), {}};
    greedy.params.temperature = 0;
    greedy.params.max_tokens = 12;
    greedy.params.ignore_eos = true;
    greedy.params.logprobs = 1;
    requests.push_back(greedy);
    engine::GenerateRequest seeded{"seeded", RandomPrompt(77, vocab, 2), {}};
    seeded.params.temperature = 0.8f;
    seeded.params.seed = 1234;
    seeded.params.n = 2;
    seeded.params.max_tokens = 10;
    seeded.params.ignore_eos = true;
    seeded.params.logprobs = 0;
    requests.push_back(seeded);
  }
  auto expected = engine::GenerateAll(*colocated, requests);
  ASSERT_TRUE(expected.ok()) << expected.status();

  for (size_t r = 0; r < requests.size(); ++r) {
    const engine::GenerateRequest& request = requests[r];
    SCOPED_TRACE(request.request_id);
    const int prompt_len = static_cast<int>(request.prompt_tokens.size());
    tandem::v1::KvReservation reservation;
    grpc::Status reserved = Reserve(request.request_id, prompt_len, request.params.max_tokens,
                                    request.params.n, &reservation);
    ASSERT_TRUE(reserved.ok()) << reserved.error_message();
    const int per_choice = (prompt_len + 15) / 16;
    EXPECT_EQ(reservation.blocks_per_choice(), per_choice);
    EXPECT_EQ(reservation.block_ids_size(), per_choice * request.params.n);
    EXPECT_EQ(RpcStats().kv_blocks_reserved(), per_choice * request.params.n);
    EXPECT_EQ(RpcStats().reservations(), 1);

    StartResult result =
        RunStart(StartRequestFor(request, reservation, Prefill(request, reservation)));
    ASSERT_TRUE(result.status.ok()) << result.status.error_message();
    ASSERT_FALSE(result.events.empty());
    for (const tandem::v1::TokenEvent& e : result.events) {
      EXPECT_EQ(e.request_id(), request.request_id);
      EXPECT_EQ(e.error().code(), 0);
    }
    const std::vector<SampleOutput> got = Collect(result.events, request.params.n);
    const engine::RequestOutput& want = (*expected)[r];
    int completion_tokens = 0;
    for (int c = 0; c < request.params.n; ++c) {
      EXPECT_EQ(got[c].token_ids, want.choices[c].token_ids) << "sample " << c;
      EXPECT_EQ(got[c].text, want.choices[c].text) << "sample " << c;
      EXPECT_EQ(got[c].logprobs, want.choices[c].logprobs) << "sample " << c;
      EXPECT_EQ(got[c].finish_reason, tandem::v1::FINISH_REASON_LENGTH) << "sample " << c;
      completion_tokens += static_cast<int>(got[c].token_ids.size());
    }
    if (request.params.n == 2) EXPECT_NE(got[0].token_ids, got[1].token_ids);
    // Usage comes once, on the last event.
    for (size_t i = 0; i + 1 < result.events.size(); ++i) {
      EXPECT_FALSE(result.events[i].has_usage()) << "event " << i;
    }
    ASSERT_TRUE(result.events.back().has_usage());
    EXPECT_EQ(result.events.back().usage().prompt_tokens(), prompt_len);
    EXPECT_EQ(result.events.back().usage().completion_tokens(), completion_tokens);

    const tandem::v1::WorkerStats stats = RpcStats();
    EXPECT_EQ(stats.kv_blocks_used(), 0);
    EXPECT_EQ(stats.kv_blocks_reserved(), 0);
    EXPECT_EQ(stats.reservations(), 0);
    EXPECT_EQ(stats.role(), tandem::v1::WORKER_ROLE_DECODE);
    EXPECT_EQ(stats.worker_id(), "decode-test");
    EXPECT_EQ(stats.kv_blocks_total(), reservation.endpoint().num_blocks());
  }
}

// A finished request's blocks stay cached on the decode worker: a Reserve with the prompt of
// the next turn (the previous prompt, its answer and a new message) answers how many prompt tokens
// it holds already, only the rest is pushed, and the output still equals a colocated engine's.
// Another tenant (cache_salt) shares nothing, and a Start whose prompt differs from the one the
// cached blocks hold is refused.
TEST_P(DecodeWorkerTest, ReserveSharesTheCachedPrefixOfFinishedRequests) {
  auto colocated = MakeEngine(engine::EngineRole::kColocated);
  ASSERT_NE(colocated, nullptr);
  const int vocab = colocated->config().vocab_size;
  std::vector<int32_t> history = RandomPrompt(70, vocab, 9);
  for (int turn = 0; turn < 2; ++turn) {
    SCOPED_TRACE(absl::StrCat("turn ", turn));
    engine::GenerateRequest request{absl::StrCat("turn", turn), history, {}};
    request.params.temperature = 0.8f;
    request.params.seed = 10 + turn;
    request.params.n = 1 + turn;
    request.params.max_tokens = 8;
    request.params.ignore_eos = true;
    auto expected = engine::GenerateAll(*colocated, {request});
    ASSERT_TRUE(expected.ok()) << expected.status();
    const int len = static_cast<int>(history.size());
    tandem::v1::KvReservation reservation;
    ASSERT_TRUE(
        ReserveOn(*stub_, request.request_id, len, 8, request.params.n, &reservation, 0, history)
            .ok());
    // Turn 1: 70 prompt tokens and 7 of the 8 generated have their KV here: 4 whole blocks.
    EXPECT_EQ(reservation.num_cached_tokens(), turn == 0 ? 0 : 64);
    if (turn == 1) {
      // Every sample's table starts with the same cached blocks.
      EXPECT_EQ(reservation.block_ids(0), reservation.block_ids(reservation.blocks_per_choice()));
      // Another tenant's identical prompt finds nothing.
      tandem::v1::KvReservation other;
      ASSERT_TRUE(ReserveOn(*stub_, "other", len, 8, 1, &other, 0, history, "tenant-b").ok());
      EXPECT_EQ(other.num_cached_tokens(), 0);
      // A Start that brings another prompt than the reserved one is refused.
      engine::GenerateRequest wrong = request;
      wrong.request_id = "wrong";
      wrong.params.n = 1;
      wrong.prompt_tokens[3] = (wrong.prompt_tokens[3] + 1) % vocab;
      tandem::v1::KvReservation wrong_reservation;
      ASSERT_TRUE(ReserveOn(*stub_, "wrong", len, 8, 1, &wrong_reservation, 0, history).ok());
      engine::PrefillHandoff first;
      first.first_token = 1;
      StartResult refused =
          RunStart(StartRequestFor(wrong, wrong_reservation, {proto::ToProto(0, first)}));
      EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
      EXPECT_THAT(refused.status.error_message(), HasSubstr("differs from the reservation"));
      tandem::v1::ReleaseRequest release;
      tandem::v1::ReleaseResponse released;
      for (const auto* r : {&other, &wrong_reservation}) {
        release.set_reservation_id(r->reservation_id());
        ASSERT_TRUE(stub_->Release(Context().get(), release, &released).ok());
      }
    }
    StartResult result =
        RunStart(StartRequestFor(request, reservation, Prefill(request, reservation)));
    ASSERT_TRUE(result.status.ok()) << result.status.error_message();
    const std::vector<SampleOutput> got = Collect(result.events, request.params.n);
    for (int c = 0; c < request.params.n; ++c) {
      EXPECT_EQ(got[c].token_ids, (*expected)[0].choices[c].token_ids) << "sample " << c;
    }
    // No block is referenced; cached ones count as free.
    EXPECT_TRUE(WaitForStats([](const tandem::v1::WorkerStats& s) {
      return s.kv_blocks_used() == 0 && s.reservations() == 0;
    }));
    history.insert(history.end(), got[0].token_ids.begin(), got[0].token_ids.end());
    const std::vector<int32_t> message = RandomPrompt(12, vocab, 30);
    history.insert(history.end(), message.begin(), message.end());
  }
  const std::string metrics = HttpGet(worker_->metrics_port(), "/metrics");
  // Looked up: turn 0, turn 1's two samples, the other tenant's and the wrong prompt's
  // reservations; found: 64 tokens for each of turn 1's samples and the wrong prompt's.
  EXPECT_EQ(MetricValue(metrics, "tandem_prefix_cache_queries_tokens_total"), 70 + 4 * 90);
  EXPECT_EQ(MetricValue(metrics, "tandem_prefix_cache_hits_tokens_total"), 3 * 64);
  // Of the started requests, turn 1's two samples found 64 tokens each: not moved.
  const engine::KvCacheLayout& layout = colocated->cache_layout();
  EXPECT_EQ(MetricValue(metrics, "tandem_decode_kv_cached_bytes_total"),
            2.0 * 64 * layout.num_layers * 2 * layout.row_bytes());
}

// The KvEvents stream of a decode worker starts with a snapshot (empty on a fresh worker), then
// names every block a finished request left in its prefix cache, by the hash the router
// computes for the same tokens and salt; a stream opened later finds them in its snapshot;
// shutting down ends every stream with UNAVAILABLE.
TEST_P(DecodeWorkerTest, KvEventsSnapshotThenTheBlocksARequestLeftCached) {
  worker_testing::KvEventsStream first(*stub_);
  std::set<uint64_t> snapshot;
  int block_size = 0;
  ASSERT_TRUE(first.ReadSnapshot(&snapshot, &block_size));
  EXPECT_TRUE(snapshot.empty());

  auto colocated = MakeEngine(engine::EngineRole::kColocated);
  ASSERT_NE(colocated, nullptr);
  const std::vector<int32_t> prompt = RandomPrompt(70, colocated->config().vocab_size, 21);
  engine::GenerateRequest request{"cached", prompt, {}};
  request.cache_salt = "tenant";
  request.params.max_tokens = 4;
  request.params.ignore_eos = true;
  tandem::v1::KvReservation reservation;
  ASSERT_TRUE(ReserveOn(*stub_, request.request_id, 70, 4, 1, &reservation, 0, prompt, "tenant")
                  .ok());
  tandem::v1::StartRequest start = StartRequestFor(request, reservation, Prefill(request, reservation));
  start.set_cache_salt("tenant");
  StartResult result = RunStart(start);
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();

  // 70 prompt tokens and 3 generated ones have KV here: 4 whole blocks, all of the prompt.
  std::vector<uint64_t> hashes;
  engine::ExtendBlockHashes(engine::PrefixRoot("tenant"), prompt, block_size, hashes);
  ASSERT_EQ(hashes.size(), 4u);
  const std::set<uint64_t> expected(hashes.begin(), hashes.end());
  EXPECT_EQ(first.ReadUntilStored(expected), expected);

  worker_testing::KvEventsStream second(*stub_);
  std::set<uint64_t> later;
  ASSERT_TRUE(second.ReadSnapshot(&later, &block_size));
  EXPECT_EQ(later, expected);

  EXPECT_TRUE(WaitForStats([](const tandem::v1::WorkerStats& s) {
    return s.kv_blocks_used() == 0 && s.reservations() == 0 && s.running() == 0;
  }));
  worker_->Shutdown(absl::Seconds(5));
  EXPECT_EQ(first.Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(second.Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  worker_.reset();  // shut down: nothing left for TearDown to ask
}

TEST_P(DecodeWorkerTest, ConcurrentStreamsEachEqualColocatedOutput) {
  auto colocated = MakeEngine(engine::EngineRole::kColocated);
  ASSERT_NE(colocated, nullptr);
  const int vocab = colocated->config().vocab_size;
  std::vector<engine::GenerateRequest> requests;
  for (int i = 0; i < 6; ++i) {
    engine::GenerateRequest request{
        absl::StrCat("c", i), RandomPrompt(30 + 25 * i, vocab, 10 + i), {}};
    request.params.max_tokens = 8 + 3 * i;
    request.params.ignore_eos = true;
    request.params.temperature = i % 2 == 0 ? 0.0f : 0.9f;
    request.params.seed = 77 + i;
    request.params.n = 1 + i % 2;
    requests.push_back(request);
  }
  auto expected = engine::GenerateAll(*colocated, requests);
  ASSERT_TRUE(expected.ok()) << expected.status();

  // All reserved and prefilled first, then started at once so they share decode steps.
  std::vector<tandem::v1::StartRequest> starts;
  for (const engine::GenerateRequest& request : requests) {
    tandem::v1::KvReservation reservation;
    ASSERT_TRUE(Reserve(request.request_id, static_cast<int>(request.prompt_tokens.size()),
                        request.params.max_tokens, request.params.n, &reservation)
                    .ok());
    starts.push_back(StartRequestFor(request, reservation, Prefill(request, reservation)));
  }
  std::vector<StartResult> results(requests.size());
  {
    std::vector<std::jthread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] { results[i] = RunStart(starts[i]); });
    }
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(requests[i].request_id);
    ASSERT_TRUE(results[i].status.ok()) << results[i].status.error_message();
    const std::vector<SampleOutput> got = Collect(results[i].events, requests[i].params.n);
    for (int c = 0; c < requests[i].params.n; ++c) {
      EXPECT_EQ(got[c].token_ids, (*expected)[i].choices[c].token_ids) << "sample " << c;
      EXPECT_EQ(got[c].text, (*expected)[i].choices[c].text) << "sample " << c;
    }
    EXPECT_TRUE(results[i].events.back().has_usage());
  }
  EXPECT_EQ(RpcStats().kv_blocks_used(), 0);
}

TEST_P(DecodeWorkerTest, UnstartedReservationExpires) {
  tandem::v1::KvReservation reservation;
  const int64_t deadline = absl::ToUnixMillis(absl::Now() + absl::Milliseconds(200));
  grpc::Status reserved = Reserve("late", 100, 10, 1, &reservation, deadline);
  ASSERT_TRUE(reserved.ok()) << reserved.error_message();
  EXPECT_EQ(reservation.expires_unix_ms(), deadline);  // never later than asked
  EXPECT_EQ(RpcStats().kv_blocks_used(), 7);

  // Past its deadline a reservation cannot be started, even while its blocks are still held
  // for transfers that may be landing. (Waiting for the clock to pass it is the point here.)
  absl::SleepFor(absl::FromUnixMillis(deadline) - absl::Now() + absl::Milliseconds(2));
  tandem::v1::StartRequest start;
  start.set_request_id("late");
  start.set_reservation_id(reservation.reservation_id());
  for (int i = 0; i < 100; ++i) start.add_prompt_token_ids(1);
  start.add_choices()->mutable_first_token()->set_token_id(1);
  StartResult result = RunStart(start);
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(result.events.empty());

  // The blocks come back by themselves, after the grace period, with nobody calling.
  EXPECT_TRUE(WaitForStats([](const tandem::v1::WorkerStats& s) {
    return s.kv_blocks_used() == 0 && s.kv_blocks_reserved() == 0 && s.reservations() == 0;
  })) << RpcStats().DebugString();
  EXPECT_EQ(RunStart(start).status.error_code(), grpc::StatusCode::NOT_FOUND);

  tandem::v1::ReleaseRequest release;
  release.set_reservation_id(reservation.reservation_id());
  tandem::v1::ReleaseResponse released;
  ASSERT_TRUE(stub_->Release(Context().get(), release, &released).ok());
  EXPECT_FALSE(released.released());
  const std::string metrics = HttpGet(worker_->metrics_port(), "/metrics");
  EXPECT_THAT(metrics, HasSubstr("\ntandem_decode_reservations_expired_total 1\n"));
}

TEST_P(DecodeWorkerTest, ReleaseAndCancelAreIdempotent) {
  tandem::v1::KvReservation reservation;
  ASSERT_TRUE(Reserve("r1", 33, 10, 2, &reservation).ok());
  EXPECT_EQ(RpcStats().kv_blocks_used(), 6);
  tandem::v1::ReleaseRequest release;
  release.set_reservation_id(reservation.reservation_id());
  for (bool want : {true, false, false}) {
    tandem::v1::ReleaseResponse response;
    ASSERT_TRUE(stub_->Release(Context().get(), release, &response).ok());
    EXPECT_EQ(response.released(), want);
    EXPECT_EQ(RpcStats().kv_blocks_used(), 0);
  }

  ASSERT_TRUE(Reserve("r2", 33, 10, 1, &reservation).ok());
  EXPECT_EQ(RpcStats().kv_blocks_used(), 3);
  tandem::v1::CancelRequest cancel;
  cancel.set_request_id("r2");
  cancel.set_reason("client disconnected");
  for (bool want : {true, false}) {
    tandem::v1::CancelResponse response;
    ASSERT_TRUE(stub_->Cancel(Context().get(), cancel, &response).ok());
    EXPECT_EQ(response.found(), want);
    EXPECT_EQ(RpcStats().kv_blocks_used(), 0);
  }
  // The cancelled reservation cannot be started.
  tandem::v1::StartRequest start;
  start.set_request_id("r2");
  start.set_reservation_id(reservation.reservation_id());
  EXPECT_EQ(RunStart(start).status.error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_P(DecodeWorkerTest, CancelEndsARunningStream) {
  OpenStream open = StartLong("long", 2);
  ASSERT_NE(open.reader, nullptr);
  EXPECT_GT(RpcStats().kv_blocks_used(), 0);  // paused after its first token
  tandem::v1::CancelRequest cancel;
  cancel.set_request_id("long");
  tandem::v1::CancelResponse response;
  ASSERT_TRUE(stub_->Cancel(Context().get(), cancel, &response).ok());
  EXPECT_TRUE(response.found());
  // Blocks are free as soon as Cancel returns.
  EXPECT_EQ(RpcStats().kv_blocks_used(), 0);

  tandem::v1::TokenEvent event;
  while (open.reader->Read(&event)) open.events.push_back(event);
  grpc::Status status = open.reader->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  const std::vector<SampleOutput> got = Collect(open.events, 2);
  for (const SampleOutput& s : got) {
    EXPECT_EQ(s.finish_reason, tandem::v1::FINISH_REASON_ABORT);
    EXPECT_EQ(s.token_ids.size(), 1u);  // the prefilled first token; no step ran since
  }
  ASSERT_TRUE(open.events.back().has_usage());
  EXPECT_EQ(open.events.back().usage().prompt_tokens(), 40);

  tandem::v1::CancelResponse again;
  ASSERT_TRUE(stub_->Cancel(Context().get(), cancel, &again).ok());
  EXPECT_FALSE(again.found());
}

TEST_P(DecodeWorkerTest, ClientCancellingTheCallFreesBlocks) {
  OpenStream open = StartLong("gone", 1);
  ASSERT_NE(open.reader, nullptr);
  EXPECT_EQ(RpcStats().running(), 1);  // paused after its first token
  open.context->TryCancel();
  EXPECT_EQ(open.reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The handler notices and frees the blocks with the engine still paused.
  EXPECT_TRUE(WaitForStats(
      [](const tandem::v1::WorkerStats& s) { return s.kv_blocks_used() == 0 && s.running() == 0; }))
      << RpcStats().DebugString();
  // Aborted after its first token, not run to its 2000.
  EXPECT_EQ(MetricValue(HttpGet(worker_->metrics_port(), "/metrics"),
                        "tandem_generation_tokens_total"),
            1);
  tandem::v1::CancelRequest cancel;
  cancel.set_request_id("gone");
  tandem::v1::CancelResponse response;
  ASSERT_TRUE(stub_->Cancel(Context().get(), cancel, &response).ok());
  EXPECT_FALSE(response.found());
}

TEST_P(DecodeWorkerTest, RefusesBadInput) {
  tandem::v1::KvReservation reservation;
  EXPECT_EQ(Reserve("a", 0, 10, 1, &reservation).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Reserve("a", 10, 10, -1, &reservation).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Reserve("a", 10, 10, 65, &reservation).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  grpc::Status too_long = Reserve("a", 2000, 100, 1, &reservation);  // context is 2048
  EXPECT_EQ(too_long.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(too_long.error_message(), HasSubstr("context length"));
  // 10 samples x 63 blocks do not fit in 512 blocks; the samples reserved first are given back.
  grpc::Status full = Reserve("a", 1000, 10, 10, &reservation);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  tandem::v1::WorkerStats stats = RpcStats();
  EXPECT_EQ(stats.kv_blocks_used(), 0);
  EXPECT_EQ(stats.reservations(), 0);

  ASSERT_TRUE(Reserve("b", 20, 10, 2, &reservation).ok());
  tandem::v1::KvReservation duplicate;
  EXPECT_EQ(Reserve("b", 20, 10, 1, &duplicate).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  tandem::v1::StartRequest start;
  start.set_request_id("b");
  start.set_reservation_id(reservation.reservation_id());
  for (int i = 0; i < 20; ++i) start.add_prompt_token_ids(i);
  start.mutable_sampling()->set_n(2);
  start.add_choices()->mutable_first_token()->set_token_id(1);  // one of two
  StartResult wrong_choices = RunStart(start);
  EXPECT_EQ(wrong_choices.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(wrong_choices.status.error_message(), HasSubstr("2 samples"));
  // An out-of-range choice index, and a prompt of the wrong length.
  tandem::v1::PrefilledChoice* second = start.add_choices();
  second->set_index(5);
  EXPECT_EQ(RunStart(start).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  second->set_index(1);
  start.add_prompt_token_ids(0);
  EXPECT_EQ(RunStart(start).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // A refused Start leaves the reservation to Release.
  EXPECT_EQ(RpcStats().reservations(), 1);
  tandem::v1::StartRequest unknown = start;
  unknown.set_reservation_id("no-such-reservation");
  EXPECT_EQ(RunStart(unknown).status.error_code(), grpc::StatusCode::NOT_FOUND);
  tandem::v1::ReleaseRequest release;
  release.set_reservation_id(reservation.reservation_id());
  tandem::v1::ReleaseResponse released;
  ASSERT_TRUE(stub_->Release(Context().get(), release, &released).ok());
  EXPECT_TRUE(released.released());

  // Handshake: the worker's own layout passes, a different head_dim is refused by name.
  tandem::v1::HandshakeRequest handshake;
  handshake.set_worker_id("prefill-test");
  *handshake.mutable_layout() = reservation.endpoint().layout();
  tandem::v1::HandshakeResponse response;
  grpc::Status ok = stub_->Handshake(Context().get(), handshake, &response);
  ASSERT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(response.worker_id(), "decode-test");
  EXPECT_EQ(response.layout().SerializeAsString(),
            reservation.endpoint().layout().SerializeAsString());
  handshake.mutable_layout()->set_head_dim(response.layout().head_dim() * 2);
  grpc::Status mismatch = stub_->Handshake(Context().get(), handshake, &response);
  EXPECT_EQ(mismatch.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(mismatch.error_message(), HasSubstr("head_dim"));
}

TEST_P(DecodeWorkerTest, ServesMetricsAndHealth) {
  auto colocated_vocab = 512;
  engine::GenerateRequest request{"m", RandomPrompt(20, colocated_vocab, 4), {}};
  request.params.max_tokens = 5;
  request.params.ignore_eos = true;
  tandem::v1::KvReservation reservation;
  ASSERT_TRUE(Reserve("m", 20, 5, 1, &reservation).ok());
  const std::string during = HttpGet(worker_->metrics_port(), "/metrics");
  EXPECT_THAT(during, HasSubstr("\ntandem_kv_cache_blocks_used 2\n"));
  EXPECT_THAT(during, HasSubstr("\ntandem_kv_cache_blocks_reserved 2\n"));
  EXPECT_THAT(during, HasSubstr("\ntandem_decode_reservations 1\n"));
  StartResult result =
      RunStart(StartRequestFor(request, reservation, Prefill(request, reservation)));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();

  const std::string metrics = HttpGet(worker_->metrics_port(), "/metrics");
  EXPECT_THAT(metrics, HasSubstr("HTTP/1.1 200"));
  EXPECT_THAT(metrics, HasSubstr("# TYPE tandem_kv_cache_blocks_used gauge"));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_kv_cache_blocks_used 0\n"));
  EXPECT_THAT(metrics, HasSubstr(absl::StrCat("\ntandem_kv_cache_blocks_capacity ",
                                              reservation.endpoint().num_blocks(), "\n")));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_kv_cache_blocks_reserved 0\n"));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_num_requests_running 0\n"));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_num_requests_waiting 0\n"));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_decode_reservations 0\n"));
  EXPECT_THAT(metrics, HasSubstr("# TYPE tandem_decode_requests_total counter"));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_decode_requests_total 1\n"));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_generation_tokens_total 5\n"));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_preemptions_total 0\n"));
  // The CPU engine draws on the host (--sampling-device auto).
  EXPECT_THAT(metrics, HasSubstr("\ntandem_sampled_tokens_total{device=\"backend\"} 0\n"));
  EXPECT_THAT(metrics, ::testing::ContainsRegex("\ntandem_sampled_tokens_total\\{device=\"host\"\\} [1-9]"));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_graph_steps_total 0\n"));  // no graphs on the CPU
  EXPECT_THAT(metrics, HasSubstr("\ntandem_decode_reservations_expired_total 0\n"));
  EXPECT_THAT(HttpGet(worker_->metrics_port(), "/health"), HasSubstr("HTTP/1.1 200"));
  EXPECT_THAT(HttpGet(worker_->metrics_port(), "/nope"), HasSubstr("HTTP/1.1 404"));
}

TEST_P(DecodeWorkerTest, ShutdownEndsStreamsWithAnError) {
  OpenStream open = StartLong("cut", 1);
  ASSERT_NE(open.reader, nullptr);
  tandem::v1::KvReservation reservation;
  ASSERT_TRUE(Reserve("unstarted", 50, 10, 1, &reservation).ok());
  // The grace runs out with the stream paused mid-generation.
  worker_->Shutdown(absl::Milliseconds(100));
  EXPECT_TRUE(worker_->Stats().draining());
  tandem::v1::TokenEvent event;
  while (open.reader->Read(&event)) open.events.push_back(event);
  open.reader->Finish();
  ASSERT_GE(open.events.size(), 2u);
  EXPECT_EQ(open.events.back().error().code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE));
  EXPECT_EQ(open.events.back().finish_reason(), tandem::v1::FINISH_REASON_ABORT);
  const tandem::v1::WorkerStats stats = worker_->Stats();
  EXPECT_EQ(stats.kv_blocks_used(), 0);
  EXPECT_EQ(stats.reservations(), 0);
  EXPECT_EQ(stats.running(), 0);
  // New work is refused (the server is gone), and a second Shutdown returns at once.
  EXPECT_FALSE(Reserve("after", 10, 10, 1, &reservation).ok());
  worker_->Shutdown(absl::Seconds(10));
  worker_.reset();
}

int NumTokens(const std::vector<tandem::v1::TokenEvent>& events) {
  int total = 0;
  for (const tandem::v1::TokenEvent& e : events) total += e.token_ids_size();
  return total;
}

// Two decode workers: A drains while a request is mid-generation and parks it; its KV moves to
// B (this fixture's worker) by Handoff, and B continues it from the generated tokens. A's and
// B's streams together must equal an uninterrupted colocated run, token for token and byte for
// byte (greedy and seeded, one and two samples), and neither worker keeps a block.
TEST_P(DecodeWorkerTest, DrainHandsKvToAnotherWorker) {
  auto colocated = MakeEngine(engine::EngineRole::kColocated);
  ASSERT_NE(colocated, nullptr);
  const int vocab = colocated->config().vocab_size;
  struct Case {
    const char* name;
    float temperature;
    int n;
    const char* grammar = nullptr;  // structured output: B rebuilds the matcher from A's tokens
  };
  // A grammar that cannot end inside max_tokens: each repetition is two tokens (no token joins a
  // control character to a letter), so the samples run to the length limit as the others do.
  const char* kLongGrammar = "root ::= (\"\\x01\" [a-z]){120,}\n";
  for (const Case& c : {Case{"greedy-1", 0.0f, 1}, Case{"greedy-2", 0.0f, 2},
                        Case{"seeded-1", 0.8f, 1}, Case{"seeded-2", 0.8f, 2},
                        Case{"grammar-2", 0.8f, 2, kLongGrammar}}) {
    SCOPED_TRACE(c.name);
    constexpr int kPrompt = 37;
    constexpr int kMaxTokens = 240;
    engine::GenerateRequest request{c.name, RandomPrompt(kPrompt, vocab, 21), {}};
    request.params.temperature = c.temperature;
    request.params.seed = 99;
    request.params.n = c.n;
    request.params.max_tokens = kMaxTokens;
    request.params.ignore_eos = true;
    request.params.logprobs = 0;
    request.params.frequency_penalty = 0.5f;  // counts the tokens generated on A
    // Text is held back while it could begin this: B must rebuild what A held.
    request.params.stop = {"@@ never in the output @@"};
    if (c.grammar != nullptr) {
      request.params.structured = {engine::ConstraintKind::kGrammar, c.grammar};
    }
    auto expected = engine::GenerateAll(*colocated, {request});
    ASSERT_TRUE(expected.ok()) << expected.status();

    // A pauses after six tokens per sample (the prefilled one and five steps) and drains there.
    auto gate = std::make_shared<testing::StepGate>();
    std::unique_ptr<DecodeWorker> a =
        MakeWorker(absl::StrCat("decode-a-", c.name), absl::Seconds(10), gate->Hook());
    ASSERT_NE(a, nullptr);
    auto stub_a = StubFor(*a);
    tandem::v1::KvReservation reservation;
    ASSERT_TRUE(ReserveOn(*stub_a, c.name, kPrompt, kMaxTokens, c.n, &reservation).ok());
    tandem::v1::StartRequest start =
        StartRequestFor(request, reservation, Prefill(request, reservation));
    gate->Allow(5);
    auto context = Context();
    auto reader = stub_a->Start(context.get(), start);
    std::vector<tandem::v1::TokenEvent> a_events;
    tandem::v1::TokenEvent event;
    while (NumTokens(a_events) < 6 * c.n && reader->Read(&event)) a_events.push_back(event);
    ASSERT_TRUE(gate->WaitPaused());
    // Drain with no grace: A parks the request and waits for it to be handed off.
    const int64_t drain_start_ms = absl::ToUnixMillis(absl::Now());
    std::jthread drain([&] { a->Shutdown(absl::ZeroDuration()); });
    while (reader->Read(&event)) a_events.push_back(event);
    EXPECT_TRUE(reader->Finish().ok());
    EXPECT_EQ(NumTokens(a_events), 6 * c.n);  // nothing ran while paused
    ASSERT_FALSE(a_events.empty());
    const tandem::v1::TokenEvent& last = a_events.back();
    EXPECT_EQ(last.error().code(), static_cast<int>(grpc::StatusCode::UNAVAILABLE));
    ASSERT_TRUE(last.has_handoff()) << last.DebugString();
    const tandem::v1::KvHandoff handoff = last.handoff();
    ASSERT_EQ(handoff.samples_size(), c.n);
    EXPECT_EQ(handoff.worker_id(), absl::StrCat("decode-a-", c.name));
    // Parked at the drain, kept for handoff_ttl.
    EXPECT_GE(handoff.expires_unix_ms(), drain_start_ms + 10000);
    EXPECT_LE(handoff.expires_unix_ms(), absl::ToUnixMillis(absl::Now()) + 10000);

    // What A streamed; its ABORT finishes are the drain's, not the samples' ends.
    std::vector<SampleOutput> got(c.n);
    for (const tandem::v1::TokenEvent& e : a_events) {
      ASSERT_TRUE(e.index() >= 0 && e.index() < c.n);
      EXPECT_TRUE(e.finish_reason() == tandem::v1::FINISH_REASON_NONE ||
                  e.finish_reason() == tandem::v1::FINISH_REASON_ABORT);
      SampleOutput& s = got[e.index()];
      s.token_ids.insert(s.token_ids.end(), e.token_ids().begin(), e.token_ids().end());
      s.text += e.text();
      s.logprobs.insert(s.logprobs.end(), e.logprobs().begin(), e.logprobs().end());
    }
    const int kv_tokens = handoff.samples(0).num_kv_tokens();
    for (const tandem::v1::KvHandoff::Sample& s : handoff.samples()) {
      ASSERT_TRUE(s.index() >= 0 && s.index() < c.n);
      const std::vector<int32_t> generated(s.generated_token_ids().begin(),
                                           s.generated_token_ids().end());
      EXPECT_EQ(generated, got[s.index()].token_ids) << "sample " << s.index();
      EXPECT_LT(static_cast<int>(generated.size()), kMaxTokens) << "finished before the drain";
      // Every token's KV but the last sampled one's.
      EXPECT_EQ(s.num_kv_tokens(), kPrompt + s.generated_token_ids_size() - 1);
      EXPECT_EQ(s.sampler_state().size(), 32u);
      // Both samples decoded in the same steps, so one reservation takes both.
      ASSERT_EQ(s.num_kv_tokens(), kv_tokens);
    }
    EXPECT_GT(a->Stats().kv_blocks_used(), 0);  // parked

    // B: reserve for the KV, hand each sample off into its slice, continue them.
    tandem::v1::KvReservation target;
    ASSERT_TRUE(Reserve(absl::StrCat(c.name, "-b"), kv_tokens, kPrompt + kMaxTokens - kv_tokens,
                        c.n, &target)
                    .ok());
    tandem::v1::StartRequest cont;
    cont.set_request_id(absl::StrCat(c.name, "-b"));
    cont.set_reservation_id(target.reservation_id());
    for (int32_t t : request.prompt_tokens) cont.add_prompt_token_ids(t);
    *cont.mutable_sampling() = proto::ToProto(request.params);
    for (int i = 0; i < c.n; ++i) {
      const tandem::v1::KvHandoff::Sample& s = handoff.samples(i);
      tandem::v1::HandoffResponse moved;
      grpc::Status status = Handoff(*stub_a, c.name, s.index(), target, i, &moved);
      ASSERT_TRUE(status.ok()) << status.error_message();
      EXPECT_EQ(moved.num_kv_tokens(), kv_tokens);
      const int layers = colocated->config().num_layers;
      const int64_t block_bytes = engine::ModelRunner::KvBytesPerBlock(
          colocated->config(), 16, colocated->cache_layout().dtype);
      // Every layer's K and V rows of the sample's tokens, not the unused slots of its last
      // block.
      EXPECT_EQ(moved.kv_transfer_bytes(), block_bytes / 16 * kv_tokens) << layers;
      // A second handoff of the same sample finds nothing. After the last one nothing is
      // parked, so the draining worker may already be stopping its server: the call is then
      // refused (UNAVAILABLE) or cut (CANCELLED) instead.
      const grpc::StatusCode again = Handoff(*stub_a, c.name, s.index(), target, i).error_code();
      if (i + 1 < c.n) {
        EXPECT_EQ(again, grpc::StatusCode::NOT_FOUND);
      } else {
        EXPECT_TRUE(again == grpc::StatusCode::NOT_FOUND ||
                    again == grpc::StatusCode::UNAVAILABLE ||
                    again == grpc::StatusCode::CANCELLED)
            << again;
      }
      tandem::v1::PrefilledChoice* choice = cont.add_choices();
      choice->set_index(i);
      choice->set_sampler_state(s.sampler_state());
      *choice->mutable_generated_token_ids() = s.generated_token_ids();
    }
    // Nothing is parked any more: A's Shutdown returns, every block freed.
    drain.join();
    EXPECT_EQ(a->Stats().kv_blocks_used(), 0);
    a.reset();

    StartResult b = RunStart(cont);
    ASSERT_TRUE(b.status.ok()) << b.status.error_message();
    int new_tokens = 0;
    for (const tandem::v1::TokenEvent& e : b.events) {
      EXPECT_EQ(e.error().code(), 0);
      ASSERT_TRUE(e.index() >= 0 && e.index() < c.n);
      SampleOutput& s = got[handoff.samples(e.index()).index()];
      s.token_ids.insert(s.token_ids.end(), e.token_ids().begin(), e.token_ids().end());
      s.text += e.text();
      s.logprobs.insert(s.logprobs.end(), e.logprobs().begin(), e.logprobs().end());
      if (e.finish_reason() != tandem::v1::FINISH_REASON_NONE) s.finish_reason = e.finish_reason();
      new_tokens += e.token_ids_size();
    }
    for (int i = 0; i < c.n; ++i) {
      EXPECT_EQ(got[i].token_ids, (*expected)[0].choices[i].token_ids) << "sample " << i;
      EXPECT_EQ(got[i].text, (*expected)[0].choices[i].text) << "sample " << i;
      EXPECT_EQ(got[i].logprobs, (*expected)[0].choices[i].logprobs) << "sample " << i;
      EXPECT_EQ(got[i].finish_reason, tandem::v1::FINISH_REASON_LENGTH) << "sample " << i;
    }
    if (c.n == 2 && c.temperature > 0) EXPECT_NE(got[0].token_ids, got[1].token_ids);
    // B's usage counts what B generated, against the original prompt.
    ASSERT_TRUE(b.events.back().has_usage());
    EXPECT_EQ(b.events.back().usage().prompt_tokens(), kPrompt);
    EXPECT_EQ(b.events.back().usage().completion_tokens(), new_tokens);
    EXPECT_EQ(RpcStats().kv_blocks_used(), 0);
  }
}

TEST_P(DecodeWorkerTest, HandoffRefusesBadRequestsAndParkedKvExpires) {
  auto gate = std::make_shared<testing::StepGate>();
  std::unique_ptr<DecodeWorker> a =
      MakeWorker("decode-a", absl::Milliseconds(1500), gate->Hook());
  ASSERT_NE(a, nullptr);
  auto stub_a = StubFor(*a);
  // Both streams paused after their first token; the second Start's calls are taken meanwhile.
  OpenStream expiring = StartLong("expiring", 1, stub_a.get(), gate.get());
  OpenStream cancelled = StartLong("cancelled", 2, stub_a.get(), gate.get());
  ASSERT_NE(expiring.reader, nullptr);
  ASSERT_NE(cancelled.reader, nullptr);
  // The grace runs out with both still paused: both are parked.
  std::jthread drain([&] { a->Shutdown(absl::Milliseconds(50)); });
  tandem::v1::TokenEvent event;
  for (OpenStream* open : {&expiring, &cancelled}) {
    while (open->reader->Read(&event)) open->events.push_back(event);
    EXPECT_TRUE(open->reader->Finish().ok());
    ASSERT_TRUE(open->events.back().has_handoff());
  }
  const tandem::v1::KvHandoff handoff = expiring.events.back().handoff();
  ASSERT_EQ(handoff.samples_size(), 1);
  const int kv_tokens = handoff.samples(0).num_kv_tokens();
  ASSERT_GT(kv_tokens, 16);

  // A reservation on B one block too small.
  tandem::v1::KvReservation small;
  ASSERT_TRUE(Reserve("small", kv_tokens - 16, 10, 1, &small).ok());
  grpc::Status status = Handoff(*stub_a, "expiring", 0, small);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("blocks per sample"));
  tandem::v1::KvReservation fits;
  ASSERT_TRUE(Reserve("fits", kv_tokens, 10, 1, &fits).ok());
  EXPECT_EQ(Handoff(*stub_a, "expiring", 0, fits, /*target_index=*/1).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // Unknown request or sample.
  EXPECT_EQ(Handoff(*stub_a, "nobody", 0, fits).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Handoff(*stub_a, "expiring", 1, fits).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Handoff(*stub_a, "", 0, fits).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // An endpoint of another backend or layout.
  tandem::v1::KvReservation other = fits;
  other.mutable_endpoint()->set_backend(GetParam() == "ucx" ? "local" : "ucx");
  EXPECT_EQ(Handoff(*stub_a, "expiring", 0, other).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  other = fits;
  other.mutable_endpoint()->mutable_layout()->set_head_dim(7);
  EXPECT_EQ(Handoff(*stub_a, "expiring", 0, other).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  // Cancel frees a parked request at once.
  tandem::v1::CancelRequest cancel;
  cancel.set_request_id("cancelled");
  tandem::v1::CancelResponse cancel_response;
  ASSERT_TRUE(stub_a->Cancel(Context().get(), cancel, &cancel_response).ok());
  EXPECT_TRUE(cancel_response.found());
  EXPECT_EQ(Handoff(*stub_a, "cancelled", 0, fits).error_code(), grpc::StatusCode::NOT_FOUND);

  // Past its expiry the parked KV is gone and its blocks are free. With nothing parked any
  // more the draining worker may already have stopped serving (UNAVAILABLE).
  absl::SleepFor(absl::FromUnixMillis(handoff.expires_unix_ms()) - absl::Now() +
                 absl::Milliseconds(100));
  const grpc::StatusCode late = Handoff(*stub_a, "expiring", 0, fits).error_code();
  EXPECT_TRUE(late == grpc::StatusCode::NOT_FOUND || late == grpc::StatusCode::UNAVAILABLE ||
              late == grpc::StatusCode::CANCELLED)
      << late;
  // With nothing parked any more the drain ends.
  drain.join();
  const tandem::v1::WorkerStats stats = a->Stats();
  EXPECT_EQ(stats.kv_blocks_used(), 0);
  EXPECT_EQ(stats.running(), 0);
  a.reset();
  tandem::v1::ReleaseRequest release;
  tandem::v1::ReleaseResponse released;
  for (const tandem::v1::KvReservation* r : {&small, &fits}) {
    release.set_reservation_id(r->reservation_id());
    EXPECT_TRUE(stub_->Release(Context().get(), release, &released).ok());
  }
}

TEST(DecodeWorkerCreateTest, RefusesBadOptionsWithoutHanging) {
  DecodeWorkerOptions options;
  options.engine = EngineOptionsFor(engine::EngineRole::kDecode);
  options.kv_backend = "carrier-pigeon";
  EXPECT_EQ(DecodeWorker::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  // Fails after the gRPC server is up: everything started so far is stopped again.
  options.kv_backend = "local";
  options.metrics_address = "no-port";
  EXPECT_EQ(DecodeWorker::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.metrics_address.clear();
  options.engine.model_dir = "/nonexistent";
  EXPECT_FALSE(DecodeWorker::Create(options).ok());
  options = DecodeWorkerOptions();
  options.engine = EngineOptionsFor(engine::EngineRole::kDecode);
  options.kv_backend = "local";
  options.handoff_ttl = absl::Minutes(5);
  EXPECT_EQ(DecodeWorker::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Backends, DecodeWorkerTest, ::testing::Values("local", "ucx"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace tandem::decode_worker
