// Scalar reference implementations of every Backend operator.
//
// Straight loops with double accumulation, written for obviousness rather than speed: the CPU
// and CUDA backends are tested against these. Shapes and meanings are those of
// tandem/kernels/backend.h; the only difference is that Linear takes W unpacked.
#pragma once

#include <cstdint>

#include "tandem/kernels/backend.h"

namespace tandem::kernels::reference {

// y[m, n] = x[m, k] * w[n, k]^T (+ bias[n]); w holds elements of w_dtype.
void Linear(const float* x, int m, const void* w, DType w_dtype, int n, int k, const float* bias,
            float* y);

void RmsNorm(const float* x, const float* weight, float eps, int rows, int dim, float* y);

void AddRmsNorm(float* residual, const float* x, const float* weight, float eps, int rows, int dim,
                float* y);

// The angle of pair i at position p is float(p) * inv_freq[i] rounded to float, as Hugging Face
// computes it; cos and sin are then taken in double.
void Rope(float* x, const int32_t* positions, int tokens, int heads, int head_dim,
          const float* inv_freq);

void SiluMul(const float* gate_up, int rows, int inter, float* out);

void Embedding(const void* table, DType table_dtype, const int32_t* ids, int tokens, int dim,
               float* out);

// Tokens whose slot is negative are padding and are not stored.
void WriteKv(const float* k, const float* v, const int32_t* slot_mapping, int tokens,
             const KvLayout& layout, void* layer_cache);

// out[i, :] = a[rows[i], :] + b[rows[i], :].
void GatherAdd(const float* a, const float* b, const int32_t* rows, int num_rows, int dim,
               float* out);

// Two-pass softmax over all visible keys, in double.
void PagedAttention(const float* q, const void* layer_cache, const KvLayout& layout,
                    const PagedAttentionBatch& batch, int num_heads, float scale, float* out);

}  // namespace tandem::kernels::reference
