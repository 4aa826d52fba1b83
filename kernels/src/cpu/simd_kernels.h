// The vectorised inner loops of the CPU backend, compiled once per instruction set.
//
// simd_kernels.cc compiles simd_kernels.inc four times (portable, AVX2+FMA, AVX-512, AVX-512 with
// BF16) under `#pragma GCC target`, so one binary carries them all and runs on a CPU with none of
// the extensions; CpuKernelTableFor picks a table at backend creation. Every function here is a
// single-threaded piece of an operator; cpu_backend.cc splits operators into such pieces and
// runs them on its thread pool.
//
// Results are bitwise reproducible on one machine: each output's floating-point reduction order
// depends only on the operator's shape, never on the piece it falls in, the thread running it
// or the other rows in the batch. Different instruction sets may differ in the last bits.
#pragma once

#include <cstdint>

#include "tandem/kernels/backend.h"

namespace tandem::kernels::cpu {

// One Linear call. W is packed in panels of `panel_width` columns: w[p][kk][c] holds
// W[p * panel_width + c, kk], zero past n, as elements of w_dtype (kF32, kBF16 or kF16), which
// the micro-kernel widens to fp32 in registers.
//
// Quantised W (quant != kNone) keeps its integers in the panels, widened and scaled in
// registers: kInt8 as int8 [panels][k][panel_width]; kInt4 as bytes [panels][k][panel_width / 2]
// whose byte c holds column c in its low nibble and column c + panel_width / 2 in its high one.
// Per panel, `scales` and (kInt4) `zeros` hold [groups][panel_width] floats, group g covering
// columns [group_starts[g], group_starts[g + 1]), and column kk of the panels is input feature
// k_order[kk] of x (k_order null: kk).
struct GemmArgs {
  const float* x = nullptr;     // [m, k]
  const void* w = nullptr;      // [ceil(n / panel_width), k, panel_width] of w_dtype
  DType w_dtype = DType::kF32;
  WeightQuant quant = WeightQuant::kNone;
  const float* scales = nullptr;     // [ceil(n / panel_width), groups, panel_width]
  const float* zeros = nullptr;      // kInt4, or kInt8 in units (all 128): as scales; else null
  const int32_t* k_order = nullptr;  // [k] or null
  const int32_t* group_starts = nullptr;  // quantised: [groups + 1], from 0 to k
  int groups = 0;
  // Non-zero: kInt4 or kInt8 packed in units of kQuantUnitK k steps for vpdpbusd (see
  // ByteDotMicroKernel in simd_kernels.inc), [ceil(n / panel_width)][ceil(units_k / 8)]
  // [panel_width * 4] bytes (kInt8: [panel_width * 8]) over units_k packed k steps, each group
  // starting at a multiple of 8 (group_starts counts packed steps); packed step kk is input
  // k_order[kk] of x, -1 for a step of zeros between groups (k_order null: kk, and
  // units_k == k).
  int units_k = 0;
  // units_k non-zero: per row of x, the scale of its byte levels (GemmPanelsByteDot), the row's
  // largest |x| over 127 (0 for a row of zeros; NaN where x holds a NaN or an infinity, so that
  // its outputs are NaN). See RowLevelScales.
  const float* x_scales = nullptr;

  const float* bias = nullptr;  // [n] or null
  float* y = nullptr;           // [m, n]
  int m = 0;
  int n = 0;
  int k = 0;
};

// The query rows of one sequence in a PagedAttention call.
struct AttentionSequence {
  const float* q = nullptr;              // [tokens, num_heads, head_dim], whole batch
  // Both [num_blocks, block_size, num_kv_heads, head_dim] of cache_dtype.
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  DType cache_dtype = DType::kF32;
  float k_scale = 1.0f;  // 8-bit caches: stored * scale is the value
  float v_scale = 1.0f;
  const int32_t* block_table = nullptr;  // [ceil(context_len / block_size)], this sequence's
  float* out = nullptr;                  // [tokens, num_heads, head_dim], whole batch
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  int first_token = 0;  // row of q holding this sequence's first query
  int q_len = 0;
  int context_len = 0;
  float scale = 1.0f;
};

struct CpuKernelTable {
  const char* name;
  // Columns per packed weight panel (two vector registers).
  int panel_width;
  // Whether bf16 W is packed in k pairs, w[p][kk / 2][c][kk % 2], for vdpbf16ps; else as every
  // dtype, w[p][kk][c].
  bool bf16_pairs;
  // Whether Linear of bf16 W rounds x to bf16 first (Backend::LinearRoundsX).
  bool rounds_x;
  // Whether int4 and int8 W are packed in units (GemmArgs::units_k).
  bool quant_units;
  // Floats of per-thread scratch that gemm_panels needs.
  int64_t gemm_scratch_floats;

  // y[:, columns of panels [panel_begin, panel_end)] of the GEMM. scratch: gemm_scratch_floats.
  // x_packed: an earlier call for the same args (another chunk of the same GEMM) ran on this
  // scratch, with nothing else between, so x as packed there may be used again: decode rows are
  // then packed once per thread per GEMM rather than once per chunk.
  void (*gemm_panels)(const GemmArgs& args, int64_t panel_begin, int64_t panel_end, float* scratch,
                      bool x_packed);
  // x_scales[i] for rows [0, rows) of x (row stride k), as GemmArgs::x_scales describes.
  void (*row_level_scales)(const float* x, int64_t rows, int k, float* x_scales);
  // Panels gemm_panels takes in one micro-kernel call for an x of m rows and weights of `quant`:
  // a chunk of panels given to one thread should be a multiple of it.
  int (*panels_per_call)(int m, WeightQuant quant);
  // RmsNorm / AddRmsNorm of `rows` rows of `dim`; row pointers already offset by the caller.
  void (*rms_norm_rows)(const float* x, const float* weight, float eps, int64_t rows, int dim,
                        float* y);
  void (*add_rms_norm_rows)(float* residual, const float* x, const float* weight, float eps,
                            int64_t rows, int dim, float* y);
  void (*silu_mul_rows)(const float* gate_up, int64_t rows, int inter, float* out);
  // Rope of `tokens` tokens [tokens, heads, head_dim]; head_dim <= kMaxRopeHeadDim.
  void (*rope_tokens)(float* x, const int32_t* positions, int64_t tokens, int heads, int head_dim,
                      const float* inv_freq);
  // Attention of query rows [row_begin, row_end) of `seq`, for the query heads of `kv_head`.
  // scratch: AttentionScratchFloats(rows * group, head_dim) floats.
  void (*attention_tile)(const AttentionSequence& seq, int kv_head, int row_begin, int row_end,
                         float* scratch);
};

// k steps per unit of int4 and int8 W packed for vpdpbusd (GemmArgs::units_k).
inline constexpr int kQuantUnitK = 8;

inline constexpr int kMaxRopeHeadDim = 1024;
inline constexpr int kMaxAttentionBlockSize = 1024;
// Keys of a non-fp32 cache widened to fp32 at a time (into scratch) by attention_tile.
inline constexpr int kAttentionDecodeKeys = 32;

// Per-thread scratch of attention_tile for `vectors` query vectors of `head_dim`.
inline int64_t AttentionScratchFloats(int64_t vectors, int head_dim) {
  const int64_t padded = ((head_dim + 15) / 16) * 16;
  // Running state per query vector: output accumulator padded to 16 floats, max, sum; then the
  // widened K and V of kAttentionDecodeKeys keys.
  return vectors * (padded + 2) + kMaxAttentionBlockSize + 16 +
         2 * int64_t{kAttentionDecodeKeys} * padded;
}

// The 256 values of an 8-bit float format (kF8E4M3 or kF8E5M2), indexed by its bits.
const float* Fp8Values(DType dtype);

// Whether this CPU (and OS) can run code for `isa`. kAuto is always supported.
bool CpuSupports(CpuIsa isa);

// The kernels for `isa`; kAuto resolves to the widest supported one. Null if unsupported.
const CpuKernelTable* CpuKernelTableFor(CpuIsa isa);

}  // namespace tandem::kernels::cpu
