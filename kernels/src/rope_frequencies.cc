// Rotary inverse frequencies, including Llama 3 "rope_scaling" (type "llama3").
#include <cmath>
#include <vector>

#include "tandem/kernels/backend.h"

namespace tandem::kernels {

std::vector<float> RopeInverseFrequencies(const RopeConfig& config) {
  const int half = config.head_dim / 2;
  std::vector<float> inv_freq(half);
  // Computed in double and rounded once, so the table is within half an ulp of the exact value
  // whatever order Hugging Face's float32 arithmetic happens to use.
  const double low_freq_wavelen = config.original_max_position / double{config.low_freq_factor};
  const double high_freq_wavelen = config.original_max_position / double{config.high_freq_factor};
  for (int i = 0; i < half; ++i) {
    double inv = 1.0 / std::pow(double{config.theta}, (2.0 * i) / config.head_dim);
    if (config.llama3_scaling) {
      const double wavelen = 2.0 * M_PI / inv;
      if (wavelen > low_freq_wavelen) {
        // Long wavelengths (low frequencies) are stretched by the full factor.
        inv = inv / config.factor;
      } else if (wavelen >= high_freq_wavelen) {
        // In between, interpolate smoothly between stretched and unchanged.
        const double smooth = (config.original_max_position / wavelen - config.low_freq_factor) /
                              (config.high_freq_factor - config.low_freq_factor);
        inv = (1.0 - smooth) * inv / config.factor + smooth * inv;
      }
    }
    inv_freq[i] = static_cast<float>(inv);
  }
  return inv_freq;
}

}  // namespace tandem::kernels
