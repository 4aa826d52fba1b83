// A small Prometheus metrics registry: counters, gauges and histograms with labels, rendered
// in the text exposition format (version 0.0.4) with HELP and TYPE lines.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace tandem::router {

// Label names and values of one series, e.g. {{"code", "200"}}. Order is kept as given.
using Labels = std::vector<std::pair<std::string, std::string>>;

// A value that only goes up. Thread-safe.
class Counter {
 public:
  void Increment(double amount = 1.0);
  // Mirrors a cumulative count kept elsewhere (e.g. the engine's preemptions): the value
  // becomes `total` unless that would make it go down.
  void AdvanceTo(double total);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down. Thread-safe.
class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double amount);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

// Observations counted into fixed buckets (upper bounds, ascending), plus their sum. Thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double value);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // per bound, then one more for +Inf (== count)
    double sum = 0.0;
  };
  Snapshot snapshot() const;

 private:
  std::vector<double> bounds_;
  mutable std::mutex mu_;
  std::vector<uint64_t> counts_;  // guarded by mu_; one per bound plus +Inf
  double sum_ = 0.0;              // guarded by mu_
};

// Owns every metric of a process and renders them. Metrics are registered once (at startup)
// and live as long as the registry; the returned pointers are owned by it.
//   MetricsRegistry registry;
//   Counter* tokens = registry.AddCounter("tandem_prompt_tokens_total", "Prompt tokens.");
//   tokens->Increment(12);
//   std::string text = registry.Render();
class MetricsRegistry {
 public:
  // The content type of Render()'s output.
  static constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

  // Each call with the same name returns the series with these labels in one family; name
  // and help must be the same for every call with that name.
  Counter* AddCounter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge* AddGauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram* AddHistogram(const std::string& name, const std::string& help,
                          std::vector<double> bounds, const Labels& labels = {});

  // Every family in registration order, each with its HELP and TYPE lines.
  std::string Render() const;

 private:
  struct Series {
    Labels labels;
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Gauge> gauge;
    std::unique_ptr<Histogram> histogram;
  };
  struct Family {
    std::string name;
    std::string help;
    std::string type;  // "counter", "gauge" or "histogram"
    std::vector<std::unique_ptr<Series>> series;
  };
  Series* FindOrAdd(const std::string& name, const std::string& help, const std::string& type,
                    const Labels& labels);

  mutable std::mutex mu_;
  std::vector<std::unique_ptr<Family>> families_;  // guarded by mu_
};

// Bucket bounds for latencies in seconds, from 1 ms to 2 minutes.
std::vector<double> LatencyBuckets();

}  // namespace tandem::router
