// The CPU backend against the scalar reference, for every instruction set this CPU supports:
// odd shapes, poisoned outputs, batch invariance and chunked prefill.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/src/cpu/reference.h"
#include "kernels/src/cpu/simd_kernels.h"
#include "kernels/src/kernel_test_support.h"
#include "tandem/base/half.h"
#include "tandem/kernels/backend.h"

namespace tandem::kernels {
namespace {

using test_support::kNaN;
using test_support::MaxRelativeError;
using test_support::Random;

bool BitwiseEqual(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, sizeof(float) * n) == 0;
}

class CpuBackendTest : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!cpu::CpuSupports(GetParam())) GTEST_SKIP() << "this CPU lacks the instruction set";
    backend_ = Make(2);
  }

  std::unique_ptr<Backend> Make(int threads) {
    auto backend = CreateCpuBackend({.num_threads = threads, .isa = GetParam()});
    EXPECT_TRUE(backend.ok()) << backend.status();
    return backend.ok() ? std::move(backend).value() : nullptr;
  }

  std::unique_ptr<Backend> backend_;
};

// ------------------------------------------------------------------------------------------------
// Linear

struct LinearCase {
  int m, n, k;
  bool bias;
};

TEST_P(CpuBackendTest, LinearMatchesReference) {
  // n and k straddle the 16- and 32-column panels and the 256-deep k blocks; k = 5000 takes
  // several of the deep k blocks that few-row products use.
  const std::vector<LinearCase> cases = {
      {1, 1, 1, false},     {1, 45, 300, true},   {3, 100, 13, false},   {7, 257, 517, true},
      {64, 33, 1030, true}, {130, 70, 77, false}, {130, 129, 300, true}, {1, 50, 5000, false},
      {13, 31, 5000, true}, {200, 17, 9, true},
  };
  for (const LinearCase& c : cases) {
    SCOPED_TRACE(testing::Message() << "m=" << c.m << " n=" << c.n << " k=" << c.k);
    const std::vector<float> x = Random(int64_t{c.m} * c.k, 1);
    const std::vector<float> w = Random(int64_t{c.n} * c.k, 2);
    const std::vector<float> bias = Random(c.n, 3);
    const float* b = c.bias ? bias.data() : nullptr;
    std::vector<float> expected(int64_t{c.m} * c.n);
    reference::Linear(x.data(), c.m, w.data(), DType::kF32, c.n, c.k, b, expected.data());
    // Poison plus a guard past the end that must survive.
    std::vector<float> y(expected.size() + 64, kNaN);
    std::fill(y.begin() + expected.size(), y.end(), 12345.0f);
    auto packed = backend_->PackWeight(w.data(), DType::kF32, c.n, c.k);
    ASSERT_EQ(packed->n(), c.n);
    ASSERT_EQ(packed->k(), c.k);
    backend_->Linear(x.data(), DType::kF32, c.m, *packed, b, y.data());
    for (size_t i = expected.size(); i < y.size(); ++i) ASSERT_EQ(y[i], 12345.0f) << "overrun";
    y.resize(expected.size());
    // Error relative to sum |x| |w| (+ |bias|), the scale of a dot product's rounding error
    // whatever cancellation leaves of the result.
    std::vector<float> abs_x(x.size()), abs_w(w.size()), abs_bias(bias.size()), scale(y.size());
    for (size_t i = 0; i < x.size(); ++i) abs_x[i] = std::abs(x[i]);
    for (size_t i = 0; i < w.size(); ++i) abs_w[i] = std::abs(w[i]);
    for (size_t i = 0; i < bias.size(); ++i) abs_bias[i] = std::abs(bias[i]);
    reference::Linear(abs_x.data(), c.m, abs_w.data(), DType::kF32, c.n, c.k,
                      c.bias ? abs_bias.data() : nullptr, scale.data());
    double worst = 0.0;
    for (size_t i = 0; i < y.size(); ++i) {
      ASSERT_TRUE(std::isfinite(y[i])) << "element " << i << " not written";
      worst = std::max(worst, std::abs(double{y[i]} - expected[i]) / (scale[i] + 1e-30));
    }
    // Observed up to 2e-7 (about 3 ulp); an element from the wrong row or column is off by O(1).
    EXPECT_LT(worst, 1e-6);
  }
}

// fp32 and bf16 weights (the AVX-512 BF16 sets multiply bf16 ones by vdpbf16ps, in k blocks and
// row passes of their own).
TEST_P(CpuBackendTest, LinearRowsAreBatchInvariant) {
  const int n = 300, k = 517, m = 17;
  const std::vector<float> x = Random(int64_t{m} * k, 4);
  const std::vector<float> w = Random(int64_t{n} * k, 5);
  std::vector<uint16_t> w_bf16(w.size());
  for (size_t i = 0; i < w.size(); ++i) w_bf16[i] = FloatToBf16(w[i]);
  const std::vector<float> bias = Random(n, 6);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const void* w_data = dtype == DType::kF32 ? static_cast<const void*>(w.data()) : w_bf16.data();
    auto packed = backend_->PackWeight(w_data, dtype, n, k);
    std::vector<float> batched(int64_t{m} * n, kNaN);
    backend_->Linear(x.data(), DType::kF32, m, *packed, bias.data(), batched.data());
    for (int i = 0; i < m; ++i) {
      std::vector<float> alone(n, kNaN);
      backend_->Linear(x.data() + int64_t{i} * k, DType::kF32, 1, *packed, bias.data(),
                       alone.data());
      EXPECT_TRUE(BitwiseEqual(alone.data(), batched.data() + int64_t{i} * n, n)) << "row " << i;
    }
    // The same rows at other offsets of a taller batch, and on pools of other sizes.
    std::vector<float> tall_x = Random(int64_t{130} * k, 7);
    std::copy(x.begin(), x.end(), tall_x.begin() + int64_t{101} * k);
    for (int threads : {1, 3}) {
      std::unique_ptr<Backend> other = Make(threads);
      auto other_packed = other->PackWeight(w_data, dtype, n, k);
      std::vector<float> tall(int64_t{130} * n, kNaN);
      other->Linear(tall_x.data(), DType::kF32, 130, *other_packed, bias.data(), tall.data());
      EXPECT_TRUE(BitwiseEqual(tall.data() + int64_t{101} * n, batched.data(), int64_t{m} * n))
          << threads << " threads";
    }
  }
}

// Quantised weights: short row tiles take two panels per micro-kernel call (AVX-512), taller
// ones one; a row's output must not depend on which it got, on the threads, or on where the
// pool's chunks of panels begin.
TEST_P(CpuBackendTest, QuantizedLinearRowsAreBatchInvariant) {
  // n = 300: ten 32-column panels or nineteen 16-column ones, the last partial. k = 512 holds
  // four int4 groups of 128; k = 640 in act order (as GPTQ stores it) five, the last in a
  // k block of its own (blocks are 256 deep). Decode rows (1 and 2) take the int4 kernel's
  // whole-k path, taller tiles its block-by-block one.
  const int n = 300, m = 17;
  for (const bool act_order : {false, true}) {
    const int k = act_order ? 640 : 512;
    std::mt19937 rng(8);
    std::vector<int8_t> values(int64_t{n} * k);
    std::vector<int8_t> zeros(int64_t{n} * (k / 128));
    for (int8_t& z : zeros) z = static_cast<int8_t>(rng() % 17);
    std::vector<int32_t> order(k);
    std::iota(order.begin(), order.end(), 0);
    if (act_order) std::shuffle(order.begin(), order.end(), rng);
    const std::vector<float> x = Random(int64_t{m} * k, 9);
    const std::vector<float> bias = Random(n, 10);
    for (WeightQuant quant : {WeightQuant::kInt8, WeightQuant::kInt4}) {
      SCOPED_TRACE(quant == WeightQuant::kInt8 ? "int8" : "int4");
      SCOPED_TRACE(act_order ? "act order" : "in order");
      const bool int4 = quant == WeightQuant::kInt4;
      for (int8_t& v : values) {
        v = static_cast<int8_t>(int4 ? rng() % 16 : static_cast<int>(rng() % 256) - 128);
      }
      const std::vector<float> scales =
          Random(int64_t{n} * (int4 ? k / 128 : 1), 11, 0.001f, 0.02f);
      const QuantizedWeightView view{.quant = quant,
                                     .n = n,
                                     .k = k,
                                     .group_size = int4 ? 128 : k,
                                     .values = values.data(),
                                     .scales = scales.data(),
                                     .zeros = int4 ? zeros.data() : nullptr,
                                     .k_order = int4 && act_order ? order.data() : nullptr};
      auto packed = backend_->PackQuantizedWeight(view);
      std::vector<float> batched(int64_t{m} * n, kNaN);
      backend_->Linear(x.data(), DType::kF32, m, *packed, bias.data(), batched.data());
      for (int rows : {1, 2, 3, 4}) {
        for (int i = 0; i + rows <= m; i += 5) {
          std::vector<float> few(int64_t{rows} * n, kNaN);
          backend_->Linear(x.data() + int64_t{i} * k, DType::kF32, rows, *packed, bias.data(),
                           few.data());
          EXPECT_TRUE(BitwiseEqual(few.data(), batched.data() + int64_t{i} * n, int64_t{rows} * n))
              << rows << " rows from row " << i;
        }
      }
      for (int threads : {1, 3}) {
        std::unique_ptr<Backend> other = Make(threads);
        auto other_packed = other->PackQuantizedWeight(view);
        std::vector<float> alone(n, kNaN);
        other->Linear(x.data() + int64_t{6} * k, DType::kF32, 1, *other_packed, bias.data(),
                      alone.data());
        EXPECT_TRUE(BitwiseEqual(alone.data(), batched.data() + int64_t{6} * n, n))
            << threads << " threads";
      }
    }
  }
}

// int4 weights [n, k] in groups of 128 over the given nibbles, scales and zero points.
QuantizedWeightView Int4Group128(int n, int k, const std::vector<int8_t>& nibbles,
                                 const std::vector<float>& scales,
                                 const std::vector<int8_t>& zeros) {
  return {.quant = WeightQuant::kInt4,
          .n = n,
          .k = k,
          .group_size = 128,
          .values = nibbles.data(),
          .scales = scales.data(),
          .zeros = zeros.data()};
}

// An int4 Linear whose x row holds a NaN or an infinity gives that row non-finite outputs, not
// finite garbage (the AVX-512 BF16 kernel carries x in bytes of a per-row scale, which such a
// row makes NaN); a row of zeros gives the bias exactly; the other rows are unaffected.
TEST_P(CpuBackendTest, Int4LinearKeepsNonFiniteRowsNonFinite) {
  const int n = 64, k = 256, m = 4;
  std::vector<int8_t> nibbles(int64_t{n} * k);
  for (size_t i = 0; i < nibbles.size(); ++i) nibbles[i] = static_cast<int8_t>(i % 16);
  const std::vector<float> scales = Random(int64_t{n} * (k / 128), 31, 0.001f, 0.02f);
  const std::vector<int8_t> zeros(scales.size(), 8);
  auto packed = backend_->PackQuantizedWeight(Int4Group128(n, k, nibbles, scales, zeros));
  std::vector<float> x = Random(int64_t{m} * k, 32);
  x[5] = std::numeric_limits<float>::quiet_NaN();         // row 0
  x[k + 9] = std::numeric_limits<float>::infinity();      // row 1
  std::fill(x.begin() + 2 * k, x.begin() + 3 * k, 0.0f);  // row 2
  const std::vector<float> bias = Random(n, 33);
  for (int rows : {1, m}) {
    for (int first = 0; first + rows <= m; ++first) {
      std::vector<float> y(int64_t{rows} * n, kNaN);
      backend_->Linear(x.data() + int64_t{first} * k, DType::kF32, rows, *packed, bias.data(),
                       y.data());
      for (int i = 0; i < rows; ++i) {
        const int row = first + i;
        for (int c = 0; c < n; ++c) {
          const float v = y[int64_t{i} * n + c];
          if (row < 2) {
            EXPECT_FALSE(std::isfinite(v)) << "row " << row << " column " << c;
          } else if (row == 2) {
            EXPECT_EQ(v, bias[c]) << "column " << c;
          } else {
            EXPECT_TRUE(std::isfinite(v)) << "column " << c;
          }
        }
      }
    }
  }
}

// Decode rows pack x once per thread per Linear and reuse it for that thread's later chunks of
// panels: Linears of different x in turn (n = 2048 is 64 panels, several chunks per thread) must
// each read their own x, whatever the weights' format.
TEST_P(CpuBackendTest, DecodeRowLinearsInTurnReadTheirOwnX) {
  const int n = 2048, k = 1024;
  const std::vector<float> w = Random(int64_t{n} * k, 21);
  std::vector<uint16_t> w_bf16(w.size());
  for (size_t i = 0; i < w.size(); ++i) w_bf16[i] = FloatToBf16(w[i]);
  std::vector<int8_t> nibbles(w.size());
  for (size_t i = 0; i < w.size(); ++i) nibbles[i] = static_cast<int8_t>((i * 7 + i / 5) % 16);
  const std::vector<float> scales = Random(int64_t{n} * (k / 128), 22, 0.001f, 0.02f);
  std::vector<int8_t> zeros(scales.size());
  for (size_t i = 0; i < zeros.size(); ++i) zeros[i] = static_cast<int8_t>(i % 16);
  const QuantizedWeightView int4 = Int4Group128(n, k, nibbles, scales, zeros);
  for (int format = 0; format < 3; ++format) {
    SCOPED_TRACE(format == 0 ? "float32" : format == 1 ? "bfloat16" : "int4");
    auto pack = [&](Backend& b) {
      if (format == 2) return b.PackQuantizedWeight(int4);
      return format == 0 ? b.PackWeight(w.data(), DType::kF32, n, k)
                         : b.PackWeight(w_bf16.data(), DType::kBF16, n, k);
    };
    auto packed = pack(*backend_);
    // The wanted outputs: each x the first Linear of a fresh one-thread backend.
    auto first_linear = [&](const std::vector<float>& x, int rows) {
      std::unique_ptr<Backend> fresh = Make(1);
      std::vector<float> y(int64_t{rows} * n, kNaN);
      fresh->Linear(x.data(), DType::kF32, rows, *pack(*fresh), nullptr, y.data());
      return y;
    };
    for (int rows : {1, 2}) {
      const std::vector<float> a = Random(int64_t{rows} * k, 23);
      const std::vector<float> b = Random(int64_t{rows} * k, 24);
      std::vector<float> ya(int64_t{rows} * n, kNaN), yb(ya), ya_again(ya);
      backend_->Linear(a.data(), DType::kF32, rows, *packed, nullptr, ya.data());
      backend_->Linear(b.data(), DType::kF32, rows, *packed, nullptr, yb.data());
      backend_->Linear(a.data(), DType::kF32, rows, *packed, nullptr, ya_again.data());
      const std::vector<float> want_a = first_linear(a, rows);
      const std::vector<float> want_b = first_linear(b, rows);
      EXPECT_TRUE(BitwiseEqual(ya.data(), want_a.data(), int64_t{rows} * n)) << rows << " rows";
      EXPECT_TRUE(BitwiseEqual(yb.data(), want_b.data(), int64_t{rows} * n)) << rows << " rows";
      EXPECT_TRUE(BitwiseEqual(ya_again.data(), want_a.data(), int64_t{rows} * n))
          << rows << " rows";
      EXPECT_FALSE(BitwiseEqual(ya.data(), yb.data(), int64_t{rows} * n));
    }
  }
}

TEST_P(CpuBackendTest, LinearWithEmptyReductionGivesBias) {
  const std::vector<float> bias = {1.5f, -2.0f, 3.0f};
  auto packed = backend_->PackWeight(nullptr, DType::kF32, 3, 0);
  std::vector<float> y(6, kNaN);
  backend_->Linear(nullptr, DType::kF32, 2, *packed, bias.data(), y.data());
  EXPECT_EQ(y, (std::vector<float>{1.5f, -2.0f, 3.0f, 1.5f, -2.0f, 3.0f}));
}

// ------------------------------------------------------------------------------------------------
// Row operators

TEST_P(CpuBackendTest, RmsNormMatchesReference) {
  for (int dim : {1, 7, 64, 100, 2048, 4099}) {
    for (int rows : {1, 3, 130}) {
      SCOPED_TRACE(testing::Message() << "rows=" << rows << " dim=" << dim);
      const std::vector<float> x = Random(int64_t{rows} * dim, 8, -3.0f, 3.0f);
      const std::vector<float> weight = Random(dim, 9, 0.5f, 1.5f);
      std::vector<float> expected(x.size());
      reference::RmsNorm(x.data(), weight.data(), 1e-5f, rows, dim, expected.data());
      std::vector<float> y(x.size(), kNaN);
      backend_->RmsNorm(x.data(), weight.data(), 1e-5f, rows, dim, y.data(), DType::kF32);
      EXPECT_LT(MaxRelativeError(y, expected), 1e-5);
      // In place, as the model runner does for q/k norms.
      std::vector<float> in_place = x;
      backend_->RmsNorm(in_place.data(), weight.data(), 1e-5f, rows, dim, in_place.data(),
                        DType::kF32);
      EXPECT_EQ(in_place, y);
    }
  }
}

TEST_P(CpuBackendTest, AddRmsNormUpdatesResidualAndNormalises) {
  for (int dim : {5, 64, 2048, 3001}) {
    for (int rows : {1, 7, 64}) {
      SCOPED_TRACE(testing::Message() << "rows=" << rows << " dim=" << dim);
      const std::vector<float> residual = Random(int64_t{rows} * dim, 10, -2.0f, 2.0f);
      const std::vector<float> x = Random(residual.size(), 11);
      const std::vector<float> weight = Random(dim, 12, 0.5f, 1.5f);
      std::vector<float> expected_residual = residual;
      std::vector<float> expected(residual.size());
      reference::AddRmsNorm(expected_residual.data(), x.data(), weight.data(), 1e-6f, rows, dim,
                            expected.data());
      std::vector<float> actual_residual = residual;
      std::vector<float> y(residual.size(), kNaN);
      backend_->AddRmsNorm(actual_residual.data(), x.data(), weight.data(), 1e-6f, rows, dim,
                           y.data(), DType::kF32);
      EXPECT_EQ(actual_residual, expected_residual);  // a single fp32 add either way
      EXPECT_LT(MaxRelativeError(y, expected), 1e-5);
    }
  }
}

TEST_P(CpuBackendTest, SiluMulMatchesReference) {
  for (int inter : {1, 9, 64, 1000, 8193}) {
    for (int rows : {1, 3, 64}) {
      SCOPED_TRACE(testing::Message() << "rows=" << rows << " inter=" << inter);
      // Gates far into both tails, where exp overflows or underflows.
      const std::vector<float> gate_up = Random(int64_t{rows} * 2 * inter, 13, -100.0f, 100.0f);
      std::vector<float> expected(int64_t{rows} * inter);
      reference::SiluMul(gate_up.data(), rows, inter, expected.data());
      std::vector<float> out(expected.size(), kNaN);
      backend_->SiluMul(gate_up.data(), rows, inter, out.data(), DType::kF32);
      EXPECT_LT(MaxRelativeError(out, expected), 1e-5);
    }
  }
}

TEST_P(CpuBackendTest, RopeMatchesReference) {
  RopeConfig llama3{.head_dim = 128,
                    .theta = 500000.0f,
                    .llama3_scaling = true,
                    .factor = 8.0f,
                    .low_freq_factor = 1.0f,
                    .high_freq_factor = 4.0f,
                    .original_max_position = 8192};
  for (int head_dim : {2, 20, 64, 128}) {
    for (bool scaled : {false, true}) {
      RopeConfig config = scaled ? llama3 : RopeConfig{.theta = 10000.0f};
      config.head_dim = head_dim;
      const std::vector<float> inv_freq = RopeInverseFrequencies(config);
      const int tokens = 37, heads = 5;
      std::vector<int32_t> positions(tokens);
      for (int t = 0; t < tokens; ++t) positions[t] = (t * 977) % 40000;  // far positions too
      SCOPED_TRACE(testing::Message() << "head_dim=" << head_dim << " llama3=" << scaled);
      const std::vector<float> x = Random(int64_t{tokens} * heads * head_dim, 14);
      std::vector<float> expected = x;
      reference::Rope(expected.data(), positions.data(), tokens, heads, head_dim, inv_freq.data());
      std::vector<float> actual = x;
      backend_->Rope(actual.data(), positions.data(), tokens, heads, head_dim, inv_freq.data());
      EXPECT_LT(MaxRelativeError(actual, expected, 0.1), 1e-6);
    }
  }
}

// Host staging memory is host memory of the size asked for, kept across moves.
TEST(CpuBackendMemoryTest, HostStagingIsWritableHostMemory) {
  auto backend = CreateCpuBackend({.num_threads = 1});
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto staging = (*backend)->AllocateHostStaging(1000 * sizeof(float));
  ASSERT_TRUE(staging.ok()) << staging.status();
  EXPECT_EQ(staging->bytes(), 1000 * sizeof(float));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(staging->data()) % 64, 0u);
  std::vector<float> values(1000);
  std::iota(values.begin(), values.end(), 0.0f);
  auto device = (*backend)->Allocate(1000 * sizeof(float));
  ASSERT_TRUE(device.ok()) << device.status();
  (*backend)->CopyToDevice(device->data(), values.data(), device->bytes());
  (*backend)->CopyToHost(staging->data(), device->data(), device->bytes());
  ASSERT_TRUE((*backend)->Synchronize().ok());
  DeviceBuffer moved = std::move(*staging);
  EXPECT_EQ(staging->data(), nullptr);
  EXPECT_TRUE(std::equal(values.begin(), values.end(), moved.as<float>()));
}

// A batch of no sequences (null arrays) writes nothing, whatever the output's dtype.
TEST(CpuBackendMemoryTest, PagedAttentionOfNoSequencesWritesNothing) {
  auto backend = CreateCpuBackend({.num_threads = 1});
  ASSERT_TRUE(backend.ok()) << backend.status();
  const KvLayout layout{.num_blocks = 1, .block_size = 16, .num_kv_heads = 1, .head_dim = 64};
  std::vector<float> cache(2 * 16 * 64, 0.0f), q(64, 1.0f);
  for (DType out_dtype : {DType::kF32, DType::kBF16}) {
    std::vector<uint32_t> out(8, 0xA5A5A5A5u);
    (*backend)->PagedAttention(q.data(), cache.data(), layout, PagedAttentionBatch{}, 1, 0.125f,
                               out.data(), out_dtype);
    EXPECT_EQ(out, std::vector<uint32_t>(8, 0xA5A5A5A5u)) << DTypeName(out_dtype);
  }
}

// Groups of unequal size must cover k in order, each non-empty, and only int4 has them.
TEST(QuantizedWeightViewTest, GroupBoundsAreChecked) {
  const std::vector<int8_t> values(2 * 10, 3);
  const std::vector<float> scales(2 * 3, 0.5f);
  const std::vector<int8_t> zeros(2 * 3, 8);
  auto view = [&](const std::vector<int32_t>& starts) {
    return QuantizedWeightView{.quant = WeightQuant::kInt4,
                               .n = 2,
                               .k = 10,
                               .group_size = 4,
                               .values = values.data(),
                               .scales = scales.data(),
                               .zeros = zeros.data(),
                               .group_starts = starts.data(),
                               .num_groups = static_cast<int>(starts.size()) - 1};
  };
  const std::vector<int32_t> good = {0, 3, 4, 10};
  EXPECT_TRUE(ValidateQuantizedWeight(view(good)).ok()) << ValidateQuantizedWeight(view(good));
  EXPECT_EQ(GroupStarts(view(good)), good);
  // (q - zero) * scale, each column by its own group's entry.
  const std::vector<float> w = DequantizeWeight(view(good));
  for (float v : w) EXPECT_EQ(v, (3 - 8) * 0.5f);
  for (const std::vector<int32_t>& bad : std::vector<std::vector<int32_t>>{
           {0, 3, 3, 10}, {1, 3, 4, 10}, {0, 3, 4, 9}, {0, 5, 4, 10}}) {
    const absl::Status status = ValidateQuantizedWeight(view(bad));
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad[1] << " " << bad[2];
  }
  QuantizedWeightView int8 = view(good);
  int8.quant = WeightQuant::kInt8;
  int8.zeros = nullptr;
  EXPECT_FALSE(ValidateQuantizedWeight(int8).ok());
}

TEST(RopeInverseFrequenciesTest, MatchesThetaFormula) {
  const std::vector<float> inv = RopeInverseFrequencies({.head_dim = 64, .theta = 10000.0f});
  ASSERT_EQ(inv.size(), 32u);
  for (int i = 0; i < 32; ++i) {
    EXPECT_FLOAT_EQ(inv[i], static_cast<float>(std::pow(10000.0, -2.0 * i / 64)));
  }
}

TEST(RopeInverseFrequenciesTest, Llama3ScalingKeepsHighStretchesLowAndBlendsBetween) {
  const RopeConfig config{.head_dim = 128,
                          .theta = 500000.0f,
                          .llama3_scaling = true,
                          .factor = 8.0f,
                          .low_freq_factor = 1.0f,
                          .high_freq_factor = 4.0f,
                          .original_max_position = 8192};
  const std::vector<float> inv = RopeInverseFrequencies(config);
  ASSERT_EQ(inv.size(), 64u);
  int kept = 0, stretched = 0, blended = 0;
  for (int i = 0; i < 64; ++i) {
    const double plain = std::pow(500000.0, -2.0 * i / 128);
    const double wavelen = 2 * M_PI / plain;
    if (wavelen < 8192.0 / 4) {
      EXPECT_FLOAT_EQ(inv[i], static_cast<float>(plain)) << i;
      ++kept;
    } else if (wavelen > 8192.0 / 1) {
      EXPECT_FLOAT_EQ(inv[i], static_cast<float>(plain / 8)) << i;
      ++stretched;
    } else {
      const double smooth = (8192.0 / wavelen - 1) / (4 - 1);
      EXPECT_FLOAT_EQ(inv[i], static_cast<float>((1 - smooth) * plain / 8 + smooth * plain)) << i;
      EXPECT_LT(inv[i], plain);
      EXPECT_GT(inv[i], plain / 8);
      ++blended;
    }
  }
  // Llama 3.1's table has all three regimes.
  EXPECT_GT(kept, 0);
  EXPECT_GT(stretched, 0);
  EXPECT_GT(blended, 0);
}

TEST_P(CpuBackendTest, EmbeddingGathersRows) {
  const int vocab = 50, dim = 37, tokens = 70;
  const std::vector<float> table = Random(int64_t{vocab} * dim, 15);
  std::vector<int32_t> ids(tokens);
  for (int t = 0; t < tokens; ++t) ids[t] = (t * 7 + 3) % vocab;
  std::vector<float> expected(int64_t{tokens} * dim);
  reference::Embedding(table.data(), DType::kF32, ids.data(), tokens, dim, expected.data());
  std::vector<float> out(expected.size(), kNaN);
  backend_->Embedding(table.data(), DType::kF32, ids.data(), tokens, dim, out.data());
  EXPECT_EQ(out, expected);
}

TEST_P(CpuBackendTest, WriteKvStoresAtSlotsAndSkipsPadding) {
  const KvLayout layout{.num_blocks = 6, .block_size = 8, .num_kv_heads = 3, .head_dim = 20};
  const int tokens = 11;
  const std::vector<int32_t> slots = {0, 7, 8, 47, 20, -1, 21, 22, 3, 40, 41};
  const int64_t row = int64_t{layout.num_kv_heads} * layout.head_dim;
  const std::vector<float> k = Random(tokens * row, 16);
  const std::vector<float> v = Random(tokens * row, 17);
  std::vector<float> expected(layout.LayerElements(), 7.0f);
  reference::WriteKv(k.data(), v.data(), slots.data(), tokens, layout, expected.data());
  std::vector<float> cache(layout.LayerElements(), 7.0f);
  backend_->WriteKv(k.data(), v.data(), slots.data(), tokens, layout, cache.data());
  EXPECT_EQ(cache, expected);
  // Spot-check the layout itself: V of token 3 (slot 47) is the last slot of the V half.
  EXPECT_EQ(cache[layout.LayerElements() - 1], v[4 * row - 1]);
}

TEST_P(CpuBackendTest, GatherAddSumsTheChosenRows) {
  const int rows = 40, dim = 33;
  const std::vector<float> a = Random(int64_t{rows} * dim, 18), b = Random(int64_t{rows} * dim, 19);
  const std::vector<int32_t> chosen = {39, 0, 17, 17, 5};
  const int n = static_cast<int>(chosen.size());
  std::vector<float> expected(int64_t{n} * dim);
  reference::GatherAdd(a.data(), b.data(), chosen.data(), n, dim, expected.data());
  std::vector<float> out(expected.size(), kNaN);
  backend_->GatherAdd(a.data(), b.data(), chosen.data(), n, dim, out.data());
  EXPECT_EQ(out, expected);
}

// ------------------------------------------------------------------------------------------------
// Memory: on the CPU backend operator memory is host memory and the copies are plain memcpy.

TEST_P(CpuBackendTest, AllocatedBuffersAreHostMemoryAndCopiesMoveBytes) {
  ASSERT_TRUE(backend_->host_memory());
  auto buffer = backend_->Allocate(64 * sizeof(float));
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  EXPECT_EQ(buffer->bytes(), 64 * sizeof(float));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % 64, 0u);
  const std::vector<float> in = Random(64, 20);
  backend_->CopyToDevice(buffer->data(), in.data(), buffer->bytes());
  EXPECT_TRUE(BitwiseEqual(buffer->as<float>(), in.data(), 64));
  std::vector<float> out(64, kNaN);
  backend_->CopyToHost(out.data(), buffer->data(), buffer->bytes());
  ASSERT_TRUE(backend_->Synchronize().ok());
  EXPECT_EQ(out, in);

  // A moved-from buffer owns nothing; the destination frees the bytes once.
  kernels::DeviceBuffer moved = std::move(buffer).value();
  EXPECT_EQ(moved.bytes(), 64 * sizeof(float));
  kernels::DeviceBuffer other;
  other = std::move(moved);
  EXPECT_EQ(moved.data(), nullptr);
  EXPECT_NE(other.data(), nullptr);
}

TEST_P(CpuBackendTest, CopyRowsMovesStridedRows) {
  // The q part of rows of a fused [rows, q + k + v] projection, as the model runner splits it.
  const int rows = 9, wide = 24, narrow = 10, offset = 6;
  const std::vector<float> src = Random(int64_t{rows} * wide, 21);
  std::vector<float> dst(int64_t{rows} * narrow, kNaN);
  backend_->CopyRows(dst.data(), narrow * sizeof(float), src.data() + offset,
                     wide * sizeof(float), narrow * sizeof(float), rows);
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < narrow; ++j) {
      ASSERT_EQ(dst[r * narrow + j], src[r * wide + offset + j]) << r << ", " << j;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// PagedAttention

struct AttentionSeq {
  int q_len;
  int context_len;
};

// A layer cache and batch built for a list of sequences: each sequence's blocks are scattered
// over the cache, every slot that no sequence owns is NaN (so reading one poisons the output),
// and queries are random.
class AttentionProblem {
 public:
  AttentionProblem(int head_dim, int num_kv_heads, int group, int block_size,
                   const std::vector<AttentionSeq>& seqs, uint32_t seed)
      : num_heads_(num_kv_heads * group), seqs_(seqs) {
    int total_blocks = 0;
    max_blocks_ = 1;
    for (const AttentionSeq& s : seqs) {
      const int blocks = (s.context_len + block_size - 1) / block_size;
      total_blocks += blocks;
      max_blocks_ = std::max(max_blocks_, blocks);
    }
    layout_ = {.num_blocks = total_blocks + 3,
               .block_size = block_size,
               .num_kv_heads = num_kv_heads,
               .head_dim = head_dim};
    std::vector<int32_t> physical(layout_.num_blocks);
    std::iota(physical.begin(), physical.end(), 0);
    std::shuffle(physical.begin(), physical.end(), std::mt19937(seed));
    cache_.assign(layout_.LayerElements(), kNaN);
    block_table_.assign(seqs.size() * max_blocks_, -1);
    query_start_.push_back(0);
    const int64_t slot_floats = int64_t{num_kv_heads} * head_dim;
    std::mt19937 gen(seed + 1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    int next = 0;
    for (size_t s = 0; s < seqs.size(); ++s) {
      for (int b = 0; b * block_size < seqs[s].context_len; ++b) {
        block_table_[s * max_blocks_ + b] = physical[next++];
      }
      for (int pos = 0; pos < seqs[s].context_len; ++pos) {
        const int64_t slot =
            int64_t{block_table_[s * max_blocks_ + pos / block_size]} * block_size +
            pos % block_size;
        for (int64_t i = 0; i < slot_floats; ++i) {
          cache_[slot * slot_floats + i] = dist(gen);
          cache_[layout_.HalfElements() + slot * slot_floats + i] = dist(gen);
        }
      }
      query_start_.push_back(query_start_.back() + seqs[s].q_len);
      context_len_.push_back(seqs[s].context_len);
    }
    q_ = Random(int64_t{query_start_.back()} * num_heads_ * head_dim, seed + 2, -2.0f, 2.0f);
  }

  PagedAttentionBatch batch() const {
    return {.num_seqs = static_cast<int>(seqs_.size()),
            .query_start = query_start_.data(),
            .context_len = context_len_.data(),
            .block_table = block_table_.data(),
            .max_blocks_per_seq = max_blocks_};
  }
  int64_t out_size() const { return int64_t{query_start_.back()} * num_heads_ * layout_.head_dim; }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(layout_.head_dim)); }

  std::vector<float> Run(Backend& backend) const {
    std::vector<float> out(out_size(), kNaN);
    backend.PagedAttention(q_.data(), cache_.data(), layout_, batch(), num_heads_, scale(),
                           out.data(), DType::kF32);
    return out;
  }
  std::vector<float> Reference() const {
    std::vector<float> out(out_size(), kNaN);
    reference::PagedAttention(q_.data(), cache_.data(), layout_, batch(), num_heads_, scale(),
                              out.data());
    return out;
  }

  int num_heads() const { return num_heads_; }
  int max_blocks() const { return max_blocks_; }
  const KvLayout& layout() const { return layout_; }
  const std::vector<float>& q() const { return q_; }
  std::vector<float>& cache() { return cache_; }
  const std::vector<int32_t>& block_table() const { return block_table_; }

 private:
  int num_heads_;
  std::vector<AttentionSeq> seqs_;
  KvLayout layout_;
  int max_blocks_ = 1;
  std::vector<float> cache_;
  std::vector<int32_t> block_table_;
  std::vector<int32_t> query_start_;
  std::vector<int32_t> context_len_;
  std::vector<float> q_;
};

struct AttentionShape {
  int head_dim, kv_heads, group, block_size;
};

TEST_P(CpuBackendTest, PagedAttentionMatchesReference) {
  const std::vector<AttentionShape> shapes = {
      {64, 2, 1, 8}, {128, 2, 2, 16}, {64, 1, 4, 32}, {128, 2, 4, 16}, {80, 1, 3, 8},
  };
  // Decode rows (q_len 1), whole prompts, and chunks of prompts whose context includes
  // earlier chunks, mixed in one batch; contexts from 1 to 700.
  const std::vector<std::vector<AttentionSeq>> batches = {
      {{1, 1}},
      {{1, 700}},
      {{1, 17}, {1, 33}, {1, 256}, {1, 5}},
      {{37, 37}},
      {{64, 300}, {1, 90}, {19, 19}, {1, 700}, {100, 164}},
  };
  for (const AttentionShape& shape : shapes) {
    for (size_t b = 0; b < batches.size(); ++b) {
      SCOPED_TRACE(testing::Message()
                   << "head_dim=" << shape.head_dim << " kv_heads=" << shape.kv_heads
                   << " group=" << shape.group << " block=" << shape.block_size << " batch=" << b);
      const AttentionProblem problem(shape.head_dim, shape.kv_heads, shape.group, shape.block_size,
                                     batches[b], 100 + b);
      EXPECT_LT(MaxRelativeError(problem.Run(*backend_), problem.Reference(), 0.05), 2e-5);
    }
  }
}

TEST_P(CpuBackendTest, PagedAttentionOfASequenceIgnoresTheRestOfTheBatch) {
  const std::vector<AttentionSeq> target = {{1, 333}, {45, 70}};
  AttentionProblem alone(128, 2, 4, 16, target, 7);
  const std::vector<float> alone_out = alone.Run(*backend_);

  // The same two sequences behind and between others, with their data copied over.
  const std::vector<AttentionSeq> mixed = {{20, 500}, {1, 333}, {3, 3}, {45, 70}, {1, 1}};
  AttentionProblem batched(128, 2, 4, 16, mixed, 8);
  const int bs = 16;
  const int64_t slot_floats = 2 * 128;
  const int64_t alone_half = alone.layout().HalfElements();
  const int64_t batched_half = batched.layout().HalfElements();
  const int to_seq[2] = {1, 3};
  std::vector<float> q = batched.q();
  const int64_t q_row = 8 * 128;
  const int alone_first_token[2] = {0, 1};
  const int batched_first_token[2] = {20, 24};
  for (int i = 0; i < 2; ++i) {
    for (int pos = 0; pos < target[i].context_len; ++pos) {
      const int64_t from =
          int64_t{alone.block_table()[i * alone.max_blocks() + pos / bs]} * bs + pos % bs;
      const int64_t to =
          int64_t{batched.block_table()[to_seq[i] * batched.max_blocks() + pos / bs]} * bs +
          pos % bs;
      for (int64_t e = 0; e < slot_floats; ++e) {
        batched.cache()[to * slot_floats + e] = alone.cache()[from * slot_floats + e];
        batched.cache()[batched_half + to * slot_floats + e] =
            alone.cache()[alone_half + from * slot_floats + e];
      }
    }
    std::copy_n(alone.q().begin() + alone_first_token[i] * q_row, target[i].q_len * q_row,
                q.begin() + batched_first_token[i] * q_row);
  }
  std::vector<float> out(batched.out_size(), kNaN);
  for (int threads : {1, 2, 3}) {
    std::unique_ptr<Backend> backend = Make(threads);
    backend->PagedAttention(q.data(), batched.cache().data(), batched.layout(), batched.batch(), 8,
                            batched.scale(), out.data(), DType::kF32);
    for (int i = 0; i < 2; ++i) {
      EXPECT_TRUE(BitwiseEqual(out.data() + batched_first_token[i] * q_row,
                               alone_out.data() + alone_first_token[i] * q_row,
                               target[i].q_len * q_row))
          << "sequence " << i << " with " << threads << " threads";
    }
  }
}

TEST_P(CpuBackendTest, ChunkedPrefillEqualsWholePrompt) {
  // A 300-token prompt attended all at once, then in chunks of 64 over the same cache (a chunk
  // sees the whole prompt so far, exactly as the scheduler runs it).
  AttentionProblem whole(128, 2, 2, 16, {{300, 300}}, 9);
  const std::vector<float> expected = whole.Run(*backend_);
  const int64_t q_row = int64_t{whole.num_heads()} * 128;
  std::vector<float> chunked(expected.size(), kNaN);
  for (int begin = 0; begin < 300; begin += 64) {
    const int len = std::min(64, 300 - begin);
    const int32_t query_start[2] = {0, len};
    const int32_t context_len[1] = {begin + len};
    const PagedAttentionBatch batch{.num_seqs = 1,
                                    .query_start = query_start,
                                    .context_len = context_len,
                                    .block_table = whole.block_table().data(),
                                    .max_blocks_per_seq = whole.max_blocks()};
    backend_->PagedAttention(whole.q().data() + begin * q_row, whole.cache().data(), whole.layout(),
                             batch, whole.num_heads(), whole.scale(),
                             chunked.data() + begin * q_row, DType::kF32);
  }
  EXPECT_LT(MaxRelativeError(chunked, expected, 0.05), 1e-5);
}

TEST(CpuBackendOptionsTest, RejectsNegativeThreadCount) {
  EXPECT_EQ(CreateCpuBackend({.num_threads = -1}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CpuBackendOptionsTest, AutoPicksTheWidestSupportedInstructionSet) {
  auto backend = CreateCpuBackend({.num_threads = 1});
  ASSERT_TRUE(backend.ok()) << backend.status();
  // Never cpu-avx512-bf16-round, which rounds activations: only an explicit choice may.
  const std::string expected = cpu::CpuSupports(CpuIsa::kAvx512Bf16) ? "cpu-avx512-bf16"
                               : cpu::CpuSupports(CpuIsa::kAvx512)   ? "cpu-avx512"
                               : cpu::CpuSupports(CpuIsa::kAvx2)     ? "cpu-avx2"
                                                                     : "cpu-portable";
  EXPECT_EQ((*backend)->name(), expected);
}

INSTANTIATE_TEST_SUITE_P(Isa, CpuBackendTest,
                         ::testing::Values(CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512,
                                           CpuIsa::kAvx512Bf16, CpuIsa::kAvx512Bf16Round),
                         [](const ::testing::TestParamInfo<CpuIsa>& info) -> std::string {
                           switch (info.param) {
                             case CpuIsa::kPortable:
                               return "Portable";
                             case CpuIsa::kAvx2:
                               return "Avx2";
                             case CpuIsa::kAvx512:
                               return "Avx512";
                             case CpuIsa::kAvx512Bf16:
                               return "Avx512Bf16";
                             case CpuIsa::kAvx512Bf16Round:
                               return "Avx512Bf16Round";
                             default:
                               return "Auto";
                           }
                         });

}  // namespace
}  // namespace tandem::kernels
