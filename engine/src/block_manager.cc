#include "tandem/engine/block_manager.h"

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"

namespace tandem::engine {

BlockManager::BlockManager(int num_blocks, int block_size)
    : block_size_(block_size), ref_counts_(num_blocks, 0) {
  TANDEM_CHECK(num_blocks >= 0 && block_size > 0);
  free_list_.reserve(num_blocks);
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_list_.push_back(b);
}

int32_t BlockManager::TakeFreeBlock() {
  int32_t b = free_list_.back();
  free_list_.pop_back();
  ref_counts_[b] = 1;
  return b;
}

bool BlockManager::CanAppend(const BlockTable& table, int num_tokens, int new_tokens) const {
  int needed = BlocksFor(num_tokens + new_tokens) - static_cast<int>(table.size());
  if (needed < 0) needed = 0;
  // A shared, partly filled last block must be copied before it is written.
  if (new_tokens > 0 && num_tokens % block_size_ != 0 &&
      ref_counts_[table[num_tokens / block_size_]] > 1) {
    ++needed;
  }
  return needed <= num_free_blocks();
}

absl::StatusOr<std::pair<int32_t, int32_t>> BlockManager::Append(BlockTable& table, int num_tokens,
                                                                 int new_tokens) {
  TANDEM_CHECK(BlocksFor(num_tokens) <= static_cast<int>(table.size()))
      << "table of " << table.size() << " blocks cannot hold " << num_tokens << " tokens";
  if (!CanAppend(table, num_tokens, new_tokens)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: ", num_free_blocks(), " free blocks"));
  }
  std::pair<int32_t, int32_t> copy{-1, -1};
  if (new_tokens > 0 && num_tokens % block_size_ != 0) {
    int32_t& last = table[num_tokens / block_size_];
    if (ref_counts_[last] > 1) {
      --ref_counts_[last];
      int32_t fresh = TakeFreeBlock();
      copy = {last, fresh};
      last = fresh;
    }
  }
  int target = BlocksFor(num_tokens + new_tokens);
  while (static_cast<int>(table.size()) < target) table.push_back(TakeFreeBlock());
  return copy;
}

void BlockManager::Free(BlockTable& table) {
  for (int32_t b : table) {
    TANDEM_CHECK(ref_counts_[b] > 0) << "double free of KV block " << b;
    if (--ref_counts_[b] == 0) free_list_.push_back(b);
  }
  table.clear();
}

BlockTable BlockManager::Fork(const BlockTable& table) {
  for (int32_t b : table) ++ref_counts_[b];
  return table;
}

}  // namespace tandem::engine
