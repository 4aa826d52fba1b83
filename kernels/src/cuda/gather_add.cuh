// Sum of the same rows of two matrices, gathered: the hidden state of the rows that sample.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace tandem::kernels::cuda {

// out[i, :] = a[rows[i], :] + b[rows[i], :] for i < num_rows. a, b: [*, dim]; rows: [num_rows];
// out: [num_rows, dim]; device memory.
absl::Status LaunchGatherAdd(const float* a, const float* b, const int32_t* rows, int num_rows,
                             int dim, float* out, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
