#include "tandem/engine/model_runner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/quantized_weights.h"

namespace tandem::engine {

// Vectors and biases are backend memory; an absent one is an empty buffer (null data()).
struct ModelRunner::Layer {
  kernels::DeviceBuffer input_norm;                // [hidden]
  kernels::DeviceBuffer post_attn_norm;            // [hidden]
  std::unique_ptr<kernels::PackedWeight> qkv;      // [(heads + 2 kv_heads) * head_dim, hidden]
  kernels::DeviceBuffer qkv_bias;                  // [(heads + 2 kv_heads) * head_dim] or empty
  kernels::DeviceBuffer q_norm, k_norm;            // [head_dim] or empty
  std::unique_ptr<kernels::PackedWeight> o;        // [hidden, heads * head_dim]
  kernels::DeviceBuffer o_bias;                    // [hidden] or empty
  std::unique_ptr<kernels::PackedWeight> gate_up;  // [2 * intermediate, hidden]
  std::unique_ptr<kernels::PackedWeight> down;     // [hidden, intermediate]
};

namespace {

// Rows [row_begin, row_begin + rows) and columns [col_begin, col_begin + cols) of tensor `name`
// (a 1-D tensor: elements [row_begin, row_begin + rows)) as elements of `dtype` (host bytes):
// the stored bytes when the checkpoint holds that type, else widened or rounded (to nearest
// even) from what it holds. Only the slice is read from the mapping (a rank of a
// tensor-parallel group touches its own rows and columns). rows / cols < 0: to the end.
absl::StatusOr<std::vector<unsigned char>> ReadSliceAs(const Checkpoint& checkpoint,
                                                       const std::string& name, DType dtype,
                                                       int64_t row_begin = 0, int64_t rows = -1,
                                                       int64_t col_begin = 0, int64_t cols = -1) {
  TANDEM_ASSIGN_OR_RETURN(TensorView tensor, checkpoint.Tensor(name));
  const int64_t total_rows = tensor.shape.empty() ? 1 : tensor.shape[0];
  const int64_t total_cols = tensor.shape.size() == 2 ? tensor.shape[1] : 1;
  if (rows < 0) rows = total_rows - row_begin;
  if (cols < 0) cols = total_cols - col_begin;
  if (row_begin < 0 || col_begin < 0 || row_begin + rows > total_rows ||
      col_begin + cols > total_cols) {
    return absl::InvalidArgumentError(
        absl::StrCat(tensor.file, ": tensor ", name, " has no slice of rows [", row_begin, ", ",
                     row_begin + rows, ") and columns [", col_begin, ", ", col_begin + cols, ")"));
  }
  const auto* data = static_cast<const unsigned char*>(tensor.data);
  const size_t out_size = DTypeSize(dtype);
  std::vector<unsigned char> out(static_cast<size_t>(rows * cols) * out_size);
  if (tensor.dtype == dtype) {
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(out.data() + static_cast<size_t>(r * cols) * out_size,
                  data + static_cast<size_t>((row_begin + r) * total_cols + col_begin) * out_size,
                  static_cast<size_t>(cols) * out_size);
    }
  } else {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float value =
            LoadAsFloat(data, tensor.dtype, (row_begin + r) * total_cols + col_begin + c);
        StoreFromFloat(out.data(), dtype, r * cols + c, value);
      }
    }
  }
  // Copied: the mapped pages need not stay resident while the next tensors load.
  checkpoint.DropPages(tensor);
  return out;
}

// A vector (bias) slice as fp32.
absl::StatusOr<std::vector<float>> ReadFloatSlice(const Checkpoint& checkpoint,
                                                  const std::string& name, int64_t begin,
                                                  int64_t count) {
  TANDEM_ASSIGN_OR_RETURN(std::vector<unsigned char> bytes,
                          ReadSliceAs(checkpoint, name, DType::kF32, begin, count));
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

// A step plan between the ranks of a tensor-parallel group: a header of kPlanHeader int32s
// (command, tokens, sequences, sampled rows, block-table width, block copies, attachment bytes),
// then, for a step, one payload of int32s: token ids, positions, slots, sampled rows (the
// planned ints, as the runner uploads them), query starts, context lengths, block tables, block
// copy pairs; then the attachment's bytes, if any (set_step_attachment).
constexpr int kPlanHeader = 7;
// The most attachment bytes a follower accepts with one step.
constexpr int32_t kMaxStepAttachment = 64 << 20;
enum PlanCommand : int32_t { kPlanStop = 0, kPlanStep = 1, kPlanSideChannel = 2 };

// A per-layer KV scale (vLLM's `self_attn.k_scale` / `v_scale` scalars) when the checkpoint has
// one, else 1.
absl::StatusOr<float> ReadKvScale(const Checkpoint& checkpoint, const std::string& name) {
  if (!checkpoint.Tensor(name).ok()) return 1.0f;
  TANDEM_ASSIGN_OR_RETURN(std::vector<float> values, checkpoint.ReadFloat(name));
  if (values.size() != 1 || !(values[0] > 0.0f) || !std::isfinite(values[0])) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be one positive finite value"));
  }
  return values[0];
}

}  // namespace

absl::StatusOr<RunnerDTypes> ResolveRunnerDTypes(const text::ModelConfig& config,
                                                 std::optional<DType> weight_dtype,
                                                 std::optional<DType> kv_cache_dtype) {
  RunnerDTypes out;
  out.weights = weight_dtype.value_or(config.torch_dtype);
  if (DTypeSize(out.weights) == 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--dtype ", DTypeFlagName(out.weights),
        " is not a weight type (auto, bfloat16, float16 or float32); 8-bit floats are for "
        "--kv-cache-dtype"));
  }
  out.kv_cache = kv_cache_dtype.value_or(out.weights);
  return out;
}

ModelRunner::~ModelRunner() {
  // The leader releases its followers (RunFollower returns OK); after a failure there is nobody
  // in step to tell.
  if (tensor_parallel() && comm_->rank() == 0 && comm_->health().ok()) {
    int32_t header[kPlanHeader] = {kPlanStop, 0, 0, 0, 0, 0, 0};
    comm_->Broadcast(header, sizeof(header), /*root=*/0).IgnoreError();
  }
}

int64_t ModelRunner::KvBytesPerBlock(const text::ModelConfig& config, int block_size,
                                     DType kv_dtype, int tp_size) {
  const KvCacheLayout layout{.num_layers = config.num_layers,
                             .num_blocks = 1,
                             .block_size = block_size,
                             .num_kv_heads = KvHeadsPerRank(config, tp_size),
                             .head_dim = config.head_dim,
                             .dtype = kv_dtype};
  return static_cast<int64_t>(layout.bytes_per_block());
}

namespace {

// What a follower takes from the leader when its runner is created, as int32s.
enum SettingsField {
  kMaxBatchedTokens,
  kMaxSeqs,
  kNumKvBlocks,
  kBlockSize,
  kWeightDType,  // -1: unset
  kKvDType,      // -1: unset
  // The model, so that ranks started on different checkpoints fail at start rather than
  // compute garbage.
  kLayers,
  kHidden,
  kVocab,
  kHeads,
  kSettingsFields
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(const Checkpoint& checkpoint,
                                                                 kernels::Backend* backend,
                                                                 const ModelRunnerOptions& input) {
  ModelRunnerOptions options = input;
  collective::Communicator* comm = options.tensor_parallel;
  collective::Communicator* device_comm = options.device_collective;
  if (comm != nullptr && comm->size() > 1) {
    if (!backend->host_memory() && device_comm == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor parallelism on the ", std::string(backend->name()),
          " backend needs a device communicator (NCCL) for the activations in device memory; "
          "the host communicator (", comm->kind(), ") carries only the step plans"));
    }
    if (device_comm != nullptr &&
        (device_comm->rank() != comm->rank() || device_comm->size() != comm->size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the device communicator is rank ", device_comm->rank(), " of ", device_comm->size(),
          ", the tensor-parallel group's rank ", comm->rank(), " of ", comm->size()));
    }
    const text::ModelConfig& c = checkpoint.config();
    std::vector<int32_t> settings(kSettingsFields);
    settings[kMaxBatchedTokens] = options.max_num_batched_tokens;
    settings[kMaxSeqs] = options.max_num_seqs;
    settings[kNumKvBlocks] = options.num_kv_blocks;
    settings[kBlockSize] = options.block_size;
    settings[kWeightDType] =
        options.weight_dtype ? static_cast<int32_t>(*options.weight_dtype) : -1;
    settings[kKvDType] =
        options.kv_cache_dtype ? static_cast<int32_t>(*options.kv_cache_dtype) : -1;
    settings[kLayers] = c.num_layers;
    settings[kHidden] = c.hidden_size;
    settings[kVocab] = c.vocab_size;
    settings[kHeads] = c.num_heads;
    const std::vector<int32_t> mine = settings;
    TANDEM_RETURN_IF_ERROR(
        comm->Broadcast(settings.data(), settings.size() * sizeof(int32_t), /*root=*/0));
    if (settings[kLayers] != mine[kLayers] || settings[kHidden] != mine[kHidden] ||
        settings[kVocab] != mine[kVocab] || settings[kHeads] != mine[kHeads]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor-parallel rank ", comm->rank(), " loaded a different model than rank 0 (",
          checkpoint.dir(), ": ", mine[kLayers], " layers, hidden ", mine[kHidden], ", vocab ",
          mine[kVocab], "; rank 0: ", settings[kLayers], ", ", settings[kHidden], ", ",
          settings[kVocab], ")"));
    }
    options.max_num_batched_tokens = settings[kMaxBatchedTokens];
    options.max_num_seqs = settings[kMaxSeqs];
    options.num_kv_blocks = settings[kNumKvBlocks];
    options.block_size = settings[kBlockSize];
    options.weight_dtype = settings[kWeightDType] < 0
                               ? std::nullopt
                               : std::optional<DType>(static_cast<DType>(settings[kWeightDType]));
    options.kv_cache_dtype = settings[kKvDType] < 0
                                 ? std::nullopt
                                 : std::optional<DType>(static_cast<DType>(settings[kKvDType]));
  }
  if (options.num_kv_blocks <= 0) {
    return absl::InvalidArgumentError("the KV cache needs at least one block");
  }
  if (options.max_num_batched_tokens <= 0 || options.max_num_seqs <= 0 ||
      options.max_logit_rows_per_seq <= 0) {
    return absl::InvalidArgumentError(
        "max_num_batched_tokens, max_num_seqs and max_logit_rows_per_seq must be positive");
  }
  std::unique_ptr<ModelRunner> runner(new ModelRunner());
  runner->config_ = checkpoint.config();
  runner->options_ = options;
  runner->backend_ = backend;
  const text::ModelConfig& c = runner->config_;
  if (comm != nullptr && comm->size() > 1) {
    runner->comm_ = comm;
    runner->device_comm_ = device_comm;
  }
  TANDEM_ASSIGN_OR_RETURN(runner->shard_, TensorParallelShard::For(c, comm ? comm->rank() : 0,
                                                                   comm ? comm->size() : 1));
  const TensorParallelShard& shard = runner->shard_;
  TANDEM_ASSIGN_OR_RETURN(RunnerDTypes dtypes,
                          ResolveRunnerDTypes(c, options.weight_dtype, options.kv_cache_dtype));
  runner->cache_layout_ = {.num_layers = c.num_layers,
                           .num_blocks = options.num_kv_blocks,
                           .block_size = options.block_size,
                           .num_kv_heads = shard.num_kv_heads,
                           .head_dim = c.head_dim,
                           .dtype = dtypes.kv_cache,
                           .kv_head_begin = shard.kv_head_begin,
                           .tp_size = shard.size};
  runner->kv_layout_ = runner->cache_layout_.kernel_layout();
  for (int l = 0; l < c.num_layers; ++l) {
    kernels::KvLayout layer = runner->kv_layout_;
    const std::string p = absl::StrCat("model.layers.", l, ".self_attn.");
    TANDEM_ASSIGN_OR_RETURN(layer.k_scale, ReadKvScale(checkpoint, p + "k_scale"));
    TANDEM_ASSIGN_OR_RETURN(layer.v_scale, ReadKvScale(checkpoint, p + "v_scale"));
    runner->layer_kv_layouts_.push_back(layer);
  }
  TANDEM_ASSIGN_OR_RETURN(runner->inv_freq_,
                          runner->Upload(kernels::RopeInverseFrequencies(c.rope)));
  TANDEM_RETURN_IF_ERROR(runner->LoadWeights(checkpoint, dtypes.weights));

  TANDEM_ASSIGN_OR_RETURN(runner->kv_cache_,
                          backend->Allocate(runner->cache_layout_.total_bytes()));

  const size_t t = options.max_num_batched_tokens;
  const size_t s =
      std::min<int64_t>(static_cast<int64_t>(options.max_num_seqs) * options.max_logit_rows_per_seq,
                        options.max_num_batched_tokens);
  runner->max_logit_rows_ = static_cast<int>(s);
  const size_t q_dim = static_cast<size_t>(shard.num_q_heads) * c.head_dim;
  const size_t kv_dim = static_cast<size_t>(shard.num_kv_heads) * c.head_dim;
  const size_t intermediate = shard.intermediate_size;
  TANDEM_ASSIGN_OR_RETURN(runner->step_ints_, backend->Allocate((3 * t + s) * sizeof(int32_t)));
  if (backend->host_memory()) {
    runner->planned_ints_ = runner->step_ints_.as<int32_t>();
  } else {
    runner->host_step_ints_.resize(3 * t + s);
    runner->planned_ints_ = runner->host_step_ints_.data();
    TANDEM_ASSIGN_OR_RETURN(runner->host_logits_,
                            backend->AllocateHostStaging(s * c.vocab_size * sizeof(float)));
  }
  runner->query_start_.resize(options.max_num_seqs + 1);
  runner->context_len_.resize(options.max_num_seqs);
  for (auto [buffer, floats] : {std::pair{&runner->residual_, t * c.hidden_size},
                                {&runner->hidden_, t * c.hidden_size},
                                {&runner->qkv_, t * (q_dim + 2 * kv_dim)},
                                {&runner->q_, t * q_dim},
                                {&runner->k_, t * kv_dim},
                                {&runner->v_, t * kv_dim},
                                {&runner->attn_, t * q_dim},
                                {&runner->proj_, t * c.hidden_size},
                                {&runner->gate_up_, t * 2 * intermediate},
                                {&runner->act_, t * intermediate},
                                {&runner->sampled_hidden_, s * c.hidden_size},
                                {&runner->logits_, s * c.vocab_size}}) {
    TANDEM_ASSIGN_OR_RETURN(*buffer, backend->Allocate(floats * sizeof(float)));
  }
  if (options.backend_sampling) {
    const size_t sampled_bytes =
        s * (1 + kernels::kMaxSampleLogprobs) * sizeof(kernels::TokenLogprob);
    TANDEM_ASSIGN_OR_RETURN(runner->sampled_, backend->Allocate(sampled_bytes));
    TANDEM_ASSIGN_OR_RETURN(
        runner->sample_scratch_,
        backend->Allocate(backend->SampleRowsScratchBytes(static_cast<int>(s), c.vocab_size,
                                                          options.max_sample_edits)));
    if (!backend->host_memory()) {
      TANDEM_ASSIGN_OR_RETURN(runner->host_sampled_, backend->AllocateHostStaging(sampled_bytes));
    }
    runner->sample_edits_.reserve(options.max_sample_edits);
  }
  if (options.max_blocks_per_seq < 0) {
    return absl::InvalidArgumentError("max_blocks_per_seq must not be negative");
  }
  if (!options.graph_batch_sizes.empty() && !runner->tensor_parallel()) {
    // Every token of a graph step yields logits.
    const int largest_allowed = static_cast<int>(std::min(t, s));
    for (int size : options.graph_batch_sizes) {
      if (size >= 1 && size <= largest_allowed) runner->graph_sizes_.push_back(size);
    }
    std::sort(runner->graph_sizes_.begin(), runner->graph_sizes_.end());
    runner->graph_sizes_.erase(
        std::unique(runner->graph_sizes_.begin(), runner->graph_sizes_.end()),
        runner->graph_sizes_.end());
  }
  if (!runner->graph_sizes_.empty()) {
    runner->graph_table_width_ = options.max_blocks_per_seq > 0
                                     ? std::min(options.max_blocks_per_seq, options.num_kv_blocks)
                                     : options.num_kv_blocks;
    const int64_t padded = runner->graph_sizes_.back();
    const size_t ints = 6 * padded + 1 + padded * runner->graph_table_width_;
    TANDEM_ASSIGN_OR_RETURN(runner->graph_ints_, backend->Allocate(ints * sizeof(int32_t)));
    // Zeros: a padding row reads entry 0 of its block table row, which must name a block.
    if (backend->host_memory()) {
      runner->graph_planned_ = runner->graph_ints_.as<int32_t>();
      std::fill_n(runner->graph_planned_, ints, 0);
    } else {
      runner->host_graph_ints_.assign(ints, 0);
      runner->graph_planned_ = runner->host_graph_ints_.data();
      backend->CopyToDevice(runner->graph_ints_.data(), runner->graph_planned_,
                            ints * sizeof(int32_t));
    }
  }
  if (runner->tensor_parallel()) {
    TANDEM_ASSIGN_OR_RETURN(runner->local_logits_,
                            backend->Allocate(s * shard.vocab_stride * sizeof(float)));
    TANDEM_ASSIGN_OR_RETURN(
        runner->gathered_logits_,
        backend->Allocate(s * shard.vocab_stride * shard.size * sizeof(float)));
  }
  // A device backend reports failed weight uploads here rather than on the first step.
  TANDEM_RETURN_IF_ERROR(backend->Synchronize());
  return runner;
}

absl::StatusOr<kernels::DeviceBuffer> ModelRunner::Upload(const std::vector<float>& values) {
  if (values.empty()) return kernels::DeviceBuffer();
  TANDEM_ASSIGN_OR_RETURN(kernels::DeviceBuffer buffer,
                          backend_->Allocate(values.size() * sizeof(float)));
  backend_->CopyToDevice(buffer.data(), values.data(), buffer.bytes());
  return buffer;
}

absl::Status ModelRunner::LoadWeights(const Checkpoint& checkpoint, DType weight_dtype) {
  const text::ModelConfig& c = config_;
  const TensorParallelShard& shard = shard_;
  weight_dtype_ = weight_dtype;
  auto pack = [&](const std::vector<unsigned char>& w, int n, int k) {
    return backend_->PackWeight(w.data(), weight_dtype, n, k);
  };
  // One module's part of a projection: rows [row_begin, + rows) and columns [col_begin, + cols)
  // of its W[out, in] (a column-parallel shard takes rows, a row-parallel one columns).
  struct Part {
    std::string module;
    int out;  // the module's W[out, in]
    int in;
    int row_begin;
    int rows;
    int col_begin = 0;
    int cols = -1;
  };
  // A projection of the modules' parts stacked along n: quantised (and kept so) when the
  // checkpoint stores them quantised, else in weight_dtype.
  const QuantizationConfig& quantization = checkpoint.quantization();
  auto load_projection = [&](std::initializer_list<Part> parts,
                             int k) -> absl::StatusOr<std::unique_ptr<kernels::PackedWeight>> {
    int quantized = 0;
    int n = 0;
    for (const Part& part : parts) {
      quantized += IsQuantizedLinear(quantization, part.module) ? 1 : 0;
      n += part.rows;
    }
    if (quantized == 0) {
      std::vector<unsigned char> w;
      for (const Part& part : parts) {
        TANDEM_ASSIGN_OR_RETURN(std::vector<unsigned char> bytes,
                                ReadSliceAs(checkpoint, part.module + ".weight", weight_dtype,
                                            part.row_begin, part.rows, part.col_begin, part.cols));
        w.insert(w.end(), bytes.begin(), bytes.end());
      }
      return pack(w, n, k);
    }
    if (quantized != static_cast<int>(parts.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(parts.begin()->module,
                       ": layers fused into one projection are quantised and unquantised both"));
    }
    // Unpacked whole, then cut to this rank's rows or inputs.
    std::vector<QuantizedMatrix> matrices;
    for (const Part& part : parts) {
      TANDEM_ASSIGN_OR_RETURN(QuantizedMatrix matrix,
                              ReadQuantizedMatrix(checkpoint, part.module, part.out, part.in));
      if (part.rows != part.out) {
        matrix = SliceQuantizedRows(matrix, part.row_begin, part.rows);
      }
      if (part.cols >= 0 && part.cols != part.in) {
        absl::StatusOr<QuantizedMatrix> cols =
            SliceQuantizedCols(matrix, part.col_begin, part.cols);
        if (!cols.ok()) {
          return absl::Status(cols.status().code(),
                              absl::StrCat(part.module, ": ", cols.status().message()));
        }
        matrix = std::move(cols).value();
      }
      matrices.push_back(std::move(matrix));
    }
    TANDEM_ASSIGN_OR_RETURN(QuantizedMatrix stacked, StackRows(std::move(matrices)));
    return backend_->PackQuantizedWeight(stacked.view());
  };
  // Reads a vector (norm weight, bias) into backend memory.
  auto read = [&](const std::string& name) -> absl::StatusOr<kernels::DeviceBuffer> {
    TANDEM_ASSIGN_OR_RETURN(std::vector<float> values, checkpoint.ReadFloat(name));
    return Upload(values);
  };
  const int hd = c.head_dim;
  {
    // The table stays in the weight type too; a step widens only the rows it looks up. A rank
    // of a tensor-parallel group holds its vocabulary rows and one row of zeros after them,
    // which the tokens of other ranks' rows look up.
    TANDEM_ASSIGN_OR_RETURN(std::vector<unsigned char> embed,
                            ReadSliceAs(checkpoint, "model.embed_tokens.weight", weight_dtype,
                                        shard.vocab_begin, shard.vocab_rows));
    if (tensor_parallel()) embed.resize(embed.size() + c.hidden_size * DTypeSize(weight_dtype), 0);
    TANDEM_ASSIGN_OR_RETURN(embed_, backend_->Allocate(embed.size()));
    backend_->CopyToDevice(embed_.data(), embed.data(), embed.size());
  }
  TANDEM_ASSIGN_OR_RETURN(final_norm_, read("model.norm.weight"));
  {
    // Padded with zero rows to vocab_stride under tensor parallelism (equal all-gather parts).
    TANDEM_ASSIGN_OR_RETURN(
        std::vector<unsigned char> lm_head,
        ReadSliceAs(checkpoint,
                    c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight",
                    weight_dtype, shard.vocab_begin, shard.vocab_rows));
    const int rows = tensor_parallel() ? shard.vocab_stride : c.vocab_size;
    lm_head.resize(static_cast<size_t>(rows) * c.hidden_size * DTypeSize(weight_dtype), 0);
    lm_head_ = pack(lm_head, rows, c.hidden_size);
  }
  const int q_begin = shard.q_head_begin * hd;
  const int q_dim = shard.num_q_heads * hd;
  const int kv_begin = shard.kv_head_begin * hd;
  const int kv_dim = shard.num_kv_heads * hd;
  const int i_begin = shard.intermediate_begin;
  const int inter = shard.intermediate_size;
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    auto layer = std::make_unique<Layer>();
    TANDEM_ASSIGN_OR_RETURN(layer->input_norm, read(p + "input_layernorm.weight"));
    TANDEM_ASSIGN_OR_RETURN(layer->post_attn_norm, read(p + "post_attention_layernorm.weight"));
    // q, k and v share their input, so one fused projection reads it once: this rank's heads.
    const int all_q = c.num_heads * hd;
    const int all_kv = c.num_kv_heads * hd;
    TANDEM_ASSIGN_OR_RETURN(
        layer->qkv,
        load_projection({{p + "self_attn.q_proj", all_q, c.hidden_size, q_begin, q_dim},
                         {p + "self_attn.k_proj", all_kv, c.hidden_size, kv_begin, kv_dim},
                         {p + "self_attn.v_proj", all_kv, c.hidden_size, kv_begin, kv_dim}},
                        c.hidden_size));
    std::vector<float> qkv_bias;
    if (c.attention_bias) {
      for (auto [name, begin, count] : {std::tuple{"q_proj", q_begin, q_dim},
                                        {"k_proj", kv_begin, kv_dim},
                                        {"v_proj", kv_begin, kv_dim}}) {
        TANDEM_ASSIGN_OR_RETURN(
            std::vector<float> b,
            ReadFloatSlice(checkpoint, absl::StrCat(p, "self_attn.", name, ".bias"), begin, count));
        qkv_bias.insert(qkv_bias.end(), b.begin(), b.end());
      }
    }
    TANDEM_ASSIGN_OR_RETURN(layer->qkv_bias, Upload(qkv_bias));
    if (c.qk_norm) {
      TANDEM_ASSIGN_OR_RETURN(layer->q_norm, read(p + "self_attn.q_norm.weight"));
      TANDEM_ASSIGN_OR_RETURN(layer->k_norm, read(p + "self_attn.k_norm.weight"));
    }
    // Row-parallel: this rank's input columns; the partial outputs are summed across ranks.
    TANDEM_ASSIGN_OR_RETURN(
        layer->o,
        load_projection(
            {{p + "self_attn.o_proj", c.hidden_size, all_q, 0, c.hidden_size, q_begin, q_dim}},
            q_dim));
    // The bias is added once, by rank 0, before the sum.
    if (c.o_proj_bias && shard.rank == 0) {
      TANDEM_ASSIGN_OR_RETURN(layer->o_bias, read(p + "self_attn.o_proj.bias"));
    }
    const int all_inter = c.intermediate_size;
    TANDEM_ASSIGN_OR_RETURN(
        layer->gate_up,
        load_projection({{p + "mlp.gate_proj", all_inter, c.hidden_size, i_begin, inter},
                         {p + "mlp.up_proj", all_inter, c.hidden_size, i_begin, inter}},
                        c.hidden_size));
    TANDEM_ASSIGN_OR_RETURN(
        layer->down,
        load_projection(
            {{p + "mlp.down_proj", c.hidden_size, all_inter, 0, c.hidden_size, i_begin, inter}},
            inter));
    layers_.push_back(std::move(layer));
  }
  return absl::OkStatus();
}

void ModelRunner::CopyBlock(int32_t src, int32_t dst) {
  // The block in each layer's K and V halves: 2 x layers rows, one half apart.
  const KvCacheLayout& l = cache_layout_;
  char* cache = static_cast<char*>(kv_cache_.data());
  backend_->CopyRows(cache + l.Offset(0, 0, dst), l.half_bytes(), cache + l.Offset(0, 0, src),
                     l.half_bytes(), l.block_bytes(), 2 * l.num_layers);
}

absl::Status ModelRunner::SendPlan(int tokens, int num_seqs, int num_sampled, int max_blocks,
                                   const std::vector<std::pair<int32_t, int32_t>>& block_copies,
                                   const std::string& attachment) {
  if (attachment.size() > static_cast<size_t>(kMaxStepAttachment)) {
    return absl::InvalidArgumentError(absl::StrCat("a step attachment of ", attachment.size(),
                                                   " bytes exceeds ", kMaxStepAttachment));
  }
  int32_t header[kPlanHeader] = {kPlanStep,
                                 tokens,
                                 num_seqs,
                                 num_sampled,
                                 max_blocks,
                                 static_cast<int32_t>(block_copies.size()),
                                 static_cast<int32_t>(attachment.size())};
  TANDEM_RETURN_IF_ERROR(comm_->Broadcast(header, sizeof(header), /*root=*/0));
  plan_.clear();
  plan_.insert(plan_.end(), planned_ints_, planned_ints_ + 3 * tokens + num_sampled);
  plan_.insert(plan_.end(), query_start_.begin(), query_start_.begin() + num_seqs + 1);
  plan_.insert(plan_.end(), context_len_.begin(), context_len_.begin() + num_seqs);
  plan_.insert(plan_.end(), block_table_.begin(),
               block_table_.begin() + static_cast<size_t>(num_seqs) * max_blocks);
  for (const auto& [src, dst] : block_copies) {
    plan_.push_back(src);
    plan_.push_back(dst);
  }
  TANDEM_RETURN_IF_ERROR(comm_->Broadcast(plan_.data(), plan_.size() * sizeof(int32_t), 0));
  if (attachment.empty()) return absl::OkStatus();
  return comm_->Broadcast(const_cast<char*>(attachment.data()), attachment.size(), /*root=*/0);
}

absl::StatusOr<std::vector<std::string>> ModelRunner::SideChannel(std::string bytes) {
  if (!tensor_parallel() || comm_->rank() != 0) {
    return absl::FailedPreconditionError("the side channel is rank 0's, with followers");
  }
  if (bytes.empty() || bytes.size() > static_cast<size_t>(kMaxStepAttachment)) {
    return absl::InvalidArgumentError(
        absl::StrCat("side-channel bytes must be 1..", kMaxStepAttachment));
  }
  int32_t header[kPlanHeader] = {kPlanSideChannel, 0, 0, 0, 0, 0,
                                 static_cast<int32_t>(bytes.size())};
  TANDEM_RETURN_IF_ERROR(comm_->Broadcast(header, sizeof(header), /*root=*/0));
  TANDEM_RETURN_IF_ERROR(comm_->Broadcast(bytes.data(), bytes.size(), /*root=*/0));
  TANDEM_RETURN_IF_ERROR(ExchangeStepReports(std::string()));
  return step_reports_;
}

absl::Status ModelRunner::ExchangeStepReports(std::string mine) {
  if (mine.size() > kMaxStepReportBytes) mine.resize(kMaxStepReportBytes);
  TANDEM_ASSIGN_OR_RETURN(std::vector<std::string> all,
                          comm_->AllGatherBytes(mine, kMaxStepReportBytes));
  if (comm_->rank() != 0) return absl::OkStatus();
  step_reports_.assign(std::make_move_iterator(all.begin() + 1),
                       std::make_move_iterator(all.end()));
  return absl::OkStatus();
}

absl::Status ModelRunner::FollowerReceiveAttachment(int32_t bytes) {
  std::string attachment(static_cast<size_t>(bytes), '\0');
  TANDEM_RETURN_IF_ERROR(comm_->Broadcast(attachment.data(), attachment.size(), 0));
  if (follower_hooks_.begin) follower_hooks_.begin(attachment);
  return absl::OkStatus();
}

absl::Status ModelRunner::FollowerReport() {
  return ExchangeStepReports(follower_hooks_.end ? follower_hooks_.end() : std::string());
}

absl::Status ModelRunner::RunFollower() {
  if (!tensor_parallel() || comm_->rank() == 0) {
    return absl::FailedPreconditionError("RunFollower is for ranks 1.. of a tensor-parallel group");
  }
  std::vector<std::pair<int32_t, int32_t>> block_copies;
  while (true) {
    int32_t header[kPlanHeader];
    // The leader may idle for as long as no request comes; its death still ends the wait.
    TANDEM_RETURN_IF_ERROR(
        comm_->Broadcast(header, sizeof(header), /*root=*/0, absl::InfiniteDuration()));
    if (header[0] == kPlanStop) return absl::OkStatus();
    if (header[0] == kPlanSideChannel) {
      // Bytes without a step: the hooks run back to back, and the reports go back.
      const int32_t bytes = header[6];
      if (bytes <= 0 || bytes > kMaxStepAttachment) {
        return absl::InternalError(absl::StrCat("tensor-parallel rank ", comm_->rank(),
                                                ": malformed side-channel plan from rank 0"));
      }
      TANDEM_RETURN_IF_ERROR(FollowerReceiveAttachment(bytes));
      TANDEM_RETURN_IF_ERROR(FollowerReport());
      continue;
    }
    const int tokens = header[1], num_seqs = header[2], num_sampled = header[3],
              max_blocks = header[4], num_copies = header[5], attachment_bytes = header[6];
    if (header[0] != kPlanStep || tokens < 0 || tokens > options_.max_num_batched_tokens ||
        num_seqs < 0 || num_seqs > options_.max_num_seqs || num_sampled < 0 ||
        num_sampled > max_logit_rows_ || max_blocks < 0 || max_blocks > options_.num_kv_blocks ||
        num_copies < 0 || num_copies > options_.num_kv_blocks || attachment_bytes < 0 ||
        attachment_bytes > kMaxStepAttachment) {
      return absl::InternalError(absl::StrCat("tensor-parallel rank ", comm_->rank(),
                                              ": malformed step plan from rank 0"));
    }
    const size_t ints = 3 * static_cast<size_t>(tokens) + num_sampled;
    const size_t table = static_cast<size_t>(num_seqs) * max_blocks;
    plan_.resize(ints + (num_seqs + 1) + num_seqs + table + 2 * static_cast<size_t>(num_copies));
    TANDEM_RETURN_IF_ERROR(comm_->Broadcast(plan_.data(), plan_.size() * sizeof(int32_t), 0));
    const int32_t* p = plan_.data();
    std::copy(p, p + ints, planned_ints_);
    p += ints;
    query_start_.assign(p, p + num_seqs + 1);
    p += num_seqs + 1;
    context_len_.assign(p, p + num_seqs);
    p += num_seqs;
    block_table_.assign(p, p + table);
    p += table;
    block_copies.clear();
    for (int i = 0; i < num_copies; ++i, p += 2) block_copies.emplace_back(p[0], p[1]);
    if (attachment_bytes > 0) TANDEM_RETURN_IF_ERROR(FollowerReceiveAttachment(attachment_bytes));
    TANDEM_RETURN_IF_ERROR(Forward(tokens, num_seqs, max_blocks, num_sampled, config_.num_layers,
                                   /*layer_hook=*/true, block_copies)
                               .status());
    if (attachment_bytes > 0) TANDEM_RETURN_IF_ERROR(FollowerReport());
  }
}

absl::StatusOr<std::span<const float>> ModelRunner::Execute(const SchedulerStep& step) {
  const int num_seqs = static_cast<int>(step.seqs.size());
  int tokens = 0;
  int rows = 0;
  for (const ScheduledSequence& s : step.seqs) {
    tokens += s.num_new_tokens;
    if (s.samples) rows += 1 + s.num_draft_tokens;
    if (s.num_draft_tokens < 0 || s.num_draft_tokens >= s.num_new_tokens ||
        s.num_draft_tokens > static_cast<int>(s.seq->draft_tokens.size())) {
      return absl::InvalidArgumentError(absl::StrCat("a sequence of ", s.num_new_tokens,
                                                     " new tokens cannot run ", s.num_draft_tokens,
                                                     " draft tokens"));
    }
  }
  if (tokens > options_.max_num_batched_tokens || num_seqs > options_.max_num_seqs ||
      rows > max_logit_rows_) {
    return absl::InvalidArgumentError(absl::StrCat("step of ", tokens, " tokens, ", num_seqs,
                                                   " sequences and ", rows,
                                                   " logit rows exceeds the runner"));
  }
  if (tensor_parallel() && comm_->rank() != 0) {
    return absl::FailedPreconditionError("only rank 0 of a tensor-parallel group plans steps");
  }
  const bool sample_in_backend = std::exchange(sample_pending_, false);
  if (sample_in_backend &&
      (static_cast<int>(sample_rows_.size()) != rows ||
       std::any_of(sample_host_rows_.begin(), sample_host_rows_.end(),
                   [&](int32_t r) { return r < 0 || r >= rows; }))) {
    return absl::InternalError(absl::StrCat("backend sampling of ", sample_rows_.size(),
                                            " rows for a step of ", rows, " logit rows"));
  }
  if (!tensor_parallel()) {
    if (const int padded = GraphBatchSize(step); padded > 0) {
      return ExecuteGraphStep(step, padded, sample_in_backend);
    }
  }

  // Flatten the step on the host: tokens of every sequence back to back.
  int max_blocks = 0;
  for (const ScheduledSequence& s : step.seqs) {
    max_blocks = std::max(max_blocks, static_cast<int>(s.seq->block_table.size()));
  }
  block_table_.assign(static_cast<size_t>(num_seqs) * max_blocks, 0);
  int32_t* token_ids = planned_ints_;
  int32_t* positions = token_ids + tokens;
  int32_t* slots = positions + tokens;
  int32_t* sample_rows = slots + tokens;
  int t = 0;
  int num_sampled = 0;
  query_start_[0] = 0;
  for (int i = 0; i < num_seqs; ++i) {
    const Sequence& seq = *step.seqs[i].seq;
    const int begin = seq.num_computed_tokens;
    const int end = begin + step.seqs[i].num_new_tokens;
    PlanTokens(seq, begin, end, token_ids + t, positions + t, slots + t);
    t += end - begin;
    query_start_[i + 1] = t;
    context_len_[i] = end;
    std::copy(seq.block_table.begin(), seq.block_table.end(),
              block_table_.begin() + static_cast<size_t>(i) * max_blocks);
    if (step.seqs[i].samples) {
      for (int r = step.seqs[i].num_draft_tokens; r >= 0; --r)
        sample_rows[num_sampled++] = t - 1 - r;
    }
  }
  if (!tensor_parallel()) {
    return Forward(tokens, num_seqs, max_blocks, num_sampled, config_.num_layers,
                   /*layer_hook=*/true, step.block_copies, sample_in_backend);
  }
  const std::string attachment = std::move(step_attachment_);
  step_attachment_.clear();
  TANDEM_RETURN_IF_ERROR(
      SendPlan(tokens, num_seqs, num_sampled, max_blocks, step.block_copies, attachment));
  absl::StatusOr<std::span<const float>> logits =
      Forward(tokens, num_seqs, max_blocks, num_sampled, config_.num_layers,
              /*layer_hook=*/true, step.block_copies, sample_in_backend);
  if (!logits.ok() || attachment.empty()) return logits;
  TANDEM_RETURN_IF_ERROR(ExchangeStepReports(std::string()));
  return logits;
}

void ModelRunner::PlanTokens(const Sequence& seq, int begin, int end, int32_t* token_ids,
                             int32_t* positions, int32_t* slots) const {
  const int bs = kv_layout_.block_size;
  const int known = static_cast<int>(seq.tokens.size());
  for (int pos = begin; pos < end; ++pos) {
    // Past the known tokens: the draft tokens being verified (or drafted).
    const int i = pos - begin;
    token_ids[i] = pos < known ? seq.tokens[pos] : seq.draft_tokens[pos - known];
    positions[i] = pos;
    slots[i] = seq.block_table[pos / bs] * bs + pos % bs;
  }
}

int ModelRunner::GraphBatchSize(const SchedulerStep& step) const {
  if (graph_sizes_.empty() || step.seqs.empty() || layer_written_hook_) return 0;
  const int64_t max_context = int64_t{graph_table_width_} * kv_layout_.block_size;
  int tokens = 0;
  for (const ScheduledSequence& s : step.seqs) {
    // Decode (one token) or speculative verification (the last token and its drafts): every
    // new token yields logits.
    if (!s.samples || s.num_new_tokens != 1 + s.num_draft_tokens ||
        s.num_new_tokens > options_.max_logit_rows_per_seq ||
        s.seq->num_computed_tokens + s.num_new_tokens > max_context) {
      return 0;
    }
    tokens += s.num_new_tokens;
  }
  if (tokens > graph_sizes_.back()) return 0;
  return *std::lower_bound(graph_sizes_.begin(), graph_sizes_.end(), tokens);
}

ModelRunner::StepArgs ModelRunner::GraphStepArgs(int padded, int context_blocks) const {
  const int32_t* ints = graph_ints_.as<int32_t>();
  StepArgs a{.tokens = padded,
             .num_sampled = padded,
             .num_layers = config_.num_layers,
             .layer_hook = false,
             .token_ids = ints,
             .positions = ints + padded,
             .slots = ints + 2 * padded,
             .sample_rows = ints + 3 * padded};
  const int32_t* query_start = ints + 4 * padded;
  a.batch = {.num_seqs = padded,
             .max_blocks_per_seq = graph_table_width_,
             .on_device = true,
             .device_query_start = query_start,
             .device_context_len = query_start + padded + 1,
             .device_block_table = query_start + 2 * padded + 1,
             .num_tokens = padded,
             .max_query_len = options_.max_logit_rows_per_seq,
             .max_context_len = context_blocks * kv_layout_.block_size};
  return a;
}

absl::StatusOr<std::span<const float>> ModelRunner::ExecuteGraphStep(const SchedulerStep& step,
                                                                     int padded,
                                                                     bool sample_in_backend) {
  kernels::Backend& b = *backend_;
  const int n = static_cast<int>(step.seqs.size());
  const int bs = kv_layout_.block_size;
  const int width = graph_table_width_;
  int32_t* ids = graph_planned_;
  int32_t* positions = ids + padded;
  int32_t* slots = positions + padded;
  int32_t* sample_rows = slots + padded;
  int32_t* query_start = sample_rows + padded;
  int32_t* context_len = query_start + padded + 1;
  int32_t* table = context_len + padded;
  // The step's sequences first, their tokens back to back (every token a sample row), then one
  // padding sequence per remaining token, then sequences of no token up to `padded` of them.
  int max_context = 1;
  int t = 0;
  for (int i = 0; i < n; ++i) {
    const Sequence& seq = *step.seqs[i].seq;
    const int begin = seq.num_computed_tokens;
    const int end = begin + step.seqs[i].num_new_tokens;
    query_start[i] = t;
    PlanTokens(seq, begin, end, ids + t, positions + t, slots + t);
    t += end - begin;
    context_len[i] = end;
    max_context = std::max(max_context, end);
    std::copy(seq.block_table.begin(), seq.block_table.end(),
              table + static_cast<int64_t>(i) * width);
  }
  const int real_tokens = t;
  for (int i = n; i < padded; ++i) {
    query_start[i] = t;
    // Padding: token 0 at position 0 over a context of one key (entry 0 of its table row,
    // some block), writing no KV; its logits are never read.
    context_len[i] = 1;
    if (t == padded) continue;  // no token left: an empty sequence
    ids[t] = 0;
    positions[t] = 0;
    slots[t] = -1;
    ++t;
  }
  query_start[padded] = padded;
  std::iota(sample_rows, sample_rows + padded, 0);
  for (const auto& [src, dst] : step.block_copies) CopyBlock(src, dst);
  if (graph_planned_ != graph_ints_.as<int32_t>()) {
    // Through the real rows' block table rows: the padding rows' entries stay as they were.
    const int64_t ints = (table - graph_planned_) + static_cast<int64_t>(n) * width;
    b.CopyToDevice(graph_ints_.data(), graph_planned_, ints * sizeof(int32_t));
  }
  int context_blocks = kGraphMinContextBlocks;
  while (context_blocks * bs < max_context) context_blocks *= 2;
  context_blocks = std::min(context_blocks, width);
  const StepArgs args = GraphStepArgs(padded, context_blocks);
  auto [it, first] = graphs_.try_emplace({padded, context_blocks});
  if (it->second != nullptr) {
    TANDEM_RETURN_IF_ERROR(it->second->Launch());
    ++graph_replays_;
  } else {
    TANDEM_RETURN_IF_ERROR(QueueModel(args));
    if (first) {
      // Capture once the eager run has queued: anything it allocated on first use (cuBLAS
      // plans, kernel attributes) is in place.
      absl::StatusOr<std::unique_ptr<kernels::Backend::StepGraph>> graph =
          b.CaptureGraph([&] { return QueueModel(args); });
      if (graph.ok()) {
        it->second = std::move(graph).value();
        ++graphs_captured_;
      } else if (absl::IsUnimplemented(graph.status())) {
        graph_sizes_.clear();  // this backend has none: every later step runs eagerly
      } else {
        std::fprintf(stderr,
                     "tandem: decode steps of %d tokens over contexts of up to %d tokens run "
                     "without a step graph: %s\n",
                     padded, context_blocks * bs, std::string(graph.status().message()).c_str());
      }
    }
  }
  last_sampled_rows_ = real_tokens;
  return FinishStep(real_tokens, sample_in_backend);
}

void ModelRunner::set_backend_sampling(std::span<const kernels::SampleRowParams> rows,
                                       std::span<const kernels::LogitEdit> edits,
                                       std::span<const int32_t> host_rows) {
  TANDEM_CHECK(options_.backend_sampling) << "backend sampling on a runner not sized for it";
  TANDEM_CHECK(static_cast<int>(edits.size()) <= options_.max_sample_edits)
      << edits.size() << " logit edits, over max_sample_edits " << options_.max_sample_edits;
  sample_rows_.assign(rows.begin(), rows.end());
  sample_edits_.assign(edits.begin(), edits.end());
  sample_host_rows_.assign(host_rows.begin(), host_rows.end());
  sample_pending_ = true;
}

ModelRunner::BackendSamples ModelRunner::backend_samples() const {
  const auto* base = (backend_->host_memory() ? sampled_ : host_sampled_)
                         .as<const kernels::TokenLogprob>();
  const size_t rows = last_backend_rows_;
  return {.tokens = {base, rows},
          .top = {base + max_logit_rows_, rows * kernels::kMaxSampleLogprobs}};
}

absl::StatusOr<std::span<const float>> ModelRunner::FinalHidden() {
  const size_t count = static_cast<size_t>(last_sampled_rows_) * config_.hidden_size;
  const float* hidden = sampled_hidden_.as<float>();
  if (!backend_->host_memory()) {
    host_hidden_.resize(count);
    backend_->CopyToHost(host_hidden_.data(), hidden, count * sizeof(float));
    TANDEM_RETURN_IF_ERROR(backend_->Synchronize());
    hidden = host_hidden_.data();
  }
  return std::span<const float>(hidden, count);
}

absl::StatusOr<std::span<const float>> ModelRunner::ExecuteDraft(
    const SchedulerStep& step, int offset, int num_layers,
    const std::vector<std::pair<int32_t, int32_t>>& block_copies) {
  std::vector<TokenRun> runs;
  for (const ScheduledSequence& s : step.seqs) {
    if (s.num_draft_tokens <= offset) continue;
    // The sequence's last real token, then the draft tokens proposed so far.
    const int pos = static_cast<int>(s.seq->tokens.size()) - 1 + offset;
    runs.push_back({.seq = s.seq, .begin = pos, .end = pos + 1, .sample = true});
  }
  return ExecuteRuns(runs, num_layers, block_copies);
}

absl::StatusOr<std::span<const float>> ModelRunner::ExecuteRuns(
    std::span<const TokenRun> runs, int num_layers,
    const std::vector<std::pair<int32_t, int32_t>>& block_copies) {
  if (num_layers < 1 || num_layers > config_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("a draft pass of ", num_layers, " layers on a model of ", config_.num_layers));
  }
  if (tensor_parallel()) {
    return absl::FailedPreconditionError("draft passes do not run on a tensor-parallel group");
  }
  const int bs = kv_layout_.block_size;
  const int num_seqs = static_cast<int>(runs.size());
  int tokens = 0;
  int rows = 0;
  int max_blocks = 0;
  for (const TokenRun& r : runs) {
    const int known = static_cast<int>(r.seq->tokens.size());
    if (r.begin < 0 || r.end <= r.begin ||
        r.end > known + static_cast<int>(r.seq->draft_tokens.size()) ||
        (r.end + bs - 1) / bs > static_cast<int>(r.seq->block_table.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a draft run of positions [", r.begin, ", ", r.end, ") on a sequence of ", known,
          " tokens, ", r.seq->draft_tokens.size(), " drafts and ", r.seq->block_table.size(),
          " blocks"));
    }
    tokens += r.end - r.begin;
    rows += r.sample ? 1 : 0;
    max_blocks = std::max(max_blocks, static_cast<int>(r.seq->block_table.size()));
  }
  if (num_seqs == 0) {
    CopyBlocks(block_copies);
    return std::span<const float>();
  }
  if (tokens > options_.max_num_batched_tokens || num_seqs > options_.max_num_seqs ||
      rows > max_logit_rows_) {
    return absl::InvalidArgumentError(absl::StrCat("a draft pass of ", tokens, " tokens, ",
                                                   num_seqs, " sequences and ", rows,
                                                   " logit rows exceeds the runner"));
  }
  block_table_.assign(static_cast<size_t>(num_seqs) * max_blocks, 0);
  int32_t* token_ids = planned_ints_;
  int32_t* positions = token_ids + tokens;
  int32_t* slots = positions + tokens;
  int32_t* sample_rows = slots + tokens;
  int t = 0;
  int num_sampled = 0;
  query_start_[0] = 0;
  for (int i = 0; i < num_seqs; ++i) {
    const TokenRun& r = runs[i];
    const Sequence& seq = *r.seq;
    PlanTokens(seq, r.begin, r.end, token_ids + t, positions + t, slots + t);
    t += r.end - r.begin;
    query_start_[i + 1] = t;
    context_len_[i] = r.end;
    std::copy(seq.block_table.begin(), seq.block_table.end(),
              block_table_.begin() + static_cast<size_t>(i) * max_blocks);
    if (r.sample) sample_rows[num_sampled++] = t - 1;
  }
  return Forward(tokens, num_seqs, max_blocks, num_sampled, num_layers, /*layer_hook=*/false,
                 block_copies);
}

absl::StatusOr<std::span<const float>> ModelRunner::Forward(
    int tokens, int num_seqs, int max_blocks, int num_sampled, int num_layers, bool layer_hook,
    const std::vector<std::pair<int32_t, int32_t>>& block_copies, bool sample_in_backend) {
  const TensorParallelShard& shard = shard_;
  kernels::Backend& b = *backend_;
  for (const auto& [src, dst] : block_copies) CopyBlock(src, dst);
  if (tensor_parallel()) {
    // This rank's embedding rows, or its row of zeros (after them) for another rank's token.
    for (int i = 0; i < tokens; ++i) {
      const int32_t local = planned_ints_[i] - shard.vocab_begin;
      planned_ints_[i] = local >= 0 && local < shard.vocab_rows ? local : shard.vocab_rows;
    }
  }
  // The same offsets in backend memory; one upload when that is not the host's.
  StepArgs a{.tokens = tokens, .num_sampled = num_sampled, .num_layers = num_layers,
             .layer_hook = layer_hook};
  a.token_ids = step_ints_.as<int32_t>();
  a.positions = a.token_ids + tokens;
  a.slots = a.positions + tokens;
  a.sample_rows = a.slots + tokens;
  if (planned_ints_ != step_ints_.as<int32_t>()) {
    b.CopyToDevice(step_ints_.data(), planned_ints_, (3 * tokens + num_sampled) * sizeof(int32_t));
  }
  a.batch = {num_seqs, query_start_.data(), context_len_.data(), block_table_.data(), max_blocks};
  TANDEM_RETURN_IF_ERROR(QueueModel(a));
  last_sampled_rows_ = num_sampled;
  if (num_sampled == 0) {
    TANDEM_RETURN_IF_ERROR(b.Synchronize());
    return std::span<const float>();
  }
  return FinishStep(num_sampled, sample_in_backend);
}

absl::Status ModelRunner::QueueModel(const StepArgs& a) {
  const text::ModelConfig& c = config_;
  const TensorParallelShard& shard = shard_;
  kernels::Backend& b = *backend_;
  const int tokens = a.tokens;
  const int num_sampled = a.num_sampled;
  const int hidden = c.hidden_size;
  const int num_heads = shard.num_q_heads;
  const int intermediate = shard.intermediate_size;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  float* residual = residual_.as<float>();
  float* hidden_states = hidden_.as<float>();
  float* qkv = qkv_.as<float>();
  float* q = q_.as<float>();
  float* k = k_.as<float>();
  float* v = v_.as<float>();
  float* attn = attn_.as<float>();
  float* proj = proj_.as<float>();
  float* gate_up = gate_up_.as<float>();
  float* act = act_.as<float>();
  const float* inv_freq = inv_freq_.as<float>();
  // Sums a row-parallel output (or the vocabulary-parallel embedding) over the group, in
  // backend memory: over the device communicator when there is one (queued on the backend's
  // stream after the kernels that wrote `x`), else over the host one.
  auto all_reduce = [&](float* x) -> absl::Status {
    if (!tensor_parallel()) return absl::OkStatus();
    return activations_comm().AllReduceSum(x, static_cast<size_t>(tokens) * hidden);
  };

  b.Embedding(embed_.data(), weight_dtype_, a.token_ids, tokens, hidden, residual);
  TANDEM_RETURN_IF_ERROR(all_reduce(residual));
  // Whether a projection's output is added to the residual stream by the GEMM itself
  // (Backend::LinearAdd: cuBLASLt's epilogue on the GPU past decode sizes) rather than written
  // to proj for AddRmsNorm to add. Not with tensor parallelism, whose partial sums must be
  // all-reduced before they are added; not for the last layer's down projection, which
  // GatherAdd adds for the sampled rows only.
  auto adds_in_linear = [&](const kernels::PackedWeight& w) {
    return !tensor_parallel() && b.LinearAdds(tokens, w);
  };
  bool proj_added = false;  // the last down projection went straight into residual
  for (int l = 0; l < a.num_layers; ++l) {
    Layer& layer = *layers_[l];
    // The inputs of the layer's Linears stored in the dtype the backend would round them to
    // (Backend::ActivationDType: 16-bit on CUDA past decode sizes), fp32 otherwise.
    const DType qkv_in = b.ActivationDType(tokens, *layer.qkv);
    const DType o_in = b.ActivationDType(tokens, *layer.o);
    const DType gate_up_in = b.ActivationDType(tokens, *layer.gate_up);
    const DType down_in = b.ActivationDType(tokens, *layer.down);
    if (l == 0 || proj_added) {
      b.RmsNorm(residual, layer.input_norm.as<float>(), c.rms_norm_eps, tokens, hidden,
                hidden_states, qkv_in);
    } else {
      b.AddRmsNorm(residual, proj, layer.input_norm.as<float>(), c.rms_norm_eps, tokens, hidden,
                   hidden_states, qkv_in);
    }
    b.Linear(hidden_states, qkv_in, tokens, *layer.qkv, layer.qkv_bias.as<float>(), qkv);
    // [tokens, q | k | v] to q and the cache: q and k per-head normed (Qwen3) and rotated.
    void* cache = layer_cache(l);
    const kernels::KvLayout& kv_layout = layer_kv_layouts_[l];
    b.AttentionInputs(qkv, tokens, num_heads, c.qk_norm ? layer.q_norm.as<float>() : nullptr,
                      c.qk_norm ? layer.k_norm.as<float>() : nullptr, c.rms_norm_eps,
                      a.positions, inv_freq, a.slots, kv_layout, cache, q, k, v);
    if (a.layer_hook && layer_written_hook_) {
      if (!b.host_memory()) TANDEM_RETURN_IF_ERROR(b.Synchronize());
      layer_written_hook_(l);
    }
    b.PagedAttention(q, cache, kv_layout, a.batch, num_heads, scale, attn, o_in);
    if (adds_in_linear(*layer.o)) {
      b.LinearAdd(attn, o_in, tokens, *layer.o, layer.o_bias.as<float>(), residual);
      b.RmsNorm(residual, layer.post_attn_norm.as<float>(), c.rms_norm_eps, tokens, hidden,
                hidden_states, gate_up_in);
    } else {
      b.Linear(attn, o_in, tokens, *layer.o, layer.o_bias.as<float>(), proj);
      TANDEM_RETURN_IF_ERROR(all_reduce(proj));
      b.AddRmsNorm(residual, proj, layer.post_attn_norm.as<float>(), c.rms_norm_eps, tokens, hidden,
                   hidden_states, gate_up_in);
    }
    b.Linear(hidden_states, gate_up_in, tokens, *layer.gate_up, nullptr, gate_up);
    b.SiluMul(gate_up, tokens, intermediate, act, down_in);
    proj_added = l + 1 < a.num_layers && adds_in_linear(*layer.down);
    if (proj_added) {
      b.LinearAdd(act, down_in, tokens, *layer.down, nullptr, residual);
    } else {
      b.Linear(act, down_in, tokens, *layer.down, nullptr, proj);
      TANDEM_RETURN_IF_ERROR(all_reduce(proj));
    }
  }
  if (num_sampled == 0) return absl::OkStatus();
  // Only the rows that sample need the final norm and the vocabulary projection.
  float* sampled = sampled_hidden_.as<float>();
  b.GatherAdd(residual, proj, a.sample_rows, num_sampled, hidden, sampled);
  // In place, so fp32 (the LM head's rows are few).
  b.RmsNorm(sampled, final_norm_.as<float>(), c.rms_norm_eps, num_sampled, hidden, sampled,
            DType::kF32);
  if (tensor_parallel()) {
    // Each rank's [sampled, stride] slice, all-gathered in backend memory (over the device
    // communicator, queued after the kernels; the host one only with the CPU backend, whose
    // operators are done when they return), then laid out as [sampled, vocab] by strided copies.
    const int stride = shard.vocab_stride;
    b.Linear(sampled, DType::kF32, num_sampled, *lm_head_, nullptr, local_logits_.as<float>());
    const size_t part = static_cast<size_t>(num_sampled) * stride;
    TANDEM_RETURN_IF_ERROR(activations_comm().AllGather(
        local_logits_.data(), gathered_logits_.data(), part * sizeof(float)));
    const float* gathered = gathered_logits_.as<float>();
    for (int r = 0; r < shard.size; ++r) {
      const int begin = std::min(c.vocab_size, r * stride);
      const int rows = std::min(c.vocab_size, begin + stride) - begin;
      b.CopyRows(logits_.as<float>() + begin, static_cast<size_t>(c.vocab_size) * sizeof(float),
                 gathered + r * part, static_cast<size_t>(stride) * sizeof(float),
                 static_cast<size_t>(rows) * sizeof(float), num_sampled);
    }
  } else {
    b.Linear(sampled, DType::kF32, num_sampled, *lm_head_, nullptr, logits_.as<float>());
  }
  return absl::OkStatus();
}

absl::StatusOr<std::span<const float>> ModelRunner::FinishStep(int num_sampled,
                                                               bool sample_in_backend) {
  const text::ModelConfig& c = config_;
  kernels::Backend& b = *backend_;
  const size_t logit_count = static_cast<size_t>(num_sampled) * c.vocab_size;
  if (sample_in_backend) {
    // Only the tokens (and their log-probabilities) come back.
    auto* drawn = sampled_.as<kernels::TokenLogprob>();
    kernels::TokenLogprob* top = drawn + max_logit_rows_;
    b.SampleRows(logits_.as<float>(), num_sampled, c.vocab_size, sample_rows_.data(),
                 sample_edits_.data(), static_cast<int>(sample_edits_.size()),
                 kernels::kMaxSampleLogprobs, sample_scratch_.data(), drawn, top);
    if (!b.host_memory()) {
      auto* host = host_sampled_.as<kernels::TokenLogprob>();
      b.CopyToHost(host, drawn, num_sampled * sizeof(kernels::TokenLogprob));
      b.CopyToHost(host + max_logit_rows_, top,
                   static_cast<size_t>(num_sampled) * kernels::kMaxSampleLogprobs *
                       sizeof(kernels::TokenLogprob));
    }
    // The rows the host samples itself, side by side.
    const size_t row_floats = c.vocab_size;
    const size_t host_rows = sample_host_rows_.size();
    float* rows_out = nullptr;
    if (b.host_memory()) {
      host_row_logits_.resize(host_rows * row_floats);
      rows_out = host_row_logits_.data();
    } else {
      rows_out = host_logits_.as<float>();
    }
    for (size_t i = 0; i < host_rows; ++i) {
      b.CopyToHost(rows_out + i * row_floats,
                   logits_.as<float>() + static_cast<size_t>(sample_host_rows_[i]) * row_floats,
                   row_floats * sizeof(float));
    }
    TANDEM_RETURN_IF_ERROR(b.Synchronize());
    last_backend_rows_ = num_sampled;
    return std::span<const float>(rows_out, host_rows * row_floats);
  }
  const float* logits = logits_.as<float>();
  if (!b.host_memory()) {
    b.CopyToHost(host_logits_.data(), logits, logit_count * sizeof(float));
    logits = host_logits_.as<float>();
  }
  TANDEM_RETURN_IF_ERROR(b.Synchronize());
  return std::span<const float>(logits, logit_count);
}

}  // namespace tandem::engine
