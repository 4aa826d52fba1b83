#include "tandem/metrics/registry.h"

#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "prometheus/family.h"
#include "prometheus/text_serializer.h"

namespace tandem::metrics {

struct Registry::Family {
  std::string help;
  std::string type;
  prometheus::Family<prometheus::Counter>* counters = nullptr;
  prometheus::Family<prometheus::Gauge>* gauges = nullptr;
  prometheus::Family<prometheus::Histogram>* histograms = nullptr;
};

Registry::Registry() : registry_(std::make_shared<prometheus::Registry>()) {}
Registry::~Registry() = default;

Registry::Family& Registry::FamilyFor(const std::string& name, const std::string& help,
                                      const char* type) {
  auto [it, inserted] = families_.try_emplace(name);
  if (inserted) {
    it->second = std::make_unique<Family>();
    it->second->help = help;
    it->second->type = type;
    return *it->second;
  }
  Family& family = *it->second;
  if (family.type != type || family.help != help) {
    // Each metric is defined once; two definitions that disagree are a bug to fix, not to
    // serve.
    std::fprintf(stderr, "tandem: metric %s registered as %s \"%s\" and as %s \"%s\"\n",
                 name.c_str(), family.type.c_str(), family.help.c_str(), type, help.c_str());
    std::abort();
  }
  return family;
}

prometheus::Counter& Registry::Counter(const std::string& name, const std::string& help,
                                       const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& family = FamilyFor(name, help, "counter");
  if (family.counters == nullptr) {
    family.counters = &prometheus::BuildCounter().Name(name).Help(help).Register(*registry_);
  }
  return family.counters->Add(labels);
}

prometheus::Gauge& Registry::Gauge(const std::string& name, const std::string& help,
                                   const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& family = FamilyFor(name, help, "gauge");
  if (family.gauges == nullptr) {
    family.gauges = &prometheus::BuildGauge().Name(name).Help(help).Register(*registry_);
  }
  return family.gauges->Add(labels);
}

void Registry::RemoveGauge(const std::string& name, const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = families_.find(name);
  if (it == families_.end() || it->second->gauges == nullptr) return;
  prometheus::Family<prometheus::Gauge>& gauges = *it->second->gauges;
  if (gauges.Has(labels)) gauges.Remove(&gauges.Add(labels));
}

prometheus::Histogram& Registry::Histogram(const std::string& name, const std::string& help,
                                           const std::vector<double>& bounds,
                                           const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Family& family = FamilyFor(name, help, "histogram");
  if (family.histograms == nullptr) {
    family.histograms = &prometheus::BuildHistogram().Name(name).Help(help).Register(*registry_);
  }
  // A series that exists keeps its buckets (Add ignores the bounds then).
  return family.histograms->Add(labels, prometheus::Histogram::BucketBoundaries(bounds));
}

std::string Registry::Render() const {
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, registry_->Collect());
  return out.str();
}

void AdvanceTo(prometheus::Counter& counter, double total) {
  const double now = counter.Value();
  if (total > now) counter.Increment(total - now);
}

std::vector<double> LatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,  0.25, 0.5,
          0.75,  1.0,    2.5,   5.0,  7.5,   10.0, 20.0,  40.0, 80.0, 120.0};
}

}  // namespace tandem::metrics
