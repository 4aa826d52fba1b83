// The SwiGLU activation: silu(gate) * up.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "tandem/base/half.h"

namespace tandem::kernels::cuda {

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]. gate_up: [rows, 2 * inter];
// out: [rows, inter]; device memory.
absl::Status LaunchSiluMul(const float* gate_up, int rows, int inter, void* out,
                           DType out_dtype, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
