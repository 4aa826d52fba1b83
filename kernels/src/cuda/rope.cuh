// Rotary position embedding, Hugging Face "rotate_half" layout (pairs i and i + head_dim / 2).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace tandem::kernels::cuda {

// Rotates x [tokens, heads, head_dim] in place. positions: [tokens]; inv_freq: [head_dim / 2];
// all device memory.
absl::Status LaunchRope(float* x, const int32_t* positions, int tokens, int heads, int head_dim,
                        const float* inv_freq, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
