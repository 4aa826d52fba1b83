#include <algorithm>

#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/element_types.cuh"
#include "kernels/src/cuda/silu_mul.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;

template <typename Out>
__global__ void SiluMulKernel(const float* __restrict__ gate_up,  // [rows, 2 * inter]
                              int64_t total, int inter,
                              Out* __restrict__ out) {  // [rows, inter]
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / inter;
    const int64_t i = idx % inter;
    const float gate = gate_up[row * 2 * inter + i];
    const float up = gate_up[row * 2 * inter + inter + i];
    out[idx] = FromFloat<Out>(gate / (1.0f + expf(-gate)) * up);
  }
}

}  // namespace

absl::Status LaunchSiluMul(const float* gate_up, int rows, int inter, void* out,
                           DType out_dtype, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(rows) * inter;
  if (total <= 0) return absl::OkStatus();
  const int blocks = static_cast<int>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535));
  TANDEM_DISPATCH_ACTIVATION_DTYPE(out_dtype, Out, {
    SiluMulKernel<Out>
        <<<blocks, kThreads, 0, stream>>>(gate_up, total, inter, static_cast<Out*>(out));
  });
  return CudaStatus(cudaGetLastError(), "SiluMulKernel");
}

}  // namespace tandem::kernels::cuda
