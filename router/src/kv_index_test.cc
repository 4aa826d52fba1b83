#include "kv_index.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>

#include "tandem/engine/prefix_hash.h"

namespace tandem::router {
namespace {

std::vector<int32_t> Tokens(int n, int32_t first = 1) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

std::vector<uint64_t> Hashes(const std::vector<int32_t>& tokens, int block_size,
                             std::string_view salt = "") {
  std::vector<uint64_t> h;
  engine::ExtendBlockHashes(engine::PrefixRoot(salt), tokens, block_size, h);
  return h;
}

tandem::v1::KvEventBatch Batch(bool reset, int block_size, std::vector<uint64_t> stored,
                               std::vector<uint64_t> removed = {}) {
  tandem::v1::KvEventBatch b;
  b.set_reset(reset);
  b.set_block_size(block_size);
  b.mutable_stored()->Add(stored.begin(), stored.end());
  b.mutable_removed()->Add(removed.begin(), removed.end());
  return b;
}

TEST(KvIndexTest, LookupFindsTheLongestCachedPrefixPerWorker) {
  const std::vector<int32_t> prompt = Tokens(50);  // 3 full blocks of 16, then 2 tokens
  const std::vector<uint64_t> h = Hashes(prompt, 16);
  ASSERT_EQ(h.size(), 3u);
  KvIndex index;
  index.Apply("a", Batch(true, 16, {h[0], h[1]}));
  index.Apply("b", Batch(true, 16, {h[0], h[2]}));  // a hole at block 1: only block 0 counts
  index.Apply("c", Batch(true, 16, {}));
  PrefixHits hits = index.Lookup(prompt, "");
  EXPECT_EQ(hits.cached_tokens["a"], 32);
  EXPECT_EQ(hits.cached_tokens["b"], 16);
  EXPECT_FALSE(hits.cached_tokens.contains("c"));
  // Another salt names other blocks: nothing is found.
  EXPECT_TRUE(index.Lookup(prompt, "tenant").cached_tokens.empty());
  // A removal (the worker evicted the block) shortens the match; a later store lengthens it.
  index.Apply("a", Batch(false, 16, {h[2]}, {h[1]}));
  EXPECT_EQ(index.Lookup(prompt, "").cached_tokens["a"], 16);
  index.Apply("a", Batch(false, 16, {h[1]}));
  EXPECT_EQ(index.Lookup(prompt, "").cached_tokens["a"], 48);
  EXPECT_THAT(index.Entries(), testing::ElementsAre(testing::Pair("a", 3), testing::Pair("b", 2),
                                                    testing::Pair("c", 0)));
}

TEST(KvIndexTest, AResetReplacesAndADropForgetsTheWorker) {
  const std::vector<int32_t> prompt = Tokens(32);
  const std::vector<uint64_t> h = Hashes(prompt, 16);
  KvIndex index;
  index.Apply("a", Batch(true, 16, {h[0], h[1]}));
  index.Apply("a", Batch(true, 16, {h[0]}));  // a new stream's snapshot
  EXPECT_EQ(index.Lookup(prompt, "").cached_tokens["a"], 16);
  index.Drop("a");
  EXPECT_TRUE(index.Lookup(prompt, "").cached_tokens.empty());
  EXPECT_TRUE(index.Entries().empty());
}

TEST(KvIndexTest, EachWorkerIsHashedWithItsOwnBlockSize) {
  const std::vector<int32_t> prompt = Tokens(64);
  KvIndex index;
  index.Apply("b16", Batch(true, 16, Hashes(prompt, 16)));
  index.Apply("b32", Batch(true, 32, {Hashes(prompt, 32)[0]}));
  PrefixHits hits = index.Lookup(prompt, "");
  EXPECT_EQ(hits.cached_tokens["b16"], 64);
  EXPECT_EQ(hits.cached_tokens["b32"], 32);
}

TEST(KvIndexTest, EntriesPerWorkerAreCappedAndTheRestCounted) {
  const std::vector<int32_t> prompt = Tokens(16 * 5);
  const std::vector<uint64_t> h = Hashes(prompt, 16);
  KvIndex index(/*max_blocks_per_worker=*/3);
  index.Apply("a", Batch(true, 16, h));
  EXPECT_EQ(index.Entries()["a"], 3);
  EXPECT_EQ(index.dropped(), 2);
  // Under the cap the prefix found is what was kept (never more than the worker holds).
  EXPECT_EQ(index.Lookup(prompt, "").cached_tokens["a"], 48);
  // Room made by a removal is taken by the next store; a hash already held is no new entry.
  index.Apply("a", Batch(false, 16, {h[3], h[0]}, {h[2]}));
  EXPECT_EQ(index.Entries()["a"], 3);
  EXPECT_EQ(index.dropped(), 2);
}

}  // namespace
}  // namespace tandem::router
