// Token embedding lookup.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace tandem::kernels::cuda {

// out[t, :] = table[ids[t], :]. table: [vocab, dim]; ids: [tokens]; out: [tokens, dim]; device
// memory. ids are validated by the caller.
absl::Status LaunchEmbedding(const void* table, DType table_dtype, const int32_t* ids, int tokens,
                             int dim, float* out, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
