#include "tandem/tools/load_generator.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "gtest/gtest.h"

namespace tandem::tools {
namespace {

TEST(PercentileTest, KnownSamples) {
  const std::vector<double> samples = {5, 1, 4, 2, 3};  // unsorted on purpose
  EXPECT_DOUBLE_EQ(Percentile(samples, 0), 1);
  EXPECT_DOUBLE_EQ(Percentile(samples, 50), 3);
  EXPECT_DOUBLE_EQ(Percentile(samples, 100), 5);
  EXPECT_DOUBLE_EQ(Percentile(samples, 90), 4.6);  // rank 3.6: 4 + 0.6 * (5 - 4)
  EXPECT_DOUBLE_EQ(Percentile(samples, 25), 2);
  EXPECT_DOUBLE_EQ(Percentile({}, 50), 0);
  EXPECT_DOUBLE_EQ(Percentile({7}, 99), 7);

  std::vector<double> hundred(101);
  std::iota(hundred.begin(), hundred.end(), 0.0);  // 0..100
  const MetricSummary s = Summarize(hundred);
  EXPECT_DOUBLE_EQ(s.mean, 50);
  EXPECT_DOUBLE_EQ(s.p50, 50);
  EXPECT_DOUBLE_EQ(s.p90, 90);
  EXPECT_DOUBLE_EQ(s.p99, 99);
}

// Mean and coefficient of variation of the gaps between consecutive arrivals.
std::pair<double, double> GapStats(const std::vector<double>& times) {
  std::vector<double> gaps;
  for (size_t i = 1; i < times.size(); ++i) gaps.push_back(times[i] - times[i - 1]);
  double mean = std::accumulate(gaps.begin(), gaps.end(), 0.0) / gaps.size();
  double var = 0;
  for (double g : gaps) var += (g - mean) * (g - mean);
  var /= gaps.size();
  return {mean, std::sqrt(var) / mean};
}

TEST(ArrivalTimesTest, PoissonMeanGapIsInverseRate) {
  const std::vector<double> t = ArrivalTimes(200001, /*rate=*/4.0, /*burstiness=*/1.0, 7);
  ASSERT_EQ(t.size(), 200001u);
  EXPECT_EQ(t[0], 0);
  for (size_t i = 1; i < t.size(); ++i) ASSERT_GE(t[i], t[i - 1]);
  auto [mean, cv] = GapStats(t);
  EXPECT_NEAR(mean, 0.25, 0.25 * 0.01);
  EXPECT_NEAR(cv, 1.0, 0.02);  // exponential gaps
}

TEST(ArrivalTimesTest, GammaCvIsInverseSqrtBurstiness) {
  for (double b : {0.25, 4.0}) {
    auto [mean, cv] = GapStats(ArrivalTimes(200001, 10.0, b, 11));
    EXPECT_NEAR(mean, 0.1, 0.1 * 0.02) << "burstiness " << b;
    EXPECT_NEAR(cv, 1.0 / std::sqrt(b), 0.05 / std::sqrt(b)) << "burstiness " << b;
  }
}

TEST(ArrivalTimesTest, InfiniteRateSendsAllAtOnce) {
  for (double t : ArrivalTimes(10, INFINITY, 1.0, 0)) EXPECT_EQ(t, 0);
  for (double t : ArrivalTimes(10, 0, 1.0, 0)) EXPECT_EQ(t, 0);
  EXPECT_EQ(ArrivalTimes(10, 5, 1.0, 3), ArrivalTimes(10, 5, 1.0, 3));  // seeded
}

RequestRecord Record(bool success, double ttft, double e2e, int64_t tokens) {
  RequestRecord r;
  r.success = success;
  r.ttft = ttft;
  r.e2e = e2e;
  r.output_tokens = tokens;
  return r;
}

TEST(SloTest, AttainmentAndGoodputOnHandMadeSet) {
  const std::vector<RequestRecord> records = {
      Record(true, 0.1, 1.1, 11),  // tpot 0.1: meets both
      Record(true, 0.5, 1.5, 11),  // ttft misses
      Record(true, 0.1, 3.1, 11),  // tpot 0.3 misses
      Record(true, 0.2, 0.2, 1),   // one token: tpot 0, meets both
      Record(false, 0.0, 0.1, 0),  // failed: misses
  };
  EXPECT_DOUBLE_EQ(records[0].Tpot(), 0.1);
  EXPECT_DOUBLE_EQ(SloAttainment(records, 0.3, 0.15), 2.0 / 5.0);
  EXPECT_DOUBLE_EQ(Goodput(records, 4.0, 0.3, 0.15), 0.5);
  EXPECT_DOUBLE_EQ(SloAttainment(records, 1.0, 1.0), 4.0 / 5.0);
  EXPECT_DOUBLE_EQ(SloAttainment({}, 1.0, 1.0), 0);
  EXPECT_DOUBLE_EQ(Goodput(records, 0, 1.0, 1.0), 0);
}

TEST(SyntheticRequestsTest, FixedLengths) {
  const std::vector<BenchRequest> r = SyntheticRequests(16, 8, 3, 1);
  ASSERT_EQ(r.size(), 3u);
  for (const BenchRequest& q : r) {
    EXPECT_EQ(std::count(q.prompt.begin(), q.prompt.end(), ' '), 15);
    EXPECT_EQ(q.max_tokens, 8);
  }
}

TEST(RunLoadTest, ConnectionRefusedIsAFailedRequest) {
  LoadConfig config;
  config.url = "http://127.0.0.1:1";
  config.model = "m";
  absl::StatusOr<BenchResult> result = RunLoad(config, SyntheticRequests(4, 4, 2, 0));
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->records.size(), 2u);
  for (const RequestRecord& r : result->records) {
    EXPECT_FALSE(r.success);
    EXPECT_NE(r.error.find("cannot connect"), std::string::npos) << r.error;
  }
  config.url = "https://x";
  EXPECT_FALSE(RunLoad(config, {}).ok());
}

}  // namespace
}  // namespace tandem::tools
