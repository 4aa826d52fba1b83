#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/embedding.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One block per token.
__global__ void EmbeddingKernel(const float* __restrict__ table,  // [vocab, dim]
                                const int32_t* __restrict__ ids,  // [tokens]
                                int dim,
                                float* __restrict__ out) {  // [tokens, dim]
  const float* row = table + static_cast<int64_t>(ids[blockIdx.x]) * dim;
  float* dst = out + static_cast<int64_t>(blockIdx.x) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = row[i];
}

}  // namespace

absl::Status LaunchEmbedding(const float* table, const int32_t* ids, int tokens, int dim,
                             float* out, cudaStream_t stream) {
  if (tokens <= 0 || dim <= 0) return absl::OkStatus();
  EmbeddingKernel<<<tokens, kThreads, 0, stream>>>(table, ids, dim, out);
  return CudaStatus(cudaGetLastError(), "EmbeddingKernel");
}

}  // namespace tandem::kernels::cuda
