// The tensor-core prefill attention kernel; see flash_attention.cuh for the design and
// mma_layout.h for the fragment layouts the code below relies on.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/element_types.cuh"
#include "kernels/src/cuda/flash_attention.cuh"
#include "kernels/src/cuda/mma.cuh"
#include "kernels/src/cuda/mma_layout.h"
#include "kernels/src/cuda/search.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kWarps = kFlashThreads / 32;
static_assert(kWarps * 16 == kFlashTileRows, "each warp owns 16 query rows");
static_assert(kFlashTileKeys % 16 == 0);
// The Q tile is staged in v_s (kFlashTileKeys rows) before the first V tile.
static_assert(kFlashTileRows <= kFlashTileKeys, "the Q tile must fit v_s");
constexpr float kLog2e = 1.4426950408889634f;

// --- Shared-memory movement ---------------------------------------------------------------------

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 matrices of 16-bit elements; `row` is this lane's row address (see mma_layout.h).
__device__ __forceinline__ void Ldmatrix(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(row))
               : "memory");
}
__device__ __forceinline__ void LdmatrixTrans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(row))
               : "memory");
}

// 16 bytes global -> shared without passing through registers (both 16-byte aligned).
__device__ __forceinline__ void CpAsync16(void* shared, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SharedAddress(shared)),
               "l"(global)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ float Exp2(float x) {  // exp2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Max (sum) over the 4 lanes of a quad, which hold the same two rows of a C fragment.
__device__ __forceinline__ float QuadMax(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float QuadSum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// --- The kernel ---------------------------------------------------------------------------------

// grid (num_heads, flash_tiles), kFlashThreads threads; see flash_attention.cuh.
template <int kHeadDim, typename Elem>
__global__ void __launch_bounds__(kFlashThreads) FlashPrefillKernel(const PagedAttentionParams p) {
  using Ops = Mma16<Elem>;
  // Shared rows are padded by 16 bytes: the 8 row addresses of an ldmatrix matrix then start
  // 4 banks apart (stride (kHeadDim + 8) * 2 bytes = 4 mod 32 words), so its 8 x 16 bytes hit
  // all 32 banks once; cp.async stores of 16 bytes stay aligned.
  constexpr int kStride = kHeadDim + 8;
  constexpr int kChunks = kHeadDim / 8;   // 16-byte pieces of a K or V row
  constexpr int kDimSteps = kHeadDim / 16;  // k-steps of S = Q K^T
  constexpr int kKeySteps = kFlashTileKeys / 16;  // k-steps of O += P V
  constexpr int kKeyTiles8 = kFlashTileKeys / 8;  // n-tiles of S
  constexpr int kDimTiles8 = kHeadDim / 8;        // n-tiles of O
  __shared__ alignas(16) Elem k_s[kFlashTileKeys * kStride];
  __shared__ alignas(16) Elem v_s[kFlashTileKeys * kStride];  // first the Q tile

  // Which tile: largest sequence s with flash_tile_start[s] <= tile (sequences the kernel does
  // not serve have no tiles, so they share their start with the next and are passed over).
  const int head = blockIdx.x;
  const int tile = p.flash_tiles - 1 - static_cast<int>(blockIdx.y);
  const int seq = LastAtMost(p.flash_tile_start, p.num_seqs, tile);
  const int q_begin = p.query_start[seq];
  const int q_len = p.query_start[seq + 1] - q_begin;
  const int row0 = (tile - p.flash_tile_start[seq]) * kFlashTileRows;  // within the sequence
  const int rows = min(kFlashTileRows, q_len - row0);
  // Row r of the tile (sequence row row0 + r) sees keys [0, first_limit + r).
  const int first_limit = p.context_len[seq] - q_len + row0 + 1;
  const int kv_end = first_limit + rows - 1;  // what the tile's last row sees
  const int key_tiles = (kv_end + kFlashTileKeys - 1) / kFlashTileKeys;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int32_t* table = p.block_table + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  const auto* k_cache = static_cast<const Elem*>(p.k_cache);
  const auto* v_cache = static_cast<const Elem*>(p.v_cache);

  // Keys [key0, key0 + kFlashTileKeys) of `cache` into `dst` with cp.async, through the block
  // table; keys at or past kv_end are stored as zeros (their slots may be another sequence's
  // or unwritten; zeros keep 0 * V finite). The caller commits.
  auto load_tile = [&](const Elem* cache, Elem* dst, int key0) {
#pragma unroll
    for (int i = 0; i < kFlashTileKeys * kChunks / kFlashThreads; ++i) {
      const int c = threadIdx.x + i * kFlashThreads;
      const int r = c / kChunks;
      const int chunk = c % kChunks;
      const int key = key0 + r;
      Elem* d = dst + r * kStride + chunk * 8;
      if (key < kv_end) {
        const int64_t slot =
            static_cast<int64_t>(table[key / p.block_size]) * p.block_size + key % p.block_size;
        CpAsync16(d, cache + (slot * p.num_kv_heads + kv_head) * kHeadDim + chunk * 8);
      } else {
        *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
      }
    }
  };

  load_tile(k_cache, k_s, 0);  // kv_end >= 1: there is always a first key tile
  CpAsyncCommit();

  // The Q tile, rounded to Elem, into v_s (rows past the sequence are zeros), then each warp's
  // 16 rows into A fragments: q_frag[s] covers head dims [16 s, 16 s + 16).
  {
    constexpr int kQuads = kHeadDim / 4;
    for (int c = threadIdx.x; c < kFlashTileRows * kQuads; c += kFlashThreads) {
      const int r = c / kQuads;
      const int d = (c % kQuads) * 4;
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (r < rows) {
        v = *reinterpret_cast<const float4*>(
            p.q + (static_cast<int64_t>(q_begin + row0 + r) * p.num_heads + head) * kHeadDim + d);
      }
      *reinterpret_cast<uint2*>(v_s + r * kStride + d) =
          make_uint2(Ops::Pack(v.x, v.y), Ops::Pack(v.z, v.w));
    }
  }
  __syncthreads();
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  uint32_t q_frag[kDimSteps][4];
  {
    const mma::Coord at = mma::LdmatrixA(lane);
#pragma unroll
    for (int s = 0; s < kDimSteps; ++s) {
      Ldmatrix(q_frag[s], v_s + (warp * 16 + at.row) * kStride + s * 16 + at.col);
    }
  }
  __syncthreads();  // v_s is V's from here on

  // This thread's two rows of the warp's 16 (C fragment rows g and g + 8) and their limits.
  const mma::Coord c0 = mma::CElement(lane, 0);  // {g, 2t}
  const int limit_lo = first_limit + warp * 16 + c0.row;
  const int limit_hi = limit_lo + 8;
  const float scale_log2 = p.scale * kLog2e;
  float o[kDimTiles8][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY};  // of the log2-domain scores seen so far
  float row_sum[2] = {0.0f, 0.0f};            // this lane's part: its columns only

  const mma::Coord k_at = mma::LdmatrixBFromNk(lane);
  const mma::Coord v_at = mma::LdmatrixBFromKnTrans(lane);
  for (int j = 0; j < key_tiles; ++j) {
    const int key0 = j * kFlashTileKeys;
    load_tile(v_cache, v_s, key0);
    CpAsyncCommit();
    CpAsyncWait<1>();  // K of this tile (V may still be in flight)
    __syncthreads();

    // S = Q K^T: s[n] is the C fragment of keys key0 + [8 n, 8 n + 8).
    float s[kKeyTiles8][4] = {};
#pragma unroll
    for (int d = 0; d < kDimSteps; ++d) {
#pragma unroll
      for (int n = 0; n < kKeyTiles8; n += 2) {
        uint32_t b[4];
        Ldmatrix(b, k_s + (n * 8 + k_at.row) * kStride + d * 16 + k_at.col);
        Ops::Mma(s[n], q_frag[d], b[0], b[1]);
        Ops::Mma(s[n + 1], q_frag[d], b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with k_s: fetch the next tile's K behind the softmax
    if (j + 1 < key_tiles) load_tile(k_cache, k_s, key0 + kFlashTileKeys);
    CpAsyncCommit();  // possibly empty: the wait below always leaves exactly one group behind

    // Scale into the log2 domain; on tiles reaching past the first row's limit, mask the keys
    // each row does not see (keys at or past kv_end are among them for every written row).
    const bool diagonal = key0 + kFlashTileKeys > first_limit;
#pragma unroll
    for (int n = 0; n < kKeyTiles8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const mma::Coord at = mma::CElement(lane, e);
        float v = s[n][e] * scale_log2;
        if (diagonal && key0 + n * 8 + at.col >= (e < 2 ? limit_lo : limit_hi)) v = -INFINITY;
        s[n][e] = v;
      }
    }

    // Online softmax for the two rows (e < 2: row g; else row g + 8).
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kKeyTiles8; ++n) {
      tile_max[0] = fmaxf(tile_max[0], fmaxf(s[n][0], s[n][1]));
      tile_max[1] = fmaxf(tile_max[1], fmaxf(s[n][2], s[n][3]));
    }
    float base[2], alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m = fmaxf(row_max[h], QuadMax(tile_max[h]));
      // A row with no visible key yet (never a written row past the first tile) keeps 0s.
      base[h] = m == -INFINITY ? 0.0f : m;
      alpha[h] = Exp2(row_max[h] - base[h]);
      row_max[h] = m;
    }
    // P = exp2(S - max), rounded to Elem, packed straight into A fragments of O += P V:
    // p_frag[k] covers keys key0 + [16 k, 16 k + 16) (mma::AFromD).
    uint32_t p_frag[kKeySteps][4];
    float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int k = 0; k < kKeySteps; ++k) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const mma::DSource from = mma::AFromD(r);
        const float* c = s[2 * k + from.tile];
        const int h = from.index >> 1;  // index 0: row g; 2: row g + 8
        const uint32_t packed =
            Ops::Pack(Exp2(c[from.index] - base[h]), Exp2(c[from.index + 1] - base[h]));
        p_frag[k][r] = packed;
        const float2 rounded = Ops::Unpack(packed);
        tile_sum[h] += rounded.x + rounded.y;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) row_sum[h] = row_sum[h] * alpha[h] + tile_sum[h];
#pragma unroll
    for (int n = 0; n < kDimTiles8; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }

    CpAsyncWait<1>();  // V of this tile (the next K may still be in flight)
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kKeySteps; ++k) {
#pragma unroll
      for (int n = 0; n < kDimTiles8; n += 2) {
        uint32_t b[4];
        LdmatrixTrans(b, v_s + (k * 16 + v_at.row) * kStride + n * 8 + v_at.col);
        Ops::Mma(o[n], p_frag[k], b[0], b[1]);
        Ops::Mma(o[n + 1], p_frag[k], b[2], b[3]);
      }
    }
    __syncthreads();  // every warp is done with v_s before the next tile's V lands there
  }

  // O / row sum (summed over the quad's columns) for the rows inside the sequence.
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) inv[h] = 1.0f / QuadSum(row_sum[h]);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + c0.row + 8 * h;
    if (r >= rows) continue;
    const int64_t first =
        (static_cast<int64_t>(q_begin + row0 + r) * p.num_heads + head) * kHeadDim + c0.col;
    if (p.out_dtype == DType::kF32) {
      float* out = static_cast<float*>(p.out) + first;
#pragma unroll
      for (int n = 0; n < kDimTiles8; ++n) {
        *reinterpret_cast<float2*>(out + n * 8) =
            make_float2(o[n][2 * h] * inv[h], o[n][2 * h + 1] * inv[h]);
      }
    } else {
#pragma unroll
      for (int n = 0; n < kDimTiles8; ++n) {
        StoreActivation(p.out, p.out_dtype, first + n * 8, o[n][2 * h] * inv[h]);
        StoreActivation(p.out, p.out_dtype, first + n * 8 + 1, o[n][2 * h + 1] * inv[h]);
      }
    }
  }
}

}  // namespace

absl::Status LaunchFlashPrefill(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.flash_tiles <= 0) return absl::OkStatus();
  if (!FlashPrefillSupports(p)) {
    return absl::InvalidArgumentError(
        "FlashPrefill: needs a bf16 or fp16 cache, head_dim 64 or 128, aligned pointers");
  }
  if (p.flash_tiles > 65535 || p.flash_tile_start == nullptr) {
    return absl::InvalidArgumentError("FlashPrefill: bad tile list");
  }
  TANDEM_DISPATCH_HEAD_DIM(p.head_dim, kHeadDim, {
    void (*kernel)(const PagedAttentionParams) = p.cache_dtype == DType::kBF16
                                                     ? &FlashPrefillKernel<kHeadDim, __nv_bfloat16>
                                                     : &FlashPrefillKernel<kHeadDim, __half>;
    kernel<<<dim3(p.num_heads, p.flash_tiles), kFlashThreads, 0, stream>>>(p);
  });
  return CudaStatus(cudaGetLastError(), "FlashPrefillKernel");
}

}  // namespace tandem::kernels::cuda
