// Rotary position embedding settings: what a model's config.json says (`rope_theta`,
// `rope_scaling` of type "llama3") and what the kernels' RoPE op computes with. Shared here so
// that reading a config (tandem::text) does not need the kernels.
#pragma once

namespace tandem {

struct RopeConfig {
  int head_dim = 0;
  float theta = 10000.0f;
  bool llama3_scaling = false;
  float factor = 8.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  int original_max_position = 8192;
};

}  // namespace tandem
