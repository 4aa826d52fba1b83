#include "tandem/engine/model_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
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

// Tensor `name` as elements of `dtype` (host bytes): the stored bytes when the checkpoint holds
// that type, else widened or rounded (to nearest even) from what it holds.
absl::StatusOr<std::vector<unsigned char>> ReadAs(const Checkpoint& checkpoint,
                                                  const std::string& name, DType dtype) {
  TANDEM_ASSIGN_OR_RETURN(TensorView tensor, checkpoint.Tensor(name));
  const auto* data = static_cast<const unsigned char*>(tensor.data);
  if (tensor.dtype == dtype) return std::vector<unsigned char>(data, data + tensor.nbytes);
  std::vector<float> values(tensor.NumElements());
  tensor.ToFloat(values.data());
  std::vector<unsigned char> out(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    StoreFromFloat(out.data(), dtype, static_cast<int64_t>(i), values[i]);
  }
  return out;
}

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

ModelRunner::~ModelRunner() = default;

int64_t ModelRunner::KvBytesPerBlock(const text::ModelConfig& config, int block_size, DType kv_dtype) {
  const KvCacheLayout layout{.num_layers = config.num_layers,
                             .num_blocks = 1,
                             .block_size = block_size,
                             .num_kv_heads = config.num_kv_heads,
                             .head_dim = config.head_dim,
                             .dtype = kv_dtype};
  return static_cast<int64_t>(layout.bytes_per_block());
}

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(
    const Checkpoint& checkpoint, kernels::Backend* backend, const ModelRunnerOptions& options) {
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
  TANDEM_ASSIGN_OR_RETURN(RunnerDTypes dtypes,
                          ResolveRunnerDTypes(c, options.weight_dtype, options.kv_cache_dtype));
  runner->cache_layout_ = {.num_layers = c.num_layers,
                           .num_blocks = options.num_kv_blocks,
                           .block_size = options.block_size,
                           .num_kv_heads = c.num_kv_heads,
                           .head_dim = c.head_dim,
                           .dtype = dtypes.kv_cache};
  runner->kv_layout_ = runner->cache_layout_.kernel_layout();
  for (int l = 0; l < c.num_layers; ++l) {
    kernels::KvLayout layer = runner->kv_layout_;
    const std::string p = absl::StrCat("model.layers.", l, ".self_attn.");
    TANDEM_ASSIGN_OR_RETURN(layer.k_scale, ReadKvScale(checkpoint, p + "k_scale"));
    TANDEM_ASSIGN_OR_RETURN(layer.v_scale, ReadKvScale(checkpoint, p + "v_scale"));
    runner->layer_kv_layouts_.push_back(layer);
  }
  TANDEM_ASSIGN_OR_RETURN(runner->inv_freq_, runner->Upload(kernels::RopeInverseFrequencies(c.rope)));
  TANDEM_RETURN_IF_ERROR(runner->LoadWeights(checkpoint, dtypes.weights));

  TANDEM_ASSIGN_OR_RETURN(runner->kv_cache_,
                          backend->Allocate(runner->cache_layout_.total_bytes()));

  const size_t t = options.max_num_batched_tokens;
  const size_t s =
      std::min<int64_t>(static_cast<int64_t>(options.max_num_seqs) * options.max_logit_rows_per_seq,
                        options.max_num_batched_tokens);
  runner->max_logit_rows_ = static_cast<int>(s);
  const size_t q_dim = static_cast<size_t>(c.num_heads) * c.head_dim;
  const size_t kv_dim = static_cast<size_t>(c.num_kv_heads) * c.head_dim;
  TANDEM_ASSIGN_OR_RETURN(runner->step_ints_, backend->Allocate((3 * t + s) * sizeof(int32_t)));
  if (backend->host_memory()) {
    runner->planned_ints_ = runner->step_ints_.as<int32_t>();
  } else {
    runner->host_step_ints_.resize(3 * t + s);
    runner->planned_ints_ = runner->host_step_ints_.data();
    runner->host_logits_.resize(s * c.vocab_size);
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
                                {&runner->gate_up_, t * 2 * c.intermediate_size},
                                {&runner->act_, t * c.intermediate_size},
                                {&runner->sampled_hidden_, s * c.hidden_size},
                                {&runner->logits_, s * c.vocab_size}}) {
    TANDEM_ASSIGN_OR_RETURN(*buffer, backend->Allocate(floats * sizeof(float)));
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
  weight_dtype_ = weight_dtype;
  // Reads a projection matrix (or several, stacked along n) as weight_dtype bytes.
  auto read_matrix =
      [&](std::initializer_list<std::string> names) -> absl::StatusOr<std::vector<unsigned char>> {
    std::vector<unsigned char> out;
    for (const std::string& name : names) {
      TANDEM_ASSIGN_OR_RETURN(std::vector<unsigned char> part,
                              ReadAs(checkpoint, name, weight_dtype));
      out.insert(out.end(), part.begin(), part.end());
    }
    return out;
  };
  auto pack = [&](const std::vector<unsigned char>& w, int n, int k) {
    return backend_->PackWeight(w.data(), weight_dtype, n, k);
  };
  // A projection of the modules' W [out_i, k] stacked along n: quantised (and kept so) when the
  // checkpoint stores them quantised, else in weight_dtype.
  const QuantizationConfig& quantization = checkpoint.quantization();
  auto load_projection = [&](std::initializer_list<std::pair<std::string, int>> modules,
                             int k) -> absl::StatusOr<std::unique_ptr<kernels::PackedWeight>> {
    int quantized = 0;
    int n = 0;
    for (const auto& [module, out] : modules) {
      quantized += IsQuantizedLinear(quantization, module) ? 1 : 0;
      n += out;
    }
    if (quantized == 0) {
      std::vector<unsigned char> w;
      for (const auto& [module, out] : modules) {
        TANDEM_ASSIGN_OR_RETURN(std::vector<unsigned char> part,
                                ReadAs(checkpoint, module + ".weight", weight_dtype));
        w.insert(w.end(), part.begin(), part.end());
      }
      return pack(w, n, k);
    }
    if (quantized != static_cast<int>(modules.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(modules.begin()->first,
                       ": layers fused into one projection are quantised and unquantised both"));
    }
    std::vector<QuantizedMatrix> parts;
    for (const auto& [module, out] : modules) {
      TANDEM_ASSIGN_OR_RETURN(QuantizedMatrix part,
                              ReadQuantizedMatrix(checkpoint, module, out, k));
      parts.push_back(std::move(part));
    }
    TANDEM_ASSIGN_OR_RETURN(QuantizedMatrix stacked, StackRows(std::move(parts)));
    return backend_->PackQuantizedWeight(stacked.view());
  };
  // Reads a vector (norm weight, bias) into backend memory.
  auto read = [&](const std::string& name) -> absl::StatusOr<kernels::DeviceBuffer> {
    TANDEM_ASSIGN_OR_RETURN(std::vector<float> values, checkpoint.ReadFloat(name));
    return Upload(values);
  };
  {
    // The table stays in the weight type too; a step widens only the rows it looks up.
    TANDEM_ASSIGN_OR_RETURN(std::vector<unsigned char> embed,
                            read_matrix({"model.embed_tokens.weight"}));
    TANDEM_ASSIGN_OR_RETURN(embed_, backend_->Allocate(embed.size()));
    backend_->CopyToDevice(embed_.data(), embed.data(), embed.size());
  }
  TANDEM_ASSIGN_OR_RETURN(final_norm_, read("model.norm.weight"));
  {
    TANDEM_ASSIGN_OR_RETURN(
        std::vector<unsigned char> lm_head,
        read_matrix({c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight"}));
    lm_head_ = pack(lm_head, c.vocab_size, c.hidden_size);
  }
  const int q_dim = c.num_heads * c.head_dim;
  const int kv_dim = c.num_kv_heads * c.head_dim;
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    auto layer = std::make_unique<Layer>();
    TANDEM_ASSIGN_OR_RETURN(layer->input_norm, read(p + "input_layernorm.weight"));
    TANDEM_ASSIGN_OR_RETURN(layer->post_attn_norm, read(p + "post_attention_layernorm.weight"));
    // q, k and v share their input, so one fused projection reads it once.
    TANDEM_ASSIGN_OR_RETURN(layer->qkv, load_projection({{p + "self_attn.q_proj", q_dim},
                                                         {p + "self_attn.k_proj", kv_dim},
                                                         {p + "self_attn.v_proj", kv_dim}},
                                                        c.hidden_size));
    std::vector<float> qkv_bias;
    for (const char* name : {"q_proj", "k_proj", "v_proj"}) {
      if (c.attention_bias) {
        TANDEM_ASSIGN_OR_RETURN(std::vector<float> b,
                                checkpoint.ReadFloat(absl::StrCat(p, "self_attn.", name, ".bias")));
        qkv_bias.insert(qkv_bias.end(), b.begin(), b.end());
      }
    }
    TANDEM_ASSIGN_OR_RETURN(layer->qkv_bias, Upload(qkv_bias));
    if (c.qk_norm) {
      TANDEM_ASSIGN_OR_RETURN(layer->q_norm, read(p + "self_attn.q_norm.weight"));
      TANDEM_ASSIGN_OR_RETURN(layer->k_norm, read(p + "self_attn.k_norm.weight"));
    }
    TANDEM_ASSIGN_OR_RETURN(layer->o,
                            load_projection({{p + "self_attn.o_proj", c.hidden_size}}, q_dim));
    if (c.o_proj_bias) {
      TANDEM_ASSIGN_OR_RETURN(layer->o_bias, read(p + "self_attn.o_proj.bias"));
    }
    TANDEM_ASSIGN_OR_RETURN(layer->gate_up,
                            load_projection({{p + "mlp.gate_proj", c.intermediate_size},
                                             {p + "mlp.up_proj", c.intermediate_size}},
                                            c.hidden_size));
    TANDEM_ASSIGN_OR_RETURN(
        layer->down, load_projection({{p + "mlp.down_proj", c.hidden_size}}, c.intermediate_size));
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
  for (const auto& [src, dst] : step.block_copies) CopyBlock(src, dst);

  // Flatten the step on the host: tokens of every sequence back to back.
  int max_blocks = 0;
  for (const ScheduledSequence& s : step.seqs) {
    max_blocks = std::max(max_blocks, static_cast<int>(s.seq->block_table.size()));
  }
  block_table_.assign(static_cast<size_t>(num_seqs) * max_blocks, 0);
  const int bs = kv_layout_.block_size;
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
    const int known = static_cast<int>(seq.tokens.size());
    for (int pos = begin; pos < end; ++pos, ++t) {
      // Past the known tokens: the draft tokens being verified.
      token_ids[t] = pos < known ? seq.tokens[pos] : seq.draft_tokens[pos - known];
      positions[t] = pos;
      slots[t] = seq.block_table[pos / bs] * bs + pos % bs;
    }
    query_start_[i + 1] = t;
    context_len_[i] = end;
    std::copy(seq.block_table.begin(), seq.block_table.end(),
              block_table_.begin() + static_cast<size_t>(i) * max_blocks);
    if (step.seqs[i].samples) {
      for (int r = step.seqs[i].num_draft_tokens; r >= 0; --r)
        sample_rows[num_sampled++] = t - 1 - r;
    }
  }
  return Forward(tokens, num_seqs, max_blocks, num_sampled, config_.num_layers,
                 /*layer_hook=*/true);
}

absl::StatusOr<std::span<const float>> ModelRunner::ExecuteDraft(const SchedulerStep& step,
                                                                 int offset, int num_layers) {
  if (num_layers < 1 || num_layers > config_.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("a draft pass of ", num_layers, " layers on a model of ", config_.num_layers));
  }
  if (offset == 0) {
    // Execute copies them again before the target pass, which rewrites every slot of the step
    // before reading it: the second copy changes nothing the target reads.
    for (const auto& [src, dst] : step.block_copies) CopyBlock(src, dst);
  }
  int num_seqs = 0;
  int max_blocks = 0;
  for (const ScheduledSequence& s : step.seqs) {
    if (s.num_draft_tokens <= offset) continue;
    ++num_seqs;
    max_blocks = std::max(max_blocks, static_cast<int>(s.seq->block_table.size()));
  }
  if (num_seqs == 0) return std::span<const float>();
  block_table_.assign(static_cast<size_t>(num_seqs) * max_blocks, 0);
  const int bs = kv_layout_.block_size;
  int32_t* token_ids = planned_ints_;
  int32_t* positions = token_ids + num_seqs;
  int32_t* slots = positions + num_seqs;
  int32_t* sample_rows = slots + num_seqs;
  int i = 0;
  query_start_[0] = 0;
  for (const ScheduledSequence& s : step.seqs) {
    if (s.num_draft_tokens <= offset) continue;
    const Sequence& seq = *s.seq;
    // The sequence's last real token, then the draft tokens proposed so far.
    const int known = static_cast<int>(seq.tokens.size());
    const int pos = known - 1 + offset;
    token_ids[i] = offset == 0 ? seq.tokens[known - 1] : seq.draft_tokens[offset - 1];
    positions[i] = pos;
    slots[i] = seq.block_table[pos / bs] * bs + pos % bs;
    sample_rows[i] = i;
    query_start_[i + 1] = i + 1;
    context_len_[i] = pos + 1;
    std::copy(seq.block_table.begin(), seq.block_table.end(),
              block_table_.begin() + static_cast<size_t>(i) * max_blocks);
    ++i;
  }
  return Forward(num_seqs, num_seqs, max_blocks, num_seqs, num_layers, /*layer_hook=*/false);
}

absl::StatusOr<std::span<const float>> ModelRunner::Forward(int tokens, int num_seqs,
                                                            int max_blocks, int num_sampled,
                                                            int num_layers, bool layer_hook) {
  const text::ModelConfig& c = config_;
  kernels::Backend& b = *backend_;
  // The same offsets in backend memory; one upload when that is not the host's.
  const int32_t* d_token_ids = step_ints_.as<int32_t>();
  const int32_t* d_positions = d_token_ids + tokens;
  const int32_t* d_slots = d_positions + tokens;
  const int32_t* d_sample_rows = d_slots + tokens;
  if (planned_ints_ != step_ints_.as<int32_t>()) {
    b.CopyToDevice(step_ints_.data(), planned_ints_, (3 * tokens + num_sampled) * sizeof(int32_t));
  }

  const int hidden = c.hidden_size;
  const int q_dim = c.num_heads * c.head_dim;
  const int kv_dim = c.num_kv_heads * c.head_dim;
  const size_t qkv_row_bytes = static_cast<size_t>(q_dim + 2 * kv_dim) * sizeof(float);
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  kernels::PagedAttentionBatch batch{num_seqs, query_start_.data(), context_len_.data(),
                                     block_table_.data(), max_blocks};
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

  b.Embedding(embed_.data(), weight_dtype_, d_token_ids, tokens, hidden, residual);
  for (int l = 0; l < num_layers; ++l) {
    Layer& layer = *layers_[l];
    if (l == 0) {
      b.RmsNorm(residual, layer.input_norm.as<float>(), c.rms_norm_eps, tokens, hidden,
                hidden_states);
    } else {
      b.AddRmsNorm(residual, proj, layer.input_norm.as<float>(), c.rms_norm_eps, tokens, hidden,
                   hidden_states);
    }
    b.Linear(hidden_states, tokens, *layer.qkv, layer.qkv_bias.as<float>(), qkv);
    // Split [tokens, q | k | v] into q, k and v for the per-head operators.
    b.CopyRows(q, q_dim * sizeof(float), qkv, qkv_row_bytes, q_dim * sizeof(float), tokens);
    b.CopyRows(k, kv_dim * sizeof(float), qkv + q_dim, qkv_row_bytes, kv_dim * sizeof(float),
               tokens);
    b.CopyRows(v, kv_dim * sizeof(float), qkv + q_dim + kv_dim, qkv_row_bytes,
               kv_dim * sizeof(float), tokens);
    if (c.qk_norm) {
      b.RmsNorm(q, layer.q_norm.as<float>(), c.rms_norm_eps, tokens * c.num_heads, c.head_dim, q);
      b.RmsNorm(k, layer.k_norm.as<float>(), c.rms_norm_eps, tokens * c.num_kv_heads, c.head_dim,
                k);
    }
    b.Rope(q, d_positions, tokens, c.num_heads, c.head_dim, inv_freq);
    b.Rope(k, d_positions, tokens, c.num_kv_heads, c.head_dim, inv_freq);
    void* cache = layer_cache(l);
    const kernels::KvLayout& kv_layout = layer_kv_layouts_[l];
    b.WriteKv(k, v, d_slots, tokens, kv_layout, cache);
    if (layer_hook && layer_written_hook_) {
      if (!b.host_memory()) TANDEM_RETURN_IF_ERROR(b.Synchronize());
      layer_written_hook_(l);
    }
    b.PagedAttention(q, cache, kv_layout, batch, c.num_heads, scale, attn);
    b.Linear(attn, tokens, *layer.o, layer.o_bias.as<float>(), proj);
    b.AddRmsNorm(residual, proj, layer.post_attn_norm.as<float>(), c.rms_norm_eps, tokens, hidden,
                 hidden_states);
    b.Linear(hidden_states, tokens, *layer.gate_up, nullptr, gate_up);
    b.SiluMul(gate_up, tokens, c.intermediate_size, act);
    b.Linear(act, tokens, *layer.down, nullptr, proj);
  }
  if (num_sampled == 0) {
    TANDEM_RETURN_IF_ERROR(b.Synchronize());
    return std::span<const float>();
  }
  // Only the rows that sample need the final norm and the vocabulary projection.
  float* sampled = sampled_hidden_.as<float>();
  b.GatherAdd(residual, proj, d_sample_rows, num_sampled, hidden, sampled);
  b.RmsNorm(sampled, final_norm_.as<float>(), c.rms_norm_eps, num_sampled, hidden, sampled);
  b.Linear(sampled, num_sampled, *lm_head_, nullptr, logits_.as<float>());
  const size_t logit_count = static_cast<size_t>(num_sampled) * c.vocab_size;
  const float* logits = logits_.as<float>();
  if (!b.host_memory()) {
    b.CopyToHost(host_logits_.data(), logits, logit_count * sizeof(float));
    logits = host_logits_.data();
  }
  TANDEM_RETURN_IF_ERROR(b.Synchronize());
  return std::span<const float>(logits, logit_count);
}

}  // namespace tandem::engine
