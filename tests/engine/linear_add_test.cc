// A projection added to the residual stream by the GEMM itself (Backend::LinearAdd, cuBLASLt's
// epilogue on the GPU past decode sizes): where a backend offers it, the runner sends the o and
// down projections there and norms the residual with RmsNorm, instead of writing them out for
// AddRmsNorm. The sums are the same (residual + projection, then the norm), so the logits must
// be bitwise those of the AddRmsNorm path. Checked on the CPU backend behind a wrapper that adds
// in LinearAdd as a GEMM epilogue would (past 4 rows); gpu_runner_test runs the CUDA backend.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/src/forwarding_backend.h"
#include "step_plan.h"
#include "tandem/engine/block_manager.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/model_runner.h"
#include "tandem/kernels/backend.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

// The CPU backend with LinearAdd past 4 rows: Linear into a buffer of its own, then y += it.
class AddingBackend : public kernels::test_support::ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;

  // The n of each LinearAdd call, in order.
  const std::vector<int>& added() const { return added_; }

  bool LinearAdds(int m, const kernels::PackedWeight& w) const override { return m > 4; }
  void LinearAdd(const void* x, DType x_dtype, int m, const kernels::PackedWeight& w,
                 const float* bias, float* y) override {
    ASSERT_TRUE(LinearAdds(m, w)) << m << " rows";
    added_.push_back(w.n());
    std::vector<float> product(static_cast<size_t>(int64_t{m} * w.n()));
    inner().Linear(x, x_dtype, m, w, bias, product.data());
    for (size_t i = 0; i < product.size(); ++i) y[i] += product[i];
  }

 private:
  std::vector<int> added_;
};

TEST(LinearAddTest, ResidualAddedInLinearGivesTheLogitsOfAddRmsNorm) {
  auto checkpoint = Checkpoint::Open(testing::TinyModel("llama", DType::kBF16));
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const text::ModelConfig& config = (*checkpoint)->config();
  const int vocab = config.vocab_size;
  const ModelRunnerOptions options{
      .max_num_batched_tokens = 256, .max_num_seqs = 8, .num_kv_blocks = 64, .block_size = 16};
  auto plain_cpu = kernels::CreateCpuBackend({.num_threads = 1});
  ASSERT_TRUE(plain_cpu.ok()) << plain_cpu.status();
  auto adding_cpu = kernels::CreateCpuBackend({.num_threads = 1});
  ASSERT_TRUE(adding_cpu.ok()) << adding_cpu.status();
  AddingBackend adding(std::move(adding_cpu).value());
  auto plain = ModelRunner::Create(**checkpoint, plain_cpu->get(), options);
  ASSERT_TRUE(plain.ok()) << plain.status();
  auto added = ModelRunner::Create(**checkpoint, &adding, options);
  ASSERT_TRUE(added.ok()) << added.status();

  // Five sequences: a prefill of all of them (more than 4 rows: LinearAdd), decode steps of 5
  // rows (LinearAdd) and of 2 (AddRmsNorm), then 5 again.
  BlockManager blocks(options.num_kv_blocks, options.block_size);
  std::vector<Sequence> seqs(5);
  for (int i = 0; i < 5; ++i) {
    const int len = 3 + 6 * i;
    for (int t = 0; t < len; ++t) seqs[i].tokens.push_back((t * 31 + i * 11 + 5) % vocab);
    seqs[i].num_prompt_tokens = len;
  }
  const std::vector<std::vector<int>> plan = {
      {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}, {1, 3}, {4, 2, 0, 3, 1}};
  size_t calls_before = 0;
  for (size_t step_index = 0; step_index < plan.size(); ++step_index) {
    SCOPED_TRACE(::testing::Message() << "step " << step_index);
    SchedulerStep step;
    for (int i : plan[step_index]) ASSERT_TRUE(testing::ScheduleRest(blocks, seqs[i], step).ok());
    auto want = (*plain)->Execute(step);
    ASSERT_TRUE(want.ok()) << want.status();
    const std::vector<float> expected(want->begin(), want->end());
    auto got = (*added)->Execute(step);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->size(), expected.size());
    for (size_t r = 0; r < step.seqs.size(); ++r) {
      EXPECT_TRUE(std::equal(expected.begin() + r * vocab, expected.begin() + (r + 1) * vocab,
                             got->begin() + r * vocab))
          << "row " << r << " differs";
    }
    // Past 4 rows every o projection and every down projection but the last layer's (added
    // for the sampled rows only, by GatherAdd) went through LinearAdd; at 4 rows or fewer none.
    const size_t calls = adding.added().size() - calls_before;
    calls_before = adding.added().size();
    if (step.num_tokens > 4) {
      EXPECT_EQ(calls, static_cast<size_t>(2 * config.num_layers - 1));
    } else {
      EXPECT_EQ(calls, 0u);
    }
    testing::AppendGreedyTokens(step, expected, vocab);
  }
  // Every call added a hidden-wide projection (o or down) into the residual stream.
  EXPECT_FALSE(adding.added().empty());
  for (int n : adding.added()) EXPECT_EQ(n, config.hidden_size);
}

}  // namespace
}  // namespace tandem::engine
