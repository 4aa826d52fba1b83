// The OpenAI server's internals, shared by openai_server.cc (startup, routing, auth, errors),
// openai_endpoints.cc (metrics, models, tokenize, readiness), openai_generation.cc (completions
// and chat: requests, streaming, responses), openai_embeddings.cc and openai_metrics.cc. Nothing
// outside router/src includes this.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "tandem/base/job_pool.h"
#include "tandem/engine/sampling_metrics.h"
#include "tandem/engine/speculative_metrics.h"
#include "tandem/metrics/registry.h"
#include "tandem/router/openai_request.h"
#include "tandem/router/openai_server.h"
#include "tandem/router/tool_calls.h"

namespace tandem::router::internal {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string Dump(const json& j);
std::string Sse(const json& j);
double Seconds(Clock::duration d);
int64_t UnixSeconds();

// JSON has no -Infinity: a token the model rules out reports OpenAI's floor instead.
double JsonLogprob(float lp);

std::string NewId(const char* prefix);

// A path or name from a request, cut short for an error message.
std::string Excerpt(const std::string& s);

int HttpStatusOf(const absl::Status& status, int overload_status);

struct ApiMetrics {
  metrics::Registry registry;
  prometheus::Counter* prompt_tokens;
  prometheus::Counter* embeddings;  // inputs embedded by /v1/embeddings
  prometheus::Counter* generation_tokens;
  prometheus::Histogram* ttft;
  prometheus::Histogram* itl;
  // Streamed output: from the generator handing it over to its chunk in the client's socket.
  prometheus::Histogram* stream_write;
  prometheus::Histogram* e2e;
  prometheus::Histogram* tpot;
  prometheus::Gauge* running;
  prometheus::Gauge* waiting;
  prometheus::Gauge* kv_used;
  prometheus::Gauge* kv_total;
  prometheus::Counter* preemptions;
  prometheus::Gauge* in_flight;
  prometheus::Gauge* connections;
  // Disaggregated serving: the pools and failovers (zero with one engine).
  prometheus::Counter* prefill_retries;
  prometheus::Counter* migrations;
  prometheus::Counter* kv_handoffs;
  prometheus::Counter* kv_handoff_bytes;
  prometheus::Gauge* workers[2][2];  // [prefill, decode][up, down]
  // Prefix cache (the engine's, or the prefill pool's summed) and KV-aware routing.
  prometheus::Counter* prefix_queries;
  prometheus::Counter* prefix_hits;
  std::mutex kv_index_mu;                  // scrapes may run at once
  std::set<std::string> kv_index_workers;  // workers with a series now; guarded by kv_index_mu
  // Sets the prefix-cache and routing series from the generator's stats and counters.
  void PrefixCacheAndRouting(const engine::EngineStats& stats,
                             const engine::GeneratorCounters& counters);
  // Speculative decoding of the engine, or the decode pool's summed, and where the tokens were
  // drawn (both pools' summed); guarded by spec_mu.
  engine::SpeculativeMetrics spec{registry};
  engine::SamplingMetrics sampling{registry};
  std::mutex spec_mu;
  // Tensor parallelism of a colocated engine (zero without it).
  prometheus::Counter* collective_seconds;
  prometheus::Counter* collective_bytes;

  // SLO accounting (see Classify). A pair is null where that objective is not configured;
  // "both" exists when any is.
  struct SloPair {
    prometheus::Counter* met = nullptr;
    prometheus::Counter* missed = nullptr;
  };
  std::optional<double> ttft_slo;
  std::optional<double> tpot_slo;
  SloPair slo_ttft, slo_tpot, slo_both;
  prometheus::Counter* slo_met;

  static constexpr const char* kRequestsHelp =
      "Generation requests finished, by finish reason of their first choice (abort: the client "
      "went away; error: the engine failed).";
  static constexpr const char* kHttpHelp = "HTTP responses sent, by status code.";
  static constexpr const char* kSloHelp =
      "Requests that finished normally (stop or length), by service-level objective (ttft, "
      "tpot, or both: every configured one) and whether they met it.";

  explicit ApiMetrics(const ApiServerOptions& options);
  // Accounts one request that finished normally: its time to first token and, for two tokens
  // or more, its time per output token (a request with fewer meets any TPOT objective).
  void Classify(double ttft_seconds, std::optional<double> tpot_seconds);
  prometheus::Counter* Finished(const std::string& reason) {
    return &registry.Counter("tandem_requests_total", kRequestsHelp, {{"finish_reason", reason}});
  }
  prometheus::Counter* Http(int code) {
    return &registry.Counter("tandem_http_responses_total", kHttpHelp,
                               {{"code", std::to_string(code)}});
  }
};

class ApiServerImpl;

// One generation request from acceptance to its last byte. Every method runs on the
// connection's I/O thread (engine outputs are handed over with http::HttpExchange::Run), so it needs
// no lock.
struct Generation {
  struct Choice {
    std::string text;
    engine::FinishReason finish = engine::FinishReason::kNone;
    int text_offset = 0;
    int tokens = 0;           // generated so far
    json logprobs = nullptr;  // the API's logprobs object, grown token by token
    // Streaming with tools: the text parsed into content and tool calls as it arrives, and the
    // ids given to the calls.
    std::optional<ToolCallParser> tool_parser;
    std::vector<std::string> tool_call_ids;
    std::string echo;                 // completions with echo: the prompt's text, shown first
    double cumulative_logprob = 0.0;  // best_of ranks samples by it
  };
  // One engine request: the chat's, or one per prompt of a completions batch.
  struct Request {
    std::string id;
    int prompt_tokens = 0;
    int generation_tokens = 0;
    bool finished = false;
  };

  ApiServerImpl* server = nullptr;  // outlives every request (see ApiServerImpl::Shutdown)
  std::shared_ptr<http::HttpExchange> exchange;
  ApiKind kind = ApiKind::kCompletion;
  std::string id;
  std::string model;
  int64_t created = 0;
  bool stream = false;
  bool include_usage = false;
  int logprobs = -1;
  int n = 1;           // choices returned per prompt
  int per_prompt = 1;  // samples drawn per prompt (best_of, or n)
  std::vector<Request> requests;
  // /v1/responses: the chat generation rendered as a Responses object or events, with the
  // request's fields the object repeats (instructions, tools, text, ...).
  bool responses = false;
  json response_fields = json::object();
  struct ResponsesStream {
    int sequence = 0;
    json output = json::array();  // items done
    json open = nullptr;          // the item being streamed
    std::string text;             // its text or arguments so far
  } responses_stream;
  // Chat with tools (other than tool_choice none): the output is parsed for tool calls.
  ToolCallFormat tool_format = ToolCallFormat::kNone;
  int prompt_tokens = 0;
  int generation_tokens = 0;
  Clock::time_point start;
  Clock::time_point first_token;
  Clock::time_point last_token;
  bool seen_token = false;
  bool done = false;
  std::vector<Choice> choices;
  // The output being streamed: when it was received, and whether a chunk of it was timed.
  Clock::time_point output_received;
  bool output_timed = true;

  // An output of requests[request]; its choice i is choices[request * per_prompt + i].
  // `received`: when the generator handed it over (tandem_stream_write_seconds starts there).
  void OnOutput(int request, const engine::RequestOutput& out, const absl::Status& status,
                Clock::time_point received);
  void OnClientGone();

 private:
  // Sends a chunk of the output being streamed; its first one observes, once written,
  // tandem_stream_write_seconds.
  void SendOutputChunk(std::string data);
  json LogprobsFor(const engine::ChoiceDelta& delta, Choice& choice) const;
  void Merge(json& into, const json& delta) const;
  json Chunk(json choices) const;
  json Usage() const;
  // The finish reason a choice reports: "tool_calls" for a sample that stopped after calls.
  json FinishReason(const Choice& choice, int num_calls) const;
  // A streamed chat choice's delta text as chunks: content and tool-call deltas.
  void StreamChat(int index, const engine::ChoiceDelta& d, Choice& c, json logprobs);
  // A whole chat message: content and, when the output held calls, tool_calls.
  json ChatMessage(const Choice& c, int* num_calls) const;
  // /v1/responses (openai_responses.cc).
  json ResponseObject(const std::string& status, json output) const;
  std::string ResponseStatus(const Choice& c) const;
  json ResponseOutput(const Choice& c) const;
  void ResponsesEvent(const std::string& type, json data);
  void ResponsesCloseItem();
  void ResponsesText(const std::string& text);
  void ResponsesDelta(const engine::ChoiceDelta& d, Choice& c);
  void ResponsesFinish(const Choice& c);

 public:
  void ResponsesStart();

 private:
  void Fail(const absl::Status& status);
  void Finalize(const std::string& reason);
};

class ApiServerImpl : public ApiServer {
 public:
  ApiServerImpl(ApiServerOptions options, std::unique_ptr<engine::Generator> engine)
      : options_(std::move(options)),
        metrics_(options_),
        started_(UnixSeconds()),
        engine_(std::move(engine)),
        outputs_written_here_(engine_->callbacks_may_work()) {
    vocab_size_ = std::min(engine_->config().vocab_size, engine_->tokenizer().vocab_size());
  }
  ~ApiServerImpl() override { Shutdown(std::chrono::milliseconds(0)); }

  absl::Status Start();

  int port() const override { return http_->port(); }

  void Shutdown(std::chrono::milliseconds grace) override;

  // --- used by Generation ---
  ApiMetrics& metrics() { return metrics_; }
  engine::Generator& engine() { return *engine_; }
  void RequestFinished() { active_.fetch_sub(1); }
  std::string TokenString(int32_t id) const {
    if (id < 0 || id >= engine_->tokenizer().vocab_size()) return "";
    return text::ReplaceInvalidUtf8(engine_->tokenizer().TokenBytes(id));
  }
  std::string TokenBytes(int32_t id) const {
    if (id < 0 || id >= engine_->tokenizer().vocab_size()) return "";
    return engine_->tokenizer().TokenBytes(id);
  }

  void Reply(http::HttpExchange& ex, int status, std::string body, http::HttpHeaders headers = {},
             std::string content_type = "application/json") {
    metrics_.Http(status)->Increment();
    ex.Reply(http::HttpResponse{status, std::move(content_type), std::move(body), std::move(headers)});
  }

  void ReplyError(http::HttpExchange& ex, const absl::Status& status);

  // Hands an engine output's handling (`deliver`) to its connection, from the generator's
  // callback: written from this thread where the generator's callbacks may work (the router's
  // gRPC threads, no hop to an I/O thread), handed over where they must return at once (an
  // engine thread, which goes on with its next step).
  void DeliverOutput(http::HttpExchange& ex, std::function<void()> deliver) {
    if (outputs_written_here_) return ex.RunHere(std::move(deliver));
    ex.Run(std::move(deliver));
  }

 private:
  enum class Endpoint {
    kHealth,
    kReady,
    kMetrics,
    kModels,
    kCompletions,
    kChatCompletions,
    kResponses,
    kTokenize,
    kDetokenize,
    kEmbeddings
  };
  struct Route {
    const char* path;
    const char* method;
    Endpoint endpoint;
  };

  void Handle(const std::shared_ptr<http::HttpExchange>& ex);
  absl::Status CheckApiKey(const http::HttpRequest& req) const;
  void MethodNotAllowed(http::HttpExchange& ex, const char* allowed);
  absl::Status CheckModel(const json& body) const;
  absl::Status CheckModelName(const std::string& name) const;
  void HandleMetrics(http::HttpExchange& ex);
  json ModelObject(const std::string& name) const;
  void HandleModels(http::HttpExchange& ex);
  void HandleModel(http::HttpExchange& ex, const std::string& name);
  // Prompt tokens of a chat: the template's text, tokenized without adding special tokens
  // unless asked (the template writes those it wants).
  absl::StatusOr<std::vector<int32_t>> ChatTokens(const json& messages, bool add_generation_prompt,
                                                  bool add_special_tokens,
                                                  const ToolRequest& tools = {}) const;
  // Turns a chat request's tools into what generation needs: tool_choice "required" or a named
  // function becomes the grammar of the calls (params.structured); a 400 when the tools cannot be
  // served (no tool-call format for this model, another constraint, a schema the grammar cannot
  // enforce).
  absl::Status PrepareTools(CompletionRequest& r) const;
  // A completions prompt with `suffix` in the tokenizer's fill-in-the-middle format, or a 400
  // naming suffix when it has none.
  absl::StatusOr<std::vector<int32_t>> FillInTheMiddle(std::vector<int32_t> prompt,
                                                       const std::string& suffix) const;
  void HandleTokenize(http::HttpExchange& ex);
  void HandleDetokenize(http::HttpExchange& ex);
  // /v1/embeddings (openai_embeddings.cc): one embedding engine request per input, answered
  // once all have their vectors.
  void HandleEmbeddings(const std::shared_ptr<http::HttpExchange>& ex);
  void HandleReady(const std::shared_ptr<http::HttpExchange>& ex);
  void ReadyDone(const absl::Status& status);
  // Completions, chat completions, and /v1/responses (`responses`: translated into a chat).
  // `constraint_ready`: the request comes back from the ConstraintCompiler (its grammar is in
  // the engine's cache); otherwise a constrained request goes there first.
  void HandleGeneration(const std::shared_ptr<http::HttpExchange>& ex, ApiKind kind,
                        bool responses = false, bool constraint_ready = false);

  // Declared first, destroyed last: everything below may use them until it is gone.
  ApiServerOptions options_;
  ApiMetrics metrics_;
  std::atomic<int> active_{0};
  std::atomic<bool> draining_{false};
  int vocab_size_ = 0;
  int64_t started_ = 0;
  ToolCallFormat tool_format_ = ToolCallFormat::kNone;  // set by Start

  std::mutex ready_mu_;
  std::optional<Clock::time_point> ready_at_;                 // guarded by ready_mu_
  bool ready_probing_ = false;                                // guarded by ready_mu_
  std::vector<std::shared_ptr<http::HttpExchange>> ready_waiters_;  // guarded by ready_mu_

  std::mutex shutdown_mu_;
  bool shut_down_ = false;  // guarded by shutdown_mu_

  // The HTTP server is stopped before the engine goes, and destroyed after it (its I/O
  // context holds handlers that the engine's last callbacks posted).
  std::unique_ptr<http::HttpServer> http_;
  // http_ for the request handlers: the server accepts (and may dispatch a request) as soon as
  // it is bound, before Create returns and http_ is assigned on the starting thread.
  std::atomic<http::HttpServer*> http_for_handlers_{nullptr};
  std::unique_ptr<engine::Generator> engine_;
  // engine_->callbacks_may_work(), read once: outputs still arrive while engine_ is destroyed.
  const bool outputs_written_here_;
  // Stopped (joined) before engine_ goes: its jobs use the engine.
  // Compiles structured-output constraints off the HTTP I/O threads: a request whose grammar may
  // take seconds to compile (a bounded JSON schema on a 128k vocabulary) waits for one of these
  // threads, then goes on on its connection's thread, where Submit finds the grammar cached.
  std::unique_ptr<base::JobPool> compiler_;
};

}  // namespace tandem::router::internal
