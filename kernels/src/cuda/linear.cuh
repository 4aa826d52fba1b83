// Linear layers through cuBLAS.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::kernels::cuda {

struct CublasHandleDeleter {
  void operator()(cublasContext* handle) const { cublasDestroy(handle); }
};
using CublasHandle = std::unique_ptr<cublasContext, CublasHandleDeleter>;

// A handle bound to `stream`, in default math mode: plain fp32 (TF32 only if opted in), so
// results stay comparable with the CPU backend at fp32 tolerance.
absl::StatusOr<CublasHandle> CreateCublasHandle(cudaStream_t stream);

// y[m, n] = x[m, k] * w[n, k]^T (+ bias[n] when not null). Device memory, row-major; the handle
// runs on `stream`.
absl::Status LaunchLinear(cublasHandle_t handle, const float* x, int m, const float* w, int n,
                          int k, const float* bias, float* y, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
