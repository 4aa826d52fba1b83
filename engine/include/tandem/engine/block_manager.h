// Allocation of fixed-size KV cache blocks, with reference counts so that blocks can be
// shared (forked samples, prefixes) and, later, reserved for transfers between processes.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/engine/handoff.h"

namespace tandem::engine {

// Hands out physical block ids 0..num_blocks-1. Plain host code, no device.
//   BlockManager blocks(/*num_blocks=*/1024, /*block_size=*/16);
//   BlockTable table;
//   if (blocks.CanAppend(table, 0, prompt_len)) blocks.Append(table, 0, prompt_len);
//   ...
//   blocks.Free(table);
class BlockManager {
 public:
  BlockManager(int num_blocks, int block_size);

  int block_size() const { return block_size_; }
  int num_blocks() const { return static_cast<int>(ref_counts_.size()); }
  int num_free_blocks() const { return static_cast<int>(free_list_.size()); }
  int num_used_blocks() const { return num_blocks() - num_free_blocks(); }
  // Blocks needed to hold `num_tokens` tokens.
  int BlocksFor(int num_tokens) const { return (num_tokens + block_size_ - 1) / block_size_; }

  // Whether `table`, now holding `num_tokens` tokens, can grow by `new_tokens`, including a
  // copy of a shared last block that the new tokens would write into.
  bool CanAppend(const BlockTable& table, int num_tokens, int new_tokens) const;
  // Grows `table` to hold num_tokens + new_tokens tokens. When the block that the first new
  // token lands in is shared, it is replaced by a fresh block and the returned pair
  // {source, destination} says which block's contents the caller must copy (copy-on-write);
  // otherwise returns {-1, -1}. ResourceExhausted when blocks run out (table unchanged).
  absl::StatusOr<std::pair<int32_t, int32_t>> Append(BlockTable& table, int num_tokens,
                                                     int new_tokens);
  // Drops this table's reference to each of its blocks and clears it.
  void Free(BlockTable& table);
  // A second table sharing every block of `table` (reference counts go up).
  BlockTable Fork(const BlockTable& table);

  int ref_count(int32_t block) const { return ref_counts_[block]; }

 private:
  int32_t TakeFreeBlock();
  int block_size_;
  std::vector<int32_t> ref_counts_;  // [num_blocks]
  std::vector<int32_t> free_list_;   // LIFO so recently freed (cache-warm) blocks are reused
};

}  // namespace tandem::engine
