// The warp-wide tensor-core instruction on 16-bit elements, for the kernels that use it
// (flash_attention.cu, linear.cu): packing two floats into a register and
// mma.sync.m16n8k16 with fp32 accumulation. Fragment layouts: mma_layout.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace tandem::kernels::cuda {

template <typename Elem>
struct Mma16;

template <>
struct Mma16<__nv_bfloat16> {
  // Two floats rounded to nearest even, `lo` in the low 16 bits (the lower-index element).
  static __device__ __forceinline__ uint32_t Pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo: the low half
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 Unpack(uint32_t bits) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
  }
  // d += a b for one m16n8k16 tile (fragments as in mma_layout.h).
  static __device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Mma16<__half> {
  static __device__ __forceinline__ uint32_t Pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  static __device__ __forceinline__ float2 Unpack(uint32_t bits) {
    return __half22float2(*reinterpret_cast<const __half2*>(&bits));
  }
  static __device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

}  // namespace tandem::kernels::cuda
