// Linear layers over weight-only quantised matrices (int8 per row, int4 per group), widened to
// fp32 in registers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "tandem/kernels/backend.h"

namespace tandem::kernels::cuda {

// A quantised W[n, k] in device memory, in the order of QuantizedWeightView.
struct DeviceQuantizedWeight {
  WeightQuant quant = WeightQuant::kInt8;
  int n = 0;
  int k = 0;
  int group_size = 0;  // ignored when column_group is set
  int groups = 0;
  // kInt8: int8 [n, k]. kInt4: bytes [n, (k + 1) / 2], byte j of a row holding column 2j in its
  // low nibble and column 2j + 1 in its high one (0 past k).
  const uint8_t* values = nullptr;
  const float* scales = nullptr;     // [n, groups]
  const float* zeros = nullptr;      // kInt4: [n, groups]; kInt8: null
  const int32_t* k_order = nullptr;  // [k] or null
  // [k]: the group of each column, for groups of unequal size (QuantizedWeightView's
  // group_starts); null: column j is in group j / group_size.
  const int32_t* column_group = nullptr;
};

// Bytes of one row of W's values.
__host__ __device__ inline int64_t QuantizedRowBytes(WeightQuant quant, int k) {
  return quant == WeightQuant::kInt4 ? (static_cast<int64_t>(k) + 1) / 2 : k;
}

// y[m, n] = x[m, k] * dequantised(W)^T (+ bias[n] when not null), each product of
// DequantizeWeight's value, fp32 accumulation. Device memory, row-major. W of equal groups
// (group_size and k multiples of 8) with 16-byte aligned x takes a kernel of 4- and 8-byte
// weight loads, two output columns per warp; other calls read W a byte at a time. Both read W
// once per 4 rows of x: a bandwidth-bound decode kernel, not a prefill GEMM.
absl::Status LaunchQuantizedLinear(const float* x, int m, const DeviceQuantizedWeight& w,
                                   const float* bias, float* y, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
