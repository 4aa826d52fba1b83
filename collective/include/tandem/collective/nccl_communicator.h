// The GPU communicator: NCCL's collectives between the GPUs of a group (NVLink, PCIe, or the
// network between nodes), one GPU per rank.
//
// Always declared; a build without CUDA (or without NCCL) holds only nccl_unavailable.cc, whose
// CreateNcclCommunicator says so, and callers need no #ifdef. Buffers are device memory of the
// rank's GPU. Collectives are queued on `stream` and waited for, polling NCCL for a peer's
// failure; past the timeout the NCCL communicator is aborted and the call returns
// DeadlineExceeded.
//
//   // Any working group (Gloo over TCP) carries NCCL's unique id from rank 0 to the others.
//   TANDEM_ASSIGN_OR_RETURN(auto gloo, CreateGlooCommunicator(gloo_options));
//   TANDEM_ASSIGN_OR_RETURN(auto nccl, CreateNcclCommunicator(*gloo, {.device = local_rank}));
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tandem/collective/communicator.h"

namespace tandem::collective {

struct NcclOptions {
  int device = 0;
  // The cudaStream_t to queue collectives on (the CUDA backend's stream, so they follow the
  // kernels that produce their input); null: a stream of the communicator's own.
  void* stream = nullptr;
  absl::Duration timeout = absl::Seconds(30);
};

// Joins the NCCL group of `bootstrap`'s ranks (same rank and size), which carries the unique id.
// FailedPrecondition when this build has no NCCL or the device does not exist.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& bootstrap,
                                                                     const NcclOptions& options);

// Whether this build includes the NCCL communicator.
bool NcclBuilt();

}  // namespace tandem::collective
