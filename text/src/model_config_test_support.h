// config.json as Hugging Face writes it for a tiny model of each family Tandem serves, for the
// config tests here and the checkpoint tests of the engine.
#pragma once

#include <string>

#include "nlohmann/json.hpp"

namespace tandem::text {

// arch: "llama", "llama-bias" (attention_bias true), "mistral", "qwen2" or "qwen3".
inline nlohmann::json TinyConfig(const std::string& arch) {
  nlohmann::json j = {{"vocab_size", 96},
                      {"hidden_size", 32},
                      {"intermediate_size", 48},
                      {"num_hidden_layers", 2},
                      {"num_attention_heads", 4},
                      {"num_key_value_heads", 2},
                      {"max_position_embeddings", 256},
                      {"rms_norm_eps", 1e-5},
                      {"bos_token_id", 1},
                      {"eos_token_id", 2},
                      {"torch_dtype", "bfloat16"},
                      {"hidden_act", "silu"}};
  if (arch == "llama" || arch == "llama-bias") {
    j["architectures"] = {"LlamaForCausalLM"};
    j["model_type"] = "llama";
    j["rope_theta"] = 500000.0;
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", 8.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 32}};
    j["attention_bias"] = arch == "llama-bias";
    j["tie_word_embeddings"] = false;
  } else if (arch == "mistral") {
    j["architectures"] = {"MistralForCausalLM"};
    j["model_type"] = "mistral";
    j["rope_theta"] = 1000000.0;
    j["sliding_window"] = 4096;
  } else if (arch == "qwen2") {
    // Qwen2 configs carry no attention_bias flag; the biases are implied.
    j["architectures"] = {"Qwen2ForCausalLM"};
    j["model_type"] = "qwen2";
    j["rope_theta"] = 1000000.0;
    j["tie_word_embeddings"] = true;
    j["use_sliding_window"] = false;
    j["sliding_window"] = 32768;
    j["eos_token_id"] = {2, 3};
  } else if (arch == "qwen3") {
    j["architectures"] = {"Qwen3ForCausalLM"};
    j["model_type"] = "qwen3";
    j["rope_theta"] = 1000000.0;
    j["head_dim"] = 16;  // not hidden / heads (8), as in Qwen3-0.6B
    j["attention_bias"] = false;
    j["tie_word_embeddings"] = false;
  }
  return j;
}

}  // namespace tandem::text
