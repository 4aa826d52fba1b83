#include "tandem/engine/kv_cache_layout.h"

#include "gtest/gtest.h"

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

}  // namespace
}  // namespace tandem::engine
