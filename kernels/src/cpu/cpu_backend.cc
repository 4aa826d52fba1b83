// The CPU backend: splits each operator into single-threaded pieces (simd_kernels.inc) and runs
// them on a persistent thread pool.
//
// Batch invariance: a piece never changes how an output is reduced, only which outputs it
// covers, so results do not depend on m, on the other sequences of a batch, or on the number
// of threads. Linear is split over panels of output columns, attention over (sequence, KV
// head, tile of query rows), row operators over rows.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/src/cpu/simd_kernels.h"
#include "kernels/src/cpu/thread_pool.h"
#include "tandem/base/status_macros.h"
#include "tandem/kernels/backend.h"
#include "tandem/kernels/sampling.h"

namespace tandem::kernels {
namespace {

using cpu::CpuKernelTable;
using cpu::kQuantUnitK;
using cpu::ThreadPool;

// Cache-line aligned storage.
struct AlignedFree {
  void operator()(void* p) const { ::operator delete (p, std::align_val_t{64}); }
};
using AlignedFloats = std::unique_ptr<float[], AlignedFree>;
using AlignedBytes = std::unique_ptr<unsigned char[], AlignedFree>;

AlignedFloats AllocateFloats(int64_t count) {
  return AlignedFloats(static_cast<float*>(
      ::operator new (sizeof(float) * std::max<int64_t>(count, 1), std::align_val_t{64})));
}

AlignedBytes AllocateAlignedBytes(int64_t count) {
  return AlignedBytes(static_cast<unsigned char*>(
      ::operator new (std::max<int64_t>(count, 1), std::align_val_t{64})));
}

// Work below this many floating-point operations runs on the calling thread: waking the pool
// costs about a microsecond, which is worth it only for work several times longer.
constexpr int64_t kMinParallelFlops = 1 << 17;

// Query vectors (rows x heads of a group) per attention piece: their accumulators plus one K
// and one V block stay in L1.
constexpr int kAttentionTileVectors = 32;

class CpuPackedWeight final : public PackedWeight {
 public:
  CpuPackedWeight(int n, int k, DType dtype, const CpuKernelTable* table, AlignedBytes data)
      : PackedWeight(n, k, dtype), table_(table), data_(std::move(data)) {}

  // A quantised weight: integers in `data`, per-panel group scales and zeros (see GemmArgs).
  // units_k: int4 in units (cpu::GemmArgs::units_k) of that many packed k steps; else 0.
  CpuPackedWeight(const QuantizedWeightView& w, const CpuKernelTable* table, AlignedBytes data,
                  AlignedFloats scales, AlignedFloats zeros, std::vector<int32_t> group_starts,
                  std::vector<int32_t> k_order, int units_k)
      : PackedWeight(w.n, w.k, DType::kI8, w.quant),
        table_(table),
        data_(std::move(data)),
        scales_(std::move(scales)),
        zeros_(std::move(zeros)),
        k_order_(std::move(k_order)),
        group_starts_(std::move(group_starts)),
        units_k_(units_k) {}

  const CpuKernelTable* table() const { return table_; }
  // [ceil(n / panel_width), k, panel_width] elements of dtype(), zero past n; quantised: see
  // GemmArgs.
  const void* data() const { return data_.get(); }
  const float* scales() const { return scales_.get(); }
  const float* zeros() const { return zeros_.get(); }
  const int32_t* k_order() const { return k_order_.empty() ? nullptr : k_order_.data(); }
  const int32_t* group_starts() const { return group_starts_.data(); }
  int groups() const {
    return group_starts_.empty() ? 0 : static_cast<int>(group_starts_.size()) - 1;
  }
  int units_k() const { return units_k_; }

 private:
  const CpuKernelTable* table_;  // static storage
  AlignedBytes data_;
  AlignedFloats scales_;  // quantised only
  AlignedFloats zeros_;   // int4, and int8 in units (all 128)
  std::vector<int32_t> k_order_;
  std::vector<int32_t> group_starts_;  // quantised only
  int units_k_ = 0;                    // see the constructor
};

// Copies W[n, k] of T into panels [ceil(n / width)][k][width], zero past n.
template <typename T>
void PackPanels(const T* w, int n, int k, int width, ThreadPool& pool, T* out) {
  const int64_t panels = (n + width - 1) / width;
  pool.ParallelFor(panels, 1, [&](int64_t begin, int64_t end, int) {
    for (int64_t p = begin; p < end; ++p) {
      T* panel = out + p * k * width;
      for (int c = 0; c < width; ++c) {
        const int64_t row = p * width + c;
        // Reads W row by row; each write stays inside this panel, which fits in L2.
        for (int64_t kk = 0; kk < k; ++kk) panel[kk * width + c] = row < n ? w[row * k + kk] : T{0};
      }
    }
  });
}

// Copies bf16 W[n, k] into panels of k pairs [ceil(n / width)][ceil(k / 2)][width][2], zero past
// n and past an odd k.
void PackPairPanels(const uint16_t* w, int n, int k, int width, ThreadPool& pool, uint16_t* out) {
  const int64_t panels = (n + width - 1) / width;
  const int64_t k2 = (k + 1) / 2;
  pool.ParallelFor(panels, 1, [&](int64_t begin, int64_t end, int) {
    for (int64_t p = begin; p < end; ++p) {
      uint16_t* panel = out + p * k2 * width * 2;
      for (int c = 0; c < width; ++c) {
        const int64_t row = p * width + c;
        for (int64_t kk = 0; kk < 2 * k2; ++kk) {
          panel[(kk / 2 * width + c) * 2 + kk % 2] = row < n && kk < k ? w[row * k + kk] : 0;
        }
      }
    }
  });
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(const CpuKernelTable* table, std::unique_ptr<ThreadPool> pool,
             std::vector<AlignedFloats> scratch, int64_t scratch_floats)
      : table_(table),
        pool_(std::move(pool)),
        scratch_(std::move(scratch)),
        scratch_floats_(scratch_floats),
        gemm_in_scratch_(scratch_.size(), 0) {}

  std::string_view name() const override { return table_->name; }

  bool host_memory() const override { return true; }

  void CopyToDevice(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }

  void CopyToHost(void* dst, const void* src, size_t bytes) override {
    std::memcpy(dst, src, bytes);
  }

  void CopyRows(void* dst, size_t dst_stride, const void* src, size_t src_stride,
                size_t row_bytes, int rows) override {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    for (int r = 0; r < rows; ++r) {
      std::memcpy(d + r * dst_stride, s + r * src_stride, row_bytes);
    }
  }

  absl::Status Synchronize() override { return absl::OkStatus(); }

  std::unique_ptr<PackedWeight> PackWeight(const void* w, DType dtype, int n, int k) override {
    TANDEM_CHECK(n > 0 && k >= 0) << "PackWeight of a " << n << " x " << k << " matrix";
    TANDEM_CHECK(dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16)
        << "PackWeight of " << DTypeName(dtype) << " weights";
    const int width = table_->panel_width;
    const int64_t panels = (n + width - 1) / width;
    const bool pairs = dtype == DType::kBF16 && table_->bf16_pairs;
    AlignedBytes packed =
        AllocateAlignedBytes(panels * (pairs ? (k + 1) / 2 * 2 : k) * width * DTypeSize(dtype));
    if (pairs) {
      PackPairPanels(static_cast<const uint16_t*>(w), n, k, width, *pool_,
                     reinterpret_cast<uint16_t*>(packed.get()));
    } else if (dtype == DType::kF32) {
      PackPanels(static_cast<const float*>(w), n, k, width, *pool_,
                 reinterpret_cast<float*>(packed.get()));
    } else {
      PackPanels(static_cast<const uint16_t*>(w), n, k, width, *pool_,
                 reinterpret_cast<uint16_t*>(packed.get()));
    }
    return std::make_unique<CpuPackedWeight>(n, k, dtype, table_, std::move(packed));
  }

  std::unique_ptr<PackedWeight> PackQuantizedWeight(const QuantizedWeightView& w) override {
    const absl::Status valid = ValidateQuantizedWeight(w);
    TANDEM_CHECK(valid.ok()) << valid;
    const int width = table_->panel_width;
    const int half = width / 2;
    const int64_t panels = (w.n + width - 1) / width;
    const int groups = w.groups();
    const bool int4 = w.quant == WeightQuant::kInt4;
    std::vector<int32_t> starts = GroupStarts(w);
    std::vector<int32_t> order;
    if (w.k_order != nullptr) order.assign(w.k_order, w.k_order + w.k);
    // int4 and int8 in units of kQuantUnitK k steps (cpu::GemmArgs::units_k). A group that does
    // not start at a multiple of it is moved to the next one: the packed k steps between hold
    // zeros, and `order` (the packed step's input, -1 for none) skips them.
    const bool units = PacksInUnits();
    int packed_k = w.k;
    std::vector<int32_t> packed_at;  // units: input kk's packed k step
    if (units) {
      std::vector<int32_t> unit_starts = {0};
      for (int g = 0; g < groups; ++g) {
        const int32_t size = starts[g + 1] - starts[g];
        unit_starts.push_back(
            unit_starts.back() +
            (g + 1 < groups ? (size + kQuantUnitK - 1) / kQuantUnitK * kQuantUnitK : size));
      }
      packed_k = unit_starts.back();
      packed_at.resize(w.k);
      std::vector<int32_t> unit_order(packed_k, -1);
      for (int g = 0; g < groups; ++g) {
        for (int32_t kk = starts[g]; kk < starts[g + 1]; ++kk) {
          packed_at[kk] = unit_starts[g] + (kk - starts[g]);
          unit_order[packed_at[kk]] = order.empty() ? kk : order[kk];
        }
      }
      if (packed_k != w.k) order = std::move(unit_order);
      starts = std::move(unit_starts);
    }
    const int64_t step_bytes = int4 ? half : width;
    // int8 in units: each weight plus 128 as an unsigned byte, with zero points of 128.
    const bool int8_units = units && !int4;
    const int64_t panel_bytes =
        units ? (packed_k + kQuantUnitK - 1) / kQuantUnitK * kQuantUnitK * step_bytes
              : w.k * step_bytes;
    AlignedBytes packed = AllocateAlignedBytes(panels * panel_bytes);
    AlignedFloats scales = AllocateFloats(panels * groups * width);
    AlignedFloats zeros = int4 || int8_units ? AllocateFloats(panels * groups * width) : nullptr;
    pool_->ParallelFor(panels, 1, [&](int64_t begin, int64_t end, int) {
      for (int64_t p = begin; p < end; ++p) {
        unsigned char* panel = packed.get() + p * panel_bytes;
        std::memset(panel, 0, panel_bytes);
        for (int c = 0; c < width; ++c) {
          const int64_t row = p * width + c;
          for (int g = 0; g < groups; ++g) {
            const int64_t at = (p * groups + g) * width + c;
            // Columns past n: scale 0, so they read as 0 whatever their integers.
            scales[at] = row < w.n ? w.scales[row * groups + g] : 0.0f;
            if (int4) zeros[at] = row < w.n ? w.zeros[row * groups + g] : 0.0f;
            if (int8_units) zeros[at] = 128.0f;
          }
          if (row >= w.n) continue;
          const int8_t* values = w.values + row * w.k;
          for (int64_t kk = 0; kk < w.k; ++kk) {
            if (int8_units) {
              // Step pk: unit pk / 8, half-unit c / half (of 8 x half bytes), its first
              // 4 x half bytes for the unit's first four steps and the next for the last four,
              // word c % half of those, byte pk % 4 of that word.
              const int64_t pk = packed_at[kk];
              const int64_t within = pk % kQuantUnitK;
              const int64_t byte = pk / kQuantUnitK * kQuantUnitK * width + c / half * (8 * half) +
                                   within / 4 * (4 * half) + c % half * 4 + within % 4;
              panel[byte] = static_cast<unsigned char>(values[kk] + 128);
            } else if (units) {
              // Step pk: unit pk / 8, half-unit c / half (of 4 x half bytes), word c % half
              // of it, byte pk % 4 of that word, its low nibble for the unit's first four
              // steps and its high one for the last four.
              const int64_t pk = packed_at[kk];
              const int64_t within = pk % kQuantUnitK;
              const int64_t byte = pk / kQuantUnitK * kQuantUnitK * half + c / half * (4 * half) +
                                   c % half * 4 + within % 4;
              panel[byte] |= static_cast<unsigned char>(values[kk] << (within < 4 ? 0 : 4));
            } else if (int4) {
              const int shift = c < half ? 0 : 4;
              panel[kk * step_bytes + c % half] |= static_cast<unsigned char>(values[kk] << shift);
            } else {
              panel[kk * step_bytes + c] = static_cast<unsigned char>(values[kk]);
            }
          }
        }
      }
    });
    return std::make_unique<CpuPackedWeight>(w, table_, std::move(packed), std::move(scales),
                                             std::move(zeros), std::move(starts),
                                             std::move(order), units ? packed_k : 0);
  }

  // Whether int4 and int8 W are packed in units of kQuantUnitK k steps (cpu::GemmArgs::units_k)
  // for the vpdpbusd kernel, which takes panels of 32 columns.
  bool PacksInUnits() const { return table_->quant_units && table_->panel_width == 32; }

  // cpu-avx512-bf16-round rounds x for bf16 W, whatever m (keeping Linear batch invariant).
  bool LinearRoundsX(int m, DType w_dtype) const override {
    return table_->rounds_x && w_dtype == DType::kBF16;
  }
  // The vdpbf16ps kernels: bf16 W in pairs (unless x is rounded).
  bool LinearSplitsX(DType w_dtype, WeightQuant quant) const override {
    return quant == WeightQuant::kNone && w_dtype == DType::kBF16 && table_->bf16_pairs &&
           !table_->rounds_x;
  }
  // The vpdpbusd kernel: int4 and int8 W in units.
  bool LinearCarriesXInBytes(WeightQuant quant) const override {
    return quant != WeightQuant::kNone && PacksInUnits();
  }

  void Linear(const void* x_in, DType x_dtype, int m, const PackedWeight& w, const float* bias,
              float* y) override {
    const auto& packed = static_cast<const CpuPackedWeight&>(w);
    TANDEM_CHECK(packed.table() == table_) << "weight packed by another CPU backend";
    const int n = w.n();
    const int k = w.k();
    if (m <= 0) return;
    // The kernels read fp32 x: a 16-bit x (exact in fp32) is widened first.
    std::vector<float> widened;
    const float* x = static_cast<const float*>(x_in);
    if (x_dtype != DType::kF32) {
      TANDEM_CHECK(x_dtype == w.dtype() && w.quant() == WeightQuant::kNone)
          << "Linear of " << DTypeName(x_dtype) << " x with " << DTypeName(w.dtype())
          << " weights";
      widened.resize(static_cast<size_t>(int64_t{m} * k));
      pool_->ParallelFor(m, RowGrain(k, 1), [&](int64_t begin, int64_t end, int) {
        for (int64_t i = begin * k; i < end * k; ++i) widened[i] = LoadAsFloat(x_in, x_dtype, i);
      });
      x = widened.data();
    }
    if (k == 0) {
      for (int64_t i = 0; i < int64_t{m} * n; ++i) y[i] = bias != nullptr ? bias[i % n] : 0.0f;
      return;
    }
    cpu::GemmArgs args{.x = x,
                       .w = packed.data(),
                       .w_dtype = packed.dtype(),
                       .quant = packed.quant(),
                       .scales = packed.scales(),
                       .zeros = packed.zeros(),
                       .k_order = packed.k_order(),
                       .group_starts = packed.group_starts(),
                       .groups = packed.groups(),
                       .units_k = packed.units_k(),
                       .x_scales = nullptr,
                       .bias = bias,
                       .y = y,
                       .m = m,
                       .n = n,
                       .k = k};
    if (packed.units_k() > 0) {
      x_scales_.resize(m);
      pool_->ParallelFor(m, RowGrain(k, 2), [&](int64_t begin, int64_t end, int) {
        table_->row_level_scales(x + begin * k, end - begin, k, x_scales_.data() + begin);
      });
      args.x_scales = x_scales_.data();
    }
    const int64_t panels = (n + table_->panel_width - 1) / table_->panel_width;
    const int64_t flops_per_panel = int64_t{2} * m * k * table_->panel_width;
    // Few rows: W streaming dominates; small chunks balance the threads. Many rows: each chunk
    // re-packs x, so fewer, larger chunks.
    const int64_t chunks_per_thread = m <= 16 ? 8 : 3;
    int64_t grain = (panels + pool_->num_threads() * chunks_per_thread - 1) /
                    (pool_->num_threads() * chunks_per_thread);
    grain = std::max(grain, kMinParallelFlops / flops_per_panel);
    // Chunks of whole groups of the panels that short row tiles take per call.
    const int64_t per_call = table_->panels_per_call(m, packed.quant());
    grain = (grain + per_call - 1) / per_call * per_call;
    const uint64_t gemm = ++gemms_;
    pool_->ParallelFor(panels, grain, [&](int64_t begin, int64_t end, int thread) {
      // A thread's later chunks of this GEMM find x packed by its first.
      const bool x_packed = gemm_in_scratch_[thread] == gemm;
      gemm_in_scratch_[thread] = gemm;
      table_->gemm_panels(args, begin, end, scratch_[thread].get(), x_packed);
    });
  }

  void RmsNorm(const float* x, const float* weight, float eps, int rows, int dim, void* y_out,
               DType y_dtype) override {
    StoreAs(y_out, y_dtype, int64_t{rows} * dim, [&](float* y) {
      pool_->ParallelFor(rows, RowGrain(dim, 4), [&](int64_t begin, int64_t end, int) {
        table_->rms_norm_rows(x + begin * dim, weight, eps, end - begin, dim, y + begin * dim);
      });
    });
  }

  void AddRmsNorm(float* residual, const float* x, const float* weight, float eps, int rows,
                  int dim, void* y_out, DType y_dtype) override {
    StoreAs(y_out, y_dtype, int64_t{rows} * dim, [&](float* y) {
      pool_->ParallelFor(rows, RowGrain(dim, 5), [&](int64_t begin, int64_t end, int) {
        table_->add_rms_norm_rows(residual + begin * dim, x + begin * dim, weight, eps,
                                  end - begin, dim, y + begin * dim);
      });
    });
  }

  void Rope(float* x, const int32_t* positions, int tokens, int heads, int head_dim,
            const float* inv_freq) override {
    TANDEM_CHECK(head_dim % 2 == 0 && head_dim <= cpu::kMaxRopeHeadDim)
        << "Rope head_dim " << head_dim;
    pool_->ParallelFor(tokens, RowGrain(int64_t{heads} * head_dim, 4),
                       [&](int64_t begin, int64_t end, int) {
                         table_->rope_tokens(x + begin * heads * head_dim, positions + begin,
                                             end - begin, heads, head_dim, inv_freq);
                       });
  }

  void SiluMul(const float* gate_up, int rows, int inter, void* out_to, DType out_dtype) override {
    StoreAs(out_to, out_dtype, int64_t{rows} * inter, [&](float* out) {
      pool_->ParallelFor(rows, RowGrain(inter, 20), [&](int64_t begin, int64_t end, int) {
        table_->silu_mul_rows(gate_up + begin * 2 * inter, end - begin, inter,
                              out + begin * inter);
      });
    });
  }

  void Embedding(const void* table, DType table_dtype, const int32_t* ids, int tokens, int dim,
                 float* out) override {
    pool_->ParallelFor(tokens, RowGrain(dim, 1), [&](int64_t begin, int64_t end, int) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t first = int64_t{ids[t]} * dim;
        if (table_dtype == DType::kF32) {
          std::memcpy(out + t * dim, static_cast<const float*>(table) + first, sizeof(float) * dim);
        } else {
          for (int i = 0; i < dim; ++i)
            out[t * dim + i] = LoadAsFloat(table, table_dtype, first + i);
        }
      }
    });
  }

  void WriteKv(const float* k, const float* v, const int32_t* slot_mapping, int tokens,
               const KvLayout& layout, void* layer_cache) override {
    const int64_t row = int64_t{layout.num_kv_heads} * layout.head_dim;
    const DType dtype = layout.dtype;
    auto* k_cache = static_cast<unsigned char*>(layer_cache);
    unsigned char* v_cache = k_cache + layout.HalfBytes();
    const int64_t row_bytes = row * DTypeSize(dtype);
    const bool fp8 = DTypeSize(dtype) == 1;
    const float k_scale = fp8 ? layout.k_scale : 1.0f;
    const float v_scale = fp8 ? layout.v_scale : 1.0f;
    pool_->ParallelFor(
        tokens, RowGrain(2 * row, dtype == DType::kF32 ? 1 : 8),
        [&](int64_t begin, int64_t end, int) {
          for (int64_t t = begin; t < end; ++t) {
            const int64_t slot = slot_mapping[t];
            if (slot < 0) continue;  // padding token
            if (dtype == DType::kF32) {
              std::memcpy(k_cache + slot * row_bytes, k + t * row, row_bytes);
              std::memcpy(v_cache + slot * row_bytes, v + t * row, row_bytes);
              continue;
            }
            for (int64_t i = 0; i < row; ++i) {
              StoreFromFloat(k_cache, dtype, slot * row + i, k[t * row + i] / k_scale);
              StoreFromFloat(v_cache, dtype, slot * row + i, v[t * row + i] / v_scale);
            }
          }
        });
  }

  void PagedAttention(const float* q, const void* layer_cache, const KvLayout& layout,
                      const PagedAttentionBatch& call_batch, int num_heads, float scale,
                      void* out_to, DType out_dtype) override {
    const int64_t tokens = call_batch.num_seqs <= 0 ? 0
                           : call_batch.on_device   ? call_batch.num_tokens
                                                    : call_batch.query_start[call_batch.num_seqs];
    StoreAs(out_to, out_dtype, tokens * num_heads * layout.head_dim, [&](float* out) {
      PagedAttentionF32(q, layer_cache, layout, call_batch, num_heads, scale, out);
    });
  }

  void GatherAdd(const float* a, const float* b, const int32_t* rows, int num_rows, int dim,
                 float* out) override {
    for (int i = 0; i < num_rows; ++i) {
      const float* x = a + int64_t{rows[i]} * dim;
      const float* y = b + int64_t{rows[i]} * dim;
      float* o = out + int64_t{i} * dim;
      for (int j = 0; j < dim; ++j) o[j] = x[j] + y[j];
    }
  }

  // The rows one after another on the calling thread, as the engine's Sampler would.
  void SampleRows(float* logits, int rows, int vocab, const SampleRowParams* params,
                  const LogitEdit* edits, int num_edits, int max_logprobs, void* scratch,
                  TokenLogprob* sampled, TokenLogprob* top) override {
    for (int r = 0; r < rows; ++r) {
      TANDEM_CHECK(params[r].num_logprobs <= max_logprobs)
          << "SampleRows: row " << r << " asks for " << params[r].num_logprobs
          << " log-probabilities, over max_logprobs " << max_logprobs;
      sampled[r] = SampleRowReference(logits + int64_t{r} * vocab, vocab, params[r], edits,
                                      sample_scratch_, top + int64_t{r} * max_logprobs);
    }
  }

  size_t SampleRowsScratchBytes(int rows, int vocab, int max_edits) const override { return 0; }

 protected:
  // Cache-line aligned and left untouched, so pages of a large KV cache cost memory only once
  // written.
  absl::StatusOr<void*> AllocateBytes(size_t bytes) override {
    void* p = ::operator new(std::max<size_t>(bytes, 1), std::align_val_t{64}, std::nothrow);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("could not allocate ", bytes, " bytes"));
    }
    return p;
  }

  void FreeBytes(void* data) override { ::operator delete(data, std::align_val_t{64}); }

 private:
  // Rows per chunk so that a chunk is worth a thread wake-up; `cost` is flops per element.
  static int64_t RowGrain(int64_t row_elements, int64_t cost) {
    return std::max<int64_t>(1, kMinParallelFlops / std::max<int64_t>(1, row_elements * cost));
  }

  // PagedAttention into fp32 `out` (StoreAs stores it as the caller's dtype).
  void PagedAttentionF32(const float* q, const void* layer_cache, const KvLayout& layout,
                         const PagedAttentionBatch& call_batch, int num_heads, float scale,
                         float* out) {
    // Operator memory is host memory: a batch on the device is read where it is.
    PagedAttentionBatch batch = call_batch;
    if (batch.on_device) {
      batch.query_start = batch.device_query_start;
      batch.context_len = batch.device_context_len;
      batch.block_table = batch.device_block_table;
    }
    const int kv_heads = layout.num_kv_heads;
    TANDEM_CHECK(kv_heads > 0 && num_heads % kv_heads == 0)
        << num_heads << " query heads over " << kv_heads << " KV heads";
    TANDEM_CHECK(layout.block_size > 0 && layout.block_size <= cpu::kMaxAttentionBlockSize)
        << "block_size " << layout.block_size;
    const int group = num_heads / kv_heads;
    // Rows per piece: enough to share each K/V block among ~kAttentionTileVectors query
    // vectors, few enough that their state fits the per-thread scratch.
    int rows_per_tile = std::max(1, kAttentionTileVectors / group);
    while (rows_per_tile > 1 && cpu::AttentionScratchFloats(int64_t{rows_per_tile} * group,
                                                            layout.head_dim) > scratch_floats_) {
      rows_per_tile /= 2;
    }
    TANDEM_CHECK(cpu::AttentionScratchFloats(group, layout.head_dim) <= scratch_floats_)
        << "attention of " << group << " heads of " << layout.head_dim << " exceeds scratch";
    int64_t items = 0;
    for (int s = 0; s < batch.num_seqs; ++s) {
      const int q_len = batch.query_start[s + 1] - batch.query_start[s];
      const absl::Status valid = CheckAttentionSequence(batch, s, layout.block_size);
      TANDEM_CHECK(valid.ok()) << valid.message();
      // A device batch's bounds are what a backend sizes the call by.
      TANDEM_CHECK(!batch.on_device || (q_len <= batch.max_query_len &&
                                        batch.context_len[s] <= batch.max_context_len))
          << "sequence " << s << " of a device batch: " << q_len << " queries, context "
          << batch.context_len[s] << ", past the bounds " << batch.max_query_len << " and "
          << batch.max_context_len;
      items += int64_t{kv_heads} * ((q_len + rows_per_tile - 1) / rows_per_tile);
    }
    const void* v_cache = static_cast<const unsigned char*>(layer_cache) + layout.HalfBytes();
    // Piece i is (sequence, tile, KV head) in that order; each chunk walks the sequences once.
    pool_->ParallelFor(items, 1, [&](int64_t begin, int64_t end, int thread) {
      int s = 0;
      int64_t first_item = 0;  // index of sequence s's first piece
      for (int64_t item = begin; item < end; ++item) {
        int64_t seq_items = 0;
        for (;; ++s) {
          const int q_len = batch.query_start[s + 1] - batch.query_start[s];
          seq_items = int64_t{kv_heads} * ((q_len + rows_per_tile - 1) / rows_per_tile);
          if (item < first_item + seq_items) break;
          first_item += seq_items;
        }
        const int64_t local = item - first_item;
        const int q_len = batch.query_start[s + 1] - batch.query_start[s];
        const int row_begin = static_cast<int>(local / kv_heads) * rows_per_tile;
        const cpu::AttentionSequence seq{
            .q = q,
            .k_cache = layer_cache,
            .v_cache = v_cache,
            .cache_dtype = layout.dtype,
            .k_scale = layout.k_scale,
            .v_scale = layout.v_scale,
            .block_table = batch.block_table + int64_t{s} * batch.max_blocks_per_seq,
            .out = out,
            .num_heads = num_heads,
            .num_kv_heads = kv_heads,
            .head_dim = layout.head_dim,
            .block_size = layout.block_size,
            .first_token = batch.query_start[s],
            .q_len = q_len,
            .context_len = batch.context_len[s],
            .scale = scale,
        };
        table_->attention_tile(seq, static_cast<int>(local % kv_heads), row_begin,
                               std::min(row_begin + rows_per_tile, q_len), scratch_[thread].get());
      }
    });
  }

  // Runs `compute(float* out)` on `out` itself when dtype is kF32; for kBF16 or kF16 on an fp32
  // temporary of `count` elements, then rounds those to nearest even into `out`.
  template <typename Compute>
  void StoreAs(void* out, DType dtype, int64_t count, Compute compute) {
    if (dtype == DType::kF32) {
      compute(static_cast<float*>(out));
      return;
    }
    TANDEM_CHECK(dtype == DType::kBF16 || dtype == DType::kF16)
        << "an activation of " << DTypeName(dtype);
    std::vector<float> wide(static_cast<size_t>(count));
    compute(wide.data());
    pool_->ParallelFor(count, kMinParallelFlops, [&](int64_t begin, int64_t end, int) {
      for (int64_t i = begin; i < end; ++i) StoreFromFloat(out, dtype, i, wide[i]);
    });
  }

  const CpuKernelTable* table_;  // static storage
  std::unique_ptr<ThreadPool> pool_;
  std::vector<AlignedFloats> scratch_;  // one per pool thread, scratch_floats_ each
  int64_t scratch_floats_;
  // Per pool thread, the number (gemms_) of the Linear whose chunks last ran on its scratch; any
  // other use of the scratch comes between two Linears, each of which takes a new number.
  std::vector<uint64_t> gemm_in_scratch_;
  std::vector<float> x_scales_;  // Linear's GemmArgs::x_scales
  uint64_t gemms_ = 0;
  SampleRowScratch sample_scratch_;  // SampleRows': grows to the vocabulary once
};

}  // namespace

bool CpuIsaSupported(CpuIsa isa) { return cpu::CpuSupports(isa); }

std::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAuto:
      return "auto";
    case CpuIsa::kPortable:
      return "portable";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx512Bf16:
      return "avx512-bf16";
    case CpuIsa::kAvx512Bf16Round:
      return "avx512-bf16-round";
  }
  return "unknown";
}

std::optional<CpuIsa> CpuIsaFromName(std::string_view name) {
  for (CpuIsa isa : {CpuIsa::kAuto, CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512,
                     CpuIsa::kAvx512Bf16, CpuIsa::kAvx512Bf16Round}) {
    if (name == CpuIsaName(isa)) return isa;
  }
  return std::nullopt;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const CpuBackendOptions& options) {
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError("CpuBackendOptions.num_threads must be >= 0");
  }
  const CpuKernelTable* table = cpu::CpuKernelTableFor(options.isa);
  if (table == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("this CPU does not support the ", std::string(CpuIsaName(options.isa)),
                     " instruction set"));
  }
  const int threads = options.num_threads > 0
                          ? options.num_threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<ThreadPool> pool, ThreadPool::Create(threads));
  // Enough for GEMM, and for attention tiles of full height up to head_dim 256.
  const int64_t scratch_floats =
      std::max(table->gemm_scratch_floats, cpu::AttentionScratchFloats(kAttentionTileVectors, 256));
  std::vector<AlignedFloats> scratch;
  for (int t = 0; t < threads; ++t) scratch.push_back(AllocateFloats(scratch_floats));
  return std::make_unique<CpuBackend>(table, std::move(pool), std::move(scratch), scratch_floats);
}

}  // namespace tandem::kernels
