// The skeleton every worker stands on, whatever its protocol: the options both roles share, the
// engine and its KV endpoint, the engine loop, the gRPC server, the /health and /metrics
// endpoint, and one shutdown order. A role (prefill_worker, decode_worker) adds only its
// protocol: its gRPC service, what it keeps per request on the loop thread, and how it winds
// down what is still running when a shutdown's grace period ends.
//
//   TANDEM_ASSIGN_OR_RETURN(auto core, WorkerCore::Create(options, engine::EngineRole::kDecode));
//   ... build the role's state on core->engine() and core->kv() ...
//   TANDEM_RETURN_IF_ERROR(core->Serve(loop_options, &service, [&] { return Render(); }));
//   ...
//   core->Shutdown([&] { /* the role's grace period and wind-down; loop still runs */ });
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "tandem/base/job_pool.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/proto/tls.h"
#include "tandem/worker/engine_loop.h"
#include "tandem/worker/kv_endpoint.h"
#include "tandem/worker/kv_events.h"
#include "tandem/worker/status_server.h"

namespace tandem::worker {

// What every worker is configured with.
struct WorkerOptions {
  // The engine; its role is set by the worker.
  engine::EngineOptions engine;
  // Reported in Stats and Handshake; empty: "<role>-<pid>".
  std::string worker_id;
  // host:port the gRPC control plane listens on; port 0 picks a free one (see grpc_address()).
  std::string grpc_address = "127.0.0.1:0";
  // Mutual TLS on the control plane: callers must present a certificate signed by `tls.ca`.
  // Empty: plaintext.
  proto::TlsFiles tls;
  // host:port of an HTTP listener serving GET /metrics (Prometheus) and GET /health; empty for
  // none. Port 0 picks a free one (see metrics_port()).
  std::string metrics_address;
  // The kvtransfer backend the KV cache is registered with: "ucx" (between processes), "local"
  // (workers in one process) or "cuda_ipc"; every worker of a deployment uses the same.
  std::string kv_backend = "ucx";
  // ucx: where the transfer listener binds (must be reachable by the other workers).
  std::string kv_listen_host = "127.0.0.1";
};

class WorkerCore {
 public:
  // The preparer's threads: a grammar compile or a slow connect holds one of them.
  static constexpr int kPreparerThreads = 4;

  // Creates the engine in `role` (its layer hook, if any, set by the caller in
  // options.engine) and registers its KV cache with a transfer agent. Nothing serves yet.
  static absl::StatusOr<std::unique_ptr<WorkerCore>> Create(WorkerOptions options,
                                                            engine::EngineRole role);
  // Shutdown() with no wind-down.
  ~WorkerCore();

  // Starts the engine loop (before any call can arrive, so every accepted call is answered;
  // after each of its iterations the KV events recorded are published), then the gRPC server for `service` (which must outlive Shutdown()) and, when asked for, the
  // status endpoint, whose /metrics calls `render_metrics` on its own thread.
  absl::Status Serve(EngineLoop::Options loop, grpc::Service* service,
                     std::function<std::string()> render_metrics);

  // The shutdown order, once (later calls return at once):
  //   1. new work is refused (accepting() false; /health answers 503, Stats says draining);
  //   2. `wind_down` runs on the caller's thread while the loop still runs: the role's grace
  //      period, then it ends or parks what is left;
  //   3. the loop drains and stops (its `finish` answers whatever is still owed);
  //   4. the KV event streams end (UNAVAILABLE), then the gRPC server stops, giving calls a
  //      second to take their last answer (the preparer's jobs still run meanwhile), and the
  //      preparer stops;
  //   5. the status endpoint stops;
  //   6. the KV endpoint closes, waiting until no transfer reads the cache.
  // The engine itself is destroyed with the core.
  void Shutdown(const std::function<void()>& wind_down);

  const WorkerOptions& options() const { return options_; }
  engine::LlmEngine& engine() { return *engine_; }
  const engine::LlmEngine& engine() const { return *engine_; }
  KvEndpoint& kv() { return *kv_; }
  const KvEndpoint& kv() const { return *kv_; }
  EngineLoop& loop() { return *loop_; }
  // The KvEvents streams of this worker's prefix cache (the service's KvEvents handler).
  KvEventHub& kv_events() { return *kv_events_; }
  // Threads for a handler's work that may block before the request can go to the loop
  // (compiling a grammar, connecting to the peer it will push to), so that no gRPC thread
  // waits on it. A job checks accepting() first; its `dropped` answers the call.
  // Created by Serve (so that its threads start after the role's set-up): handlers only.
  base::JobPool& preparer() { return *preparer_; }
  // False once a shutdown began. Any thread.
  bool accepting() const { return accepting_.load(); }
  // "host:port" the control plane is bound to.
  const std::string& grpc_address() const { return grpc_address_; }
  // The bound status port, 0 when none was asked for.
  int metrics_port() const { return status_ ? status_->port() : 0; }

 private:
  WorkerCore() = default;

  WorkerOptions options_;
  std::unique_ptr<engine::LlmEngine> engine_;  // destroyed last: the agent reads its cache
  std::unique_ptr<KvEndpoint> kv_;
  std::unique_ptr<KvEventHub> kv_events_;  // reads engine_'s block manager
  std::unique_ptr<EngineLoop> loop_;
  std::unique_ptr<base::JobPool> preparer_;
  std::unique_ptr<grpc::Server> server_;
  std::string grpc_address_;
  std::unique_ptr<StatusServer> status_;
  std::atomic<bool> accepting_{true};
  std::once_flag shutdown_once_;
};

}  // namespace tandem::worker
