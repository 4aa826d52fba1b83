#include "tandem/engine/step_latency_model.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::engine {
namespace {

struct Truth {
  double a, b, c, d;
  double operator()(int64_t tokens, int64_t seqs, int64_t context) const {
    return a + b * tokens + c * seqs + d * context;
  }
};

// Feeds `n` steps of varied shapes (tokens, sequences and context vary independently).
void Feed(StepLatencyModel& model, const Truth& truth, int n, std::mt19937& rng, double noise = 0) {
  std::uniform_int_distribution<int> seqs_dist(1, 64);
  std::uniform_int_distribution<int> extra_tokens(0, 448);
  std::uniform_int_distribution<int> context_per_seq(16, 2048);
  std::normal_distribution<double> jitter(0, noise);
  for (int i = 0; i < n; ++i) {
    const int seqs = seqs_dist(rng);
    const int tokens = seqs + extra_tokens(rng);
    const int64_t context = static_cast<int64_t>(seqs) * context_per_seq(rng);
    double t = truth(tokens, seqs, context);
    if (noise > 0) t *= 1 + jitter(rng);
    model.Observe(tokens, seqs, context, t);
  }
}

TEST(StepLatencyModelTest, RecoversKnownCoefficients) {
  const Truth truth{2e-3, 40e-6, 150e-6, 0.2e-6};
  StepLatencyModel model;
  std::mt19937 rng(1);
  EXPECT_FALSE(model.ready());
  Feed(model, truth, 100, rng);
  ASSERT_TRUE(model.ready());
  const auto& coef = model.coefficients();
  EXPECT_NEAR(coef.intercept, truth.a, truth.a * 0.01);
  EXPECT_NEAR(coef.per_token, truth.b, truth.b * 0.01);
  EXPECT_NEAR(coef.per_seq, truth.c, truth.c * 0.01);
  EXPECT_NEAR(coef.per_context_token, truth.d, truth.d * 0.01);
  EXPECT_NEAR(model.Predict(256, 32, 32000), truth(256, 32, 32000), truth(256, 32, 32000) * 0.01);
  EXPECT_LT(model.error_ratio(), 0.01);
}

TEST(StepLatencyModelTest, FitsNoisySamplesWithinTheNoise) {
  const Truth truth{5e-3, 20e-6, 300e-6, 0.1e-6};
  StepLatencyModel model;
  std::mt19937 rng(2);
  Feed(model, truth, 256, rng, /*noise=*/0.05);
  for (auto [tokens, seqs, context] : {std::tuple{64, 64, 64000}, {512, 1, 512}, {300, 20, 9000}}) {
    const double want = truth(tokens, seqs, context);
    EXPECT_NEAR(model.Predict(tokens, seqs, context), want, want * 0.05);
  }
  EXPECT_LT(model.error_ratio(), 0.1);
}

TEST(StepLatencyModelTest, AdaptsAfterAShift) {
  const Truth before{2e-3, 40e-6, 150e-6, 0.2e-6};
  const Truth after{6e-3, 80e-6, 400e-6, 0.5e-6};  // e.g. another engine now shares the cores
  StepLatencyModel model;
  std::mt19937 rng(3);
  Feed(model, before, 300, rng);
  Feed(model, after, 100, rng);
  // Recent samples weigh most: most of the way after 100 steps, exact once the old ones are
  // gone.
  const double want = after(128, 64, 64000);
  const double was = before(128, 64, 64000);
  EXPECT_LT(std::abs(model.Predict(128, 64, 64000) - want), 0.5 * (want - was));
  Feed(model, after, 300, rng);
  EXPECT_NEAR(model.Predict(128, 64, 64000), want, want * 0.01);
  EXPECT_NEAR(model.coefficients().per_seq, after.c, after.c * 0.01);
}

TEST(StepLatencyModelTest, DecodeOnlyShapesStillPredictDecodeSteps) {
  // A decode engine runs one token per sequence: tokens and sequences never differ, so only
  // their sum is identifiable; predictions for decode steps must still be right.
  const Truth truth{3e-3, 50e-6, 100e-6, 0.3e-6};
  StepLatencyModel model;
  std::mt19937 rng(4);
  std::uniform_int_distribution<int> seqs_dist(1, 48);
  for (int i = 0; i < 200; ++i) {
    const int n = seqs_dist(rng);
    const int64_t context = static_cast<int64_t>(n) * (100 + i * 5);
    model.Observe(n, n, context, truth(n, n, context));
  }
  for (int n : {1, 16, 64}) {
    const double want = truth(n, n, n * 1000);
    EXPECT_NEAR(model.Predict(n, n, n * 1000), want, want * 0.02) << n;
  }
}

// A model that has seen exact decode steps of `truth`.
StepLatencyModel Trained(const Truth& truth) {
  StepLatencyModel model;
  std::mt19937 rng(5);
  Feed(model, truth, 64, rng);
  return model;
}

TEST(DecodeBatchLimitTest, MaxUntilTheModelIsReady) {
  StepLatencyModel model;
  std::vector<int64_t> contexts(10, 1000);
  EXPECT_EQ(DecodeBatchLimit(model, contexts, 64, 1e-6), 64);
  model.Observe(1, 1, 1, 1.0);
  EXPECT_EQ(DecodeBatchLimit(model, contexts, 64, 1e-6), 64);
}

TEST(DecodeBatchLimitTest, LargestBatchUnderTheTarget) {
  // 10 ms + 1 ms per sequence, contexts free: 25 ms fits 15 sequences.
  const Truth truth{10e-3, 0.5e-3, 0.5e-3, 0};
  StepLatencyModel model = Trained(truth);
  std::vector<int64_t> contexts(40, 500);
  EXPECT_EQ(DecodeBatchLimit(model, contexts, 64, 25.5e-3), 15);
  EXPECT_EQ(DecodeBatchLimit(model, contexts, 64, 1.0), 64);    // everything fits
  EXPECT_EQ(DecodeBatchLimit(model, contexts, 64, 1e-3), 1);    // never below one
  EXPECT_EQ(DecodeBatchLimit(model, contexts, 8, 25.5e-3), 8);  // never above max_num_seqs
}

TEST(DecodeBatchLimitTest, LowersTheCapWhenStepsGetSlower) {
  // The controller's loop in small: steps measured slower than before (longer contexts, or
  // other work on the cores) make the same target fit fewer sequences.
  const Truth fast{5e-3, 0.25e-3, 0.25e-3, 0.1e-6};
  const Truth slow{10e-3, 0.5e-3, 0.5e-3, 0.2e-6};
  StepLatencyModel model = Trained(fast);
  std::vector<int64_t> contexts(64, 1000);
  const int before = DecodeBatchLimit(model, contexts, 64, 20e-3);
  std::mt19937 rng(6);
  Feed(model, slow, 300, rng);
  const int after = DecodeBatchLimit(model, contexts, 64, 20e-3);
  EXPECT_LT(after, before);
  // The cap's predicted step is under the target, one more sequence's is over.
  int64_t context = 1000LL * after;
  EXPECT_LE(model.Predict(after, after, context), 20e-3);
  EXPECT_GT(model.Predict(after + 1, after + 1, context + 1000), 20e-3);
  // Longer contexts (the running sequences have generated more) lower it further.
  std::vector<int64_t> longer(64, 20000);
  EXPECT_LT(DecodeBatchLimit(model, longer, 64, 20e-3), after);
}

TEST(PrefillTokenBudgetTest, LargestBudgetUnderTheTarget) {
  // 10 ms + 0.1 ms per token: 40 ms fits 300 tokens, rounded down to a multiple of 16.
  const Truth truth{10e-3, 0.1e-3, 0, 0};
  StepLatencyModel model = Trained(truth);
  EXPECT_EQ(PrefillTokenBudget(model, 512, 16, 16, 40e-3), 288);
  EXPECT_EQ(PrefillTokenBudget(model, 512, 16, 16, 1.0), 512);
  EXPECT_EQ(PrefillTokenBudget(model, 512, 16, 16, 1e-3), 16);
  StepLatencyModel fresh;
  EXPECT_EQ(PrefillTokenBudget(fresh, 512, 16, 16, 1e-3), 512);
}

TEST(FitStepCoefficientsTest, WeightsNonNegativityAndTermsNoStepSeparates) {
  // Steps whose time falls with the sequence count: plain least squares fits a negative cost
  // per sequence, the non-negative fit (the planner's) fixes it at 0 and refits the rest.
  std::vector<StepObservation> steps;
  for (int seqs = 1; seqs <= 8; ++seqs) {
    for (int tokens : {64, 128, 256}) {
      steps.push_back({static_cast<double>(tokens), static_cast<double>(seqs), 0,
                       1e-3 + 1e-5 * tokens - 1e-5 * seqs});
    }
  }
  auto plain = FitStepCoefficients(steps, {});
  ASSERT_TRUE(plain.has_value());
  EXPECT_NEAR(plain->per_seq, -1e-5, 1e-9);
  EXPECT_EQ(plain->per_context_token, 0);  // no step read any context
  auto non_negative = FitStepCoefficients(steps, {.non_negative = true});
  ASSERT_TRUE(non_negative.has_value());
  EXPECT_EQ(non_negative->per_seq, 0);
  EXPECT_GT(non_negative->per_token, 0);
  // Weights: a step with weight 0 does not count; none with a positive weight is no fit.
  std::vector<StepObservation> weighted = {
      {10, 1, 0, 1.0, 1}, {20, 1, 0, 2.0, 1}, {30, 1, 0, 100.0, 0}};
  auto fit = FitStepCoefficients(weighted, {});
  ASSERT_TRUE(fit.has_value());
  EXPECT_NEAR(fit->Seconds(30, 1, 0), 3.0, 1e-9);
  for (auto& s : weighted) s.weight = 0;
  EXPECT_FALSE(FitStepCoefficients(weighted, {}).has_value());
  EXPECT_FALSE(FitStepCoefficients({}, {}).has_value());
}

}  // namespace
}  // namespace tandem::engine
