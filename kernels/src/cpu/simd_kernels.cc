// Instantiates simd_kernels.inc for each instruction set. Each instantiation lives in its own
// namespace and `#pragma GCC target` region: only code defined inside the region is compiled
// for the wider instruction set, so inline library functions (defined before it, in the headers
// above) keep their baseline code and the binary still runs on a CPU without AVX.
#include "kernels/src/cpu/simd_kernels.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "tandem/base/half.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define TANDEM_X86_KERNELS 1
#include <immintrin.h>
#endif

namespace tandem::kernels::cpu {

namespace {

template <float (*kDecode)(uint8_t)>
std::array<float, 256> Fp8Table() {
  std::array<float, 256> values;
  for (int i = 0; i < 256; ++i) values[i] = kDecode(static_cast<uint8_t>(i));
  return values;
}

}  // namespace

const float* Fp8Values(DType dtype) {
  static const std::array<float, 256> e4m3 = Fp8Table<&Fp8E4M3ToFloat>();
  static const std::array<float, 256> e5m2 = Fp8Table<&Fp8E5M2ToFloat>();
  return dtype == DType::kF8E5M2 ? e5m2.data() : e4m3.data();
}

// 2^23 and its bits: a float whose mantissa's low bits are free, so that OR-ing a small
// integer into them gives 2^23 + that integer exactly (int4 weights are widened this way).
constexpr float kNibbleBias = 8388608.0f;
constexpr int kNibbleBiasBits = 0x4b000000;

// What an instruction set without products of bf16 pairs (vdpbf16ps) says of them: declared so
// that simd_kernels.inc compiles, never defined nor called (GemmPanelsDot is instantiated only
// where kBf16Dot holds). The AVX-512 BF16 Vec defines them.
struct WithoutBf16Dot {
  static constexpr bool kBf16Dot = false;
  using Pairs = int;
  using Block = int;
  static Pairs LoadPairs(const uint16_t* p);
  static Pairs SetPair(uint32_t pair);
  template <typename T>
  static T DotPairs(T acc, Pairs a, Pairs b);
  static void RoundPairs(const float* x, uint32_t* pairs);
  static void SplitPairs(const float* x, uint32_t* hi, uint32_t* lo);
  static Block LoadBlock(const uint8_t* p);
  static Block ZeroBlock();
  static Block LowNibbles(Block block);
  static Block HighNibbles(Block block);
  static Block DotBytes(Block acc, Block u, const uint32_t* word);
  template <typename R>
  static R BlockToFloat(Block block);
  static void SplitLevels(const float* x, float ratio, int8_t* h, int8_t* m, int8_t* l);
  static void OctetSums(const int8_t* bytes, int32_t* sums);
};

// Portable: eight lanes of plain C++, which the compiler maps onto SSE2.
namespace portable {

struct Vec : WithoutBf16Dot {
  struct T {
    float v[8];
  };
  static constexpr const char* kName = "cpu-portable";
  static constexpr int kLanes = 8;
  static constexpr int kRowsPerTile = 4;
  // Quantised micro-kernels: one panel per call.
  static constexpr int kQuantRowPanels = 1;
  static constexpr int kQuantPairRows = 0;

  static T Zero() { return Set(0.0f); }
  static T Set(float a) {
    T r;
    for (float& x : r.v) x = a;
    return r;
  }
  static T Load(const float* p) {
    T r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = p[i];
    return r;
  }
  static T LoadN(const float* p, int n) {
    T r = Zero();
    for (int i = 0; i < n; ++i) r.v[i] = p[i];
    return r;
  }
  static T LoadBf16(const uint16_t* p) {
    T r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = Bf16ToFloat(p[i]);
    return r;
  }
  static T LoadF16(const uint16_t* p) {
    T r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = F16ToFloat(p[i]);
    return r;
  }
  static T LoadI8(const int8_t* p) {
    T r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = static_cast<float>(p[i]);
    return r;
  }
  // kLanes bytes, as floats biased so that no conversion instruction is needed: *lo holds
  // 2^23 + low nibble, *hi 2^23 + 16 x high nibble (both exact; kNibbleBias is 2^23, whose
  // float has the mantissa's low bits free for a small integer).
  static void LoadNibblesBiased(const uint8_t* p, T* lo, T* hi) {
    for (int i = 0; i < kLanes; ++i) {
      lo->v[i] = kNibbleBias + static_cast<float>(p[i] & 15);
      hi->v[i] = kNibbleBias + static_cast<float>(p[i] & 0xf0);
    }
  }
  static void Store(float* p, const T& a) {
    for (int i = 0; i < kLanes; ++i) p[i] = a.v[i];
  }
  static void StoreN(float* p, const T& a, int n) {
    for (int i = 0; i < n; ++i) p[i] = a.v[i];
  }
  template <typename Op>
  static T Map(const T& a, const T& b, Op op) {
    T r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = op(a.v[i], b.v[i]);
    return r;
  }
  static T Add(const T& a, const T& b) {
    return Map(a, b, [](float x, float y) { return x + y; });
  }
  static T Sub(const T& a, const T& b) {
    return Map(a, b, [](float x, float y) { return x - y; });
  }
  static T Mul(const T& a, const T& b) {
    return Map(a, b, [](float x, float y) { return x * y; });
  }
  static T Div(const T& a, const T& b) {
    return Map(a, b, [](float x, float y) { return x / y; });
  }
  static T Min(const T& a, const T& b) {
    return Map(a, b, [](float x, float y) { return y < x ? y : x; });
  }
  static T Max(const T& a, const T& b) {
    return Map(a, b, [](float x, float y) { return y > x ? y : x; });
  }
  // Without hardware FMA a fused multiply-add is a slow library call: multiply, then add.
  static T Fma(const T& a, const T& b, const T& c) { return Add(Mul(a, b), c); }
  static T Floor(const T& a) {
    T r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = std::floor(a.v[i]);
    return r;
  }
  // 2^a for integral a in [-126, 127].
  static T Pow2(const T& a) {
    T r;
    for (int i = 0; i < kLanes; ++i) r.v[i] = std::ldexp(1.0f, static_cast<int>(a.v[i]));
    return r;
  }
  static void ReduceAdd4(const T& a, const T& b, const T& c, const T& d, float* out) {
    out[0] = ReduceAdd(a);
    out[1] = ReduceAdd(b);
    out[2] = ReduceAdd(c);
    out[3] = ReduceAdd(d);
  }
  static float ReduceAdd(const T& a) {
    // Pairwise, in the same tree as the AVX2 code.
    float s[4];
    for (int i = 0; i < 4; ++i) s[i] = a.v[i] + a.v[i + 4];
    return (s[0] + s[1]) + (s[2] + s[3]);
  }
};

#include "kernels/src/cpu/simd_kernels.inc"

}  // namespace portable

#if TANDEM_X86_KERNELS

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

struct Vec : WithoutBf16Dot {
  using T = __m256;
  static constexpr const char* kName = "cpu-avx2";
  static constexpr int kLanes = 8;
  // 6 rows x 2 vectors = 12 accumulators, 2 W vectors, 1 broadcast: 15 of 16 registers.
  static constexpr int kRowsPerTile = 6;
  // Two quantised panels' scales and zero points alone would take 8 of the 16 registers.
  static constexpr int kQuantRowPanels = 1;
  static constexpr int kQuantPairRows = 0;

  static __m256i Mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static T Zero() { return _mm256_setzero_ps(); }
  static T Set(float a) { return _mm256_set1_ps(a); }
  static T Load(const float* p) { return _mm256_loadu_ps(p); }
  static T LoadN(const float* p, int n) { return _mm256_maskload_ps(p, Mask(n)); }
  // Eight bf16 (the high half of a float) or fp16 values, widened exactly.
  static T LoadBf16(const uint16_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static T LoadF16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static T LoadI8(const int8_t* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void LoadNibblesBiased(const uint8_t* p, T* lo, T* hi) {
    const __m256i bytes =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i bias = _mm256_set1_epi32(kNibbleBiasBits);
    *lo = _mm256_castsi256_ps(
        _mm256_or_si256(_mm256_and_si256(bytes, _mm256_set1_epi32(15)), bias));
    *hi = _mm256_castsi256_ps(
        _mm256_or_si256(_mm256_and_si256(bytes, _mm256_set1_epi32(0xf0)), bias));
  }
  static void Store(float* p, T a) { _mm256_storeu_ps(p, a); }
  static void StoreN(float* p, T a, int n) { _mm256_maskstore_ps(p, Mask(n), a); }
  static T Add(T a, T b) { return _mm256_add_ps(a, b); }
  static T Sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T Mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T Div(T a, T b) { return _mm256_div_ps(a, b); }
  static T Min(T a, T b) { return _mm256_min_ps(a, b); }
  static T Max(T a, T b) { return _mm256_max_ps(a, b); }
  static T Fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T Floor(T a) { return _mm256_floor_ps(a); }
  static T Pow2(T a) {
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(a), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static float ReduceAdd(T a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // out[0..3] = the lane sums of a, b, c, d.
  static void ReduceAdd4(T a, T b, T c, T d, float* out) {
    const __m256 ab = _mm256_hadd_ps(a, b);      // a01 a23 b01 b23 | a45 a67 b45 b67
    const __m256 cd = _mm256_hadd_ps(c, d);      // c01 c23 d01 d23 | c45 c67 d45 d67
    const __m256 abcd = _mm256_hadd_ps(ab, cd);  // a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
};

#include "kernels/src/cpu/simd_kernels.inc"

}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,f16c")
// GCC 12's own masked-load intrinsics trip this warning (a self-initialised "undefined" vector).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
namespace avx512 {

struct Vec : WithoutBf16Dot {
  using T = __m512;
  static constexpr const char* kName = "cpu-avx512";
  static constexpr int kLanes = 16;
  // 12 rows x 2 vectors = 24 accumulators, 2 W vectors, 1 broadcast: 27 of 32 registers.
  static constexpr int kRowsPerTile = 12;
  // Tiles of up to 3 rows take two quantised panels per call: 3 x 4 accumulators, 4 scales,
  // 4 zero points, 4 W vectors, 1 broadcast and the nibble mask: 26 of 32 registers.
  static constexpr int kQuantPairRows = 3;
  // A one-row tile takes four: 8 accumulators, 8 scales, 8 zero points, the W vectors and
  // the broadcast, a few of them reloaded from L1 at each step.
  static constexpr int kQuantRowPanels = 4;

  static __mmask16 Mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
  static T Zero() { return _mm512_setzero_ps(); }
  static T Set(float a) { return _mm512_set1_ps(a); }
  static T Load(const float* p) { return _mm512_loadu_ps(p); }
  static T LoadN(const float* p, int n) { return _mm512_maskz_loadu_ps(Mask(n), p); }
  static T LoadBf16(const uint16_t* p) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static T LoadF16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static T LoadI8(const int8_t* p) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void LoadNibblesBiased(const uint8_t* p, T* lo, T* hi) {
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i bias = _mm512_set1_epi32(kNibbleBiasBits);
    // (bytes & mask) | bias in one instruction each: 0xea is A & B | C.
    *lo = _mm512_castsi512_ps(
        _mm512_ternarylogic_epi32(bytes, _mm512_set1_epi32(15), bias, 0xea));
    *hi = _mm512_castsi512_ps(
        _mm512_ternarylogic_epi32(bytes, _mm512_set1_epi32(0xf0), bias, 0xea));
  }
  static void Store(float* p, T a) { _mm512_storeu_ps(p, a); }
  static void StoreN(float* p, T a, int n) { _mm512_mask_storeu_ps(p, Mask(n), a); }
  static T Add(T a, T b) { return _mm512_add_ps(a, b); }
  static T Sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T Mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T Div(T a, T b) { return _mm512_div_ps(a, b); }
  static T Min(T a, T b) { return _mm512_min_ps(a, b); }
  static T Max(T a, T b) { return _mm512_max_ps(a, b); }
  static T Fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T Floor(T a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static T Pow2(T a) {
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(a), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  static float ReduceAdd(T a) {
    const __m256 lo = _mm512_castps512_ps256(a);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    const __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // out[0..3] = the lane sums of a, b, c, d: halve each to 8 lanes, then as in AVX2.
  static void ReduceAdd4(T a, T b, T c, T d, float* out) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 ab8 = _mm256_hadd_ps(_mm512_castps512_ps256(ab), _mm512_extractf32x8_ps(ab, 1));
    const __m256 cd8 = _mm256_hadd_ps(_mm512_castps512_ps256(cd), _mm512_extractf32x8_ps(cd, 1));
    const __m256 abcd = _mm256_hadd_ps(ab8, cd8);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  }
};

#include "kernels/src/cpu/simd_kernels.inc"

}  // namespace avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,avx512vnni,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// AVX-512 with BF16 and VNNI: the AVX-512 kernels, but bf16 weights multiply by vdpbf16ps, on x
// carried as two bf16 halves (kTable) or rounded to bf16 (kRoundXTable), see GemmPanelsDot; and
// int4 and int8 weights by vpdpbusd, on x carried as three signed bytes, see ByteDotMicroKernel.
namespace avx512bf16 {

struct Vec : avx512::Vec {
  static constexpr const char* kName = "cpu-avx512-bf16";
  static constexpr const char* kRoundXName = "cpu-avx512-bf16-round";
  static constexpr bool kBf16Dot = true;
  using Pairs = __m512bh;
  using Block = __m512i;
  // 16 bf16 pairs: columns c .. c + 15 of a panel, two k steps each.
  static Pairs LoadPairs(const uint16_t* p) {
    return reinterpret_cast<Pairs>(_mm512_loadu_si512(reinterpret_cast<const void*>(p)));
  }
  static Pairs SetPair(uint32_t pair) {
    return reinterpret_cast<Pairs>(_mm512_set1_epi32(static_cast<int>(pair)));
  }
  // acc + a.lo b.lo + a.hi b.hi per lane, in fp32.
  static T DotPairs(T acc, Pairs a, Pairs b) { return _mm512_dpbf16_ps(acc, a, b); }
  // x[0 .. 31] rounded to bf16 (to nearest even) as 16 pairs (x[2l] low, x[2l + 1] high).
  static void RoundPairs(const float* x, uint32_t* pairs) {
    const __m256bh lo = _mm512_cvtneps_pbh(_mm512_loadu_ps(x));
    const __m256bh hi = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs), reinterpret_cast<__m256i>(lo));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + 8), reinterpret_cast<__m256i>(hi));
  }
  // x[0 .. 31] as two sets of 16 pairs: `hi` the bf16 of x (to nearest even), `lo` the bf16 of
  // what that leaves (x - hi, exact in fp32), so hi + lo is x to about 2^-17 of it.
  static void SplitPairs(const float* x, uint32_t* hi, uint32_t* lo) {
    for (int half = 0; half < 2; ++half) {
      const __m512 v = _mm512_loadu_ps(x + 16 * half);
      const __m256bh h = _mm512_cvtneps_pbh(v);
      const __m512 widened = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(h)), 16));
      const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, widened));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + 8 * half), reinterpret_cast<__m256i>(h));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + 8 * half), reinterpret_cast<__m256i>(l));
    }
  }
  // 64 bytes of an int4 unit (ByteDotMicroKernel): sixteen words of eight nibbles each.
  static Block LoadBlock(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static Block ZeroBlock() { return _mm512_setzero_si512(); }
  // The low and the high nibble of every byte, as unsigned bytes.
  static Block LowNibbles(Block block) { return _mm512_and_si512(block, _mm512_set1_epi8(0x0f)); }
  static Block HighNibbles(Block block) {
    return _mm512_and_si512(_mm512_srli_epi16(block, 4), _mm512_set1_epi8(0x0f));
  }
  // acc + per lane the sum of its four unsigned bytes of u times the four signed bytes of *word.
  // In assembly, with *word broadcast from memory: GCC 12 compiles _mm512_dpbusd_epi32 on an
  // array of accumulators with a copy of each to the stack per product (3.3 G vpdpbusd/s per
  // core measured, against 8.5 G here), and a broadcast register per word would leave the
  // accumulators too few registers.
  static Block DotBytes(Block acc, Block u, const uint32_t* word) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*word));
    return acc;
  }
  // The lanes as floats (exact below 2^24).
  template <typename R = T>
  static R BlockToFloat(Block block) {
    return _mm512_cvtepi32_ps(block);
  }
  // x[0 .. 15] times `ratio` (t = x ratio, |t| <= 127) as three signed bytes each: h = round(t),
  // m = round(254 (t - h)), l = round(254 (254 (t - h) - m)), all rounded to nearest even, so
  // that x = (h + m / 254 + l / 254^2) / ratio to within 1 / ratio / 2 / 254^2 and t's own
  // rounding.
  static void SplitLevels(const float* x, float ratio, int8_t* h, int8_t* m, int8_t* l) {
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 step = _mm512_set1_ps(254.0f);
    const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(ratio));
    const __m512 th = _mm512_roundscale_ps(t, kNearest);
    const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, th), step);
    const __m512 tm = _mm512_roundscale_ps(r, kNearest);
    const __m512 tl = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(r, tm), step), kNearest);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(th)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(tm)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(l), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(tl)));
  }
  // sums[q] (q < 8) = the sum of the signed bytes 8q .. 8q + 7 of bytes[0 .. 63]: vpsadbw of the
  // bytes offset by 128, less 8 x 128.
  static void OctetSums(const int8_t* bytes, int32_t* sums) {
    const __m512i offset =
        _mm512_xor_si512(_mm512_loadu_si512(bytes), _mm512_set1_epi8(static_cast<char>(0x80)));
    const __m512i sad = _mm512_sub_epi64(_mm512_sad_epu8(offset, _mm512_setzero_si512()),
                                         _mm512_set1_epi64(8 * 128));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums), _mm512_cvtepi64_epi32(sad));
  }
};

#include "kernels/src/cpu/simd_kernels.inc"

// As kTable, but bf16 W multiplies x rounded to bf16, once per pair (Backend::LinearRoundsX).
const CpuKernelTable kRoundXTable = [] {
  CpuKernelTable table = kTable;
  table.name = Vec::kRoundXName;
  table.rounds_x = true;
  table.gemm_panels = &GemmPanels<true>;
  return table;
}();

}  // namespace avx512bf16
#pragma GCC diagnostic pop
#pragma GCC pop_options

#endif  // TANDEM_X86_KERNELS

bool CpuSupports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAuto:
    case CpuIsa::kPortable:
      return true;
#if TANDEM_X86_KERNELS
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case CpuIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case CpuIsa::kAvx512Bf16:
    case CpuIsa::kAvx512Bf16Round:
      return CpuSupports(CpuIsa::kAvx512) && __builtin_cpu_supports("avx512bf16") &&
             __builtin_cpu_supports("avx512vnni");
#else
    case CpuIsa::kAvx2:
    case CpuIsa::kAvx512:
    case CpuIsa::kAvx512Bf16:
    case CpuIsa::kAvx512Bf16Round:
      return false;
#endif
  }
  return false;
}

const CpuKernelTable* CpuKernelTableFor(CpuIsa isa) {
  if (isa == CpuIsa::kAuto) {
    // Not kAvx512Bf16Round: it rounds x for bf16 weights, which only an explicit choice may do.
    for (CpuIsa widest : {CpuIsa::kAvx512Bf16, CpuIsa::kAvx512, CpuIsa::kAvx2}) {
      if (CpuSupports(widest)) return CpuKernelTableFor(widest);
    }
    return &portable::kTable;
  }
  if (!CpuSupports(isa)) return nullptr;
  switch (isa) {
#if TANDEM_X86_KERNELS
    case CpuIsa::kAvx512Bf16Round:
      return &avx512bf16::kRoundXTable;
    case CpuIsa::kAvx512Bf16:
      return &avx512bf16::kTable;
    case CpuIsa::kAvx512:
      return &avx512::kTable;
    case CpuIsa::kAvx2:
      return &avx2::kTable;
#endif
    case CpuIsa::kPortable:
      return &portable::kTable;
    default:
      return nullptr;
  }
}

}  // namespace tandem::kernels::cpu
