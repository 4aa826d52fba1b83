#include <algorithm>

#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/element_types.cuh"
#include "kernels/src/cuda/flash_attention.cuh"
#include "kernels/src/cuda/paged_attention.cuh"
#include "kernels/src/cuda/reduce.cuh"
#include "kernels/src/cuda/search.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;

// The sequence holding query row `token` and how many keys that row sees.
struct RowInfo {
  int seq;
  int visible;
};

__device__ RowInfo FindRow(const PagedAttentionParams& p, int token) {
  const int lo = LastAtMost(p.query_start, p.num_seqs, token);
  const int q_len = p.query_start[lo + 1] - p.query_start[lo];
  const int row = token - p.query_start[lo];
  return {lo, p.context_len[lo] - q_len + row + 1};
}

// Offset of the K (or V) vector of `kv_head` at position `pos` of the sequence whose block
// table row is `table`.
__device__ __forceinline__ int64_t KvOffset(const PagedAttentionParams& p, const int32_t* table,
                                            int pos, int kv_head, int head_dim) {
  const int64_t slot =
      static_cast<int64_t>(table[pos / p.block_size]) * p.block_size + pos % p.block_size;
  return (slot * p.num_kv_heads + kv_head) * head_dim;
}

// The query row (token) of the i-th split-KV row of this launch (split row split_begin + i of
// the call).
__device__ __forceinline__ int SplitRow(const PagedAttentionParams& p, int i) {
  const int j = p.split_begin + i;
  return p.split_row_ids != nullptr ? p.split_row_ids[j] : j;
}

// What a partition block of grid (max_partitions, num_kv_heads, this launch's split rows)
// covers: keys [begin, begin + n) of its row's visible prefix (n <= 0: the row is shorter,
// nothing to do), for the `group` query heads of KV head kv_head; its logit rows are `stride`
// floats apart. `slot` is the row's place in this launch, and in the merge workspace.
struct PartitionSpan {
  int partition, kv_head, slot, token;
  RowInfo row;
  int stride, begin, n, group;
};
__device__ __forceinline__ PartitionSpan ThisPartition(const PagedAttentionParams& p) {
  PartitionSpan s;
  s.partition = blockIdx.x;
  s.kv_head = blockIdx.y;
  s.slot = blockIdx.z;
  s.token = SplitRow(p, s.slot);
  s.row = FindRow(p, s.token);
  s.stride = PagedAttentionLogitStride(p.partition_tokens);
  s.begin = s.partition * p.partition_tokens;
  s.n = min(s.row.visible - s.begin, p.partition_tokens);
  s.group = p.num_heads / p.num_kv_heads;
  return s;
}

// The `group` query rows of (token, kv_head) into shared q_s [group][head_dim], then a barrier.
__device__ __forceinline__ void LoadGroupQueries(const PagedAttentionParams& p, int token,
                                                 int kv_head, int group, int head_dim,
                                                 float* q_s) {
  const float* q_row =
      p.q + (static_cast<int64_t>(token) * p.num_heads + kv_head * group) * head_dim;
  for (int i = threadIdx.x; i < group * head_dim; i += kThreads) q_s[i] = q_row[i];
  __syncthreads();
}

// Softmax numerators within a partition, per query head: each of the `group` rows of `logits`
// (`stride` apart, n scores each) becomes exp(score - its max); the max and the sum go to
// group_max[g] and group_sum[g]. Called by all kThreads threads; ends with a barrier.
__device__ __forceinline__ void PartitionSoftmax(float* logits, int stride, int n, int group,
                                                 float* scratch, float* group_max,
                                                 float* group_sum) {
  for (int g = 0; g < group; ++g) {
    float* lg = logits + g * stride;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < n; j += kThreads) m = fmaxf(m, lg[j]);
    m = BlockReduce<true>(m, scratch);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += kThreads) {
      const float e = expf(lg[j] - m);
      lg[j] = e;
      sum += e;
    }
    sum = BlockReduce<false>(sum, scratch);
    if (threadIdx.x == 0) {
      group_max[g] = m;
      group_sum[g] = sum;
    }
  }
  __syncthreads();
}

// grid (max_partitions, num_kv_heads, split rows), kThreads threads.
// Dynamic shared memory: group * (kHeadDim + PagedAttentionLogitStride(p)) floats. Cache: the KV
// element type.
template <int kHeadDim, typename Cache>
__global__ void __launch_bounds__(kThreads)
    PagedAttentionPartitionKernel(const PagedAttentionParams p) {
  const auto [partition, kv_head, slot, token, row, stride, begin, n, group] = ThisPartition(p);
  if (n <= 0) return;

  extern __shared__ float shared[];
  float* q_s = shared;                     // [group][kHeadDim]
  float* logits = q_s + group * kHeadDim;  // [group][stride]
  __shared__ float scratch[32];
  __shared__ float group_max[kAttentionMaxGroup];
  __shared__ float group_sum[kAttentionMaxGroup];

  LoadGroupQueries(p, token, kv_head, group, kHeadDim, q_s);
  const int32_t* table = p.block_table + static_cast<int64_t>(row.seq) * p.max_blocks_per_seq;
  // Scores: each warp takes whole keys, its lanes split head_dim; the key is loaded once and
  // dotted with every query head of the group.
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  constexpr int kPerLane = kHeadDim / 32;
  for (int j = warp; j < n; j += kWarps) {
    const Cache* k =
        static_cast<const Cache*>(p.k_cache) + KvOffset(p, table, begin + j, kv_head, kHeadDim);
    float k_reg[kPerLane];
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) k_reg[e] = ToFloat(k[lane + 32 * e]) * p.k_scale;
    for (int g = 0; g < group; ++g) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) dot += q_s[g * kHeadDim + lane + 32 * e] * k_reg[e];
      dot = WarpSum(dot);
      if (lane == 0) logits[g * stride + j] = dot * p.scale;
    }
  }
  __syncthreads();

  PartitionSoftmax(logits, stride, n, group, scratch, group_max, group_sum);

  // Weighted values: threads split head_dim (kDims each) and, when head_dim is narrower than
  // the block, the keys (kSubsets interleaved subsets merged below).
  constexpr int kDims = kHeadDim >= kThreads ? kHeadDim / kThreads : 1;
  constexpr int kLanesPerSubset = kHeadDim / kDims;
  constexpr int kSubsets = kThreads / kLanesPerSubset;
  const int subset = threadIdx.x / kLanesPerSubset;
  const int d_lane = threadIdx.x % kLanesPerSubset;
  float acc[kAttentionMaxGroup][kDims] = {};
  for (int j = subset; j < n; j += kSubsets) {
    const Cache* v =
        static_cast<const Cache*>(p.v_cache) + KvOffset(p, table, begin + j, kv_head, kHeadDim);
    float v_reg[kDims];
#pragma unroll
    for (int e = 0; e < kDims; ++e) v_reg[e] = ToFloat(v[d_lane + kLanesPerSubset * e]) * p.v_scale;
#pragma unroll
    for (int g = 0; g < kAttentionMaxGroup; ++g) {
      if (g < group) {
        const float w = logits[g * stride + j];
#pragma unroll
        for (int e = 0; e < kDims; ++e) acc[g][e] += w * v_reg[e];
      }
    }
  }
  if constexpr (kSubsets > 1) {
    __syncthreads();        // logits are no longer read; reuse them to merge the subsets
    // [group][kSubsets][kHeadDim] <= group * stride floats (stride >= kMinLogitStride).
    static_assert(kSubsets * kHeadDim <= kAttentionMinLogitStride);
    float* merge = logits;
#pragma unroll
    for (int g = 0; g < kAttentionMaxGroup; ++g) {
      if (g < group) {
#pragma unroll
        for (int e = 0; e < kDims; ++e) {
          merge[(g * kSubsets + subset) * kHeadDim + d_lane + kLanesPerSubset * e] = acc[g][e];
        }
      }
    }
    __syncthreads();
    if (subset == 0) {
#pragma unroll
      for (int g = 0; g < kAttentionMaxGroup; ++g) {
        if (g < group) {
#pragma unroll
          for (int e = 0; e < kDims; ++e) {
            float total = 0.0f;
            for (int s = 0; s < kSubsets; ++s) {
              total += merge[(g * kSubsets + s) * kHeadDim + d_lane + kLanesPerSubset * e];
            }
            acc[g][e] = total;
          }
        }
      }
    }
  }
  if (subset != 0) return;
#pragma unroll
  for (int g = 0; g < kAttentionMaxGroup; ++g) {
    if (g >= group) break;
    const int64_t head_row = static_cast<int64_t>(token) * p.num_heads + kv_head * group + g;
    const int64_t part =
        (static_cast<int64_t>(slot) * p.num_heads + kv_head * group + g) * p.max_partitions +
        partition;
#pragma unroll
    for (int e = 0; e < kDims; ++e) {
      const int d = d_lane + kLanesPerSubset * e;
      if (p.max_partitions == 1) {
        StoreActivation(p.out, p.out_dtype, head_row * kHeadDim + d, acc[g][e] / group_sum[g]);
      } else {
        p.partial_out[part * kHeadDim + d] = acc[g][e];
      }
    }
    if (p.max_partitions > 1 && d_lane == 0) {
      p.partial_max[part] = group_max[g];
      p.partial_sum[part] = group_sum[g];
    }
  }
}

// Elements of K or V one lane reads at once: 16 bytes of a 16-bit cache, 8 of an 8-bit one,
// 32 (two 16-byte loads) of fp32.
constexpr int kVecElems = 8;
// Query heads per KV head PagedAttentionVecKernel holds (its accumulators are registers).
constexpr int kVecMaxGroup = 8;
// Keys whose loads each lane has in flight before it uses the first.
constexpr int kVecKeysInFlight = 4;

template <typename Cache>
struct alignas(sizeof(Cache) * kVecElems) CacheVec {
  Cache e[kVecElems];
};

// The bandwidth-bound form of PagedAttentionPartitionKernel (same grid, partitions and
// outputs), for query groups of at most kVecMaxGroup heads. kHeadDim / kVecElems lanes share
// one key: each reads kVecElems consecutive elements of it in one wide load, so a warp reads
// 32 / (kHeadDim / kVecElems) whole keys per load instruction, and kVecKeysInFlight such loads
// are issued before the first is used. Scores reduce over the lanes of a key with shuffles;
// the weighted sum of V accumulates per lane in registers and is reduced over the block once.
// Dynamic shared memory: group * (kHeadDim + stride) + kWarps * group * kHeadDim floats.
// kGroup: the group rounded up to a power of two (the registers its accumulators take).
template <int kHeadDim, typename Cache, int kGroup>
__global__ void __launch_bounds__(kThreads)
    PagedAttentionVecKernel(const PagedAttentionParams p) {
  static_assert(kGroup <= kVecMaxGroup);
  constexpr int kLanesPerKey = kHeadDim / kVecElems;
  constexpr int kKeysPerWarp = 32 / kLanesPerKey;
  constexpr int kKeysPerPass = kWarps * kKeysPerWarp;
  static_assert(kLanesPerKey <= 32 && 32 % kLanesPerKey == 0);
  using Vec = CacheVec<Cache>;
  const auto [partition, kv_head, slot, token, row, stride, begin, n, group] = ThisPartition(p);
  if (n <= 0) return;

  extern __shared__ float shared[];
  float* q_s = shared;                     // [group][kHeadDim]
  float* logits = q_s + group * kHeadDim;  // [group][stride]
  float* merge = logits + group * stride;  // [kWarps][group][kHeadDim]
  __shared__ float scratch[32];
  __shared__ float group_max[kVecMaxGroup];
  __shared__ float group_sum[kVecMaxGroup];

  LoadGroupQueries(p, token, kv_head, group, kHeadDim, q_s);
  const int32_t* table = p.block_table + static_cast<int64_t>(row.seq) * p.max_blocks_per_seq;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int key_slot = lane / kLanesPerKey;  // which of the warp's keys
  const int sub = lane % kLanesPerKey;       // which kVecElems elements of it
  const auto* k_cache = static_cast<const Cache*>(p.k_cache);
  const auto* v_cache = static_cast<const Cache*>(p.v_cache);
  auto load = [&, begin = begin, kv_head = kv_head](const Cache* cache, int j) {
    return *reinterpret_cast<const Vec*>(cache + KvOffset(p, table, begin + j, kv_head, kHeadDim) +
                                         sub * kVecElems);
  };

  // Scores. The loop bound is warp-uniform so every lane reaches the shuffles.
  const float score_scale = p.scale * p.k_scale;
  for (int base = warp * kKeysPerWarp; base < n; base += kKeysPerPass * kVecKeysInFlight) {
    Vec raw[kVecKeysInFlight];
#pragma unroll
    for (int u = 0; u < kVecKeysInFlight; ++u) {
      const int j = base + u * kKeysPerPass + key_slot;
      raw[u] = j < n ? load(k_cache, j) : Vec{};
    }
#pragma unroll
    for (int u = 0; u < kVecKeysInFlight; ++u) {
      const int j = base + u * kKeysPerPass + key_slot;
      float kf[kVecElems];
#pragma unroll
      for (int e = 0; e < kVecElems; ++e) kf[e] = ToFloat(raw[u].e[e]);
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (g < group) {
          const float* qg = q_s + g * kHeadDim + sub * kVecElems;
          float dot = 0.0f;
#pragma unroll
          for (int e = 0; e < kVecElems; ++e) dot += qg[e] * kf[e];
#pragma unroll
          for (int offset = kLanesPerKey / 2; offset > 0; offset /= 2) {
            dot += __shfl_xor_sync(0xffffffffu, dot, offset);
          }
          if (sub == 0 && j < n) logits[g * stride + j] = dot * score_scale;
        }
      }
    }
  }
  __syncthreads();

  PartitionSoftmax(logits, stride, n, group, scratch, group_max, group_sum);

  // Weighted values: each lane accumulates its kVecElems dims over the keys it reads.
  float acc[kGroup][kVecElems] = {};
  for (int base = warp * kKeysPerWarp; base < n; base += kKeysPerPass * kVecKeysInFlight) {
    Vec raw[kVecKeysInFlight];
#pragma unroll
    for (int u = 0; u < kVecKeysInFlight; ++u) {
      const int j = base + u * kKeysPerPass + key_slot;
      raw[u] = j < n ? load(v_cache, j) : Vec{};
    }
#pragma unroll
    for (int u = 0; u < kVecKeysInFlight; ++u) {
      const int j = base + u * kKeysPerPass + key_slot;
      if (j < n) {
        float vf[kVecElems];
#pragma unroll
        for (int e = 0; e < kVecElems; ++e) vf[e] = ToFloat(raw[u].e[e]);
#pragma unroll
        for (int g = 0; g < kGroup; ++g) {
          if (g < group) {
            const float w = logits[g * stride + j];
#pragma unroll
            for (int e = 0; e < kVecElems; ++e) acc[g][e] += w * vf[e];
          }
        }
      }
    }
  }
  // Over the warp's key slots (lanes kLanesPerKey apart), then over the warps.
#pragma unroll
  for (int g = 0; g < kGroup; ++g) {
    if (g < group) {
#pragma unroll
      for (int e = 0; e < kVecElems; ++e) {
        float v = acc[g][e];
#pragma unroll
        for (int offset = kLanesPerKey; offset < 32; offset *= 2) {
          v += __shfl_xor_sync(0xffffffffu, v, offset);
        }
        if (key_slot == 0) merge[(warp * group + g) * kHeadDim + sub * kVecElems + e] = v;
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * kHeadDim; i += kThreads) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += merge[w * group * kHeadDim + i];
    total *= p.v_scale;
    const int g = i / kHeadDim;
    const int d = i % kHeadDim;
    const int64_t head_row = static_cast<int64_t>(token) * p.num_heads + kv_head * group + g;
    if (p.max_partitions == 1) {
      StoreActivation(p.out, p.out_dtype, head_row * kHeadDim + d, total / group_sum[g]);
    } else {
      const int64_t part =
          (static_cast<int64_t>(slot) * p.num_heads + kv_head * group + g) * p.max_partitions +
          partition;
      p.partial_out[part * kHeadDim + d] = total;
      if (d == 0) {
        p.partial_max[part] = group_max[g];
        p.partial_sum[part] = group_sum[g];
      }
    }
  }
}

// grid (num_heads, this launch's split rows), kHeadDim threads: merges a row's partitions,
// rescaling each by exp(its max - the overall max).
template <int kHeadDim>
__global__ void __launch_bounds__(kHeadDim)
    PagedAttentionMergeKernel(const PagedAttentionParams p) {
  const int h = blockIdx.x;
  const int slot = blockIdx.y;
  const int token = SplitRow(p, slot);
  const RowInfo row = FindRow(p, token);
  const int partitions = (row.visible + p.partition_tokens - 1) / p.partition_tokens;
  const int64_t head_row = static_cast<int64_t>(token) * p.num_heads + h;
  const int64_t first = (static_cast<int64_t>(slot) * p.num_heads + h) * p.max_partitions;
  const float* maxes = p.partial_max + first;
  const float* sums = p.partial_sum + first;
  float m = -INFINITY;
  for (int i = 0; i < partitions; ++i) m = fmaxf(m, maxes[i]);
  float total = 0.0f;
  for (int i = 0; i < partitions; ++i) total += sums[i] * expf(maxes[i] - m);
  const int d = threadIdx.x;
  float o = 0.0f;
  for (int i = 0; i < partitions; ++i) {
    o += p.partial_out[(first + i) * kHeadDim + d] * expf(maxes[i] - m);
  }
  StoreActivation(p.out, p.out_dtype, head_row * kHeadDim + d, o / total);
}

}  // namespace

absl::Status LaunchPagedAttention(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 0) return absl::OkStatus();
  if (absl::Status dtype = CheckActivationDType(p.out_dtype); !dtype.ok()) return dtype;
  if (p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        "PagedAttention: num_heads must be a multiple of num_kv_heads");
  }
  const int group = p.num_heads / p.num_kv_heads;
  if (group > kAttentionMaxGroup) {
    return absl::InvalidArgumentError(absl::StrCat("PagedAttention: ", group,
                                                   " query heads per KV head; the CUDA kernel "
                                                   "holds at most ",
                                                   kAttentionMaxGroup));
  }
  if (p.block_size <= 0) return absl::InvalidArgumentError("PagedAttention: bad block_size");
  // Sequences of prefill length may go to the tensor-core kernel, the rest (or everything)
  // to the split-KV kernels below.
  if (p.flash_tiles > 0) {
    if (const absl::Status status = LaunchFlashPrefill(p, stream); !status.ok()) return status;
  }
  const int split_rows = p.split_rows < 0 ? p.num_tokens : p.split_rows;
  if (split_rows == 0) return absl::OkStatus();
  if (p.max_partitions <= 0) {
    return absl::InvalidArgumentError("PagedAttention: bad partition count");
  }
  if (p.partition_tokens < kAttentionMinPartitionTokens ||
      p.partition_tokens > kAttentionPartitionTokens) {
    return absl::InvalidArgumentError(absl::StrCat("PagedAttention: partition of ",
                                                   p.partition_tokens, " keys"));
  }
  if (p.max_partitions > 1 &&
      (p.partial_out == nullptr || p.partial_max == nullptr || p.partial_sum == nullptr)) {
    return absl::InvalidArgumentError("PagedAttention: split over partitions needs workspace");
  }
  if (p.max_partitions > 65535 || p.num_kv_heads > 65535 || p.num_heads > 65535) {
    return absl::InvalidArgumentError("PagedAttention: grid too large");
  }
  if (p.max_partitions > 1 && p.launch_rows <= 0) {
    return absl::InvalidArgumentError("PagedAttention: no rows fit the merge workspace");
  }
  // Rows per launch: as many as the merge workspace holds (all of them without a merge), and
  // at most the grid's 65535.
  const int launch_rows = std::min(p.max_partitions > 1 ? p.launch_rows : split_rows, 65535);
  TANDEM_DISPATCH_HEAD_DIM(p.head_dim, kHeadDim, {
    // Groups of up to kVecMaxGroup heads take the wide-load kernel; larger ones the original.
    // Its wide loads (CacheVec: 8 elements, 8 to 32 bytes, which some architectures load in
    // one instruction) need the K and V halves, and so every key's vector, aligned to their
    // size; a cache that is not (the engine's allocations are) reads a key per warp instead.
    const int64_t vec_bytes = int64_t{kVecElems} * DTypeSize(p.cache_dtype);
    const bool aligned = reinterpret_cast<uintptr_t>(p.k_cache) % vec_bytes == 0 &&
                         reinterpret_cast<uintptr_t>(p.v_cache) % vec_bytes == 0 &&
                         kHeadDim * DTypeSize(p.cache_dtype) % vec_bytes == 0;
    const bool vec = group <= kVecMaxGroup && aligned;
    const size_t shared_bytes =
        sizeof(float) * group *
        (kHeadDim + PagedAttentionLogitStride(p.partition_tokens) + (vec ? kWarps * kHeadDim : 0));
    void (*partition_kernel)(const PagedAttentionParams) = nullptr;
    TANDEM_DISPATCH_KV_DTYPE(p.cache_dtype, Cache, {
      if (!vec) {
        partition_kernel = &PagedAttentionPartitionKernel<kHeadDim, Cache>;
      } else if (group == 1) {
        partition_kernel = &PagedAttentionVecKernel<kHeadDim, Cache, 1>;
      } else if (group == 2) {
        partition_kernel = &PagedAttentionVecKernel<kHeadDim, Cache, 2>;
      } else if (group <= 4) {
        partition_kernel = &PagedAttentionVecKernel<kHeadDim, Cache, 4>;
      } else {
        partition_kernel = &PagedAttentionVecKernel<kHeadDim, Cache, kVecMaxGroup>;
      }
    });
    if (shared_bytes > 48 * 1024) {
      const cudaError_t error = cudaFuncSetAttribute(
          partition_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
      if (error != cudaSuccess) return CudaStatus(error, "PagedAttention shared memory");
    }
    // Launches in stream order, each reusing the merge workspace from its start.
    for (int begin = 0; begin < split_rows; begin += launch_rows) {
      PagedAttentionParams launch = p;
      launch.split_begin = begin;
      const int rows = std::min(launch_rows, split_rows - begin);
      const dim3 grid(p.max_partitions, p.num_kv_heads, rows);
      partition_kernel<<<grid, kThreads, shared_bytes, stream>>>(launch);
      if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) {
        return CudaStatus(error, vec ? "PagedAttentionVecKernel" : "PagedAttentionPartitionKernel");
      }
      if (p.max_partitions > 1) {
        PagedAttentionMergeKernel<kHeadDim>
            <<<dim3(p.num_heads, rows), kHeadDim, 0, stream>>>(launch);
        if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) {
          return CudaStatus(error, "PagedAttentionMergeKernel");
        }
      }
    }
  });
  return absl::OkStatus();  // every launch above was checked
}

}  // namespace tandem::kernels::cuda
