#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/src/cuda/cublas_loader.h"
#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/element_types.cuh"
#include "kernels/src/cuda/linear.cuh"
#include "tandem/base/status_macros.h"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// Of a call through `api`.
absl::Status CublasStatus(const CublasApi& api, cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", api.status_name(status)));
}

__global__ void AddBiasKernel(float* __restrict__ y,           // [m, n]
                              const float* __restrict__ bias,  // [n]
                              int64_t total, int n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] += bias[i % n];
  }
}

// Rows of x a GEMV block serves at once; more rows take the tiled kernel.
constexpr int kGemvMaxRows = 4;
constexpr int kGemvWarps = 8;
constexpr int kTile = 16;

// Few rows (decode): one warp per output column, its lanes striding over k, so W is read once,
// coalesced. grid ceil(n / kGemvWarps), kGemvWarps * 32 threads.
template <typename W>
__global__ void GemvKernel(const float* __restrict__ x,                   // [m, k]
                           int m, const W* __restrict__ w,                // [n, k]
                           int n, int k, const float* __restrict__ bias,  // [n] or null
                           float* __restrict__ y) {                       // [m, n]
  const int col = blockIdx.x * kGemvWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (col >= n) return;
  float acc[kGemvMaxRows] = {};
  const W* wc = w + static_cast<int64_t>(col) * k;
  for (int i = lane; i < k; i += 32) {
    const float wi = ToFloat(wc[i]);
#pragma unroll
    for (int r = 0; r < kGemvMaxRows; ++r) {
      if (r < m) acc[r] += x[static_cast<int64_t>(r) * k + i] * wi;
    }
  }
#pragma unroll
  for (int r = 0; r < kGemvMaxRows; ++r) {
    float v = acc[r];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (lane == 0 && r < m) y[static_cast<int64_t>(r) * n + col] = v + (bias ? bias[col] : 0.0f);
  }
}

// More rows: kTile x kTile output tiles through shared memory. grid (ceil(n / kTile),
// ceil(m / kTile)), kTile x kTile threads.
template <typename W>
__global__ void GemmTileKernel(const float* __restrict__ x, int m, const W* __restrict__ w, int n,
                               int k, const float* __restrict__ bias, float* __restrict__ y) {
  __shared__ float xs[kTile][kTile + 1];
  __shared__ float ws[kTile][kTile + 1];
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int row = blockIdx.y * kTile + ty;
  const int col = blockIdx.x * kTile + tx;
  const int w_row = blockIdx.x * kTile + ty;
  float acc = 0.0f;
  for (int k0 = 0; k0 < k; k0 += kTile) {
    xs[ty][tx] = row < m && k0 + tx < k ? x[static_cast<int64_t>(row) * k + k0 + tx] : 0.0f;
    ws[ty][tx] =
        w_row < n && k0 + tx < k ? ToFloat(w[static_cast<int64_t>(w_row) * k + k0 + tx]) : 0.0f;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kTile; ++i) acc += xs[ty][i] * ws[tx][i];
    __syncthreads();
  }
  if (row < m && col < n) y[static_cast<int64_t>(row) * n + col] = acc + (bias ? bias[col] : 0.0f);
}

}  // namespace

absl::Status LaunchLinearLowPrecision(const float* x, int m, const void* w, DType w_dtype, int n,
                                      int k, const float* bias, float* y, cudaStream_t stream) {
  if (m <= 0 || n <= 0) return absl::OkStatus();
  if (n > 65535 * kTile || m > 65535 * kTile) {
    return absl::InvalidArgumentError("Linear: grid too large");
  }
  TANDEM_DISPATCH_WEIGHT_DTYPE(w_dtype, W, {
    const auto* wt = static_cast<const W*>(w);
    if (m <= kGemvMaxRows) {
      GemvKernel<W><<<(n + kGemvWarps - 1) / kGemvWarps, kGemvWarps * 32, 0, stream>>>(x, m, wt, n,
                                                                                       k, bias, y);
    } else {
      const dim3 grid((n + kTile - 1) / kTile, (m + kTile - 1) / kTile);
      GemmTileKernel<W><<<grid, dim3(kTile, kTile), 0, stream>>>(x, m, wt, n, k, bias, y);
    }
  });
  return CudaStatus(cudaGetLastError(), "Linear (low-precision weights)");
}

void CublasHandleDeleter::operator()(cublasContext* handle) const {
  // A handle exists only once cuBLAS loaded.
  if (absl::StatusOr<const CublasApi*> api = LoadCublas(); api.ok()) (*api)->destroy(handle);
}

absl::StatusOr<CublasHandle> CreateCublasHandle(cudaStream_t stream) {
  TANDEM_ASSIGN_OR_RETURN(const CublasApi* api, LoadCublas());
  cublasHandle_t raw = nullptr;
  TANDEM_RETURN_IF_ERROR(CublasStatus(*api, api->create(&raw), "cublasCreate"));
  CublasHandle handle(raw);
  TANDEM_RETURN_IF_ERROR(CublasStatus(*api, api->set_stream(raw, stream), "cublasSetStream"));
  TANDEM_RETURN_IF_ERROR(CublasStatus(*api, api->set_math_mode(raw, CUBLAS_DEFAULT_MATH),
                                      "cublasSetMathMode"));
  return handle;
}

absl::Status LaunchLinear(cublasHandle_t handle, const float* x, int m, const float* w, int n,
                          int k, const float* bias, float* y, cudaStream_t stream) {
  if (m <= 0 || n <= 0) return absl::OkStatus();
  // Row-major y[m, n] = x W^T is column-major y^T[n, m] = W[n, k] (W^T stored) * x^T[k, m].
  const float one = 1.0f;
  const float zero = 0.0f;
  // The handle's existence means cuBLAS loaded.
  TANDEM_ASSIGN_OR_RETURN(const CublasApi* api, LoadCublas());
  absl::Status status = CublasStatus(
      *api, api->sgemm(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, k, x, k, &zero, y, n),
      "cublasSgemm");
  if (!status.ok() || bias == nullptr) return status;
  const int64_t total = static_cast<int64_t>(m) * n;
  const int blocks = static_cast<int>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535));
  AddBiasKernel<<<blocks, kThreads, 0, stream>>>(y, bias, total, n);
  return CudaStatus(cudaGetLastError(), "AddBiasKernel");
}

}  // namespace tandem::kernels::cuda
