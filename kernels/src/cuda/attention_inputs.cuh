// One layer's attention inputs in one kernel: the fused projection's q, k and v split, q and k
// RMS-normed per head (Qwen3) and rotated, q written out and k and v stored into the cache.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "tandem/kernels/backend.h"

namespace tandem::kernels::cuda {

// Backend::AttentionInputs without its k and v scratch. All pointers are device memory.
absl::Status LaunchAttentionInputs(const float* qkv, int tokens, int num_heads,
                                   const float* q_norm, const float* k_norm, float eps,
                                   const int32_t* positions, const float* inv_freq,
                                   const int32_t* slot_mapping, const KvLayout& layout,
                                   void* layer_cache, float* q, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
