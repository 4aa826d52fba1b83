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

TEST(HalfTest, Fp8E4M3MatchesTheOcpFormat) {
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.0f);                // largest finite
  EXPECT_EQ(Fp8E4M3ToFloat(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(Fp8E4M3ToFloat(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(Fp8E4M3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4M3ToFloat(0xc0), -2.0f);
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0x7f)));
  EXPECT_EQ(FloatToFp8E4M3(1000.0f), 0x7e);  // saturates
  EXPECT_EQ(FloatToFp8E4M3(-1e9f), 0xfe);
  EXPECT_EQ(FloatToFp8E4M3(1.0625f), 0x38);  // halfway between 1 and 1.125: to even
  EXPECT_EQ(FloatToFp8E4M3(1.1875f), 0x3a);  // halfway between 1.125 and 1.25: to even
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;
    EXPECT_EQ(FloatToFp8E4M3(Fp8E4M3ToFloat(static_cast<uint8_t>(b))), b) << b;
  }
}

TEST(HalfTest, Fp8E5M2MatchesTheOcpFormat) {
  EXPECT_EQ(Fp8E5M2ToFloat(0x7b), 57344.0f);
  EXPECT_EQ(Fp8E5M2ToFloat(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(Fp8E5M2ToFloat(0x3c), 1.0f);
  EXPECT_TRUE(std::isinf(Fp8E5M2ToFloat(0x7c)));
  EXPECT_EQ(FloatToFp8E5M2(1e6f), 0x7b);  // saturates rather than overflowing to infinity
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7c) == 0x7c) continue;  // infinities and NaNs
    EXPECT_EQ(FloatToFp8E5M2(Fp8E5M2ToFloat(static_cast<uint8_t>(b))), b) << b;
  }
  // Between two codes: the nearer one.
  EXPECT_EQ(Fp8E5M2ToFloat(FloatToFp8E5M2(1.2f)), 1.25f);
  EXPECT_EQ(Fp8E5M2ToFloat(FloatToFp8E5M2(1.1f)), 1.0f);
}

TEST(HalfTest, DTypeFlagsParse) {
  EXPECT_EQ(ParseDTypeFlag("bfloat16"), DType::kBF16);
  EXPECT_EQ(ParseDTypeFlag("float16"), DType::kF16);
  EXPECT_EQ(ParseDTypeFlag("fp8_e5m2"), DType::kF8E5M2);
  EXPECT_EQ(ParseDTypeFlag("bf16"), DType::kBF16);
  EXPECT_EQ(ParseDTypeFlag("int3"), std::nullopt);
}

}  // namespace
}  // namespace tandem
