#include "tandem/worker/status_server.h"

#include <utility>

#include "tandem/base/host_port.h"
#include "tandem/base/status_macros.h"
#include "tandem/metrics/registry.h"

namespace tandem::worker {

absl::StatusOr<std::unique_ptr<StatusServer>> StatusServer::Create(
    const std::string& address, std::function<bool()> draining,
    std::function<std::string()> render_metrics) {
  TANDEM_ASSIGN_OR_RETURN(auto host_port, SplitHostPort(address));
  http::HttpServerOptions options;
  options.host = host_port.first;
  options.port = host_port.second;
  options.num_threads = 1;
  options.error_response = [](int status, const std::string& message) {
    return http::HttpResponse{status, "text/plain", message + "\n", {}};
  };
  std::unique_ptr<StatusServer> server(new StatusServer());
  TANDEM_ASSIGN_OR_RETURN(
      server->server_,
      http::HttpServer::Create(
          options, [draining = std::move(draining), render = std::move(render_metrics)](
                       std::shared_ptr<http::HttpExchange> ex) {
            const http::HttpRequest& request = ex->request();
            if (request.path != "/health" && request.path != "/metrics") {
              ex->Reply({404, "text/plain", "not found\n", {}});
            } else if (request.method != "GET") {
              ex->Reply({405, "text/plain", "method not allowed\n", {{"Allow", "GET"}}});
            } else if (request.path == "/health") {
              ex->Reply(draining() ? http::HttpResponse{503, "text/plain", "draining\n", {}}
                                   : http::HttpResponse{200, "text/plain", "ok\n", {}});
            } else {
              ex->Reply({200, metrics::Registry::kContentType, render(), {}});
            }
          }));
  return server;
}

StatusServer::~StatusServer() { Stop(); }

int StatusServer::port() const { return server_->port(); }

void StatusServer::Stop() {
  if (server_ != nullptr) server_->Stop();
}

}  // namespace tandem::worker
