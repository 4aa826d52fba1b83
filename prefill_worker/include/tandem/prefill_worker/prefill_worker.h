// The prefill worker: a prefill-role engine behind the tandem.v1.PrefillWorker gRPC service.
//
// Submit runs a request's prompt (chunked, batched with other requests) and, as each layer of
// each chunk is computed, pushes that layer's new KV pages into the blocks a decode worker
// reserved for the request (kvtransfer), so the transfer overlaps the rest of the prefill. It
// answers with the first sampled token of every sample and its sampler state once all pages
// are at the decode worker. docs/protocol.md describes every RPC.
//
//   TANDEM_ASSIGN_OR_RETURN(auto worker, PrefillWorker::Create(options));
//   std::printf("prefill worker on %s\n", worker->grpc_address().c_str());
//   ...
//   worker->Shutdown(absl::Seconds(30));
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tandem/v1/worker.pb.h"
#include "tandem/worker/worker_core.h"

namespace tandem::prefill_worker {

// The options every worker has (worker::WorkerOptions: engine, worker_id, grpc_address, tls,
// metrics_address, kv_backend, kv_listen_host); the engine's role is set to prefill, and
// kv_backend must be the decode workers'.
struct PrefillWorkerOptions : worker::WorkerOptions {};

class PrefillWorker {
 public:
  static absl::StatusOr<std::unique_ptr<PrefillWorker>> Create(PrefillWorkerOptions options);
  // Shuts down at once (as Shutdown with no grace).
  virtual ~PrefillWorker() = default;

  // "host:port" the control plane is bound to (the actual port when 0 was asked for).
  virtual std::string grpc_address() const = 0;
  // The bound metrics port, 0 when none was asked for.
  virtual int metrics_port() const = 0;
  // What the Stats RPC returns.
  virtual tandem::v1::WorkerStats Stats() const = 0;
  // Refuses new submissions, lets those in flight finish for up to `grace`, then cancels the
  // rest (their Submit calls fail with Unavailable), waits for transfers reading its cache and
  // stops. Idempotent.
  virtual void Shutdown(absl::Duration grace) = 0;
};

}  // namespace tandem::prefill_worker
