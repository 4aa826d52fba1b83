#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/element_types.cuh"
#include "kernels/src/cuda/kv_write.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One block per token.
template <typename Cache>
__global__ void WriteKvKernel(const float* __restrict__ k,  // [tokens, num_kv_heads, head_dim]
                              const float* __restrict__ v,  // [tokens, num_kv_heads, head_dim]
                              const int32_t* __restrict__ slot_mapping,  // [tokens]
                              int64_t row,                               // num_kv_heads * head_dim
                              float k_scale, float v_scale,
                              Cache* k_cache,    // [num_blocks * block_size, row]
                              Cache* v_cache) {  // [num_blocks * block_size, row]
  const int64_t slot = slot_mapping[blockIdx.x];
  if (slot < 0) return;
  const int64_t src = static_cast<int64_t>(blockIdx.x) * row;
  for (int64_t i = threadIdx.x; i < row; i += blockDim.x) {
    k_cache[slot * row + i] = FromFloat<Cache>(k[src + i] / k_scale);
    v_cache[slot * row + i] = FromFloat<Cache>(v[src + i] / v_scale);
  }
}

}  // namespace

absl::Status LaunchWriteKv(const float* k, const float* v, const int32_t* slot_mapping, int tokens,
                           const KvLayout& layout, void* layer_cache, cudaStream_t stream) {
  if (tokens <= 0) return absl::OkStatus();
  const int64_t row = static_cast<int64_t>(layout.num_kv_heads) * layout.head_dim;
  const bool fp8 = DTypeSize(layout.dtype) == 1;
  TANDEM_DISPATCH_KV_DTYPE(layout.dtype, Cache, {
    auto* cache = static_cast<Cache*>(layer_cache);
    WriteKvKernel<Cache><<<tokens, kThreads, 0, stream>>>(
        k, v, slot_mapping, row, fp8 ? layout.k_scale : 1.0f, fp8 ? layout.v_scale : 1.0f, cache,
        cache + layout.HalfElements());
  });
  return CudaStatus(cudaGetLastError(), "WriteKvKernel");
}

}  // namespace tandem::kernels::cuda
