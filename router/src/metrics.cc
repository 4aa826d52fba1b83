#include "tandem/router/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "tandem/base/status_macros.h"

namespace tandem::router {
namespace {

// Prometheus reads Go float syntax: integers print exactly, others with full precision.
std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 9.007199254740992e15) {
    std::snprintf(buf, sizeof(buf), "%.0f", v);
  } else {
    std::snprintf(buf, sizeof(buf), "%.17g", v);
  }
  return buf;
}

std::string EscapeLabelValue(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string EscapeHelp(const std::string& help) {
  std::string out;
  for (char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// `{a="x",b="y"}` with `extra` appended (a histogram's `le`), or "" when there are no labels.
std::string FormatLabels(const Labels& labels, const std::pair<std::string, std::string>* extra) {
  if (labels.empty() && extra == nullptr) return "";
  std::string out = "{";
  bool first = true;
  auto add = [&](const std::pair<std::string, std::string>& l) {
    if (!first) out += ",";
    first = false;
    out += l.first + "=\"" + EscapeLabelValue(l.second) + "\"";
  };
  for (const auto& l : labels) add(l);
  if (extra != nullptr) add(*extra);
  out += "}";
  return out;
}

void AtomicAdd(std::atomic<double>& target, double amount) {
  double old = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(old, old + amount, std::memory_order_relaxed)) {
  }
}

}  // namespace

void Counter::Increment(double amount) {
  if (!(amount > 0)) return;  // a counter never goes down, and NaN is never counted
  AtomicAdd(value_, amount);
}

void Counter::AdvanceTo(double total) {
  double old = value_.load(std::memory_order_relaxed);
  while (total > old && !value_.compare_exchange_weak(old, total, std::memory_order_relaxed)) {
  }
}

void Gauge::Add(double amount) { AtomicAdd(value_, amount); }

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  std::sort(bounds_.begin(), bounds_.end());
  counts_.assign(bounds_.size() + 1, 0);
}

void Histogram::Observe(double value) {
  if (std::isnan(value)) return;
  size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_[bucket];
  sum_ += value;
}

Histogram::Snapshot Histogram::snapshot() const {
  Snapshot s;
  s.bounds = bounds_;
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t running = 0;
  for (uint64_t c : counts_) {
    running += c;
    s.cumulative.push_back(running);
  }
  s.sum = sum_;
  return s;
}

MetricsRegistry::Series* MetricsRegistry::FindOrAdd(const std::string& name,
                                                    const std::string& help,
                                                    const std::string& type, const Labels& labels) {
  std::lock_guard<std::mutex> lock(mu_);
  Family* family = nullptr;
  for (auto& f : families_) {
    if (f->name == name) family = f.get();
  }
  if (family == nullptr) {
    families_.push_back(std::make_unique<Family>(Family{name, help, type, {}}));
    family = families_.back().get();
  }
  TANDEM_CHECK(family->type == type)
      << "metric " << name << " registered as " << family->type << " and as " << type;
  for (auto& s : family->series) {
    if (s->labels == labels) return s.get();
  }
  family->series.push_back(std::make_unique<Series>());
  family->series.back()->labels = labels;
  return family->series.back().get();
}

Counter* MetricsRegistry::AddCounter(const std::string& name, const std::string& help,
                                     const Labels& labels) {
  Series* s = FindOrAdd(name, help, "counter", labels);
  std::lock_guard<std::mutex> lock(mu_);
  if (!s->counter) s->counter = std::make_unique<Counter>();
  return s->counter.get();
}

Gauge* MetricsRegistry::AddGauge(const std::string& name, const std::string& help,
                                 const Labels& labels) {
  Series* s = FindOrAdd(name, help, "gauge", labels);
  std::lock_guard<std::mutex> lock(mu_);
  if (!s->gauge) s->gauge = std::make_unique<Gauge>();
  return s->gauge.get();
}

Histogram* MetricsRegistry::AddHistogram(const std::string& name, const std::string& help,
                                         std::vector<double> bounds, const Labels& labels) {
  Series* s = FindOrAdd(name, help, "histogram", labels);
  std::lock_guard<std::mutex> lock(mu_);
  if (!s->histogram) s->histogram = std::make_unique<Histogram>(std::move(bounds));
  return s->histogram.get();
}

std::string MetricsRegistry::Render() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (const auto& f : families_) {
    out += "# HELP " + f->name + " " + EscapeHelp(f->help) + "\n";
    out += "# TYPE " + f->name + " " + f->type + "\n";
    for (const auto& s : f->series) {
      if (s->counter) {
        out += f->name + FormatLabels(s->labels, nullptr) + " " + FormatValue(s->counter->value()) +
               "\n";
      } else if (s->gauge) {
        out += f->name + FormatLabels(s->labels, nullptr) + " " + FormatValue(s->gauge->value()) +
               "\n";
      } else if (s->histogram) {
        Histogram::Snapshot snap = s->histogram->snapshot();
        for (size_t i = 0; i <= snap.bounds.size(); ++i) {
          std::pair<std::string, std::string> le{
              "le", i < snap.bounds.size() ? FormatValue(snap.bounds[i]) : "+Inf"};
          out += f->name + "_bucket" + FormatLabels(s->labels, &le) + " " +
                 FormatValue(static_cast<double>(snap.cumulative[i])) + "\n";
        }
        out += f->name + "_sum" + FormatLabels(s->labels, nullptr) + " " + FormatValue(snap.sum) +
               "\n";
        out += f->name + "_count" + FormatLabels(s->labels, nullptr) + " " +
               FormatValue(static_cast<double>(snap.cumulative.back())) + "\n";
      }
    }
  }
  return out;
}

std::vector<double> LatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,  0.25, 0.5,
          0.75,  1.0,    2.5,   5.0,  7.5,   10.0, 20.0,  40.0, 80.0, 120.0};
}

}  // namespace tandem::router
