// Searches over the small sorted arrays of a call's metadata (sequence starts). Device code:
// include from .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tandem::kernels::cuda {

// The largest i in [0, count) with starts[i] <= value, for ascending starts (equal entries
// allowed: the last of them) with starts[0] <= value; 0 when count is 1.
__device__ __forceinline__ int LastAtMost(const int32_t* starts, int count, int value) {
  int lo = 0;
  int hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= value) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace tandem::kernels::cuda
