// Standalone SVG line charts (see svg_plot.h).
#include "tandem/tools/svg_plot.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tandem::tools {
namespace {

// Panel geometry in SVG user units.
constexpr double kPanelWidth = 380, kPanelHeight = 300;
constexpr double kLeft = 64, kRight = 30, kTop = 30, kBottom = 48;  // margins inside a panel
constexpr double kTitleHeight = 34;
constexpr double kLegendRow = 20;

// Colour-blind-safe palette (Okabe-Ito), then greys.
const char* const kColors[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00",
                               "#56B4E9", "#000000", "#F0E442", "#999999", "#555555"};

std::string Escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string Num(double v) { return absl::StrFormat("%.2f", v); }
// A tick label: shortest form of a round number.
std::string TickLabel(double v) { return absl::StrFormat("%g", v); }

struct Range {
  double lo = 0, hi = 1;
  std::vector<double> ticks;
};

Range AxisRange(const std::vector<const std::vector<double>*>& data, std::optional<double> lo,
                std::optional<double> hi) {
  double dlo = INFINITY, dhi = -INFINITY;
  for (const std::vector<double>* values : data) {
    for (double v : *values) {
      if (!std::isfinite(v)) continue;
      dlo = std::min(dlo, v);
      dhi = std::max(dhi, v);
    }
  }
  if (!std::isfinite(dlo)) dlo = 0, dhi = 1;
  Range r;
  r.ticks = NiceTicks(lo.value_or(dlo), hi.value_or(dhi), 5);
  r.lo = lo.value_or(r.ticks.front());
  r.hi = hi.value_or(r.ticks.back());
  if (r.hi <= r.lo) r.hi = r.lo + 1;
  // Ticks outside fixed limits are dropped.
  std::erase_if(r.ticks, [&](double t) {
    const double eps = (r.hi - r.lo) * 1e-9;
    return t < r.lo - eps || t > r.hi + eps;
  });
  return r;
}

}  // namespace

std::vector<double> NiceTicks(double lo, double hi, int target) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) lo = 0, hi = 1;
  if (hi < lo) std::swap(lo, hi);
  if (hi == lo) {
    const double pad = lo == 0 ? 1 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
    if (lo < 0 && lo + pad >= 0) lo = 0;  // a non-negative value keeps a non-negative axis
  }
  target = std::max(target, 1);
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / mag;
  const double slack = 1 + 1e-9;  // 0.2 / 0.1 is 2.0000000000000004
  const double step =
      (norm <= slack ? 1 : norm <= 2 * slack ? 2 : norm <= 5 * slack ? 5 : 10) * mag;
  const double first = std::floor(lo / step + 1e-9);
  const double last = std::ceil(hi / step - 1e-9);
  std::vector<double> ticks;
  for (double k = first; k <= last + 0.5; k += 1) {
    double t = k * step;
    if (std::abs(t) < step * 1e-9) t = 0;
    // Round away binary noise (0.30000000000000004 -> 0.3).
    t = std::stod(absl::StrFormat("%.12g", t));
    ticks.push_back(t);
  }
  if (ticks.size() < 2) ticks.push_back(ticks.back() + step);
  return ticks;
}

std::string RenderSvg(const std::string& title, const std::vector<PlotPanel>& panels) {
  // One colour per group, one legend entry per series name, in order of first appearance.
  std::vector<std::string> names;
  std::map<std::string, std::string> group_color;
  std::map<std::string, std::pair<std::string, bool>> style;  // name -> colour, dashed
  for (const PlotPanel& p : panels) {
    for (const PlotSeries& s : p.series) {
      if (style.count(s.name)) continue;
      const std::string& group = s.group.empty() ? s.name : s.group;
      if (!group_color.count(group)) {
        group_color[group] = kColors[group_color.size() % (sizeof(kColors) / sizeof(kColors[0]))];
      }
      style[s.name] = {group_color[group], s.dashed};
      names.push_back(s.name);
    }
  }
  const double n_panels = static_cast<double>(std::max<size_t>(panels.size(), 1));
  const double width = kPanelWidth * n_panels;
  const int legend_columns = std::max(1, static_cast<int>(width / 240));
  const int legend_rows =
      static_cast<int>((names.size() + legend_columns - 1) / std::max(legend_columns, 1));
  const double height = kTitleHeight + kPanelHeight + legend_rows * kLegendRow + 12;

  std::string out = absl::StrFormat(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect x=\"0\" y=\"0\" width=\"%d\" height=\"%d\" fill=\"white\"/>\n"
      "<text class=\"title\" x=\"%s\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">%s</text>\n",
      static_cast<int>(width), static_cast<int>(height), static_cast<int>(width),
      static_cast<int>(height), static_cast<int>(width), static_cast<int>(height), Num(width / 2),
      Escape(title));

  for (size_t pi = 0; pi < panels.size(); ++pi) {
    const PlotPanel& p = panels[pi];
    const double ox = kPanelWidth * static_cast<double>(pi);
    const double oy = kTitleHeight;
    const double x0 = ox + kLeft, x1 = ox + kPanelWidth - kRight;
    const double y0 = oy + kPanelHeight - kBottom, y1 = oy + kTop;  // y0: bottom edge
    std::vector<const std::vector<double>*> xs, ys;
    for (const PlotSeries& s : p.series) {
      xs.push_back(&s.x);
      ys.push_back(&s.y);
    }
    const Range xr = AxisRange(xs, p.x_min, p.x_max);
    const Range yr = AxisRange(ys, p.y_min, p.y_max);
    auto px = [&](double x) { return x0 + (x - xr.lo) / (xr.hi - xr.lo) * (x1 - x0); };
    auto py = [&](double y) { return y0 - (y - yr.lo) / (yr.hi - yr.lo) * (y0 - y1); };

    absl::StrAppendFormat(&out, "<g class=\"panel\" data-title=\"%s\">\n", Escape(p.title));
    absl::StrAppendFormat(&out,
                          "<text class=\"panel-title\" x=\"%s\" y=\"%s\" text-anchor=\"middle\" "
                          "font-size=\"13\">%s</text>\n",
                          Num((x0 + x1) / 2), Num(y1 - 10), Escape(p.title));
    // Grid and ticks.
    for (double t : xr.ticks) {
      const double x = px(t);
      absl::StrAppendFormat(&out,
                            "<line x1=\"%s\" y1=\"%s\" x2=\"%s\" y2=\"%s\" stroke=\"#e5e5e5\"/>\n",
                            Num(x), Num(y1), Num(x), Num(y0));
      absl::StrAppendFormat(&out,
                            "<line class=\"xtick\" data-value=\"%s\" x1=\"%s\" y1=\"%s\" x2=\"%s\" "
                            "y2=\"%s\" stroke=\"black\"/>\n",
                            TickLabel(t), Num(x), Num(y0), Num(x), Num(y0 + 5));
      absl::StrAppendFormat(&out, "<text x=\"%s\" y=\"%s\" text-anchor=\"middle\">%s</text>\n",
                            Num(x), Num(y0 + 18), TickLabel(t));
    }
    for (double t : yr.ticks) {
      const double y = py(t);
      absl::StrAppendFormat(&out,
                            "<line x1=\"%s\" y1=\"%s\" x2=\"%s\" y2=\"%s\" stroke=\"#e5e5e5\"/>\n",
                            Num(x0), Num(y), Num(x1), Num(y));
      absl::StrAppendFormat(&out,
                            "<line class=\"ytick\" data-value=\"%s\" x1=\"%s\" y1=\"%s\" x2=\"%s\" "
                            "y2=\"%s\" stroke=\"black\"/>\n",
                            TickLabel(t), Num(x0 - 5), Num(y), Num(x0), Num(y));
      absl::StrAppendFormat(&out, "<text x=\"%s\" y=\"%s\" text-anchor=\"end\">%s</text>\n",
                            Num(x0 - 8), Num(y + 4), TickLabel(t));
    }
    // Axes and their labels.
    absl::StrAppendFormat(&out,
                          "<rect class=\"frame\" x=\"%s\" y=\"%s\" width=\"%s\" height=\"%s\" "
                          "fill=\"none\" stroke=\"black\"/>\n",
                          Num(x0), Num(y1), Num(x1 - x0), Num(y0 - y1));
    absl::StrAppendFormat(&out,
                          "<text class=\"xlabel\" x=\"%s\" y=\"%s\" text-anchor=\"middle\">%s"
                          "</text>\n",
                          Num((x0 + x1) / 2), Num(y0 + 36), Escape(p.x_label));
    absl::StrAppendFormat(&out,
                          "<text class=\"ylabel\" x=\"%s\" y=\"%s\" text-anchor=\"middle\" "
                          "transform=\"rotate(-90 %s %s)\">%s</text>\n",
                          Num(ox + 16), Num((y0 + y1) / 2), Num(ox + 16), Num((y0 + y1) / 2),
                          Escape(p.y_label));
    // Data.
    for (const PlotSeries& s : p.series) {
      const auto& [color, dashed] = style[s.name];
      std::string points;
      const size_t n = std::min(s.x.size(), s.y.size());
      for (size_t i = 0; i < n; ++i) {
        absl::StrAppend(&points, i ? " " : "", Num(px(s.x[i])), ",", Num(py(s.y[i])));
      }
      absl::StrAppendFormat(&out,
                            "<polyline class=\"series\" data-series=\"%s\" fill=\"none\" "
                            "stroke=\"%s\" stroke-width=\"1.8\"%s points=\"%s\"/>\n",
                            Escape(s.name), color,
                            dashed ? " stroke-dasharray=\"6 4\"" : "", points);
      if (s.markers) {
        for (size_t i = 0; i < n; ++i) {
          absl::StrAppendFormat(&out,
                                "<circle class=\"point\" data-series=\"%s\" cx=\"%s\" cy=\"%s\" "
                                "r=\"3.5\" fill=\"%s\"/>\n",
                                Escape(s.name), Num(px(s.x[i])), Num(py(s.y[i])), color);
        }
      }
    }
    out += "</g>\n";
  }

  // Legend, shared by the panels.
  out += "<g class=\"legend\">\n";
  const double legend_top = kTitleHeight + kPanelHeight + 4;
  const double column_width = width / legend_columns;
  for (size_t i = 0; i < names.size(); ++i) {
    const auto& [color, dashed] = style[names[i]];
    const double x = 16 + column_width * static_cast<double>(i % legend_columns);
    const double y = legend_top + kLegendRow * static_cast<double>(i / legend_columns) + 10;
    absl::StrAppendFormat(&out,
                          "<line x1=\"%s\" y1=\"%s\" x2=\"%s\" y2=\"%s\" stroke=\"%s\" "
                          "stroke-width=\"2.5\"%s/>\n",
                          Num(x), Num(y), Num(x + 26), Num(y), color,
                          dashed ? " stroke-dasharray=\"6 4\"" : "");
    absl::StrAppendFormat(&out, "<text class=\"legend-entry\" x=\"%s\" y=\"%s\">%s</text>\n",
                          Num(x + 32), Num(y + 4), Escape(names[i]));
  }
  out += "</g>\n</svg>\n";
  return out;
}

}  // namespace tandem::tools
