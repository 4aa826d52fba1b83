#include "kernels/src/cuda/attention_inputs.cuh"
#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/element_types.cuh"
#include "kernels/src/cuda/reduce.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 128;

// One block per token, one warp per head: the token's q heads, then its k heads (normed, when
// a norm is given, and rotated, as RmsNorm then Rope compute them), then its v heads (stored as
// they are). Padding tokens (negative slots) write q only.
template <typename Cache>
__global__ void __launch_bounds__(kThreads)
    AttentionInputsKernel(const float* __restrict__ qkv,  // [tokens, q_dim + 2 kv_dim]
                          int num_heads, int kv_heads, int head_dim,
                          const float* __restrict__ q_norm,  // [head_dim] or null
                          const float* __restrict__ k_norm,  // [head_dim] or null
                          float eps, const int32_t* __restrict__ positions,
                          const float* __restrict__ inv_freq,  // [head_dim / 2]
                          const int32_t* __restrict__ slot_mapping, float k_scale, float v_scale,
                          Cache* __restrict__ k_cache,  // [num_blocks * block_size, kv_dim]
                          Cache* __restrict__ v_cache,  // [num_blocks * block_size, kv_dim]
                          float* __restrict__ q) {      // [tokens, q_dim]
  const int token = blockIdx.x;
  const int lane = threadIdx.x % 32;
  const int q_dim = num_heads * head_dim;
  const int kv_dim = kv_heads * head_dim;
  const int half = head_dim / 2;
  const float* row = qkv + static_cast<int64_t>(token) * (q_dim + 2 * kv_dim);
  const int64_t slot = slot_mapping[token];
  const float position = static_cast<float>(positions[token]);
  for (int item = threadIdx.x / 32; item < num_heads + 2 * kv_heads; item += kThreads / 32) {
    if (item >= num_heads + kv_heads) {
      if (slot < 0) continue;
      const int h = item - num_heads - kv_heads;
      const float* src = row + q_dim + kv_dim + h * head_dim;
      Cache* dst = v_cache + slot * kv_dim + h * head_dim;
      for (int i = lane; i < head_dim; i += 32) dst[i] = FromFloat<Cache>(src[i] / v_scale);
      continue;
    }
    const bool is_q = item < num_heads;
    if (!is_q && slot < 0) continue;
    const int h = is_q ? item : item - num_heads;
    const float* src = row + (is_q ? 0 : q_dim) + h * head_dim;
    const float* norm = is_q ? q_norm : k_norm;
    float inv_rms = 1.0f;
    if (norm != nullptr) {
      float sum_sq = 0.0f;
      for (int i = lane; i < head_dim; i += 32) sum_sq += src[i] * src[i];
      sum_sq = WarpSum(sum_sq);
      inv_rms = rsqrtf(sum_sq / head_dim + eps);
    }
    for (int i = lane; i < half; i += 32) {
      float x1 = src[i];
      float x2 = src[i + half];
      if (norm != nullptr) {
        x1 = x1 * inv_rms * norm[i];
        x2 = x2 * inv_rms * norm[i + half];
      }
      // The angle is rounded to float before cos/sin, as Hugging Face computes it.
      float s, c;
      sincosf(position * inv_freq[i], &s, &c);
      const float y1 = x1 * c - x2 * s;
      const float y2 = x2 * c + x1 * s;
      if (is_q) {
        float* dst = q + static_cast<int64_t>(token) * q_dim + h * head_dim;
        dst[i] = y1;
        dst[i + half] = y2;
      } else {
        Cache* dst = k_cache + slot * kv_dim + h * head_dim;
        dst[i] = FromFloat<Cache>(y1 / k_scale);
        dst[i + half] = FromFloat<Cache>(y2 / k_scale);
      }
    }
  }
}

}  // namespace

absl::Status LaunchAttentionInputs(const float* qkv, int tokens, int num_heads,
                                   const float* q_norm, const float* k_norm, float eps,
                                   const int32_t* positions, const float* inv_freq,
                                   const int32_t* slot_mapping, const KvLayout& layout,
                                   void* layer_cache, float* q, cudaStream_t stream) {
  if (tokens <= 0) return absl::OkStatus();
  if (layout.head_dim <= 0 || layout.head_dim % 2 != 0) {
    return absl::InvalidArgumentError("AttentionInputs needs an even head_dim");
  }
  const bool fp8 = DTypeSize(layout.dtype) == 1;
  TANDEM_DISPATCH_KV_DTYPE(layout.dtype, Cache, {
    auto* cache = static_cast<Cache*>(layer_cache);
    AttentionInputsKernel<Cache><<<tokens, kThreads, 0, stream>>>(
        qkv, num_heads, layout.num_kv_heads, layout.head_dim, q_norm, k_norm, eps, positions,
        inv_freq, slot_mapping, fp8 ? layout.k_scale : 1.0f, fp8 ? layout.v_scale : 1.0f, cache,
        cache + layout.HalfElements(), q);
  });
  return CudaStatus(cudaGetLastError(), "AttentionInputsKernel");
}

}  // namespace tandem::kernels::cuda
