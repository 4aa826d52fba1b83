// Device element types of weights and KV caches, widened to and narrowed from fp32.
//
// A launcher turns a runtime DType into the element type of its kernel template:
//   TANDEM_DISPATCH_KV_DTYPE(layout.dtype, Cache, {
//     WriteKvKernel<Cache><<<grid, block, 0, stream>>>(...);
//   });
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tandem/base/half.h"

namespace tandem::kernels::cuda {

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(__nv_fp8_e4m3 v) { return static_cast<float>(v); }
__device__ __forceinline__ float ToFloat(__nv_fp8_e5m2 v) { return static_cast<float>(v); }

// Round to nearest even; the 8-bit formats saturate at their largest finite value, as the CPU
// backend does.
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_fp8_e4m3 FromFloat<__nv_fp8_e4m3>(float v) {
  __nv_fp8_e4m3 r;
  r.__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  return r;
}
template <>
__device__ __forceinline__ __nv_fp8_e5m2 FromFloat<__nv_fp8_e5m2>(float v) {
  __nv_fp8_e5m2 r;
  r.__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
  return r;
}

// Stores v as out[i] of an activation whose dtype is a kernel argument rather than a template
// parameter (kF32, or kBF16 / kF16 rounded to nearest even; the launcher checks it with
// CheckActivationDType). The branch is uniform over the launch.
__device__ __forceinline__ void StoreActivation(void* out, DType dtype, int64_t i, float v) {
  if (dtype == DType::kBF16) {
    static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(v);
  } else if (dtype == DType::kF16) {
    static_cast<__half*>(out)[i] = __float2half_rn(v);
  } else {
    static_cast<float*>(out)[i] = v;
  }
}

// What a launcher answers for an activation dtype it has no store for.
inline constexpr char kNoActivationStore[] = "no CUDA kernel stores an activation as ";

// InvalidArgument unless dtype is one an activation may be stored as.
inline absl::Status CheckActivationDType(DType dtype) {
  if (dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(kNoActivationStore, DTypeName(dtype)));
}

}  // namespace tandem::kernels::cuda

#define TANDEM_DTYPE_CASE_(DTYPE, TYPE, NAME, ...) \
  case DTYPE: {                                    \
    using NAME = TYPE;                             \
    __VA_ARGS__                                    \
    break;                                         \
  }

// The 32- and 16-bit float types, failing with `what` followed by any other dtype's name.
#define TANDEM_DISPATCH_WIDE_FLOAT_(dtype, NAME, what, ...)                         \
  switch (dtype) {                                                                 \
    TANDEM_DTYPE_CASE_(::tandem::DType::kF32, float, NAME, __VA_ARGS__)            \
    TANDEM_DTYPE_CASE_(::tandem::DType::kBF16, __nv_bfloat16, NAME, __VA_ARGS__)   \
    TANDEM_DTYPE_CASE_(::tandem::DType::kF16, __half, NAME, __VA_ARGS__)           \
    default:                                                                       \
      return absl::InvalidArgumentError(absl::StrCat(what, ::tandem::DTypeName(dtype))); \
  }

// Weight element types: F32, BF16, F16.
#define TANDEM_DISPATCH_WEIGHT_DTYPE(dtype, NAME, ...) \
  TANDEM_DISPATCH_WIDE_FLOAT_(dtype, NAME, "no CUDA kernel for weights of ", __VA_ARGS__)

// KV cache element types: those of the weights and the two 8-bit floats.
#define TANDEM_DISPATCH_KV_DTYPE(dtype, NAME, ...)                                        \
  switch (dtype) {                                                                        \
    TANDEM_DTYPE_CASE_(::tandem::DType::kF32, float, NAME, __VA_ARGS__)                   \
    TANDEM_DTYPE_CASE_(::tandem::DType::kBF16, __nv_bfloat16, NAME, __VA_ARGS__)          \
    TANDEM_DTYPE_CASE_(::tandem::DType::kF16, __half, NAME, __VA_ARGS__)                  \
    TANDEM_DTYPE_CASE_(::tandem::DType::kF8E4M3, __nv_fp8_e4m3, NAME, __VA_ARGS__)        \
    TANDEM_DTYPE_CASE_(::tandem::DType::kF8E5M2, __nv_fp8_e5m2, NAME, __VA_ARGS__)        \
    default:                                                                              \
      return absl::InvalidArgumentError(                                                  \
          absl::StrCat("no CUDA kernel for a KV cache of ", ::tandem::DTypeName(dtype))); \
  }

// Activation element types: F32, BF16, F16.
#define TANDEM_DISPATCH_ACTIVATION_DTYPE(dtype, NAME, ...) \
  TANDEM_DISPATCH_WIDE_FLOAT_(dtype, NAME, ::tandem::kernels::cuda::kNoActivationStore, \
                              __VA_ARGS__)
