#include "tandem/engine/kv_cache_layout.h"

#include "absl/strings/str_cat.h"

namespace tandem::engine {

absl::StatusOr<std::vector<KvCopyRange>> KvBlockCopyRanges(const KvCacheLayout& src,
                                                           const KvCacheLayout& dst,
                                                           const std::vector<int32_t>& src_blocks,
                                                           const std::vector<int32_t>& dst_blocks) {
  if (src.num_layers != dst.num_layers || src.block_size != dst.block_size ||
      src.num_kv_heads != dst.num_kv_heads || src.head_dim != dst.head_dim ||
      src.dtype != dst.dtype || src.kv_head_begin != dst.kv_head_begin) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV layouts differ: layers ", src.num_layers, " vs ", dst.num_layers, ", block_size ",
        src.block_size, " vs ", dst.block_size, ", kv_heads ", src.num_kv_heads, " vs ",
        dst.num_kv_heads, ", head_dim ", src.head_dim, " vs ", dst.head_dim, ", dtype ",
        DTypeName(src.dtype), " vs ", DTypeName(dst.dtype), ", first KV head ",
        src.kv_head_begin, " vs ", dst.kv_head_begin));
  }
  if (src_blocks.size() != dst_blocks.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("copying ", src_blocks.size(), " blocks into ", dst_blocks.size()));
  }
  for (int32_t b : src_blocks) {
    if (b < 0 || b >= src.num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("source block id ", b, " outside [0, ", src.num_blocks, ")"));
    }
  }
  for (int32_t b : dst_blocks) {
    if (b < 0 || b >= dst.num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("destination block id ", b, " outside [0, ", dst.num_blocks, ")"));
    }
  }
  std::vector<KvCopyRange> ranges;
  ranges.reserve(static_cast<size_t>(src.num_layers) * 2 * src_blocks.size());
  for (int layer = 0; layer < src.num_layers; ++layer) {
    for (int half = 0; half < 2; ++half) {
      for (size_t i = 0; i < src_blocks.size(); ++i) {
        ranges.push_back({src.Offset(layer, half, src_blocks[i]),
                          dst.Offset(layer, half, dst_blocks[i]), src.block_bytes()});
      }
    }
  }
  return ranges;
}

}  // namespace tandem::engine
