// tandem::kernels_cuda in a build without CUDA: the declarations of cuda_backend.h, answering
// that there is no CUDA backend, so callers choose a device at run time without an #ifdef.
#include "tandem/kernels/cuda_backend.h"

namespace tandem::kernels {

bool CudaBuilt() { return false; }

int CudaDeviceCount() { return 0; }

int64_t CudaAttentionWorkspaceBytes(int, int, int, int) { return 0; }

absl::StatusOr<std::unique_ptr<CudaBackend>> CreateCudaBackend(const CudaBackendOptions&) {
  return absl::FailedPreconditionError(
      "this build has no CUDA backend (configure with -DTANDEM_CUDA=ON where nvcc is installed)");
}

}  // namespace tandem::kernels
