#include "tandem/router/openai_server.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tandem/base/status_macros.h"
#include "tandem/metrics/registry.h"
#include "tandem/router/openai_request.h"

namespace tandem::router {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string Sse(const json& j) { return absl::StrCat("data: ", Dump(j), "\n\n"); }

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// JSON has no -Infinity: a token the model rules out reports OpenAI's floor instead.
double JsonLogprob(float lp) { return std::isfinite(lp) ? std::max(lp, -9999.0f) : -9999.0; }

std::string NewId(const char* prefix) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(rng()),
                static_cast<unsigned long long>(rng()));
  return absl::StrCat(prefix, buf);
}

// Compares without an early exit, so the time taken says nothing about the key.
bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

// A path or name from a request, cut short for an error message.
std::string Excerpt(const std::string& s) { return s.size() <= 64 ? s : s.substr(0, 64) + "..."; }

// Bucket bounds for time per output token: finer than LatencyBuckets() below 10 ms, where
// GPU decode steps fall.
std::vector<double> TpotBuckets() {
  return {0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03,
          0.04,   0.05,  0.075, 0.1,   0.15,  0.2,    0.3,  0.5,   0.75, 1.0,   2.5};
}

struct ApiMetrics {
  metrics::Registry registry;
  prometheus::Counter* prompt_tokens;
  prometheus::Counter* generation_tokens;
  prometheus::Histogram* ttft;
  prometheus::Histogram* itl;
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

  explicit ApiMetrics(const ApiServerOptions& options)
      : ttft_slo(options.ttft_slo_seconds), tpot_slo(options.tpot_slo_seconds) {
    for (const char* reason : {"stop", "length", "abort", "error"}) Finished(reason);
    prompt_tokens = &registry.Counter("tandem_prompt_tokens_total", "Prompt tokens processed.");
    generation_tokens =
        &registry.Counter("tandem_generation_tokens_total", "Tokens generated, all choices.");
    ttft = &registry.Histogram("tandem_time_to_first_token_seconds",
                                 "Time from request arrival to its first generated token.",
                                 metrics::LatencyBuckets());
    itl = &registry.Histogram("tandem_inter_token_latency_seconds",
                                "Time between successive generated tokens of a request.",
                                metrics::LatencyBuckets());
    e2e = &registry.Histogram("tandem_e2e_request_latency_seconds",
                                "Time from request arrival to its last token.", metrics::LatencyBuckets());
    running =
        &registry.Gauge("tandem_requests_running", "Requests in the engine's running batch.");
    waiting = &registry.Gauge("tandem_requests_waiting", "Requests queued in the engine.");
    kv_used = &registry.Gauge("tandem_kv_cache_blocks_used",
                              "KV cache blocks in use (on a decode worker, reserved ones too).");
    // Not "_total": Prometheus reserves that suffix for counters (promtool refuses a gauge).
    kv_total = &registry.Gauge("tandem_kv_cache_blocks_capacity", "KV cache blocks in all.");
    preemptions =
        &registry.Counter("tandem_preemptions_total",
                          "Sequences preempted (their KV dropped and recomputed).");
    in_flight = &registry.Gauge("tandem_api_requests_in_flight",
                                  "Generation requests accepted by the API and not yet finished.");
    connections = &registry.Gauge("tandem_http_connections", "Open HTTP connections.");
    constexpr const char* kRetriesHelp =
        "Requests that went on elsewhere after a worker went away under them (prefill: started "
        "over before the first token; decode: continued mid-stream on another decode worker by "
        "recomputing their KV; kv_handoff: samples a draining decode worker parked, moved with "
        "their KV to another decode worker).";
    prefill_retries =
        &registry.Counter("tandem_request_retries_total", kRetriesHelp, {{"phase", "prefill"}});
    migrations =
        &registry.Counter("tandem_request_retries_total", kRetriesHelp, {{"phase", "decode"}});
    kv_handoffs = &registry.Counter("tandem_request_retries_total", kRetriesHelp,
                                      {{"phase", "kv_handoff"}});
    kv_handoff_bytes = &registry.Counter(
        "tandem_kv_handoff_bytes_total",
        "KV bytes moved from draining decode workers to others by KV handoff.");
    const char* roles[2] = {"prefill", "decode"};
    const char* states[2] = {"up", "down"};
    for (int r = 0; r < 2; ++r) {
      for (int st = 0; st < 2; ++st) {
        workers[r][st] = &registry.Gauge(
            "tandem_workers",
            "Workers in the router's pools, by role and by whether their last Stats answered.",
            {{"role", roles[r]}, {"state", states[st]}});
      }
    }

    tpot = &registry.Histogram(
        "tandem_time_per_output_token_seconds",
        "Per request that finished normally with at least 2 tokens: (end - first token) / "
        "(tokens of its longest choice - 1).",
        TpotBuckets());
    auto pair = [&](const char* slo) {
      return SloPair{
          &registry.Counter("tandem_requests_slo_total", kSloHelp,
                              {{"slo", slo}, {"result", "met"}}),
          &registry.Counter("tandem_requests_slo_total", kSloHelp,
                              {{"slo", slo}, {"result", "missed"}}),
      };
    };
    if (ttft_slo) slo_ttft = pair("ttft");
    if (tpot_slo) slo_tpot = pair("tpot");
    if (ttft_slo || tpot_slo) slo_both = pair("both");
    slo_met = &registry.Counter(
        "tandem_requests_slo_met_total",
        "Requests that finished normally (stop or length) meeting every configured service-level "
        "objective (all of them when none is configured); its rate is the goodput.");
    if (ttft_slo) {
      registry.Gauge("tandem_slo_ttft_seconds", "The time-to-first-token objective.")
          .Set(*ttft_slo);
    }
    if (tpot_slo) {
      registry.Gauge("tandem_slo_tpot_seconds", "The time-per-output-token objective.")
          .Set(*tpot_slo);
    }
  }

  // Accounts one request that finished normally: its time to first token and, for two tokens
  // or more, its time per output token (a request with fewer meets any TPOT objective).
  void Classify(double ttft_seconds, std::optional<double> tpot_seconds) {
    if (tpot_seconds) tpot->Observe(*tpot_seconds);
    bool all_met = true;
    auto count = [&](const SloPair& pair, bool met) {
      (met ? pair.met : pair.missed)->Increment();
      all_met = all_met && met;
    };
    if (ttft_slo) count(slo_ttft, ttft_seconds <= *ttft_slo);
    if (tpot_slo) count(slo_tpot, !tpot_seconds || *tpot_seconds <= *tpot_slo);
    if (ttft_slo || tpot_slo) count(slo_both, all_met);
    if (all_met) slo_met->Increment();
  }
  prometheus::Counter* Finished(const std::string& reason) {
    return &registry.Counter("tandem_requests_total", kRequestsHelp, {{"finish_reason", reason}});
  }
  prometheus::Counter* Http(int code) {
    return &registry.Counter("tandem_http_responses_total", kHttpHelp,
                               {{"code", std::to_string(code)}});
  }
};

int HttpStatusOf(const absl::Status& status, int overload_status) {
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
      return overload_status;
    case absl::StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

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
  int prompt_tokens = 0;
  int generation_tokens = 0;
  Clock::time_point start;
  Clock::time_point first_token;
  Clock::time_point last_token;
  bool seen_token = false;
  bool done = false;
  std::vector<Choice> choices;

  void OnOutput(const engine::RequestOutput& out, const absl::Status& status);
  void OnClientGone();

 private:
  json LogprobsFor(const engine::ChoiceDelta& delta, Choice& choice) const;
  void Merge(json& into, const json& delta) const;
  json Chunk(json choices) const;
  json Usage() const;
  void Fail(const absl::Status& status);
  void Finalize(const std::string& reason);
};

class ApiServerImpl : public ApiServer {
 public:
  ApiServerImpl(ApiServerOptions options, std::unique_ptr<engine::Generator> engine)
      : options_(std::move(options)),
        metrics_(options_),
        started_(UnixSeconds()),
        engine_(std::move(engine)) {
    vocab_size_ = std::min(engine_->config().vocab_size, engine_->tokenizer().vocab_size());
  }
  ~ApiServerImpl() override { Shutdown(std::chrono::milliseconds(0)); }

  absl::Status Start() {
    if (options_.served_model_names.empty()) {
      return absl::InvalidArgumentError("at least one served model name is required");
    }
    if (options_.overload_status != 529 && options_.overload_status != 503) {
      return absl::InvalidArgumentError(
          absl::StrCat("overload status must be 529 or 503, got ", options_.overload_status));
    }
    for (const auto& [name, slo] : {std::pair{"TTFT", options_.ttft_slo_seconds},
                                    std::pair{"TPOT", options_.tpot_slo_seconds}}) {
      if (slo && !(std::isfinite(*slo) && *slo > 0)) {
        return absl::InvalidArgumentError(
            absl::StrCat("the ", name, " SLO must be a finite number of seconds > 0, got ", *slo));
      }
    }
    http::HttpServerOptions http = options_.http;
    http.error_response = [this](int status, const std::string& message) {
      metrics_.Http(status)->Increment();
      std::string code;
      if (status == 413) code = "request_too_large";
      if (status == 431) code = "request_header_fields_too_large";
      return http::HttpResponse{status, "application/json", ErrorBody(status, message, "", code), {}};
    };
    TANDEM_ASSIGN_OR_RETURN(http_, http::HttpServer::Create(http, [this](auto ex) { Handle(ex); }));
    http_for_handlers_.store(http_.get(), std::memory_order_release);
    return absl::OkStatus();
  }

  int port() const override { return http_->port(); }

  void Shutdown(std::chrono::milliseconds grace) override {
    std::lock_guard<std::mutex> lock(shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
    if (http_) {
      http_->StopAccepting();
      draining_ = true;
      const Clock::time_point deadline = Clock::now() + grace;
      // A finished generation may still have its last bytes queued on the socket: wait for
      // those too, so that no stream in flight is cut by the shutdown.
      while ((active_.load() > 0 || http_->num_responses_in_flight() > 0) &&
             Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      http_->Stop();
    }
    // Outputs of requests still running are posted to the stopped I/O context and dropped.
    engine_.reset();
  }

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

  void ReplyError(http::HttpExchange& ex, const absl::Status& status) {
    const int code = HttpStatusOf(status, options_.overload_status);
    http::HttpHeaders headers;
    if (status.code() == absl::StatusCode::kResourceExhausted ||
        status.code() == absl::StatusCode::kUnavailable) {
      headers.emplace_back("Retry-After", "1");
    }
    if (code == 401) headers.emplace_back("WWW-Authenticate", "Bearer");
    std::string message(status.message());
    if (code == 500) {
      std::fprintf(stderr, "tandem: internal error: %s\n", message.c_str());
    }
    Reply(ex, code, ErrorBody(code, message, ParamOf(status), ErrorCodeOf(status)),
          std::move(headers));
  }

 private:
  enum class Endpoint {
    kHealth,
    kReady,
    kMetrics,
    kModels,
    kCompletions,
    kChatCompletions,
    kTokenize,
    kDetokenize
  };
  struct Route {
    const char* path;
    const char* method;
    Endpoint endpoint;
  };

  void Handle(const std::shared_ptr<http::HttpExchange>& ex) {
    static constexpr Route kRoutes[] = {
        {"/health", "GET", Endpoint::kHealth},
        {"/ready", "GET", Endpoint::kReady},
        {"/metrics", "GET", Endpoint::kMetrics},
        {"/v1/models", "GET", Endpoint::kModels},
        {"/v1/completions", "POST", Endpoint::kCompletions},
        {"/v1/chat/completions", "POST", Endpoint::kChatCompletions},
        {"/tokenize", "POST", Endpoint::kTokenize},
        {"/detokenize", "POST", Endpoint::kDetokenize},
    };
    const http::HttpRequest& req = ex->request();
    // Deny by default: only the probes (liveness, readiness) and metrics when made public skip
    // the key. /ready runs one cached one-token generation at most every 10 s, whoever asks.
    const bool is_public = req.path == "/health" || req.path == "/ready" ||
                           (req.path == "/metrics" && options_.metrics_public);
    if (!is_public && !options_.api_key.empty()) {
      if (absl::Status auth = CheckApiKey(req); !auth.ok()) return ReplyError(*ex, auth);
    }
    const Route* route = nullptr;
    for (const Route& r : kRoutes) {
      if (req.path == r.path) route = &r;
    }
    const std::string kModelPrefix = "/v1/models/";
    if (route == nullptr && absl::StartsWith(req.path, kModelPrefix)) {
      if (req.method != "GET") return MethodNotAllowed(*ex, "GET");
      return HandleModel(*ex, req.path.substr(kModelPrefix.size()));
    }
    if (route == nullptr) {
      return ReplyError(
          *ex, WithErrorCode(absl::NotFoundError(absl::StrCat("no route for ", Excerpt(req.path))),
                             "not_found"));
    }
    if (req.method != route->method) return MethodNotAllowed(*ex, route->method);
    switch (route->endpoint) {
      case Endpoint::kHealth:
        return Reply(*ex, 200, R"({"status":"ok"})");
      case Endpoint::kReady:
        return HandleReady(ex);
      case Endpoint::kMetrics:
        return HandleMetrics(*ex);
      case Endpoint::kModels:
        return HandleModels(*ex);
      case Endpoint::kCompletions:
        return HandleGeneration(ex, ApiKind::kCompletion);
      case Endpoint::kChatCompletions:
        return HandleGeneration(ex, ApiKind::kChat);
      case Endpoint::kTokenize:
        return HandleTokenize(*ex);
      case Endpoint::kDetokenize:
        return HandleDetokenize(*ex);
    }
  }

  absl::Status CheckApiKey(const http::HttpRequest& req) const {
    std::optional<std::string> auth = req.header("authorization");
    if (!auth) {
      return WithErrorCode(absl::UnauthenticatedError(
                               "missing API key: send the header 'Authorization: Bearer <key>'"),
                           "invalid_api_key");
    }
    std::string value = *auth;
    if (value.size() < 7 || !absl::EqualsIgnoreCase(value.substr(0, 7), "bearer ")) {
      return WithErrorCode(
          absl::UnauthenticatedError("the Authorization header must be 'Bearer <key>'"),
          "invalid_api_key");
    }
    std::string key(absl::StripAsciiWhitespace(value.substr(7)));
    if (!ConstantTimeEquals(key, options_.api_key)) {
      return WithErrorCode(absl::UnauthenticatedError("incorrect API key provided"),
                           "invalid_api_key");
    }
    return absl::OkStatus();
  }

  void MethodNotAllowed(http::HttpExchange& ex, const char* allowed) {
    std::string message =
        absl::StrCat("method ", Excerpt(ex.request().method), " is not allowed on ",
                     Excerpt(ex.request().path), "; use ", allowed);
    Reply(ex, 405, ErrorBody(405, message, "", "method_not_allowed"), {{"Allow", allowed}});
  }

  absl::Status CheckModel(const json& body) const {
    auto it = body.find("model");
    if (it == body.end() || it->is_null()) return absl::OkStatus();
    if (!it->is_string()) return ParamError("model", "model must be a string");
    return CheckModelName(it->get<std::string>());
  }

  absl::Status CheckModelName(const std::string& name) const {
    for (const std::string& served : options_.served_model_names) {
      if (name == served) return absl::OkStatus();
    }
    absl::Status s = absl::NotFoundError(absl::StrCat("the model '", Excerpt(name),
                                                      "' does not exist; this server serves '",
                                                      options_.served_model_names.front(), "'"));
    s.SetPayload("type.tandem/openai.param", absl::Cord("model"));
    return WithErrorCode(s, "model_not_found");
  }

  void HandleMetrics(http::HttpExchange& ex) {
    engine::EngineStats stats = engine_->stats();
    metrics_.running->Set(stats.running);
    metrics_.waiting->Set(stats.waiting);
    metrics_.kv_used->Set(stats.kv_blocks_used);
    metrics_.kv_total->Set(stats.kv_blocks_total);
    metrics::AdvanceTo(*metrics_.preemptions, static_cast<double>(stats.preemptions));
    const engine::GeneratorCounters counters = engine_->counters();
    metrics::AdvanceTo(*metrics_.prefill_retries, static_cast<double>(counters.prefill_retries));
    metrics::AdvanceTo(*metrics_.migrations, static_cast<double>(counters.migrations));
    metrics::AdvanceTo(*metrics_.kv_handoffs, static_cast<double>(counters.kv_handoffs));
    metrics::AdvanceTo(*metrics_.kv_handoff_bytes, static_cast<double>(counters.kv_handoff_bytes));
    metrics_.workers[0][0]->Set(counters.prefill_workers_up);
    metrics_.workers[0][1]->Set(counters.prefill_workers - counters.prefill_workers_up);
    metrics_.workers[1][0]->Set(counters.decode_workers_up);
    metrics_.workers[1][1]->Set(counters.decode_workers - counters.decode_workers_up);
    metrics_.in_flight->Set(active_.load());
    if (const http::HttpServer* server = http_for_handlers_.load(std::memory_order_acquire)) {
      metrics_.connections->Set(server->num_connections());
    }
    // Counted before rendering so the scrape includes itself.
    metrics_.Http(200)->Increment();
    ex.Reply(http::HttpResponse{200, metrics::Registry::kContentType, metrics_.registry.Render(), {}});
  }

  json ModelObject(const std::string& name) const {
    return {{"id", name},
            {"object", "model"},
            {"created", started_},
            {"owned_by", "tandem"},
            {"root", options_.served_model_names.front()},
            {"max_model_len", engine_->max_model_len()}};
  }

  void HandleModels(http::HttpExchange& ex) {
    json data = json::array();
    for (const std::string& name : options_.served_model_names) data.push_back(ModelObject(name));
    Reply(ex, 200, Dump({{"object", "list"}, {"data", data}}));
  }

  void HandleModel(http::HttpExchange& ex, const std::string& name) {
    if (absl::Status s = CheckModelName(name); !s.ok()) return ReplyError(ex, s);
    Reply(ex, 200, Dump(ModelObject(name)));
  }

  // Prompt tokens of a chat: the template's text, tokenized without adding special tokens
  // unless asked (the template writes those it wants).
  absl::StatusOr<std::vector<int32_t>> ChatTokens(const json& messages, bool add_generation_prompt,
                                                  bool add_special_tokens) const {
    absl::StatusOr<std::string> text =
        engine_->chat_formatter().Apply(messages, add_generation_prompt);
    if (!text.ok()) {
      return ParamError("messages", absl::StrCat("the chat template refused the messages: ",
                                                 text.status().message()));
    }
    return engine_->tokenizer().Encode(*text, add_special_tokens);
  }

  void HandleTokenize(http::HttpExchange& ex) {
    absl::StatusOr<json> body = ParseJsonObject(ex.request().body);
    if (!body.ok()) return ReplyError(ex, body.status());
    if (absl::Status s = CheckModel(*body); !s.ok()) return ReplyError(ex, s);
    auto get_bool = [&](const char* name, bool fallback) -> absl::StatusOr<bool> {
      auto it = body->find(name);
      if (it == body->end() || it->is_null()) return fallback;
      if (!it->is_boolean()) return ParamError(name, absl::StrCat(name, " must be a boolean"));
      return it->get<bool>();
    };
    const bool has_prompt = body->contains("prompt") && !(*body)["prompt"].is_null();
    const bool has_messages = body->contains("messages") && !(*body)["messages"].is_null();
    if (has_prompt == has_messages) {
      return ReplyError(ex, ParamError("prompt", "give exactly one of prompt and messages"));
    }
    std::vector<int32_t> tokens;
    if (has_prompt) {
      const json& prompt = (*body)["prompt"];
      if (!prompt.is_string())
        return ReplyError(ex, ParamError("prompt", "prompt must be a string"));
      absl::StatusOr<bool> special = get_bool("add_special_tokens", true);
      if (!special.ok()) return ReplyError(ex, special.status());
      tokens = engine_->tokenizer().Encode(prompt.get<std::string>(), *special);
    } else {
      absl::StatusOr<json> messages = NormalizeMessages((*body)["messages"]);
      if (!messages.ok()) return ReplyError(ex, messages.status());
      absl::StatusOr<bool> special = get_bool("add_special_tokens", false);
      if (!special.ok()) return ReplyError(ex, special.status());
      absl::StatusOr<bool> gen = get_bool("add_generation_prompt", true);
      if (!gen.ok()) return ReplyError(ex, gen.status());
      absl::StatusOr<std::vector<int32_t>> chat = ChatTokens(*messages, *gen, *special);
      if (!chat.ok()) return ReplyError(ex, chat.status());
      tokens = std::move(*chat);
    }
    Reply(ex, 200,
          Dump({{"tokens", tokens},
                {"count", tokens.size()},
                {"max_model_len", engine_->max_model_len()}}));
  }

  void HandleDetokenize(http::HttpExchange& ex) {
    absl::StatusOr<json> body = ParseJsonObject(ex.request().body);
    if (!body.ok()) return ReplyError(ex, body.status());
    if (absl::Status s = CheckModel(*body); !s.ok()) return ReplyError(ex, s);
    auto it = body->find("tokens");
    if (it == body->end() || it->is_null()) {
      return ReplyError(ex, ParamError("tokens", "tokens is required"));
    }
    absl::StatusOr<std::vector<int32_t>> ids = ParseTokenIds(*it, "tokens", vocab_size_);
    if (!ids.ok()) return ReplyError(ex, ids.status());
    std::string text = engine_->tokenizer().Decode(*ids, /*skip_special_tokens=*/false);
    Reply(ex, 200, Dump({{"prompt", text}}));
  }

  void HandleReady(const std::shared_ptr<http::HttpExchange>& ex) {
    {
      std::lock_guard<std::mutex> lock(ready_mu_);
      if (ready_at_ && Clock::now() - *ready_at_ < options_.ready_cache) {
        return Reply(*ex, 200, R"({"status":"ready"})");
      }
      ready_waiters_.push_back(ex);
      if (ready_probing_) return;
      ready_probing_ = true;
    }
    // One greedy token through the whole engine path: tokenizer, scheduler, model, sampler.
    engine::GenerateRequest probe;
    probe.request_id = NewId("ready-");
    probe.prompt_tokens = engine_->tokenizer().Encode("ready", /*add_special_tokens=*/true);
    if (probe.prompt_tokens.empty()) probe.prompt_tokens = {0};
    probe.params.temperature = 0.0f;
    probe.params.max_tokens = 1;
    absl::Status submitted = engine_->Submit(
        std::move(probe), [this](const engine::RequestOutput& out, const absl::Status& status) {
          if (!status.ok()) return ReadyDone(status);
          if (!out.finished) return;
          if (out.num_generation_tokens < 1) {
            return ReadyDone(absl::UnavailableError("the engine generated no token"));
          }
          ReadyDone(absl::OkStatus());
        });
    if (!submitted.ok()) ReadyDone(submitted);
  }

  void ReadyDone(const absl::Status& status) {
    std::vector<std::shared_ptr<http::HttpExchange>> waiters;
    {
      std::lock_guard<std::mutex> lock(ready_mu_);
      waiters.swap(ready_waiters_);
      ready_probing_ = false;
      if (status.ok()) ready_at_ = Clock::now();
    }
    for (auto& ex : waiters) {
      if (status.ok()) {
        Reply(*ex, 200, R"({"status":"ready"})");
      } else {
        ReplyError(*ex, absl::UnavailableError(
                            absl::StrCat("the engine is not ready: ", status.message())));
      }
    }
  }

  void HandleGeneration(const std::shared_ptr<http::HttpExchange>& ex, ApiKind kind) {
    if (draining_) {
      return ReplyError(*ex, absl::UnavailableError("the server is shutting down"));
    }
    absl::StatusOr<json> body = ParseJsonObject(ex->request().body);
    if (!body.ok()) return ReplyError(*ex, body.status());
    absl::StatusOr<CompletionRequest> parsed = ParseCompletionRequest(*body, kind, vocab_size_);
    if (!parsed.ok()) return ReplyError(*ex, parsed.status());
    CompletionRequest& r = *parsed;
    if (r.model) {
      if (absl::Status s = CheckModelName(*r.model); !s.ok()) return ReplyError(*ex, s);
    }

    std::vector<int32_t> prompt;
    if (kind == ApiKind::kChat) {
      absl::StatusOr<std::vector<int32_t>> tokens =
          ChatTokens(r.messages, r.add_generation_prompt, r.add_special_tokens);
      if (!tokens.ok()) return ReplyError(*ex, tokens.status());
      prompt = std::move(*tokens);
    } else if (r.prompt_text) {
      prompt = engine_->tokenizer().Encode(*r.prompt_text, r.add_special_tokens);
    } else {
      prompt = std::move(r.prompt_tokens);
    }
    const int prompt_len = static_cast<int>(prompt.size());
    if (r.max_tokens) {
      r.params.max_tokens = *r.max_tokens;
    } else if (kind == ApiKind::kChat) {
      r.params.max_tokens = std::max(1, engine_->max_model_len() - prompt_len);
    } else {
      r.params.max_tokens = 16;
    }

    if (active_.fetch_add(1) >= options_.max_active_requests) {
      active_.fetch_sub(1);
      return ReplyError(
          *ex, WithErrorCode(absl::ResourceExhaustedError(absl::StrCat(
                                 "the server is overloaded (", options_.max_active_requests,
                                 " requests in flight); retry shortly")),
                             "overloaded"));
    }
    auto gen = std::make_shared<Generation>();
    gen->server = this;
    gen->exchange = ex;
    gen->kind = kind;
    gen->id = NewId(kind == ApiKind::kChat ? "chatcmpl-" : "cmpl-");
    gen->model = options_.served_model_names.front();
    gen->created = UnixSeconds();
    gen->stream = r.stream;
    gen->include_usage = r.include_usage;
    gen->logprobs = r.params.logprobs;
    gen->prompt_tokens = prompt_len;
    gen->start = Clock::now();
    gen->choices.resize(r.params.n);
    const int n = r.params.n;

    // Registered before Submit so that no output can be handled before it is in place.
    ex->OnClientGone([gen] { gen->OnClientGone(); });
    engine::GenerateRequest request{gen->id, std::move(prompt), r.params};
    absl::Status submitted = engine_->Submit(
        std::move(request), [gen](const engine::RequestOutput& out, const absl::Status& status) {
          // On the engine thread: hand over and return at once.
          gen->exchange->Run([gen, out, status] { gen->OnOutput(out, status); });
        });
    if (!submitted.ok()) {
      gen->done = true;
      RequestFinished();
      return ReplyError(*ex, AttachParam(submitted, kind));
    }
    metrics_.prompt_tokens->Increment(prompt_len);
    if (gen->stream) {
      metrics_.Http(200)->Increment();
      ex->BeginStream(200, "text/event-stream",
                      {{"Cache-Control", "no-cache"}, {"X-Request-Id", gen->id}});
      if (kind == ApiKind::kChat) {
        // OpenAI opens each chat choice with the assistant role and empty content.
        for (int i = 0; i < n; ++i) {
          json choice = {{"index", i},
                         {"delta", {{"role", "assistant"}, {"content", ""}}},
                         {"logprobs", nullptr},
                         {"finish_reason", nullptr}};
          json chunk = {{"id", gen->id},
                        {"object", "chat.completion.chunk"},
                        {"created", gen->created},
                        {"model", gen->model},
                        {"choices", json::array({choice})}};
          ex->Send(Sse(chunk));
        }
      }
    }
  }

  // Declared first, destroyed last: everything below may use them until it is gone.
  ApiServerOptions options_;
  ApiMetrics metrics_;
  std::atomic<int> active_{0};
  std::atomic<bool> draining_{false};
  int vocab_size_ = 0;
  int64_t started_ = 0;

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
};

json Generation::LogprobsFor(const engine::ChoiceDelta& delta, Choice& choice) const {
  if (logprobs < 0 || delta.token_ids.empty()) return nullptr;
  const size_t count = delta.token_ids.size();
  auto top_at = [&](size_t i) -> const std::vector<engine::TokenLogprob>* {
    return i < delta.top_logprobs.size() ? &delta.top_logprobs[i] : nullptr;
  };
  auto lp_at = [&](size_t i) { return i < delta.logprobs.size() ? delta.logprobs[i] : 0.0f; };
  if (kind == ApiKind::kCompletion) {
    json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
         offsets = json::array();
    for (size_t i = 0; i < count; ++i) {
      std::string s = server->TokenString(delta.token_ids[i]);
      tokens.push_back(s);
      token_logprobs.push_back(JsonLogprob(lp_at(i)));
      json alternatives = json::object();
      if (const auto* t = top_at(i)) {
        for (const engine::TokenLogprob& alt : *t) {
          std::string alt_s = server->TokenString(alt.token);
          if (!alternatives.contains(alt_s)) alternatives[alt_s] = JsonLogprob(alt.logprob);
        }
      }
      top.push_back(std::move(alternatives));
      offsets.push_back(choice.text_offset);
      choice.text_offset += static_cast<int>(s.size());
    }
    return {{"tokens", tokens},
            {"token_logprobs", token_logprobs},
            {"top_logprobs", top},
            {"text_offset", offsets}};
  }
  auto entry = [&](int32_t id, float lp) {
    std::string raw = server->TokenBytes(id);
    json bytes = json::array();
    for (unsigned char c : raw) bytes.push_back(static_cast<int>(c));
    return json{
        {"token", text::ReplaceInvalidUtf8(raw)}, {"logprob", JsonLogprob(lp)}, {"bytes", bytes}};
  };
  json content = json::array();
  for (size_t i = 0; i < count; ++i) {
    json e = entry(delta.token_ids[i], lp_at(i));
    json top = json::array();
    if (const auto* t = top_at(i)) {
      for (const engine::TokenLogprob& alt : *t) top.push_back(entry(alt.token, alt.logprob));
    }
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  return {{"content", content}, {"refusal", nullptr}};
}

void Generation::Merge(json& into, const json& delta) const {
  if (delta.is_null()) return;
  if (into.is_null()) {
    into = delta;
    return;
  }
  for (auto& [key, value] : delta.items()) {
    if (!value.is_array()) continue;
    for (const json& v : value) into[key].push_back(v);
  }
}

json Generation::Chunk(json choices_json) const {
  return {{"id", id},
          {"object", kind == ApiKind::kChat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", model},
          {"choices", std::move(choices_json)}};
}

json Generation::Usage() const {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", generation_tokens},
          {"total_tokens", prompt_tokens + generation_tokens}};
}

void Generation::OnOutput(const engine::RequestOutput& out, const absl::Status& status) {
  if (done) return;
  if (!status.ok()) return Fail(status);
  const Clock::time_point now = Clock::now();
  size_t new_tokens = 0;
  for (const engine::ChoiceDelta& d : out.choices)
    new_tokens = std::max(new_tokens, d.token_ids.size());
  ApiMetrics& m = server->metrics();
  if (new_tokens > 0) {
    if (!seen_token) {
      m.ttft->Observe(Seconds(now - start));
      first_token = now;
      seen_token = true;
    } else {
      m.itl->Observe(Seconds(now - last_token) / static_cast<double>(new_tokens));
    }
    last_token = now;
  }
  generation_tokens = out.num_generation_tokens;
  if (out.num_prompt_tokens > 0) prompt_tokens = out.num_prompt_tokens;

  for (const engine::ChoiceDelta& d : out.choices) {
    if (d.index < 0 || d.index >= static_cast<int>(choices.size())) continue;
    Choice& c = choices[d.index];
    c.tokens += static_cast<int>(d.token_ids.size());
    json lp = LogprobsFor(d, c);
    c.text += d.text;
    if (d.finish_reason != engine::FinishReason::kNone) c.finish = d.finish_reason;
    const bool finished = d.finish_reason != engine::FinishReason::kNone;
    if (!stream) {
      Merge(c.logprobs, lp);
      continue;
    }
    if (d.text.empty() && !finished && lp.is_null()) continue;
    json finish = finished ? json(engine::FinishReasonName(d.finish_reason)) : json(nullptr);
    json choice;
    if (kind == ApiKind::kChat) {
      json delta = json::object();
      if (!d.text.empty()) delta["content"] = d.text;
      choice = {{"index", d.index}, {"delta", delta}, {"logprobs", lp}, {"finish_reason", finish}};
    } else {
      choice = {{"index", d.index}, {"text", d.text}, {"logprobs", lp}, {"finish_reason", finish}};
    }
    exchange->Send(Sse(Chunk(json::array({choice}))));
  }
  if (!out.finished) return;

  const std::string reason =
      choices.empty() ? "stop" : engine::FinishReasonName(choices.front().finish);
  if (stream) {
    if (include_usage) {
      json usage_chunk = Chunk(json::array());
      usage_chunk["usage"] = Usage();
      exchange->Send(Sse(usage_chunk));
    }
    exchange->Send("data: [DONE]\n\n");
    exchange->EndStream();
  } else {
    json list = json::array();
    for (size_t i = 0; i < choices.size(); ++i) {
      const Choice& c = choices[i];
      json finish = c.finish == engine::FinishReason::kNone
                        ? json(nullptr)
                        : json(engine::FinishReasonName(c.finish));
      if (kind == ApiKind::kChat) {
        list.push_back({{"index", i},
                        {"message", {{"role", "assistant"}, {"content", c.text}}},
                        {"logprobs", c.logprobs},
                        {"finish_reason", finish}});
      } else {
        list.push_back(
            {{"index", i}, {"text", c.text}, {"logprobs", c.logprobs}, {"finish_reason", finish}});
      }
    }
    json response = {{"id", id},
                     {"object", kind == ApiKind::kChat ? "chat.completion" : "text_completion"},
                     {"created", created},
                     {"model", model},
                     {"choices", list},
                     {"usage", Usage()}};
    server->Reply(*exchange, 200, Dump(response));
  }
  Finalize(reason.empty() ? "stop" : reason);
}

void Generation::Fail(const absl::Status& status) {
  if (stream) {
    // The 200 and earlier chunks are already out: report the error in-band, as OpenAI does.
    const int code = HttpStatusOf(status, 503);
    json error = json::parse(
        ErrorBody(code, std::string(status.message()), ParamOf(status), ErrorCodeOf(status)));
    exchange->Send(absl::StrCat("event: error\ndata: ", Dump(error), "\n\n"));
    exchange->Send("data: [DONE]\n\n");
    exchange->EndStream();
  } else {
    server->ReplyError(*exchange, status);
  }
  Finalize("error");
}

void Generation::OnClientGone() {
  if (done) return;
  // Frees the request's KV blocks before the engine's next step.
  server->engine().Abort(id);
  Finalize("abort");
}

void Generation::Finalize(const std::string& reason) {
  done = true;
  const Clock::time_point now = Clock::now();
  ApiMetrics& m = server->metrics();
  m.Finished(reason)->Increment();
  m.generation_tokens->Increment(generation_tokens);
  const double e2e = Seconds(now - start);
  m.e2e->Observe(e2e);
  // Only requests that ran to their end are held to the SLOs: an abort (client gone) or an
  // error says nothing about the latency the server would have given.
  if (reason == "stop" || reason == "length") {
    const double ttft = seen_token ? Seconds(first_token - start) : e2e;
    int tokens = 0;
    for (const Choice& c : choices) tokens = std::max(tokens, c.tokens);
    std::optional<double> tpot;
    if (tokens >= 2) tpot = (e2e - ttft) / static_cast<double>(tokens - 1);
    m.Classify(ttft, tpot);
  }
  server->RequestFinished();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ApiServer>> ApiServer::Create(
    ApiServerOptions options, std::unique_ptr<engine::Generator> engine) {
  if (engine == nullptr) return absl::InvalidArgumentError("ApiServer needs an engine");
  auto server = std::make_unique<ApiServerImpl>(std::move(options), std::move(engine));
  TANDEM_RETURN_IF_ERROR(server->Start());
  return std::unique_ptr<ApiServer>(std::move(server));
}

}  // namespace tandem::router
