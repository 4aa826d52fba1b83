// The HTTP endpoint every worker serves beside its gRPC control plane, with one behaviour for
// both roles: GET /health answers 200 "ok" while the worker takes new work and 503 "draining"
// once its shutdown began (a load balancer or probe stops sending it work), GET /metrics the
// Prometheus exposition, anything else 404, another method 405 with Allow: GET.
//
//   TANDEM_ASSIGN_OR_RETURN(auto status, StatusServer::Create(
//       "0.0.0.0:9090", [&] { return draining.load(); }, [&] { return registry.Render(); }));
//   int port = status->port();
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "tandem/http/http_server.h"

namespace tandem::worker {

class StatusServer {
 public:
  // Listens on `address` (host:port, port 0 picks one). `draining` and `render_metrics` are
  // called on the server's thread for each request and must be thread-safe.
  static absl::StatusOr<std::unique_ptr<StatusServer>> Create(
      const std::string& address, std::function<bool()> draining,
      std::function<std::string()> render_metrics);
  ~StatusServer();

  int port() const;
  // Stops listening and closes connections; idempotent (the destructor does it too).
  void Stop();

 private:
  StatusServer() = default;
  std::unique_ptr<http::HttpServer> server_;
};

}  // namespace tandem::worker
