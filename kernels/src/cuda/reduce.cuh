// Block-wide reductions shared by the row kernels. Device code: include from .cu files only.
#pragma once

#include <cuda_runtime.h>

namespace tandem::kernels::cuda {

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum (or max) of `v` over the block, returned to every thread. scratch: [32] shared floats,
// free on entry; blockDim.x a multiple of 32. Contains __syncthreads: call from all threads.
template <bool kMax>
__device__ float BlockReduce(float v, float* scratch) {
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  const int warps = blockDim.x / 32;
  v = kMax ? WarpMax(v) : WarpSum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = lane < warps ? scratch[lane] : (kMax ? -INFINITY : 0.0f);
  r = kMax ? WarpMax(r) : WarpSum(r);
  __syncthreads();  // scratch is free again for the next reduction
  return r;
}

struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a > b ? a : b;
  }
};
struct MinOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a < b ? a : b;
  }
};
struct SumOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};

// op (MaxOp, MinOp, SumOp) over `v` of every thread of the block, of any type a warp shuffle
// moves (float, double, int, uint64_t), returned to all; `identity` fills the missing warps.
// Uses a shared array of its own per (T, Op); blockDim.x a multiple of 32. Contains
// __syncthreads: call from all threads.
template <typename T, typename Op>
__device__ T BlockAll(T v, Op op, T identity) {
  __shared__ T partial[32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  T r = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : identity;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) r = op(r, __shfl_xor_sync(0xffffffffu, r, offset));
  __syncthreads();  // partial is free again
  return r;
}

}  // namespace tandem::kernels::cuda
