#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "kernels/src/cuda/cublas_loader.h"
#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/element_types.cuh"
#include "kernels/src/cuda/linear.cuh"
#include "kernels/src/cuda/mma.cuh"
#include "kernels/src/cuda/mma_layout.h"
#include "kernels/src/cuda/reduce.cuh"
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

// y[m, n] += bias[n] after a cuBLAS product (which has no bias); nothing when bias is null.
absl::Status AddBias(float* y, const float* bias, int m, int n, cudaStream_t stream) {
  if (bias == nullptr) return absl::OkStatus();
  const int64_t total = static_cast<int64_t>(m) * n;
  const int blocks = static_cast<int>(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535));
  AddBiasKernel<<<blocks, kThreads, 0, stream>>>(y, bias, total, n);
  return CudaStatus(cudaGetLastError(), "AddBiasKernel");
}

constexpr int kGemvWarps = 8;

// Decode rows that GemvVecKernel cannot take (k not a multiple of 8, or unaligned): one warp per
// output column, its lanes striding over k, so W is read once, coalesced. m <= kGemvMaxRows.
// grid ceil(n / kGemvWarps), kGemvWarps * 32 threads.
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
    v = WarpSum(v);
    if (lane == 0 && r < m) y[static_cast<int64_t>(r) * n + col] = v + (bias ? bias[col] : 0.0f);
  }
}

// Eight weights of one 16-byte load, widened (pairwise, as the 16-bit types convert).
template <typename W>
__device__ void Widen8(const uint4& raw, float (&out)[8]);
template <>
__device__ __forceinline__ void Widen8<__nv_bfloat16>(const uint4& raw, float (&out)[8]) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
template <>
__device__ __forceinline__ void Widen8<__half>(const uint4& raw, float (&out)[8]) {
  const auto* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// A 16-byte load that skips L1: each weight byte is read once per call.
__device__ __forceinline__ uint4 LoadStreaming(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

constexpr int kVecWarps = 4;     // warps per block
constexpr int kVecCols = 2;      // output columns per warp
constexpr int kVecUnroll = 4;    // 16-byte loads per column in flight per lane

// Decode GEMV at the bandwidth limit, for 16-bit weights with k % 8 == 0 and 16-byte aligned
// x and w: each warp owns kVecCols columns and streams them in 16-byte loads (kVecUnroll in
// flight per lane), x is read as float4 through the read-only cache and reused across the
// warp's columns; fp32 products and accumulation. kRows >= m rows of x (a template bound, so
// the accumulators stay in registers). grid ceil(n / (kVecWarps * kVecCols)), kVecWarps * 32.
template <typename W, int kRows>
__global__ void __launch_bounds__(kVecWarps * 32)
    GemvVecKernel(const float* __restrict__ x, int m, const W* __restrict__ w, int n, int k,
                  const float* __restrict__ bias, float* __restrict__ y) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int col0 = (blockIdx.x * kVecWarps + warp) * kVecCols;
  if (col0 >= n) return;
  const int chunks = k / 8;  // 16-byte chunks per weight row
  const uint4* wrow[kVecCols];
#pragma unroll
  for (int c = 0; c < kVecCols; ++c) {
    // A column past n re-reads the last one; its sum is not written.
    wrow[c] = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(min(col0 + c, n - 1)) * k);
  }
  float acc[kRows][kVecCols] = {};
  for (int base = 0; base < chunks; base += 32 * kVecUnroll) {
    uint4 raw[kVecUnroll][kVecCols];
#pragma unroll
    for (int u = 0; u < kVecUnroll; ++u) {
      const int chunk = base + u * 32 + lane;
#pragma unroll
      for (int c = 0; c < kVecCols; ++c) {
        raw[u][c] = chunk < chunks ? LoadStreaming(wrow[c] + chunk) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kVecUnroll; ++u) {
      const int chunk = base + u * 32 + lane;
      if (chunk >= chunks) break;
      float wf[kVecCols][8];
#pragma unroll
      for (int c = 0; c < kVecCols; ++c) Widen8<W>(raw[u][c], wf[c]);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (r < m) {
          const float4* xr = reinterpret_cast<const float4*>(x + static_cast<int64_t>(r) * k) +
                             2 * chunk;
          const float4 a = __ldg(xr);
          const float4 b = __ldg(xr + 1);
#pragma unroll
          for (int c = 0; c < kVecCols; ++c) {
            float s = acc[r][c];
            s += a.x * wf[c][0];
            s += a.y * wf[c][1];
            s += a.z * wf[c][2];
            s += a.w * wf[c][3];
            s += b.x * wf[c][4];
            s += b.y * wf[c][5];
            s += b.z * wf[c][6];
            s += b.w * wf[c][7];
            acc[r][c] = s;
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (r >= m) break;
#pragma unroll
    for (int c = 0; c < kVecCols; ++c) {
      const float v = WarpSum(acc[r][c]);
      const int col = col0 + c;
      if (lane == 0 && col < n) {
        y[static_cast<int64_t>(r) * n + col] = v + (bias ? bias[col] : 0.0f);
      }
    }
  }
}

template <typename W, int kRows>
void LaunchGemvVec(const float* x, int m, const W* w, int n, int k, const float* bias, float* y,
                   cudaStream_t stream) {
  constexpr int kColsPerBlock = kVecWarps * kVecCols;
  GemvVecKernel<W, kRows>
      <<<(n + kColsPerBlock - 1) / kColsPerBlock, kVecWarps * 32, 0, stream>>>(x, m, w, n, k,
                                                                              bias, y);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Runs GemvVecKernel when it takes this call (16-bit weights, m <= kGemvMaxRows, k a multiple of
// 8, 16-byte aligned x and w); false otherwise.
template <typename W>
bool TryGemvVec(const float* x, int m, const W* w, int n, int k, const float* bias, float* y,
                cudaStream_t stream) {
  if (m > kGemvMaxRows || k % 8 != 0 || !Aligned16(x) || !Aligned16(w)) {
    return false;
  }
  static_assert(kGemvMaxRows == 4);
  if (m == 1) {
    LaunchGemvVec<W, 1>(x, m, w, n, k, bias, y, stream);
  } else if (m == 2) {
    LaunchGemvVec<W, 2>(x, m, w, n, k, bias, y, stream);
  } else {
    LaunchGemvVec<W, 4>(x, m, w, n, k, bias, y, stream);
  }
  return true;
}

// Decode rows (m <= kGemvMaxRows) of 16-bit weights W.
template <typename W>
void LaunchDecodeRows(const float* x, int m, const W* w, int n, int k, const float* bias,
                      float* y, cudaStream_t stream) {
  if (TryGemvVec(x, m, w, n, k, bias, y, stream)) return;
  GemvKernel<W><<<(n + kGemvWarps - 1) / kGemvWarps, kGemvWarps * 32, 0, stream>>>(x, m, w, n, k,
                                                                                   bias, y);
}

// x rounded to the weights' 16-bit type for the tensor cores. Grid-stride over `count`.
template <typename W>
__global__ void NarrowKernel(const float* __restrict__ x, int64_t count, W* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = FromFloat<W>(x[i]);
  }
}

constexpr int kSkinnyWarps = 8;   // warps per block, splitting k between them
constexpr int kSkinnyUnroll = 4;  // 32-wide k chunks per warp in flight

// 32-bit word j (0..3) of a 16-byte load.
__device__ __forceinline__ uint32_t Word(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// y[m, n] = x16[m, k] w[n, k]^T (+ bias[n]) for m <= 8 kMTiles rows, on the tensor cores at the
// weights' bandwidth: one block per 16 rows of W, its warps taking every kSkinnyWarps-th 32-wide
// k chunk, the mma fragments straight from 16-byte loads (mma_layout.h's Skinny* functions:
// W as A, x as B, k walked in the same permuted order by both), fp32 accumulation, the warps'
// partial sums added in shared memory in a fixed order. k % 8 == 0; x16 and w 16-byte aligned.
// grid ceil(n / 16), kSkinnyWarps * 32 threads.
template <typename W, int kMTiles>
__global__ void __launch_bounds__(kSkinnyWarps * 32)
    SkinnyMmaKernel(const W* __restrict__ x16, int m, const W* __restrict__ w, int n, int k,
                    const float* __restrict__ bias, float* __restrict__ y) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int n0 = blockIdx.x * 16;
  // Rows past n re-read the last one; their sums are not written.
  const W* wrow[2] = {w + static_cast<int64_t>(min(n0 + g, n - 1)) * k,
                      w + static_cast<int64_t>(min(n0 + g + 8, n - 1)) * k};
  const W* xrow[kMTiles];
  bool x_row_in[kMTiles];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    x_row_in[mt] = 8 * mt + g < m;
    xrow[mt] = x16 + static_cast<int64_t>(min(8 * mt + g, m - 1)) * k;
  }
  float acc[kMTiles][4] = {};
  const int chunks = (k + 31) / 32;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int first = warp; first < chunks; first += kSkinnyWarps * kSkinnyUnroll) {
    uint4 wl[kSkinnyUnroll][2];
    uint4 xl[kSkinnyUnroll][kMTiles];
#pragma unroll
    for (int u = 0; u < kSkinnyUnroll; ++u) {
      const int at = (first + u * kSkinnyWarps) * 32 + 8 * t;  // k % 8 == 0: all 8 or none
      const bool in = first + u * kSkinnyWarps < chunks && at < k;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        wl[u][r] = in ? LoadStreaming(reinterpret_cast<const uint4*>(wrow[r] + at)) : zero;
      }
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        xl[u][mt] = in && x_row_in[mt] ? __ldg(reinterpret_cast<const uint4*>(xrow[mt] + at))
                                       : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < kSkinnyUnroll; ++u) {
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        uint32_t a[4];
#pragma unroll
        for (int reg = 0; reg < 4; ++reg) {
          a[reg] = Word(wl[u][mma::SkinnyARow(reg)], mma::SkinnyAWord(step, reg));
        }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          Mma16<W>::Mma(acc[mt], a, Word(xl[u][mt], mma::SkinnyBWord(step, 0)),
                        Word(xl[u][mt], mma::SkinnyBWord(step, 1)));
        }
      }
    }
  }
  __shared__ float partial[kSkinnyWarps][kMTiles * 4][32];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][mt * 4 + i][lane] = acc[mt][i];
  }
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float sum = 0.0f;
#pragma unroll
      for (int from = 0; from < kSkinnyWarps; ++from) sum += partial[from][mt * 4 + i][lane];
      const mma::Coord c = mma::CElement(lane, i);  // row: W's row, column: x's row
      const int col = n0 + c.row;
      const int row = 8 * mt + c.col;
      if (col < n && row < m) {
        y[static_cast<int64_t>(row) * n + col] = sum + (bias != nullptr ? bias[col] : 0.0f);
      }
    }
  }
}

template <typename W>
void LaunchSkinny(const void* x16, int m, const void* w, int n, int k, const float* bias,
                  float* y, cudaStream_t stream) {
  const int blocks = (n + 15) / 16;
  const auto* x = static_cast<const W*>(x16);
  const auto* wt = static_cast<const W*>(w);
  if (m <= 8) {
    SkinnyMmaKernel<W, 1><<<blocks, kSkinnyWarps * 32, 0, stream>>>(x, m, wt, n, k, bias, y);
  } else {
    SkinnyMmaKernel<W, 2><<<blocks, kSkinnyWarps * 32, 0, stream>>>(x, m, wt, n, k, bias, y);
  }
}

// LinearAdd's rows: only the cuBLASLt and cublasGemmEx paths add into y (beta = 1), the GEMV
// and skinny kernels write it.
absl::Status CheckAccumulate(bool accumulate, int m) {
  if (!accumulate || m > kSkinnyMaxRows) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("no CUDA Linear adds into y at ", m, " rows (only past ", kSkinnyMaxRows, ")"));
}

}  // namespace

absl::Status LaunchLinearLowPrecision(const GemmEngines& engines, const float* x, int m,
                                      const void* w, DType w_dtype, int n, int k, const float* bias,
                                      float* y, void* x16, cudaStream_t stream, bool accumulate) {
  if (m <= 0 || n <= 0) return absl::OkStatus();
  const bool bf16 = w_dtype == DType::kBF16;
  if (!bf16 && w_dtype != DType::kF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("no 16-bit CUDA Linear for weights of ", DTypeName(w_dtype)));
  }
  TANDEM_RETURN_IF_ERROR(CheckAccumulate(accumulate, m));
  if (m <= kGemvMaxRows) {
    if (bf16) {
      LaunchDecodeRows(x, m, static_cast<const __nv_bfloat16*>(w), n, k, bias, y, stream);
    } else {
      LaunchDecodeRows(x, m, static_cast<const __half*>(w), n, k, bias, y, stream);
    }
    return CudaStatus(cudaGetLastError(), "Linear (16-bit weights)");
  }
  // Prefill: the tensor cores, on x rounded to the weights' type.
  const int64_t count = static_cast<int64_t>(m) * k;
  const int blocks = static_cast<int>(std::min<int64_t>((count + kThreads - 1) / kThreads, 4096));
  if (bf16) {
    NarrowKernel<<<blocks, kThreads, 0, stream>>>(x, count, static_cast<__nv_bfloat16*>(x16));
  } else {
    NarrowKernel<<<blocks, kThreads, 0, stream>>>(x, count, static_cast<__half*>(x16));
  }
  TANDEM_RETURN_IF_ERROR(CudaStatus(cudaGetLastError(), "Linear: narrowing x"));
  return LaunchLinear16(engines, x16, m, w, w_dtype, n, k, bias, y, stream, accumulate);
}

absl::Status LaunchLinear16(const GemmEngines& engines, const void* x16, int m, const void* w,
                            DType w_dtype, int n, int k, const float* bias, float* y,
                            cudaStream_t stream, bool accumulate) {
  if (m <= 0 || n <= 0) return absl::OkStatus();
  if (w_dtype != DType::kBF16 && w_dtype != DType::kF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("no 16-bit CUDA Linear for weights of ", DTypeName(w_dtype)));
  }
  TANDEM_RETURN_IF_ERROR(CheckAccumulate(accumulate, m));
  if (engines.skinny && m <= kSkinnyMaxRows && k % 8 == 0 && Aligned16(x16) && Aligned16(w)) {
    if (w_dtype == DType::kBF16) {
      LaunchSkinny<__nv_bfloat16>(x16, m, w, n, k, bias, y, stream);
    } else {
      LaunchSkinny<__half>(x16, m, w, n, k, bias, y, stream);
    }
    return CudaStatus(cudaGetLastError(), "SkinnyMmaKernel");
  }
  const cudaDataType_t type = w_dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F;
  LtGemm* lt = engines.lt;
  if (lt != nullptr) {
    // The bias in the epilogue; cublasGemmEx below only where cuBLASLt has no algorithm.
    absl::Status status = lt->Run({.x16 = x16,
                                   .m = m,
                                   .w = w,
                                   .type = type,
                                   .n = n,
                                   .k = k,
                                   .bias = bias,
                                   .y = y,
                                   .accumulate = accumulate},
                                  stream);
    if (!absl::IsUnimplemented(status)) return status;
  }
  TANDEM_ASSIGN_OR_RETURN(const CublasApi* api, LoadCublas());
  const float one = 1.0f;
  const float beta = accumulate ? 1.0f : 0.0f;
  // Row-major y[m, n] = x W^T is column-major y^T[n, m] = W[n, k] (W^T stored) * x^T[k, m].
  TANDEM_RETURN_IF_ERROR(CublasStatus(
      *api,
      api->gemm_ex(engines.cublas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, type, k, x16, type,
                   k, &beta, y, CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx"));
  return AddBias(y, bias, m, n, stream);
}

void CublasHandleDeleter::operator()(cublasContext* handle) const {
  // A handle exists only once cuBLAS loaded.
  if (absl::StatusOr<const CublasApi*> api = LoadCublas(); api.ok()) (*api)->destroy(handle);
}

absl::StatusOr<CublasHandle> CreateCublasHandle(cudaStream_t stream, void* workspace,
                                                size_t workspace_bytes) {
  TANDEM_ASSIGN_OR_RETURN(const CublasApi* api, LoadCublas());
  cublasHandle_t raw = nullptr;
  TANDEM_RETURN_IF_ERROR(CublasStatus(*api, api->create(&raw), "cublasCreate"));
  CublasHandle handle(raw);
  TANDEM_RETURN_IF_ERROR(CublasStatus(*api, api->set_stream(raw, stream), "cublasSetStream"));
  // After the stream: setting one resets the workspace to cuBLAS's own.
  TANDEM_RETURN_IF_ERROR(CublasStatus(*api, api->set_workspace(raw, workspace, workspace_bytes),
                                      "cublasSetWorkspace"));
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
  if (!status.ok()) return status;
  return AddBias(y, bias, m, n, stream);
}

}  // namespace tandem::kernels::cuda
