// The cuda_ipc backend in a build without CUDA: it says so, and no memory is device memory.
#include "absl/status/status.h"
#include "kvtransfer/src/cuda_ipc/cuda_ipc_agent.h"
#include "kvtransfer/src/internal.h"

namespace tandem::kvtransfer {

namespace internal {
bool IsDeviceMemory(const void*) { return false; }
}  // namespace internal

namespace cuda_ipc {
absl::StatusOr<std::unique_ptr<Agent>> CreateCudaIpcAgent(const AgentOptions&) {
  return absl::InvalidArgumentError(
      "cuda_ipc backend not built (this build has no CUDA; configure with -DTANDEM_CUDA=ON)");
}
}  // namespace cuda_ipc

}  // namespace tandem::kvtransfer
