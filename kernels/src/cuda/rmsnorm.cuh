// RmsNorm, optionally fused with the residual add that precedes it in a transformer block.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "tandem/base/half.h"

namespace tandem::kernels::cuda {

// With residual == nullptr: y = x / rms(x) * weight (y may alias x when y_dtype is kF32).
// Otherwise: residual += x, then y = residual / rms(residual) * weight.
// x, residual, y: [rows, dim] device; weight: [dim] device. y is stored as y_dtype (kF32, kBF16
// or kF16, rounded to nearest even).
absl::Status LaunchRmsNorm(const float* x, float* residual, const float* weight, float eps,
                           int rows, int dim, void* y, DType y_dtype, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
