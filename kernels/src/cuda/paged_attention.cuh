// Paged attention for decode and chunked prefill.
//
// Which kernel serves which rows of a call (the backend plans it on the host, from the batch's
// query lengths, with no device synchronisation):
// - sequences of at least kFlashMinRows (16) query rows over a bf16 or fp16 cache with
//   head_dim 64 or 128 (and 16-byte aligned q and cache): the tensor-core prefill kernel of
//   flash_attention.cuh, which rounds q and the softmax weights to the cache's type
//   (Backend::PagedAttentionRoundsQ);
// - every other row (decode rows, short chunks, fp32 and fp8 caches, other head dims): the
//   split-KV kernels below, exact on q in fp32. When a call mixes both, the split-KV kernels
//   take a list of their rows (split_row_ids) and each kernel writes only its own rows.
//
// The split-KV kernels:
// Every query row (token) attends to its visible prefix in partitions of partition_tokens keys
// (at most kAttentionPartitionTokens; the launcher's caller picks fewer when a call has too few
// rows x KV heads to fill the GPU): one block per (partition, KV head, row) computes a partial
// softmax for all the query heads sharing that KV head, so each K and V vector is read once per
// group. A second kernel merges the partitions. Calls whose rows all fit one partition skip the
// merge and write the output directly. The merge workspace holds launch_rows rows' partitions:
// a call of more split rows runs as several launches of that many rows, in stream order, so
// the workspace is sized by a budget rather than by the largest batch times the longest
// context. Groups of up to 8 query heads per KV head (every Llama,
// Qwen and Mistral model) run a kernel that reads K and V in 16-byte loads, several keys in
// flight per lane; larger groups run a simpler one that reads a key per warp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "tandem/base/half.h"

namespace tandem::kernels::cuda {

inline constexpr int kAttentionPartitionTokens = 512;
inline constexpr int kAttentionMinPartitionTokens = 64;
// Floats per query head of a block's logit area, which the kernel also reuses to merge
// head_dim-wide partial sums (at most 128 floats for the head dims it has).
inline constexpr int kAttentionMinLogitStride = 128;
__host__ __device__ inline constexpr int PagedAttentionLogitStride(int partition_tokens) {
  return partition_tokens > kAttentionMinLogitStride ? partition_tokens
                                                     : kAttentionMinLogitStride;
}
// Query heads per KV head that one block can hold in shared memory.
inline constexpr int kAttentionMaxGroup = 16;

// One PagedAttention call. Every pointer is device memory.
struct PagedAttentionParams {
  const float* q = nullptr;              // [num_tokens, num_heads, head_dim]
  // Both [num_blocks, block_size, num_kv_heads, head_dim] of cache_dtype; an element reads as
  // its value times k_scale (v_scale), 1 but for 8-bit caches.
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  DType cache_dtype = DType::kF32;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  const int32_t* query_start = nullptr;  // [num_seqs + 1]
  const int32_t* context_len = nullptr;  // [num_seqs]
  const int32_t* block_table = nullptr;  // [num_seqs, max_blocks_per_seq]
  void* out = nullptr;                   // [num_tokens, num_heads, head_dim] of out_dtype
  DType out_dtype = DType::kF32;         // kF32, kBF16 or kF16 (StoreActivation)
  // Merge workspace, used when max_partitions > 1, for launch_rows split rows at a time.
  float* partial_out = nullptr;  // [launch_rows, num_heads, max_partitions, head_dim]
  float* partial_max = nullptr;  // [launch_rows, num_heads, max_partitions]
  float* partial_sum = nullptr;  // [launch_rows, num_heads, max_partitions]
  int launch_rows = 0;
  int num_seqs = 0;
  int num_tokens = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  int max_blocks_per_seq = 0;
  // Keys per partition, in [kAttentionMinPartitionTokens, kAttentionPartitionTokens].
  int partition_tokens = kAttentionPartitionTokens;
  // ceil(longest context / partition_tokens).
  int max_partitions = 0;
  float scale = 1.0f;
  // Rows for the tensor-core prefill kernel (flash_attention.cuh): flash_tiles tiles of up to
  // kFlashTileRows rows of one sequence, sequence s's starting at flash_tile_start[s]
  // ([num_seqs + 1], a prefix sum; 0 tiles for sequences it does not serve). 0: none.
  const int32_t* flash_tile_start = nullptr;
  int flash_tiles = 0;
  // Rows for the split-KV kernels: split_rows of them, the i-th being token split_row_ids[i]
  // (split_row_ids null: token i); split_rows < 0 means all num_tokens rows.
  const int32_t* split_row_ids = nullptr;
  int split_rows = -1;
  // The first split row of one launch (set by LaunchPagedAttention for each launch).
  int split_begin = 0;
};

// Floats of merge workspace a launch of `rows` split rows with these sizes needs (0 when
// max_partitions == 1).
inline int64_t PagedAttentionWorkspaceFloats(int rows, int num_heads, int head_dim,
                                             int max_partitions) {
  if (max_partitions <= 1) return 0;
  return static_cast<int64_t>(rows) * num_heads * max_partitions * (head_dim + 2);
}

absl::Status LaunchPagedAttention(const PagedAttentionParams& params, cudaStream_t stream);

}  // namespace tandem::kernels::cuda
