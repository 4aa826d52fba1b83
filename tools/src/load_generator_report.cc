// Load generator results: per-request statistics, SLO attainment and goodput, the report
// (JSON, tables, progress line) and its plots.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tandem/tools/load_generator.h"
#include "tandem/tools/svg_plot.h"

namespace tandem::tools {
namespace {

using json = nlohmann::json;

}  // namespace

double RequestRecord::Tpot() const {
  if (output_tokens < 2) return 0;
  return (e2e - ttft) / static_cast<double>(output_tokens - 1);
}

double Percentile(std::vector<double> samples, double p) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const double rank = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(samples.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, samples.size() - 1);
  return samples[lo] + (samples[hi] - samples[lo]) * (rank - static_cast<double>(lo));
}

MetricSummary Summarize(const std::vector<double>& samples) {
  MetricSummary s;
  if (samples.empty()) return s;
  double sum = 0;
  for (double v : samples) sum += v;
  s.mean = sum / static_cast<double>(samples.size());
  s.p50 = Percentile(samples, 50);
  s.p90 = Percentile(samples, 90);
  s.p99 = Percentile(samples, 99);
  return s;
}

namespace {
int64_t MeetingSlos(const std::vector<RequestRecord>& records, double ttft_slo, double tpot_slo) {
  int64_t good = 0;
  for (const RequestRecord& r : records) {
    if (r.success && r.ttft <= ttft_slo && r.Tpot() <= tpot_slo) ++good;
  }
  return good;
}
}  // namespace

double SloAttainment(const std::vector<RequestRecord>& records, double ttft_slo, double tpot_slo) {
  if (records.empty()) return 0;
  return static_cast<double>(MeetingSlos(records, ttft_slo, tpot_slo)) /
         static_cast<double>(records.size());
}

double Goodput(const std::vector<RequestRecord>& records, double duration, double ttft_slo,
               double tpot_slo) {
  if (duration <= 0) return 0;
  return static_cast<double>(MeetingSlos(records, ttft_slo, tpot_slo)) / duration;
}

json ReportJson(const BenchResult& result, double ttft_slo, double tpot_slo) {
  std::vector<double> ttft, tpot, itl, e2e;
  int64_t succeeded = 0, output_tokens = 0, prompt_tokens = 0;
  json records = json::array();
  for (const RequestRecord& r : result.records) {
    json rec = {{"success", r.success}, {"start_s", r.start}, {"e2e_ms", r.e2e * 1e3}};
    if (r.success) {
      ++succeeded;
      output_tokens += r.output_tokens;
      prompt_tokens += r.prompt_tokens;
      ttft.push_back(r.ttft * 1e3);
      e2e.push_back(r.e2e * 1e3);
      if (r.output_tokens > 1) tpot.push_back(r.Tpot() * 1e3);
      for (double g : r.itls) itl.push_back(g * 1e3);
      json itls_ms = json::array();
      for (double g : r.itls) itls_ms.push_back(g * 1e3);
      rec["ttft_ms"] = r.ttft * 1e3;
      rec["tpot_ms"] = r.Tpot() * 1e3;
      rec["itl_ms"] = itls_ms;
      rec["output_tokens"] = r.output_tokens;
      rec["prompt_tokens"] = r.prompt_tokens;
      if (!r.id.empty()) rec["id"] = r.id;
    } else {
      rec["error"] = r.error;
    }
    records.push_back(std::move(rec));
  }
  auto metric = [](const std::vector<double>& samples) {
    const MetricSummary s = Summarize(samples);
    return json{{"mean", s.mean}, {"p50", s.p50}, {"p90", s.p90}, {"p99", s.p99}};
  };
  const double d = result.duration;
  json report = {
      {"requests_sent", result.records.size()},
      {"requests_succeeded", succeeded},
      {"requests_failed", static_cast<int64_t>(result.records.size()) - succeeded},
      {"duration_s", d},
      {"request_throughput", d > 0 ? succeeded / d : 0.0},
      {"output_tokens", output_tokens},
      {"prompt_tokens", prompt_tokens},
      {"output_token_throughput", d > 0 ? output_tokens / d : 0.0},
      {"ttft_ms", metric(ttft)},
      {"tpot_ms", metric(tpot)},
      {"itl_ms", metric(itl)},
      {"e2e_ms", metric(e2e)},
  };
  if (ttft_slo > 0 && tpot_slo > 0) {
    report["slo"] = {{"ttft_s", ttft_slo},
                     {"tpot_s", tpot_slo},
                     {"attainment", SloAttainment(result.records, ttft_slo, tpot_slo)},
                     {"goodput", Goodput(result.records, d, ttft_slo, tpot_slo)}};
  }
  // Multi-turn runs: TTFT of each turn (later turns resend the history, which a prefix cache
  // holds).
  std::map<int, std::vector<double>> ttft_by_turn;
  for (const RequestRecord& r : result.records) {
    if (r.success) ttft_by_turn[r.turn].push_back(r.ttft * 1e3);
  }
  if (ttft_by_turn.size() > 1) {
    json turns = json::array();
    for (const auto& [turn, samples] : ttft_by_turn) {
      json m = metric(samples);
      m["turn"] = turn;
      m["count"] = samples.size();
      turns.push_back(std::move(m));
    }
    report["ttft_ms_by_turn"] = std::move(turns);
  }
  report["requests"] = std::move(records);
  return report;
}

std::string ReportTable(const json& report) {
  std::string out;
  auto row = [&](const std::string& name, const std::string& value) {
    absl::StrAppendFormat(&out, "%-34s %s\n", name, value);
  };
  row("Requests sent", std::to_string(report["requests_sent"].get<int64_t>()));
  row("Requests succeeded", std::to_string(report["requests_succeeded"].get<int64_t>()));
  row("Requests failed", std::to_string(report["requests_failed"].get<int64_t>()));
  row("Duration (s)", absl::StrFormat("%.3f", report["duration_s"].get<double>()));
  row("Output tokens", std::to_string(report["output_tokens"].get<int64_t>()));
  row("Request throughput (req/s)",
      absl::StrFormat("%.3f", report["request_throughput"].get<double>()));
  row("Output token throughput (tok/s)",
      absl::StrFormat("%.2f", report["output_token_throughput"].get<double>()));
  if (report.contains("slo")) {
    const json& slo = report["slo"];
    row("SLO attainment", absl::StrFormat("%.4f", slo["attainment"].get<double>()));
    row("Goodput (req/s)", absl::StrFormat("%.3f", slo["goodput"].get<double>()));
  }
  absl::StrAppendFormat(&out, "\n%-10s %12s %12s %12s %12s\n", "ms", "mean", "p50", "p90", "p99");
  for (const char* name : {"ttft", "tpot", "itl", "e2e"}) {
    const json& m = report[std::string(name) + "_ms"];
    std::string label = name;
    for (char& c : label) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    absl::StrAppendFormat(&out, "%-10s %12.2f %12.2f %12.2f %12.2f\n", label,
                          m["mean"].get<double>(), m["p50"].get<double>(), m["p90"].get<double>(),
                          m["p99"].get<double>());
  }
  if (auto turns = report.find("ttft_ms_by_turn"); turns != report.end()) {
    for (const json& m : *turns) {
      absl::StrAppendFormat(&out, "%-10s %12.2f %12.2f %12.2f %12.2f\n",
                            absl::StrCat("TTFT t", m["turn"].get<int>()), m["mean"].get<double>(),
                            m["p50"].get<double>(), m["p90"].get<double>(), m["p99"].get<double>());
    }
  }
  return out;
}

std::string ProgressLine(const std::string& label, int64_t total, int64_t sent, int64_t finished,
                         int64_t failed, double elapsed) {
  constexpr int kBarWidth = 24;
  const int filled =
      total > 0 ? static_cast<int>(kBarWidth * std::clamp<int64_t>(finished, 0, total) / total)
                : kBarWidth;
  std::string bar(static_cast<size_t>(filled), '#');
  bar.resize(kBarWidth, '.');
  return absl::StrFormat("%s%s[%s] %d/%d finished, %d sent, %d failed, %.1fs", label,
                         label.empty() ? "" : " ", bar, finished, total, sent, failed, elapsed);
}

namespace {

// "2 req/s", "inf", or "" when the report has no rate.
std::string RateText(const json& report) {
  auto it = report.find("request_rate");
  if (it == report.end()) return "";
  if (it->is_number()) return absl::StrFormat("%g req/s", it->get<double>());
  if (it->is_string()) return it->get<std::string>() == "inf" ? "all at once" : it->get<std::string>();
  return "";
}

std::string LabelText(const json& report) {
  auto it = report.find("label");
  return it != report.end() && it->is_string() ? it->get<std::string>() : "";
}

}  // namespace

std::string ComparisonTable(const std::vector<json>& reports) {
  size_t width = 14;
  for (const json& r : reports) {
    width = std::max({width, LabelText(r).size() + 2, RateText(r).size() + 2});
  }
  std::string out;
  auto row = [&](const std::string& name, auto&& cell) {
    absl::StrAppendFormat(&out, "%-32s", name);
    for (const json& r : reports) {
      const std::string text = cell(r);
      out += std::string(width > text.size() ? width - text.size() : 1, ' ') + text;
    }
    out += "\n";
  };
  row("", [](const json& r) { return LabelText(r); });
  row("Request rate", [](const json& r) { return RateText(r); });
  bool any_concurrency = false;
  for (const json& r : reports) any_concurrency |= r.value("max_concurrency", int64_t{0}) > 0;
  if (any_concurrency) {
    row("Max concurrency", [](const json& r) {
      const int64_t c = r.value("max_concurrency", int64_t{0});
      return c > 0 ? std::to_string(c) : std::string("unbounded");
    });
  }
  row("Requests succeeded / sent", [](const json& r) {
    return absl::StrCat(r["requests_succeeded"].get<int64_t>(), "/",
                        r["requests_sent"].get<int64_t>());
  });
  row("Duration (s)",
      [](const json& r) { return absl::StrFormat("%.3f", r["duration_s"].get<double>()); });
  row("Request throughput (req/s)", [](const json& r) {
    return absl::StrFormat("%.3f", r["request_throughput"].get<double>());
  });
  row("Output token throughput (tok/s)", [](const json& r) {
    return absl::StrFormat("%.2f", r["output_token_throughput"].get<double>());
  });
  bool any_slo = false;
  for (const json& r : reports) any_slo |= r.contains("slo");
  if (any_slo) {
    row("SLO attainment", [](const json& r) {
      return r.contains("slo") ? absl::StrFormat("%.4f", r["slo"]["attainment"].get<double>())
                               : std::string("-");
    });
    row("Goodput (req/s)", [](const json& r) {
      return r.contains("slo") ? absl::StrFormat("%.3f", r["slo"]["goodput"].get<double>())
                               : std::string("-");
    });
  }
  for (const char* name : {"ttft", "tpot", "itl", "e2e"}) {
    std::string upper = name;
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    for (const char* stat : {"mean", "p50", "p90", "p99"}) {
      row(absl::StrCat(upper, " ", stat, " (ms)"), [&](const json& r) {
        return absl::StrFormat("%.2f", r[std::string(name) + "_ms"][stat].get<double>());
      });
    }
  }
  return out;
}

std::map<std::string, std::string> BenchPlots(const std::vector<json>& reports) {
  std::map<std::string, std::string> files;
  // Name each report by what differs between them.
  std::vector<std::string> labels, rates;
  for (const json& r : reports) {
    if (std::find(labels.begin(), labels.end(), LabelText(r)) == labels.end()) {
      labels.push_back(LabelText(r));
    }
    if (std::find(rates.begin(), rates.end(), RateText(r)) == rates.end()) {
      rates.push_back(RateText(r));
    }
  }
  auto series_name = [&](const json& r) {
    std::string label = LabelText(r);
    if (rates.size() > 1 || label.empty()) {
      label = label.empty() ? RateText(r) : absl::StrCat(label, " @ ", RateText(r));
    }
    return label.empty() ? std::string("run") : label;
  };

  auto panel = [](std::string title, std::string x_label, std::string y_label) {
    PlotPanel p;
    p.title = std::move(title);
    p.x_label = std::move(x_label);
    p.y_label = std::move(y_label);
    return p;
  };
  std::vector<PlotPanel> cdfs = {
      panel("TTFT", "time to first token (ms)", "fraction of requests"),
      panel("TPOT", "time per output token (ms)", "fraction of requests"),
      panel("E2E", "end-to-end latency (ms)", "fraction of requests")};
  const char* const keys[] = {"ttft_ms", "tpot_ms", "e2e_ms"};
  for (size_t k = 0; k < cdfs.size(); ++k) {
    cdfs[k].x_min = 0;
    cdfs[k].y_min = 0;
    cdfs[k].y_max = 1;
    for (const json& r : reports) {
      PlotSeries s;
      s.name = series_name(r);
      for (const json& rec : r.value("requests", json::array())) {
        if (!rec.value("success", false) || !rec.contains(keys[k])) continue;
        if (k == 1 && rec.value("output_tokens", int64_t{0}) < 2) continue;  // no TPOT
        s.x.push_back(rec[keys[k]].get<double>());
      }
      std::sort(s.x.begin(), s.x.end());
      for (size_t i = 0; i < s.x.size(); ++i) {
        s.y.push_back(static_cast<double>(i + 1) / static_cast<double>(s.x.size()));
      }
      cdfs[k].series.push_back(std::move(s));
    }
  }
  files["latency_cdf.svg"] = RenderSvg("Latency CDFs", cdfs);

  bool rate_plot = !reports.empty();
  for (const json& r : reports) {
    rate_plot &= r.contains("slo") && r.contains("request_rate") && r["request_rate"].is_number();
  }
  if (rate_plot) {
    const json& slo = reports.front()["slo"];
    PlotPanel attainment = panel("SLO attainment", "request rate (req/s)",
                                 "requests meeting both SLOs (fraction)");
    attainment.x_min = 0;
    attainment.y_min = 0;
    attainment.y_max = 1;
    PlotPanel goodput =
        panel("Goodput (solid) and throughput (dashed)", "request rate (req/s)", "requests/s");
    goodput.x_min = 0;
    goodput.y_min = 0;
    for (const std::string& label : labels) {
      std::vector<const json*> mine;
      for (const json& r : reports) {
        if (LabelText(r) == label) mine.push_back(&r);
      }
      std::stable_sort(mine.begin(), mine.end(), [](const json* a, const json* b) {
        return (*a)["request_rate"].get<double>() < (*b)["request_rate"].get<double>();
      });
      const std::string name = label.empty() ? "run" : label;
      PlotSeries att, good, thr;
      att.name = good.name = name;
      thr.name = absl::StrCat(name, " throughput");
      thr.group = name;
      att.markers = good.markers = thr.markers = true;
      thr.dashed = true;
      for (const json* r : mine) {
        const double rate = (*r)["request_rate"].get<double>();
        att.x.push_back(rate);
        att.y.push_back((*r)["slo"]["attainment"].get<double>());
        good.x.push_back(rate);
        good.y.push_back((*r)["slo"]["goodput"].get<double>());
        thr.x.push_back(rate);
        thr.y.push_back((*r)["request_throughput"].get<double>());
      }
      attainment.series.push_back(std::move(att));
      goodput.series.push_back(std::move(good));
      goodput.series.push_back(std::move(thr));
    }
    files["attainment_vs_rate.svg"] = RenderSvg(
        absl::StrFormat("SLO attainment and goodput vs request rate (TTFT <= %g s, TPOT <= %g s)",
                        slo["ttft_s"].get<double>(), slo["tpot_s"].get<double>()),
        {attainment, goodput});
  }
  return files;
}

}  // namespace tandem::tools
