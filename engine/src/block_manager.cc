#include "tandem/engine/block_manager.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"

namespace tandem::engine {

BlockManager::BlockManager(int num_blocks, int block_size, bool enable_prefix_caching)
    : block_size_(block_size),
      prefix_caching_(enable_prefix_caching),
      ref_counts_(num_blocks, 0),
      block_hash_(num_blocks, kNoHash),
      evictable_pos_(num_blocks) {
  TANDEM_CHECK(num_blocks >= 0 && block_size > 0);
  free_list_.reserve(num_blocks);
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_list_.push_back(b);
}

int32_t BlockManager::TakeFreeBlock() {
  int32_t b;
  if (!free_list_.empty()) {
    b = free_list_.back();
    free_list_.pop_back();
  } else {
    // Evict the least recently freed cached block.
    TANDEM_CHECK(!evictable_.empty()) << "no free KV block";
    b = evictable_.front();
    evictable_.pop_front();
    cached_.erase(block_hash_[b]);
    if (record_events_) events_.push_back({block_hash_[b], /*stored=*/false});
    block_hash_[b] = kNoHash;
    ++num_evictions_;
  }
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

void BlockManager::Release(int32_t b) {
  TANDEM_CHECK(ref_counts_[b] > 0) << "double free of KV block " << b;
  if (--ref_counts_[b] > 0) return;
  if (block_hash_[b] != kNoHash) {
    evictable_pos_[b] = evictable_.insert(evictable_.end(), b);
  } else {
    free_list_.push_back(b);
  }
}

void BlockManager::Free(BlockTable& table) {
  // Last block first: when these stay cached, a prefix's tail is evicted before its head,
  // which more requests share.
  for (auto it = table.rbegin(); it != table.rend(); ++it) Release(*it);
  table.clear();
}

void BlockManager::Truncate(BlockTable& table, int num_tokens) {
  const size_t keep = static_cast<size_t>(BlocksFor(std::max(num_tokens, 0)));
  while (table.size() > keep) {
    Release(table.back());
    table.pop_back();
  }
}

BlockTable BlockManager::Fork(const BlockTable& table, int num_blocks) {
  BlockTable fork(table.begin(), num_blocks < 0
                                     ? table.end()
                                     : table.begin() + std::min<size_t>(num_blocks, table.size()));
  for (int32_t b : fork) ++ref_counts_[b];
  return fork;
}

int32_t BlockManager::FindCached(uint64_t hash) const {
  auto it = cached_.find(hash);
  return it == cached_.end() ? -1 : it->second;
}

int BlockManager::CountCached(std::span<const uint64_t> hashes) const {
  if (!prefix_caching_) return 0;
  int n = 0;
  while (n < static_cast<int>(hashes.size()) && FindCached(hashes[n]) >= 0) ++n;
  return n;
}

int BlockManager::CountCachedFree(std::span<const uint64_t> hashes, int max_blocks) const {
  if (!prefix_caching_) return 0;
  int free = 0;
  for (int i = 0; i < max_blocks && i < static_cast<int>(hashes.size()); ++i) {
    const int32_t b = FindCached(hashes[i]);
    if (b < 0) break;
    if (ref_counts_[b] == 0) ++free;
  }
  return free;
}

int BlockManager::AllocateCached(BlockTable& table, std::span<const uint64_t> hashes,
                                 int max_blocks) {
  TANDEM_CHECK(table.empty()) << "a cached prefix starts a block table";
  if (!prefix_caching_) return 0;
  for (int i = 0; i < max_blocks && i < static_cast<int>(hashes.size()); ++i) {
    const int32_t b = FindCached(hashes[i]);
    if (b < 0) break;
    if (ref_counts_[b]++ == 0) evictable_.erase(evictable_pos_[b]);
    table.push_back(b);
  }
  return static_cast<int>(table.size());
}

void BlockManager::CacheFullBlocks(const BlockTable& table, std::span<const uint64_t> hashes,
                                   int first) {
  if (!prefix_caching_) return;
  TANDEM_CHECK(hashes.size() <= table.size());
  for (size_t i = std::max(first, 0); i < hashes.size(); ++i) {
    const int32_t b = table[i];
    if (block_hash_[b] != kNoHash) continue;  // named already (a cached or forked block)
    if (cached_.try_emplace(hashes[i], b).second) {
      block_hash_[b] = hashes[i];
      if (record_events_) events_.push_back({hashes[i], /*stored=*/true});
    }
  }
}

void BlockManager::RecordEvents(bool on) {
  record_events_ = on;
  if (!on) events_.clear();
}

std::vector<BlockManager::CacheEvent> BlockManager::TakeEvents() {
  std::vector<CacheEvent> taken;
  taken.swap(events_);
  return taken;
}

std::vector<uint64_t> BlockManager::CachedHashes() const {
  std::vector<uint64_t> hashes;
  hashes.reserve(cached_.size());
  for (const auto& [hash, block] : cached_) hashes.push_back(hash);
  return hashes;
}

}  // namespace tandem::engine
