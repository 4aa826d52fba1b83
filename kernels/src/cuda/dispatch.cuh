// Turning runtime values into template parameters, and CUDA errors into absl::Status.
//
// A launcher dispatches inside a function returning absl::Status; unsupported values return
// InvalidArgument instead of launching anything:
//   absl::Status LaunchFoo(int head_dim, ...) {
//     TANDEM_DISPATCH_HEAD_DIM(head_dim, kHeadDim, {
//       FooKernel<kHeadDim><<<grid, block, 0, stream>>>(...);
//     });
//     return CudaStatus(cudaGetLastError(), "FooKernel");
//   }
// Host-includable (no device code), so the backend's C++ callers can share CudaStatus.
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tandem::kernels::cuda {

inline absl::Status CudaStatus(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")"));
}

}  // namespace tandem::kernels::cuda

// Head dimensions with compiled kernels: those of the Llama, Qwen and Mistral families.
#define TANDEM_DISPATCH_HEAD_DIM(head_dim, HEAD_DIM, ...)                                   \
  switch (head_dim) {                                                                       \
    case 64: {                                                                              \
      constexpr int HEAD_DIM = 64;                                                          \
      __VA_ARGS__                                                                           \
      break;                                                                                \
    }                                                                                       \
    case 128: {                                                                             \
      constexpr int HEAD_DIM = 128;                                                         \
      __VA_ARGS__                                                                           \
      break;                                                                                \
    }                                                                                       \
    default:                                                                                \
      return absl::InvalidArgumentError(                                                    \
          absl::StrCat("no CUDA kernel for head_dim ", head_dim, " (supported: 64, 128)")); \
  }

#define TANDEM_DISPATCH_BOOL(value, NAME, ...) \
  if (value) {                                 \
    constexpr bool NAME = true;                \
    __VA_ARGS__                                \
  } else {                                     \
    constexpr bool NAME = false;               \
    __VA_ARGS__                                \
  }
