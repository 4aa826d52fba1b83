#include "tandem/base/half.h"

#include <cmath>

#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(HalfTest, Bf16RoundTripsRepresentableValues) {
  for (float v : {0.0f, 1.0f, -2.5f, 0.15625f, 65504.0f, -1e-20f}) {
    float r = Bf16ToFloat(FloatToBf16(v));
    EXPECT_NEAR(r, v, std::abs(v) * (1.0f / 128)) << v;
  }
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
}

TEST(HalfTest, F16MatchesIeeeForKnownBitPatterns) {
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(1e6f), 0x7c00);  // overflow to infinity
  EXPECT_EQ(F16ToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  for (int h = 0; h < 0x7c00; h += 7) {
    EXPECT_EQ(FloatToF16(F16ToFloat(static_cast<uint16_t>(h))), h);
  }
}

}  // namespace
}  // namespace tandem
