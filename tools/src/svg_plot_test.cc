#include "tandem/tools/svg_plot.h"

#include <string>

#include "gtest/gtest.h"

namespace tandem::tools {
namespace {

TEST(NiceTicksTest, RoundStepsCoveringTheRange) {
  EXPECT_EQ(NiceTicks(0, 1, 5), (std::vector<double>{0, 0.2, 0.4, 0.6, 0.8, 1}));
  EXPECT_EQ(NiceTicks(0, 97, 5), (std::vector<double>{0, 20, 40, 60, 80, 100}));
  EXPECT_EQ(NiceTicks(3, 47, 5), (std::vector<double>{0, 10, 20, 30, 40, 50}));
  EXPECT_EQ(NiceTicks(0.0012, 0.0049, 4), (std::vector<double>{0.001, 0.002, 0.003, 0.004,
                                                                0.005}));
  // A single value gets a range around it; zero gets [0, 1].
  const std::vector<double> one = NiceTicks(5, 5, 5);
  EXPECT_LE(one.front(), 5);
  EXPECT_GE(one.back(), 5);
  EXPECT_GT(one.back(), one.front());
  EXPECT_EQ(NiceTicks(0, 0, 5).front(), 0);
  EXPECT_GE(NiceTicks(0, 0, 5).back(), 1);
}

size_t Count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + 1)) {
    ++n;
  }
  return n;
}

PlotPanel Panel(std::string title, std::string x_label, std::string y_label) {
  PlotPanel p;
  p.title = std::move(title);
  p.x_label = std::move(x_label);
  p.y_label = std::move(y_label);
  return p;
}

PlotSeries Series(std::string name, std::vector<double> x, std::vector<double> y,
                  bool markers = false, bool dashed = false) {
  PlotSeries s;
  s.name = std::move(name);
  s.x = std::move(x);
  s.y = std::move(y);
  s.markers = markers;
  s.dashed = dashed;
  return s;
}

TEST(RenderSvgTest, PanelsSeriesMarkersAndLegend) {
  PlotPanel a = Panel("A & B", "x <ms>", "y");
  a.series.push_back(Series("one", {1, 2, 3}, {0.1, 0.5, 1}));
  a.series.push_back(Series("two", {1, 2}, {1, 2}, /*markers=*/true, /*dashed=*/true));
  PlotPanel b = Panel("C", "x", "y");
  b.series.push_back(Series("one", {0, 10}, {0, 1}));
  const std::string svg = RenderSvg("title \"quoted\"", {a, b});
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_NE(svg.find("xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  EXPECT_EQ(Count(svg, "class=\"panel\""), 2u);
  EXPECT_EQ(Count(svg, "<polyline"), 3u);
  EXPECT_EQ(Count(svg, "<circle"), 2u);               // markers of "two" only
  EXPECT_EQ(Count(svg, "class=\"legend-entry\""), 2u);  // "one" is listed once
  EXPECT_NE(svg.find("A &amp; B"), std::string::npos);
  EXPECT_NE(svg.find("x &lt;ms&gt;"), std::string::npos);
  EXPECT_NE(svg.find("title &quot;quoted&quot;"), std::string::npos);
  EXPECT_NE(svg.find("stroke-dasharray"), std::string::npos);
  EXPECT_GE(Count(svg, "class=\"xtick\""), 4u);
  EXPECT_GE(Count(svg, "class=\"ytick\""), 4u);
  EXPECT_EQ(svg.substr(svg.size() - 7), "</svg>\n");
}

TEST(RenderSvgTest, GroupSharesAColour) {
  PlotPanel p = Panel("P", "x", "y");
  p.series.push_back(Series("a", {0, 1}, {0, 1}));
  PlotSeries b = Series("a throughput", {0, 1}, {1, 2}, false, true);
  b.group = "a";
  p.series.push_back(b);
  p.series.push_back(Series("c", {0, 1}, {2, 3}));
  const std::string svg = RenderSvg("t", {p});
  EXPECT_EQ(Count(svg, "stroke=\"#0072B2\""), 4u);  // two lines, two legend swatches
  EXPECT_EQ(Count(svg, "stroke=\"#D55E00\""), 2u);  // "c" gets the second colour
}

}  // namespace
}  // namespace tandem::tools
