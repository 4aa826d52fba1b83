// Prefill attention on the tensor cores: a FlashAttention-2-style tiled kernel over the paged
// KV cache, for 16-bit (bf16, fp16) caches and head_dim 64 or 128.
//
// Grid (num_heads, flash_tiles): one block of 4 warps per (query head, tile of up to
// kFlashTileRows query rows of ONE sequence); each warp owns 16 of the tile's rows. Tiles never
// straddle sequences: the host lists, per sequence, where its tiles start (flash_tile_start,
// a prefix sum of ceil(q_len / kFlashTileRows) over the sequences the kernel serves, 0 tiles
// for the others), and a block finds its sequence by binary search. Tiles run in reverse order
// (the longest causal rows first) and the query heads of one KV head are adjacent blocks, so a
// tile's K and V are fetched from memory once and served from L2 to the rest of its group.
//
// A block converts its Q tile to the cache's 16-bit type once (through shared memory into A
// fragments held in registers for the whole loop), then walks the key tiles of kFlashTileKeys
// keys up to the causal limit of its last row: K and V rows are gathered through the block
// table into shared memory with cp.async (16 bytes per copy; keys past the limit are zeros, so
// no slot outside the sequence is read), S = Q K^T on mma.m16n8k16 with fp32 accumulation,
// the causal mask on the tiles that cross the diagonal only, an online softmax in fp32 in the
// log2 domain (scores prescaled by scale * log2 e, exp2), P rounded to 16 bits and reused
// directly as A fragments for O += P V. The softmax denominator sums the rounded P, so each
// output row is an exact convex combination of V with weights within 2^-8 (bf16; fp16 2^-11)
// relative of the exact ones. Shared memory: 2 x kFlashTileKeys x (head_dim + 8) 16-bit
// elements (34816 bytes at head_dim 128), the Q tile borrowing V's buffer before the loop.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/src/cuda/paged_attention.cuh"
#include "tandem/base/half.h"

namespace tandem::kernels::cuda {

inline constexpr int kFlashTileRows = 64;
inline constexpr int kFlashTileKeys = 64;
inline constexpr int kFlashThreads = 128;
// Sequences of at least this many query rows go to the tensor-core kernel when the call
// allows it (FlashPrefillSupports); shorter ones (decode rows) to the split-KV kernels.
inline constexpr int kFlashMinRows = 16;

// Whether the tensor-core kernel has an instance for this cache type and head dim.
inline bool FlashPrefillHasKernel(DType cache_dtype, int head_dim) {
  return (cache_dtype == DType::kBF16 || cache_dtype == DType::kF16) &&
         (head_dim == 64 || head_dim == 128);
}

// FlashPrefillHasKernel, and the pointers aligned as the kernel reads and writes them (q and
// both cache halves 16 bytes, out 8).
inline bool FlashPrefillSupports(const PagedAttentionParams& p) {
  auto aligned = [](const void* ptr, uintptr_t to) {
    return reinterpret_cast<uintptr_t>(ptr) % to == 0;
  };
  return FlashPrefillHasKernel(p.cache_dtype, p.head_dim) && aligned(p.q, 16) &&
         aligned(p.k_cache, 16) && aligned(p.v_cache, 16) && aligned(p.out, 8);
}

// Runs the tensor-core kernel over p.flash_tiles tiles (nothing when 0). Called by
// LaunchPagedAttention; p must pass FlashPrefillSupports.
absl::Status LaunchFlashPrefill(const PagedAttentionParams& p, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
