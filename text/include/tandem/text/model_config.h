// The model hyper-parameters Tandem reads from a Hugging Face `config.json`.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/base/half.h"
#include "tandem/base/rope_config.h"

namespace tandem::text {

// The decoder-only families Tandem serves. They share one forward pass; the differences are
// q/k/v biases (Qwen2) and per-head q/k RMSNorm (Qwen3).
enum class Architecture { kLlama, kMistral, kQwen2, kQwen3 };

struct ModelConfig {
  Architecture architecture = Architecture::kLlama;
  std::string architecture_name;  // as in config.json, e.g. "LlamaForCausalLM"
  std::string model_type;         // e.g. "llama"
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;  // hidden_size / num_heads unless config.json says otherwise
  int max_position_embeddings = 0;
  float rms_norm_eps = 1e-5f;
  RopeConfig rope;  // theta and llama3 scaling; rope.head_dim == head_dim
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // q/k/v projections carry a bias (Qwen2)
  // o_proj carries a bias too: Llama and Qwen3 with "attention_bias": true put one on all four
  // attention projections (Qwen2 biases only q/k/v).
  bool o_proj_bias = false;
  bool qk_norm = false;  // per-head RMSNorm of q and k before RoPE (Qwen3)
  DType torch_dtype = DType::kBF16;
  int bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;

  // Parses config.json text. `source` names the file in error messages.
  static absl::StatusOr<ModelConfig> FromJson(std::string_view json, std::string_view source);
  // Reads and parses `path`.
  static absl::StatusOr<ModelConfig> FromFile(const std::string& path);

  // Parameters in the checkpoint (embedding and lm_head counted once when tied).
  int64_t NumParameters() const;

  // config.json text in Hugging Face form; FromJson(ToJson()) gives back this config.
  std::string ToJson() const;
};

// Every tensor a checkpoint of `config` must hold, with its shape, in HF naming
// ("model.layers.0.self_attn.q_proj.weight", ...).
std::map<std::string, std::vector<int64_t>> ExpectedTensors(const ModelConfig& config);

}  // namespace tandem::text
