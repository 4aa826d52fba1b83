// CreateNcclCommunicator in a build without CUDA or NCCL.
#include "tandem/collective/nccl_communicator.h"

namespace tandem::collective {

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator&,
                                                                     const NcclOptions&) {
  return absl::FailedPreconditionError(
      "this build of Tandem has no NCCL communicator (configured without CUDA or NCCL)");
}

bool NcclBuilt() { return false; }

}  // namespace tandem::collective
