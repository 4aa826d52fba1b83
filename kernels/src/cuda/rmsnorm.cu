#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/element_types.cuh"
#include "kernels/src/cuda/reduce.cuh"
#include "kernels/src/cuda/rmsnorm.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row.
template <bool kAddResidual, typename Y>
__global__ void RmsNormKernel(const float* x,                    // [rows, dim]; may alias y
                              float* residual,                   // [rows, dim] or unused
                              const float* __restrict__ weight,  // [dim]
                              float eps, int dim,
                              Y* y) {  // [rows, dim]; may alias x (Y float)
  __shared__ float scratch[32];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * dim;
  float sum_sq = 0.0f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = x[base + i];
    if constexpr (kAddResidual) {
      v += residual[base + i];
      residual[base + i] = v;
    }
    sum_sq += v * v;
  }
  sum_sq = BlockReduce<false>(sum_sq, scratch);
  const float inv_rms = rsqrtf(sum_sq / dim + eps);
  // Each thread reads back only the elements it wrote, so no barrier is needed in between.
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    const float v = kAddResidual ? residual[base + i] : x[base + i];
    y[base + i] = FromFloat<Y>(v * inv_rms * weight[i]);
  }
}

}  // namespace

absl::Status LaunchRmsNorm(const float* x, float* residual, const float* weight, float eps,
                           int rows, int dim, void* y, DType y_dtype, cudaStream_t stream) {
  if (rows <= 0) return absl::OkStatus();
  if (dim <= 0) return absl::InvalidArgumentError("RmsNorm needs dim > 0");
  TANDEM_DISPATCH_ACTIVATION_DTYPE(y_dtype, Y, {
    TANDEM_DISPATCH_BOOL(residual != nullptr, kAddResidual, {
      RmsNormKernel<kAddResidual, Y>
          <<<rows, kThreads, 0, stream>>>(x, residual, weight, eps, dim, static_cast<Y*>(y));
    });
  });
  return CudaStatus(cudaGetLastError(), "RmsNormKernel");
}

}  // namespace tandem::kernels::cuda
