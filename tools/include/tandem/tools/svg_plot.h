// Standalone SVG line charts, written without any plotting library: one figure of panels side by
// side, each with axes, ticks, axis labels and lines (optionally with point markers), and one
// legend shared by the panels (a series name, or group, has the same colour in every panel).
//
//   PlotPanel panel{.title = "TTFT", .x_label = "ms", .y_label = "fraction"};
//   panel.series.push_back({.name = "colocated", .x = {1, 2}, .y = {0.5, 1}});
//   std::string svg = RenderSvg("Latency CDFs", {panel});
//
// Every element a reader may want to check carries data attributes: ticks
// (`<line class="xtick|ytick" data-value="...">`), lines (`<polyline class="series"
// data-series="NAME">`), markers (`<circle class="point" data-series="NAME">`), each inside its
// panel's `<g class="panel" data-title="...">`.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace tandem::tools {

struct PlotSeries {
  std::string name;
  std::vector<double> x, y;  // same length; drawn in the given order
  bool markers = false;      // a circle at every point
  bool dashed = false;
  std::string group;  // series of one group share a colour (default: the name)
};

struct PlotPanel {
  std::string title;
  std::string x_label, y_label;
  std::vector<PlotSeries> series;
  // Axis limits; unset ones come from the data, widened to the nearest ticks.
  std::optional<double> x_min, x_max, y_min, y_max;
};

// About `target` evenly spaced round ticks (steps of 1, 2 or 5 times a power of ten) from at or
// below `lo` to at or above `hi`. lo == hi is widened to a unit range around it.
std::vector<double> NiceTicks(double lo, double hi, int target);

// The figure as a complete SVG document.
std::string RenderSvg(const std::string& title, const std::vector<PlotPanel>& panels);

}  // namespace tandem::tools
