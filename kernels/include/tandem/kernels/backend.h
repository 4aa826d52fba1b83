// The operator interface every compute backend implements (CPU and CUDA).
//
// All tensors are dense row-major fp32 unless a comment says otherwise; every pointer
// comment states the shape. Weights may be held as bf16 or fp16 (PackWeight) and the KV cache
// as bf16, fp16 or 8-bit floats (KvLayout::dtype); activations are fp32 and every operator
// accumulates in fp32 (or wider). Pointers never own: the caller owns every buffer, and a
// backend never allocates on the forward path, except inside PackWeight.
//
// Operator tensors live in the backend's memory: host memory for the CPU backend, device
// memory for CUDA. `Allocate` hands out such memory and the Copy* methods move bytes in and
// out of it, so one caller (the engine's ModelRunner) runs unchanged on either backend; on the
// CPU backend the copies are memcpy and Synchronize does nothing.
//
//   TANDEM_ASSIGN_OR_RETURN(auto backend, CreateCpuBackend({.num_threads = 2}));
//   auto w = backend->PackWeight(bf16_weights.data(), DType::kBF16, /*n=*/4096, /*k=*/4096);
//   TANDEM_ASSIGN_OR_RETURN(DeviceBuffer x, backend->Allocate(m * 4096 * sizeof(float)));
//   TANDEM_ASSIGN_OR_RETURN(DeviceBuffer y, backend->Allocate(m * 4096 * sizeof(float)));
//   backend->CopyToDevice(x.data(), host_x.data(), x.bytes());
//   backend->Linear(x.as<float>(), m, *w, /*bias=*/nullptr, y.as<float>());
//   backend->CopyToHost(host_y.data(), y.data(), y.bytes());
//   TANDEM_RETURN_IF_ERROR(backend->Synchronize());
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/base/half.h"
#include "tandem/base/rope_config.h"

namespace tandem::kernels {

// Shape of one layer's paged KV cache: [2 (K,V)][num_blocks][block_size][num_kv_heads][head_dim]
// elements of `dtype`.
struct KvLayout {
  int num_blocks = 0;
  int block_size = 16;
  int num_kv_heads = 0;
  int head_dim = 0;
  // kF32, kF16, kBF16, kF8E4M3 or kF8E5M2.
  DType dtype = DType::kF32;
  // 8-bit caches only (the others ignore them): an element stores value / scale and reads back
  // as stored * scale, so a layer whose K or V exceed the format's range still fits (vLLM's
  // per-layer k_scale / v_scale).
  float k_scale = 1.0f;
  float v_scale = 1.0f;

  // Elements in one of the K or V halves of a layer.
  int64_t HalfElements() const {
    return static_cast<int64_t>(num_blocks) * block_size * num_kv_heads * head_dim;
  }
  int64_t LayerElements() const { return 2 * HalfElements(); }
  int64_t HalfBytes() const { return HalfElements() * DTypeSize(dtype); }
  int64_t LayerBytes() const { return 2 * HalfBytes(); }
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

  // A batch known only by its shape, as a captured step graph replays it (Backend::CaptureGraph):
  // the three arrays above already in operator memory (uploaded by the caller), whose values may
  // change between replays within the bounds below. When `on_device` is set, a backend reads
  // these arrays only from the device pointers (the host ones may be null), and what it queues
  // depends on num_seqs, num_tokens, max_query_len, max_context_len and max_blocks_per_seq
  // alone. A sequence may then have no query row (query_start[s] == query_start[s + 1]).
  bool on_device = false;
  const int32_t* device_query_start = nullptr;
  const int32_t* device_context_len = nullptr;
  const int32_t* device_block_table = nullptr;
  int num_tokens = 0;       // = query_start[num_seqs]
  int max_query_len = 0;    // >= every sequence's query rows
  int max_context_len = 0;  // >= every context_len, <= max_blocks_per_seq * block_size
};

// OK when sequence s of `batch` (read through its host arrays) has no more query rows than
// context tokens, so that every row sees a key, and a context that fits its block-table row of
// `block_size`-key blocks; else InvalidArgument naming them. Every backend's PagedAttention
// holds its batches to this.
absl::Status CheckAttentionSequence(const PagedAttentionBatch& batch, int s, int block_size);

// Rotary embedding settings (HF `rope_theta`, `rope_scaling` of type "llama3").
using ::tandem::RopeConfig;

// Inverse frequencies [head_dim / 2] for RopeConfig, with llama3 scaling applied.
std::vector<float> RopeInverseFrequencies(const RopeConfig& config);

// One row of Backend::SampleRows: a sequence's sampling settings, reduced to what one draw needs.
// The layout is the same in host and device code (uploaded as bytes).
struct SampleRowParams {
  double uniform = 0;          // the row's draw, in [0, 1); greedy rows ignore it
  float temperature = 0;       // 0: greedy (the argmax, ties to the lowest id)
  float top_p = 1;             // in (0, 1]
  float min_p = 0;             // in [0, 1]
  int32_t top_k = 0;           // <= 0 or >= vocab: off
  int32_t num_logprobs = -1;   // -1: none; 0: the chosen token's; k > 0: and the k most likely
  int32_t edits_begin = 0;     // the row's logit edits: edits[edits_begin, edits_end)
  int32_t edits_end = 0;
};

// A change to one token's logit before a draw, applied as: -inf when `mask` (min_tokens holding
// back EOS and stop ids); then the repetition penalty when `repetition` != 1 (l / r for l > 0,
// else l * r); then l -= subtract (frequency * count + presence); then l += bias (logit_bias).
// A row's edits name each token at most once.
struct LogitEdit {
  int32_t token = 0;
  int32_t mask = 0;
  float repetition = 1;
  float subtract = 0;
  float bias = 0;
};

// The most log-probabilities besides the chosen token's SampleRows returns per row.
inline constexpr int kMaxSampleLogprobs = 20;

// A token and its log-probability under the model's own (unedited) distribution.
struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0;
};

// How a weight matrix's elements are stored: as floats of its dtype, or as integers with scales
// (weight-only quantisation; activations and sums stay fp32).
enum class WeightQuant {
  kNone,
  // W8A16: int8 values, one fp32 scale per output row (symmetric: W = q * scale).
  kInt8,
  // W4A16: 4-bit values 0..15 with a scale and an integer zero point per output row and group of
  // group_size inputs: W = (q - zero) * scale (AWQ and GPTQ checkpoints).
  kInt4,
};

// A quantised W[n, k] in the one unpacked form every backend packs from (host memory, owned by
// the caller); the engine converts each checkpoint layout (compressed-tensors int8, AWQ, GPTQ)
// to it. Column j of `values` holds input feature k_order[j] (k_order null: feature j), so a
// GPTQ act-order matrix, whose groups are scattered over the inputs, has each group's columns
// side by side: group g is columns [g * group_size, (g + 1) * group_size). A tensor-parallel
// rank's share of the inputs of such a layer holds its part of each group, of any size: then
// `group_starts` gives the groups' bounds instead, group g being columns
// [group_starts[g], group_starts[g + 1]).
struct QuantizedWeightView {
  WeightQuant quant = WeightQuant::kInt8;
  int n = 0;
  int k = 0;
  int group_size = 0;                // divides k; kInt8: k (one scale per row)
  const int8_t* values = nullptr;    // [n, k]: kInt8 -128..127, kInt4 0..15
  const float* scales = nullptr;     // [n, k / group_size]
  const int8_t* zeros = nullptr;     // kInt4: [n, k / group_size], 0..16; kInt8: null
  const int32_t* k_order = nullptr;  // [k], a permutation of 0..k-1, or null
  // kInt4 only: [num_groups + 1], 0 = group_starts[0] < ... < group_starts[num_groups] = k, or
  // null (groups of group_size, which is then ignored).
  const int32_t* group_starts = nullptr;
  int num_groups = 0;

  int groups() const {
    if (group_starts != nullptr) return num_groups;
    return group_size > 0 ? k / group_size : 0;
  }
};

// The first column of each group of `w` and then k: [groups() + 1] (w.group_starts' values, or
// multiples of w.group_size).
std::vector<int32_t> GroupStarts(const QuantizedWeightView& w);

// Checks a QuantizedWeightView's shape, group size, value ranges and k_order.
absl::Status ValidateQuantizedWeight(const QuantizedWeightView& w);

// W[n, k] as fp32 in input-feature order: element (r, k_order[j]) is (values[r, j] -
// zeros[r, j / group_size]) * scales[r, j / group_size], the integer difference converted
// exactly and multiplied once in fp32. These are the values every backend's Linear multiplies
// by.
std::vector<float> DequantizeWeight(const QuantizedWeightView& w);

// A weight matrix W[n, k] repacked into a backend's preferred layout, its elements still of
// the dtype it was packed from (or quantised: quant() != kNone, dtype() kI8). Opaque to callers.
class PackedWeight {
 public:
  virtual ~PackedWeight() = default;
  int n() const { return n_; }
  int k() const { return k_; }
  DType dtype() const { return dtype_; }
  WeightQuant quant() const { return quant_; }

 protected:
  PackedWeight(int n, int k, DType dtype, WeightQuant quant = WeightQuant::kNone)
      : n_(n), k_(k), dtype_(dtype), quant_(quant) {}

 private:
  int n_;
  int k_;
  DType dtype_;
  WeightQuant quant_;
};

class Backend;

// Bytes of a backend's operator memory (see Backend::Allocate), or of host memory for its copies
// (Backend::AllocateHostStaging), freed on destruction. Move-only; the backend that allocated it
// must outlive it.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  friend class Backend;
  DeviceBuffer(Backend* owner, void* data, size_t bytes, bool host)
      : owner_(owner), data_(data), bytes_(bytes), host_(host) {}
  void Free();

  Backend* owner_ = nullptr;  // not owned
  void* data_ = nullptr;
  size_t bytes_ = 0;
  bool host_ = false;  // from AllocateHostStaging
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;

  // --- Memory ---------------------------------------------------------------------------------

  // True when operator memory is host memory, which host code may read and write directly (the
  // CPU backend); false for device memory, reached only through the Copy* methods.
  virtual bool host_memory() const = 0;

  // `bytes` of operator memory, uninitialised. For start-up: never called on the forward path.
  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes);

  // `bytes` of host memory (data() is a host pointer), uninitialised, that CopyToHost fills
  // fastest: page-locked for the CUDA backend, whose copies into it then run at the link's full
  // speed without a staging copy; plain memory for the CPU backend. For start-up.
  absl::StatusOr<DeviceBuffer> AllocateHostStaging(size_t bytes);

  // Host -> operator memory, ordered before every operator queued after it. `src` (host) may be
  // reused as soon as this returns.
  virtual void CopyToDevice(void* dst, const void* src, size_t bytes) = 0;

  // Operator memory -> host, ordered after every operator queued before it. `dst` (host) holds
  // the bytes once Synchronize has returned.
  virtual void CopyToHost(void* dst, const void* src, size_t bytes) = 0;

  // Within operator memory: `rows` rows of `row_bytes` each, row r from src + r * src_stride to
  // dst + r * dst_stride (strides in bytes, each >= row_bytes). Source and destination must not
  // overlap.
  virtual void CopyRows(void* dst, size_t dst_stride, const void* src, size_t src_stride,
                        size_t row_bytes, int rows) = 0;

  // Waits for all queued work and returns the first error an operator or copy met since the
  // previous call. The CPU backend runs everything before returning from each call and always
  // returns OK.
  virtual absl::Status Synchronize() = 0;

  // --- Operators ------------------------------------------------------------------------------

  // Copies W[n, k] (row-major, the Hugging Face nn.Linear layout; host memory) of `dtype` (kF32,
  // kF16 or kBF16) into the backend's layout, keeping the dtype: a bf16 weight stays 2 bytes an
  // element.
  virtual std::unique_ptr<PackedWeight> PackWeight(const void* w, DType dtype, int n, int k) = 0;

  // Packs a quantised W (already checked by ValidateQuantizedWeight) into the backend's layout,
  // keeping it quantised: Linear widens each value to fp32 in registers, as
  // (value - zero) * scale, and multiplies by exactly DequantizeWeight's element.
  virtual std::unique_ptr<PackedWeight> PackQuantizedWeight(const QuantizedWeightView& w) = 0;

  // Whether Linear of m rows with W of `w_dtype` rounds x to w_dtype (round to nearest even)
  // before multiplying: the CUDA backend does for 16-bit W past decode sizes, to run prefill on
  // the tensor cores. The products and fp32 accumulation are then exact on the rounded x.
  virtual bool LinearRoundsX(int m, DType w_dtype) const { return false; }
  // Whether Linear with W of `w_dtype` and `quant` carries x as two bf16 halves, hi = bf16(x)
  // and lo = bf16(x - hi) (round to nearest even), whose sum is within 2^-16 of x: the CPU
  // backend's AVX-512 BF16 kernels do (CpuIsa::kAvx512Bf16), for vdpbf16ps. The products and
  // fp32 accumulation are then exact on hi + lo.
  virtual bool LinearSplitsX(DType w_dtype, WeightQuant quant) const { return false; }
  // Whether Linear with W quantised as `quant` carries x as three signed bytes per element, of
  // a scale per row s = max |x| / 127: with t = x (1 / s) in fp32, h = round(t),
  // m = round(254 (t - h)) and l = round(254 (254 (t - h) - m)) (fp32, round to nearest even),
  // x is read as s (h + m / 254 + l / 254^2), within about 2^-22 of the row's largest |x|. The
  // CPU backend's AVX-512 BF16 kernels do for int4 and int8 W (CpuIsa::kAvx512Bf16), for
  // vpdpbusd. The products are then exact on that x, their sums over a group exact in integers,
  // and only combining the levels and groups rounds in fp32.
  virtual bool LinearCarriesXInBytes(WeightQuant quant) const { return false; }

  // y[m, n] = x[m, k] * W^T (+ bias[n] when bias is not null). Whatever W's dtype, each product
  // is of W's exact value (quantised: of DequantizeWeight's value) and accumulates in fp32; x
  // is read exactly too, except where LinearRoundsX says it is first rounded to W's dtype,
  // LinearSplitsX that it is carried as two bf16 halves or LinearCarriesXInBytes that it is
  // carried in three bytes.
  // x_dtype is kF32, or W's own 16-bit dtype (W not quantised): a 16-bit activation its
  // producer already rounded (see ActivationDType), read exactly. Anything else is an error.
  // Batch invariant on the CPU: row i of y is bitwise the same whatever m is and whatever the
  // other rows hold (the CUDA backend's kernels change with m). y must not overlap x (other
  // operators say where theirs may alias).
  virtual void Linear(const void* x, DType x_dtype, int m, const PackedWeight& w,
                      const float* bias, float* y) = 0;

  // Whether LinearAdd takes a Linear of m rows with W. False unless a backend overrides it: the
  // CUDA backend adds past its skinny-GEMM rows with 16-bit W, where cuBLASLt adds y in the
  // GEMM's epilogue (section "Devices" of docs/architecture.md).
  virtual bool LinearAdds(int m, const PackedWeight& w) const { return false; }
  // y[m, n] += x[m, k] * W^T (+ bias[n]): Linear with its result added to what y holds (the
  // residual stream) by the GEMM itself, instead of written out for a later AddRmsNorm to read
  // back and add. Only where LinearAdds(m, w) holds (elsewhere a programming error); x and the
  // products as in Linear.
  virtual void LinearAdd(const void* x, DType x_dtype, int m, const PackedWeight& w,
                         const float* bias, float* y);

  // The dtype in which an operator should store the x of a Linear of m rows with W. kF32 unless
  // a backend overrides it: the CUDA backend answers W's 16-bit dtype where its Linear would
  // round an fp32 x to it anyway (LinearRoundsX; W not quantised), so that the producer's
  // rounding gives the same values with fewer bytes moved (no fp32 copy written, read back and
  // rounded). The CPU backend's kernels read fp32 x, so it keeps kF32.
  virtual DType ActivationDType(int m, const PackedWeight& w) const { return DType::kF32; }
  // The rule above: W's 16-bit dtype where LinearRoundsX(m) and W is not quantised, else kF32.
  DType RoundedActivationDType(int m, const PackedWeight& w) const;

  // y[r, :] = x[r, :] / rms(x[r, :]) * weight, computed in fp32 and stored as y_dtype (kF32,
  // kBF16 or kF16, rounded to nearest even). x and y may alias when y_dtype is kF32.
  virtual void RmsNorm(const float* x, const float* weight, float eps, int rows, int dim,
                       void* y, DType y_dtype) = 0;

  // residual[r, :] += x[r, :]; then y[r, :] = RmsNorm(residual[r, :]), stored as y_dtype.
  virtual void AddRmsNorm(float* residual, const float* x, const float* weight, float eps, int rows,
                          int dim, void* y, DType y_dtype) = 0;

  // Rotates x [tokens, heads, head_dim] in place, HF "rotate_half" layout (pairs i, i + d/2).
  // inv_freq: [head_dim / 2] from RopeInverseFrequencies. positions: [tokens].
  virtual void Rope(float* x, const int32_t* positions, int tokens, int heads, int head_dim,
                    const float* inv_freq) = 0;

  // out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]; gate_up: [rows, 2 * inter]. out is
  // stored as out_dtype (kF32, kBF16 or kF16, rounded to nearest even).
  virtual void SiluMul(const float* gate_up, int rows, int inter, void* out,
                       DType out_dtype) = 0;

  // out[t, :] = table[ids[t], :], widened to fp32; table: [vocab, dim] of table_dtype (kF32,
  // kBF16 or kF16). ids are validated by the caller.
  virtual void Embedding(const void* table, DType table_dtype, const int32_t* ids, int tokens,
                         int dim, float* out) = 0;

  // Stores k, v [tokens, num_kv_heads, head_dim] into the layer cache at the flat slots
  // slot_mapping[t] = block * block_size + offset; a negative slot marks a padding token, which
  // is not stored. layer_cache: [2][num_blocks][block_size][num_kv_heads][head_dim] of
  // layout.dtype; values are rounded to nearest even (8-bit floats: of value / scale,
  // saturating at the format's largest finite value).
  virtual void WriteKv(const float* k, const float* v, const int32_t* slot_mapping, int tokens,
                       const KvLayout& layout, void* layer_cache) = 0;

  // One layer's attention inputs from its fused projection qkv [tokens, q_dim + 2 kv_dim]
  // (q | k | v per row; q_dim = num_heads x layout.head_dim, kv_dim = layout.num_kv_heads x
  // layout.head_dim): each head of q and of k RMS-normed over head_dim by q_norm / k_norm
  // ([head_dim] each; both null: no norm, as for Llama; Qwen3 has them), then rotated by Rope
  // at `positions`; q written to `q` [tokens, q_dim], k and v stored into the layer cache at
  // slot_mapping as WriteKv stores them. By default exactly CopyRows, RmsNorm, Rope and WriteKv
  // in that order, through k and v ([tokens, kv_dim] each, operator memory the backend may use
  // as scratch); the CUDA backend does it all in one kernel, leaving k and v alone.
  virtual void AttentionInputs(const float* qkv, int tokens, int num_heads, const float* q_norm,
                               const float* k_norm, float eps, const int32_t* positions,
                               const float* inv_freq, const int32_t* slot_mapping,
                               const KvLayout& layout, void* layer_cache, float* q, float* k,
                               float* v);

  // Whether PagedAttention rounds the query rows of a sequence of q_len rows, over a cache of
  // `cache_dtype` with `head_dim`, to cache_dtype (round to nearest even) before the scores, and
  // their softmax weights to cache_dtype before weighting V: the CUDA backend does for bf16 and
  // fp16 caches past decode lengths, to run prefill on the tensor cores (for q, out and the
  // cache at least 16-byte aligned, as Allocate gives them). The scores are then exact dot
  // products of the rounded q in fp32; the weights' rounding moves each output by at most about
  // 2 u max |V| (u = 2^-8 for bf16, 2^-11 for fp16) instead of fp32's few ulp. Never for a
  // batch on the device (PagedAttentionBatch::on_device), which is computed exactly.
  virtual bool PagedAttentionRoundsQ(DType cache_dtype, int head_dim, int q_len) const {
    return false;
  }

  // Causal attention of q [tokens, num_heads, head_dim] over the paged cache (of layout.dtype,
  // read as fp32); grouped-query: head h reads KV head h / (num_heads / num_kv_heads).
  // out: [tokens, num_heads, head_dim], stored as out_dtype (kF32, kBF16 or kF16, rounded to
  // nearest even). Exact on q in fp32 arithmetic, except for the sequences where
  // PagedAttentionRoundsQ says otherwise.
  virtual void PagedAttention(const float* q, const void* layer_cache, const KvLayout& layout,
                              const PagedAttentionBatch& batch, int num_heads, float scale,
                              void* out, DType out_dtype) = 0;

  // out[i, :] = a[rows[i], :] + b[rows[i], :] for i < num_rows; a, b: [*, dim]; rows:
  // [num_rows], indices validated by the caller; out: [num_rows, dim].
  virtual void GatherAdd(const float* a, const float* b, const int32_t* rows, int num_rows,
                         int dim, float* out) = 0;

  // Draws one token from each of `rows` rows of logits [rows, vocab] (overwritten as scratch),
  // so that only token ids and log-probabilities leave the backend. Per row, in this order:
  // the log-probabilities of the raw logits (when num_logprobs >= 0); the row's edits; then
  // the argmax (temperature 0), or temperature, top-k, top-p and min-p and a draw by the row's
  // uniform: the candidates in the order of the sort by logit (descending, ties by id) when
  // top-k or top-p truncates, else in id order, each with its softmax probability (exp in double
  // of (logit - max) / temperature, normalised in double, rounded to float); top-p keeps the
  // shortest prefix of that order whose mass reaches top_p; min-p those of at least min_p times
  // the largest; the token is the first whose running mass passes uniform times the kept mass
  // (past the end by rounding: the last kept with any mass). This is the engine's Sampler on a
  // sequence with no grammar and no draft; the CPU backend gives bitwise its results, the CUDA
  // backend the same up to the order of its sums.
  // params: [rows] and edits: [num_edits], as params index them, are host memory (uploaded,
  // as PagedAttentionBatch's arrays are); logits, scratch, sampled ([rows]) and top ([rows,
  // max_logprobs], row r's first params[r].num_logprobs entries filled, by log-probability
  // descending, ties to the lowest id) operator memory. scratch: SampleRowsScratchBytes of at
  // least these rows, vocab and num_edits. max_logprobs is at most kMaxSampleLogprobs.
  virtual void SampleRows(float* logits, int rows, int vocab, const SampleRowParams* params,
                          const LogitEdit* edits, int num_edits, int max_logprobs, void* scratch,
                          TokenLogprob* sampled, TokenLogprob* top) = 0;
  virtual size_t SampleRowsScratchBytes(int rows, int vocab, int max_edits) const = 0;

  // --- Step graphs ----------------------------------------------------------------------------

  // Records the operators `record` queues, without running them, into a graph that Launch then
  // queues as one unit (CUDA graphs: one launch instead of one per kernel, the decode step's
  // overhead at small batches). Each replay runs the same operators on the same buffers and
  // sizes with whatever those buffers hold at that point of the stream, so `record` must queue
  // only operators whose arguments do not change between the replays (attention through a
  // PagedAttentionBatch with on_device set): no copies between host and operator memory, no
  // Synchronize, no allocation. An error of `record`, or of an operator it queued, fails the
  // capture. Unimplemented on a backend with nothing to gain (the CPU backend, which has no
  // launch cost) or that cannot.
  class StepGraph {
   public:
    virtual ~StepGraph() = default;
    // Queues the recorded operators, ordered after everything queued before.
    virtual absl::Status Launch() = 0;
  };
  virtual absl::StatusOr<std::unique_ptr<StepGraph>> CaptureGraph(
      const std::function<absl::Status()>& record);

 protected:
  // Allocate and DeviceBuffer's destructor go through these.
  virtual absl::StatusOr<void*> AllocateBytes(size_t bytes) = 0;
  virtual void FreeBytes(void* data) = 0;
  // AllocateHostStaging's: plain 64-byte aligned host memory unless a backend has better.
  virtual absl::StatusOr<void*> AllocateHostBytes(size_t bytes);
  virtual void FreeHostBytes(void* data);

 private:
  friend class DeviceBuffer;
};

// Instruction sets the CPU backend carries code for. Results are bitwise reproducible for one
// instruction set on one machine; different instruction sets may differ in the last bits.
// kAvx512Bf16: AVX-512 with vdpbf16ps for bf16 weights, x carried as two bf16 halves (within
// 2^-16 of x, Backend::LinearSplitsX), and VNNI's vpdpbusd for int4 and int8 weights, x carried
// in three bytes (within about 2^-22 of its row's largest |x|, Backend::LinearCarriesXInBytes):
// both nearly as exact as fp32 activations. It needs AVX512_BF16 and AVX512_VNNI.
// kAvx512Bf16Round: the same, but bf16 weights multiply x rounded to bf16 (Backend::LinearRoundsX):
// about twice the prefill GEMM rate on bf16 weights, with activations no longer exact in fp32, so
// kAuto never picks it.
enum class CpuIsa { kAuto, kPortable, kAvx2, kAvx512, kAvx512Bf16, kAvx512Bf16Round };

// "auto", "portable", "avx2", "avx512", "avx512-bf16", "avx512-bf16-round".
std::string_view CpuIsaName(CpuIsa isa);

// The instruction set CpuIsaName calls `name`, or nullopt.
std::optional<CpuIsa> CpuIsaFromName(std::string_view name);

// Whether this CPU (and OS) can run the CPU backend's code for `isa`; kAuto always.
bool CpuIsaSupported(CpuIsa isa);

struct CpuBackendOptions {
  int num_threads = 0;  // 0: one per available core
  // kAuto: the widest this CPU supports of kAvx512Bf16, kAvx512, kAvx2 and kPortable; others
  // fail if unsupported.
  CpuIsa isa = CpuIsa::kAuto;
};

// The CPU backend: fp32 activations and accumulation, fp32/bf16/fp16 weights (converted in
// registers), vectorised, multi-threaded, batch invariant.
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const CpuBackendOptions& options);

}  // namespace tandem::kernels
