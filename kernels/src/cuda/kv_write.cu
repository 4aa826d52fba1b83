#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/kv_write.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One block per token.
__global__ void WriteKvKernel(const float* __restrict__ k,  // [tokens, num_kv_heads, head_dim]
                              const float* __restrict__ v,  // [tokens, num_kv_heads, head_dim]
                              const int32_t* __restrict__ slot_mapping,  // [tokens]
                              int64_t row,                               // num_kv_heads * head_dim
                              float* k_cache,    // [num_blocks * block_size, row]
                              float* v_cache) {  // [num_blocks * block_size, row]
  const int64_t slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const int64_t src = static_cast<int64_t>(blockIdx.x) * row;
  for (int64_t i = threadIdx.x; i < row; i += blockDim.x) {
    k_cache[slot * row + i] = k[src + i];
    v_cache[slot * row + i] = v[src + i];
  }
}

}  // namespace

absl::Status LaunchWriteKv(const float* k, const float* v, const int32_t* slot_mapping, int tokens,
                           const KvLayout& layout, float* layer_cache, cudaStream_t stream) {
  if (tokens <= 0) return absl::OkStatus();
  const int64_t row = static_cast<int64_t>(layout.num_kv_heads) * layout.head_dim;
  WriteKvKernel<<<tokens, kThreads, 0, stream>>>(k, v, slot_mapping, row, layer_cache,
                                                 layer_cache + layout.HalfElements());
  return CudaStatus(cudaGetLastError(), "WriteKvKernel");
}

}  // namespace tandem::kernels::cuda
