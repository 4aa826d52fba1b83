// 16-bit activations (Backend::ActivationDType): where a backend's Linear rounds an fp32 x to its
// weights' 16-bit type anyway, the runner has the operator before it store x in that type. The
// values are the same, so the logits must be bitwise those of a runner that hands Linear fp32 x
// to round. Checked on the CPU backend behind a wrapper that rounds as the CUDA backend does
// (past 4 rows); gpu_runner_test runs the CUDA backend itself.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/src/forwarding_backend.h"
#include "step_plan.h"
#include "tandem/base/half.h"
#include "tandem/engine/block_manager.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/model_runner.h"
#include "tandem/kernels/backend.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

// The CPU backend, but Linear rounds x to 16-bit W's type past 4 rows (LinearRoundsX) before
// the CPU's kernels read it. With `stored`, ActivationDType asks the producers of those x for
// 16-bit activations; without, the runner passes fp32 and Linear rounds it here.
class RoundingBackend : public kernels::test_support::ForwardingBackend {
 public:
  RoundingBackend(std::unique_ptr<kernels::Backend> inner, bool stored)
      : ForwardingBackend(std::move(inner)), stored_(stored) {}

  // The n of each Linear whose fp32 x was rounded here.
  const std::vector<int>& rounded_here() const { return rounded_here_; }
  int sixteen_bit_inputs() const { return sixteen_bit_inputs_; }

  bool LinearRoundsX(int m, DType w_dtype) const override {
    return m > 4 && (w_dtype == DType::kBF16 || w_dtype == DType::kF16);
  }
  DType ActivationDType(int m, const kernels::PackedWeight& w) const override {
    return stored_ ? RoundedActivationDType(m, w) : DType::kF32;
  }
  void Linear(const void* x, DType x_dtype, int m, const kernels::PackedWeight& w,
              const float* bias, float* y) override {
    if (x_dtype != DType::kF32) {
      ++sixteen_bit_inputs_;
    } else if (RoundedActivationDType(m, w) != DType::kF32) {
      rounded_here_.push_back(w.n());
      std::vector<unsigned char> x16(static_cast<size_t>(int64_t{m} * w.k()) * 2);
      for (int64_t i = 0; i < int64_t{m} * w.k(); ++i) {
        StoreFromFloat(x16.data(), w.dtype(), i, static_cast<const float*>(x)[i]);
      }
      inner().Linear(x16.data(), w.dtype(), m, w, bias, y);
      return;
    }
    inner().Linear(x, x_dtype, m, w, bias, y);
  }

 private:
  bool stored_;
  std::vector<int> rounded_here_;
  int sixteen_bit_inputs_ = 0;
};

struct Model {
  std::string arch;
  DType dtype;
};

class ActivationDTypeTest : public ::testing::TestWithParam<Model> {};

TEST_P(ActivationDTypeTest, StoredActivationsGiveTheLogitsOfRoundingInLinear) {
  auto checkpoint = Checkpoint::Open(testing::TinyModel(GetParam().arch, GetParam().dtype));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const int vocab = (*checkpoint)->config().vocab_size;
  const ModelRunnerOptions options{
      .max_num_batched_tokens = 256, .max_num_seqs = 8, .num_kv_blocks = 64, .block_size = 16};
  std::unique_ptr<RoundingBackend> backends[2];
  std::unique_ptr<ModelRunner> runners[2];
  for (int i = 0; i < 2; ++i) {
    auto cpu = kernels::CreateCpuBackend({.num_threads = 1});
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    backends[i] = std::make_unique<RoundingBackend>(std::move(cpu).value(), /*stored=*/i == 1);
    auto runner = ModelRunner::Create(**checkpoint, backends[i].get(), options);
    ASSERT_TRUE(runner.ok()) << runner.status();
    runners[i] = std::move(runner).value();
  }

  // Six sequences: a prefill of all of them (long prompts with chunks of context), then decode
  // batches of more than 4 rows (16-bit activations) and of fewer (fp32), and a mixed step.
  BlockManager blocks(options.num_kv_blocks, options.block_size);
  std::vector<Sequence> seqs(6);
  for (int i = 0; i < 6; ++i) {
    const int len = 2 + 7 * i;
    for (int t = 0; t < len; ++t) seqs[i].tokens.push_back((t * 29 + i * 13 + 3) % vocab);
    seqs[i].num_prompt_tokens = len;
  }
  const std::vector<std::vector<int>> plan = {
      {0, 1, 2, 3, 4, 5}, {0, 1, 2, 3, 4, 5}, {2, 3}, {0, 1, 2, 3, 4}, {5}, {1, 3, 4, 5, 0}};
  for (size_t step_index = 0; step_index < plan.size(); ++step_index) {
    SCOPED_TRACE(::testing::Message() << "step " << step_index);
    SchedulerStep step;
    for (int i : plan[step_index]) {
      ASSERT_TRUE(testing::ScheduleRest(blocks, seqs[i], step).ok());
    }
    auto rounding = runners[0]->Execute(step);
    ASSERT_TRUE(rounding.ok()) << rounding.status();
    const std::vector<float> want(rounding->begin(), rounding->end());
    auto stored = runners[1]->Execute(step);
    ASSERT_TRUE(stored.ok()) << stored.status();
    ASSERT_EQ(stored->size(), want.size());
    for (size_t r = 0; r < step.seqs.size(); ++r) {
      EXPECT_TRUE(std::equal(want.begin() + r * vocab, want.begin() + (r + 1) * vocab,
                             stored->begin() + r * vocab))
          << "row " << r << " differs";
    }
    testing::AppendGreedyTokens(step, want, vocab);
  }
  // The first runner rounded x in every Linear of more than 4 rows and was never given 16-bit
  // x; the second was given them instead (4 per layer of such a step), and rounded only the LM
  // head's x (its final norm writes fp32 in place).
  const std::vector<int>& rounded = backends[0]->rounded_here();
  const auto lm_head_calls = std::count(rounded.begin(), rounded.end(), vocab);
  EXPECT_GT(lm_head_calls, 0);
  EXPECT_EQ(backends[0]->sixteen_bit_inputs(), 0);
  EXPECT_EQ(backends[1]->sixteen_bit_inputs(), rounded.size() - lm_head_calls);
  EXPECT_EQ(backends[1]->rounded_here(), std::vector<int>(lm_head_calls, vocab));
}

// The rule a backend that rounds x (LinearRoundsX) answers with RoundedActivationDType: the
// weights' 16-bit type past 4 rows; fp32 for fewer rows, fp32 weights and quantised weights.
TEST(RoundedActivationDTypeTest, SixteenBitWeightsPastTheGemvRows) {
  auto cpu = kernels::CreateCpuBackend({.num_threads = 1});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  RoundingBackend b(std::move(cpu).value(), /*stored=*/true);
  const int n = 4, k = 8;
  const std::vector<float> f32(n * k, 0.5f);
  const std::vector<uint16_t> half(n * k, 0x3c00);  // 1.0 in fp16; 1.875 in bf16
  auto w_f32 = b.PackWeight(f32.data(), DType::kF32, n, k);
  auto w_bf16 = b.PackWeight(half.data(), DType::kBF16, n, k);
  auto w_f16 = b.PackWeight(half.data(), DType::kF16, n, k);
  const std::vector<int8_t> values(n * k, 3);
  const std::vector<float> scales(n, 0.25f);
  auto w_int8 = b.PackQuantizedWeight({.quant = kernels::WeightQuant::kInt8,
                                       .n = n,
                                       .k = k,
                                       .group_size = k,
                                       .values = values.data(),
                                       .scales = scales.data()});
  for (int m : {1, 4}) {
    EXPECT_EQ(b.ActivationDType(m, *w_bf16), DType::kF32) << m;
    EXPECT_EQ(b.ActivationDType(m, *w_f16), DType::kF32) << m;
  }
  for (int m : {5, 16, 2048}) {
    EXPECT_EQ(b.ActivationDType(m, *w_bf16), DType::kBF16) << m;
    EXPECT_EQ(b.ActivationDType(m, *w_f16), DType::kF16) << m;
    EXPECT_EQ(b.ActivationDType(m, *w_f32), DType::kF32) << m;
    EXPECT_EQ(b.ActivationDType(m, *w_int8), DType::kF32) << m;
  }
  // The CPU backend itself keeps fp32 activations whatever the weights.
  auto plain = kernels::CreateCpuBackend({.num_threads = 1});
  ASSERT_TRUE(plain.ok()) << plain.status();
  auto w_plain = (*plain)->PackWeight(half.data(), DType::kBF16, n, k);
  EXPECT_EQ((*plain)->ActivationDType(2048, *w_plain), DType::kF32);
}

INSTANTIATE_TEST_SUITE_P(Models, ActivationDTypeTest,
                         ::testing::Values(Model{"llama", DType::kBF16},
                                           Model{"qwen2", DType::kF16},
                                           Model{"qwen3", DType::kBF16}),
                         [](const auto& info) { return info.param.arch; });

}  // namespace
}  // namespace tandem::engine
