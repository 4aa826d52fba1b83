#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/element_types.cuh"
#include "kernels/src/cuda/embedding.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One block per token.
template <typename T>
__global__ void EmbeddingKernel(const T* __restrict__ table,      // [vocab, dim]
                                const int32_t* __restrict__ ids,  // [tokens]
                                int dim,
                                float* __restrict__ out) {  // [tokens, dim]
  const T* row = table + static_cast<int64_t>(ids[blockIdx.x]) * dim;
  float* dst = out + static_cast<int64_t>(blockIdx.x) * dim;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = ToFloat(row[i]);
}

}  // namespace

absl::Status LaunchEmbedding(const void* table, DType table_dtype, const int32_t* ids, int tokens,
                             int dim, float* out, cudaStream_t stream) {
  if (tokens <= 0 || dim <= 0) return absl::OkStatus();
  TANDEM_DISPATCH_WEIGHT_DTYPE(table_dtype, T, {
    EmbeddingKernel<T>
        <<<tokens, kThreads, 0, stream>>>(static_cast<const T*>(table), ids, dim, out);
  });
  return CudaStatus(cudaGetLastError(), "EmbeddingKernel");
}

}  // namespace tandem::kernels::cuda
