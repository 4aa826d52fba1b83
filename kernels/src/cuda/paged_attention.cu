#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/element_types.cuh"
#include "kernels/src/cuda/paged_attention.cuh"
#include "kernels/src/cuda/reduce.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kPartition = kAttentionPartitionTokens;

// The sequence holding query row `token` and how many keys that row sees.
struct RowInfo {
  int seq;
  int visible;
};

__device__ RowInfo FindRow(const PagedAttentionParams& p, int token) {
  // Largest s with query_start[s] <= token.
  int lo = 0;
  int hi = p.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.query_start[mid] <= token) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
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

// grid (max_partitions, num_kv_heads, num_tokens), kThreads threads.
// Dynamic shared memory: group * (kHeadDim + kPartition) floats. Cache: the KV element type.
template <int kHeadDim, typename Cache>
__global__ void __launch_bounds__(kThreads)
    PagedAttentionPartitionKernel(const PagedAttentionParams p) {
  const int partition = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int token = blockIdx.z;
  const RowInfo row = FindRow(p, token);
  const int begin = partition * kPartition;
  if (begin >= row.visible) return;
  const int n = min(row.visible - begin, kPartition);
  const int group = p.num_heads / p.num_kv_heads;

  extern __shared__ float shared[];
  float* q_s = shared;                     // [group][kHeadDim]
  float* logits = q_s + group * kHeadDim;  // [group][kPartition]
  __shared__ float scratch[32];
  __shared__ float group_max[kAttentionMaxGroup];
  __shared__ float group_sum[kAttentionMaxGroup];

  const float* q_row =
      p.q + (static_cast<int64_t>(token) * p.num_heads + kv_head * group) * kHeadDim;
  for (int i = threadIdx.x; i < group * kHeadDim; i += kThreads) q_s[i] = q_row[i];
  __syncthreads();

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
      if (lane == 0) logits[g * kPartition + j] = dot * p.scale;
    }
  }
  __syncthreads();

  // Softmax numerators within the partition, per query head.
  for (int g = 0; g < group; ++g) {
    float* lg = logits + g * kPartition;
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
        const float w = logits[g * kPartition + j];
#pragma unroll
        for (int e = 0; e < kDims; ++e) acc[g][e] += w * v_reg[e];
      }
    }
  }
  if constexpr (kSubsets > 1) {
    __syncthreads();        // logits are no longer read; reuse them to merge the subsets
    float* merge = logits;  // [group][kSubsets][kHeadDim] <= group * kPartition floats
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
#pragma unroll
    for (int e = 0; e < kDims; ++e) {
      const int d = d_lane + kLanesPerSubset * e;
      if (p.max_partitions == 1) {
        p.out[head_row * kHeadDim + d] = acc[g][e] / group_sum[g];
      } else {
        p.partial_out[(head_row * p.max_partitions + partition) * kHeadDim + d] = acc[g][e];
      }
    }
    if (p.max_partitions > 1 && d_lane == 0) {
      p.partial_max[head_row * p.max_partitions + partition] = group_max[g];
      p.partial_sum[head_row * p.max_partitions + partition] = group_sum[g];
    }
  }
}

// grid (num_heads, num_tokens), kHeadDim threads: merges a row's partitions, rescaling each
// by exp(its max - the overall max).
template <int kHeadDim>
__global__ void __launch_bounds__(kHeadDim)
    PagedAttentionMergeKernel(const PagedAttentionParams p) {
  const int h = blockIdx.x;
  const int token = blockIdx.y;
  const RowInfo row = FindRow(p, token);
  const int partitions = (row.visible + kPartition - 1) / kPartition;
  const int64_t head_row = static_cast<int64_t>(token) * p.num_heads + h;
  const float* maxes = p.partial_max + head_row * p.max_partitions;
  const float* sums = p.partial_sum + head_row * p.max_partitions;
  float m = -INFINITY;
  for (int i = 0; i < partitions; ++i) m = fmaxf(m, maxes[i]);
  float total = 0.0f;
  for (int i = 0; i < partitions; ++i) total += sums[i] * expf(maxes[i] - m);
  const int d = threadIdx.x;
  float o = 0.0f;
  for (int i = 0; i < partitions; ++i) {
    o += p.partial_out[(head_row * p.max_partitions + i) * kHeadDim + d] * expf(maxes[i] - m);
  }
  p.out[head_row * kHeadDim + d] = o / total;
}

}  // namespace

absl::Status LaunchPagedAttention(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 0) return absl::OkStatus();
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
  if (p.block_size <= 0 || p.max_partitions <= 0) {
    return absl::InvalidArgumentError("PagedAttention: bad block_size or partition count");
  }
  if (p.max_partitions > 1 &&
      (p.partial_out == nullptr || p.partial_max == nullptr || p.partial_sum == nullptr)) {
    return absl::InvalidArgumentError("PagedAttention: split over partitions needs workspace");
  }
  if (p.max_partitions > 65535 || p.num_tokens > 65535 || p.num_kv_heads > 65535) {
    return absl::InvalidArgumentError("PagedAttention: grid too large");
  }
  TANDEM_DISPATCH_HEAD_DIM(p.head_dim, kHeadDim, {
    const size_t shared_bytes = sizeof(float) * group * (kHeadDim + kPartition);
    void (*partition_kernel)(const PagedAttentionParams) = nullptr;
    TANDEM_DISPATCH_KV_DTYPE(p.cache_dtype, Cache, {
      partition_kernel = &PagedAttentionPartitionKernel<kHeadDim, Cache>;
    });
    if (shared_bytes > 48 * 1024) {
      const cudaError_t error = cudaFuncSetAttribute(
          partition_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
      if (error != cudaSuccess) return CudaStatus(error, "PagedAttention shared memory");
    }
    const dim3 grid(p.max_partitions, p.num_kv_heads, p.num_tokens);
    partition_kernel<<<grid, kThreads, shared_bytes, stream>>>(p);
    if (const cudaError_t error = cudaGetLastError(); error != cudaSuccess) {
      return CudaStatus(error, "PagedAttentionPartitionKernel");
    }
    if (p.max_partitions > 1) {
      PagedAttentionMergeKernel<kHeadDim>
          <<<dim3(p.num_heads, p.num_tokens), kHeadDim, 0, stream>>>(p);
    }
  });
  return CudaStatus(cudaGetLastError(), "PagedAttentionMergeKernel");
}

}  // namespace tandem::kernels::cuda
