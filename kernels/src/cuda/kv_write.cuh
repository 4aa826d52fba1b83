// Stores new keys and values into the paged KV cache.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "tandem/kernels/backend.h"

namespace tandem::kernels::cuda {

// Stores k, v [tokens, num_kv_heads, head_dim] at flat slots slot_mapping[t] (block *
// block_size + offset) of layer_cache [2][num_blocks][block_size][num_kv_heads][head_dim] of
// layout.dtype (8-bit caches: value / scale); negative slots are padding and are skipped. All
// pointers are device memory.
absl::Status LaunchWriteKv(const float* k, const float* v, const int32_t* slot_mapping, int tokens,
                           const KvLayout& layout, void* layer_cache, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
