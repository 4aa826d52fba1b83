// Where every byte of a paged KV cache lives. The model runner allocates and copies blocks with
// it, the prefill worker pushes pages and the decode worker hands parked KV off with it, so the
// offset arithmetic exists once and a cache of another element type (bf16, fp8) changes one
// field, not three copies of it.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/base/half.h"
#include "tandem/kernels/backend.h"

namespace tandem::engine {

// One contiguous byte range of a KV copy between two caches (offsets from each cache's start).
struct KvCopyRange {
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
};

// A paged KV cache of `num_layers` layers, each [2 (K, V)][num_blocks][block_size]
// [num_kv_heads][head_dim] elements of `dtype`, layers back to back in one region.
//   KvCacheLayout layout{.num_layers = 32, .num_blocks = 4096, .block_size = 16,
//                        .num_kv_heads = 8, .head_dim = 128};
//   uint64_t at = layout.Offset(layer, /*half=*/1, block, slot);  // token `slot`'s V
struct KvCacheLayout {
  int num_layers = 0;
  int num_blocks = 0;
  int block_size = 16;
  int num_kv_heads = 0;
  int head_dim = 0;
  DType dtype = DType::kF32;
  // Which of the model's KV heads this cache holds: [kv_head_begin, + num_kv_heads), the shard
  // of one rank of a tensor-parallel group of tp_size ranks (engine/tensor_parallel.h); 0 and 1
  // for a cache of every head.
  int kv_head_begin = 0;
  int tp_size = 1;

  uint64_t element_bytes() const { return static_cast<uint64_t>(DTypeSize(dtype)); }
  // One token's K (or V) in one layer.
  uint64_t row_bytes() const {
    return static_cast<uint64_t>(num_kv_heads) * static_cast<uint64_t>(head_dim) *
           element_bytes();
  }
  // One block of K (or V) in one layer.
  uint64_t block_bytes() const { return row_bytes() * static_cast<uint64_t>(block_size); }
  // One layer's K (or V) half.
  uint64_t half_bytes() const { return block_bytes() * static_cast<uint64_t>(num_blocks); }
  uint64_t layer_bytes() const { return 2 * half_bytes(); }
  uint64_t total_bytes() const { return layer_bytes() * static_cast<uint64_t>(num_layers); }
  // What one block id holds across every layer, K and V.
  uint64_t bytes_per_block() const {
    return 2 * block_bytes() * static_cast<uint64_t>(num_layers);
  }

  // Byte offset of token slot `slot` of block `block` in the K (half 0) or V (half 1) of
  // `layer`, from the start of the cache.
  uint64_t Offset(int layer, int half, int64_t block, int slot = 0) const {
    return (static_cast<uint64_t>(layer) * 2 + static_cast<uint64_t>(half)) * half_bytes() +
           static_cast<uint64_t>(block) * block_bytes() + static_cast<uint64_t>(slot) * row_bytes();
  }

  // The per-layer view the kernels take.
  kernels::KvLayout kernel_layout() const {
    return {.num_blocks = num_blocks,
            .block_size = block_size,
            .num_kv_heads = num_kv_heads,
            .head_dim = head_dim,
            .dtype = dtype};
  }
};

// The byte ranges that copy the K and V of `src_blocks` (in a cache laid out as `src`) into
// `dst_blocks` (of `dst`), for every layer. The caches must agree on everything but their
// number of blocks (InvalidArgument naming the difference otherwise); every block id is checked
// against its cache.
absl::StatusOr<std::vector<KvCopyRange>> KvBlockCopyRanges(const KvCacheLayout& src,
                                                           const KvCacheLayout& dst,
                                                           const std::vector<int32_t>& src_blocks,
                                                           const std::vector<int32_t>& dst_blocks);

// Heads [head_begin, head_end) of the model that destination rank `dst_rank` takes from source
// rank `src_rank` when KV goes from one tensor-parallel group to another.
struct KvHeadRun {
  int src_rank = 0;
  int dst_rank = 0;
  int head_begin = 0;
  int head_end = 0;
};

// Which source rank gives each destination rank each of its KV heads (rank r's cache is src[r]
// and dst[r]): the first source rank holding the head, runs in destination order. InvalidArgument,
// naming the difference, when the caches disagree on layers, block size, head_dim or element
// type, or when a destination head is held by no source rank.
absl::StatusOr<std::vector<KvHeadRun>> KvHeadRuns(const std::vector<KvCacheLayout>& src,
                                                  const std::vector<KvCacheLayout>& dst);

// Appends the byte ranges that move `run`'s heads of tokens [slot, slot + count) of one block,
// the K (half 0) or V (half 1) of one layer, from `from` (block src_block of layer src_layer)
// to `to` (dst_block of dst_layer): one range when both caches hold exactly the run's heads,
// else one per token. Block ids and the slot range are the caller's to check.
void AppendKvRunRanges(const KvCacheLayout& from, const KvCacheLayout& to, const KvHeadRun& run,
                       int src_layer, int dst_layer, int half, int32_t src_block, int32_t dst_block,
                       int slot, int count, std::vector<KvCopyRange>& out);

// What one (source rank, destination rank) pair moves when KV goes from one tensor-parallel
// group to another (offsets into the source rank's and the destination rank's caches).
struct KvShardTransfer {
  int src_rank = 0;
  int dst_rank = 0;
  std::vector<KvCopyRange> ranges;
};

// The plan that moves the K and V of `src_blocks` from a group whose rank r's cache is src[r]
// into `dst_blocks` of a group whose rank r's cache is dst[r], the degrees free to differ
// (2 -> 1, 1 -> 2, 4 -> 2, with KV heads replicated where a degree exceeds them). Each
// destination rank takes each of its KV heads from the first source rank holding it; a pair
// moves only the heads both hold (whole token rows when their head ranges are equal, else the
// overlapping heads of each row), layer by layer; pairs with nothing in common are left out.
// InvalidArgument, naming the difference, when the caches disagree on layers, block size,
// head_dim or element type, when a destination head is held by no source rank, or for a block
// id outside its cache.
absl::StatusOr<std::vector<KvShardTransfer>> KvReshardPlan(const std::vector<KvCacheLayout>& src,
                                                           const std::vector<KvCacheLayout>& dst,
                                                           const std::vector<int32_t>& src_blocks,
                                                           const std::vector<int32_t>& dst_blocks);

}  // namespace tandem::engine
