// The "cuda_ipc" backend: pushes between regions of CUDA device memory of processes on one
// node (or agents of one process) with device-to-device cudaMemcpyAsync.
//
// - RegisterMemory takes device memory only, and `base` must be the start of a cudaMalloc
//   allocation (as ModelRunner's KV cache is): the descriptor carries the allocation's
//   cudaIpcMemHandle_t, the owner's process id and its device address.
// - Connect dials the peer's Unix-domain socket (abstract namespace, named after the peer's
//   incarnation, so a restarted peer is not reached through an old address) and exchanges a
//   16-byte hello. The connection stays open: its hang-up is how a gone peer is noticed.
// - Submit opens the descriptor's handle once per registration (cached until the peer is
//   disconnected or the agent destroyed; in the owner's own process the address is used as is,
//   since CUDA refuses to open a process's own handles) and queues one copy per coalesced range
//   on the agent's stream, then an event; a completion thread finishes the handle when the
//   event fires, the deadline passes, or the peer hangs up.
// In a build without CUDA, Create fails with InvalidArgument "cuda_ipc backend not built".
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "tandem/kvtransfer/agent.h"

namespace tandem::kvtransfer::cuda_ipc {

absl::StatusOr<std::unique_ptr<Agent>> CreateCudaIpcAgent(const AgentOptions& options);

}  // namespace tandem::kvtransfer::cuda_ipc
