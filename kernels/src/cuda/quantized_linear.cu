#include "absl/strings/str_cat.h"
#include "kernels/src/cuda/quantized_linear.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kWarps = 8;  // output columns per block, one warp each
constexpr int kRows = 4;   // rows of x per block

// The dequantised element (row, column j of the stored order) of W.
template <WeightQuant kQuant>
__device__ __forceinline__ float Dequantize(const DeviceQuantizedWeight& w, int64_t row, int j) {
  const int groups = w.groups;
  const int g = w.column_group != nullptr ? w.column_group[j] : j / w.group_size;
  const float scale = w.scales[row * groups + g];
  if constexpr (kQuant == WeightQuant::kInt8) {
    return static_cast<float>(static_cast<int8_t>(w.values[row * w.k + j])) * scale;
  } else {
    const uint8_t byte = w.values[row * (w.k / 2) + j / 2];
    const int q = (j % 2 == 0) ? (byte & 15) : (byte >> 4);
    return (static_cast<float>(q) - w.zeros[row * groups + g]) * scale;
  }
}

// One warp per output column, its lanes striding over k (W read once, coalesced), for kRows
// rows of x. grid (ceil(n / kWarps), ceil(m / kRows)), kWarps * 32 threads.
template <WeightQuant kQuant>
__global__ void QuantizedGemvKernel(const float* __restrict__ x,  // [m, k]
                                    int m, DeviceQuantizedWeight w,
                                    const float* __restrict__ bias,  // [n] or null
                                    float* __restrict__ y) {         // [m, n]
  const int col = blockIdx.x * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int row0 = blockIdx.y * kRows;
  if (col >= w.n) return;
  float acc[kRows] = {};
  for (int j = lane; j < w.k; j += 32) {
    const float wj = Dequantize<kQuant>(w, col, j);
    const int feature = w.k_order != nullptr ? w.k_order[j] : j;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r < m) acc[r] += x[static_cast<int64_t>(row0 + r) * w.k + feature] * wj;
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float v = acc[r];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (lane == 0 && row0 + r < m) {
      y[static_cast<int64_t>(row0 + r) * w.n + col] = v + (bias ? bias[col] : 0.0f);
    }
  }
}

}  // namespace

absl::Status LaunchQuantizedLinear(const float* x, int m, const DeviceQuantizedWeight& w,
                                   const float* bias, float* y, cudaStream_t stream) {
  if (m <= 0 || w.n <= 0) return absl::OkStatus();
  if ((m + kRows - 1) / kRows > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("Linear of ", m, " rows: grid too large"));
  }
  const dim3 grid((w.n + kWarps - 1) / kWarps, (m + kRows - 1) / kRows);
  switch (w.quant) {
    case WeightQuant::kInt8:
      QuantizedGemvKernel<WeightQuant::kInt8><<<grid, kWarps * 32, 0, stream>>>(x, m, w, bias, y);
      break;
    case WeightQuant::kInt4:
      QuantizedGemvKernel<WeightQuant::kInt4><<<grid, kWarps * 32, 0, stream>>>(x, m, w, bias, y);
      break;
    default:
      return absl::InvalidArgumentError("Linear: not a quantised weight");
  }
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("Linear (quantised weights): ", cudaGetErrorString(error)));
  }
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
