#include "tandem/router/metrics.h"

#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::router {
namespace {

using ::testing::HasSubstr;

TEST(MetricsRegistryTest, RendersHelpTypeAndLabelledSeries) {
  MetricsRegistry registry;
  registry.AddCounter("tandem_http_responses_total", "HTTP responses.", {{"code", "200"}})
      ->Increment(3);
  registry.AddCounter("tandem_http_responses_total", "HTTP responses.", {{"code", "404"}})
      ->Increment();
  registry.AddGauge("tandem_kv_cache_blocks_used", "Blocks in use.")->Set(7);
  const std::string text = registry.Render();
  EXPECT_EQ(text,
            "# HELP tandem_http_responses_total HTTP responses.\n"
            "# TYPE tandem_http_responses_total counter\n"
            "tandem_http_responses_total{code=\"200\"} 3\n"
            "tandem_http_responses_total{code=\"404\"} 1\n"
            "# HELP tandem_kv_cache_blocks_used Blocks in use.\n"
            "# TYPE tandem_kv_cache_blocks_used gauge\n"
            "tandem_kv_cache_blocks_used 7\n");
}

TEST(MetricsRegistryTest, SameNameAndLabelsIsTheSameSeries) {
  MetricsRegistry registry;
  Counter* a = registry.AddCounter("tandem_x_total", "x", {{"k", "v"}});
  Counter* b = registry.AddCounter("tandem_x_total", "x", {{"k", "v"}});
  EXPECT_EQ(a, b);
}

TEST(MetricsRegistryTest, HistogramBucketsAreCumulativeWithSumAndCount) {
  MetricsRegistry registry;
  Histogram* h = registry.AddHistogram("tandem_latency_seconds", "Latency.", {0.1, 1.0});
  h->Observe(0.05);
  h->Observe(0.1);  // on the bound: counts in that bucket (le is inclusive)
  h->Observe(0.5);
  h->Observe(30);
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("# TYPE tandem_latency_seconds histogram\n"));
  EXPECT_THAT(text, HasSubstr("tandem_latency_seconds_bucket{le=\"0.10000000000000001\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("tandem_latency_seconds_bucket{le=\"1\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("tandem_latency_seconds_bucket{le=\"+Inf\"} 4\n"));
  EXPECT_THAT(text, HasSubstr("tandem_latency_seconds_sum 30.649999999999999\n"));
  EXPECT_THAT(text, HasSubstr("tandem_latency_seconds_count 4\n"));
}

TEST(MetricsRegistryTest, LabelValuesAreEscaped) {
  MetricsRegistry registry;
  registry.AddGauge("tandem_g", "g", {{"v", "a\"b\\c\nd"}})->Set(1);
  EXPECT_THAT(registry.Render(), HasSubstr("tandem_g{v=\"a\\\"b\\\\c\\nd\"} 1\n"));
}

TEST(CounterTest, NeverGoesDown) {
  Counter c;
  c.Increment(5);
  c.Increment(-3);
  c.AdvanceTo(2);
  EXPECT_EQ(c.value(), 5);
  c.AdvanceTo(9);
  EXPECT_EQ(c.value(), 9);
}

TEST(CounterTest, ConcurrentIncrementsAreAllCounted) {
  Counter c;
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        for (int i = 0; i < 10000; ++i) c.Increment();
      });
    }
  }
  EXPECT_EQ(c.value(), 40000);
}

}  // namespace
}  // namespace tandem::router
