#include "tandem/engine/model_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"

namespace tandem::engine {

struct ModelRunner::Layer {
  std::vector<float> input_norm;                   // [hidden]
  std::vector<float> post_attn_norm;               // [hidden]
  std::unique_ptr<kernels::PackedWeight> qkv;      // [(heads + 2 kv_heads) * head_dim, hidden]
  std::vector<float> qkv_bias;                     // [(heads + 2 kv_heads) * head_dim] or empty
  std::vector<float> q_norm, k_norm;               // [head_dim] or empty
  std::unique_ptr<kernels::PackedWeight> o;        // [hidden, heads * head_dim]
  std::vector<float> o_bias;                       // [hidden] or empty
  std::unique_ptr<kernels::PackedWeight> gate_up;  // [2 * intermediate, hidden]
  std::unique_ptr<kernels::PackedWeight> down;     // [hidden, intermediate]
};

ModelRunner::~ModelRunner() = default;

absl::StatusOr<std::vector<KvCopyRange>> KvBlockCopyRanges(const kernels::KvLayout& src,
                                                           const kernels::KvLayout& dst,
                                                           int num_layers,
                                                           const BlockTable& src_blocks,
                                                           const BlockTable& dst_blocks) {
  if (src.block_size != dst.block_size || src.num_kv_heads != dst.num_kv_heads ||
      src.head_dim != dst.head_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV layouts differ: block_size ", src.block_size, " vs ", dst.block_size,
                     ", kv_heads ", src.num_kv_heads, " vs ", dst.num_kv_heads, ", head_dim ",
                     src.head_dim, " vs ", dst.head_dim));
  }
  if (src_blocks.size() != dst_blocks.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("copying ", src_blocks.size(), " blocks into ", dst_blocks.size()));
  }
  for (int32_t b : src_blocks) {
    if (b < 0 || b >= src.num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("source block id ", b, " outside [0, ", src.num_blocks, ")"));
    }
  }
  for (int32_t b : dst_blocks) {
    if (b < 0 || b >= dst.num_blocks) {
      return absl::InvalidArgumentError(
          absl::StrCat("destination block id ", b, " outside [0, ", dst.num_blocks, ")"));
    }
  }
  const uint64_t block_bytes =
      static_cast<uint64_t>(src.block_size) * src.num_kv_heads * src.head_dim * sizeof(float);
  std::vector<KvCopyRange> ranges;
  ranges.reserve(static_cast<size_t>(num_layers) * 2 * src_blocks.size());
  for (int l = 0; l < num_layers; ++l) {
    for (int half = 0; half < 2; ++half) {
      const uint64_t src_base =
          (l * 2 + half) * static_cast<uint64_t>(src.num_blocks) * block_bytes;
      const uint64_t dst_base =
          (l * 2 + half) * static_cast<uint64_t>(dst.num_blocks) * block_bytes;
      for (size_t i = 0; i < src_blocks.size(); ++i) {
        ranges.push_back({src_base + src_blocks[i] * block_bytes,
                          dst_base + dst_blocks[i] * block_bytes, block_bytes});
      }
    }
  }
  return ranges;
}

int64_t ModelRunner::KvBytesPerBlock(const ModelConfig& config, int block_size) {
  return static_cast<int64_t>(config.num_layers) * 2 * block_size * config.num_kv_heads *
         config.head_dim * static_cast<int64_t>(sizeof(float));
}

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(
    const Checkpoint& checkpoint, kernels::Backend* backend, const ModelRunnerOptions& options) {
  if (options.num_kv_blocks <= 0) {
    return absl::InvalidArgumentError("the KV cache needs at least one block");
  }
  if (options.max_num_batched_tokens <= 0 || options.max_num_seqs <= 0) {
    return absl::InvalidArgumentError("max_num_batched_tokens and max_num_seqs must be positive");
  }
  std::unique_ptr<ModelRunner> runner(new ModelRunner());
  runner->config_ = checkpoint.config();
  runner->options_ = options;
  runner->backend_ = backend;
  const ModelConfig& c = runner->config_;
  runner->kv_layout_ = {options.num_kv_blocks, options.block_size, c.num_kv_heads, c.head_dim};
  runner->inv_freq_ = kernels::RopeInverseFrequencies(c.rope);
  TANDEM_RETURN_IF_ERROR(runner->LoadWeights(checkpoint));

  const size_t cache_elems = static_cast<size_t>(c.num_layers) * runner->kv_layout_.LayerElements();
  runner->kv_cache_ = std::make_unique_for_overwrite<float[]>(cache_elems);

  const size_t t = options.max_num_batched_tokens;
  const size_t s = std::min(options.max_num_seqs, options.max_num_batched_tokens);
  const size_t q_dim = static_cast<size_t>(c.num_heads) * c.head_dim;
  const size_t kv_dim = static_cast<size_t>(c.num_kv_heads) * c.head_dim;
  runner->token_ids_.resize(t);
  runner->positions_.resize(t);
  runner->slots_.resize(t);
  runner->query_start_.resize(s + 1);
  runner->context_len_.resize(s);
  runner->sample_rows_.resize(s);
  runner->residual_.resize(t * c.hidden_size);
  runner->hidden_.resize(t * c.hidden_size);
  runner->qkv_.resize(t * (q_dim + 2 * kv_dim));
  runner->q_.resize(t * q_dim);
  runner->k_.resize(t * kv_dim);
  runner->v_.resize(t * kv_dim);
  runner->attn_.resize(t * q_dim);
  runner->proj_.resize(t * c.hidden_size);
  runner->gate_up_.resize(t * 2 * c.intermediate_size);
  runner->act_.resize(t * c.intermediate_size);
  runner->sampled_hidden_.resize(s * c.hidden_size);
  runner->logits_.resize(s * c.vocab_size);
  return runner;
}

absl::Status ModelRunner::LoadWeights(const Checkpoint& checkpoint) {
  const ModelConfig& c = config_;
  TANDEM_ASSIGN_OR_RETURN(embed_, checkpoint.ReadFloat("model.embed_tokens.weight"));
  TANDEM_ASSIGN_OR_RETURN(final_norm_, checkpoint.ReadFloat("model.norm.weight"));
  if (c.tie_word_embeddings) {
    lm_head_ = backend_->PackWeight(embed_.data(), c.vocab_size, c.hidden_size);
  } else {
    TANDEM_ASSIGN_OR_RETURN(std::vector<float> lm_head, checkpoint.ReadFloat("lm_head.weight"));
    lm_head_ = backend_->PackWeight(lm_head.data(), c.vocab_size, c.hidden_size);
  }
  const int q_dim = c.num_heads * c.head_dim;
  const int kv_dim = c.num_kv_heads * c.head_dim;
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    auto layer = std::make_unique<Layer>();
    TANDEM_ASSIGN_OR_RETURN(layer->input_norm, checkpoint.ReadFloat(p + "input_layernorm.weight"));
    TANDEM_ASSIGN_OR_RETURN(layer->post_attn_norm,
                            checkpoint.ReadFloat(p + "post_attention_layernorm.weight"));
    // q, k and v share their input, so one fused projection reads it once.
    std::vector<float> qkv;
    qkv.reserve(static_cast<size_t>(q_dim + 2 * kv_dim) * c.hidden_size);
    for (const char* name : {"q_proj", "k_proj", "v_proj"}) {
      TANDEM_ASSIGN_OR_RETURN(std::vector<float> w,
                              checkpoint.ReadFloat(absl::StrCat(p, "self_attn.", name, ".weight")));
      qkv.insert(qkv.end(), w.begin(), w.end());
      if (c.attention_bias) {
        TANDEM_ASSIGN_OR_RETURN(std::vector<float> b,
                                checkpoint.ReadFloat(absl::StrCat(p, "self_attn.", name, ".bias")));
        layer->qkv_bias.insert(layer->qkv_bias.end(), b.begin(), b.end());
      }
    }
    layer->qkv = backend_->PackWeight(qkv.data(), q_dim + 2 * kv_dim, c.hidden_size);
    if (c.qk_norm) {
      TANDEM_ASSIGN_OR_RETURN(layer->q_norm, checkpoint.ReadFloat(p + "self_attn.q_norm.weight"));
      TANDEM_ASSIGN_OR_RETURN(layer->k_norm, checkpoint.ReadFloat(p + "self_attn.k_norm.weight"));
    }
    TANDEM_ASSIGN_OR_RETURN(std::vector<float> o,
                            checkpoint.ReadFloat(p + "self_attn.o_proj.weight"));
    layer->o = backend_->PackWeight(o.data(), c.hidden_size, q_dim);
    if (c.o_proj_bias) {
      TANDEM_ASSIGN_OR_RETURN(layer->o_bias, checkpoint.ReadFloat(p + "self_attn.o_proj.bias"));
    }
    TANDEM_ASSIGN_OR_RETURN(std::vector<float> gate_up,
                            checkpoint.ReadFloat(p + "mlp.gate_proj.weight"));
    TANDEM_ASSIGN_OR_RETURN(std::vector<float> up, checkpoint.ReadFloat(p + "mlp.up_proj.weight"));
    gate_up.insert(gate_up.end(), up.begin(), up.end());
    layer->gate_up = backend_->PackWeight(gate_up.data(), 2 * c.intermediate_size, c.hidden_size);
    TANDEM_ASSIGN_OR_RETURN(std::vector<float> down,
                            checkpoint.ReadFloat(p + "mlp.down_proj.weight"));
    layer->down = backend_->PackWeight(down.data(), c.hidden_size, c.intermediate_size);
    layers_.push_back(std::move(layer));
  }
  return absl::OkStatus();
}

void ModelRunner::CopyBlock(int32_t src, int32_t dst) {
  const int64_t block_elems =
      static_cast<int64_t>(kv_layout_.block_size) * kv_layout_.num_kv_heads * kv_layout_.head_dim;
  for (int l = 0; l < config_.num_layers; ++l) {
    float* layer = layer_cache(l);
    for (int half = 0; half < 2; ++half) {
      float* base = layer + half * kv_layout_.HalfElements();
      std::memcpy(base + dst * block_elems, base + src * block_elems, block_elems * sizeof(float));
    }
  }
}

absl::StatusOr<std::span<const float>> ModelRunner::Execute(const SchedulerStep& step) {
  const ModelConfig& c = config_;
  const int num_seqs = static_cast<int>(step.seqs.size());
  if (step.num_tokens > options_.max_num_batched_tokens || num_seqs > options_.max_num_seqs) {
    return absl::InvalidArgumentError(absl::StrCat("step of ", step.num_tokens, " tokens and ",
                                                   num_seqs, " sequences exceeds the runner"));
  }
  for (const auto& [src, dst] : step.block_copies) CopyBlock(src, dst);

  // Flatten the step: tokens of every sequence back to back.
  int max_blocks = 0;
  for (const ScheduledSequence& s : step.seqs) {
    max_blocks = std::max(max_blocks, static_cast<int>(s.seq->block_table.size()));
  }
  block_table_.assign(static_cast<size_t>(num_seqs) * max_blocks, 0);
  const int bs = kv_layout_.block_size;
  int t = 0;
  int num_sampled = 0;
  query_start_[0] = 0;
  for (int i = 0; i < num_seqs; ++i) {
    const Sequence& seq = *step.seqs[i].seq;
    const int begin = seq.num_computed_tokens;
    const int end = begin + step.seqs[i].num_new_tokens;
    for (int pos = begin; pos < end; ++pos, ++t) {
      token_ids_[t] = seq.tokens[pos];
      positions_[t] = pos;
      slots_[t] = seq.block_table[pos / bs] * bs + pos % bs;
    }
    query_start_[i + 1] = t;
    context_len_[i] = end;
    std::copy(seq.block_table.begin(), seq.block_table.end(),
              block_table_.begin() + static_cast<size_t>(i) * max_blocks);
    if (step.seqs[i].samples) sample_rows_[num_sampled++] = t - 1;
  }
  const int tokens = t;

  const int hidden = c.hidden_size;
  const int q_dim = c.num_heads * c.head_dim;
  const int kv_dim = c.num_kv_heads * c.head_dim;
  const int qkv_dim = q_dim + 2 * kv_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  kernels::PagedAttentionBatch batch{num_seqs, query_start_.data(), context_len_.data(),
                                     block_table_.data(), max_blocks};
  kernels::Backend& b = *backend_;

  b.Embedding(embed_.data(), token_ids_.data(), tokens, hidden, residual_.data());
  for (int l = 0; l < c.num_layers; ++l) {
    Layer& layer = *layers_[l];
    if (l == 0) {
      b.RmsNorm(residual_.data(), layer.input_norm.data(), c.rms_norm_eps, tokens, hidden,
                hidden_.data());
    } else {
      b.AddRmsNorm(residual_.data(), proj_.data(), layer.input_norm.data(), c.rms_norm_eps, tokens,
                   hidden, hidden_.data());
    }
    b.Linear(hidden_.data(), tokens, *layer.qkv,
             layer.qkv_bias.empty() ? nullptr : layer.qkv_bias.data(), qkv_.data());
    for (int i = 0; i < tokens; ++i) {
      const float* row = qkv_.data() + static_cast<size_t>(i) * qkv_dim;
      std::memcpy(q_.data() + static_cast<size_t>(i) * q_dim, row, q_dim * sizeof(float));
      std::memcpy(k_.data() + static_cast<size_t>(i) * kv_dim, row + q_dim, kv_dim * sizeof(float));
      std::memcpy(v_.data() + static_cast<size_t>(i) * kv_dim, row + q_dim + kv_dim,
                  kv_dim * sizeof(float));
    }
    if (c.qk_norm) {
      b.RmsNorm(q_.data(), layer.q_norm.data(), c.rms_norm_eps, tokens * c.num_heads, c.head_dim,
                q_.data());
      b.RmsNorm(k_.data(), layer.k_norm.data(), c.rms_norm_eps, tokens * c.num_kv_heads, c.head_dim,
                k_.data());
    }
    b.Rope(q_.data(), positions_.data(), tokens, c.num_heads, c.head_dim, inv_freq_.data());
    b.Rope(k_.data(), positions_.data(), tokens, c.num_kv_heads, c.head_dim, inv_freq_.data());
    float* cache = layer_cache(l);
    b.WriteKv(k_.data(), v_.data(), slots_.data(), tokens, kv_layout_, cache);
    if (layer_written_hook_) layer_written_hook_(l);
    b.PagedAttention(q_.data(), cache, kv_layout_, batch, c.num_heads, scale, attn_.data());
    b.Linear(attn_.data(), tokens, *layer.o, layer.o_bias.empty() ? nullptr : layer.o_bias.data(),
             proj_.data());
    b.AddRmsNorm(residual_.data(), proj_.data(), layer.post_attn_norm.data(), c.rms_norm_eps,
                 tokens, hidden, hidden_.data());
    b.Linear(hidden_.data(), tokens, *layer.gate_up, nullptr, gate_up_.data());
    b.SiluMul(gate_up_.data(), tokens, c.intermediate_size, act_.data());
    b.Linear(act_.data(), tokens, *layer.down, nullptr, proj_.data());
  }
  // Only the rows that sample need the final norm and the vocabulary projection.
  for (int i = 0; i < num_sampled; ++i) {
    const size_t row = static_cast<size_t>(sample_rows_[i]) * hidden;
    for (int j = 0; j < hidden; ++j) {
      sampled_hidden_[static_cast<size_t>(i) * hidden + j] = residual_[row + j] + proj_[row + j];
    }
  }
  if (num_sampled == 0) return std::span<const float>();
  b.RmsNorm(sampled_hidden_.data(), final_norm_.data(), c.rms_norm_eps, num_sampled, hidden,
            sampled_hidden_.data());
  b.Linear(sampled_hidden_.data(), num_sampled, *lm_head_, nullptr, logits_.data());
  return std::span<const float>(logits_.data(), static_cast<size_t>(num_sampled) * c.vocab_size);
}

}  // namespace tandem::engine
