#include "tandem/engine/kv_cache_layout.h"

#include <cstring>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tandem/engine/tensor_parallel.h"

namespace tandem::engine {
namespace {

// Two layers of four blocks of 16 tokens x 2 KV heads x head_dim 8.
KvCacheLayout Small(DType dtype = DType::kF32) {
  return {.num_layers = 2, .num_blocks = 4, .block_size = 16, .num_kv_heads = 2, .head_dim = 8,
          .dtype = dtype};
}

TEST(KvCacheLayoutTest, SizesFollowTheElementType) {
  const KvCacheLayout f32 = Small();
  EXPECT_EQ(f32.row_bytes(), 2u * 8 * 4);
  EXPECT_EQ(f32.block_bytes(), 16u * 2 * 8 * 4);
  EXPECT_EQ(f32.half_bytes(), 4 * f32.block_bytes());
  EXPECT_EQ(f32.total_bytes(), 2u * 2 * 4 * f32.block_bytes());
  EXPECT_EQ(f32.bytes_per_block(), 2u * 2 * f32.block_bytes());
  const KvCacheLayout bf16 = Small(DType::kBF16);
  EXPECT_EQ(bf16.total_bytes() * 2, f32.total_bytes());
  EXPECT_EQ(bf16.Offset(1, 1, 3, 5) * 2, f32.Offset(1, 1, 3, 5));
}

TEST(KvCacheLayoutTest, EveryTokenRowHasItsOwnPlace) {
  // [layers][2][num_blocks][block_size][kv_heads][head_dim]: walking the dimensions in order
  // visits every row exactly once, one row apart.
  const KvCacheLayout l = Small();
  uint64_t expected = 0;
  for (int layer = 0; layer < l.num_layers; ++layer) {
    for (int half = 0; half < 2; ++half) {
      for (int block = 0; block < l.num_blocks; ++block) {
        for (int slot = 0; slot < l.block_size; ++slot) {
          ASSERT_EQ(l.Offset(layer, half, block, slot), expected)
              << layer << "/" << half << "/" << block << "/" << slot;
          expected += l.row_bytes();
        }
      }
    }
  }
  EXPECT_EQ(expected, l.total_bytes());
  const kernels::KvLayout k = l.kernel_layout();
  EXPECT_EQ(static_cast<uint64_t>(k.LayerElements()) * l.num_layers * l.element_bytes(),
            l.total_bytes());
}

TEST(KvBlockCopyRangesTest, RefusesOutOfRangeAndMismatchedLayouts) {
  const KvCacheLayout a = Small();
  KvCacheLayout b = a;
  b.num_blocks = 3;  // caches may differ in size
  EXPECT_TRUE(KvBlockCopyRanges(a, b, {0, 3}, {1, 2}).ok());
  EXPECT_EQ(KvBlockCopyRanges(a, b, {4}, {0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvBlockCopyRanges(a, b, {0}, {3}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvBlockCopyRanges(a, b, {0}, {-1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvBlockCopyRanges(a, b, {0, 1}, {0}).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (auto change : {+[](KvCacheLayout& l) { l.head_dim = 16; },
                      +[](KvCacheLayout& l) { l.num_layers = 3; },
                      +[](KvCacheLayout& l) { l.block_size = 32; },
                      +[](KvCacheLayout& l) { l.dtype = DType::kBF16; }}) {
    KvCacheLayout other = a;
    change(other);
    auto refused = KvBlockCopyRanges(a, other, {0}, {0});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("KV layouts differ"), std::string::npos);
  }
}

TEST(KvBlockCopyRangesTest, OneRangePerLayerHalfAndBlock) {
  const KvCacheLayout src = Small();
  KvCacheLayout dst = src;
  dst.num_blocks = 8;
  // Two layers x (K, V) x one block: four ranges, each a whole block at its place.
  auto ranges = KvBlockCopyRanges(src, dst, {1}, {6});
  ASSERT_TRUE(ranges.ok());
  ASSERT_EQ(ranges->size(), 4u);
  const uint64_t block_bytes = 16 * 2 * 8 * 4;
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ((*ranges)[i].bytes, block_bytes);
    EXPECT_EQ((*ranges)[i].src_offset, (i * 4 + 1) * block_bytes) << i;
    EXPECT_EQ((*ranges)[i].dst_offset, (i * 8 + 6) * block_bytes) << i;
  }
}

// The caches of a group of `tp` ranks over a model of `kv_heads` KV heads (as the model runner
// lays them out: TensorParallelShard), `blocks` blocks each.
std::vector<KvCacheLayout> GroupLayouts(int kv_heads, int tp, int blocks) {
  text::ModelConfig c;
  c.num_heads = 8;
  c.num_kv_heads = kv_heads;
  c.intermediate_size = 64;
  c.vocab_size = 64;
  std::vector<KvCacheLayout> out;
  for (int r = 0; r < tp; ++r) {
    auto shard = TensorParallelShard::For(c, r, tp);
    EXPECT_TRUE(shard.ok()) << shard.status();
    out.push_back({.num_layers = 2,
                   .num_blocks = blocks,
                   .block_size = 4,
                   .num_kv_heads = shard->num_kv_heads,
                   .head_dim = 3,
                   .dtype = DType::kBF16,
                   .kv_head_begin = shard->kv_head_begin,
                   .tp_size = tp});
  }
  return out;
}

// The value every element of the model's KV has: a function of where it is in the model.
uint16_t Value(int layer, int half, int block, int slot, int head, int dim) {
  return static_cast<uint16_t>(((((layer * 2 + half) * 16 + block) * 8 + slot) * 8 + head) * 4 +
                               dim);
}

// Caches of a group filled with the model's KV (block b of the model in block b of each rank).
std::vector<std::vector<uint16_t>> Fill(const std::vector<KvCacheLayout>& group) {
  std::vector<std::vector<uint16_t>> caches;
  for (const KvCacheLayout& l : group) {
    std::vector<uint16_t> cache(l.total_bytes() / 2);
    for (int layer = 0; layer < l.num_layers; ++layer)
      for (int half = 0; half < 2; ++half)
        for (int block = 0; block < l.num_blocks; ++block)
          for (int slot = 0; slot < l.block_size; ++slot)
            for (int h = 0; h < l.num_kv_heads; ++h)
              for (int d = 0; d < l.head_dim; ++d)
                cache[l.Offset(layer, half, block, slot) / 2 + h * l.head_dim + d] =
                    Value(layer, half, block, slot, l.kv_head_begin + h, d);
    caches.push_back(std::move(cache));
  }
  return caches;
}

class KvReshardTest : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

// Blocks {1, 3} of the source group land in blocks {2, 0} of the destination group, every rank
// of it holding exactly its heads' KV, whatever the two degrees.
TEST_P(KvReshardTest, EveryDestinationRankGetsItsHeads) {
  const auto [kv_heads, src_tp, dst_tp] = GetParam();
  const auto src = GroupLayouts(kv_heads, src_tp, 4);
  const auto dst = GroupLayouts(kv_heads, dst_tp, 3);
  const auto src_caches = Fill(src);
  std::vector<std::vector<uint16_t>> dst_caches;
  for (const KvCacheLayout& l : dst) dst_caches.emplace_back(l.total_bytes() / 2, 0xffff);
  auto plan = KvReshardPlan(src, dst, {1, 3}, {2, 0});
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (const KvShardTransfer& t : *plan) {
    for (const KvCopyRange& r : t.ranges) {
      ASSERT_LE(r.src_offset + r.bytes, src[t.src_rank].total_bytes());
      ASSERT_LE(r.dst_offset + r.bytes, dst[t.dst_rank].total_bytes());
      std::memcpy(reinterpret_cast<char*>(dst_caches[t.dst_rank].data()) + r.dst_offset,
                  reinterpret_cast<const char*>(src_caches[t.src_rank].data()) + r.src_offset,
                  r.bytes);
    }
  }
  for (size_t d = 0; d < dst.size(); ++d) {
    const KvCacheLayout& l = dst[d];
    for (int layer = 0; layer < l.num_layers; ++layer)
      for (int half = 0; half < 2; ++half)
        for (auto [from, to] : {std::pair{1, 2}, {3, 0}})
          for (int slot = 0; slot < l.block_size; ++slot)
            for (int h = 0; h < l.num_kv_heads; ++h)
              for (int e = 0; e < l.head_dim; ++e)
                ASSERT_EQ(dst_caches[d][l.Offset(layer, half, to, slot) / 2 + h * l.head_dim + e],
                          Value(layer, half, from, slot, l.kv_head_begin + h, e))
                    << "rank " << d << " layer " << layer << " block " << to << " head " << h;
    // Block 1 was not part of the transfer.
    EXPECT_EQ(dst_caches[d][l.Offset(0, 0, 1) / 2], 0xffff);
  }
  // A destination rank reads from as few source ranks as its heads need, one transfer each.
  for (size_t i = 1; i < plan->size(); ++i) {
    EXPECT_FALSE((*plan)[i].src_rank == (*plan)[i - 1].src_rank &&
                 (*plan)[i].dst_rank == (*plan)[i - 1].dst_rank);
  }
}

INSTANTIATE_TEST_SUITE_P(Degrees, KvReshardTest,
                         // (KV heads, source degree, destination degree): 2 -> 1, 1 -> 2, 4 -> 2, 2
                         // -> 4, and with KV heads replicated (2 heads over 4 or 8 ranks).
                         ::testing::Values(std::tuple{4, 2, 1}, std::tuple{4, 1, 2},
                                           std::tuple{4, 4, 2}, std::tuple{4, 2, 4},
                                           std::tuple{2, 4, 1}, std::tuple{2, 1, 4},
                                           std::tuple{2, 8, 2}, std::tuple{4, 1, 1}),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param), "Heads",
                                               std::get<1>(info.param), "To",
                                               std::get<2>(info.param));
                         });

TEST(KvReshardTest, RefusesWhatCannotBeMapped) {
  auto src = GroupLayouts(4, 2, 4);
  auto dst = GroupLayouts(4, 1, 4);
  // Only rank 0 of the source: heads 2 and 3 come from nowhere.
  auto missing = KvReshardPlan({src[0]}, dst, {0}, {0});
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("KV head 2 of destination rank 0 is held by no "
                                            "source rank"),
            std::string::npos)
      << missing.status();
  dst[0].head_dim = 4;
  EXPECT_EQ(KvReshardPlan(src, dst, {0}, {0}).status().code(), absl::StatusCode::kInvalidArgument);
  dst = GroupLayouts(4, 1, 4);
  EXPECT_EQ(KvReshardPlan(src, dst, {4}, {0}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(KvReshardPlan(src, dst, {0, 1}, {0}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::engine
