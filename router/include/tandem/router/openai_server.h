// The OpenAI-compatible HTTP API in front of a Generator (one engine, or prefill and decode
// workers): completions and chat completions
// (streamed as server-sent events or not), responses, embeddings, models, tokenize/detokenize,
// health, readiness and Prometheus metrics. docs/api.md describes every endpoint, field, limit and
// error.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/engine/generator.h"
#include "tandem/http/http_server.h"

namespace tandem::router {

struct ApiServerOptions {
  http::HttpServerOptions http;
  // Names clients may use in "model"; the first is the one reported. Must not be empty.
  std::vector<std::string> served_model_names;
  // When non-empty, every route but /health (and /metrics with metrics_public) needs
  // "Authorization: Bearer <api_key>".
  std::string api_key;
  bool metrics_public = false;
  // Generation requests in flight beyond which new ones are refused with overload_status
  // (529, or 503 for clients that only know standard codes) and Retry-After.
  int max_active_requests = 1024;
  int overload_status = 529;
  // /ready re-proves the engine path with a one-token generation at most this often.
  std::chrono::milliseconds ready_cache{10000};
  // Service-level objectives each finished request is classified against (docs/api.md,
  // "SLO accounting"): time to first token, and time per output token after the first. Unset
  // means no objective of that kind; a set value must be finite and > 0.
  std::optional<double> ttft_slo_seconds;
  std::optional<double> tpot_slo_seconds;
  // The syntax chat completions parse tool calls in and constrain them to (tool_calls.h):
  // "auto" (detected from the model's chat template), "hermes" or "llama3_json".
  std::string tool_call_parser = "auto";
};

//   TANDEM_ASSIGN_OR_RETURN(auto engine, engine::AsyncEngine::Create(engine_options));
//   TANDEM_ASSIGN_OR_RETURN(auto api, ApiServer::Create(options, std::move(engine)));
//   std::printf("serving on port %d\n", api->port());
//   ...
//   api->Shutdown(std::chrono::seconds(30));
class ApiServer {
 public:
  static absl::StatusOr<std::unique_ptr<ApiServer>> Create(
      ApiServerOptions options, std::unique_ptr<engine::Generator> engine);
  virtual ~ApiServer() = default;

  virtual int port() const = 0;
  // Stops accepting connections, lets requests in flight finish for up to `grace` (new ones
  // on open connections get 503), then stops all I/O and the engine. Idempotent.
  virtual void Shutdown(std::chrono::milliseconds grace) = 0;
};

}  // namespace tandem::router
