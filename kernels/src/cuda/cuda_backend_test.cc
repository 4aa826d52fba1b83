// Every CUDA operator against the CPU reference, over a table of shapes. Needs a GPU: without
// one, creating the backend fails and so does every test (ctest runs it only with label gpu).
#include "tandem/kernels/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/src/cpu/reference.h"
#include "kernels/src/kernel_test_support.h"
#include "tandem/base/half.h"
#include "tandem/kernels/backend.h"

namespace tandem::kernels {
namespace {

using test_support::kNaN;
using test_support::MaxRelativeError;
using test_support::Random;

// A device copy of a host vector, freed on destruction.
template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(const std::vector<T>& host) : size_(host.size()) {
    EXPECT_EQ(cudaMalloc(&data_, sizeof(T) * std::max<size_t>(size_, 1)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data_, host.data(), sizeof(T) * size_, cudaMemcpyHostToDevice),
              cudaSuccess);
    // From pageable memory cudaMemcpy may return before the data lands, and the backend's
    // stream does not wait for the default stream: wait here.
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  ~DeviceVector() { cudaFree(data_); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;

  T* get() { return data_; }
  std::vector<T> ToHost() const {
    std::vector<T> host(size_);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, sizeof(T) * size_, cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }

 private:
  T* data_ = nullptr;
  size_t size_;
};

// One row of the shape table: sizes for the row operators and a paged-attention layout.
struct Shape {
  int rows;
  int dim;
  int head_dim;
  int kv_heads;
  int group;
  int block_size;
};

std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  const Shape& s = info.param;
  return "rows" + std::to_string(s.rows) + "_dim" + std::to_string(s.dim) + "_hd" +
         std::to_string(s.head_dim) + "_g" + std::to_string(s.group) + "_bs" +
         std::to_string(s.block_size);
}

class CudaBackendTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    auto backend = CreateCudaBackend({});
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = std::move(backend).value();
  }
  std::unique_ptr<CudaBackend> backend_;
};

TEST_P(CudaBackendTest, LinearMatchesReference) {
  const Shape& s = GetParam();
  const int m = s.rows, k = s.dim, n = s.dim + 13;
  const std::vector<float> x = Random(int64_t{m} * k, 1), w = Random(int64_t{n} * k, 2),
                           bias = Random(n, 3);
  std::vector<float> expected(int64_t{m} * n);
  reference::Linear(x.data(), m, w.data(), DType::kF32, n, k, bias.data(), expected.data());
  DeviceVector<float> d_x(x), d_bias(bias), d_y(std::vector<float>(expected.size(), kNaN));
  auto packed = backend_->PackWeight(w.data(), DType::kF32, n, k);
  backend_->Linear(d_x.get(), DType::kF32, m, *packed, d_bias.get(), d_y.get());
  ASSERT_TRUE(backend_->Synchronize().ok());
  EXPECT_LT(MaxRelativeError(d_y.ToHost(), expected, 1.0), 1e-5 * std::sqrt(k));
}

TEST_P(CudaBackendTest, RmsNormAndAddRmsNormMatchReference) {
  const Shape& s = GetParam();
  const int64_t size = int64_t{s.rows} * s.dim;
  const std::vector<float> x = Random(size, 4, -3, 3), residual = Random(size, 5, -2, 2),
                           weight = Random(s.dim, 6, 0.5f, 1.5f);
  std::vector<float> expected(size);
  reference::RmsNorm(x.data(), weight.data(), 1e-5f, s.rows, s.dim, expected.data());
  DeviceVector<float> d_x(x), d_w(weight), d_y(std::vector<float>(size, kNaN));
  backend_->RmsNorm(d_x.get(), d_w.get(), 1e-5f, s.rows, s.dim, d_y.get(), DType::kF32);
  ASSERT_TRUE(backend_->Synchronize().ok());
  EXPECT_LT(MaxRelativeError(d_y.ToHost(), expected, 1e-3), 1e-5);

  std::vector<float> expected_residual = residual;
  reference::AddRmsNorm(expected_residual.data(), x.data(), weight.data(), 1e-5f, s.rows, s.dim,
                        expected.data());
  DeviceVector<float> d_residual(residual), d_y2(std::vector<float>(size, kNaN));
  backend_->AddRmsNorm(d_residual.get(), d_x.get(), d_w.get(), 1e-5f, s.rows, s.dim, d_y2.get(),
                       DType::kF32);
  ASSERT_TRUE(backend_->Synchronize().ok());
  EXPECT_EQ(d_residual.ToHost(), expected_residual);
  EXPECT_LT(MaxRelativeError(d_y2.ToHost(), expected, 1e-3), 1e-5);
}

TEST_P(CudaBackendTest, RopeMatchesReference) {
  const Shape& s = GetParam();
  const int heads = s.kv_heads * s.group;
  const std::vector<float> inv_freq =
      RopeInverseFrequencies({.head_dim = s.head_dim, .theta = 500000.0f, .llama3_scaling = true});
  std::vector<int32_t> positions(s.rows);
  for (int t = 0; t < s.rows; ++t) positions[t] = (t * 977) % 30000;
  const std::vector<float> x = Random(int64_t{s.rows} * heads * s.head_dim, 7);
  std::vector<float> expected = x;
  reference::Rope(expected.data(), positions.data(), s.rows, heads, s.head_dim, inv_freq.data());
  DeviceVector<float> d_x(x), d_inv(inv_freq);
  DeviceVector<int32_t> d_pos(positions);
  backend_->Rope(d_x.get(), d_pos.get(), s.rows, heads, s.head_dim, d_inv.get());
  ASSERT_TRUE(backend_->Synchronize().ok());
  EXPECT_LT(MaxRelativeError(d_x.ToHost(), expected, 0.1), 1e-5);
}

TEST_P(CudaBackendTest, SiluMulMatchesReference) {
  const Shape& s = GetParam();
  const std::vector<float> gate_up = Random(int64_t{s.rows} * 2 * s.dim, 8, -30, 30);
  std::vector<float> expected(int64_t{s.rows} * s.dim);
  reference::SiluMul(gate_up.data(), s.rows, s.dim, expected.data());
  DeviceVector<float> d_in(gate_up), d_out(std::vector<float>(expected.size(), kNaN));
  backend_->SiluMul(d_in.get(), s.rows, s.dim, d_out.get(), DType::kF32);
  ASSERT_TRUE(backend_->Synchronize().ok());
  EXPECT_LT(MaxRelativeError(d_out.ToHost(), expected, 1e-3), 1e-5);
}

TEST_P(CudaBackendTest, EmbeddingAndWriteKvCopyExactly) {
  const Shape& s = GetParam();
  const int vocab = 97;
  const std::vector<float> table = Random(int64_t{vocab} * s.dim, 9);
  std::vector<int32_t> ids(s.rows);
  for (int t = 0; t < s.rows; ++t) ids[t] = (t * 31 + 5) % vocab;
  std::vector<float> expected(int64_t{s.rows} * s.dim);
  reference::Embedding(table.data(), DType::kF32, ids.data(), s.rows, s.dim, expected.data());
  DeviceVector<float> d_table(table), d_out(std::vector<float>(expected.size(), kNaN));
  DeviceVector<int32_t> d_ids(ids);
  backend_->Embedding(d_table.get(), DType::kF32, d_ids.get(), s.rows, s.dim, d_out.get());

  const KvLayout layout{.num_blocks = (s.rows + s.block_size - 1) / s.block_size + 2,
                        .block_size = s.block_size,
                        .num_kv_heads = s.kv_heads,
                        .head_dim = s.head_dim};
  const int64_t row = int64_t{s.kv_heads} * s.head_dim;
  const std::vector<float> k = Random(s.rows * row, 10), v = Random(s.rows * row, 11);
  std::vector<int32_t> slots(s.rows);
  for (int t = 0; t < s.rows; ++t) slots[t] = t % 5 == 4 ? -1 : t + s.block_size;  // padding too
  std::vector<float> expected_cache(layout.LayerElements(), 3.0f);
  reference::WriteKv(k.data(), v.data(), slots.data(), s.rows, layout, expected_cache.data());
  DeviceVector<float> d_k(k), d_v(v), d_cache(std::vector<float>(expected_cache.size(), 3.0f));
  DeviceVector<int32_t> d_slots(slots);
  backend_->WriteKv(d_k.get(), d_v.get(), d_slots.get(), s.rows, layout, d_cache.get());
  ASSERT_TRUE(backend_->Synchronize().ok());
  EXPECT_EQ(d_out.ToHost(), expected);
  EXPECT_EQ(d_cache.ToHost(), expected_cache);
}

// How PagedAttentionError runs its call: the status, expected OK, goes to *status when given;
// the cache starts `cache_offset` floats into its allocation.
struct AttentionRun {
  absl::Status* status = nullptr;
  int cache_offset = 0;
};

// Runs one batch of (q_len, context_len) sequences on the GPU and returns the worst error
// against the reference.
double PagedAttentionError(CudaBackend& backend, const Shape& s,
                           const std::vector<std::pair<int, int>>& seqs,
                           const AttentionRun& run = {}) {
  const int heads = s.kv_heads * s.group;
  int total_blocks = 0, max_blocks = 0;
  for (auto [q_len, ctx] : seqs) {
    const int blocks = (ctx + s.block_size - 1) / s.block_size;
    total_blocks += blocks;
    max_blocks = std::max(max_blocks, blocks);
  }
  const KvLayout layout{.num_blocks = total_blocks,
                        .block_size = s.block_size,
                        .num_kv_heads = s.kv_heads,
                        .head_dim = s.head_dim};
  std::vector<int32_t> physical(total_blocks);
  std::iota(physical.begin(), physical.end(), 0);
  std::shuffle(physical.begin(), physical.end(), std::mt19937(12));
  std::vector<int32_t> block_table(seqs.size() * max_blocks, 0), query_start = {0}, context_len;
  int next = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    for (int b = 0; b * s.block_size < seqs[i].second; ++b) {
      block_table[i * max_blocks + b] = physical[next++];
    }
    query_start.push_back(query_start.back() + seqs[i].first);
    context_len.push_back(seqs[i].second);
  }
  const std::vector<float> cache = Random(layout.LayerElements(), 13);
  const std::vector<float> q = Random(int64_t{query_start.back()} * heads * s.head_dim, 14, -2, 2);
  const PagedAttentionBatch batch{.num_seqs = static_cast<int>(seqs.size()),
                                  .query_start = query_start.data(),
                                  .context_len = context_len.data(),
                                  .block_table = block_table.data(),
                                  .max_blocks_per_seq = max_blocks};
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  std::vector<float> expected(q.size());
  reference::PagedAttention(q.data(), cache.data(), layout, batch, heads, scale, expected.data());
  std::vector<float> placed(run.cache_offset, 0.0f);
  placed.insert(placed.end(), cache.begin(), cache.end());
  DeviceVector<float> d_q(q), d_cache(placed), d_out(std::vector<float>(q.size(), kNaN));
  backend.PagedAttention(d_q.get(), d_cache.get() + run.cache_offset, layout, batch, heads, scale,
                         d_out.get(), DType::kF32);
  const absl::Status status = backend.Synchronize();
  if (run.status != nullptr) {
    *run.status = status;
  } else {
    EXPECT_TRUE(status.ok()) << status;
  }
  return MaxRelativeError(d_out.ToHost(), expected, 0.05);
}

TEST_P(CudaBackendTest, PagedAttentionMatchesReference) {
  // Contexts past the 512-key partition (split, then merged), next to a prefill chunk over
  // earlier context and a whole prompt.
  EXPECT_LT(PagedAttentionError(*backend_, GetParam(),
                                {{1, 1}, {1, 700}, {40, 300}, {1, 1100}, {17, 17}}),
            2e-5);
  // Every row within one partition: written directly, no merge.
  EXPECT_LT(PagedAttentionError(*backend_, GetParam(), {{1, 5}, {3, 200}, {1, 512}}), 2e-5);
  // A cache 4 or 16 bytes off the 32-byte alignment of eight fp32 elements: the kernel that
  // reads a key per warp, not the wide loads.
  for (int offset : {1, 4}) {
    EXPECT_LT(
        PagedAttentionError(*backend_, GetParam(), {{1, 700}, {2, 40}}, {.cache_offset = offset}),
        2e-5)
        << offset;
  }
}

// A merge workspace that holds two rows' partitions at most: the call runs as many launches of
// two rows (the halving of partitions for a small grid stops where the rows would not fit), with
// the same results; one that holds none of a row's partitions is refused, saying how much a row
// needs.
TEST_P(CudaBackendTest, PagedAttentionRunsInLaunchesOfTheRowsItsWorkspaceHolds) {
  const Shape& s = GetParam();
  const int heads = s.kv_heads * s.group;
  // Contexts up to 1100 keys: 3 partitions of 512.
  const int64_t row_bytes = int64_t{heads} * 3 * (s.head_dim + 2) * sizeof(float);
  auto small = CreateCudaBackend({.attention_workspace_bytes = 2 * row_bytes + 100});
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_LT(PagedAttentionError(**small, s, {{1, 1}, {1, 700}, {40, 300}, {1, 1100}, {17, 17}}),
            2e-5);
  auto none = CreateCudaBackend({.attention_workspace_bytes = row_bytes / 2});
  ASSERT_TRUE(none.ok()) << none.status();
  absl::Status status;
  PagedAttentionError(**none, s, {{1, 1100}}, {.status = &status});
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("bytes of merge workspace per query row"), std::string::npos)
      << status;
}

TEST_P(CudaBackendTest, GatherAddMatchesReference) {
  const Shape& s = GetParam();
  const std::vector<float> a = Random(int64_t{s.rows} * s.dim, 12),
                           b = Random(int64_t{s.rows} * s.dim, 13);
  std::vector<int32_t> rows;
  for (int r = s.rows - 1; r >= 0; r -= 3) rows.push_back(r);
  rows.push_back(0);
  const int n = static_cast<int>(rows.size());
  std::vector<float> expected(int64_t{n} * s.dim);
  reference::GatherAdd(a.data(), b.data(), rows.data(), n, s.dim, expected.data());
  DeviceVector<float> d_a(a), d_b(b), d_out(std::vector<float>(expected.size(), kNaN));
  DeviceVector<int32_t> d_rows(rows);
  backend_->GatherAdd(d_a.get(), d_b.get(), d_rows.get(), n, s.dim, d_out.get());
  ASSERT_TRUE(backend_->Synchronize().ok());
  EXPECT_EQ(d_out.ToHost(), expected);
}

TEST_P(CudaBackendTest, AllocateCopyRowsAndCopyBack) {
  const Shape& s = GetParam();
  ASSERT_FALSE(backend_->host_memory());
  const int wide = s.dim + 7, offset = 5;
  const std::vector<float> src = Random(int64_t{s.rows} * wide, 14);
  auto d_src = backend_->Allocate(src.size() * sizeof(float));
  auto d_dst = backend_->Allocate(int64_t{s.rows} * s.dim * sizeof(float));
  ASSERT_TRUE(d_src.ok() && d_dst.ok());
  backend_->CopyToDevice(d_src->data(), src.data(), d_src->bytes());
  backend_->CopyRows(d_dst->data(), s.dim * sizeof(float), d_src->as<float>() + offset,
                     wide * sizeof(float), s.dim * sizeof(float), s.rows);
  std::vector<float> out(int64_t{s.rows} * s.dim, kNaN);
  backend_->CopyToHost(out.data(), d_dst->data(), d_dst->bytes());
  ASSERT_TRUE(backend_->Synchronize().ok());
  for (int r = 0; r < s.rows; ++r) {
    for (int j = 0; j < s.dim; ++j) {
      ASSERT_EQ(out[int64_t{r} * s.dim + j], src[int64_t{r} * wide + offset + j]) << r << "," << j;
    }
  }
}

TEST_P(CudaBackendTest, UnsupportedHeadDimIsReported) {
  const Shape& s = GetParam();
  const KvLayout layout{
      .num_blocks = 1, .block_size = s.block_size, .num_kv_heads = 1, .head_dim = 72};
  const int32_t query_start[2] = {0, 1}, context_len[1] = {1}, block_table[1] = {0};
  DeviceVector<float> d_q(std::vector<float>(72)),
      d_cache(std::vector<float>(layout.LayerElements())), d_out(std::vector<float>(72));
  backend_->PagedAttention(d_q.get(), d_cache.get(), layout,
                           {.num_seqs = 1,
                            .query_start = query_start,
                            .context_len = context_len,
                            .block_table = block_table,
                            .max_blocks_per_seq = 1},
                           1, 1.0f, d_out.get(), DType::kF32);
  EXPECT_EQ(backend_->Synchronize().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(backend_->Synchronize().ok()) << "the error is reported once";
}

// LinearAdd past the skinny rows: y += x W^T + bias, the product added by the GEMM (cuBLASLt's
// beta = 1, or cublasGemmEx's). Against Linear on the same backend and a host add, for fp32 x
// (rounded to bf16 first) and for a bf16 x; within a rounding of the sum. Not offered at 16
// rows or fewer, nor for fp32 or quantised weights, where LinearAdd is an error.
TEST(CudaLinearAddTest, AddsTheProductOfLinearToY) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto created = CreateCudaBackend({});
  ASSERT_TRUE(created.ok()) << created.status();
  CudaBackend& backend = **created;
  const int n = 320, k = 256;
  std::vector<uint16_t> w16(int64_t{n} * k);
  const std::vector<float> w = Random(w16.size(), 21), bias = Random(n, 22);
  for (size_t i = 0; i < w.size(); ++i) w16[i] = FloatToBf16(w[i]);
  auto packed = backend.PackWeight(w16.data(), DType::kBF16, n, k);
  auto packed_f32 = backend.PackWeight(w.data(), DType::kF32, n, k);
  EXPECT_FALSE(backend.LinearAdds(16, *packed));
  EXPECT_FALSE(backend.LinearAdds(64, *packed_f32));
  for (const int m : {17, 64, 300}) {
    SCOPED_TRACE(::testing::Message() << m << " rows");
    ASSERT_TRUE(backend.LinearAdds(m, *packed));
    const std::vector<float> x = Random(int64_t{m} * k, 23), y0 = Random(int64_t{m} * n, 24);
    std::vector<uint16_t> x16(x.size());
    for (size_t i = 0; i < x.size(); ++i) x16[i] = FloatToBf16(x[i]);
    DeviceVector<float> d_x(x), d_bias(bias), d_product(std::vector<float>(y0.size(), kNaN));
    DeviceVector<uint16_t> d_x16(x16);
    backend.Linear(d_x.get(), DType::kF32, m, *packed, d_bias.get(), d_product.get());
    ASSERT_TRUE(backend.Synchronize().ok());
    std::vector<float> expected = d_product.ToHost();
    for (size_t i = 0; i < expected.size(); ++i) expected[i] += y0[i];
    DeviceVector<float> d_y(y0), d_y16(y0);
    backend.LinearAdd(d_x.get(), DType::kF32, m, *packed, d_bias.get(), d_y.get());
    backend.LinearAdd(d_x16.get(), DType::kBF16, m, *packed, d_bias.get(), d_y16.get());
    ASSERT_TRUE(backend.Synchronize().ok());
    EXPECT_LT(MaxRelativeError(d_y.ToHost(), expected, 1.0), 1e-6 * std::sqrt(k));
    EXPECT_LT(MaxRelativeError(d_y16.ToHost(), expected, 1.0), 1e-6 * std::sqrt(k));
  }
  DeviceVector<float> d_x(Random(int64_t{16} * k, 25)), d_y(std::vector<float>(16 * n, 0.0f));
  backend.LinearAdd(d_x.get(), DType::kF32, 16, *packed, nullptr, d_y.get());
  EXPECT_EQ(backend.Synchronize().code(), absl::StatusCode::kInvalidArgument);
}

// A backend on a GPU other than 0, created on this thread and used from another (as the engine
// steps its backend on its own thread), whose current device is GPU 0: its memory is on its own
// GPU and its operators run there. Needs two GPUs.
TEST(CudaBackendDeviceTest, BackendOnAnotherGpuRunsFromAnyThread) {
  const int devices = CudaDeviceCount();
  if (devices < 2) GTEST_SKIP() << "needs two CUDA devices, found " << devices;
  const int device = devices - 1;
  auto created = CreateCudaBackend({.device = device});
  ASSERT_TRUE(created.ok()) << created.status();
  CudaBackend& backend = **created;
  const int m = 3, n = 70, k = 64;
  const std::vector<float> x = Random(int64_t{m} * k, 31), w = Random(int64_t{n} * k, 32);
  std::vector<float> expected(int64_t{m} * n);
  reference::Linear(x.data(), m, w.data(), DType::kF32, n, k, nullptr, expected.data());
  std::vector<float> got(expected.size(), kNaN);
  int located = -1;
  absl::Status status;
  std::thread([&] {
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    auto d_x = backend.Allocate(sizeof(float) * x.size());
    auto d_y = backend.Allocate(sizeof(float) * got.size());
    ASSERT_TRUE(d_x.ok() && d_y.ok());
    cudaPointerAttributes attributes{};
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, d_y->data()), cudaSuccess);
    located = attributes.device;
    backend.CopyToDevice(d_x->data(), x.data(), sizeof(float) * x.size());
    auto packed = backend.PackWeight(w.data(), DType::kF32, n, k);
    backend.Linear(d_x->data(), DType::kF32, m, *packed, nullptr, d_y->as<float>());
    backend.CopyToHost(got.data(), d_y->data(), sizeof(float) * got.size());
    status = backend.Synchronize();
  }).join();
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(located, device);
  EXPECT_LT(MaxRelativeError(got, expected, 1.0), 1e-5 * std::sqrt(k));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaBackendTest,
                         ::testing::Values(Shape{1, 64, 64, 2, 1, 8}, Shape{3, 1000, 128, 2, 2, 16},
                                           Shape{7, 2048, 64, 1, 4, 32},
                                           Shape{130, 333, 128, 2, 4, 16}),
                         ShapeName);

}  // namespace
}  // namespace tandem::kernels
