#include <cstdint>

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
    const uint8_t byte = w.values[row * QuantizedRowBytes(kQuant, w.k) + j / 2];
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

// The wide kernel: each lane takes kWideElems consecutive columns (of the stored order) of W
// per step, one 4-byte (int4) or 8-byte (int8) load per output column, all in one group; a
// warp's lanes cover 32 x kWideElems columns of k, coalesced, for kWideCols output columns at
// once, so that each x value read serves all of them. grid (ceil(n / (kWarps x kWideCols)),
// ceil(m / kRows)), kWarps * 32 threads.
constexpr int kWideElems = 8;
constexpr int kWideCols = 2;

template <WeightQuant kQuant>
__global__ void __launch_bounds__(kWarps * 32)
    QuantizedWideGemvKernel(const float* __restrict__ x,  // [m, k], 16-byte aligned rows
                            int m, DeviceQuantizedWeight w,
                            const float* __restrict__ bias,  // [n] or null
                            float* __restrict__ y) {         // [m, n]
  const int col0 = (blockIdx.x * kWarps + threadIdx.x / 32) * kWideCols;
  const int lane = threadIdx.x % 32;
  const int row0 = blockIdx.y * kRows;
  if (col0 >= w.n) return;
  const int rows = min(kRows, m - row0);
  const int64_t row_bytes = QuantizedRowBytes(kQuant, w.k);
  float acc[kWideCols][kRows] = {};
  for (int e0 = lane * kWideElems; e0 < w.k; e0 += 32 * kWideElems) {
    // x of the kWideElems columns, per row (gathered through k_order when set).
    float xv[kRows][kWideElems];
    if (w.k_order == nullptr) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < rows) {
          const float4* xr =
              reinterpret_cast<const float4*>(x + static_cast<int64_t>(row0 + r) * w.k + e0);
          const float4 a = __ldg(xr), b = __ldg(xr + 1);
          xv[r][0] = a.x, xv[r][1] = a.y, xv[r][2] = a.z, xv[r][3] = a.w;
          xv[r][4] = b.x, xv[r][5] = b.y, xv[r][6] = b.z, xv[r][7] = b.w;
        }
      }
    } else {
      int feature[kWideElems];
#pragma unroll
      for (int e = 0; e < kWideElems; ++e) feature[e] = __ldg(w.k_order + e0 + e);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < rows) {
          const float* xr = x + static_cast<int64_t>(row0 + r) * w.k;
#pragma unroll
          for (int e = 0; e < kWideElems; ++e) xv[r][e] = __ldg(xr + feature[e]);
        }
      }
    }
    const int g = e0 / w.group_size;
#pragma unroll
    for (int c = 0; c < kWideCols; ++c) {
      const int col = col0 + c;
      if (col >= w.n) break;
      const float scale = __ldg(w.scales + static_cast<int64_t>(col) * w.groups + g);
      float wq[kWideElems];
      if constexpr (kQuant == WeightQuant::kInt4) {
        const float zero = __ldg(w.zeros + static_cast<int64_t>(col) * w.groups + g);
        const uint32_t word = __ldg(reinterpret_cast<const uint32_t*>(
            w.values + static_cast<int64_t>(col) * row_bytes + e0 / 2));
#pragma unroll
        for (int e = 0; e < kWideElems; ++e) {
          wq[e] = (static_cast<float>((word >> (4 * e)) & 15u) - zero) * scale;
        }
      } else {
        const uint2 words = __ldg(
            reinterpret_cast<const uint2*>(w.values + static_cast<int64_t>(col) * row_bytes + e0));
#pragma unroll
        for (int e = 0; e < kWideElems; ++e) {
          const uint32_t word = e < 4 ? words.x : words.y;
          wq[e] = static_cast<float>(static_cast<int8_t>((word >> (8 * (e % 4))) & 255u)) * scale;
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < rows) {
#pragma unroll
          for (int e = 0; e < kWideElems; ++e) acc[c][r] += xv[r][e] * wq[e];
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kWideCols; ++c) {
    const int col = col0 + c;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float v = acc[c][r];
      for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
      if (lane == 0 && col < w.n && r < rows) {
        y[static_cast<int64_t>(row0 + r) * w.n + col] = v + (bias ? bias[col] : 0.0f);
      }
    }
  }
}

// Whether a call can take QuantizedWideGemvKernel: equal groups whole units of kWideElems
// columns (so a lane's columns share one group and its loads stay aligned), and x whose rows
// are 16-byte aligned.
bool WideGemvTakes(const float* x, const DeviceQuantizedWeight& w) {
  return w.column_group == nullptr && w.group_size > 0 && w.group_size % kWideElems == 0 &&
         w.k % kWideElems == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w.values) % 8 == 0;
}

}  // namespace

absl::Status LaunchQuantizedLinear(const float* x, int m, const DeviceQuantizedWeight& w,
                                   const float* bias, float* y, cudaStream_t stream) {
  if (m <= 0 || w.n <= 0) return absl::OkStatus();
  const int row_blocks = (m + kRows - 1) / kRows;
  if (row_blocks > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("Linear of ", m, " rows: grid too large"));
  }
  if (w.quant != WeightQuant::kInt8 && w.quant != WeightQuant::kInt4) {
    return absl::InvalidArgumentError("Linear: not a quantised weight");
  }
  // The wide kernel where it takes W and x, else the byte kernel; output columns per block.
  const bool wide = WideGemvTakes(x, w);
  const bool int8 = w.quant == WeightQuant::kInt8;
  void (*kernel)(const float*, int, DeviceQuantizedWeight, const float*, float*) =
      wide ? (int8 ? &QuantizedWideGemvKernel<WeightQuant::kInt8>
                   : &QuantizedWideGemvKernel<WeightQuant::kInt4>)
           : (int8 ? &QuantizedGemvKernel<WeightQuant::kInt8>
                   : &QuantizedGemvKernel<WeightQuant::kInt4>);
  const int columns = wide ? kWarps * kWideCols : kWarps;
  const dim3 grid((w.n + columns - 1) / columns, row_blocks);
  kernel<<<grid, kWarps * 32, 0, stream>>>(x, m, w, bias, y);
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("Linear (quantised weights): ", cudaGetErrorString(error)));
  }
  return absl::OkStatus();
}

}  // namespace tandem::kernels::cuda
