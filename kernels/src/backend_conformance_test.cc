// Operator conformance: one table of cases covering every operator of the Backend interface, run
// on each backend the test binary names (see backend_conformance.h) against the scalar reference.
//
// A case is data: an operator, its shapes, a tolerance (largest relative error; 0 means bitwise
// equal) and a seed (derived from the case's name, so it does not change when cases are added).
// Every tensor the operator sees lives in the backend's own memory (Allocate, CopyToDevice), with
// a guard region of 64 floats' worth of a sentinel byte on either side. Outputs start as NaN.
// After the call the harness copies every tensor back with its guards and fails the case when
// - a guard byte changed (a write before or after a tensor),
// - an input the operator must only read changed,
// - an output element is NaN or infinite (not written, or overflowed),
// - an output differs from the reference by more than the tolerance,
// - Synchronize reports an error.
#include "kernels/src/backend_conformance.h"
#include "kernels/src/forwarding_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest-spi.h"
#include "gtest/gtest.h"
#include "kernels/src/cpu/reference.h"
#include "kernels/src/kernel_test_support.h"
#include "tandem/base/half.h"
#include "tandem/kernels/backend.h"
#include "tandem/kernels/sampling.h"

namespace tandem::kernels::conformance {
namespace {

using test_support::kNaN;
using test_support::Random;

// ------------------------------------------------------------------------------------------------
// Harness: tensors in operator memory between guard regions.

constexpr size_t kGuardBytes = 64 * sizeof(float);
constexpr unsigned char kGuardByte = 0xA5;

// One tensor in a backend's operator memory, laid out [guard][contents][guard].
class GuardedTensor {
 public:
  enum class Role { kInput, kInOut, kOutput };

  GuardedTensor(std::string name, Role role, DeviceBuffer buffer, std::vector<unsigned char> host)
      : name_(std::move(name)),
        role_(role),
        buffer_(std::move(buffer)),
        uploaded_(std::move(host)) {}

  const std::string& name() const { return name_; }
  Role role() const { return role_; }
  void* data() const { return buffer_.as<unsigned char>() + kGuardBytes; }
  // What was uploaded, guards included.
  const std::vector<unsigned char>& uploaded() const { return uploaded_; }
  const DeviceBuffer& buffer() const { return buffer_; }
  // Filled by Harness::Finish: the tensor and its guards as the backend left them.
  std::vector<unsigned char>& read_back() { return read_back_; }

  size_t content_bytes() const { return uploaded_.size() - 2 * kGuardBytes; }

 private:
  std::string name_;
  Role role_;
  DeviceBuffer buffer_;
  std::vector<unsigned char> uploaded_;
  std::vector<unsigned char> read_back_;
};

// The tensors of one case on one backend. Failures to allocate or copy are test failures.
class Harness {
 public:
  Harness(Backend& backend, const ConformanceBackend& info) : backend_(backend), info_(info) {}

  Backend& backend() { return backend_; }
  const ConformanceBackend& info() const { return info_; }

  // Operator memory holding `host`; the operator must leave it unchanged.
  template <typename T>
  T* Input(std::string name, const std::vector<T>& host) {
    return static_cast<T*>(
        Add(std::move(name), GuardedTensor::Role::kInput, host.data(), host.size() * sizeof(T)));
  }
  // Operator memory holding `host`, which the operator updates.
  template <typename T>
  T* InOut(std::string name, const std::vector<T>& host) {
    return static_cast<T*>(
        Add(std::move(name), GuardedTensor::Role::kInOut, host.data(), host.size() * sizeof(T)));
  }
  // Operator memory for `size` floats, all NaN.
  float* Output(std::string name, int64_t size) {
    const std::vector<float> poison(size, kNaN);
    return static_cast<float*>(Add(std::move(name), GuardedTensor::Role::kOutput, poison.data(),
                                   poison.size() * sizeof(float)));
  }

  // Operator memory for `count` activations of `dtype` (kF32, kBF16 or kF16), all NaN.
  void* Activation(std::string name, int64_t count, DType dtype) {
    std::vector<unsigned char> poison(count * DTypeSize(dtype));
    for (int64_t i = 0; i < count; ++i) StoreFromFloat(poison.data(), dtype, i, kNaN);
    return Add(std::move(name), GuardedTensor::Role::kOutput, poison.data(), poison.size());
  }
  // The activations at `data` after Finish, widened to fp32.
  std::vector<float> ActivationResult(const void* data, DType dtype) {
    const std::vector<unsigned char> bytes = Result(static_cast<const unsigned char*>(data));
    std::vector<float> out(bytes.size() / DTypeSize(dtype));
    for (size_t i = 0; i < out.size(); ++i) {
      out[i] = LoadAsFloat(bytes.data(), dtype, static_cast<int64_t>(i));
    }
    return out;
  }

  // Copies every tensor back with its guards, waits, and checks the guards and the inputs.
  // Returns false (after recording failures) when the results cannot be trusted.
  bool Finish() {
    for (auto& t : tensors_) {
      t->read_back().assign(t->uploaded().size(), 0);
      backend_.CopyToHost(t->read_back().data(), t->buffer().data(), t->read_back().size());
    }
    const absl::Status status = backend_.Synchronize();
    EXPECT_TRUE(status.ok()) << "Synchronize after the operator: " << status;
    if (!status.ok()) return false;
    bool good = true;
    for (auto& t : tensors_) {
      const std::vector<unsigned char>& got = t->read_back();
      const size_t end = got.size() - kGuardBytes;
      for (size_t i = 0; i < got.size(); i = (i + 1 == kGuardBytes ? end : i + 1)) {
        if (got[i] != kGuardByte) {
          const bool before = i < kGuardBytes;
          const int64_t offset = before
                                     ? static_cast<int64_t>(i) - static_cast<int64_t>(kGuardBytes)
                                     : static_cast<int64_t>(i - end);
          ADD_FAILURE() << "guard of " << t->name() << " overwritten: byte " << (before ? "" : "+")
                        << offset << (before ? " before the tensor" : " past its end");
          good = false;
          break;
        }
      }
      if (t->role() == GuardedTensor::Role::kInput &&
          std::memcmp(got.data(), t->uploaded().data(), got.size()) != 0) {
        ADD_FAILURE() << "input " << t->name() << " changed by the operator";
        good = false;
      }
    }
    return good;
  }

  // The contents of the tensor at `data` after Finish.
  template <typename T>
  std::vector<T> Result(const T* data) {
    for (auto& t : tensors_) {
      if (t->data() == data) {
        std::vector<T> out(t->content_bytes() / sizeof(T));
        std::memcpy(out.data(), t->read_back().data() + kGuardBytes, t->content_bytes());
        return out;
      }
    }
    ADD_FAILURE() << "no tensor at that address";
    return {};
  }

  bool ok() const { return ok_; }

 private:
  void* Add(std::string name, GuardedTensor::Role role, const void* contents, size_t bytes) {
    std::vector<unsigned char> host(bytes + 2 * kGuardBytes, kGuardByte);
    if (bytes > 0) std::memcpy(host.data() + kGuardBytes, contents, bytes);
    absl::StatusOr<DeviceBuffer> buffer = backend_.Allocate(host.size());
    if (!buffer.ok()) {
      ADD_FAILURE() << "Allocate " << host.size() << " bytes for " << name << ": "
                    << buffer.status();
      ok_ = false;
      return nullptr;
    }
    backend_.CopyToDevice(buffer->data(), host.data(), host.size());
    tensors_.push_back(std::make_unique<GuardedTensor>(std::move(name), role,
                                                       std::move(buffer).value(), std::move(host)));
    return tensors_.back()->data();
  }

  Backend& backend_;
  const ConformanceBackend& info_;
  std::vector<std::unique_ptr<GuardedTensor>> tensors_;
  bool ok_ = true;
};

// ------------------------------------------------------------------------------------------------
// Comparison

// Expects `actual` finite everywhere and within `tolerance` of `expected`, the error of element i
// being |actual - expected| / denominator[i]; tolerance 0 asks for bitwise equality.
void ExpectMatches(std::string_view what, const std::vector<float>& actual,
                   const std::vector<float>& expected, const std::vector<double>& denominator,
                   double tolerance) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double worst = 0.0;
  size_t worst_at = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i])) {
      ADD_FAILURE() << what << "[" << i << "] is " << actual[i] << " (not written?), expected "
                    << expected[i];
      return;
    }
    if (tolerance == 0.0) {
      if (std::memcmp(&actual[i], &expected[i], sizeof(float)) != 0) {
        ADD_FAILURE() << what << "[" << i << "] is " << actual[i] << ", expected exactly "
                      << expected[i];
        return;
      }
      continue;
    }
    const double error = std::abs(double{actual[i]} - expected[i]) / denominator[i];
    if (error > worst) {
      worst = error;
      worst_at = i;
    }
  }
  EXPECT_LE(worst, tolerance) << what << ": worst relative error at element " << worst_at << " ("
                              << actual[worst_at] << " vs " << expected[worst_at] << ")";
}

// The usual measure: relative to |expected| + floor, the floor keeping values near zero from
// dominating.
void ExpectClose(std::string_view what, const std::vector<float>& actual,
                 const std::vector<float>& expected, double tolerance, double floor) {
  std::vector<double> denominator(expected.size());
  for (size_t i = 0; i < expected.size(); ++i)
    denominator[i] = std::abs(double{expected[i]}) + floor;
  ExpectMatches(what, actual, expected, denominator, tolerance);
}

// FNV-1a of the case name: a seed that stays the same when other cases are added.
uint32_t SeedOf(std::string_view name) {
  uint32_t h = 2166136261u;
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 16777619u;
  return h;
}

// ------------------------------------------------------------------------------------------------
// Cases

class OpCase {
 public:
  OpCase(std::string name, double tolerance)
      : name_(std::move(name)), tolerance_(tolerance), seed_(SeedOf(name_)) {}
  virtual ~OpCase() = default;

  // Unique in the table; letters, digits and '_'.
  const std::string& name() const { return name_; }
  double tolerance() const { return tolerance_; }
  uint32_t seed() const { return seed_; }

  // Empty when `info`'s backend implements this case, else why not.
  virtual std::string Unsupported(const ConformanceBackend&) const { return ""; }

  // Uploads random inputs, runs the operator on h.backend() and the reference, compares.
  virtual void Check(Harness& h) const = 0;

 private:
  std::string name_;
  double tolerance_;
  uint32_t seed_;
};

std::string Str(int v) { return std::to_string(v); }

// Case-name suffix of a dtype: "" for fp32 (the names of the fp32 cases stay as they were).
std::string DTypeSuffix(DType dtype) {
  return dtype == DType::kF32 ? "" : std::string("_") + DTypeFlagName(dtype);
}

// Case-name suffix of an activation stored as `dtype`: "" for fp32.
std::string OutSuffix(DType dtype) {
  return dtype == DType::kF32 ? "" : std::string("_out_") + DTypeFlagName(dtype);
}

// The relative error of an fp32 result stored as `dtype` (rounded to nearest even): half a unit
// in the last place, 2^-9 for bf16 and 2^-12 for fp16, doubled for the fp32 result's own error
// moving a value across a rounding boundary; `tolerance` (the fp32 case's) for kF32.
double StoredTolerance(DType dtype, double tolerance) {
  if (dtype == DType::kBF16) return std::max(tolerance, 1.0 / 256);
  if (dtype == DType::kF16) return std::max(tolerance, 1.0 / 2048);
  return tolerance;
}

// `values` encoded as `dtype` (rounded to nearest even; 8-bit floats of value / scale).
std::vector<unsigned char> Encode(const std::vector<float>& values, DType dtype,
                                  float scale = 1.0f) {
  std::vector<unsigned char> bytes(values.size() * DTypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    StoreFromFloat(bytes.data(), dtype, static_cast<int64_t>(i), values[i] / scale);
  }
  return bytes;
}

// x as a backend whose Linear splits it reads it (Backend::LinearSplitsX): hi = bf16(x) plus
// lo = bf16(x - hi), both rounded to nearest even (the sum is exact in fp32).
std::vector<float> SplitIntoBf16Halves(const std::vector<float>& x) {
  std::vector<float> read(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float hi = Bf16ToFloat(FloatToBf16(x[i]));
    read[i] = hi + Bf16ToFloat(FloatToBf16(x[i] - hi));
  }
  return read;
}

// x as a backend that carries it in three bytes reads it (Backend::LinearCarriesXInBytes): per
// row of k, s = max |x| / 127, and each element's levels from t = x (1 / s) in fp32.
std::vector<float> ReadAsByteLevels(const std::vector<float>& x, int k) {
  std::vector<float> read(x.size());
  for (size_t row = 0; row < x.size(); row += k) {
    float largest = 0.0f;
    for (int c = 0; c < k; ++c) largest = std::max(largest, std::abs(x[row + c]));
    const float s = largest / 127.0f;
    const float ratio = 1.0f / s;
    for (int c = 0; c < k; ++c) {
      if (s == 0.0f) {
        read[row + c] = 0.0f;
        continue;
      }
      const float t = x[row + c] * ratio;
      const float h = std::nearbyint(t);
      const float r = (t - h) * 254.0f;
      const float m = std::nearbyint(r);
      const float l = std::nearbyint((r - m) * 254.0f);
      read[row + c] = static_cast<float>(double{s} * (h + m / 254.0 + l / (254.0 * 254.0)));
    }
  }
  return read;
}

// One x in 61 made 1000 times larger, as the massive activations of some channels of real
// models are: the error of a kernel that carries x less exactly than fp32 then lands on a few
// products that dominate sum |x| |w|, where random x would average it out.
void AddOutliers(std::vector<float>& x) {
  for (size_t i = 3; i < x.size(); i += 61) x[i] *= 1000.0f;
}

// W of `w_dtype` (fp32, bf16, fp16): the reference reads the same encoded W, so the tolerance is
// that of fp32 accumulation whatever the weight type.
class LinearCase : public OpCase {
 public:
  // x16: x given in W's 16-bit dtype (a producer's rounded activation), read exactly.
  LinearCase(int m, int n, int k, bool bias, double tolerance, DType w_dtype = DType::kF32,
             bool outliers = false, bool x16 = false)
      : OpCase("Linear_m" + Str(m) + "_n" + Str(n) + "_k" + Str(k) + (bias ? "_bias" : "") +
                   DTypeSuffix(w_dtype) + (outliers ? "_outliers" : "") + (x16 ? "_x16" : ""),
               tolerance),
        m_(m),
        n_(n),
        k_(k),
        bias_(bias),
        w_dtype_(w_dtype),
        outliers_(outliers),
        x16_(x16) {}

  void Check(Harness& h) const override {
    std::vector<float> x = Random(int64_t{m_} * k_, seed());
    if (outliers_) AddOutliers(x);
    std::vector<float> w = Random(int64_t{n_} * k_, seed() + 1);
    // The weights as stored, and their exact values (for the error scale below).
    const std::vector<unsigned char> w_bytes = Encode(w, w_dtype_);
    for (size_t i = 0; i < w.size(); ++i) w[i] = LoadAsFloat(w_bytes.data(), w_dtype_, i);
    const std::vector<float> bias = Random(n_, seed() + 2);
    const std::vector<unsigned char> x_bytes = Encode(x, x16_ ? w_dtype_ : DType::kF32);
    const void* d_x = h.Input("x", x_bytes);
    const float* d_bias = bias_ ? h.Input("bias", bias) : nullptr;
    float* d_y = h.Output("y", int64_t{m_} * n_);
    ASSERT_TRUE(h.ok());
    std::unique_ptr<PackedWeight> packed = h.backend().PackWeight(w_bytes.data(), w_dtype_, n_, k_);
    ASSERT_EQ(packed->n(), n_);
    ASSERT_EQ(packed->k(), k_);
    ASSERT_EQ(packed->dtype(), w_dtype_);
    h.backend().Linear(d_x, x16_ ? w_dtype_ : DType::kF32, m_, *packed, d_bias, d_y);
    if (!h.Finish()) return;

    // A backend that rounds x to W's type first (the CUDA backend's prefill path) is held to
    // the same tolerance on the rounded x, one that splits it on the two halves' sum. A 16-bit
    // x is read as it is.
    std::vector<float> x_read = x;
    if (x16_ || h.backend().LinearRoundsX(m_, w_dtype_)) {
      const std::vector<unsigned char> x_bytes = Encode(x, w_dtype_);
      for (size_t i = 0; i < x.size(); ++i) x_read[i] = LoadAsFloat(x_bytes.data(), w_dtype_, i);
    } else if (h.backend().LinearSplitsX(w_dtype_, WeightQuant::kNone)) {
      x_read = SplitIntoBf16Halves(x);
    }
    std::vector<float> expected(int64_t{m_} * n_);
    reference::Linear(x_read.data(), m_, w_bytes.data(), w_dtype_, n_, k_,
                      bias_ ? bias.data() : nullptr, expected.data());
    // Error relative to sum |x| |w| (+ |bias|), the scale of a dot product's rounding error
    // whatever cancellation leaves of the result; an element from the wrong row or column is off
    // by about 1 / sqrt(k) of it.
    std::vector<float> abs_x(x.size()), abs_w(w.size()), abs_bias(bias.size());
    for (size_t i = 0; i < x.size(); ++i) abs_x[i] = std::abs(x[i]);
    for (size_t i = 0; i < w.size(); ++i) abs_w[i] = std::abs(w[i]);
    for (size_t i = 0; i < bias.size(); ++i) abs_bias[i] = std::abs(bias[i]);
    std::vector<float> scale(expected.size());
    reference::Linear(abs_x.data(), m_, abs_w.data(), DType::kF32, n_, k_,
                      bias_ ? abs_bias.data() : nullptr, scale.data());
    std::vector<double> denominator(scale.begin(), scale.end());
    for (double& d : denominator) d += 1e-30;
    ExpectMatches("y", h.Result(d_y), expected, denominator, tolerance());
  }

 private:
  int m_, n_, k_;
  bool bias_;
  DType w_dtype_;
  bool outliers_;
  bool x16_;
};

// Weight-only quantised W (int8 per row; int4 per group with zero points, optionally in a
// shuffled k order as GPTQ act-order checkpoints store it, and optionally in groups of unequal
// size, as a tensor-parallel rank holds its part of each group): the reference multiplies by
// DequantizeWeight's values, which the backend must use exactly, so the tolerance is that of
// fp32 accumulation.
class QuantizedLinearCase : public OpCase {
 public:
  // uneven: int4 groups of 1 to 2 x group_size columns, drawn at random; with unit_aligned,
  // of multiples of 8 columns (but the last, which ends at k), as the AVX-512 BF16 kernels
  // pack in units of 8 k steps. outliers: AddOutliers.
  QuantizedLinearCase(WeightQuant quant, int m, int n, int k, int group_size, bool shuffled,
                      bool bias, double tolerance, bool uneven = false,
                      bool unit_aligned = false, bool outliers = false)
      : OpCase(std::string("Linear_") + (quant == WeightQuant::kInt8 ? "int8" : "int4") + "_m" +
                   Str(m) + "_n" + Str(n) + "_k" + Str(k) +
                   (quant == WeightQuant::kInt4 ? "_g" + Str(group_size) : "") +
                   (uneven ? (unit_aligned ? "_uneven8" : "_uneven") : "") +
                   (shuffled ? "_korder" : "") + (bias ? "_bias" : "") +
                   (outliers ? "_outliers" : ""),
               tolerance),
        quant_(quant),
        m_(m),
        n_(n),
        k_(k),
        group_size_(group_size),
        shuffled_(shuffled),
        bias_(bias),
        uneven_(uneven),
        unit_aligned_(unit_aligned),
        outliers_(outliers) {}

  void Check(Harness& h) const override {
    std::vector<float> x = Random(int64_t{m_} * k_, seed());
    if (outliers_) AddOutliers(x);
    const bool int4 = quant_ == WeightQuant::kInt4;
    const int group = int4 ? group_size_ : k_;
    std::mt19937 rng(seed() + 1);
    std::vector<int32_t> starts = {0};
    while (uneven_ && starts.back() < k_) {
      const int32_t size = unit_aligned_ ? 8 * static_cast<int32_t>(1 + rng() % (group / 4))
                                         : static_cast<int32_t>(1 + rng() % (2 * group));
      starts.push_back(std::min<int32_t>(k_, starts.back() + size));
    }
    const int groups = uneven_ ? static_cast<int>(starts.size()) - 1 : k_ / group;
    std::vector<int8_t> values(int64_t{n_} * k_);
    for (int8_t& v : values) {
      v = static_cast<int8_t>(int4 ? rng() % 16 : static_cast<int>(rng() % 256) - 128);
    }
    std::vector<float> scales = Random(int64_t{n_} * groups, seed() + 2, 0.001f, 0.02f);
    std::vector<int8_t> zeros;
    if (int4) {
      for (int64_t i = 0; i < int64_t{n_} * groups; ++i) zeros.push_back(rng() % 17);
    }
    std::vector<int32_t> order(k_);
    std::iota(order.begin(), order.end(), 0);
    if (shuffled_) std::shuffle(order.begin(), order.end(), rng);
    const QuantizedWeightView view{.quant = quant_,
                                   .n = n_,
                                   .k = k_,
                                   .group_size = group,
                                   .values = values.data(),
                                   .scales = scales.data(),
                                   .zeros = int4 ? zeros.data() : nullptr,
                                   .k_order = shuffled_ ? order.data() : nullptr,
                                   .group_starts = uneven_ ? starts.data() : nullptr,
                                   .num_groups = uneven_ ? groups : 0};
    ASSERT_TRUE(ValidateQuantizedWeight(view).ok()) << ValidateQuantizedWeight(view);
    const std::vector<float> bias = Random(n_, seed() + 3);
    const float* d_x = h.Input("x", x);
    const float* d_bias = bias_ ? h.Input("bias", bias) : nullptr;
    float* d_y = h.Output("y", int64_t{m_} * n_);
    ASSERT_TRUE(h.ok());
    std::unique_ptr<PackedWeight> packed = h.backend().PackQuantizedWeight(view);
    ASSERT_EQ(packed->n(), n_);
    ASSERT_EQ(packed->k(), k_);
    ASSERT_EQ(packed->quant(), quant_);
    h.backend().Linear(d_x, DType::kF32, m_, *packed, d_bias, d_y);
    if (!h.Finish()) return;

    const std::vector<float> w = DequantizeWeight(view);
    std::vector<float> expected(int64_t{m_} * n_);
    const std::vector<float> x_read =
        h.backend().LinearCarriesXInBytes(quant_)        ? ReadAsByteLevels(x, k_)
        : h.backend().LinearSplitsX(DType::kF32, quant_) ? SplitIntoBf16Halves(x)
                                                         : x;
    reference::Linear(x_read.data(), m_, w.data(), DType::kF32, n_, k_,
                      bias_ ? bias.data() : nullptr, expected.data());
    std::vector<float> abs_x(x.size()), abs_w(w.size()), abs_bias(bias.size());
    for (size_t i = 0; i < x.size(); ++i) abs_x[i] = std::abs(x[i]);
    for (size_t i = 0; i < w.size(); ++i) abs_w[i] = std::abs(w[i]);
    for (size_t i = 0; i < bias.size(); ++i) abs_bias[i] = std::abs(bias[i]);
    std::vector<float> scale(expected.size());
    reference::Linear(abs_x.data(), m_, abs_w.data(), DType::kF32, n_, k_,
                      bias_ ? abs_bias.data() : nullptr, scale.data());
    std::vector<double> denominator(scale.begin(), scale.end());
    for (double& d : denominator) d += 1e-30;
    ExpectMatches("y", h.Result(d_y), expected, denominator, tolerance());
  }

 private:
  WeightQuant quant_;
  int m_, n_, k_, group_size_;
  bool shuffled_, bias_, uneven_, unit_aligned_, outliers_;
};

class RmsNormCase : public OpCase {
 public:
  // out_dtype other than kF32: y stored as 16-bit activations (never in place).
  RmsNormCase(int rows, int dim, bool in_place, double tolerance, DType out_dtype = DType::kF32)
      : OpCase("RmsNorm_rows" + Str(rows) + "_dim" + Str(dim) + (in_place ? "_in_place" : "") +
                   OutSuffix(out_dtype),
               tolerance),
        rows_(rows),
        dim_(dim),
        in_place_(in_place),
        out_dtype_(out_dtype) {}

  void Check(Harness& h) const override {
    const std::vector<float> x = Random(int64_t{rows_} * dim_, seed(), -3.0f, 3.0f);
    const std::vector<float> weight = Random(dim_, seed() + 1, 0.5f, 1.5f);
    const float* d_weight = h.Input("weight", weight);
    float* d_x = in_place_ ? h.InOut("x", x) : h.Input("x", x);
    void* d_y = in_place_ ? d_x : h.Activation("y", x.size(), out_dtype_);
    ASSERT_TRUE(h.ok());
    h.backend().RmsNorm(d_x, d_weight, 1e-5f, rows_, dim_, d_y, out_dtype_);
    if (!h.Finish()) return;
    std::vector<float> expected(x.size());
    reference::RmsNorm(x.data(), weight.data(), 1e-5f, rows_, dim_, expected.data());
    ExpectClose("y", h.ActivationResult(d_y, out_dtype_), expected,
                StoredTolerance(out_dtype_, tolerance()), 1e-3);
  }

 private:
  int rows_, dim_;
  bool in_place_;
  DType out_dtype_;
};

class AddRmsNormCase : public OpCase {
 public:
  AddRmsNormCase(int rows, int dim, double tolerance, DType out_dtype = DType::kF32)
      : OpCase("AddRmsNorm_rows" + Str(rows) + "_dim" + Str(dim) + OutSuffix(out_dtype),
               tolerance),
        rows_(rows),
        dim_(dim),
        out_dtype_(out_dtype) {}

  void Check(Harness& h) const override {
    const std::vector<float> residual = Random(int64_t{rows_} * dim_, seed(), -2.0f, 2.0f);
    const std::vector<float> x = Random(residual.size(), seed() + 1);
    const std::vector<float> weight = Random(dim_, seed() + 2, 0.5f, 1.5f);
    float* d_residual = h.InOut("residual", residual);
    const float* d_x = h.Input("x", x);
    const float* d_weight = h.Input("weight", weight);
    void* d_y = h.Activation("y", residual.size(), out_dtype_);
    ASSERT_TRUE(h.ok());
    h.backend().AddRmsNorm(d_residual, d_x, d_weight, 1e-6f, rows_, dim_, d_y, out_dtype_);
    if (!h.Finish()) return;
    std::vector<float> expected_residual = residual;
    std::vector<float> expected(residual.size());
    reference::AddRmsNorm(expected_residual.data(), x.data(), weight.data(), 1e-6f, rows_, dim_,
                          expected.data());
    // A single fp32 add on every backend.
    ExpectMatches("residual", h.Result<float>(d_residual), expected_residual, {}, 0.0);
    ExpectClose("y", h.ActivationResult(d_y, out_dtype_), expected,
                StoredTolerance(out_dtype_, tolerance()), 1e-3);
  }

 private:
  int rows_, dim_;
  DType out_dtype_;
};

class RopeCase : public OpCase {
 public:
  RopeCase(int tokens, int heads, int head_dim, bool llama3, double tolerance)
      : OpCase("Rope_tokens" + Str(tokens) + "_heads" + Str(heads) + "_hd" + Str(head_dim) +
                   (llama3 ? "_llama3" : ""),
               tolerance),
        tokens_(tokens),
        heads_(heads),
        head_dim_(head_dim),
        llama3_(llama3) {}

  void Check(Harness& h) const override {
    const RopeConfig config = llama3_ ? RopeConfig{.head_dim = head_dim_,
                                                   .theta = 500000.0f,
                                                   .llama3_scaling = true,
                                                   .factor = 8.0f,
                                                   .low_freq_factor = 1.0f,
                                                   .high_freq_factor = 4.0f,
                                                   .original_max_position = 8192}
                                      : RopeConfig{.head_dim = head_dim_, .theta = 10000.0f};
    const std::vector<float> inv_freq = RopeInverseFrequencies(config);
    std::vector<int32_t> positions(tokens_);
    for (int t = 0; t < tokens_; ++t) positions[t] = (t * 977) % 40000;  // far positions too
    const std::vector<float> x = Random(int64_t{tokens_} * heads_ * head_dim_, seed());
    float* d_x = h.InOut("x", x);
    const int32_t* d_positions = h.Input("positions", positions);
    const float* d_inv_freq = h.Input("inv_freq", inv_freq);
    ASSERT_TRUE(h.ok());
    h.backend().Rope(d_x, d_positions, tokens_, heads_, head_dim_, d_inv_freq);
    if (!h.Finish()) return;
    std::vector<float> expected = x;
    reference::Rope(expected.data(), positions.data(), tokens_, heads_, head_dim_, inv_freq.data());
    ExpectClose("x", h.Result<float>(d_x), expected, tolerance(), 0.1);
  }

 private:
  int tokens_, heads_, head_dim_;
  bool llama3_;
};

class SiluMulCase : public OpCase {
 public:
  SiluMulCase(int rows, int inter, double tolerance, DType out_dtype = DType::kF32)
      : OpCase("SiluMul_rows" + Str(rows) + "_inter" + Str(inter) + OutSuffix(out_dtype),
               tolerance),
        rows_(rows),
        inter_(inter),
        out_dtype_(out_dtype) {}

  void Check(Harness& h) const override {
    // Gates far into both tails, where exp overflows or underflows.
    const std::vector<float> gate_up = Random(int64_t{rows_} * 2 * inter_, seed(), -100.0f, 100.0f);
    const float* d_gate_up = h.Input("gate_up", gate_up);
    void* d_out = h.Activation("out", int64_t{rows_} * inter_, out_dtype_);
    ASSERT_TRUE(h.ok());
    h.backend().SiluMul(d_gate_up, rows_, inter_, d_out, out_dtype_);
    if (!h.Finish()) return;
    std::vector<float> expected(int64_t{rows_} * inter_);
    reference::SiluMul(gate_up.data(), rows_, inter_, expected.data());
    ExpectClose("out", h.ActivationResult(d_out, out_dtype_), expected,
                StoredTolerance(out_dtype_, tolerance()), 1e-3);
  }

 private:
  int rows_, inter_;
  DType out_dtype_;
};

// A table of fp32, bf16 or fp16: rows widened exactly.
class EmbeddingCase : public OpCase {
 public:
  EmbeddingCase(int vocab, int dim, int tokens, DType dtype = DType::kF32)
      : OpCase("Embedding_vocab" + Str(vocab) + "_dim" + Str(dim) + "_tokens" + Str(tokens) +
                   DTypeSuffix(dtype),
               0.0),
        vocab_(vocab),
        dim_(dim),
        tokens_(tokens),
        dtype_(dtype) {}

  void Check(Harness& h) const override {
    const std::vector<unsigned char> table = Encode(Random(int64_t{vocab_} * dim_, seed()), dtype_);
    // The last row of the table first, then ids spread over it with repeats.
    std::vector<int32_t> ids(tokens_);
    for (int t = 0; t < tokens_; ++t) ids[t] = t == 0 ? vocab_ - 1 : (t * 31 + 5) % vocab_;
    const unsigned char* d_table = h.Input("table", table);
    const int32_t* d_ids = h.Input("ids", ids);
    float* d_out = h.Output("out", int64_t{tokens_} * dim_);
    ASSERT_TRUE(h.ok());
    h.backend().Embedding(d_table, dtype_, d_ids, tokens_, dim_, d_out);
    if (!h.Finish()) return;
    std::vector<float> expected(int64_t{tokens_} * dim_);
    reference::Embedding(table.data(), dtype_, ids.data(), tokens_, dim_, expected.data());
    ExpectMatches("out", h.Result(d_out), expected, {}, 0.0);
  }

 private:
  int vocab_, dim_, tokens_;
  DType dtype_;
};

// Tokens [start, start + tokens) of one sequence whose blocks are scattered over the cache, as
// a prefill chunk or a decode step writes them; with `padding`, every fifth token is padding
// (slot -1).
// The cache of any KV dtype: stored bytes compared exactly (8-bit caches with a scale that is
// not 1, values past the format's range saturating).
class WriteKvCase : public OpCase {
 public:
  WriteKvCase(int block_size, int kv_heads, int head_dim, int start, int tokens, bool padding,
              DType dtype = DType::kF32)
      : OpCase("WriteKv_bs" + Str(block_size) + "_kv" + Str(kv_heads) + "_hd" + Str(head_dim) +
                   "_pos" + Str(start) + "_tokens" + Str(tokens) + (padding ? "_padding" : "") +
                   DTypeSuffix(dtype),
               0.0),
        layout_{.num_blocks = (start + tokens + block_size - 1) / block_size + 2,
                .block_size = block_size,
                .num_kv_heads = kv_heads,
                .head_dim = head_dim,
                .dtype = dtype,
                .k_scale = DTypeSize(dtype) == 1 ? 0.125f : 1.0f,
                .v_scale = DTypeSize(dtype) == 1 ? 3.0f : 1.0f},
        start_(start),
        tokens_(tokens),
        padding_(padding) {}

  void Check(Harness& h) const override {
    std::vector<int32_t> physical(layout_.num_blocks);
    std::iota(physical.begin(), physical.end(), 0);
    std::shuffle(physical.begin(), physical.end(), std::mt19937(seed()));
    std::vector<int32_t> slots(tokens_);
    for (int t = 0; t < tokens_; ++t) {
      const int pos = start_ + t;
      slots[t] = padding_ && t % 5 == 4 ? -1
                                        : physical[pos / layout_.block_size] * layout_.block_size +
                                              pos % layout_.block_size;
    }
    const int64_t row = int64_t{layout_.num_kv_heads} * layout_.head_dim;
    // K past E4M3's range once scaled by 0.125 (448 * 0.125 = 56), so saturation is checked.
    const std::vector<float> k = Random(tokens_ * row, seed() + 1, -80.0f, 80.0f);
    const std::vector<float> v = Random(tokens_ * row, seed() + 2);
    // Random old contents: a store to the wrong slot shows wherever it lands.
    const std::vector<unsigned char> cache =
        Encode(Random(layout_.LayerElements(), seed() + 3), layout_.dtype);
    const float* d_k = h.Input("k", k);
    const float* d_v = h.Input("v", v);
    const int32_t* d_slots = h.Input("slot_mapping", slots);
    unsigned char* d_cache = h.InOut("layer_cache", cache);
    ASSERT_TRUE(h.ok());
    h.backend().WriteKv(d_k, d_v, d_slots, tokens_, layout_, d_cache);
    if (!h.Finish()) return;
    std::vector<unsigned char> expected = cache;
    reference::WriteKv(k.data(), v.data(), slots.data(), tokens_, layout_, expected.data());
    const std::vector<unsigned char> got = h.Result<unsigned char>(d_cache);
    ASSERT_EQ(got.size(), expected.size());
    const int element = DTypeSize(layout_.dtype);
    for (size_t i = 0; i < got.size(); i += element) {
      if (std::memcmp(&got[i], &expected[i], element) != 0) {
        ADD_FAILURE() << "layer_cache element " << i / element << " is "
                      << LoadAsFloat(got.data(), layout_.dtype, i / element) << ", expected "
                      << LoadAsFloat(expected.data(), layout_.dtype, i / element);
        return;
      }
    }
  }

 private:
  KvLayout layout_;
  int start_, tokens_;
  bool padding_;
};

// One layer's attention inputs from a fused [tokens, q | k | v] projection, with and without
// Qwen3's per-head norms, against the reference ops in the unfused order: the split, RmsNorm,
// Rope, WriteKv. q within the Rope tolerance; the cache to within one step of its type (a
// fused kernel may round the fp32 value an ulp apart, which can move a 16- or 8-bit element).
class AttentionInputsCase : public OpCase {
 public:
  AttentionInputsCase(int tokens, int heads, int kv_heads, int head_dim, bool norm, DType dtype,
                      double tolerance)
      : OpCase("AttentionInputs_tokens" + Str(tokens) + "_heads" + Str(heads) + "_kv" +
                   Str(kv_heads) + "_hd" + Str(head_dim) + (norm ? "_norm" : "") +
                   DTypeSuffix(dtype),
               tolerance),
        tokens_(tokens),
        heads_(heads),
        norm_(norm),
        layout_{.num_blocks = (tokens + 15) / 16 + 2,
                .block_size = 16,
                .num_kv_heads = kv_heads,
                .head_dim = head_dim,
                .dtype = dtype,
                .k_scale = DTypeSize(dtype) == 1 ? 0.5f : 1.0f,
                .v_scale = DTypeSize(dtype) == 1 ? 2.0f : 1.0f} {}

  void Check(Harness& h) const override {
    const int hd = layout_.head_dim;
    const int q_dim = heads_ * hd;
    const int kv_dim = layout_.num_kv_heads * hd;
    const int row = q_dim + 2 * kv_dim;
    const std::vector<float> qkv = Random(int64_t{tokens_} * row, seed(), -3.0f, 3.0f);
    const std::vector<float> q_norm = Random(hd, seed() + 1, 0.5f, 1.5f);
    const std::vector<float> k_norm = Random(hd, seed() + 2, 0.5f, 1.5f);
    const std::vector<float> inv_freq =
        RopeInverseFrequencies(RopeConfig{.head_dim = hd, .theta = 500000.0f});
    std::vector<int32_t> positions(tokens_), slots(tokens_);
    std::vector<int32_t> physical(layout_.num_blocks);
    std::iota(physical.begin(), physical.end(), 0);
    std::shuffle(physical.begin(), physical.end(), std::mt19937(seed() + 3));
    for (int t = 0; t < tokens_; ++t) {
      positions[t] = 7 + t * 131;
      // Every seventh token is padding: it writes q but nothing into the cache.
      slots[t] = t % 7 == 6 ? -1 : physical[t / 16] * 16 + t % 16;
    }
    const std::vector<unsigned char> cache =
        Encode(Random(layout_.LayerElements(), seed() + 4), layout_.dtype);
    const float* d_qkv = h.Input("qkv", qkv);
    const float* d_q_norm = h.Input("q_norm", q_norm);
    const float* d_k_norm = h.Input("k_norm", k_norm);
    const float* d_inv_freq = h.Input("inv_freq", inv_freq);
    const int32_t* d_positions = h.Input("positions", positions);
    const int32_t* d_slots = h.Input("slot_mapping", slots);
    unsigned char* d_cache = h.InOut("layer_cache", cache);
    float* d_q = h.Output("q", int64_t{tokens_} * q_dim);
    // Scratch the backend may use: its contents are not checked.
    float* d_k = h.InOut("k_scratch", std::vector<float>(int64_t{tokens_} * kv_dim));
    float* d_v = h.InOut("v_scratch", std::vector<float>(int64_t{tokens_} * kv_dim));
    ASSERT_TRUE(h.ok());
    h.backend().AttentionInputs(d_qkv, tokens_, heads_, norm_ ? d_q_norm : nullptr,
                                norm_ ? d_k_norm : nullptr, 1e-6f, d_positions, d_inv_freq,
                                d_slots, layout_, d_cache, d_q, d_k, d_v);
    if (!h.Finish()) return;

    std::vector<float> q(int64_t{tokens_} * q_dim), k(int64_t{tokens_} * kv_dim),
        v(int64_t{tokens_} * kv_dim);
    for (int t = 0; t < tokens_; ++t) {
      const float* src = qkv.data() + int64_t{t} * row;
      std::copy(src, src + q_dim, q.begin() + int64_t{t} * q_dim);
      std::copy(src + q_dim, src + q_dim + kv_dim, k.begin() + int64_t{t} * kv_dim);
      std::copy(src + q_dim + kv_dim, src + row, v.begin() + int64_t{t} * kv_dim);
    }
    if (norm_) {
      reference::RmsNorm(q.data(), q_norm.data(), 1e-6f, tokens_ * heads_, hd, q.data());
      reference::RmsNorm(k.data(), k_norm.data(), 1e-6f, tokens_ * layout_.num_kv_heads, hd,
                         k.data());
    }
    reference::Rope(q.data(), positions.data(), tokens_, heads_, hd, inv_freq.data());
    reference::Rope(k.data(), positions.data(), tokens_, layout_.num_kv_heads, hd,
                    inv_freq.data());
    std::vector<unsigned char> expected = cache;
    reference::WriteKv(k.data(), v.data(), slots.data(), tokens_, layout_, expected.data());
    ExpectClose("q", h.Result(d_q), q, tolerance(), 0.1);
    const std::vector<unsigned char> got_bytes = h.Result<unsigned char>(d_cache);
    ASSERT_EQ(got_bytes.size(), expected.size());
    // One step of the cache's type, relative (an 8-bit float's step is 2^-3 or 2^-2).
    const double step = layout_.dtype == DType::kF32    ? tolerance()
                        : layout_.dtype == DType::kBF16 ? 1.0 / 128
                        : layout_.dtype == DType::kF16  ? 1.0 / 1024
                                                        : 0.25;
    std::vector<float> got(layout_.LayerElements()), want(layout_.LayerElements());
    for (int64_t i = 0; i < layout_.LayerElements(); ++i) {
      got[i] = LoadAsFloat(got_bytes.data(), layout_.dtype, i);
      want[i] = LoadAsFloat(expected.data(), layout_.dtype, i);
    }
    ExpectClose("layer_cache", got, want, step, 0.1);
  }

 private:
  int tokens_, heads_;
  bool norm_;
  KvLayout layout_;
};

struct AttentionSeq {
  int q_len;
  int context_len;
};

// One PagedAttention call over a batch of sequences whose blocks are scattered over the cache;
// every slot no sequence owns is NaN, so reading one poisons the output.
class PagedAttentionCase : public OpCase {
 public:
  // A cache of `dtype`: the reference reads the same stored values, so the tolerance stays that
  // of fp32 arithmetic.
  // `on_device`: the batch as a captured step graph passes it (PagedAttentionBatch::on_device):
  // its arrays in operator memory, a block table wider than the sequences need, and bounds on
  // the query and context lengths looser than the batch's.
  PagedAttentionCase(int head_dim, int kv_heads, int group, int block_size,
                     std::vector<AttentionSeq> seqs, double tolerance, DType dtype = DType::kF32,
                     bool on_device = false, DType out_dtype = DType::kF32)
      : OpCase(Name(head_dim, kv_heads, group, block_size, seqs) + DTypeSuffix(dtype) +
                   (on_device ? "_on_device" : "") + OutSuffix(out_dtype),
               tolerance),
        head_dim_(head_dim),
        kv_heads_(kv_heads),
        group_(group),
        block_size_(block_size),
        seqs_(std::move(seqs)),
        dtype_(dtype),
        on_device_(on_device),
        out_dtype_(out_dtype) {}

  std::string Unsupported(const ConformanceBackend& info) const override {
    const std::vector<int>& dims = info.attention_head_dims;
    if (dims.empty() || std::find(dims.begin(), dims.end(), head_dim_) != dims.end()) return "";
    return info.name + " has no PagedAttention for head_dim " + Str(head_dim_);
  }

  void Check(Harness& h) const override {
    const int num_heads = kv_heads_ * group_;
    int total_blocks = 0, max_blocks = 1;
    for (const AttentionSeq& s : seqs_) {
      const int blocks = (s.context_len + block_size_ - 1) / block_size_;
      total_blocks += blocks;
      max_blocks = std::max(max_blocks, blocks);
    }
    int max_q_len = 1;
    for (const AttentionSeq& s : seqs_) max_q_len = std::max(max_q_len, s.q_len);
    if (on_device_) max_blocks += 5;
    const bool fp8 = DTypeSize(dtype_) == 1;
    const KvLayout layout{.num_blocks = total_blocks + 3,
                          .block_size = block_size_,
                          .num_kv_heads = kv_heads_,
                          .head_dim = head_dim_,
                          .dtype = dtype_,
                          .k_scale = fp8 ? 1.0f / 256 : 1.0f,
                          .v_scale = fp8 ? 4.0f : 1.0f};
    std::vector<int32_t> physical(layout.num_blocks);
    std::iota(physical.begin(), physical.end(), 0);
    std::shuffle(physical.begin(), physical.end(), std::mt19937(seed()));
    std::vector<float> cache(layout.LayerElements(), kNaN);
    std::vector<int32_t> block_table(seqs_.size() * max_blocks, -1);
    std::vector<int32_t> query_start = {0}, context_len;
    const int64_t slot_floats = int64_t{kv_heads_} * head_dim_;
    std::mt19937 gen(seed() + 1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    int next = 0;
    for (size_t s = 0; s < seqs_.size(); ++s) {
      for (int b = 0; b * block_size_ < seqs_[s].context_len; ++b) {
        block_table[s * max_blocks + b] = physical[next++];
      }
      for (int pos = 0; pos < seqs_[s].context_len; ++pos) {
        const int64_t slot =
            int64_t{block_table[s * max_blocks + pos / block_size_]} * block_size_ +
            pos % block_size_;
        for (int64_t i = 0; i < slot_floats; ++i) {
          cache[slot * slot_floats + i] = dist(gen);
          cache[layout.HalfElements() + slot * slot_floats + i] = dist(gen);
        }
      }
      query_start.push_back(query_start.back() + seqs_[s].q_len);
      context_len.push_back(seqs_[s].context_len);
    }
    const std::vector<float> q =
        Random(int64_t{query_start.back()} * num_heads * head_dim_, seed() + 2, -2.0f, 2.0f);
    // The batch description is host memory on every backend (the reference reads this one).
    const PagedAttentionBatch batch{.num_seqs = static_cast<int>(seqs_.size()),
                                    .query_start = query_start.data(),
                                    .context_len = context_len.data(),
                                    .block_table = block_table.data(),
                                    .max_blocks_per_seq = max_blocks};
    // On the device: the same arrays in operator memory and no host ones.
    PagedAttentionBatch call = batch;
    if (on_device_) {
      call.query_start = call.context_len = call.block_table = nullptr;
      call.on_device = true;
      call.device_query_start = h.Input("query_start", query_start);
      call.device_context_len = h.Input("context_len", context_len);
      call.device_block_table = h.Input("block_table", block_table);
      call.num_tokens = query_start.back();
      call.max_query_len = max_q_len + 2;
      call.max_context_len = max_blocks * block_size_;
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
    const float* d_q = h.Input("q", q);
    // Stored as dtype_ (NaN stays NaN); for fp8, K stored 256 times larger (scale 1/256, up
    // to E4M3's range), V 4 times smaller (scale 4, into its subnormals).
    std::vector<unsigned char> stored(layout.LayerBytes());
    for (int64_t i = 0; i < layout.LayerElements(); ++i) {
      const bool is_k = i < layout.HalfElements();
      const float cache_scale = fp8 ? (is_k ? layout.k_scale : layout.v_scale) : 1.0f;
      StoreFromFloat(stored.data(), dtype_, i, cache[i] / cache_scale);
    }
    const unsigned char* d_cache = h.Input("layer_cache", stored);
    void* d_out = h.Activation("out", q.size(), out_dtype_);
    ASSERT_TRUE(h.ok());
    h.backend().PagedAttention(d_q, d_cache, layout, call, num_heads, scale, d_out, out_dtype_);
    if (!h.Finish()) return;

    // Sequences whose q (and softmax weights) the backend rounds to the cache's type (the CUDA
    // backend's tensor-core prefill): the reference reads the same rounded q, and the
    // weights' rounding is what RoundedAttentionTolerance allows for.
    const int64_t row_floats = int64_t{num_heads} * head_dim_;
    std::vector<float> q_read = q;
    std::vector<bool> rounded(query_start.back(), false);
    for (size_t s = 0; s < seqs_.size(); ++s) {
      if (on_device_ ||
          !h.backend().PagedAttentionRoundsQ(dtype_, head_dim_, seqs_[s].q_len)) {
        continue;
      }
      for (int r = query_start[s]; r < query_start[s + 1]; ++r) {
        rounded[r] = true;
        const std::vector<float> row(q.begin() + r * row_floats, q.begin() + (r + 1) * row_floats);
        const std::vector<unsigned char> bytes = Encode(row, dtype_);
        for (int64_t i = 0; i < row_floats; ++i) {
          q_read[r * row_floats + i] = LoadAsFloat(bytes.data(), dtype_, i);
        }
      }
    }
    std::vector<float> expected(q.size());
    reference::PagedAttention(q_read.data(), stored.data(), layout, batch, num_heads, scale,
                              expected.data());
    const std::vector<float> actual = h.ActivationResult(d_out, out_dtype_);
    // Rows computed exactly: relative to |expected| + 0.05, as every other backend. Rounded
    // rows: relative to the largest |V| (the scale of the weights' rounding error).
    std::vector<float> exact_got, exact_want, rounded_got, rounded_want;
    for (int r = 0; r < query_start.back(); ++r) {
      auto& got = rounded[r] ? rounded_got : exact_got;
      auto& want = rounded[r] ? rounded_want : exact_want;
      got.insert(got.end(), actual.begin() + r * row_floats, actual.begin() + (r + 1) * row_floats);
      want.insert(want.end(), expected.begin() + r * row_floats,
                  expected.begin() + (r + 1) * row_floats);
    }
    if (!exact_got.empty()) {
      ExpectClose("out", exact_got, exact_want, StoredTolerance(out_dtype_, tolerance()), 0.05);
    }
    if (!rounded_got.empty()) {
      double max_v = 0.0;
      for (int64_t i = layout.HalfElements(); i < layout.LayerElements(); ++i) {
        const double v = std::abs(LoadAsFloat(stored.data(), dtype_, i) * layout.v_scale);
        if (std::isfinite(v)) max_v = std::max(max_v, v);
      }
      ExpectMatches("out (q and weights rounded)", rounded_got, rounded_want,
                    std::vector<double>(rounded_got.size(), max_v),
                    RoundedAttentionTolerance() + StoredTolerance(out_dtype_, 0.0));
    }
  }

  // The error bound of an attention row whose softmax weights p_k are rounded to the cache's
  // 16-bit type (relative error at most u: 2^-8 for bf16, 2^-11 for fp16) in both the weighted
  // sum and the denominator: with p~_k = p_k (1 + d_k), the output sum_k p~_k v_k / sum_k p~_k
  // differs from the exact one by sum_k w_k v_k (d_k - d) / (1 + d), w_k = p_k / sum p and
  // d = sum_k w_k d_k, so by at most 2 u / (1 - u) max |V|. fp16 weights below 2^-14 are
  // subnormal (absolute error up to 2^-25 each; sum p >= 1 as the largest weight is exp(0)),
  // adding at most 2 n 2^-25 max |V| over n keys: under 7e-5 for the 1100 keys of these cases.
  // fp32 arithmetic (scores, exp2, sums) adds ~1e-6. Allowed: 2.5 u, i.e. 0.0098 (bf16) and
  // 0.0012 (fp16) of max |V|; a key masked wrongly on a short row, or a misplaced element,
  // moves an output by a sizeable fraction of |V| (the prompts include rows of 1 and 2 keys).
  double RoundedAttentionTolerance() const {
    const double u = dtype_ == DType::kBF16 ? 1.0 / 256 : 1.0 / 2048;
    return 2.5 * u;
  }

 private:
  static std::string Name(int head_dim, int kv_heads, int group, int block_size,
                          const std::vector<AttentionSeq>& seqs) {
    const bool decode =
        std::all_of(seqs.begin(), seqs.end(), [](const AttentionSeq& s) { return s.q_len == 1; });
    std::string name = std::string("PagedAttention_") + (decode ? "decode" : "prefill") + "_hd" +
                       Str(head_dim) + "_kv" + Str(kv_heads) + "_g" + Str(group) + "_bs" +
                       Str(block_size);
    for (const AttentionSeq& s : seqs) name += "_q" + Str(s.q_len) + "c" + Str(s.context_len);
    return name;
  }

  int head_dim_, kv_heads_, group_, block_size_;
  std::vector<AttentionSeq> seqs_;
  DType dtype_;
  bool on_device_;
  DType out_dtype_;
};

class GatherAddCase : public OpCase {
 public:
  GatherAddCase(int rows, int dim, int num_rows)
      : OpCase("GatherAdd_rows" + Str(rows) + "_dim" + Str(dim) + "_gather" + Str(num_rows), 0.0),
        rows_(rows),
        dim_(dim),
        num_rows_(num_rows) {}

  void Check(Harness& h) const override {
    const std::vector<float> a = Random(int64_t{rows_} * dim_, seed());
    const std::vector<float> b = Random(int64_t{rows_} * dim_, seed() + 1);
    // The last row first, then random rows with repeats.
    std::mt19937 gen(seed() + 2);
    std::vector<int32_t> chosen(num_rows_);
    for (int i = 0; i < num_rows_; ++i) {
      chosen[i] = i == 0 ? rows_ - 1 : static_cast<int32_t>(gen() % rows_);
    }
    const float* d_a = h.Input("a", a);
    const float* d_b = h.Input("b", b);
    const int32_t* d_rows = h.Input("rows", chosen);
    float* d_out = h.Output("out", int64_t{num_rows_} * dim_);
    ASSERT_TRUE(h.ok());
    h.backend().GatherAdd(d_a, d_b, d_rows, num_rows_, dim_, d_out);
    if (!h.Finish()) return;
    std::vector<float> expected(int64_t{num_rows_} * dim_);
    reference::GatherAdd(a.data(), b.data(), chosen.data(), num_rows_, dim_, expected.data());
    // A single fp32 add on every backend.
    ExpectMatches("out", h.Result(d_out), expected, {}, 0.0);
  }

 private:
  int rows_, dim_, num_rows_;
};

// A token drawn from each row: greedy rows, and temperature, top-k, top-p and min-p in
// combinations, with logit edits, ties at the top and log-probabilities, against the host
// reference (the engine Sampler's arithmetic). Tokens must be identical; log-probabilities
// within 2e-5 (a backend may sum in another order, and in float).
class SampleRowsCase : public OpCase {
 public:
  SampleRowsCase(int rows, int vocab)
      : OpCase("SampleRows_rows" + Str(rows) + "_vocab" + Str(vocab), 2e-5),
        rows_(rows),
        vocab_(vocab) {}

  void Check(Harness& h) const override {
    std::vector<float> logits = Random(int64_t{rows_} * vocab_, seed());
    for (float& l : logits) l *= 4.0f;
    std::mt19937 gen(seed() + 1);
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    std::vector<SampleRowParams> params(rows_);
    std::vector<LogitEdit> edits;
    int max_logprobs = 0;
    for (int r = 0; r < rows_; ++r) {
      float* row = logits.data() + int64_t{r} * vocab_;
      SampleRowParams& p = params[r];
      p.uniform = uniform(gen);
      switch (r % 8) {
        case 0: p.num_logprobs = 3; break;
        case 1: p.temperature = 0.7f; break;
        case 2: p.temperature = 1.0f, p.top_k = 5; break;
        case 3: p.temperature = 0.8f, p.top_p = 0.9f; break;
        case 4: p.temperature = 1.3f, p.min_p = 0.05f; break;
        case 5:
          p.temperature = 0.6f, p.top_k = 40, p.top_p = 0.95f, p.min_p = 0.02f;
          p.num_logprobs = 20;
          break;
        case 6: p.num_logprobs = 0; break;
        default: p.temperature = 1.0f, p.top_k = vocab_, p.num_logprobs = 1; break;
      }
      p.num_logprobs = std::min(p.num_logprobs, vocab_);
      max_logprobs = std::max(max_logprobs, p.num_logprobs);
      // Ties at the top on some rows: the lower id wins.
      if (r % 2 == 0 && vocab_ > 17) {
        const float top = *std::max_element(row, row + vocab_) + 1.0f;
        row[17] = top;
        row[5] = top;
      }
      // Every third row edits distinct tokens: masks (the argmax among them), repetition,
      // penalties and biases.
      p.edits_begin = static_cast<int32_t>(edits.size());
      if (r % 3 == 0 && vocab_ >= 16) {
        std::vector<int32_t> ids(vocab_);
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), gen);
        ids[0] = static_cast<int32_t>(std::max_element(row, row + vocab_) - row);
        ids.erase(std::remove(ids.begin() + 1, ids.end(), ids[0]), ids.end());
        for (int i = 0; i < 12; ++i) {
          LogitEdit e{.token = ids[i]};
          if (i < 2) e.mask = 1;
          if (i >= 2 && i < 7) e.repetition = 1.3f;
          if (i >= 5 && i < 9) e.subtract = 0.5f * static_cast<float>(i - 4);
          if (i >= 9) e.bias = i == 9 ? 5.0f : -3.0f;
          edits.push_back(e);
        }
      }
      p.edits_end = static_cast<int32_t>(edits.size());
    }
    float* d_logits = h.InOut("logits", logits);
    const size_t scratch_bytes = h.backend().SampleRowsScratchBytes(
        rows_, vocab_, static_cast<int>(edits.size()));
    void* d_scratch = h.Output("scratch", static_cast<int64_t>((scratch_bytes + 3) / 4));
    auto* d_sampled = reinterpret_cast<TokenLogprob*>(h.Output("sampled", int64_t{rows_} * 2));
    auto* d_top = reinterpret_cast<TokenLogprob*>(
        h.Output("top", int64_t{rows_} * std::max(max_logprobs, 1) * 2));
    ASSERT_TRUE(h.ok());
    h.backend().SampleRows(d_logits, rows_, vocab_, params.data(), edits.data(),
                           static_cast<int>(edits.size()), max_logprobs, d_scratch, d_sampled,
                           d_top);
    if (!h.Finish()) return;
    const std::vector<TokenLogprob> sampled = h.Result(d_sampled);
    const std::vector<TokenLogprob> top = h.Result(d_top);
    SampleRowScratch scratch;
    std::vector<TokenLogprob> expected_top(std::max(max_logprobs, 1));
    for (int r = 0; r < rows_; ++r) {
      SCOPED_TRACE(testing::Message() << "row " << r);
      std::vector<float> row(logits.begin() + int64_t{r} * vocab_,
                             logits.begin() + int64_t{r + 1} * vocab_);
      const TokenLogprob want = SampleRowReference(row.data(), vocab_, params[r], edits.data(),
                                                   scratch, expected_top.data());
      EXPECT_EQ(sampled[r].token, want.token);
      if (params[r].num_logprobs >= 0) {
        EXPECT_NEAR(sampled[r].logprob, want.logprob, tolerance() * (1 + std::abs(want.logprob)));
      }
      for (int i = 0; i < params[r].num_logprobs; ++i) {
        const TokenLogprob& got = top[int64_t{r} * max_logprobs + i];
        EXPECT_EQ(got.token, expected_top[i].token) << "top " << i;
        EXPECT_NEAR(got.logprob, expected_top[i].logprob,
                    tolerance() * (1 + std::abs(expected_top[i].logprob)))
            << "top " << i;
      }
    }
  }

 private:
  int rows_, vocab_;
};

// The columns [offset, offset + narrow) of every row of a [rows, wide] tensor into a dense
// [rows, narrow] one, as the model runner splits a fused projection. No reference op: the
// expected result is the definition itself.
class CopyRowsCase : public OpCase {
 public:
  CopyRowsCase(int rows, int wide, int narrow, int offset)
      : OpCase("CopyRows_rows" + Str(rows) + "_wide" + Str(wide) + "_narrow" + Str(narrow) +
                   "_offset" + Str(offset),
               0.0),
        rows_(rows),
        wide_(wide),
        narrow_(narrow),
        offset_(offset) {}

  void Check(Harness& h) const override {
    const std::vector<float> src = Random(int64_t{rows_} * wide_, seed());
    const float* d_src = h.Input("src", src);
    float* d_dst = h.Output("dst", int64_t{rows_} * narrow_);
    ASSERT_TRUE(h.ok());
    h.backend().CopyRows(d_dst, narrow_ * sizeof(float), d_src + offset_, wide_ * sizeof(float),
                         narrow_ * sizeof(float), rows_);
    if (!h.Finish()) return;
    std::vector<float> expected(int64_t{rows_} * narrow_);
    for (int r = 0; r < rows_; ++r) {
      std::copy_n(src.begin() + int64_t{r} * wide_ + offset_, narrow_,
                  expected.begin() + int64_t{r} * narrow_);
    }
    ExpectMatches("dst", h.Result(d_dst), expected, {}, 0.0);
  }

 private:
  int rows_, wide_, narrow_, offset_;
};

// ------------------------------------------------------------------------------------------------
// The table

// Tolerances are the largest relative error allowed on any backend; the reference accumulates
// in double.
constexpr double kLinearTolerance = 2e-6;  // of sum |x||w|: a few ulp; a wrong element is ~1e-2
constexpr double kRowOpTolerance = 1e-5;
constexpr double kRopeTolerance = 1e-5;
constexpr double kAttentionTolerance = 2e-5;

std::vector<std::shared_ptr<const OpCase>> AllCases() {
  std::vector<std::shared_ptr<const OpCase>> cases;
  auto add = [&](auto op) { cases.push_back(std::make_shared<decltype(op)>(std::move(op))); };

  // Linear: m = 1 (decode), n and k straddling the CPU's 16/32-column panels and 256-deep k
  // blocks, k = 5000 (several deep blocks), m past a 128-row tile.
  for (auto [m, n, k, bias] : std::vector<std::tuple<int, int, int, bool>>{
           {1, 1, 1, false},
           {1, 45, 300, true},
           {3, 100, 13, false},
           {7, 257, 517, true},
           {64, 33, 1030, true},
           {130, 70, 77, false},
           {130, 129, 300, true},
           {1, 50, 5000, false},
           {13, 31, 5000, true},
           {200, 17, 9, true},
           {1, 1024, 256, false},
       }) {
    add(LinearCase(m, n, k, bias, kLinearTolerance));
  }
  // bf16 and fp16 weights, widened in registers: decode rows, a prefill tile, panel and k-block
  // remainders; the CUDA backend's vectorised GEMV (k a multiple of 8, m up to 4): each of its
  // row bounds (1, 2, 4) and m = 3 under one, an odd n (a warp's second column past the end), k
  // not a multiple of its 32 x 4 chunk stride; and past it (m 5 to 17) its tensor-core path.
  for (DType w_dtype : {DType::kBF16, DType::kF16}) {
    for (auto [m, n, k, bias] : std::vector<std::tuple<int, int, int, bool>>{
             {1, 1, 1, false},
             {1, 45, 300, true},
             {7, 257, 517, true},
             {130, 129, 300, true},
             {1, 50, 5000, false},
             {1, 1024, 256, false},
             {1, 301, 4096, true},
             {2, 63, 1032, false},
             {4, 130, 2056, true},
             {3, 129, 1024, true},
             {5, 64, 2048, false},
             {9, 257, 512, true},
             {16, 100, 1032, true},
             {17, 33, 512, false},
             // The CUDA skinny GEMM's shapes (m <= 16, k % 8 == 0): one and two 8-row tiles
             // of x, n past a 16-row block, k chunks of 32 split over 8 warps with a tail.
             {8, 1000, 264, false},
             {12, 4100, 4096, true},
         }) {
      add(LinearCase(m, n, k, bias, kLinearTolerance, w_dtype));
    }
  }
  // x already in W's 16-bit dtype (a producer's rounded activation): decode and prefill sizes,
  // odd n and k, with and without a bias.
  for (DType w_dtype : {DType::kBF16, DType::kF16}) {
    for (auto [m, n, k, bias] : std::vector<std::tuple<int, int, int, bool>>{
             {1, 45, 300, true},
             {4, 130, 2056, false},
             {9, 257, 517, true},
             {14, 70, 776, true},
             {130, 129, 300, false},
         }) {
      add(LinearCase(m, n, k, bias, kLinearTolerance, w_dtype, false, /*x16=*/true));
    }
  }
  // x with outliers (AddOutliers): a decode row and a prefill tile, fp32 and bf16 weights.
  for (DType w_dtype : {DType::kF32, DType::kBF16}) {
    add(LinearCase(1, 97, 640, false, kLinearTolerance, w_dtype, /*outliers=*/true));
    add(LinearCase(7, 97, 512, true, kLinearTolerance, w_dtype, /*outliers=*/true));
  }

  // Quantised weights: decode rows (1 to 3 take panel pairs on AVX-512) and prefill tiles, panel
  // remainders, k blocks that end inside a group (k 640 with groups of 128 and 32 past a
  // 256-deep block), act-order k.
  for (auto [m, n, k, bias] : std::vector<std::tuple<int, int, int, bool>>{
           {1, 1, 8, false},
           {1, 45, 300, true},
           {2, 100, 300, true},
           {7, 257, 512, true},
           {130, 129, 300, false},
           {1, 50, 5000, false},
       }) {
    add(QuantizedLinearCase(WeightQuant::kInt8, m, n, k, k, false, bias, kLinearTolerance));
  }
  for (auto [m, n, k, group, shuffled, bias] :
       std::vector<std::tuple<int, int, int, int, bool, bool>>{
           {1, 8, 32, 32, false, false},
           {1, 45, 640, 128, false, true},
           {1, 64, 640, 32, true, false},
           {3, 97, 640, 128, false, true},
           {7, 257, 512, 128, true, true},
           {130, 129, 384, 128, false, true},
           {13, 40, 5120, 128, true, false},
       }) {
    add(QuantizedLinearCase(WeightQuant::kInt4, m, n, k, group, shuffled, bias, kLinearTolerance));
  }
  // Groups of unequal size (a tensor-parallel rank's part of each group): decode rows, panel
  // pairs and prefill tiles, k blocks that end inside a group, act-order k.
  for (auto [m, n, k, group, shuffled] : std::vector<std::tuple<int, int, int, int, bool>>{
           {1, 45, 300, 16, false},
           {2, 100, 640, 64, true},
           {7, 257, 1000, 128, false},
           {130, 129, 700, 32, true},
       }) {
    add(QuantizedLinearCase(WeightQuant::kInt4, m, n, k, group, shuffled, true, kLinearTolerance,
                            /*uneven=*/true));
  }
  // Groups of multiples of 8 (units of the AVX-512 BF16 int4 kernel) of unequal size, k not a
  // multiple of 8: spans that end inside and across 256-deep k blocks, a last unit past k,
  // decode rows and tiles taller than one pass of 6 rows.
  for (auto [m, n, k, group, shuffled] : std::vector<std::tuple<int, int, int, int, bool>>{
           {1, 45, 1001, 64, false},
           {2, 70, 777, 128, true},
           {9, 33, 300, 32, false},
           {130, 65, 517, 64, false},
       }) {
    add(QuantizedLinearCase(WeightQuant::kInt4, m, n, k, group, shuffled, false, kLinearTolerance,
                            /*uneven=*/true, /*unit_aligned=*/true));
  }
  // x with outliers (AddOutliers): decode rows and a prefill tile, groups of 128 and 32.
  for (auto [m, k, group] : std::vector<std::tuple<int, int, int>>{{1, 640, 128}, {7, 512, 32}}) {
    add(QuantizedLinearCase(WeightQuant::kInt4, m, 97, k, group, false, false, kLinearTolerance,
                            /*uneven=*/false, /*unit_aligned=*/false, /*outliers=*/true));
  }
  add(QuantizedLinearCase(WeightQuant::kInt8, 3, 97, 640, 640, false, false, kLinearTolerance,
                          false, false, /*outliers=*/true));

  // RmsNorm and AddRmsNorm: dims below, at and past vector widths and block sizes.
  for (int dim : {1, 7, 64, 100, 2048, 4099}) {
    for (int rows : {1, 3, 130}) add(RmsNormCase(rows, dim, false, kRowOpTolerance));
  }
  for (int dim : {7, 2048, 4099}) add(RmsNormCase(3, dim, true, kRowOpTolerance));
  for (int dim : {5, 64, 2048, 3001}) {
    for (int rows : {1, 7, 64}) add(AddRmsNormCase(rows, dim, kRowOpTolerance));
  }
  // Stored as 16-bit activations (Backend::ActivationDType), odd sizes included.
  for (DType out : {DType::kBF16, DType::kF16}) {
    for (int dim : {7, 4099}) {
      add(RmsNormCase(5, dim, false, kRowOpTolerance, out));
      add(AddRmsNormCase(9, dim, kRowOpTolerance, out));
    }
    add(SiluMulCase(7, 1000, kRowOpTolerance, out));
    add(SiluMulCase(3, 8193, kRowOpTolerance, out));
  }

  // Rope: the smallest head_dim, one that is not a vector multiple, and the usual ones.
  for (int head_dim : {2, 20, 64, 128}) {
    for (bool llama3 : {false, true}) add(RopeCase(37, 5, head_dim, llama3, kRopeTolerance));
  }
  add(RopeCase(1, 32, 128, true, kRopeTolerance));
  add(RopeCase(130, 8, 64, false, kRopeTolerance));

  for (int inter : {1, 9, 64, 1000, 8193}) {
    for (int rows : {1, 3, 64}) add(SiluMulCase(rows, inter, kRowOpTolerance));
  }

  add(EmbeddingCase(50, 37, 70));
  add(EmbeddingCase(97, 1, 1));
  add(EmbeddingCase(97, 4096, 3));
  add(EmbeddingCase(1000, 129, 130));
  add(EmbeddingCase(50, 37, 70, DType::kBF16));
  add(EmbeddingCase(97, 4096, 3, DType::kF16));

  // WriteKv: page sizes 8/16/32, a decode token, chunks crossing block boundaries, padding.
  for (int block_size : {8, 16, 32}) {
    add(WriteKvCase(block_size, 2, 64, 0, 1, false));
    add(WriteKvCase(block_size, 1, 128, 37, 1, false));
    add(WriteKvCase(block_size, 3, 20, 5, 70, true));
    add(WriteKvCase(block_size, 8, 128, block_size - 1, 2 * block_size + 3, false));
  }
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF8E5M2}) {
    add(WriteKvCase(16, 2, 64, 0, 1, false, dtype));
    add(WriteKvCase(8, 3, 20, 5, 70, true, dtype));
  }

  // PagedAttention: decode batches (q_len 1) and prefill batches (whole prompts, and chunks
  // whose context includes earlier chunks), over GQA ratios 1 to 8 and page sizes 8/16/32;
  // contexts of one token, ending on and past block boundaries, and past 512 (the CUDA backend
  // splits keys into partitions of 64 to 512 tokens, smaller when a call has few rows, and
  // merges them).
  const std::vector<std::vector<AttentionSeq>> decode_batches = {
      {{1, 1}},
      {{1, 700}},
      {{1, 17}, {1, 33}, {1, 256}, {1, 5}, {1, 512}},
      {{1, 1100}, {1, 32}},
  };
  const std::vector<std::vector<AttentionSeq>> prefill_batches = {
      {{37, 37}},
      {{64, 300}, {1, 90}, {19, 19}, {1, 700}, {100, 164}},
      {{40, 300}, {1, 1100}, {17, 17}, {3, 513}},
  };
  struct AttentionShape {
    int head_dim, kv_heads, group, block_size;
  };
  for (const AttentionShape& s : std::vector<AttentionShape>{
           {64, 2, 1, 8},
           {128, 2, 2, 16},
           {64, 1, 4, 32},
           {128, 2, 4, 16},
           {128, 1, 8, 32},
           {64, 1, 16, 16},  // past the CUDA backend's wide-load kernel (groups of up to 8)
           {64, 2, 3, 16},   // groups the CUDA wide-load kernel rounds up to 4 and 8 heads
           {128, 1, 6, 16},
           {80, 1, 3, 8},    // not a power of two: the CPU backend only
       }) {
    for (const auto* batches : {&decode_batches, &prefill_batches}) {
      for (const std::vector<AttentionSeq>& seqs : *batches) {
        add(PagedAttentionCase(s.head_dim, s.kv_heads, s.group, s.block_size, seqs,
                               kAttentionTolerance));
      }
    }
  }
  // 16- and 8-bit caches: decode and prefill, a page size past the CPU backend's 32-key widening
  // chunk, a head_dim that is not a vector multiple.
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF8E4M3, DType::kF8E5M2}) {
    add(PagedAttentionCase(128, 2, 4, 16, decode_batches[2], kAttentionTolerance, dtype));
    add(PagedAttentionCase(64, 1, 4, 64, decode_batches[3], kAttentionTolerance, dtype));
    add(PagedAttentionCase(128, 2, 2, 16, prefill_batches[1], kAttentionTolerance, dtype));
    add(PagedAttentionCase(80, 1, 3, 8, prefill_batches[2], kAttentionTolerance, dtype));
  }
  // Batches on the device, as a captured decode step passes them: decode rows, a few rows of
  // one sequence (speculative verification), contexts past one partition, and sequences with no
  // query row (fewer rows than sequences, as the contract allows).
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF8E4M3}) {
    add(PagedAttentionCase(128, 2, 4, 16, decode_batches[2], kAttentionTolerance, dtype, true));
    add(PagedAttentionCase(64, 1, 4, 64, decode_batches[3], kAttentionTolerance, dtype, true));
    add(PagedAttentionCase(128, 1, 8, 16, {{1, 1}, {4, 700}, {1, 33}}, kAttentionTolerance, dtype,
                           true));
    add(PagedAttentionCase(128, 2, 4, 16, {{0, 20}, {2, 600}, {0, 7}}, kAttentionTolerance, dtype,
                           true));
  }

  // The CUDA backend's tensor-core prefill (sequences of 16 or more rows over bf16 and fp16
  // caches at head_dim 64 and 128; PagedAttentionRoundsQ): whole prompts of 1 (decode kernels),
  // 63, 64 and 65 rows (its 64-row query tiles and 64-key tiles), 200; a chunk of 100 rows
  // after 200 tokens of earlier context; and one call mixing both kernels: prompts around a
  // tile, a decode row, 15 rows (split-KV) next to 16 (tensor cores), a chunk with context past
  // 1024 keys. GQA 1:1 and 4:1, pages of 16 and 32 keys.
  const std::vector<std::vector<AttentionSeq>> tensor_core_batches = {
      {{1, 1}},
      {{63, 63}},
      {{64, 64}},
      {{65, 65}},
      {{200, 200}},
      {{100, 300}},
      {{65, 65}, {1, 90}, {100, 300}, {15, 40}, {16, 16}, {200, 200}, {64, 1100}},
  };
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    for (const AttentionShape& s : std::vector<AttentionShape>{
             {64, 2, 1, 16},
             {128, 2, 4, 32},
             {128, 1, 1, 16},
             {64, 1, 4, 32},
         }) {
      for (const std::vector<AttentionSeq>& seqs : tensor_core_batches) {
        add(PagedAttentionCase(s.head_dim, s.kv_heads, s.group, s.block_size, seqs,
                               kAttentionTolerance, dtype));
      }
    }
  }
  // Output stored as 16-bit activations for the o projection (Backend::ActivationDType): the
  // mixed batch (tensor-core tiles, split-KV rows, merged partitions) over the same-typed cache,
  // and a device batch.
  for (DType out : {DType::kBF16, DType::kF16}) {
    add(PagedAttentionCase(128, 2, 4, 32, tensor_core_batches.back(), kAttentionTolerance, out,
                           false, out));
    add(PagedAttentionCase(128, 1, 8, 16, {{1, 1}, {4, 700}, {1, 33}}, kAttentionTolerance, out,
                           true, out));
  }

  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3}) {
    add(AttentionInputsCase(23, 8, 2, 128, false, dtype, kRopeTolerance));
    add(AttentionInputsCase(9, 4, 4, 64, true, dtype, kRopeTolerance));
  }
  add(AttentionInputsCase(1, 32, 8, 128, true, DType::kBF16, kRopeTolerance));

  add(GatherAddCase(40, 33, 5));
  add(GatherAddCase(1, 1, 1));
  add(GatherAddCase(130, 1000, 44));
  add(GatherAddCase(7, 2048, 7));

  add(SampleRowsCase(8, 1000));
  add(SampleRowsCase(24, 5003));
  add(SampleRowsCase(3, 151936));
  add(SampleRowsCase(2, 1));

  add(CopyRowsCase(9, 24, 10, 6));
  add(CopyRowsCase(1, 1, 1, 0));
  add(CopyRowsCase(130, 340, 333, 7));
  add(CopyRowsCase(3, 2048, 2048, 0));
  return cases;
}

// ------------------------------------------------------------------------------------------------
// The parameterised test: every case on every backend.

struct Param {
  ConformanceBackend backend;
  std::shared_ptr<const OpCase> op;
};

void PrintTo(const Param& p, std::ostream* os) {
  *os << p.backend.name << " " << p.op->name() << " (seed " << p.op->seed() << ", tolerance "
      << p.op->tolerance() << ")";
}

std::vector<Param> AllParams() {
  std::vector<Param> params;
  const std::vector<std::shared_ptr<const OpCase>> cases = AllCases();
  for (const ConformanceBackend& backend : ConformanceBackends()) {
    for (const auto& op : cases) params.push_back({backend, op});
  }
  return params;
}

class BackendConformanceTest : public ::testing::TestWithParam<Param> {};

TEST_P(BackendConformanceTest, MatchesReference) {
  const Param& p = GetParam();
  if (const std::string why = p.backend.unavailable ? p.backend.unavailable() : ""; !why.empty()) {
    GTEST_SKIP() << why;
  }
  if (const std::string why = p.op->Unsupported(p.backend); !why.empty()) GTEST_SKIP() << why;
  absl::StatusOr<std::unique_ptr<Backend>> backend = p.backend.create();
  ASSERT_TRUE(backend.ok()) << backend.status();
  SCOPED_TRACE(testing::Message() << "seed " << p.op->seed());
  Harness harness(**backend, p.backend);
  p.op->Check(harness);
}

INSTANTIATE_TEST_SUITE_P(Ops, BackendConformanceTest, ::testing::ValuesIn(AllParams()),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return info.param.backend.name + "_" + info.param.op->name();
                         });

// ------------------------------------------------------------------------------------------------
// The harness itself: a backend that writes past an output, leaves an element unwritten or
// writes an input must fail the case.

// The CPU backend with one fault injected into chosen operators. Its memory is host memory.
class FaultyBackend : public test_support::ForwardingBackend {
 public:
  enum class Fault { kOverrunAfter, kOverrunBefore, kSkipLastElement, kWriteInput };

  FaultyBackend(std::unique_ptr<Backend> inner, Fault fault)
      : ForwardingBackend(std::move(inner)), fault_(fault) {}

  std::string_view name() const override { return "faulty"; }
  void RmsNorm(const float* x, const float* weight, float eps, int rows, int dim, void* y_out,
               DType y_dtype) override {
    float* y = static_cast<float*>(y_out);  // the suite's RmsNorm cases faulted are fp32
    const float last = y[int64_t{rows} * dim - 1];
    inner().RmsNorm(x, weight, eps, rows, dim, y, y_dtype);
    switch (fault_) {
      case Fault::kOverrunAfter:
        y[int64_t{rows} * dim + 3] = 0.0f;
        break;
      case Fault::kOverrunBefore:
        y[-1] = 0.0f;
        break;
      case Fault::kSkipLastElement:
        y[int64_t{rows} * dim - 1] = last;
        break;
      case Fault::kWriteInput:
        const_cast<float*>(weight)[0] += 1.0f;
        break;
    }
  }

 private:
  Fault fault_;
};

void RunRmsNormOn(FaultyBackend::Fault fault) {
  auto cpu = CreateCpuBackend({.num_threads = 1});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  FaultyBackend faulty(std::move(cpu).value(), fault);
  const ConformanceBackend info{.name = "Faulty"};
  Harness harness(faulty, info);
  RmsNormCase(3, 100, false, kRowOpTolerance).Check(harness);
}

TEST(ConformanceHarnessTest, CatchesAWritePastAnOutput) {
  EXPECT_NONFATAL_FAILURE(RunRmsNormOn(FaultyBackend::Fault::kOverrunAfter),
                          "guard of y overwritten: byte +12 past its end");
}

TEST(ConformanceHarnessTest, CatchesAWriteBeforeAnOutput) {
  EXPECT_NONFATAL_FAILURE(RunRmsNormOn(FaultyBackend::Fault::kOverrunBefore),
                          "guard of y overwritten: byte -4 before the tensor");
}

TEST(ConformanceHarnessTest, CatchesAnUnwrittenElement) {
  EXPECT_NONFATAL_FAILURE(RunRmsNormOn(FaultyBackend::Fault::kSkipLastElement),
                          "y[299] is nan (not written?)");
}

TEST(ConformanceHarnessTest, CatchesAWrittenInput) {
  EXPECT_NONFATAL_FAILURE(RunRmsNormOn(FaultyBackend::Fault::kWriteInput),
                          "input weight changed by the operator");
}

TEST(ConformanceHarnessTest, CaseNamesAreUniqueAndEveryOperatorIsCovered) {
  std::vector<std::string> names;
  for (const auto& op : AllCases()) names.push_back(op->name());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(std::adjacent_find(names.begin(), names.end()), names.end());
  for (const char* prefix :
       {"Linear_", "RmsNorm_", "AddRmsNorm_", "Rope_", "SiluMul_", "Embedding_", "WriteKv_",
        "PagedAttention_decode_", "PagedAttention_prefill_", "GatherAdd_", "CopyRows_",
        "SampleRows_", "AttentionInputs_"}) {
    EXPECT_TRUE(std::any_of(names.begin(), names.end(), [&](const std::string& n) {
      return n.rfind(prefix, 0) == 0;
    })) << prefix;
  }
}

}  // namespace
}  // namespace tandem::kernels::conformance
