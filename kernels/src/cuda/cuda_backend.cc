// CudaBackend: checks arguments, plans PagedAttention on the host, and queues the kernels of
// kernels/src/cuda on one stream. Launch errors are kept (first one wins) for Synchronize.
#include "tandem/kernels/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/src/cuda/attention_inputs.cuh"
#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/embedding.cuh"
#include "kernels/src/cuda/flash_attention.cuh"
#include "kernels/src/cuda/gather_add.cuh"
#include "kernels/src/cuda/kv_write.cuh"
#include "kernels/src/cuda/linear.cuh"
#include "kernels/src/cuda/paged_attention.cuh"
#include "kernels/src/cuda/quantized_linear.cuh"
#include "kernels/src/cuda/rmsnorm.cuh"
#include "kernels/src/cuda/rope.cuh"
#include "kernels/src/cuda/sample_rows.cuh"
#include "kernels/src/cuda/silu_mul.cuh"
#include "tandem/base/status_macros.h"

namespace tandem::kernels {
namespace {

using cuda::CudaStatus;

// Ints of PagedAttention metadata a backend with these bounds uploads at most: query_start
// (max_seqs + 1), context_len (max_seqs), block_table (max_seqs x max_blocks_per_seq), the
// tensor-core kernel's tile starts (max_seqs + 1) and the split-KV kernels' row list, which is
// uploaded only when a call mixes both kernels and then holds rows of sequences shorter than
// kFlashMinRows (at most kFlashMinRows - 1 per sequence).
int64_t MetadataInts(const CudaBackendOptions& options) {
  const int64_t seqs = options.max_seqs;
  return (seqs + 1) + seqs + seqs * options.max_blocks_per_seq + (seqs + 1) +
         seqs * (cuda::kFlashMinRows - 1);
}

// Makes `device` the calling thread's current device, if it is not already.
absl::Status MakeCurrent(int device) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device) return absl::OkStatus();
  return CudaStatus(cudaSetDevice(device), "cudaSetDevice");
}

// Frees on the GPU it was allocated on, whichever thread drops it (a packed weight, a step
// graph's scratch): cudaFree then waits for that GPU, not for the thread's current one.
struct DeviceFree {
  int device = 0;
  void operator()(void* p) const {
    (void)MakeCurrent(device);
    cudaFree(p);
  }
};
template <typename T>
using DeviceArray = std::unique_ptr<T[], DeviceFree>;

// On the calling thread's current device (the backend makes its own current first).
template <typename T>
absl::StatusOr<DeviceArray<T>> DeviceAlloc(int64_t count) {
  int device = 0;
  TANDEM_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  void* p = nullptr;
  TANDEM_RETURN_IF_ERROR(
      CudaStatus(cudaMalloc(&p, sizeof(T) * std::max<int64_t>(count, 1)), "cudaMalloc"));
  return DeviceArray<T>(static_cast<T*>(p), DeviceFree{device});
}

struct StreamDestroy {
  void operator()(CUstream_st* stream) const { cudaStreamDestroy(stream); }
};
using Stream = std::unique_ptr<CUstream_st, StreamDestroy>;

struct EventDestroy {
  void operator()(CUevent_st* event) const { cudaEventDestroy(event); }
};
using Event = std::unique_ptr<CUevent_st, EventDestroy>;

struct GraphExecDestroy {
  void operator()(CUgraphExec_st* exec) const { cudaGraphExecDestroy(exec); }
};

// A step instantiated from a stream capture, and the scratch buffers its kernels read.
class CudaStepGraph final : public Backend::StepGraph {
 public:
  CudaStepGraph(cudaGraphExec_t exec, int device, cudaStream_t stream,
                std::shared_ptr<void> scratch)
      : exec_(exec), device_(device), stream_(stream), scratch_(std::move(scratch)) {}
  absl::Status Launch() override {
    // On the backend's GPU, whichever thread replays the step (see MakeDeviceCurrent).
    TANDEM_RETURN_IF_ERROR(MakeCurrent(device_));
    return CudaStatus(cudaGraphLaunch(exec_.get(), stream_), "cudaGraphLaunch");
  }
  ~CudaStepGraph() override { (void)MakeCurrent(device_); }

 private:
  std::unique_ptr<CUgraphExec_st, GraphExecDestroy> exec_;
  int device_;
  cudaStream_t stream_;
  std::shared_ptr<void> scratch_;
};

struct HostFree {
  void operator()(int32_t* p) const { cudaFreeHost(p); }
};
using PinnedInts = std::unique_ptr<int32_t[], HostFree>;

class CudaPackedWeight final : public PackedWeight {
 public:
  CudaPackedWeight(int n, int k, DType dtype, DeviceArray<unsigned char> data)
      : PackedWeight(n, k, dtype), data_(std::move(data)) {}
  // A quantised weight: `data` holds the values, `scales` the scales then (int4) the zeros,
  // `k_order` the column order and `column_group` each column's group (groups of unequal
  // size), each or both empty; see cuda::DeviceQuantizedWeight.
  CudaPackedWeight(const QuantizedWeightView& w, DeviceArray<unsigned char> data,
                   DeviceArray<float> scales, DeviceArray<int32_t> k_order,
                   DeviceArray<int32_t> column_group)
      : PackedWeight(w.n, w.k, DType::kI8, w.quant),
        data_(std::move(data)),
        scales_(std::move(scales)),
        k_order_(std::move(k_order)),
        column_group_(std::move(column_group)),
        group_size_(w.group_size),
        groups_(w.groups()) {}
  const void* data() const { return data_.get(); }  // [n, k] of dtype(), device, row-major

  cuda::DeviceQuantizedWeight quantized() const {
    const int64_t group_entries = int64_t{n()} * groups_;
    return {.quant = quant(),
            .n = n(),
            .k = k(),
            .group_size = group_size_,
            .groups = groups_,
            .values = data_.get(),
            .scales = scales_.get(),
            .zeros = quant() == WeightQuant::kInt4 ? scales_.get() + group_entries : nullptr,
            .k_order = k_order_.get(),
            .column_group = column_group_.get()};
  }

 private:
  DeviceArray<unsigned char> data_;
  DeviceArray<float> scales_;
  DeviceArray<int32_t> k_order_;
  DeviceArray<int32_t> column_group_;
  int group_size_ = 0;
  int groups_ = 0;
};

class CudaBackendImpl final : public CudaBackend {
 public:
  CudaBackendImpl(const CudaBackendOptions& options, int multiprocessors, Stream stream,
                  DeviceArray<unsigned char> cublas_workspace, cuda::CublasHandle cublas,
                  std::unique_ptr<cuda::LtGemm> lt, DeviceArray<int32_t> metadata,
                  PinnedInts pinned_metadata, Event metadata_read, DeviceArray<float> workspace)
      : options_(options),
        stream_(std::move(stream)),
        cublas_workspace_(std::move(cublas_workspace)),
        cublas_(std::move(cublas)),
        lt_(std::move(lt)),
        metadata_(std::move(metadata)),
        pinned_metadata_(std::move(pinned_metadata)),
        metadata_read_(std::move(metadata_read)),
        workspace_(std::move(workspace)),
        multiprocessors_(std::max(multiprocessors, 1)) {
    staging_.reserve(MetadataInts());
  }
  // The members' streams, events and memory are released on the backend's GPU.
  ~CudaBackendImpl() override { (void)MakeDeviceCurrent(); }

  std::string_view name() const override { return "cuda"; }

  bool host_memory() const override { return false; }

  void* stream() const override { return stream_.get(); }
  int device() const override { return options_.device; }

  // From pageable host memory the copy returns once `src` has been read.
  void CopyToDevice(void* dst, const void* src, size_t bytes) override {
    UseDevice();
    if (bytes == 0 || RefusedInCapture("CopyToDevice")) return;
    Keep(CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_.get()),
                    "CopyToDevice"));
  }

  void CopyToHost(void* dst, const void* src, size_t bytes) override {
    UseDevice();
    if (bytes == 0 || RefusedInCapture("CopyToHost")) return;
    Keep(CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_.get()),
                    "CopyToHost"));
  }

  void CopyRows(void* dst, size_t dst_stride, const void* src, size_t src_stride,
                size_t row_bytes, int rows) override {
    UseDevice();
    if (rows <= 0 || row_bytes == 0) return;
    Keep(CudaStatus(cudaMemcpy2DAsync(dst, dst_stride, src, src_stride, row_bytes, rows,
                                      cudaMemcpyDeviceToDevice, stream_.get()),
                    "CopyRows"));
  }

  absl::Status Synchronize() override {
    UseDevice();
    if (RefusedInCapture("Synchronize")) return status_;
    Keep(CudaStatus(cudaStreamSynchronize(stream_.get()), "cudaStreamSynchronize"));
    return std::exchange(status_, absl::OkStatus());
  }

  absl::StatusOr<std::unique_ptr<StepGraph>> CaptureGraph(
      const std::function<absl::Status()>& record) override {
    if (capturing_) return absl::FailedPreconditionError("CaptureGraph inside a capture");
    TANDEM_RETURN_IF_ERROR(MakeDeviceCurrent());
    // Errors of the captured operators are the capture's, not the next Synchronize's.
    absl::Status pending = std::exchange(status_, absl::OkStatus());
    absl::Status status = CudaStatus(
        cudaStreamBeginCapture(stream_.get(), cudaStreamCaptureModeThreadLocal),
        "cudaStreamBeginCapture");
    cudaGraph_t graph = nullptr;
    if (status.ok()) {
      capturing_ = true;
      status = record();
      capturing_ = false;
      const absl::Status ended =
          CudaStatus(cudaStreamEndCapture(stream_.get(), &graph), "cudaStreamEndCapture");
      if (status.ok()) status = status_;
      if (status.ok()) status = ended;
    }
    status_ = std::move(pending);
    cudaGraphExec_t exec = nullptr;
    if (status.ok()) {
      status = CudaStatus(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    }
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (!status.ok()) {
      cudaGetLastError();  // a failed capture's error is not the next operator's
      return absl::Status(status.code(),
                          absl::StrCat("capturing a step graph: ", status.message()));
    }
    return std::make_unique<CudaStepGraph>(exec, options_.device, stream_.get(), x16_);
  }

  std::unique_ptr<PackedWeight> PackWeight(const void* w, DType dtype, int n, int k) override {
    if (!UseDevice()) return std::make_unique<CudaPackedWeight>(n, k, dtype, nullptr);
    const int64_t bytes = int64_t{n} * k * DTypeSize(dtype);
    auto data = DeviceAlloc<unsigned char>(bytes);
    if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
      Keep(
          absl::InvalidArgumentError(absl::StrCat("PackWeight of ", DTypeName(dtype), " weights")));
      return std::make_unique<CudaPackedWeight>(n, k, dtype, nullptr);
    }
    if (!data.ok()) {
      Keep(data.status());
      return std::make_unique<CudaPackedWeight>(n, k, dtype, nullptr);
    }
    Keep(CudaStatus(cudaMemcpyAsync(data->get(), w, bytes, cudaMemcpyHostToDevice, stream_.get()),
                    "PackWeight upload"));
    // The caller may free w once this returns.
    Keep(CudaStatus(cudaStreamSynchronize(stream_.get()), "PackWeight upload"));
    if (lt_ != nullptr && dtype != DType::kF32) {
      // Its GEMMs' algorithms, chosen now rather than in a serving step.
      Keep(lt_->Prepare(n, k, dtype == DType::kBF16 ? CUDA_R_16BF : CUDA_R_16F));
    }
    return std::make_unique<CudaPackedWeight>(n, k, dtype, std::move(data).value());
  }

  std::unique_ptr<PackedWeight> PackQuantizedWeight(const QuantizedWeightView& w) override {
    auto failed = [&](absl::Status status) {
      Keep(std::move(status));
      return std::make_unique<CudaPackedWeight>(w, nullptr, nullptr, nullptr, nullptr);
    };
    if (absl::Status current = MakeDeviceCurrent(); !current.ok()) return failed(current);
    if (absl::Status valid = ValidateQuantizedWeight(w); !valid.ok()) return failed(valid);
    const bool int4 = w.quant == WeightQuant::kInt4;
    const int64_t group_entries = int64_t{w.n} * w.groups();
    // Host staging in the device layout: int4 values two to a byte (a row of odd k ends in a
    // half byte), zeros after the scales.
    const int64_t row_bytes = cuda::QuantizedRowBytes(w.quant, w.k);
    std::vector<unsigned char> values(w.n * row_bytes);
    for (int64_t row = 0; row < w.n; ++row) {
      const int8_t* in = w.values + row * w.k;
      unsigned char* out = values.data() + row * row_bytes;
      for (int j = 0; j < w.k; ++j) {
        const auto v = static_cast<unsigned char>(in[j]);
        if (!int4) {
          out[j] = v;
        } else {
          out[j / 2] |= static_cast<unsigned char>(j % 2 == 0 ? v : v << 4);
        }
      }
    }
    std::vector<float> scales(w.scales, w.scales + group_entries);
    if (int4) {
      for (int64_t i = 0; i < group_entries; ++i) scales.push_back(w.zeros[i]);
    }
    // Each column's group when the groups are of unequal size.
    std::vector<int32_t> column_group;
    if (w.group_starts != nullptr) {
      for (int g = 0; g < w.num_groups; ++g) {
        column_group.insert(column_group.end(), w.group_starts[g + 1] - w.group_starts[g], g);
      }
    }
    auto d_values = DeviceAlloc<unsigned char>(static_cast<int64_t>(values.size()));
    auto d_scales = DeviceAlloc<float>(static_cast<int64_t>(scales.size()));
    if (!d_values.ok()) return failed(d_values.status());
    if (!d_scales.ok()) return failed(d_scales.status());
    Keep(CudaStatus(cudaMemcpyAsync(d_values->get(), values.data(), values.size(),
                                    cudaMemcpyHostToDevice, stream_.get()),
                    "PackQuantizedWeight upload"));
    Keep(CudaStatus(cudaMemcpyAsync(d_scales->get(), scales.data(), scales.size() * sizeof(float),
                                    cudaMemcpyHostToDevice, stream_.get()),
                    "PackQuantizedWeight upload"));
    // A device copy of an optional int array (an empty one for null).
    auto upload_ints = [&](const int32_t* ints,
                           int64_t count) -> absl::StatusOr<DeviceArray<int32_t>> {
      if (ints == nullptr) return DeviceArray<int32_t>();
      TANDEM_ASSIGN_OR_RETURN(DeviceArray<int32_t> d, DeviceAlloc<int32_t>(count));
      Keep(CudaStatus(cudaMemcpyAsync(d.get(), ints, sizeof(int32_t) * count,
                                      cudaMemcpyHostToDevice, stream_.get()),
                      "PackQuantizedWeight upload"));
      return d;
    };
    auto k_order = upload_ints(w.k_order, w.k);
    if (!k_order.ok()) return failed(k_order.status());
    auto groups = upload_ints(column_group.empty() ? nullptr : column_group.data(), w.k);
    if (!groups.ok()) return failed(groups.status());
    // The staging vectors (and the caller's arrays) may go once this returns.
    Keep(CudaStatus(cudaStreamSynchronize(stream_.get()), "PackQuantizedWeight upload"));
    return std::make_unique<CudaPackedWeight>(w, std::move(d_values).value(),
                                              std::move(d_scales).value(),
                                              std::move(k_order).value(),
                                              std::move(groups).value());
  }

  bool PagedAttentionRoundsQ(DType cache_dtype, int head_dim, int q_len) const override {
    return q_len >= cuda::kFlashMinRows && cuda::FlashPrefillHasKernel(cache_dtype, head_dim);
  }

  bool LinearRoundsX(int m, DType w_dtype) const override {
    return m > cuda::kGemvMaxRows && (w_dtype == DType::kBF16 || w_dtype == DType::kF16);
  }

  DType ActivationDType(int m, const PackedWeight& w) const override {
    return RoundedActivationDType(m, w);
  }

  void Linear(const void* x_in, DType x_dtype, int m, const PackedWeight& w, const float* bias,
              float* y) override {
    LinearInto(x_in, x_dtype, m, w, bias, y, /*accumulate=*/false);
  }

  // Past the skinny GEMM's rows, 16-bit W goes to cuBLASLt (or cublasGemmEx), which adds y with
  // beta = 1. Fewer rows run the GEMV and skinny kernels, which write y: there the runner adds
  // in AddRmsNorm instead (decode steps, whose bytes are the weights').
  bool LinearAdds(int m, const PackedWeight& w) const override {
    return m > cuda::kSkinnyMaxRows && w.quant() == WeightQuant::kNone &&
           (w.dtype() == DType::kBF16 || w.dtype() == DType::kF16);
  }

  void LinearAdd(const void* x_in, DType x_dtype, int m, const PackedWeight& w, const float* bias,
                 float* y) override {
    if (!LinearAdds(m, w)) {
      Keep(absl::InvalidArgumentError(
          absl::StrCat("LinearAdd of ", m, " rows with ", DTypeName(w.dtype()), " weights")));
      return;
    }
    LinearInto(x_in, x_dtype, m, w, bias, y, /*accumulate=*/true);
  }

  // Linear, or with `accumulate` LinearAdd (16-bit W past kSkinnyMaxRows rows only).
  void LinearInto(const void* x_in, DType x_dtype, int m, const PackedWeight& w, const float* bias,
                  float* y, bool accumulate) {
    if (!UseDevice()) return;
    const auto& packed = static_cast<const CudaPackedWeight&>(w);
    if (packed.data() == nullptr) {
      Keep(absl::FailedPreconditionError("Linear with a weight whose upload failed"));
      return;
    }
    if (x_dtype != DType::kF32) {
      // A 16-bit x its producer rounded: straight to the tensor cores, whatever m.
      if (x_dtype != w.dtype() || w.quant() != WeightQuant::kNone) {
        Keep(absl::InvalidArgumentError(absl::StrCat("Linear of ", DTypeName(x_dtype),
                                                     " x with ", DTypeName(w.dtype()),
                                                     " weights")));
        return;
      }
      Keep(cuda::LaunchLinear16(Engines(), x_in, m, packed.data(), w.dtype(), w.n(), w.k(), bias, y,
                                stream_.get(), accumulate));
      return;
    }
    const auto* x = static_cast<const float*>(x_in);
    if (w.quant() != WeightQuant::kNone) {
      Keep(cuda::LaunchQuantizedLinear(x, m, packed.quantized(), bias, y, stream_.get()));
    } else if (w.dtype() == DType::kF32) {
      Keep(cuda::LaunchLinear(cublas_.get(), x, m, static_cast<const float*>(packed.data()), w.n(),
                              w.k(), bias, y, stream_.get()));
    } else {
      void* x16 = nullptr;
      if (m > cuda::kGemvMaxRows) {
        // The tensor-core path reads x rounded to 16 bits: scratch grown on demand (a
        // runner's first prefill of its largest size; decode never needs it).
        // A graph captured with the old buffer keeps it.
        const int64_t bytes = int64_t{m} * w.k() * 2;
        if (bytes > x16_bytes_) {
          if (RefusedInCapture("growing Linear's scratch")) return;
          x16_.reset();
          x16_bytes_ = 0;
          auto grown = DeviceAlloc<unsigned char>(bytes);
          if (!grown.ok()) {
            Keep(grown.status());
            return;
          }
          x16_ = std::move(grown).value();
          x16_bytes_ = bytes;
        }
        x16 = x16_.get();
      }
      Keep(cuda::LaunchLinearLowPrecision(Engines(), x, m, packed.data(), w.dtype(), w.n(), w.k(),
                                          bias, y, x16, stream_.get(), accumulate));
    }
  }

  void RmsNorm(const float* x, const float* weight, float eps, int rows, int dim, void* y,
               DType y_dtype) override {
    UseDevice();
    Keep(cuda::LaunchRmsNorm(x, nullptr, weight, eps, rows, dim, y, y_dtype, stream_.get()));
  }

  void AddRmsNorm(float* residual, const float* x, const float* weight, float eps, int rows,
                  int dim, void* y, DType y_dtype) override {
    UseDevice();
    Keep(cuda::LaunchRmsNorm(x, residual, weight, eps, rows, dim, y, y_dtype, stream_.get()));
  }

  void Rope(float* x, const int32_t* positions, int tokens, int heads, int head_dim,
            const float* inv_freq) override {
    UseDevice();
    Keep(cuda::LaunchRope(x, positions, tokens, heads, head_dim, inv_freq, stream_.get()));
  }

  void SiluMul(const float* gate_up, int rows, int inter, void* out, DType out_dtype) override {
    UseDevice();
    Keep(cuda::LaunchSiluMul(gate_up, rows, inter, out, out_dtype, stream_.get()));
  }

  void Embedding(const void* table, DType table_dtype, const int32_t* ids, int tokens, int dim,
                 float* out) override {
    UseDevice();
    Keep(cuda::LaunchEmbedding(table, table_dtype, ids, tokens, dim, out, stream_.get()));
  }

  void WriteKv(const float* k, const float* v, const int32_t* slot_mapping, int tokens,
               const KvLayout& layout, void* layer_cache) override {
    UseDevice();
    Keep(cuda::LaunchWriteKv(k, v, slot_mapping, tokens, layout, layer_cache, stream_.get()));
  }

  void AttentionInputs(const float* qkv, int tokens, int num_heads, const float* q_norm,
                       const float* k_norm, float eps, const int32_t* positions,
                       const float* inv_freq, const int32_t* slot_mapping, const KvLayout& layout,
                       void* layer_cache, float* q, float* k, float* v) override {
    UseDevice();
    Keep(cuda::LaunchAttentionInputs(qkv, tokens, num_heads, q_norm, k_norm, eps, positions,
                                     inv_freq, slot_mapping, layout, layer_cache, q,
                                     stream_.get()));
  }

  void PagedAttention(const float* q, const void* layer_cache, const KvLayout& layout,
                      const PagedAttentionBatch& batch, int num_heads, float scale, void* out,
                      DType out_dtype) override {
    UseDevice();
    Keep(RunPagedAttention(q, layer_cache, layout, batch, num_heads, scale, {out, out_dtype}));
  }

  void GatherAdd(const float* a, const float* b, const int32_t* rows, int num_rows, int dim,
                 float* out) override {
    UseDevice();
    Keep(cuda::LaunchGatherAdd(a, b, rows, num_rows, dim, out, stream_.get()));
  }

  void SampleRows(float* logits, int rows, int vocab, const SampleRowParams* params,
                  const LogitEdit* edits, int num_edits, int max_logprobs, void* scratch,
                  TokenLogprob* sampled, TokenLogprob* top) override {
    UseDevice();
    // Its rows' parameters are uploaded from host memory on each call.
    if (RefusedInCapture("SampleRows")) return;
    Keep(cuda::LaunchSampleRows({.logits = logits,
                                 .rows = rows,
                                 .vocab = vocab,
                                 .params = params,
                                 .edits = edits,
                                 .num_edits = num_edits,
                                 .max_logprobs = max_logprobs,
                                 .scratch = scratch,
                                 .sampled = sampled,
                                 .top = top},
                                sample_staging_, stream_.get()));
  }

  size_t SampleRowsScratchBytes(int rows, int vocab, int max_edits) const override {
    return cuda::SampleRowsScratchBytes(rows, vocab, max_edits);
  }

 protected:
  absl::StatusOr<void*> AllocateBytes(size_t bytes) override {
    TANDEM_RETURN_IF_ERROR(MakeDeviceCurrent());
    void* p = nullptr;
    TANDEM_RETURN_IF_ERROR(
        CudaStatus(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc"));
    return p;
  }

  // cudaFree waits for the device, so no queued operator still reads the memory.
  void FreeBytes(void* data) override {
    UseDevice();
    cudaFree(data);
  }

  // Page-locked: a copy into it is one DMA at the link's speed, where a copy into pageable
  // memory goes through the driver's staging buffers.
  absl::StatusOr<void*> AllocateHostBytes(size_t bytes) override {
    TANDEM_RETURN_IF_ERROR(MakeDeviceCurrent());
    void* p = nullptr;
    TANDEM_RETURN_IF_ERROR(
        CudaStatus(cudaMallocHost(&p, std::max<size_t>(bytes, 1)), "cudaMallocHost"));
    return p;
  }
  // cudaFreeHost waits for the device, so no queued copy still writes the memory.
  void FreeHostBytes(void* data) override {
    UseDevice();
    cudaFreeHost(data);
  }

 private:
  int64_t MetadataInts() const { return kernels::MetadataInts(options_); }

  // Makes the backend's GPU the calling thread's current device. The current device is a
  // per-thread setting, and the engine creates its backend on one thread (which CreateCudaBackend
  // sets) but steps it on another, whose current device is its own (GPU 0 unless set): without
  // this, a backend on any other GPU would allocate on GPU 0 and launch into a stream of another
  // device, which CUDA refuses.
  absl::Status MakeDeviceCurrent() const { return MakeCurrent(options_.device); }
  // MakeDeviceCurrent for the operators, whose errors wait for the next Synchronize; false
  // when it failed (an operator that allocates then stops, rather than allocate elsewhere).
  bool UseDevice() {
    absl::Status status = MakeDeviceCurrent();
    const bool ok = status.ok();
    Keep(std::move(status));
    return ok;
  }

  void Keep(absl::Status status) {
    if (status_.ok()) status_ = std::move(status);
  }

  // True (and the capture failed) when `what` is called while a step graph is being captured.
  bool RefusedInCapture(const char* what) {
    if (!capturing_) return false;
    Keep(absl::FailedPreconditionError(
        absl::StrCat(what, " inside a step graph capture: not part of a replayable step")));
    return true;
  }

  cuda::GemmEngines Engines() const {
    return {.cublas = cublas_.get(),
            .lt = lt_.get(),
            .skinny = options_.gemm == CudaBackendOptions::Gemm::kAuto};
  }

  // Where PagedAttention stores its output, and as what.
  struct Output {
    void* data;
    DType dtype;
  };

  absl::Status RunPagedAttention(const float* q, const void* layer_cache, const KvLayout& layout,
                                 const PagedAttentionBatch& batch, int num_heads, float scale,
                                 Output out) {
    const int n = batch.num_seqs;
    if (n <= 0) return absl::OkStatus();
    if (batch.on_device) return RunDevicePagedAttention(q, layer_cache, layout, batch, num_heads,
                                                        scale, out);
    if (capturing_) {
      return absl::FailedPreconditionError(
          "PagedAttention inside a step graph capture needs a batch on the device");
    }
    if (n > options_.max_seqs || batch.max_blocks_per_seq > options_.max_blocks_per_seq) {
      return absl::InvalidArgumentError(
          absl::StrCat("PagedAttention batch of ", n, " sequences x ", batch.max_blocks_per_seq,
                       " blocks exceeds CudaBackendOptions (", options_.max_seqs, " x ",
                       options_.max_blocks_per_seq, ")"));
    }
    cuda::PagedAttentionParams p =
        AttentionParams(q, layer_cache, layout, batch, num_heads, scale, out);
    p.num_tokens = batch.query_start[n];

    // Which kernel takes which sequence: those of at least kFlashMinRows query rows the
    // tensor-core prefill kernel when it has one for this cache (PagedAttentionRoundsQ says so
    // to callers), the rest (decode rows) the split-KV kernels.
    const bool flash = cuda::FlashPrefillSupports(p);
    tile_start_.assign(1, 0);
    split_row_ids_.clear();
    int split_max_context = 1;
    bool any_split = false;
    for (int s = 0; s < n; ++s) {
      const int q_len = batch.query_start[s + 1] - batch.query_start[s];
      // Past its block-table row the kernels would read another row of the table as block ids.
      TANDEM_RETURN_IF_ERROR(CheckAttentionSequence(batch, s, layout.block_size));
      int tiles = 0;
      if (flash && q_len >= cuda::kFlashMinRows) {
        tiles = (q_len + cuda::kFlashTileRows - 1) / cuda::kFlashTileRows;
      } else if (q_len > 0) {
        any_split = true;
        split_max_context = std::max(split_max_context, batch.context_len[s]);
        for (int r = batch.query_start[s]; r < batch.query_start[s + 1]; ++r) {
          split_row_ids_.push_back(r);
        }
      }
      tile_start_.push_back(tile_start_.back() + tiles);
    }
    p.flash_tiles = tile_start_.back();
    // All rows split-KV: no row list (the kernels take every row); a mix: the list.
    const bool mixed = p.flash_tiles > 0 && any_split;
    p.split_rows = p.flash_tiles == 0 ? -1 : static_cast<int>(split_row_ids_.size());
    const int split_count = p.split_rows < 0 ? p.num_tokens : p.split_rows;

    // Plan on the host: the metadata goes up in one copy, laid out
    // [query_start (n + 1)][context_len (n)][block_table (n x max_blocks_per_seq)]
    // [flash tile starts (n + 1)][split rows, only when mixed].
    const int64_t table_ints = int64_t{n} * batch.max_blocks_per_seq;
    staging_.assign(batch.query_start, batch.query_start + n + 1);
    staging_.insert(staging_.end(), batch.context_len, batch.context_len + n);
    staging_.insert(staging_.end(), batch.block_table, batch.block_table + table_ints);
    staging_.insert(staging_.end(), tile_start_.begin(), tile_start_.end());
    if (mixed) staging_.insert(staging_.end(), split_row_ids_.begin(), split_row_ids_.end());
    // Every layer of a step plans the same batch: upload it only when it changed.
    if (staging_ != uploaded_) {
      TANDEM_RETURN_IF_ERROR(UploadMetadata());
      uploaded_ = staging_;
    }
    p.query_start = metadata_.get();
    p.context_len = metadata_.get() + n + 1;
    p.block_table = metadata_.get() + 2 * n + 1;
    p.flash_tile_start = p.block_table + table_ints;
    p.split_row_ids = mixed ? p.flash_tile_start + n + 1 : nullptr;
    return LaunchSplitAttention(p, layout, split_count, split_max_context);
  }

  // A batch on the device (a captured step): every row to the split-KV kernels, planned from
  // the batch's bounds alone, so that a replay with other lengths runs the same grid (rows
  // shorter than the bound leave their later partitions idle).
  absl::Status RunDevicePagedAttention(const float* q, const void* layer_cache,
                                       const KvLayout& layout, const PagedAttentionBatch& batch,
                                       int num_heads, float scale, Output out) {
    if (batch.device_query_start == nullptr || batch.device_context_len == nullptr ||
        batch.device_block_table == nullptr || batch.num_tokens < 0 ||
        (batch.num_tokens > 0 && batch.max_query_len < 1) || batch.max_context_len < 1 ||
        batch.max_context_len > int64_t{batch.max_blocks_per_seq} * layout.block_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PagedAttention on a device batch of ", batch.num_seqs, " sequences and ",
          batch.num_tokens, " tokens: missing arrays or bounds (max_query_len ",
          batch.max_query_len, ", max_context_len ", batch.max_context_len, ")"));
    }
    cuda::PagedAttentionParams p =
        AttentionParams(q, layer_cache, layout, batch, num_heads, scale, out);
    p.num_tokens = batch.num_tokens;
    p.query_start = batch.device_query_start;
    p.context_len = batch.device_context_len;
    p.block_table = batch.device_block_table;
    return LaunchSplitAttention(p, layout, p.num_tokens, batch.max_context_len);
  }

  // The parameters every PagedAttention call shares; the metadata pointers, num_tokens and the
  // kernels' split are the caller's.
  static cuda::PagedAttentionParams AttentionParams(const float* q, const void* layer_cache,
                                                    const KvLayout& layout,
                                                    const PagedAttentionBatch& batch,
                                                    int num_heads, float scale, Output out) {
    cuda::PagedAttentionParams p;
    p.q = q;
    const bool fp8 = DTypeSize(layout.dtype) == 1;
    p.k_cache = layer_cache;
    p.v_cache = static_cast<const unsigned char*>(layer_cache) + layout.HalfBytes();
    p.cache_dtype = layout.dtype;
    p.k_scale = fp8 ? layout.k_scale : 1.0f;
    p.v_scale = fp8 ? layout.v_scale : 1.0f;
    p.out = out.data;
    p.out_dtype = out.dtype;
    p.num_seqs = batch.num_seqs;
    p.num_heads = num_heads;
    p.num_kv_heads = layout.num_kv_heads;
    p.head_dim = layout.head_dim;
    p.block_size = layout.block_size;
    p.max_blocks_per_seq = batch.max_blocks_per_seq;
    p.scale = scale;
    return p;
  }

  // Sizes the split-KV kernels' partitions for `split_count` rows over contexts of at most
  // `split_max_context` keys, points them at the merge workspace, and launches p: in launches of
  // as many rows as the workspace holds.
  absl::Status LaunchSplitAttention(cuda::PagedAttentionParams& p, const KvLayout& layout,
                                    int split_count, int split_max_context) {
    const int num_heads = p.num_heads;
    const int64_t workspace_floats =
        options_.attention_workspace_bytes / static_cast<int64_t>(sizeof(float));
    auto partitions_of = [&](int tokens) { return (split_max_context + tokens - 1) / tokens; };
    // The merge workspace one row takes with partitions of `tokens` keys (0: no merge).
    auto row_floats = [&](int tokens) {
      return cuda::PagedAttentionWorkspaceFloats(1, num_heads, layout.head_dim,
                                                 partitions_of(tokens));
    };
    // Partitions of up to kAttentionPartitionTokens keys for the split-KV rows; halved (down to
    // the minimum) while the grid has fewer than two blocks per multiprocessor and the workspace
    // holds every row at the smaller partition, so that decode of a few sequences still spreads
    // over the whole GPU.
    int partition = cuda::kAttentionPartitionTokens;
    while (partition > cuda::kAttentionMinPartitionTokens &&
           int64_t{layout.num_kv_heads} * split_count * partitions_of(partition) <
               2 * int64_t{multiprocessors_} &&
           partitions_of(partition / 2) > partitions_of(partition) &&
           row_floats(partition / 2) * split_count <= workspace_floats) {
      partition /= 2;
    }
    p.partition_tokens = partition;
    p.max_partitions = partitions_of(partition);
    const int64_t row = row_floats(partition);
    if (row > 0 && split_count > 0) {
      const int64_t rows = std::min<int64_t>(workspace_floats / row, split_count);
      if (rows < 1) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "PagedAttention over ", split_max_context, " keys needs ", row * int64_t{sizeof(float)},
            " bytes of merge workspace per query row, and "
            "CudaBackendOptions.attention_workspace_bytes is ",
            options_.attention_workspace_bytes));
      }
      p.launch_rows = static_cast<int>(rows);
      const int64_t outs = rows * num_heads * p.max_partitions;
      p.partial_out = workspace_.get();
      p.partial_max = p.partial_out + outs * layout.head_dim;
      p.partial_sum = p.partial_max + outs;
    }
    return cuda::LaunchPagedAttention(p, stream_.get());
  }

  // staging_ into metadata_, queued on the stream. Through page-locked memory, so that the
  // host goes on queueing the step's kernels: an upload from pageable memory waits for the
  // stream (here, for the layers' kernels queued before the first attention). The page-locked
  // copy is rewritten only after the previous upload has read it (metadata_read_, recorded a
  // step earlier, so in practice no wait).
  absl::Status UploadMetadata() {
    const size_t bytes = sizeof(int32_t) * staging_.size();
    TANDEM_RETURN_IF_ERROR(
        CudaStatus(cudaEventSynchronize(metadata_read_.get()), "PagedAttention metadata upload"));
    std::memcpy(pinned_metadata_.get(), staging_.data(), bytes);
    TANDEM_RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(metadata_.get(), pinned_metadata_.get(), bytes,
                                   cudaMemcpyHostToDevice, stream_.get()),
                   "PagedAttention metadata upload"));
    return CudaStatus(cudaEventRecord(metadata_read_.get(), stream_.get()),
                      "PagedAttention metadata upload");
  }

  CudaBackendOptions options_;
  Stream stream_;
  DeviceArray<unsigned char> cublas_workspace_;  // the handle's, freed after it
  cuda::CublasHandle cublas_;
  std::unique_ptr<cuda::LtGemm> lt_;  // null for CudaBackendOptions::Gemm::kCublas
  DeviceArray<int32_t> metadata_;  // [MetadataInts()]
  PinnedInts pinned_metadata_;  // [MetadataInts()], page-locked: what the uploads read
  Event metadata_read_;         // recorded after the last upload from pinned_metadata_
  DeviceArray<float> workspace_;   // [attention_workspace_bytes / 4]
  std::vector<int32_t> staging_;   // host copy of the metadata, capacity MetadataInts()
  std::vector<int32_t> uploaded_;  // what metadata_ holds now
  std::vector<int32_t> tile_start_;     // host plan: tensor-core tiles per sequence (prefix)
  std::vector<int32_t> split_row_ids_;  // host plan: rows of the split-KV kernels
  // [x16_bytes_]: Linear's x rounded to 16 bits (prefill); shared with the graphs that use it.
  std::shared_ptr<unsigned char[]> x16_;
  int64_t x16_bytes_ = 0;
  int multiprocessors_ = 1;
  cuda::SampleRowsStaging sample_staging_;  // SampleRows' uploads
  absl::Status status_;
  bool capturing_ = false;  // inside CaptureGraph's record
};

}  // namespace

bool CudaBuilt() { return true; }

int64_t CudaAttentionWorkspaceBytes(int max_tokens, int num_heads, int head_dim,
                                    int max_context) {
  const int partitions =
      (std::max(max_context, 1) + cuda::kAttentionPartitionTokens - 1) /
      cuda::kAttentionPartitionTokens;
  const int64_t all =
      cuda::PagedAttentionWorkspaceFloats(std::max(max_tokens, 1), num_heads, head_dim, partitions);
  const int64_t one_row = cuda::PagedAttentionWorkspaceFloats(1, num_heads, head_dim, partitions);
  const int64_t budget = kAttentionWorkspaceBudgetBytes / static_cast<int64_t>(sizeof(float));
  return std::max(std::min(all, budget), one_row) * static_cast<int64_t>(sizeof(float));
}

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

absl::StatusOr<std::unique_ptr<CudaBackend>> CreateCudaBackend(const CudaBackendOptions& options) {
  int count = 0;
  const cudaError_t probe = cudaGetDeviceCount(&count);
  if (probe != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no CUDA device: ", probe == cudaSuccess ? "none found" : cudaGetErrorString(probe)));
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", options.device, " of ", count, " does not exist"));
  }
  if (options.max_seqs <= 0 || options.max_blocks_per_seq <= 0 ||
      options.attention_workspace_bytes < 0) {
    return absl::InvalidArgumentError("CudaBackendOptions bounds must be positive");
  }
  TANDEM_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options.device), "cudaSetDevice"));
  int multiprocessors = 1;
  TANDEM_RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, options.device),
      "cudaDeviceGetAttribute"));
  cudaStream_t raw_stream = nullptr;
  TANDEM_RETURN_IF_ERROR(
      CudaStatus(cudaStreamCreateWithFlags(&raw_stream, cudaStreamNonBlocking), "stream"));
  Stream stream(raw_stream);
  TANDEM_ASSIGN_OR_RETURN(DeviceArray<unsigned char> cublas_workspace,
                          DeviceAlloc<unsigned char>(cuda::kCublasWorkspaceBytes));
  TANDEM_ASSIGN_OR_RETURN(cuda::CublasHandle cublas,
                          cuda::CreateCublasHandle(raw_stream, cublas_workspace.get(),
                                                   cuda::kCublasWorkspaceBytes));
  std::unique_ptr<cuda::LtGemm> lt;
  if (options.gemm != CudaBackendOptions::Gemm::kCublas) {
    // The cuBLAS handle's workspace: both queue on the one stream.
    TANDEM_ASSIGN_OR_RETURN(
        lt, cuda::LtGemm::Create(cublas_workspace.get(), cuda::kCublasWorkspaceBytes));
  }
  TANDEM_ASSIGN_OR_RETURN(
      DeviceArray<int32_t> metadata,
      DeviceAlloc<int32_t>(MetadataInts(options)));
  void* pinned = nullptr;
  TANDEM_RETURN_IF_ERROR(CudaStatus(
      cudaMallocHost(&pinned, sizeof(int32_t) * MetadataInts(options)), "cudaMallocHost"));
  PinnedInts pinned_metadata(static_cast<int32_t*>(pinned));
  cudaEvent_t event = nullptr;
  TANDEM_RETURN_IF_ERROR(
      CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate"));
  Event metadata_read(event);
  TANDEM_ASSIGN_OR_RETURN(DeviceArray<float> workspace,
                          DeviceAlloc<float>(options.attention_workspace_bytes / 4));
  return std::make_unique<CudaBackendImpl>(
      options, multiprocessors, std::move(stream), std::move(cublas_workspace), std::move(cublas),
      std::move(lt), std::move(metadata),
      std::move(pinned_metadata), std::move(metadata_read), std::move(workspace));
}

}  // namespace tandem::kernels
