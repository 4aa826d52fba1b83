#include "tandem/engine/block_manager.h"

#include <set>

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

}  // namespace
}  // namespace tandem::engine
