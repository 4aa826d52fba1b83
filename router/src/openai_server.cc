// The OpenAI-compatible API server: startup and shutdown, routing, API keys and error replies
// (the endpoints are in openai_endpoints.cc and openai_generation.cc).
#include "tandem/router/openai_server.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "openai_server_impl.h"
#include "tandem/base/status_macros.h"

namespace tandem::router {
namespace internal {
namespace {

// Compares without an early exit, so the time taken says nothing about the key.
bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  }
  return diff == 0;
}

}  // namespace

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

// A path or name from a request, cut short for an error message.
std::string Excerpt(const std::string& s) { return s.size() <= 64 ? s : s.substr(0, 64) + "..."; }

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

absl::Status ApiServerImpl::Start() {
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
  TANDEM_ASSIGN_OR_RETURN(std::optional<ToolCallFormat> tool_format,
                          ParseToolCallFormat(options_.tool_call_parser));
  tool_format_ =
      tool_format.value_or(DetectToolCallFormat(engine_->chat_formatter().template_source()));
  compiler_ = std::make_unique<base::JobPool>(2);
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

void ApiServerImpl::Shutdown(std::chrono::milliseconds grace) {
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
  compiler_.reset();
  // Outputs of requests still running are dropped by the stopped HTTP server.
  engine_.reset();
}

void ApiServerImpl::ReplyError(http::HttpExchange& ex, const absl::Status& status) {
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

void ApiServerImpl::Handle(const std::shared_ptr<http::HttpExchange>& ex) {
  static constexpr Route kRoutes[] = {
      {"/health", "GET", Endpoint::kHealth},
      {"/ready", "GET", Endpoint::kReady},
      {"/metrics", "GET", Endpoint::kMetrics},
      {"/v1/models", "GET", Endpoint::kModels},
      {"/v1/completions", "POST", Endpoint::kCompletions},
      {"/v1/chat/completions", "POST", Endpoint::kChatCompletions},
      {"/v1/responses", "POST", Endpoint::kResponses},
      {"/tokenize", "POST", Endpoint::kTokenize},
      {"/detokenize", "POST", Endpoint::kDetokenize},
      {"/v1/embeddings", "POST", Endpoint::kEmbeddings},
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
    case Endpoint::kResponses:
      return HandleGeneration(ex, ApiKind::kChat, /*responses=*/true);
    case Endpoint::kTokenize:
      return HandleTokenize(*ex);
    case Endpoint::kDetokenize:
      return HandleDetokenize(*ex);
    case Endpoint::kEmbeddings:
      return HandleEmbeddings(ex);
  }
}

absl::Status ApiServerImpl::CheckApiKey(const http::HttpRequest& req) const {
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

void ApiServerImpl::MethodNotAllowed(http::HttpExchange& ex, const char* allowed) {
  std::string message =
      absl::StrCat("method ", Excerpt(ex.request().method), " is not allowed on ",
                   Excerpt(ex.request().path), "; use ", allowed);
  Reply(ex, 405, ErrorBody(405, message, "", "method_not_allowed"), {{"Allow", allowed}});
}

absl::Status ApiServerImpl::CheckModel(const json& body) const {
  auto it = body.find("model");
  if (it == body.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_string()) return ParamError("model", "model must be a string");
  return CheckModelName(it->get<std::string>());
}

absl::Status ApiServerImpl::CheckModelName(const std::string& name) const {
  for (const std::string& served : options_.served_model_names) {
    if (name == served) return absl::OkStatus();
  }
  absl::Status s = absl::NotFoundError(absl::StrCat("the model '", Excerpt(name),
                                                    "' does not exist; this server serves '",
                                                    options_.served_model_names.front(), "'"));
  s.SetPayload("type.tandem/openai.param", absl::Cord("model"));
  return WithErrorCode(s, "model_not_found");
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<ApiServer>> ApiServer::Create(
    ApiServerOptions options, std::unique_ptr<engine::Generator> engine) {
  if (engine == nullptr) return absl::InvalidArgumentError("ApiServer needs an engine");
  auto server = std::make_unique<internal::ApiServerImpl>(std::move(options), std::move(engine));
  TANDEM_RETURN_IF_ERROR(server->Start());
  return std::unique_ptr<ApiServer>(std::move(server));
}

}  // namespace tandem::router
