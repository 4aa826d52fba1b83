#include "tandem/engine/kv_cache_layout.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"

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
        DTypeName(src.dtype), " vs ", DTypeName(dst.dtype), ", first KV head ", src.kv_head_begin,
        " vs ", dst.kv_head_begin));
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

absl::StatusOr<std::vector<KvHeadRun>> KvHeadRuns(const std::vector<KvCacheLayout>& src,
                                                  const std::vector<KvCacheLayout>& dst) {
  if (src.empty() || dst.empty()) {
    return absl::InvalidArgumentError("a KV re-shard needs at least one rank on each side");
  }
  const KvCacheLayout& a = src[0];
  for (const std::vector<KvCacheLayout>* side : {&src, &dst}) {
    for (const KvCacheLayout& l : *side) {
      if (l.num_layers != a.num_layers || l.block_size != a.block_size ||
          l.head_dim != a.head_dim || l.dtype != a.dtype) {
        return absl::InvalidArgumentError(absl::StrCat(
            "KV layouts differ: layers ", a.num_layers, " vs ", l.num_layers, ", block_size ",
            a.block_size, " vs ", l.block_size, ", head_dim ", a.head_dim, " vs ", l.head_dim,
            ", dtype ", DTypeName(a.dtype), " vs ", DTypeName(l.dtype)));
      }
    }
  }
  std::vector<KvHeadRun> runs;
  for (size_t d = 0; d < dst.size(); ++d) {
    const KvCacheLayout& to = dst[d];
    // Walk the destination's heads, taking each run from the first source rank that holds it.
    int head = to.kv_head_begin;
    const int end = to.kv_head_begin + to.num_kv_heads;
    while (head < end) {
      int from_rank = -1;
      for (size_t s = 0; s < src.size(); ++s) {
        if (head >= src[s].kv_head_begin && head < src[s].kv_head_begin + src[s].num_kv_heads) {
          from_rank = static_cast<int>(s);
          break;
        }
      }
      if (from_rank < 0) {
        return absl::InvalidArgumentError(absl::StrCat("KV head ", head, " of destination rank ", d,
                                                       " is held by no source rank"));
      }
      const KvCacheLayout& from = src[from_rank];
      const int run_end = std::min(end, from.kv_head_begin + from.num_kv_heads);
      runs.push_back({from_rank, static_cast<int>(d), head, run_end});
      head = run_end;
    }
  }
  return runs;
}

void AppendKvRunRanges(const KvCacheLayout& from, const KvCacheLayout& to, const KvHeadRun& run,
                       int src_layer, int dst_layer, int half, int32_t src_block, int32_t dst_block,
                       int slot, int count, std::vector<KvCopyRange>& out) {
  const uint64_t head_bytes = static_cast<uint64_t>(from.head_dim) * from.element_bytes();
  const uint64_t bytes = static_cast<uint64_t>(run.head_end - run.head_begin) * head_bytes;
  const uint64_t src_at = from.Offset(src_layer, half, src_block, slot) +
                          static_cast<uint64_t>(run.head_begin - from.kv_head_begin) * head_bytes;
  const uint64_t dst_at = to.Offset(dst_layer, half, dst_block, slot) +
                          static_cast<uint64_t>(run.head_begin - to.kv_head_begin) * head_bytes;
  if (bytes == from.row_bytes() && bytes == to.row_bytes()) {
    // Whole token rows on both sides: the tokens are contiguous.
    out.push_back({src_at, dst_at, bytes * static_cast<uint64_t>(count)});
    return;
  }
  for (int i = 0; i < count; ++i) {
    out.push_back({src_at + i * from.row_bytes(), dst_at + i * to.row_bytes(), bytes});
  }
}

absl::StatusOr<std::vector<KvShardTransfer>> KvReshardPlan(const std::vector<KvCacheLayout>& src,
                                                           const std::vector<KvCacheLayout>& dst,
                                                           const std::vector<int32_t>& src_blocks,
                                                           const std::vector<int32_t>& dst_blocks) {
  if (src_blocks.size() != dst_blocks.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("copying ", src_blocks.size(), " blocks into ", dst_blocks.size()));
  }
  TANDEM_ASSIGN_OR_RETURN(std::vector<KvHeadRun> runs, KvHeadRuns(src, dst));
  for (size_t r = 0; r < src.size(); ++r) {
    for (int32_t b : src_blocks) {
      if (b < 0 || b >= src[r].num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("source block id ", b, " outside [0, ",
                                                       src[r].num_blocks, ") of rank ", r));
      }
    }
  }
  for (size_t r = 0; r < dst.size(); ++r) {
    for (int32_t b : dst_blocks) {
      if (b < 0 || b >= dst[r].num_blocks) {
        return absl::InvalidArgumentError(absl::StrCat("destination block id ", b, " outside [0, ",
                                                       dst[r].num_blocks, ") of rank ", r));
      }
    }
  }
  std::vector<KvShardTransfer> plan;
  for (const KvHeadRun& run : runs) {
    // Consecutive runs of the same pair join one transfer.
    if (plan.empty() || plan.back().src_rank != run.src_rank ||
        plan.back().dst_rank != run.dst_rank) {
      plan.push_back({run.src_rank, run.dst_rank, {}});
    }
    const KvCacheLayout& from = src[run.src_rank];
    const KvCacheLayout& to = dst[run.dst_rank];
    for (int layer = 0; layer < from.num_layers; ++layer) {
      for (int half = 0; half < 2; ++half) {
        for (size_t i = 0; i < src_blocks.size(); ++i) {
          AppendKvRunRanges(from, to, run, layer, layer, half, src_blocks[i], dst_blocks[i], 0,
                            from.block_size, plan.back().ranges);
        }
      }
    }
  }
  return plan;
}

}  // namespace tandem::engine
