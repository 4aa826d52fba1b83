#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/linear.cuh"
#include "tandem/base/status_macros.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;

absl::Status CublasStatus(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cublasGetStatusName(status)));
}

__global__ void AddBiasKernel(float* __restrict__ y,           // [m, n]
                              const float* __restrict__ bias,  // [n]
                              int64_t total, int n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += bias[i % n];
  }
}

}  // namespace

absl::StatusOr<CublasHandle> CreateCublasHandle(cudaStream_t stream) {
  cublasHandle_t raw = nullptr;
  TANDEM_RETURN_IF_ERROR(CublasStatus(cublasCreate(&raw), "cublasCreate"));
  CublasHandle handle(raw);
  TANDEM_RETURN_IF_ERROR(CublasStatus(cublasSetStream(raw, stream), "cublasSetStream"));
  TANDEM_RETURN_IF_ERROR(
      CublasStatus(cublasSetMathMode(raw, CUBLAS_DEFAULT_MATH), "cublasSetMathMode"));
  return handle;
}

absl::Status LaunchLinear(cublasHandle_t handle, const float* x, int m, const float* w, int n,
                          int k, const float* bias, float* y, cudaStream_t stream) {
  if (m <= 0 || n <= 0) return absl::OkStatus();
  // Row-major y[m, n] = x W^T is column-major y^T[n, m] = W[n, k] (W^T stored) * x^T[k, m].
  const float one = 1.0f;
  const float zero = 0.0f;
  absl::Status status = CublasStatus(
      cublasSgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, k, x, k, &zero, y, n),
      "cublasSgemm");
  if (!status.ok() || bias == nullptr) return status;
  const int64_t total = static_cast<int64_t>(m) * n;
  const int blocks = static_cast<int>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535));
  AddBiasKernel<<<blocks, kThreads, 0, stream>>>(y, bias, total, n);
  return CudaStatus(cudaGetLastError(), "AddBiasKernel");
}

}  // namespace tandem::kernels::cuda
