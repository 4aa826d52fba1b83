#include <algorithm>

#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/gather_add.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One block per output row; threads stride over its columns.
__global__ void GatherAddKernel(const float* __restrict__ a,       // [*, dim]
                                const float* __restrict__ b,       // [*, dim]
                                const int32_t* __restrict__ rows,  // [num_rows]
                                int dim,
                                float* __restrict__ out) {  // [num_rows, dim]
  const int64_t src = static_cast<int64_t>(rows[blockIdx.x]) * dim;
  const int64_t dst = static_cast<int64_t>(blockIdx.x) * dim;
  for (int j = threadIdx.x; j < dim; j += blockDim.x) out[dst + j] = a[src + j] + b[src + j];
}

}  // namespace

absl::Status LaunchGatherAdd(const float* a, const float* b, const int32_t* rows, int num_rows,
                             int dim, float* out, cudaStream_t stream) {
  if (num_rows <= 0 || dim <= 0) return absl::OkStatus();
  GatherAddKernel<<<num_rows, std::min(kThreads, dim), 0, stream>>>(a, b, rows, dim, out);
  return CudaStatus(cudaGetLastError(), "GatherAddKernel");
}

}  // namespace tandem::kernels::cuda
