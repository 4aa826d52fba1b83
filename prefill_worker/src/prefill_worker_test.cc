// The prefill worker over real gRPC, with the test playing the decode side: a decode-role engine
// whose cache is registered with a kvtransfer agent, reservations built by hand, and the
// requests continued on it from the Submit responses. The output must equal a colocated
// engine's token for token, and no KV block may be left allocated on any path.
#include "tandem/prefill_worker/prefill_worker.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "step_gate.h"
#include "tandem/collective/gloo_communicator.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/kvtransfer/agent.h"
#include "tandem/proto/wire.h"
#include "tandem/v1/prefill.grpc.pb.h"
#include "tandem/worker/tensor_parallel_kv.h"
#include "kv_events_stream.h"
#include "tensor_parallel_support.h"
#include "test_models.h"

namespace tandem::prefill_worker {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kTinyKvBytes = 8ll << 20;
constexpr int64_t kSmallKvBytes = 40ll << 20;
// A prompt of many prefill chunks, to be held in its middle.
constexpr int kLongPromptLen = 1200;

engine::EngineOptions EngineOptionsFor(const std::string& model, int64_t kv_bytes,
                                       engine::EngineRole role) {
  engine::EngineOptions options;
  options.model_dir = model;
  options.num_threads = 2;
  options.kv_cache_bytes = kv_bytes;
  options.max_num_batched_tokens = 64;  // prompts span several prefill chunks
  options.role = role;
  return options;
}

std::string TinyQwen3() { return testing::TinyModel("qwen3", DType::kBF16); }
std::string SmallQwen3() { return testing::TinyModel("qwen3", DType::kBF16, "small"); }

// The decode worker's side, played by the test: a decode-role engine whose KV cache is
// registered (region 0) with an agent, reservations made with ReserveBlocks, and requests
// continued with AddPrefilled. Thread-safe.
class DecodeSide {
 public:
  DecodeSide(const std::string& backend, const std::string& model, int64_t kv_bytes,
             std::optional<DType> kv_cache_dtype = std::nullopt)
      : backend_(backend) {
    engine::EngineOptions options = EngineOptionsFor(model, kv_bytes, engine::EngineRole::kDecode);
    options.kv_cache_dtype = kv_cache_dtype;
    auto engine = engine::LlmEngine::Create(options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(engine).value();
    auto agent = kvtransfer::Agent::Create({.backend = backend, .name = "decode"});
    EXPECT_TRUE(agent.ok()) << agent.status();
    agent_ = std::move(agent).value();
    auto descriptor = agent_->RegisterMemory(0, engine_->kv_cache(), engine_->kv_cache_bytes());
    EXPECT_TRUE(descriptor.ok()) << descriptor.status();
    descriptor_ = *descriptor;
    address_ = agent_->address();
  }

  // Blocks for n samples of a prompt, as a decode worker's Reserve would answer. Given the
  // prompt's tokens, the blocks this side's prefix cache holds are shared
  // (num_cached_tokens), as a decode worker asked with ReserveRequest.prompt_token_ids does.
  tandem::v1::KvReservation Reserve(const std::string& id, int prompt_len, int n,
                                    std::span<const int32_t> prompt = {}) {
    std::lock_guard<std::mutex> lock(mu_);
    tandem::v1::KvReservation reservation;
    reservation.set_reservation_id("res-" + id);
    const int bs = engine_->kv_layout().block_size;
    reservation.set_blocks_per_choice((prompt_len + bs - 1) / bs);
    for (int c = 0; c < n; ++c) {
      int cached = 0;
      auto table = engine_->ReserveBlocks(prompt_len, prompt, "", &cached);
      EXPECT_TRUE(table.ok()) << table.status();
      for (int32_t b : *table) reservation.add_block_ids(b);
      reserved_[id].push_back(std::move(table).value());
      reservation.set_num_cached_tokens(cached);
    }
    tandem::v1::TransferEndpoint* endpoint = reservation.mutable_endpoint();
    endpoint->set_backend(backend_);
    endpoint->set_address(address_);
    endpoint->add_region_descriptors(descriptor_);
    endpoint->set_num_blocks(engine_->kv_layout().num_blocks);
    *endpoint->mutable_layout() = proto::EngineKvLayout(
        engine_->config(), engine_->kv_layout().block_size, engine_->kv_layout().dtype);
    reservation.set_expires_unix_ms(absl::ToUnixMillis(absl::Now() + absl::Seconds(120)));
    return reservation;
  }

  void Release(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    for (engine::BlockTable& table : reserved_[id]) engine_->FreeReservation(table);
    reserved_.erase(id);
  }

  // Continues a request from its Submit response (the reservation's blocks now hold its KV).
  absl::Status Continue(const engine::GenerateRequest& request,
                        const tandem::v1::SubmitResponse& response) {
    std::lock_guard<std::mutex> lock(mu_);
    // The worker pushed into the reservation before it answered Submit.
    kvtransfer::AcquireTransferred(engine_->kv_cache());
    std::vector<engine::PrefilledChoice> choices(response.choices_size());
    for (const tandem::v1::PrefilledChoice& wire : response.choices()) {
      auto choice = proto::FromProto(wire);
      if (!choice.ok()) return choice.status();
      choice->blocks = reserved_.at(request.request_id).at(wire.index());
      choices.at(wire.index()) = std::move(choice).value();
    }
    reserved_.erase(request.request_id);
    return engine_->AddPrefilled(request, std::move(choices));
  }

  // Runs every continued request to the end; the final output of each choice by request id.
  std::map<std::string, engine::RequestOutput> RunAll() {
    std::lock_guard<std::mutex> lock(mu_);
    std::map<std::string, engine::RequestOutput> got;
    while (engine_->has_unfinished()) {
      auto outputs = engine_->Step();
      EXPECT_TRUE(outputs.ok()) << outputs.status();
      if (!outputs.ok()) break;
      for (engine::RequestOutput& out : *outputs) {
        engine::RequestOutput& total = got[out.request_id];
        for (engine::ChoiceDelta& d : out.choices) {
          if (static_cast<int>(total.choices.size()) <= d.index) total.choices.resize(d.index + 1);
          engine::AccumulateDelta(total.choices[d.index], d);
        }
      }
    }
    return got;
  }

  int blocks_used() {
    std::lock_guard<std::mutex> lock(mu_);
    return engine_->stats().kv_blocks_used;
  }
  // The decode worker's agent goes away (its process died); the cache stays allocated.
  void DestroyAgent() {
    std::lock_guard<std::mutex> lock(mu_);
    agent_.reset();
  }
  const engine::LlmEngine& engine() const { return *engine_; }

 private:
  std::string backend_;
  std::mutex mu_;
  std::unique_ptr<engine::LlmEngine> engine_;
  std::unique_ptr<kvtransfer::Agent> agent_;
  std::string descriptor_;
  std::string address_;
  std::map<std::string, std::vector<engine::BlockTable>> reserved_;
};

std::unique_ptr<PrefillWorker> MakeWorker(const std::string& backend, const std::string& model,
                                          int64_t kv_bytes,
                                          std::function<bool()> before_step = nullptr) {
  PrefillWorkerOptions options;
  options.engine = EngineOptionsFor(model, kv_bytes, engine::EngineRole::kColocated);
  options.engine.before_step = std::move(before_step);
  options.worker_id = "prefill-test";
  options.metrics_address = "127.0.0.1:0";
  options.kv_backend = backend;
  auto worker = PrefillWorker::Create(options);
  EXPECT_TRUE(worker.ok()) << worker.status();
  return worker.ok() ? std::move(worker).value() : nullptr;
}

std::unique_ptr<tandem::v1::PrefillWorker::Stub> Connect(const PrefillWorker& worker) {
  return tandem::v1::PrefillWorker::NewStub(
      grpc::CreateChannel(worker.grpc_address(), grpc::InsecureChannelCredentials()));
}

tandem::v1::SubmitRequest MakeSubmit(const engine::GenerateRequest& request,
                                     const tandem::v1::KvReservation& reservation,
                                     absl::Duration deadline = absl::Seconds(60)) {
  tandem::v1::SubmitRequest submit;
  submit.set_request_id(request.request_id);
  submit.mutable_prompt_token_ids()->Add(request.prompt_tokens.begin(),
                                         request.prompt_tokens.end());
  *submit.mutable_sampling() = proto::ToProto(request.params);
  *submit.mutable_reservation() = reservation;
  submit.set_cache_salt(request.cache_salt);
  submit.set_deadline_unix_ms(absl::ToUnixMillis(absl::Now() + deadline));
  return submit;
}

struct SubmitResult {
  grpc::Status status;
  tandem::v1::SubmitResponse response;
};

SubmitResult CallSubmit(tandem::v1::PrefillWorker::Stub& stub,
                        const tandem::v1::SubmitRequest& submit,
                        grpc::ClientContext* context = nullptr) {
  grpc::ClientContext own;
  if (context == nullptr) {
    context = &own;
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  }
  SubmitResult result;
  result.status = stub.Submit(context, submit, &result.response);
  return result;
}

tandem::v1::WorkerStats CallStats(tandem::v1::PrefillWorker::Stub& stub) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  tandem::v1::WorkerStats stats;
  grpc::Status status = stub.Stats(&context, tandem::v1::StatsRequest(), &stats);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return stats;
}

tandem::v1::CancelResponse CallCancel(tandem::v1::PrefillWorker::Stub& stub,
                                      const std::string& id) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  tandem::v1::CancelRequest request;
  request.set_request_id(id);
  request.set_reason("test");
  tandem::v1::CancelResponse response;
  grpc::Status status = stub.Cancel(&context, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response;
}

// Waits (up to 60 s, a bound for a hang) until the worker holds no KV block and nothing runs.
void ExpectDrained(tandem::v1::PrefillWorker::Stub& stub) {
  tandem::v1::WorkerStats stats;
  const absl::Time until = absl::Now() + absl::Seconds(60);
  do {
    stats = CallStats(stub);
    if (stats.kv_blocks_used() == 0 && stats.running() == 0 && stats.waiting() == 0) break;
    absl::SleepFor(absl::Milliseconds(10));
  } while (absl::Now() < until);
  EXPECT_EQ(stats.kv_blocks_used(), 0);
  EXPECT_EQ(stats.running(), 0);
  EXPECT_EQ(stats.waiting(), 0);
  EXPECT_EQ(stats.queued_prefill_tokens(), 0);
}

std::vector<int32_t> RandomPrompt(int len, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> prompt(len);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % vocab);
  return prompt;
}

// Bytes of KV of `tokens` prompt tokens of one sample, every layer, K and V.
uint64_t PromptKvBytes(const engine::LlmEngine& engine, int tokens) {
  const engine::KvCacheLayout& layout = engine.cache_layout();
  return static_cast<uint64_t>(tokens) * layout.num_layers * 2 * layout.row_bytes();
}

// GET http://127.0.0.1:port/path; the whole response (status line, headers, body).
std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  std::string request = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  (void)!write(fd, request.data(), request.size());
  std::string response;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) response.append(buf, n);
  close(fd);
  return response;
}

TEST(PrefillWorkerCreateTest, BadOptionsFailWithoutHanging) {
  PrefillWorkerOptions options;
  options.engine = EngineOptionsFor(TinyQwen3(), kTinyKvBytes, engine::EngineRole::kColocated);
  options.kv_backend = "carrier-pigeon";
  EXPECT_EQ(PrefillWorker::Create(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.kv_backend = "local";
  options.grpc_address = "no-port-here";
  EXPECT_FALSE(PrefillWorker::Create(options).ok());
  options.grpc_address = "127.0.0.1:0";
  options.metrics_address = "127.0.0.1:99999";
  EXPECT_FALSE(PrefillWorker::Create(options).ok());
  options.metrics_address.clear();
  options.engine.model_dir = "/nonexistent";
  EXPECT_FALSE(PrefillWorker::Create(options).ok());
  options.engine.model_dir = TinyQwen3();
  auto worker = PrefillWorker::Create(options);
  ASSERT_TRUE(worker.ok()) << worker.status();
  EXPECT_EQ((*worker)->metrics_port(), 0);
  EXPECT_EQ((*worker)->Stats().role(), tandem::v1::WORKER_ROLE_PREFILL);
  EXPECT_THAT((*worker)->Stats().worker_id(), ::testing::StartsWith("prefill-"));
}

class PrefillWorkerTest : public ::testing::TestWithParam<std::string> {};

TEST_P(PrefillWorkerTest, ConcurrentSubmitsEqualColocatedTokenForToken) {
  const std::string backend = GetParam();
  auto worker = MakeWorker(backend, TinyQwen3(), kTinyKvBytes);
  ASSERT_NE(worker, nullptr);
  DecodeSide decode(backend, TinyQwen3(), kTinyKvBytes);
  auto colocated = engine::LlmEngine::Create(
      EngineOptionsFor(TinyQwen3(), kTinyKvBytes, engine::EngineRole::kColocated));
  ASSERT_TRUE(colocated.ok()) << colocated.status();
  const int vocab = (*colocated)->config().vocab_size;

  // Greedy and seeded (n = 2) requests over 1 to 4 prefill chunks; the last one's first token
  // is also its last (max_tokens 1), so the engine finishes it instead of handing it off.
  std::vector<engine::GenerateRequest> requests;
  for (int i = 0; i < 7; ++i) {
    engine::SamplingParams p;
    p.max_tokens = 10 + i;
    p.ignore_eos = true;
    p.logprobs = 1;
    if (i % 2 == 1) {
      p.temperature = 0.8f;
      p.seed = 40 + i;
      p.n = 2;
    } else {
      p.temperature = 0;
    }
    if (i == 6) p.max_tokens = 1;
    requests.push_back({absl::StrCat("req", i), RandomPrompt(30 + 35 * i, vocab, i), p});
  }
  auto expected = engine::GenerateAll(**colocated, requests);
  ASSERT_TRUE(expected.ok()) << expected.status();

  auto stub = Connect(*worker);
  std::vector<SubmitResult> results(requests.size());
  {
    std::vector<std::jthread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] {
        const engine::GenerateRequest& r = requests[i];
        tandem::v1::KvReservation reservation =
            decode.Reserve(r.request_id, static_cast<int>(r.prompt_tokens.size()), r.params.n);
        results[i] = CallSubmit(*stub, MakeSubmit(r, reservation));
      });
    }
  }

  for (size_t i = 0; i < requests.size(); ++i) {
    const engine::GenerateRequest& r = requests[i];
    const SubmitResult& result = results[i];
    ASSERT_TRUE(result.status.ok()) << i << ": " << result.status.error_message();
    const int prompt_len = static_cast<int>(r.prompt_tokens.size());
    EXPECT_EQ(result.response.num_prompt_tokens(), prompt_len);
    ASSERT_EQ(result.response.choices_size(), r.params.n);
    // Every sample's prompt KV, exactly once (nothing was preempted).
    EXPECT_EQ(result.response.kv_transfer_bytes(),
              r.params.n * PromptKvBytes(decode.engine(), prompt_len))
        << i;
    // Durations are reported; how much of the transfer hides behind compute depends on the
    // machine and is measured by bench/kv_overlap.py, not here.
    EXPECT_GT(result.response.kv_transfer_seconds(), 0.0) << i;
    EXPECT_GE(result.response.kv_transfer_exposed_seconds(), 0.0) << i;
    EXPECT_LE(result.response.kv_transfer_exposed_seconds(), result.response.kv_transfer_seconds())
        << i;
    EXPECT_GE(result.response.queue_seconds(), 0.0) << i;
    EXPECT_GT(result.response.prefill_seconds(), 0.0) << i;
    ASSERT_TRUE(decode.Continue(r, result.response).ok()) << i;
  }
  std::map<std::string, engine::RequestOutput> got = decode.RunAll();
  for (size_t i = 0; i < requests.size(); ++i) {
    const engine::RequestOutput& want = (*expected)[i];
    const engine::RequestOutput& have = got[requests[i].request_id];
    ASSERT_EQ(have.choices.size(), want.choices.size()) << i;
    for (size_t c = 0; c < want.choices.size(); ++c) {
      EXPECT_EQ(have.choices[c].token_ids, want.choices[c].token_ids) << i << "/" << c;
      EXPECT_EQ(have.choices[c].logprobs, want.choices[c].logprobs) << i << "/" << c;
      EXPECT_EQ(have.choices[c].text, want.choices[c].text) << i << "/" << c;
      EXPECT_EQ(have.choices[c].finish_reason, engine::FinishReason::kLength) << i << "/" << c;
    }
  }
  EXPECT_EQ(decode.blocks_used(), 0);
  ExpectDrained(*stub);

  tandem::v1::WorkerStats stats = CallStats(*stub);
  EXPECT_EQ(stats.role(), tandem::v1::WORKER_ROLE_PREFILL);
  EXPECT_EQ(stats.worker_id(), "prefill-test");
  EXPECT_GT(stats.kv_blocks_total(), 0);

  const std::string metrics = HttpGet(worker->metrics_port(), "/metrics");
  EXPECT_THAT(metrics, HasSubstr("200 OK"));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_kv_cache_blocks_used 0\n"));
  EXPECT_THAT(metrics, HasSubstr(absl::StrCat("\ntandem_kv_cache_blocks_capacity ",
                                              stats.kv_blocks_total(), "\n")));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_prefill_requests_total{code=\"OK\"} 7\n"));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_prefill_seconds_count 7\n"));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_prefill_queued_tokens 0\n"));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_kv_transfer_bytes_total "));
  EXPECT_THAT(metrics, HasSubstr("\ntandem_kv_transfer_exposed_seconds_total "));
  EXPECT_THAT(HttpGet(worker->metrics_port(), "/health"), HasSubstr("200 OK"));
  worker->Shutdown(absl::Seconds(5));
  worker->Shutdown(absl::Seconds(5));  // idempotent
}

TEST_P(PrefillWorkerTest, BadReservationsAreRefusedAndLeakNothing) {
  const std::string backend = GetParam();
  auto worker = MakeWorker(backend, TinyQwen3(), kTinyKvBytes);
  ASSERT_NE(worker, nullptr);
  DecodeSide decode(backend, TinyQwen3(), kTinyKvBytes);
  auto stub = Connect(*worker);
  engine::GenerateRequest request{"bad", RandomPrompt(100, 200, 1), {}};
  request.params.n = 2;
  request.params.temperature = 0;
  const tandem::v1::KvReservation good = decode.Reserve("bad", 100, 2);  // 2 x 7 blocks

  {  // The decode worker's cache has another head size.
    tandem::v1::SubmitRequest submit = MakeSubmit(request, good);
    auto* layout = submit.mutable_reservation()->mutable_endpoint()->mutable_layout();
    layout->set_head_dim(layout->head_dim() * 2);
    SubmitResult result = CallSubmit(*stub, submit);
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(result.status.error_message(), HasSubstr("head_dim"));
  }
  {  // Another dtype and block size: both named.
    tandem::v1::SubmitRequest submit = MakeSubmit(request, good);
    auto* layout = submit.mutable_reservation()->mutable_endpoint()->mutable_layout();
    layout->set_dtype(tandem::v1::KV_DTYPE_F32);
    layout->set_block_size(32);
    SubmitResult result = CallSubmit(*stub, submit);
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    // The checkpoint is bf16, so is the worker's cache (--kv-cache-dtype auto).
    EXPECT_THAT(result.status.error_message(), HasSubstr("dtype BF16 vs F32"));
    EXPECT_THAT(result.status.error_message(), HasSubstr("block_size 16 vs 32"));
  }
  {  // No layout at all.
    tandem::v1::SubmitRequest submit = MakeSubmit(request, good);
    submit.mutable_reservation()->mutable_endpoint()->clear_layout();
    EXPECT_EQ(CallSubmit(*stub, submit).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {  // Another kvtransfer backend.
    tandem::v1::SubmitRequest submit = MakeSubmit(request, good);
    submit.mutable_reservation()->mutable_endpoint()->set_backend(backend == "ucx" ? "local"
                                                                                   : "ucx");
    SubmitResult result = CallSubmit(*stub, submit);
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(result.status.error_message(), HasSubstr("backend"));
  }
  {  // A block id past the decode worker's cache.
    tandem::v1::SubmitRequest submit = MakeSubmit(request, good);
    const int bad_id = good.endpoint().num_blocks() + 3;
    submit.mutable_reservation()->set_block_ids(9, bad_id);
    SubmitResult result = CallSubmit(*stub, submit);
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(result.status.error_message(), HasSubstr(absl::StrCat("block id ", bad_id)));
  }
  {  // A negative one.
    tandem::v1::SubmitRequest submit = MakeSubmit(request, good);
    submit.mutable_reservation()->set_block_ids(0, -1);
    SubmitResult result = CallSubmit(*stub, submit);
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(result.status.error_message(), HasSubstr("block id -1"));
  }
  {  // One block short.
    tandem::v1::SubmitRequest submit = MakeSubmit(request, good);
    submit.mutable_reservation()->mutable_block_ids()->RemoveLast();
    SubmitResult result = CallSubmit(*stub, submit);
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(result.status.error_message(), HasSubstr("13 block ids"));
  }
  {  // Blocks for one sample of n = 2.
    tandem::v1::SubmitRequest submit = MakeSubmit(request, good);
    submit.mutable_sampling()->set_n(1);
    EXPECT_EQ(CallSubmit(*stub, submit).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {  // blocks_per_choice that does not fit the prompt.
    tandem::v1::SubmitRequest submit = MakeSubmit(request, good);
    submit.mutable_reservation()->set_blocks_per_choice(8);
    EXPECT_EQ(CallSubmit(*stub, submit).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {  // A block id twice.
    tandem::v1::SubmitRequest submit = MakeSubmit(request, good);
    submit.mutable_reservation()->set_block_ids(1, good.block_ids(0));
    EXPECT_EQ(CallSubmit(*stub, submit).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  }
  {  // A token outside the vocabulary (the engine's own validation).
    tandem::v1::SubmitRequest submit = MakeSubmit(request, good);
    submit.set_prompt_token_ids(5, 1 << 30);
    SubmitResult result = CallSubmit(*stub, submit);
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(result.status.error_message(), HasSubstr("vocabulary"));
  }
  {  // A deadline already passed.
    tandem::v1::SubmitRequest submit = MakeSubmit(request, good);
    submit.set_deadline_unix_ms(absl::ToUnixMillis(absl::Now() - absl::Seconds(1)));
    EXPECT_EQ(CallSubmit(*stub, submit).status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  ExpectDrained(*stub);

  // The handshake applies the same rule.
  {
    grpc::ClientContext context;
    tandem::v1::HandshakeRequest hello;
    hello.set_worker_id("decode-test");
    *hello.mutable_layout() = good.endpoint().layout();
    tandem::v1::HandshakeResponse response;
    grpc::Status status = stub->Handshake(&context, hello, &response);
    ASSERT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(response.worker_id(), "prefill-test");
    EXPECT_EQ(response.layout().SerializeAsString(), good.endpoint().layout().SerializeAsString());
  }
  {
    grpc::ClientContext context;
    tandem::v1::HandshakeRequest hello;
    *hello.mutable_layout() = good.endpoint().layout();
    hello.mutable_layout()->set_num_layers(99);
    tandem::v1::HandshakeResponse response;
    grpc::Status status = stub->Handshake(&context, hello, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_THAT(status.error_message(), HasSubstr("num_layers"));
  }

  // The good reservation still works after all that.
  SubmitResult result = CallSubmit(*stub, MakeSubmit(request, good));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.response.choices_size(), 2);
  EXPECT_EQ(result.response.kv_transfer_bytes(), 2 * PromptKvBytes(decode.engine(), 100));
  decode.Release("bad");
  EXPECT_EQ(decode.blocks_used(), 0);
  ExpectDrained(*stub);
}

// A decode worker whose KV cache holds another element type (--kv-cache-dtype fp8_e4m3 against
// the prefill worker's default, the bf16 checkpoint's type): the push would corrupt it, so the
// submit is refused, naming both.
TEST_P(PrefillWorkerTest, ADecodeWorkerWithAnotherKvCacheDtypeIsRefused) {
  const std::string backend = GetParam();
  auto worker = MakeWorker(backend, TinyQwen3(), kTinyKvBytes);
  ASSERT_NE(worker, nullptr);
  DecodeSide decode(backend, TinyQwen3(), kTinyKvBytes, DType::kF8E4M3);
  auto stub = Connect(*worker);
  engine::GenerateRequest request{"fp8", RandomPrompt(40, 200, 3), {}};
  request.params.temperature = 0;
  const tandem::v1::KvReservation reservation = decode.Reserve("fp8", 40, 1);
  EXPECT_EQ(reservation.endpoint().layout().dtype(), tandem::v1::KV_DTYPE_FP8_E4M3);
  SubmitResult result = CallSubmit(*stub, MakeSubmit(request, reservation));
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(result.status.error_message(), HasSubstr("dtype BF16 vs FP8_E4M3"));
  decode.Release("fp8");
  EXPECT_EQ(decode.blocks_used(), 0);
  ExpectDrained(*stub);
}

// A multi-turn conversation: each turn resends the history. The prefill worker computes only
// what its own prefix cache lacks (the previous prompt it computed) and pushes only what the
// decode side lacks (which also holds the KV of the previous answer it generated); the output
// equals a colocated engine's without any cache.
TEST_P(PrefillWorkerTest, CachedPrefixesAreNeitherComputedNorPushedAgain) {
  const std::string backend = GetParam();
  auto worker = MakeWorker(backend, TinyQwen3(), kTinyKvBytes);
  ASSERT_NE(worker, nullptr);
  DecodeSide decode(backend, TinyQwen3(), kTinyKvBytes);
  engine::EngineOptions reference_options =
      EngineOptionsFor(TinyQwen3(), kTinyKvBytes, engine::EngineRole::kColocated);
  reference_options.enable_prefix_caching = false;
  auto reference = engine::LlmEngine::Create(reference_options);
  ASSERT_TRUE(reference.ok()) << reference.status();
  auto stub = Connect(*worker);

  std::vector<int32_t> history = RandomPrompt(100, 500, 41);
  for (int turn = 0; turn < 3; ++turn) {
    SCOPED_TRACE(absl::StrCat("turn ", turn));
    engine::GenerateRequest request{absl::StrCat("turn", turn), history, {}};
    request.params.max_tokens = 10;
    request.params.ignore_eos = true;
    request.params.temperature = 0.7f;
    request.params.seed = 5 + turn;
    request.params.n = turn == 2 ? 2 : 1;
    auto expected = engine::GenerateAll(**reference, {request});
    ASSERT_TRUE(expected.ok()) << expected.status();

    const int len = static_cast<int>(history.size());
    const tandem::v1::KvReservation reservation =
        decode.Reserve(request.request_id, len, request.params.n, history);
    SubmitResult result = CallSubmit(*stub, MakeSubmit(request, reservation));
    ASSERT_TRUE(result.status.ok()) << result.status.error_message();
    const int decode_cached = reservation.num_cached_tokens();
    const int prefill_cached = result.response.num_cached_tokens();
    if (turn == 0) {
      EXPECT_EQ(decode_cached, 0);
      EXPECT_EQ(prefill_cached, 0);
    } else {
      // The decode side holds the previous prompt and all but the last of the 10 tokens it
      // generated (whole blocks); the prefill side only the previous prompt (whole blocks), and
      // a second sample finds the whole prompt but its last token cached by the first.
      const int previous = len - 30;
      EXPECT_EQ(decode_cached, (previous + 9) / 16 * 16);
      EXPECT_EQ(prefill_cached,
                previous / 16 * 16 + (request.params.n - 1) * ((len - 1) / 16 * 16));
    }
    EXPECT_EQ(result.response.kv_transfer_bytes(),
              request.params.n * (PromptKvBytes(decode.engine(), len) -
                                  PromptKvBytes(decode.engine(), decode_cached)));
    ASSERT_TRUE(decode.Continue(request, result.response).ok());
    std::map<std::string, engine::RequestOutput> got = decode.RunAll();
    for (int c = 0; c < request.params.n; ++c) {
      EXPECT_EQ(got[request.request_id].choices.at(c).token_ids,
                (*expected)[0].choices[c].token_ids);
    }
    EXPECT_EQ(decode.blocks_used(), 0);
    // The next turn: this one's answer (sample 0) and a new message.
    const auto& answer = got[request.request_id].choices.at(0).token_ids;
    history.insert(history.end(), answer.begin(), answer.end());
    const std::vector<int32_t> message = RandomPrompt(20, 500, 50 + turn);
    history.insert(history.end(), message.begin(), message.end());
  }
  ExpectDrained(*stub);
}

// KV events: a new stream begins with a snapshot of the hashes cached (none on a fresh worker),
// then names every block a request's prompt filled, by the hash the engine (and the router)
// gives it; a stream opened later finds them in its snapshot; shutting down ends every stream
// with UNAVAILABLE.
TEST(PrefillWorkerKvEventsTest, ASnapshotThenEveryBlockStoredUntilShutdown) {
  auto worker = MakeWorker("local", TinyQwen3(), kTinyKvBytes);
  ASSERT_NE(worker, nullptr);
  DecodeSide decode("local", TinyQwen3(), kTinyKvBytes);
  auto stub = Connect(*worker);

  worker_testing::KvEventsStream first(*stub);
  std::set<uint64_t> snapshot;
  int block_size = 0;
  ASSERT_TRUE(first.ReadSnapshot(&snapshot, &block_size));
  EXPECT_TRUE(snapshot.empty());

  const std::vector<int32_t> prompt = RandomPrompt(100, 500, 7);
  std::vector<uint64_t> hashes;
  engine::ExtendBlockHashes(engine::PrefixRoot("tenant"), prompt, block_size, hashes);
  ASSERT_EQ(hashes.size(), static_cast<size_t>(100 / block_size));
  engine::GenerateRequest request{"salted", prompt, {}};
  request.cache_salt = "tenant";
  request.params.max_tokens = 2;
  SubmitResult result =
      CallSubmit(*stub, MakeSubmit(request, decode.Reserve("salted", 100, 1)));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  decode.Release("salted");

  const std::set<uint64_t> expected(hashes.begin(), hashes.end());
  const std::set<uint64_t> stored = first.ReadUntilStored(expected);
  EXPECT_EQ(stored, expected);

  worker_testing::KvEventsStream second(*stub);
  std::set<uint64_t> later;
  ASSERT_TRUE(second.ReadSnapshot(&later, &block_size));
  EXPECT_EQ(later, stored);

  worker->Shutdown(absl::Seconds(5));
  EXPECT_EQ(first.Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(second.Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_P(PrefillWorkerTest, PreemptedSamplesArePushedAgainAndStillMatch) {
  // 20 blocks for 6 prompts of 13 blocks each, prefilled one after the other: while a prompt's
  // last pages are in flight its blocks are held, and the next prompt may have to be preempted
  // (and its pages pushed again once recomputed). Every request must still succeed and match.
  const std::string backend = GetParam();
  const int64_t block_bytes = 16 * 1024;  // tiny: 2 layers x K,V x 16 tokens x 2 heads x 32
  auto worker = MakeWorker(backend, TinyQwen3(), 20 * block_bytes);
  ASSERT_NE(worker, nullptr);
  DecodeSide decode(backend, TinyQwen3(), kTinyKvBytes);
  auto colocated = engine::LlmEngine::Create(
      EngineOptionsFor(TinyQwen3(), kTinyKvBytes, engine::EngineRole::kColocated));
  ASSERT_TRUE(colocated.ok()) << colocated.status();
  std::vector<engine::GenerateRequest> requests;
  for (int i = 0; i < 6; ++i) {
    engine::SamplingParams p;
    p.max_tokens = 8;
    p.ignore_eos = true;
    p.temperature = 0.9f;
    p.seed = 7 + i;
    requests.push_back({absl::StrCat("p", i), RandomPrompt(200, 500, 20 + i), p});
  }
  auto expected = engine::GenerateAll(**colocated, requests);
  ASSERT_TRUE(expected.ok()) << expected.status();

  auto stub = Connect(*worker);
  std::vector<SubmitResult> results(requests.size());
  {
    std::vector<std::jthread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] {
        tandem::v1::KvReservation reservation = decode.Reserve(requests[i].request_id, 200, 1);
        results[i] = CallSubmit(*stub, MakeSubmit(requests[i], reservation));
      });
    }
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(results[i].status.ok()) << i << ": " << results[i].status.error_message();
    EXPECT_GE(results[i].response.kv_transfer_bytes(), PromptKvBytes(decode.engine(), 200));
    ASSERT_TRUE(decode.Continue(requests[i], results[i].response).ok());
  }
  std::printf("preemptions: %ld\n", static_cast<long>(CallStats(*stub).preemptions_total()));
  std::map<std::string, engine::RequestOutput> got = decode.RunAll();
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(got[requests[i].request_id].choices.at(0).token_ids,
              (*expected)[i].choices[0].token_ids)
        << i;
  }
  EXPECT_EQ(decode.blocks_used(), 0);
  ExpectDrained(*stub);
}

// An embedding Submit (TASK_EMBED) carries no reservation and reaches no decode worker: the
// worker computes the prompt, alongside a generation, and answers the colocated engine's vector
// bit for bit, with no token, no KV pushed and no block left held. Malformed ones are refused.
TEST_P(PrefillWorkerTest, EmbeddingsAnswerTheColocatedVectorAndPushNothing) {
  const std::string backend = GetParam();
  auto worker = MakeWorker(backend, TinyQwen3(), kTinyKvBytes);
  ASSERT_NE(worker, nullptr);
  DecodeSide decode(backend, TinyQwen3(), kTinyKvBytes);
  auto colocated = engine::LlmEngine::Create(
      EngineOptionsFor(TinyQwen3(), kTinyKvBytes, engine::EngineRole::kColocated));
  ASSERT_TRUE(colocated.ok()) << colocated.status();
  const int vocab = (*colocated)->config().vocab_size;

  // One prompt within a chunk, one over three chunks, and a generation beside them.
  std::vector<engine::GenerateRequest> embeds;
  for (int i = 0; i < 2; ++i) {
    engine::GenerateRequest r{
        absl::StrCat("emb", i), RandomPrompt(20 + 150 * i, vocab, 70 + i), {}};
    r.task = engine::RequestTask::kEmbed;
    embeds.push_back(r);
  }
  auto expected = engine::GenerateAll(**colocated, embeds);
  ASSERT_TRUE(expected.ok()) << expected.status();
  engine::SamplingParams greedy;
  greedy.temperature = 0;
  greedy.max_tokens = 4;
  const engine::GenerateRequest gen{"gen", RandomPrompt(90, vocab, 77), greedy};

  auto stub = Connect(*worker);
  auto embed_submit = [](const engine::GenerateRequest& r) {
    tandem::v1::SubmitRequest submit = MakeSubmit(r, {});
    submit.clear_reservation();
    submit.set_task(proto::ToProto(r.task));
    return submit;
  };
  std::vector<SubmitResult> results(embeds.size());
  SubmitResult generated;
  {
    std::vector<std::jthread> threads;
    for (size_t i = 0; i < embeds.size(); ++i) {
      threads.emplace_back([&, i] { results[i] = CallSubmit(*stub, embed_submit(embeds[i])); });
    }
    threads.emplace_back([&] {
      tandem::v1::KvReservation reservation =
          decode.Reserve(gen.request_id, static_cast<int>(gen.prompt_tokens.size()), 1);
      generated = CallSubmit(*stub, MakeSubmit(gen, reservation));
    });
  }
  for (size_t i = 0; i < embeds.size(); ++i) {
    const SubmitResult& result = results[i];
    ASSERT_TRUE(result.status.ok()) << i << ": " << result.status.error_message();
    EXPECT_EQ(result.response.choices_size(), 0) << i;
    EXPECT_EQ(result.response.kv_transfer_bytes(), 0u) << i;
    EXPECT_EQ(result.response.num_prompt_tokens(),
              static_cast<int>(embeds[i].prompt_tokens.size()));
    const std::vector<float> have(result.response.embedding().begin(),
                                  result.response.embedding().end());
    ASSERT_EQ(have.size(), static_cast<size_t>((*colocated)->config().hidden_size)) << i;
    EXPECT_EQ(have, (*expected)[i].embedding) << i;
  }
  ASSERT_TRUE(generated.status.ok()) << generated.status.error_message();
  EXPECT_TRUE(generated.response.embedding().empty());
  ASSERT_TRUE(decode.Continue(gen, generated.response).ok());
  decode.RunAll();

  // Refused: a reservation with an embedding, more than one sample, a task from a newer router.
  tandem::v1::SubmitRequest bad = embed_submit(embeds[0]);
  bad.set_request_id("with-reservation");
  *bad.mutable_reservation() = decode.Reserve("with-reservation", 20, 1);
  SubmitResult refused = CallSubmit(*stub, bad);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.status.error_message(), HasSubstr("reservation"));
  decode.Release("with-reservation");
  bad = embed_submit(embeds[0]);
  bad.set_request_id("two");
  bad.mutable_sampling()->set_n(2);
  refused = CallSubmit(*stub, bad);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(refused.status.error_message(), HasSubstr("n must be 1"));
  bad = embed_submit(embeds[0]);
  bad.set_request_id("newer");
  bad.set_task(static_cast<tandem::v1::Task>(7));
  refused = CallSubmit(*stub, bad);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  EXPECT_EQ(decode.blocks_used(), 0);
  ExpectDrained(*stub);
  EXPECT_THAT(HttpGet(worker->metrics_port(), "/metrics"),
              HasSubstr("\ntandem_prefill_requests_total{code=\"OK\"} 3\n"));
}

INSTANTIATE_TEST_SUITE_P(Backends, PrefillWorkerTest, ::testing::Values("local", "ucx"));

// Requests caught in the middle of a long prefill on purpose: the worker's engine is paused at a
// StepGate after two of the prompt's 19 chunks, whatever the speed of the machine, while the
// worker goes on taking cancels, deadlines and a drain.
class MidPrefillTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    gate_ = std::make_shared<testing::StepGate>();
    worker_ = MakeWorker(GetParam(), TinyQwen3(), kTinyKvBytes, gate_->Hook());
    ASSERT_NE(worker_, nullptr);
    decode_ = std::make_unique<DecodeSide>(GetParam(), TinyQwen3(), kTinyKvBytes);
    stub_ = Connect(*worker_);
  }
  void TearDown() override { gate_->Open(); }

  engine::GenerateRequest LongRequest(const std::string& id) {
    engine::GenerateRequest request{id, RandomPrompt(kLongPromptLen, 500, 3), {}};
    request.params.temperature = 0;
    request.params.max_tokens = 4;
    return request;
  }

  std::shared_ptr<testing::StepGate> gate_;
  std::unique_ptr<PrefillWorker> worker_;
  std::unique_ptr<DecodeSide> decode_;
  std::unique_ptr<tandem::v1::PrefillWorker::Stub> stub_;
};

TEST_P(MidPrefillTest, DeadlinePassingMidPrefillFailsAndFreesBlocks) {
  engine::GenerateRequest request = LongRequest("late");
  {  // Unhindered, the request succeeds and its whole prompt KV is pushed.
    tandem::v1::KvReservation reservation = decode_->Reserve("late", kLongPromptLen, 1);
    SubmitResult full = CallSubmit(*stub_, MakeSubmit(request, reservation));
    ASSERT_TRUE(full.status.ok()) << full.status.error_message();
    EXPECT_EQ(full.response.kv_transfer_bytes(), PromptKvBytes(decode_->engine(), kLongPromptLen));
    decode_->Release("late");
  }
  // Paused after two chunks, the Submit's deadline, then the reservation's expiry, passes; the
  // worker's sweep fails the request without another step.
  for (const bool by_expiry : {false, true}) {
    SCOPED_TRACE(by_expiry ? "reservation expiry" : "submit deadline");
    // Its own cache_salt: the prompt computed above (and the chunks of the previous attempt)
    // stay in the worker's prefix cache, and this attempt must compute the prompt again.
    request.cache_salt = by_expiry ? "expiry" : "deadline";
    tandem::v1::KvReservation reservation = decode_->Reserve("late", kLongPromptLen, 1);
    const absl::Duration budget = absl::Milliseconds(500);
    if (by_expiry) {
      reservation.set_expires_unix_ms(absl::ToUnixMillis(absl::Now() + budget));
    }
    const int64_t passed_before = gate_->passed();
    gate_->Allow(2);
    SubmitResult result = CallSubmit(
        *stub_, MakeSubmit(request, reservation, by_expiry ? absl::Seconds(60) : budget));
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
        << result.status.error_message();
    // At most two chunks ran: the deadline, not the end of the prefill, ended it (fewer when the
    // deadline passed before the worker got to the request).
    EXPECT_LE(gate_->passed() - passed_before, 2);
    ExpectDrained(*stub_);
    decode_->Release("late");
    gate_->Open();
  }
}

TEST_P(MidPrefillTest, CancelRpcEndsSubmitWithCancelled) {
  engine::GenerateRequest request = LongRequest("doomed");
  tandem::v1::KvReservation reservation = decode_->Reserve("doomed", kLongPromptLen, 1);
  gate_->Allow(2);
  SubmitResult result;
  {
    std::jthread submit([&] { result = CallSubmit(*stub_, MakeSubmit(request, reservation)); });
    ASSERT_TRUE(gate_->WaitPaused());
    // The same id twice in flight is refused.
    EXPECT_EQ(CallSubmit(*stub_, MakeSubmit(request, reservation)).status.error_code(),
              grpc::StatusCode::ALREADY_EXISTS);
    EXPECT_TRUE(CallCancel(*stub_, "doomed").found());  // answers once the request is over
  }
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::CANCELLED)
      << result.status.error_message();
  EXPECT_EQ(gate_->passed(), 2);
  ExpectDrained(*stub_);
  EXPECT_FALSE(CallCancel(*stub_, "doomed").found());  // idempotent
  EXPECT_FALSE(CallCancel(*stub_, "never-seen").found());
  decode_->Release("doomed");
}

TEST_P(MidPrefillTest, ClientCancellingTheCallCancelsTheRequest) {
  engine::GenerateRequest request = LongRequest("gone");
  tandem::v1::KvReservation reservation = decode_->Reserve("gone", kLongPromptLen, 1);
  grpc::ClientContext context;
  gate_->Allow(2);
  SubmitResult result;
  {
    std::jthread submit(
        [&] { result = CallSubmit(*stub_, MakeSubmit(request, reservation), &context); });
    ASSERT_TRUE(gate_->WaitPaused());
    context.TryCancel();
  }
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::CANCELLED);
  // The worker notices the cancelled call and frees what the request held, still paused.
  ExpectDrained(*stub_);
  EXPECT_EQ(gate_->passed(), 2);
  decode_->Release("gone");

  // The worker goes on serving.
  gate_->Open();
  engine::GenerateRequest next{"next", RandomPrompt(100, 500, 4), {}};
  next.params.temperature = 0;
  reservation = decode_->Reserve("next", 100, 1);
  result = CallSubmit(*stub_, MakeSubmit(next, reservation));
  ASSERT_TRUE(result.status.ok()) << result.status.error_message();
  EXPECT_EQ(result.response.kv_transfer_bytes(), PromptKvBytes(decode_->engine(), 100));
  decode_->Release("next");
  ExpectDrained(*stub_);
}

TEST_P(MidPrefillTest, ShutdownCancelsWhatIsLeftWithUnavailable) {
  engine::GenerateRequest request = LongRequest("cut");
  tandem::v1::KvReservation reservation = decode_->Reserve("cut", kLongPromptLen, 1);
  gate_->Allow(2);
  SubmitResult result;
  {
    std::jthread submit([&] { result = CallSubmit(*stub_, MakeSubmit(request, reservation)); });
    ASSERT_TRUE(gate_->WaitPaused());
    // The grace runs out with the request still paused mid-prefill; the loop fails it.
    worker_->Shutdown(absl::Milliseconds(50));
  }
  EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << result.status.error_message();
  EXPECT_EQ(gate_->passed(), 2);
  EXPECT_TRUE(worker_->Stats().draining());
  EXPECT_EQ(worker_->Stats().kv_blocks_used(), 0);
  EXPECT_EQ(worker_->Stats().running(), 0);
  decode_->Release("cut");
}

INSTANTIATE_TEST_SUITE_P(Backends, MidPrefillTest, ::testing::Values("local", "ucx"));

// The decode worker's process dies: its agent goes away before or during a Submit (the worker's
// engine paused at a StepGate after two chunks, some pages already pushed).
TEST(PrefillWorkerPeerTest, DecodeAgentGoneFailsWithUnavailableAndLeaksNothing) {
  auto gate = std::make_shared<testing::StepGate>();
  auto worker = MakeWorker("ucx", SmallQwen3(), kSmallKvBytes, gate->Hook());
  ASSERT_NE(worker, nullptr);
  auto stub = Connect(*worker);
  engine::GenerateRequest request{"lost", RandomPrompt(kLongPromptLen, 1000, 5), {}};
  request.params.temperature = 0;

  {  // Gone before the Submit.
    DecodeSide decode("ucx", SmallQwen3(), kSmallKvBytes);
    tandem::v1::KvReservation reservation = decode.Reserve("lost", kLongPromptLen, 1);
    decode.DestroyAgent();
    SubmitResult result = CallSubmit(*stub, MakeSubmit(request, reservation));
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE)
        << result.status.error_message();
    ExpectDrained(*stub);
    decode.Release("lost");
  }
  {  // Gone in the middle of it.
    DecodeSide decode("ucx", SmallQwen3(), kSmallKvBytes);
    tandem::v1::KvReservation reservation = decode.Reserve("lost", kLongPromptLen, 1);
    SubmitResult result;
    gate->Allow(2);
    {
      std::jthread submit([&] { result = CallSubmit(*stub, MakeSubmit(request, reservation)); });
      ASSERT_TRUE(gate->WaitPaused());
      decode.DestroyAgent();
      gate->Open();
    }
    EXPECT_EQ(result.status.error_code(), grpc::StatusCode::UNAVAILABLE)
        << result.status.error_message();
    EXPECT_THAT(result.status.error_message(), HasSubstr("KV transfer failed"));
    ExpectDrained(*stub);
    decode.Release("lost");
  }
  {  // A healthy decode worker is served as before, with the same output as colocated.
    DecodeSide decode("ucx", SmallQwen3(), kSmallKvBytes);
    engine::GenerateRequest ok{"fine", RandomPrompt(150, 1000, 6), {}};
    ok.params.temperature = 0.7f;
    ok.params.seed = 11;
    ok.params.n = 2;
    ok.params.max_tokens = 6;
    ok.params.ignore_eos = true;
    tandem::v1::KvReservation reservation = decode.Reserve("fine", 150, 2);
    SubmitResult result = CallSubmit(*stub, MakeSubmit(ok, reservation));
    ASSERT_TRUE(result.status.ok()) << result.status.error_message();
    ASSERT_TRUE(decode.Continue(ok, result.response).ok());
    auto got = decode.RunAll();
    auto colocated = engine::LlmEngine::Create(
        EngineOptionsFor(SmallQwen3(), kSmallKvBytes, engine::EngineRole::kColocated));
    ASSERT_TRUE(colocated.ok());
    auto expected = engine::GenerateAll(**colocated, {ok});
    ASSERT_TRUE(expected.ok());
    for (int c = 0; c < 2; ++c) {
      EXPECT_EQ(got["fine"].choices.at(c).token_ids, (*expected)[0].choices[c].token_ids) << c;
    }
    EXPECT_EQ(decode.blocks_used(), 0);
    ExpectDrained(*stub);
  }
}


// A prefill worker whose engine is a tensor-parallel group of 2 ranks over Gloo, its follower
// (RunKvFollower, with a ucx agent of its own) on a thread as its own process would run it.
// Each rank holds one of the tiny model's 2 KV heads, so the follower pushes head 1.
class PrefillGroup {
 public:
  explicit PrefillGroup(const std::string& model) : dir_("prefill_group") {
    follower_ = std::jthread([this, model] {
      auto comm = collective::CreateGlooCommunicator(
          {.rank = 1, .size = 2, .file_store_dir = dir_.path()});
      if (!comm.ok()) {
        follower_status_ = comm.status();
        return;
      }
      engine::EngineOptions options =
          EngineOptionsFor(model, kTinyKvBytes, engine::EngineRole::kColocated);
      options.tensor_parallel = comm->get();
      follower_status_ = worker::RunKvFollower(
          options, {.backend = "ucx", .name = "prefill-test/rank1", .role = "prefill"});
    });
    auto comm =
        collective::CreateGlooCommunicator({.rank = 0, .size = 2, .file_store_dir = dir_.path()});
    EXPECT_TRUE(comm.ok()) << comm.status();
    if (!comm.ok()) return;
    comm_ = std::move(comm).value();
    PrefillWorkerOptions options;
    options.engine = EngineOptionsFor(model, kTinyKvBytes, engine::EngineRole::kColocated);
    options.engine.tensor_parallel = comm_.get();
    options.worker_id = "prefill-test";
    options.kv_backend = "ucx";
    auto worker = PrefillWorker::Create(options);
    EXPECT_TRUE(worker.ok()) << worker.status();
    if (worker.ok()) worker_ = std::move(worker).value();
  }
  ~PrefillGroup() {
    worker_.reset();  // destroys the leader's engine, which stops the follower
    comm_.reset();
    follower_.join();
    EXPECT_TRUE(follower_status_.ok()) << follower_status_;
  }
  PrefillWorker* worker() { return worker_.get(); }

 private:
  testing::TempDir dir_;
  std::unique_ptr<collective::Communicator> comm_;
  std::unique_ptr<PrefillWorker> worker_;
  absl::Status follower_status_;
  std::jthread follower_;
};

// A TCP listener that accepts nothing: a connect to it gets no answer until it closes.
class SilentListener {
 public:
  SilentListener() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), len), 0);
    EXPECT_EQ(listen(fd_, 16), 0);
    EXPECT_EQ(getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    port_ = ntohs(addr.sin_port);
  }
  ~SilentListener() { Close(); }
  // A ucx agent address at this listener.
  std::string address() const { return absl::StrCat("127.0.0.1:", port_, "#1"); }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// A follower connects to a decode rank it has not reached before in the background, before the
// request going there enters the engine: the steps of other requests go on meanwhile. Request
// "stuck" goes to a decode group whose rank 1 (the follower's to reach) never answers; request
// "moving", submitted after it, to a healthy decode worker, and is answered while "stuck" still
// waits. When the silent rank's listener closes, "stuck" fails with a clear error and nothing
// leaks.
TEST(PrefillWorkerTensorParallelTest, AFollowersConnectHoldsUpNoStep) {
  const std::string model = TinyQwen3();
  DecodeSide decode("ucx", model, kTinyKvBytes);
  SilentListener silent;
  PrefillGroup group(model);
  ASSERT_NE(group.worker(), nullptr);
  auto stub = Connect(*group.worker());

  engine::GenerateRequest stuck{"stuck", RandomPrompt(40, 500, 21), {}};
  stuck.params.temperature = 0;
  stuck.params.max_tokens = 4;
  // A decode group of 2 ranks, one head each: rank 0 is `decode`'s agent (this group's rank 0
  // reaches it when the Submit arrives), rank 1 the silent listener (the follower's).
  tandem::v1::KvReservation to_group = decode.Reserve("stuck", 40, 1);
  {
    tandem::v1::TransferEndpoint whole = to_group.endpoint();
    tandem::v1::TransferEndpoint* group_endpoint = to_group.mutable_endpoint();
    group_endpoint->mutable_layout()->set_tp_size(2);
    group_endpoint->mutable_layout()->set_num_kv_heads(1);
    for (int r = 0; r < 2; ++r) {
      tandem::v1::TransferEndpoint* rank = group_endpoint->add_tp_ranks();
      *rank = whole;
      rank->mutable_layout()->set_tp_size(2);
      rank->mutable_layout()->set_tp_rank(r);
      rank->mutable_layout()->set_kv_head_begin(r);
      rank->mutable_layout()->set_num_kv_heads(1);
    }
    group_endpoint->mutable_tp_ranks(1)->set_address(silent.address());
  }
  SubmitResult stuck_result;
  std::atomic<bool> stuck_answered{false};
  std::jthread stuck_call([&] {
    stuck_result = CallSubmit(*stub, MakeSubmit(stuck, to_group));
    stuck_answered = true;
  });
  // Until the worker has taken it (its prompt counts as queued).
  for (int i = 0; i < 1000 && CallStats(*stub).queued_prefill_tokens() < 40; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }

  engine::GenerateRequest moving{"moving", RandomPrompt(70, 500, 22), {}};
  moving.params.temperature = 0;
  moving.params.max_tokens = 6;
  moving.params.ignore_eos = true;
  SubmitResult moved = CallSubmit(*stub, MakeSubmit(moving, decode.Reserve("moving", 70, 1)));
  ASSERT_TRUE(moved.status.ok()) << moved.status.error_message();
  EXPECT_FALSE(stuck_answered.load()) << "a step waited for the follower's connect to rank 1";
  ASSERT_TRUE(decode.Continue(moving, moved.response).ok());
  auto got = decode.RunAll();
  auto colocated = engine::LlmEngine::Create(
      EngineOptionsFor(model, kTinyKvBytes, engine::EngineRole::kColocated));
  ASSERT_TRUE(colocated.ok()) << colocated.status();
  auto expected = engine::GenerateAll(**colocated, {moving});
  ASSERT_TRUE(expected.ok()) << expected.status();
  EXPECT_EQ(got["moving"].choices.at(0).token_ids, (*expected)[0].choices[0].token_ids)
      << "the follower's head reached the decode worker";

  silent.Close();
  stuck_call.join();
  EXPECT_THAT(stuck_result.status.error_code(),
              ::testing::AnyOf(grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::DEADLINE_EXCEEDED))
      << stuck_result.status.error_message();
  EXPECT_THAT(stuck_result.status.error_message(),
              HasSubstr("request stuck: cannot reach the decode worker: tensor-parallel rank 1: "
                        "decode rank 1"));
  decode.Release("stuck");
  EXPECT_EQ(decode.blocks_used(), 0);
  ExpectDrained(*stub);
}

}  // namespace
}  // namespace tandem::prefill_worker
