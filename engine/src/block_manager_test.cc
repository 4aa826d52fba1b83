#include "tandem/engine/block_manager.h"

#include <numeric>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

TEST(BlockManagerTest, AppendGrowsByWholeBlocksAndFreeReturnsThem) {
  BlockManager blocks(8, 16);
  BlockTable table;
  ASSERT_TRUE(blocks.Append(table, 0, 17).ok());
  EXPECT_EQ(table.size(), 2u);
  EXPECT_EQ(blocks.num_free_blocks(), 6);
  // Tokens 17..31 fit in the second block: no new block.
  ASSERT_TRUE(blocks.Append(table, 17, 15).ok());
  EXPECT_EQ(table.size(), 2u);
  ASSERT_TRUE(blocks.Append(table, 32, 1).ok());
  EXPECT_EQ(table.size(), 3u);
  std::set<int32_t> distinct(table.begin(), table.end());
  EXPECT_EQ(distinct.size(), 3u);
  blocks.Free(table);
  EXPECT_TRUE(table.empty());
  EXPECT_EQ(blocks.num_free_blocks(), 8);
}

TEST(BlockManagerTest, RefusesWhenFullAndLeavesTableUnchanged) {
  BlockManager blocks(2, 4);
  BlockTable table;
  EXPECT_FALSE(blocks.CanAppend(table, 0, 9));
  auto result = blocks.Append(table, 0, 9);
  EXPECT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(table.empty());
  EXPECT_EQ(blocks.num_free_blocks(), 2);
}

TEST(BlockManagerTest, ForkSharesBlocksAndCopiesTheLastOnWrite) {
  BlockManager blocks(8, 4);
  BlockTable parent;
  ASSERT_TRUE(blocks.Append(parent, 0, 6).ok());  // blocks: full + half
  BlockTable child = blocks.Fork(parent);
  EXPECT_EQ(child, parent);
  EXPECT_EQ(blocks.ref_count(parent[0]), 2);
  EXPECT_EQ(blocks.num_free_blocks(), 6);

  // The child writes token 6 into the shared half-full block: it gets its own copy.
  auto copy = blocks.Append(child, 6, 1);
  ASSERT_TRUE(copy.ok());
  EXPECT_EQ(copy->first, parent[1]);
  EXPECT_EQ(copy->second, child[1]);
  EXPECT_NE(child[1], parent[1]);
  EXPECT_EQ(child[0], parent[0]);  // full blocks stay shared
  EXPECT_EQ(blocks.ref_count(parent[1]), 1);

  blocks.Free(parent);
  EXPECT_EQ(blocks.ref_count(child[0]), 1);
  blocks.Free(child);
  EXPECT_EQ(blocks.num_free_blocks(), 8);
}

TEST(BlockManagerTest, CanAppendCountsTheCopyOfASharedBlock) {
  BlockManager blocks(3, 4);
  BlockTable parent;
  ASSERT_TRUE(blocks.Append(parent, 0, 6).ok());
  BlockTable child = blocks.Fork(parent);
  // One free block: enough for the copy, not for the copy plus a new block.
  EXPECT_TRUE(blocks.CanAppend(child, 6, 2));
  EXPECT_FALSE(blocks.CanAppend(child, 6, 3));
}

// Tokens 1..n, and the hash chain of their full blocks.
std::vector<int32_t> Tokens(int n, int32_t first = 1) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

std::vector<uint64_t> Hashes(const std::vector<int32_t>& tokens, int block_size,
                             std::string_view salt = "") {
  std::vector<uint64_t> h;
  ExtendBlockHashes(PrefixRoot(salt), tokens, block_size, h);
  return h;
}

TEST(PrefixHashTest, ChainsOverTheParentAndTheSalt) {
  const std::vector<int32_t> a = Tokens(12);
  std::vector<int32_t> b = a;
  b[1] = 99;  // differs in the first block only
  const auto ha = Hashes(a, 4);
  const auto hb = Hashes(b, 4);
  ASSERT_EQ(ha.size(), 3u);
  // The later blocks hold the same tokens but follow a different prefix.
  EXPECT_NE(ha[0], hb[0]);
  EXPECT_NE(ha[1], hb[1]);
  EXPECT_NE(ha[2], hb[2]);
  // Same tokens, same hashes (stable: computed again from scratch); a salt changes every one.
  EXPECT_EQ(Hashes(a, 4), ha);
  const auto salted = Hashes(a, 4, "tenant-a");
  for (size_t i = 0; i < ha.size(); ++i) EXPECT_NE(salted[i], ha[i]) << i;
  EXPECT_NE(Hashes(a, 4, "tenant-b")[0], salted[0]);
  // A partial block has no hash; extending picks up where the chain stopped.
  std::vector<uint64_t> partial;
  ExtendBlockHashes(PrefixRoot(""), std::span<const int32_t>(a).first(6), 4, partial);
  ASSERT_EQ(partial.size(), 1u);
  ExtendBlockHashes(PrefixRoot(""), a, 4, partial);
  EXPECT_EQ(partial, ha);
}

TEST(PrefixCacheTest, FreedFullBlocksStayCachedAndAreSharedByTheNextMatch) {
  BlockManager blocks(8, 4, /*enable_prefix_caching=*/true);
  const auto tokens = Tokens(10);  // two full blocks and a partial one
  const auto hashes = Hashes(tokens, 4);
  BlockTable first;
  ASSERT_TRUE(blocks.Append(first, 0, 10).ok());
  blocks.CacheFullBlocks(first, hashes);
  EXPECT_EQ(blocks.CountCached(hashes), 2);

  // While the first table holds them, a second one shares them (two references each).
  BlockTable second;
  EXPECT_EQ(blocks.CountCachedFree(hashes, 2), 0);
  EXPECT_EQ(blocks.AllocateCached(second, hashes, 2), 2);
  EXPECT_EQ(second, BlockTable(first.begin(), first.begin() + 2));
  EXPECT_EQ(blocks.ref_count(first[0]), 2);
  EXPECT_EQ(blocks.num_used_blocks(), 3);

  // Freed by both: referenced by nobody, counted free, but still cached.
  const BlockTable kept(first.begin(), first.begin() + 2);
  blocks.Free(first);
  blocks.Free(second);
  EXPECT_EQ(blocks.num_used_blocks(), 0);
  EXPECT_EQ(blocks.num_free_blocks(), 8);
  EXPECT_EQ(blocks.num_cached_free_blocks(), 2);
  EXPECT_EQ(blocks.CountCachedFree(hashes, 2), 2);

  // A later request with the same first 8 tokens gets those very blocks back.
  BlockTable third;
  EXPECT_EQ(blocks.AllocateCached(third, hashes, 5), 2);
  EXPECT_EQ(third, kept);
  EXPECT_EQ(blocks.num_cached_free_blocks(), 0);
  EXPECT_EQ(blocks.num_free_blocks(), 6);
  // The cap leaves blocks to compute: only one taken.
  BlockTable fourth;
  EXPECT_EQ(blocks.AllocateCached(fourth, hashes, 1), 1);
  EXPECT_EQ(blocks.ref_count(kept[0]), 2);
  blocks.Free(third);
  blocks.Free(fourth);
  EXPECT_EQ(blocks.num_used_blocks(), 0);
}

TEST(PrefixCacheTest, AMatchStopsAtTheFirstMissingBlock) {
  BlockManager blocks(8, 4, true);
  const auto tokens = Tokens(12);
  const auto hashes = Hashes(tokens, 4);
  BlockTable table;
  ASSERT_TRUE(blocks.Append(table, 0, 12).ok());
  blocks.CacheFullBlocks(table, hashes);
  blocks.Free(table);
  // Another prompt sharing only the first block.
  std::vector<int32_t> other = tokens;
  other[5] = 1000;
  const auto other_hashes = Hashes(other, 4);
  EXPECT_EQ(blocks.CountCached(other_hashes), 1);
  BlockTable t;
  EXPECT_EQ(blocks.AllocateCached(t, other_hashes, 3), 1);
  blocks.Free(t);
}

TEST(PrefixCacheTest, SaltsIsolateTenants) {
  BlockManager blocks(8, 4, true);
  const auto tokens = Tokens(8);
  BlockTable table;
  ASSERT_TRUE(blocks.Append(table, 0, 8).ok());
  blocks.CacheFullBlocks(table, Hashes(tokens, 4, "alice"));
  blocks.Free(table);
  EXPECT_EQ(blocks.CountCached(Hashes(tokens, 4, "alice")), 2);
  EXPECT_EQ(blocks.CountCached(Hashes(tokens, 4, "bob")), 0);
  EXPECT_EQ(blocks.CountCached(Hashes(tokens, 4)), 0);
  BlockTable t;
  EXPECT_EQ(blocks.AllocateCached(t, Hashes(tokens, 4, "bob"), 2), 0);
}

TEST(PrefixCacheTest, EvictsTheLeastRecentlyFreedCachedBlocksOnlyWhenNothingElseIsFree) {
  BlockManager blocks(4, 2, true);
  const auto a = Tokens(4, 100);  // two blocks each
  const auto b = Tokens(4, 200);
  BlockTable ta, tb;
  ASSERT_TRUE(blocks.Append(ta, 0, 4).ok());
  ASSERT_TRUE(blocks.Append(tb, 0, 4).ok());
  blocks.CacheFullBlocks(ta, Hashes(a, 2));
  blocks.CacheFullBlocks(tb, Hashes(b, 2));
  blocks.Free(ta);  // a is freed first: least recently used
  blocks.Free(tb);
  EXPECT_EQ(blocks.num_free_blocks(), 4);
  EXPECT_EQ(blocks.num_cached_free_blocks(), 4);

  // Two fresh blocks: both come from a's, tail first; b stays whole.
  BlockTable fresh;
  ASSERT_TRUE(blocks.Append(fresh, 0, 4).ok());
  EXPECT_EQ(blocks.CountCached(Hashes(a, 2)), 0);
  EXPECT_EQ(blocks.CountCached(Hashes(b, 2)), 2);
  blocks.Free(fresh);  // unnamed: plain free blocks, handed out before cached ones
  BlockTable again;
  ASSERT_TRUE(blocks.Append(again, 0, 3).ok());
  EXPECT_EQ(blocks.CountCached(Hashes(b, 2)), 2);
  // One more evicts b's tail block first: its head still matches.
  BlockTable more;
  ASSERT_TRUE(blocks.Append(more, 0, 1).ok());
  EXPECT_EQ(blocks.CountCached(Hashes(b, 2)), 1);
  EXPECT_EQ(blocks.num_evictions(), 3);
  EXPECT_FALSE(blocks.CanAppend(more, 1, 4));
  blocks.Free(again);
  blocks.Free(more);
  EXPECT_EQ(blocks.num_used_blocks(), 0);
}

TEST(PrefixCacheTest, AReferencedCachedBlockIsNeverEvicted) {
  BlockManager blocks(3, 2, true);
  const auto a = Tokens(4);
  BlockTable ta;
  ASSERT_TRUE(blocks.Append(ta, 0, 4).ok());
  blocks.CacheFullBlocks(ta, Hashes(a, 2));
  BlockTable fill;
  ASSERT_TRUE(blocks.Append(fill, 0, 2).ok());
  EXPECT_FALSE(blocks.CanAppend(fill, 2, 1));  // the cached blocks are in use
  blocks.Free(fill);
  blocks.Free(ta);
  EXPECT_TRUE(blocks.CanAppend(fill, 0, 6));  // now they can go
}

TEST(PrefixCacheTest, ASecondComputationOfTheSamePrefixLeavesTheFirstNamed) {
  BlockManager blocks(8, 4, true);
  const auto tokens = Tokens(4);
  const auto hashes = Hashes(tokens, 4);
  BlockTable x, y;
  ASSERT_TRUE(blocks.Append(x, 0, 4).ok());
  ASSERT_TRUE(blocks.Append(y, 0, 4).ok());
  blocks.CacheFullBlocks(x, hashes);
  blocks.CacheFullBlocks(y, hashes);
  const int32_t named = x[0];
  blocks.Free(x);
  blocks.Free(y);  // y's block is unnamed: plain free
  EXPECT_EQ(blocks.num_cached_free_blocks(), 1);
  BlockTable t;
  ASSERT_EQ(blocks.AllocateCached(t, hashes, 1), 1);
  EXPECT_EQ(t[0], named);
  blocks.Free(t);
}

TEST(PrefixCacheTest, WithoutPrefixCachingNothingIsCached) {
  BlockManager blocks(4, 4, /*enable_prefix_caching=*/false);
  const auto tokens = Tokens(8);
  const auto hashes = Hashes(tokens, 4);
  BlockTable table;
  ASSERT_TRUE(blocks.Append(table, 0, 8).ok());
  blocks.CacheFullBlocks(table, hashes);
  blocks.Free(table);
  EXPECT_EQ(blocks.CountCached(hashes), 0);
  EXPECT_EQ(blocks.num_cached_free_blocks(), 0);
  BlockTable t;
  EXPECT_EQ(blocks.AllocateCached(t, hashes, 2), 0);
}

TEST(BlockManagerTest, ForkOfAPrefixSharesOnlyThoseBlocks) {
  BlockManager blocks(8, 4);
  BlockTable parent;
  ASSERT_TRUE(blocks.Append(parent, 0, 10).ok());
  BlockTable child = blocks.Fork(parent, 2);
  EXPECT_EQ(child, BlockTable(parent.begin(), parent.begin() + 2));
  EXPECT_EQ(blocks.ref_count(parent[2]), 1);
  blocks.Free(child);
  blocks.Free(parent);
  EXPECT_EQ(blocks.num_free_blocks(), 8);
}

TEST(PrefixCacheTest, EventsNameEveryHashStoredAndEvicted) {
  BlockManager blocks(3, 4, /*enable_prefix_caching=*/true);
  // Nothing is recorded until asked for.
  BlockTable unrecorded;
  ASSERT_TRUE(blocks.Append(unrecorded, 0, 4).ok());
  const auto early = Hashes(Tokens(4, 100), 4);
  blocks.CacheFullBlocks(unrecorded, early);
  EXPECT_TRUE(blocks.TakeEvents().empty());
  blocks.Free(unrecorded);  // stays cached

  blocks.RecordEvents(true);
  const auto hashes = Hashes(Tokens(8), 4);
  BlockTable table;
  ASSERT_TRUE(blocks.Append(table, 0, 8).ok());
  blocks.CacheFullBlocks(table, hashes);
  blocks.CacheFullBlocks(table, hashes);  // named already: no second event
  std::vector<BlockManager::CacheEvent> events = blocks.TakeEvents();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].hash, hashes[0]);
  EXPECT_TRUE(events[0].stored);
  EXPECT_EQ(events[1].hash, hashes[1]);
  EXPECT_TRUE(blocks.TakeEvents().empty());  // taken
  std::vector<uint64_t> cached = blocks.CachedHashes();
  EXPECT_EQ(std::set<uint64_t>(cached.begin(), cached.end()),
            (std::set<uint64_t>{early[0], hashes[0], hashes[1]}));

  // Three blocks, all named: a fresh block evicts the least recently freed cached one.
  blocks.Free(table);
  BlockTable fresh;
  ASSERT_TRUE(blocks.Append(fresh, 0, 4).ok());
  events = blocks.TakeEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].hash, early[0]);
  EXPECT_FALSE(events[0].stored);
  EXPECT_EQ(blocks.CachedHashes().size(), 2u);
}

}  // namespace
}  // namespace tandem::engine
