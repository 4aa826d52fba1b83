// Allocation of fixed-size KV cache blocks, with reference counts so that blocks can be
// shared (forked samples, cached prefixes, reservations for transfers between processes), and
// the prefix cache: full blocks named by a hash of their tokens and everything before them.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/engine/handoff.h"
#include "tandem/engine/prefix_hash.h"

namespace tandem::engine {

// Hands out physical block ids 0..num_blocks-1. Plain host code, no device.
//   BlockManager blocks(/*num_blocks=*/1024, /*block_size=*/16, /*enable_prefix_caching=*/true);
//   BlockTable table;
//   int cached = blocks.AllocateCached(table, hashes, max_blocks);  // shared, already computed
//   if (blocks.CanAppend(table, cached * 16, n)) blocks.Append(table, cached * 16, n);
//   ...  // compute the new tokens, then name the blocks they filled:
//   blocks.CacheFullBlocks(table, hashes);
//   blocks.Free(table);  // named blocks stay cached until their block is needed again
//
// A block is referenced (ref_count > 0), cached (unreferenced but named by a hash: reusable by
// a later prefix match, else evicted least recently freed first when a fresh block is needed)
// or free. num_free_blocks() counts cached blocks too: both can be handed out at once.
class BlockManager {
 public:
  BlockManager(int num_blocks, int block_size, bool enable_prefix_caching = false);

  int block_size() const { return block_size_; }
  bool prefix_caching() const { return prefix_caching_; }
  int num_blocks() const { return static_cast<int>(ref_counts_.size()); }
  // Blocks that can be handed out: never used or freed, and cached but unreferenced.
  int num_free_blocks() const { return static_cast<int>(free_list_.size() + evictable_.size()); }
  // Blocks some table references.
  int num_used_blocks() const { return num_blocks() - num_free_blocks(); }
  // Unreferenced blocks still holding a cached prefix.
  int num_cached_free_blocks() const { return static_cast<int>(evictable_.size()); }
  // Cached blocks evicted so far (handed out fresh, their prefix forgotten).
  int64_t num_evictions() const { return num_evictions_; }
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
  // Drops this table's reference to each of its blocks and clears it. A block nobody references
  // any more stays cached when it is named, its table's later blocks to be evicted first.
  void Free(BlockTable& table);
  // Drops this table's reference to its blocks past the first BlocksFor(num_tokens), last
  // first (speculative tokens that were rejected).
  void Truncate(BlockTable& table, int num_tokens);
  // A second table sharing the first `num_blocks` blocks of `table` (all when -1; reference
  // counts go up).
  BlockTable Fork(const BlockTable& table, int num_blocks = -1);

  // --- prefix cache (no-ops without prefix caching) ---
  // How many leading blocks of the chain `hashes` are cached (referenced or not).
  int CountCached(std::span<const uint64_t> hashes) const;
  // Appends to the empty `table` the leading cached blocks of `hashes`, at most `max_blocks`,
  // taking a reference on each; returns how many. Their KV is already computed.
  int AllocateCached(BlockTable& table, std::span<const uint64_t> hashes, int max_blocks);
  // How many blocks AllocateCached would take out of num_free_blocks() (cached, unreferenced).
  int CountCachedFree(std::span<const uint64_t> hashes, int max_blocks) const;
  // Names table[i] by hashes[i] for every i in [first, hashes.size()) (blocks whose tokens are
  // all computed), so later requests with that prefix find it. A hash already naming another
  // block (the same prefix computed twice at once) is left to that block.
  void CacheFullBlocks(const BlockTable& table, std::span<const uint64_t> hashes, int first = 0);

  // --- KV events: changes to the set of cached hashes, which workers publish to the router's
  // index (docs/protocol.md, "KV events") ---
  // A hash that came to name a block (stored) or stopped naming one (removed: its block was
  // evicted). A hash is stored at most once until it is removed.
  struct CacheEvent {
    uint64_t hash;
    bool stored;
  };
  // Records events from now on for TakeEvents() (off by default: nothing is kept).
  void RecordEvents(bool on);
  // The events since the last call, in order.
  std::vector<CacheEvent> TakeEvents();
  // Every hash that names a block now (referenced or not), in no particular order.
  std::vector<uint64_t> CachedHashes() const;

  int ref_count(int32_t block) const { return ref_counts_[block]; }

 private:
  static constexpr uint64_t kNoHash = 0;
  int32_t TakeFreeBlock();
  // Drops one reference to `block`; unreferenced, it becomes cached (named) or free.
  void Release(int32_t block);
  int32_t FindCached(uint64_t hash) const;
  int block_size_;
  bool prefix_caching_;
  std::vector<int32_t> ref_counts_;  // [num_blocks]
  std::vector<int32_t> free_list_;   // LIFO so recently freed (cache-warm) blocks are reused
  // Prefix cache: the hash naming each block (kNoHash: none), the block each hash names, and
  // the unreferenced named blocks, least recently freed first, with each one's position.
  std::vector<uint64_t> block_hash_;  // [num_blocks]
  std::unordered_map<uint64_t, int32_t> cached_;
  std::list<int32_t> evictable_;
  std::vector<std::list<int32_t>::iterator> evictable_pos_;  // [num_blocks]
  int64_t num_evictions_ = 0;
  bool record_events_ = false;
  std::vector<CacheEvent> events_;
};

}  // namespace tandem::engine
