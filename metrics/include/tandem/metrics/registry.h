// Tandem's Prometheus metrics: a registry on prometheus-cpp's core (families, series, the text
// exposition format), served by Tandem's own HTTP server.
//
//   metrics::Registry registry;
//   prometheus::Counter& tokens =
//       registry.Counter("tandem_prompt_tokens_total", "Prompt tokens processed.");
//   tokens.Increment(12);
//   std::string text = registry.Render();  // for GET /metrics
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/labels.h"
#include "prometheus/registry.h"

namespace tandem::metrics {

// Label names and values of one series, e.g. {{"code", "OK"}}.
using Labels = prometheus::Labels;

// Every metric family of a process. A name is one family: registering it again (the same
// type and help text) adds or returns a series of that family; another type or help text for
// a name is a programming error and aborts. Series live as long as the registry, or until
// RemoveGauge removes them. Thread-safe.
class Registry {
 public:
  // The content type of Render()'s output.
  static constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

  Registry();
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  prometheus::Counter& Counter(const std::string& name, const std::string& help,
                               const Labels& labels = {});
  prometheus::Gauge& Gauge(const std::string& name, const std::string& help,
                           const Labels& labels = {});
  // Drops one gauge series (a worker that left); a reference to it from Gauge() dangles after.
  // Nothing happens when there is no such series.
  void RemoveGauge(const std::string& name, const Labels& labels);
  // `bounds`: the buckets' upper bounds, ascending (+Inf is implied). Every series of a
  // family has the family's bounds.
  prometheus::Histogram& Histogram(const std::string& name, const std::string& help,
                                   const std::vector<double>& bounds, const Labels& labels = {});

  // Every family in the text exposition format (version 0.0.4), with HELP and TYPE lines.
  std::string Render() const;

 private:
  struct Family;
  Family& FamilyFor(const std::string& name, const std::string& help, const char* type);

  std::shared_ptr<prometheus::Registry> registry_;
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<Family>> families_;  // guarded by mu_
};

// Moves a counter up to `total`, a cumulative count kept elsewhere (an engine's preemptions);
// never down.
void AdvanceTo(prometheus::Counter& counter, double total);

// Bucket bounds for latencies in seconds, from 1 ms to 2 minutes.
std::vector<double> LatencyBuckets();

}  // namespace tandem::metrics
