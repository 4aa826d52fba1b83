// Conversions between float and the 16- and 8-bit storage types of checkpoints and KV caches.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace tandem {

// Element types of stored tensors. Weights are F32, F16 or BF16; a KV cache may also be one of
// the two OCP 8-bit floats: E4M3 ("fn": no infinities, largest finite 448) and E5M2 (largest
// finite 57344). I8 and I32 are the integer tensors of weight-quantised checkpoints (int8
// weights; AWQ/GPTQ words of eight packed 4-bit values, g_idx).
enum class DType { kF32, kF16, kBF16, kF8E4M3, kF8E5M2, kI8, kI32 };

// Bytes per element of `dtype`.
inline constexpr int DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kF8E4M3:
    case DType::kF8E5M2:
    case DType::kI8:
      return 1;
  }
  return 4;
}

// Name as written in safetensors headers ("F32", "F16", "BF16", "F8_E4M3", "F8_E5M2").
inline constexpr const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kBF16: return "BF16";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kF8E5M2:
      return "F8_E5M2";
    case DType::kI8:
      return "I8";
    case DType::kI32:
      return "I32";
  }
  return "?";
}

// Name as the engine flags (--dtype, --kv-cache-dtype) and torch spell it: "float32",
// "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2".
inline constexpr const char* DTypeFlagName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF8E4M3:
      return "fp8_e4m3";
    case DType::kF8E5M2:
      return "fp8_e5m2";
    case DType::kI8:
      return "int8";
    case DType::kI32:
      return "int32";
  }
  return "?";
}

// The dtype a flag value names: a DTypeFlagName, or the short forms "f32", "fp32", "f16",
// "fp16", "half", "bf16", "fp8" (E4M3). Nullopt for anything else.
inline std::optional<DType> ParseDTypeFlag(std::string_view name) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2}) {
    if (name == DTypeFlagName(d)) return d;
  }
  if (name == "f32" || name == "fp32") return DType::kF32;
  if (name == "f16" || name == "fp16" || name == "half") return DType::kF16;
  if (name == "bf16") return DType::kBF16;
  if (name == "fp8") return DType::kF8E4M3;
  return std::nullopt;
}

inline float Bf16ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even; NaN stays NaN.
inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

inline float F16ToFloat(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToF16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffffu;
  if (((x >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t half = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(half);
}

namespace internal {

// An 8-bit float of `kExpBits` exponent and `kMantBits` mantissa bits: value of `bits`.
template <int kExpBits, int kMantBits, bool kHasInf>
inline float Fp8ToFloat(uint8_t bits) {
  constexpr int kBias = (1 << (kExpBits - 1)) - 1;
  constexpr int kExpMax = (1 << kExpBits) - 1;
  const int exp = (bits >> kMantBits) & kExpMax;
  const int mant = bits & ((1 << kMantBits) - 1);
  const float sign = (bits & 0x80) ? -1.0f : 1.0f;
  if (exp == kExpMax) {
    if (kHasInf) return mant == 0 ? sign * INFINITY : NAN;
    if (mant == (1 << kMantBits) - 1) return NAN;  // E4M3fn: only S.1111.111 is NaN
  }
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), 1 - kBias - kMantBits);
  return sign * std::ldexp(static_cast<float>(mant + (1 << kMantBits)), exp - kBias - kMantBits);
}

// Round to nearest even, saturating at the largest finite value (as vLLM and the CUDA
// __NV_SATFINITE conversions do); NaN stays NaN.
template <int kExpBits, int kMantBits, bool kHasInf>
inline uint8_t FloatToFp8(float f) {
  constexpr int kBias = (1 << (kExpBits - 1)) - 1;
  constexpr int kMantOne = 1 << kMantBits;
  // Largest finite code: E5M2 0x7b (exponent 30, mantissa 3); E4M3fn 0x7e (15, 6).
  constexpr int kMaxCode = kHasInf ? (((1 << kExpBits) - 2) << kMantBits) | (kMantOne - 1)
                                   : (((1 << kExpBits) - 1) << kMantBits) | (kMantOne - 2);
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return kHasInf ? 0x7e : 0x7f;
  const float a = std::fabs(f);
  int code;
  if (a < std::ldexp(1.0f, 1 - kBias)) {
    // Subnormal range: a multiple of the smallest subnormal; rounding up to kMantOne gives the
    // smallest normal's code.
    code = static_cast<int>(std::nearbyint(std::ldexp(a, kBias - 1 + kMantBits)));
  } else if (a >= 1e30f) {
    code = kMaxCode;
  } else {
    int e;
    const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    int q = static_cast<int>(std::nearbyint(std::ldexp(m, kMantBits + 1))) - kMantOne;
    int exp = e - 1 + kBias;
    if (q == kMantOne) {
      q = 0;
      ++exp;
    }
    code = exp * kMantOne + q;
    if (code > kMaxCode) code = kMaxCode;
  }
  return static_cast<uint8_t>(sign | code);
}

}  // namespace internal

inline float Fp8E4M3ToFloat(uint8_t v) { return internal::Fp8ToFloat<4, 3, false>(v); }
inline float Fp8E5M2ToFloat(uint8_t v) { return internal::Fp8ToFloat<5, 2, true>(v); }
inline uint8_t FloatToFp8E4M3(float f) { return internal::FloatToFp8<4, 3, false>(f); }
inline uint8_t FloatToFp8E5M2(float f) { return internal::FloatToFp8<5, 2, true>(f); }

// Element `i` of `dtype`-encoded `data`, as float.
inline float LoadAsFloat(const void* data, DType dtype, int64_t i) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, bytes + 4 * i, 4);
      return f;
    }
    case DType::kF16:
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, bytes + 2 * i, 2);
      return dtype == DType::kF16 ? F16ToFloat(h) : Bf16ToFloat(h);
    }
    case DType::kF8E4M3:
      return Fp8E4M3ToFloat(bytes[i]);
    case DType::kF8E5M2:
      return Fp8E5M2ToFloat(bytes[i]);
    case DType::kI8:
      return static_cast<float>(static_cast<int8_t>(bytes[i]));
    case DType::kI32: {
      int32_t v;
      std::memcpy(&v, bytes + 4 * i, 4);
      return static_cast<float>(v);
    }
  }
  return 0.0f;
}

// Stores `value` as element `i` of `dtype`-encoded `data` (rounded to nearest even; 8-bit
// floats saturate).
inline void StoreFromFloat(void* data, DType dtype, int64_t i, float value) {
  auto* bytes = static_cast<unsigned char*>(data);
  switch (dtype) {
    case DType::kF32:
      std::memcpy(bytes + 4 * i, &value, 4);
      return;
    case DType::kF16:
    case DType::kBF16: {
      const uint16_t h = dtype == DType::kF16 ? FloatToF16(value) : FloatToBf16(value);
      std::memcpy(bytes + 2 * i, &h, 2);
      return;
    }
    case DType::kF8E4M3:
      bytes[i] = FloatToFp8E4M3(value);
      return;
    case DType::kF8E5M2:
      bytes[i] = FloatToFp8E5M2(value);
      return;
    case DType::kI8: {
      // Rounded to nearest (ties away from zero, as std::lround) and saturated.
      const float v = std::fmin(127.0f, std::fmax(-128.0f, std::round(value)));
      bytes[i] = static_cast<unsigned char>(static_cast<int8_t>(v));
      return;
    }
    case DType::kI32: {
      const int32_t v = static_cast<int32_t>(
          std::fmin(2147483520.0f, std::fmax(-2147483648.0f, std::round(value))));
      std::memcpy(bytes + 4 * i, &v, 4);
      return;
    }
  }
}

}  // namespace tandem
