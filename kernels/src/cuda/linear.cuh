// Linear layers through cuBLAS (loaded on first use: cublas_loader.h).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/src/cuda/gemm_lt.h"
#include "tandem/base/half.h"

namespace tandem::kernels::cuda {

// Only handles of CreateCublasHandle, which loaded cuBLAS (cublas_loader.h).
struct CublasHandleDeleter {
  void operator()(cublasContext* handle) const;
};
using CublasHandle = std::unique_ptr<cublasContext, CublasHandleDeleter>;

// A handle bound to `stream`, in default math mode: plain fp32 (TF32 only if opted in), so
// results stay comparable with the CPU backend at fp32 tolerance. Its workspace is
// `workspace_bytes` of the caller's device memory at `workspace` (which must outlive it), so
// that cuBLAS never allocates inside a captured step graph.
inline constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
absl::StatusOr<CublasHandle> CreateCublasHandle(cudaStream_t stream, void* workspace,
                                                size_t workspace_bytes);

// y[m, n] = x[m, k] * w[n, k]^T (+ bias[n] when not null). Device memory, row-major; the handle
// runs on `stream`.
absl::Status LaunchLinear(cublasHandle_t handle, const float* x, int m, const float* w, int n,
                          int k, const float* bias, float* y, cudaStream_t stream);

// The same with w[n, k] of w_dtype (kBF16 or kF16). Calls of m <= kGemvMaxRows rows keep x in
// fp32 and widen w as it is read (a GEMV streaming w in 16-byte loads): fp32 products and
// accumulation, results equal to the fp32 path on the widened weights up to rounding, at the
// memory-bandwidth limit. Larger m runs the tensor cores on x rounded to w_dtype into `x16`
// (at least m * k 16-bit elements, device memory), accumulation fp32, as LaunchLinear16 does.
// The bound is where the GEMV stops winning: on an H100 (bench/results/gpu-h100-2026-11-27.md)
// it streamed an 8B-shaped gate_up at 0.99 of copy bandwidth for m = 1 but 0.55 for m = 8,
// where it re-reads x from L1 once per row, while cuBLAS held 0.86 at m = 64.
inline constexpr int kGemvMaxRows = 4;

// What runs the tensor-core GEMMs of LaunchLinear16.
struct GemmEngines {
  cublasHandle_t cublas = nullptr;
  LtGemm* lt = nullptr;  // null: cublasGemmEx and a bias kernel
  // Tandem's skinny GEMM for m <= kSkinnyMaxRows (k % 8 == 0, 16-byte aligned x and w).
  bool skinny = true;
};

// accumulate: y += x W^T (+ bias) (Backend::LinearAdd), for m > kSkinnyMaxRows only.
absl::Status LaunchLinearLowPrecision(const GemmEngines& engines, const float* x, int m,
                                      const void* w, DType w_dtype, int n, int k, const float* bias,
                                      float* y, void* x16, cudaStream_t stream,
                                      bool accumulate = false);

// The tensor-core half of the above on an x already of w_dtype (kBF16 or kF16): x16 [m, k]
// device, read exactly, any m; fp32 accumulation. Up to kSkinnyMaxRows rows (with
// engines.skinny) a kernel of Tandem's own streams the weights into mma.m16n8k16 from 16-byte
// loads, 16 rows of W per block with k split over its warps: cuBLAS held only 0.58-0.83 of
// copy bandwidth at m = 8 and 16 on the 8B shapes' smaller projections (the run above). Past
// it (or when the skinny kernel cannot take the call) cuBLASLt (`engines.lt`, the bias in its
// epilogue) unless it is null or has no algorithm for the call, else cublasGemmEx and a bias
// kernel.
inline constexpr int kSkinnyMaxRows = 16;
// With `accumulate`, y += x W^T (+ bias) (Backend::LinearAdd): cuBLASLt or cublasGemmEx with
// beta = 1, never the skinny kernel (so only past kSkinnyMaxRows rows, else InvalidArgument).
absl::Status LaunchLinear16(const GemmEngines& engines, const void* x16, int m, const void* w,
                            DType w_dtype, int n, int k, const float* bias, float* y,
                            cudaStream_t stream, bool accumulate = false);

}  // namespace tandem::kernels::cuda
