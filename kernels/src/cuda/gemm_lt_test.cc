// LtGemm (Linear's 16-bit GEMMs through cuBLASLt) on a GPU, against a float64 product of the same
// 16-bit values. Label gpu: without a device every case skips.
#include "kernels/src/cuda/gemm_lt.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/src/kernel_test_support.h"
#include "tandem/base/half.h"
#include "tandem/kernels/cuda_backend.h"

namespace tandem::kernels::cuda {
namespace {

using test_support::Random;

// The CUDA backend's (kCublasWorkspaceBytes).
constexpr size_t kWorkspaceBytes = size_t{32} << 20;

struct DeviceBytes {
  explicit DeviceBytes(size_t bytes) { EXPECT_EQ(cudaMalloc(&data, bytes + 256), cudaSuccess); }
  ~DeviceBytes() { cudaFree(data); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  unsigned char* data = nullptr;
};

std::vector<uint16_t> ToBf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBf16(v[i]);
  return out;
}

class LtGemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
    workspace_ = std::make_unique<DeviceBytes>(kWorkspaceBytes);
    auto lt = LtGemm::Create(workspace_->data, kWorkspaceBytes);
    ASSERT_TRUE(lt.ok()) << lt.status();
    lt_ = std::move(lt).value();
  }
  void TearDown() override {
    lt_.reset();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Runs y = x w^T (+ bias) for m rows, with y `y_offset` floats past an aligned address, and
  // returns the largest error as a fraction of sum |x||w| of its element.
  double Error(int m, int n, int k, bool bias, int y_offset) {
    const std::vector<uint16_t> x = ToBf16(Random(int64_t{m} * k, 11));
    const std::vector<uint16_t> w = ToBf16(Random(int64_t{n} * k, 12));
    const std::vector<float> b = Random(n, 13);
    DeviceBytes d_x(x.size() * 2), d_w(w.size() * 2), d_b(b.size() * 4),
        d_y(sizeof(float) * (int64_t{m} * n + y_offset));
    EXPECT_EQ(cudaMemcpy(d_x.data, x.data(), x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d_w.data, w.data(), w.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d_b.data, b.data(), b.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    EXPECT_EQ(cudaMemset(d_y.data, 0xff, sizeof(float) * (int64_t{m} * n + y_offset)),
              cudaSuccess);  // NaN
    float* y = reinterpret_cast<float*>(d_y.data) + y_offset;
    absl::Status status =
        lt_->Run({.x16 = d_x.data, .m = m, .w = d_w.data, .type = CUDA_R_16BF, .n = n, .k = k,
                  .bias = bias ? reinterpret_cast<const float*>(d_b.data) : nullptr, .y = y},
                 stream_);
    EXPECT_TRUE(status.ok()) << status;
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    std::vector<float> got(int64_t{m} * n);
    EXPECT_EQ(cudaMemcpy(got.data(), y, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    // Every row of small calls; rows spread over m (the last one too) of large ones.
    const int64_t row_step = std::max<int64_t>(1, int64_t{m} * n * k / 200'000'000);
    double worst = 0;
    for (int i = 0; i < m; i = (i + 1 < m && i + row_step >= m) ? m - 1 : i + row_step) {
      for (int j = 0; j < n; ++j) {
        double sum = bias ? b[j] : 0.0, scale = bias ? std::fabs(b[j]) : 0.0;
        for (int q = 0; q < k; ++q) {
          const double p = double{Bf16ToFloat(x[int64_t{i} * k + q])} *
                           Bf16ToFloat(w[int64_t{j} * k + q]);
          sum += p;
          scale += std::fabs(p);
        }
        const double error = std::fabs(got[int64_t{i} * n + j] - sum) / (scale + 1e-30);
        worst = std::isnan(error) ? INFINITY : std::max(worst, error);
      }
    }
    return worst;
  }

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DeviceBytes> workspace_;
  std::unique_ptr<LtGemm> lt_;
};

TEST_F(LtGemmTest, PrepareChoosesEveryBucketOnce) {
  ASSERT_TRUE(lt_->Prepare(512, 1024, CUDA_R_16BF).ok());
  // 8, 16, ..., 8192 rows, with and without a bias.
  EXPECT_EQ(lt_->choices(), 2 * 11);
  EXPECT_EQ(lt_->choices_without_algorithm(), 0);
  ASSERT_TRUE(lt_->Prepare(512, 1024, CUDA_R_16BF).ok());
  EXPECT_EQ(lt_->choices(), 2 * 11);
  // Every m of a prepared bucket, aligned, runs on the kept choice.
  for (int m : {5, 8, 9, 100, 1000}) {
    for (bool bias : {false, true}) EXPECT_LT(Error(m, 512, 1024, bias, 0), 1e-5) << m;
  }
  EXPECT_EQ(lt_->choices(), 2 * 11);
}

// (m, n, k, bias, y offset in floats): the bucket edges, odd n and k (unaligned leading
// dimensions), a y 4 bytes off 16, and a bucket past the prepared ones.
class LtGemmShapes
    : public LtGemmTest,
      public ::testing::WithParamInterface<std::tuple<int, int, int, bool, int>> {};

TEST_P(LtGemmShapes, MatchesTheProductOfTheSame16BitValues) {
  const auto [m, n, k, bias, y_offset] = GetParam();
  EXPECT_LT(Error(m, n, k, bias, y_offset), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Calls, LtGemmShapes,
    ::testing::Values(std::tuple{5, 64, 2048, false, 0}, std::tuple{16, 100, 1032, true, 0},
                      std::tuple{17, 33, 512, false, 0}, std::tuple{9, 257, 517, true, 0},
                      std::tuple{130, 129, 300, true, 1}, std::tuple{64, 6144, 4096, false, 0},
                      std::tuple{256, 4096, 14336, true, 3},
                      std::tuple{9000, 96, 256, true, 0}));

}  // namespace
}  // namespace tandem::kernels::cuda
