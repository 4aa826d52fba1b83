// RmsNorm, optionally fused with the residual add that precedes it in a transformer block.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"

namespace tandem::kernels::cuda {

// With residual == nullptr: y = x / rms(x) * weight (y may alias x).
// Otherwise: residual += x, then y = residual / rms(residual) * weight.
// x, residual, y: [rows, dim] device; weight: [dim] device.
absl::Status LaunchRmsNorm(const float* x, float* residual, const float* weight, float eps,
                           int rows, int dim, float* y, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
