// Linear layers through cuBLAS (loaded on first use: cublas_loader.h).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/base/half.h"

namespace tandem::kernels::cuda {

// Only handles of CreateCublasHandle, which loaded cuBLAS (cublas_loader.h).
struct CublasHandleDeleter {
  void operator()(cublasContext* handle) const;
};
using CublasHandle = std::unique_ptr<cublasContext, CublasHandleDeleter>;

// A handle bound to `stream`, in default math mode: plain fp32 (TF32 only if opted in), so
// results stay comparable with the CPU backend at fp32 tolerance.
absl::StatusOr<CublasHandle> CreateCublasHandle(cudaStream_t stream);

// y[m, n] = x[m, k] * w[n, k]^T (+ bias[n] when not null). Device memory, row-major; the handle
// runs on `stream`.
absl::Status LaunchLinear(cublasHandle_t handle, const float* x, int m, const float* w, int n,
                          int k, const float* bias, float* y, cudaStream_t stream);

// The same with w[n, k] of w_dtype (kBF16 or kF16), widened to fp32 as it is read; fp32
// products and accumulation, so results match the fp32 path on the widened weights to
// rounding. x stays fp32: cuBLAS's bf16 GEMMs would round it to bf16.
absl::Status LaunchLinearLowPrecision(const float* x, int m, const void* w, DType w_dtype, int n,
                                      int k, const float* bias, float* y, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
