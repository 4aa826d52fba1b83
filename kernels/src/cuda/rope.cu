#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/rope.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 128;

// One block per token; threads walk (head, pair).
__global__ void RopeKernel(float* x,                               // [tokens, heads, head_dim]
                           const int32_t* __restrict__ positions,  // [tokens]
                           int heads, int head_dim,
                           const float* __restrict__ inv_freq) {  // [head_dim / 2]
  const int half = head_dim / 2;
  const int token = blockIdx.x;
  const float position = static_cast<float>(positions[token]);
  float* xt = x + static_cast<int64_t>(token) * heads * head_dim;
  for (int idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
    const int h = idx / half;
    const int i = idx % half;
    // The angle is rounded to float before cos/sin, as Hugging Face computes it.
    float s, c;
    sincosf(position * inv_freq[i], &s, &c);
    float* xh = xt + h * head_dim;
    const float x1 = xh[i];
    const float x2 = xh[i + half];
    xh[i] = x1 * c - x2 * s;
    xh[i + half] = x2 * c + x1 * s;
  }
}

}  // namespace

absl::Status LaunchRope(float* x, const int32_t* positions, int tokens, int heads, int head_dim,
                        const float* inv_freq, cudaStream_t stream) {
  if (tokens <= 0 || heads <= 0) return absl::OkStatus();
  if (head_dim <= 0 || head_dim % 2 != 0) {
    return absl::InvalidArgumentError("Rope needs an even head_dim");
  }
  RopeKernel<<<tokens, kThreads, 0, stream>>>(x, positions, heads, head_dim, inv_freq);
  return CudaStatus(cudaGetLastError(), "RopeKernel");
}

}  // namespace tandem::kernels::cuda
