// The decode worker: a decode-role engine behind the tandem.v1.DecodeWorker gRPC service.
//
// It reserves KV blocks for requests about to be prefilled elsewhere, registers its whole KV
// cache with a kvtransfer agent so prefill workers can write the prompt KV straight into those
// blocks, and, once the router starts a request (Start), continues it from the prefilled first
// token and streams the tokens back. docs/protocol.md describes every RPC.
//
//   TANDEM_ASSIGN_OR_RETURN(auto worker, DecodeWorker::Create(options));
//   std::printf("decode worker on %s\n", worker->grpc_address().c_str());
//   ...
//   worker->Shutdown(absl::Seconds(30));
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tandem/v1/worker.pb.h"
#include "tandem/worker/worker_core.h"

namespace tandem::decode_worker {

// The options every worker has (worker::WorkerOptions: engine, worker_id, grpc_address, tls,
// metrics_address, kv_backend, kv_listen_host; the engine's role is set to decode), and:
struct DecodeWorkerOptions : worker::WorkerOptions {
  // Longest a reservation may wait for Start; a ReserveRequest deadline further out (or none)
  // is cut to this.
  absl::Duration max_reservation_ttl = absl::Seconds(60);
  // Drain by KV handoff: requests still running when Shutdown's grace ends are parked (no
  // longer stepped, KV kept) and their streams end with a KvHandoff, so the router can move
  // them to another decode worker with the Handoff RPC. Parked blocks are freed when handed
  // off, cancelled, or after this long. Zero: no parking (such requests are cancelled and the
  // router recomputes them). At most 30 s.
  absl::Duration handoff_ttl = absl::Seconds(3);
};

class DecodeWorker {
 public:
  static absl::StatusOr<std::unique_ptr<DecodeWorker>> Create(DecodeWorkerOptions options);
  // Shuts down at once (as Shutdown with no grace).
  virtual ~DecodeWorker() = default;

  // "host:port" the control plane is bound to (the actual port when 0 was asked for).
  virtual std::string grpc_address() const = 0;
  // The bound metrics port, 0 when none was asked for.
  virtual int metrics_port() const = 0;
  // What the Stats RPC returns.
  virtual tandem::v1::WorkerStats Stats() const = 0;
  // Refuses new reservations, lets running requests finish for up to `grace`, then parks the
  // rest for KV handoff (options.handoff_ttl; their streams end with an UNAVAILABLE error event
  // carrying a KvHandoff) and waits until every parked sample was handed off, cancelled or
  // expired, or cancels them at once without handoff_ttl; frees every block and stops.
  // Idempotent. The destructor shuts down at once, without parking.
  virtual void Shutdown(absl::Duration grace) = 0;
};

}  // namespace tandem::decode_worker
