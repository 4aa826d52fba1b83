#include "tandem/metrics/registry.h"

#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(RegistryTest, RendersHelpTypeAndLabelledSeries) {
  Registry registry;
  registry.Counter("tandem_http_responses_total", "HTTP responses.", {{"code", "200"}})
      .Increment(3);
  registry.Counter("tandem_http_responses_total", "HTTP responses.", {{"code", "404"}})
      .Increment();
  registry.Gauge("tandem_kv_cache_blocks_used", "Blocks in use.").Set(7);
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("# HELP tandem_http_responses_total HTTP responses.\n"
                              "# TYPE tandem_http_responses_total counter\n"));
  EXPECT_THAT(text, HasSubstr("\ntandem_http_responses_total{code=\"200\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("\ntandem_http_responses_total{code=\"404\"} 1\n"));
  EXPECT_THAT(text, HasSubstr("# HELP tandem_kv_cache_blocks_used Blocks in use.\n"
                              "# TYPE tandem_kv_cache_blocks_used gauge\n"
                              "tandem_kv_cache_blocks_used 7\n"));
}

TEST(RegistryTest, SameNameAndLabelsIsTheSameSeries) {
  Registry registry;
  prometheus::Counter& a = registry.Counter("tandem_x_total", "x", {{"k", "v"}});
  prometheus::Counter& b = registry.Counter("tandem_x_total", "x", {{"k", "v"}});
  EXPECT_EQ(&a, &b);
  EXPECT_NE(&a, &registry.Counter("tandem_x_total", "x", {{"k", "w"}}));
}

TEST(RegistryTest, ARemovedGaugeSeriesIsNoLongerRendered) {
  Registry registry;
  registry.Gauge("tandem_index_blocks", "Blocks.", {{"worker", "a"}}).Set(3);
  registry.Gauge("tandem_index_blocks", "Blocks.", {{"worker", "b"}}).Set(4);
  registry.RemoveGauge("tandem_index_blocks", {{"worker", "a"}});
  registry.RemoveGauge("tandem_index_blocks", {{"worker", "never"}});  // nothing to remove
  registry.RemoveGauge("tandem_no_such_family", {});
  const std::string text = registry.Render();
  EXPECT_THAT(text, Not(HasSubstr("worker=\"a\"")));
  EXPECT_THAT(text, HasSubstr("\ntandem_index_blocks{worker=\"b\"} 4\n"));
  // Registered again, it starts afresh.
  registry.Gauge("tandem_index_blocks", "Blocks.", {{"worker", "a"}}).Set(1);
  EXPECT_THAT(registry.Render(), HasSubstr("\ntandem_index_blocks{worker=\"a\"} 1\n"));
}

TEST(RegistryTest, ANameDefinedTwiceDifferentlyIsABug) {
  Registry registry;
  registry.Gauge("tandem_y", "One meaning.");
  EXPECT_DEATH(registry.Gauge("tandem_y", "Another meaning."), "registered as gauge");
  EXPECT_DEATH(registry.Counter("tandem_y", "One meaning."), "registered as gauge");
}

TEST(RegistryTest, HistogramBucketsAreCumulativeWithSumAndCount) {
  Registry registry;
  prometheus::Histogram& h = registry.Histogram("tandem_latency_seconds", "Latency.", {0.1, 1.0});
  h.Observe(0.05);
  h.Observe(0.1);  // on the bound: counts in that bucket (le is inclusive)
  h.Observe(0.5);
  h.Observe(30);
  const std::string text = registry.Render();
  EXPECT_THAT(text, HasSubstr("# TYPE tandem_latency_seconds histogram\n"));
  EXPECT_THAT(text, HasSubstr("tandem_latency_seconds_bucket{le=\"0.1\"} 2\n"));
  EXPECT_THAT(text, HasSubstr("tandem_latency_seconds_bucket{le=\"1\"} 3\n"));
  EXPECT_THAT(text, HasSubstr("tandem_latency_seconds_bucket{le=\"+Inf\"} 4\n"));
  EXPECT_THAT(text, HasSubstr("tandem_latency_seconds_sum 30.65\n"));
  EXPECT_THAT(text, HasSubstr("tandem_latency_seconds_count 4\n"));
}

TEST(RegistryTest, LabelValuesAreEscaped) {
  Registry registry;
  registry.Gauge("tandem_g", "g", {{"v", "a\"b\\c\nd"}}).Set(1);
  EXPECT_THAT(registry.Render(), HasSubstr("tandem_g{v=\"a\\\"b\\\\c\\nd\"} 1\n"));
}

TEST(RegistryTest, CounterAdvancesToATotalButNeverGoesDown) {
  Registry registry;
  prometheus::Counter& c = registry.Counter("tandem_c_total", "c");
  c.Increment(5);
  AdvanceTo(c, 2);
  EXPECT_EQ(c.Value(), 5);
  AdvanceTo(c, 9);
  EXPECT_EQ(c.Value(), 9);
}

TEST(RegistryTest, ConcurrentRegistrationAndIncrementsAreAllCounted) {
  Registry registry;
  {
    std::vector<std::jthread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        prometheus::Counter& c = registry.Counter("tandem_n_total", "n");
        for (int i = 0; i < 10000; ++i) c.Increment();
        (void)registry.Render();
      });
    }
  }
  EXPECT_THAT(registry.Render(), HasSubstr("\ntandem_n_total 40000\n"));
}

}  // namespace
}  // namespace tandem::metrics
