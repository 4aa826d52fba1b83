// kvtransfer: moves registered byte ranges from one process (or agent) to another.
//
// An `Agent` knows nothing about models: the engine turns (layer, block id) lists into byte
// ranges of its KV cache and this library pushes those bytes into a peer's registered memory.
//
//   // Receiver (decode worker):
//   TANDEM_ASSIGN_OR_RETURN(auto decode, Agent::Create({.backend = "ucx", .name = "decode"}));
//   TANDEM_ASSIGN_OR_RETURN(std::string descriptor,
//                           decode->RegisterMemory(/*region_id=*/0, kv_base, kv_bytes));
//   // ... send decode->address() and `descriptor` to the prefill worker (control plane) ...
//
//   // Sender (prefill worker):
//   TANDEM_ASSIGN_OR_RETURN(PeerId peer, prefill->Connect(decode_address, deadline));
//   TANDEM_ASSIGN_OR_RETURN(auto handle,
//                           prefill->Submit(peer, /*local_region_id=*/0, descriptor,
//                                           {{.src_offset = 0, .dst_offset = 4096,
//                                             .bytes = 8192}},
//                                           deadline));
//   TANDEM_RETURN_IF_ERROR(handle->Wait());  // OK: the bytes are visible in the decode worker.
//
// Backends, chosen at run time by `AgentOptions::backend`:
//   "local" same process; Submit copies with memcpy (colocated mode, tests).
//   "ucx"   UCX (tcp / shared memory / cma between processes, RDMA where present).
//   "cuda_ipc" CUDA device memory between processes (or agents) on one node: CUDA IPC handles
//           and device-to-device copies; built only with CUDA. "local" and "ucx" register host
//           memory only and refuse device memory with InvalidArgument.
//   "nccl"  CUDA device memory between agents on different GPUs, on one node or across nodes:
//           NCCL send/receive, the receiver taking part through a TCP control connection;
//           built with CUDA and NCCL.
// docs/kvtransfer.md describes the guarantees and failure semantics in full.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tandem::kvtransfer {

struct AgentOptions {
  // "local", "ucx", "cuda_ipc" or "nccl".
  std::string backend;
  // A human-readable name used in error messages and, for "local", in the address.
  std::string name;
  // ucx, nccl: where the listener binds; peers connect to it, so it must be reachable by them.
  std::string listen_host = "127.0.0.1";
  // ucx, nccl: 0 picks a free port.
  int listen_port = 0;
  // ucx: the UCX transports to use (UCX_TLS syntax). Empty: $UCX_TLS if set, else
  // "tcp,sm,self", which needs no RDMA hardware. Both sides must share at least one.
  std::string ucx_transports;
};

// Identifies a connection made by `Agent::Connect`; meaningful only to the agent that made it.
using PeerId = uint64_t;

// One contiguous copy: `bytes` bytes from `src_offset` of the local region to `dst_offset` of
// the remote region. Offsets are relative to the start of each registered region.
struct Range {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
};

// The outcome of one `Agent::Submit`. Thread-compatible: use one handle from one thread.
// A handle may outlive its agent; destroying the agent fails it with Cancelled.
class TransferHandle {
 public:
  virtual ~TransferHandle() = default;

  // Returns the final status if the transfer has finished (OK: every byte is visible at the
  // destination), DeadlineExceeded once the deadline has passed, or nullopt while in flight.
  // The first final status returned is returned again by every later Poll or Wait.
  virtual std::optional<absl::Status> Poll() = 0;

  // Blocks until the transfer finishes or its deadline passes; returns what Poll would.
  virtual absl::Status Wait() = 0;
};

// A transfer endpoint. All methods are thread-safe.
//
// Guarantees (every backend):
// - Every range is checked against the local region and against the destination region's
//   bounds recorded in its descriptor before anything is posted; a transfer with any range
//   outside them is refused with InvalidArgument and writes nothing.
// - A descriptor is integrity-checked and bound to the agent that produced it: a garbled
//   descriptor, one from another backend, or one of a different agent than the peer (for
//   example of a restarted peer process) is refused.
// - `DeregisterMemory` returns only when no posted operation reads the region any more (see
//   its comment), so the caller may free the memory afterwards.
// - Nothing blocks forever on a dead peer: a lost connection fails the transfers posted on it
//   with Unavailable, and every wait is bounded by the caller's deadline.
class Agent {
 public:
  // Creates an agent of `options.backend`; an unknown backend is an InvalidArgument error.
  static absl::StatusOr<std::unique_ptr<Agent>> Create(const AgentOptions& options);

  // Destroying an agent closes its connections and fails its in-flight transfers (their
  // handles report Cancelled); it returns once the backend no longer touches any region.
  virtual ~Agent() = default;

  // Makes [base, base + bytes) a region peers may write into and this agent may send from.
  // `base` stays owned by the caller and must stay valid until DeregisterMemory (or the
  // agent's destruction) returns. Returns the descriptor: opaque bytes a peer passes to
  // Submit to write into this region. Fails with AlreadyExists if `region_id` is registered.
  virtual absl::StatusOr<std::string> RegisterMemory(uint64_t region_id, void* base,
                                                     size_t bytes) = 0;

  // Removes a region. Submits from it are refused from now on. Blocks until no posted operation
  // reads it: transfers still within their deadline may finish; those whose deadline has passed
  // are cancelled by closing the connection they were posted on (that peer then reports
  // Unavailable and must be connected again). Descriptors already given to peers must no longer
  // be used by them: with one-sided writes the receiver cannot refuse them (the control plane
  // sees to that).
  virtual absl::Status DeregisterMemory(uint64_t region_id) = 0;

  // The opaque address peers pass to Connect; also identifies this agent's incarnation.
  virtual std::string address() const = 0;

  // Connects to the agent at `peer_address`. Fails with Unavailable if nobody answers there (or
  // a different incarnation does) and DeadlineExceeded if the handshake is not done by
  // `deadline`.
  virtual absl::StatusOr<PeerId> Connect(const std::string& peer_address, absl::Time deadline) = 0;

  // Closes a connection. Transfers still in flight on it fail with Cancelled.
  virtual absl::Status Disconnect(PeerId peer) = 0;

  // Writes (pushes) `ranges` of local region `local_region_id` into the peer's region described
  // by `remote_region_descriptor`. Returns InvalidArgument for a range outside either region or
  // a bad descriptor, NotFound for an unknown local region or peer, Unavailable for a peer
  // known to be gone, DeadlineExceeded if `deadline` has already passed. Errors found after
  // posting (a peer dying mid-transfer) are reported by the handle. Ranges may be in any order;
  // destination ranges of one transfer should not overlap (the order they land in is
  // unspecified). If the transfer fails or times out, the destination ranges hold unspecified
  // bytes.
  virtual absl::StatusOr<std::unique_ptr<TransferHandle>> Submit(
      PeerId peer, uint64_t local_region_id, const std::string& remote_region_descriptor,
      std::vector<Range> ranges, absl::Time deadline) = 0;
};

// ThreadSanitizer only (nothing in other builds). The local backend copies on the pushing
// thread; the receiver learns the copy is complete from the control plane (a gRPC call), an
// ordering TSan cannot see inside the uninstrumented libgrpc. A local copy states itself as
// released on the destination region's base, and a receiver in the same process calls this with
// the base of the region it registered before it reads bytes a peer pushed there.
void AcquireTransferred(const void* region_base);

}  // namespace tandem::kvtransfer
