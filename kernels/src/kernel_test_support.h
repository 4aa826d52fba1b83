// Helpers shared by the backend tests (CPU and CUDA): random inputs and the error measure.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::kernels::test_support {

// Outputs are filled with this before a run so an element a kernel forgot to write shows.
inline constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// `size` uniform values in [lo, hi), the same for the same seed.
inline std::vector<float> Random(int64_t size, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(size);
  for (float& x : v) x = dist(gen);
  return v;
}

// Largest |actual - expected| / (|expected| + floor), after checking every element is finite:
// an element the backend forgot to write still holds its NaN poison.
inline double MaxRelativeError(const std::vector<float>& actual, const std::vector<float>& expected,
                               double floor = 1e-3) {
  EXPECT_EQ(actual.size(), expected.size());
  double worst = 0.0;
  for (size_t i = 0; i < actual.size() && i < expected.size(); ++i) {
    if (!std::isfinite(actual[i])) {
      ADD_FAILURE() << "element " << i << " is " << actual[i] << " (not written?)";
      return std::numeric_limits<double>::infinity();
    }
    worst = std::max(
        worst, std::abs(double{actual[i]} - expected[i]) / (std::abs(double{expected[i]}) + floor));
  }
  return worst;
}

}  // namespace tandem::kernels::test_support
