// The operator interface every compute backend implements (CPU today, CUDA beside it).
//
// All tensors are dense row-major fp32 unless a comment says otherwise; every pointer
// comment states the shape. Pointers never own: the caller owns every buffer, and a
// backend never allocates on the forward path, except inside PackWeight.
//
//   TANDEM_ASSIGN_OR_RETURN(auto backend, CreateCpuBackend({.num_threads = 2}));
//   auto w = backend->PackWeight(weights.data(), /*n=*/4096, /*k=*/4096);
//   backend->Linear(x, m, *w, /*bias=*/nullptr, y);
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tandem::kernels {

// Shape of one layer's paged KV cache: [2 (K,V)][num_blocks][block_size][num_kv_heads][head_dim].
struct KvLayout {
  int num_blocks = 0;
  int block_size = 16;
  int num_kv_heads = 0;
  int head_dim = 0;

  // Floats in one of the K or V halves of a layer.
  int64_t HalfElements() const {
    return static_cast<int64_t>(num_blocks) * block_size * num_kv_heads * head_dim;
  }
  int64_t LayerElements() const { return 2 * HalfElements(); }
};

// The sequences of one attention call. Arrays are host memory owned by the caller.
// Query rows of sequence s are rows query_start[s] .. query_start[s+1]-1 of q; they are the
// last q_len tokens of a context of context_len[s] tokens, so row r of sequence s sits at
// position context_len[s] - q_len + r and attends causally to positions 0..that position.
struct PagedAttentionBatch {
  int num_seqs = 0;
  const int32_t* query_start = nullptr;  // [num_seqs + 1]
  const int32_t* context_len = nullptr;  // [num_seqs]
  const int32_t* block_table =
      nullptr;  // [num_seqs, max_blocks_per_seq]: logical -> physical block
  int max_blocks_per_seq = 0;
};

// Rotary embedding settings (HF `rope_theta`, `rope_scaling` of type "llama3").
struct RopeConfig {
  int head_dim = 0;
  float theta = 10000.0f;
  bool llama3_scaling = false;
  float factor = 8.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  int original_max_position = 8192;
};

// Inverse frequencies [head_dim / 2] for RopeConfig, with llama3 scaling applied.
std::vector<float> RopeInverseFrequencies(const RopeConfig& config);

// A weight matrix W[n, k] repacked into a backend's preferred layout. Opaque to callers.
class PackedWeight {
 public:
  virtual ~PackedWeight() = default;
  int n() const { return n_; }
  int k() const { return k_; }

 protected:
  PackedWeight(int n, int k) : n_(n), k_(k) {}

 private:
  int n_;
  int k_;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  // Copies W[n, k] (row-major, the Hugging Face nn.Linear layout) into the backend's layout.
  virtual std::unique_ptr<PackedWeight> PackWeight(const float* w, int n, int k) = 0;

  // y[m, n] = x[m, k] * W^T (+ bias[n] when bias is not null).
  // Batch invariant: row i of y is bitwise the same whatever m is and whatever the other rows hold.
  virtual void Linear(const float* x, int m, const PackedWeight& w, const float* bias,
                      float* y) = 0;

  // y[r, :] = x[r, :] / rms(x[r, :]) * weight. x and y may alias.
  virtual void RmsNorm(const float* x, const float* weight, float eps, int rows, int dim,
                       float* y) = 0;

  // residual[r, :] += x[r, :]; then y[r, :] = RmsNorm(residual[r, :]).
  virtual void AddRmsNorm(float* residual, const float* x, const float* weight, float eps, int rows,
                          int dim, float* y) = 0;

  // Rotates x [tokens, heads, head_dim] in place, HF "rotate_half" layout (pairs i, i + d/2).
  // inv_freq: [head_dim / 2] from RopeInverseFrequencies. positions: [tokens].
  virtual void Rope(float* x, const int32_t* positions, int tokens, int heads, int head_dim,
                    const float* inv_freq) = 0;

  // out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]; gate_up: [rows, 2 * inter].
  virtual void SiluMul(const float* gate_up, int rows, int inter, float* out) = 0;

  // out[t, :] = table[ids[t], :]; table: [vocab, dim]. ids are validated by the caller.
  virtual void Embedding(const float* table, const int32_t* ids, int tokens, int dim,
                         float* out) = 0;

  // Stores k, v [tokens, num_kv_heads, head_dim] into the layer cache at the flat slots
  // slot_mapping[t] = block * block_size + offset; a negative slot marks a padding token, which
  // is not stored. layer_cache: [2][num_blocks][block_size][num_kv_heads][head_dim].
  virtual void WriteKv(const float* k, const float* v, const int32_t* slot_mapping, int tokens,
                       const KvLayout& layout, float* layer_cache) = 0;

  // Causal attention of q [tokens, num_heads, head_dim] over the paged cache; grouped-query:
  // head h reads KV head h / (num_heads / num_kv_heads). out: [tokens, num_heads, head_dim].
  virtual void PagedAttention(const float* q, const float* layer_cache, const KvLayout& layout,
                              const PagedAttentionBatch& batch, int num_heads, float scale,
                              float* out) = 0;
};

// Instruction sets the CPU backend carries code for. Results are bitwise reproducible for one
// instruction set on one machine; different instruction sets may differ in the last bits.
enum class CpuIsa { kAuto, kPortable, kAvx2, kAvx512 };

struct CpuBackendOptions {
  int num_threads = 0;         // 0: one per available core
  CpuIsa isa = CpuIsa::kAuto;  // kAuto: the widest this CPU supports; others fail if unsupported
};

// The CPU backend: fp32, vectorised, multi-threaded, batch invariant.
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const CpuBackendOptions& options);

}  // namespace tandem::kernels
