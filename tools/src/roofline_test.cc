#include "tandem/tools/roofline.h"

#include <string>

#include "gtest/gtest.h"

namespace tandem::tools {
namespace {

RooflineReport Analyze(const RooflineShape& shape, const std::string& hardware) {
  absl::StatusOr<HardwareProfile> hw = FindHardware(hardware);
  EXPECT_TRUE(hw.ok()) << hw.status();
  absl::StatusOr<RooflineReport> report = AnalyzeRoofline(shape, *hw);
  EXPECT_TRUE(report.ok()) << report.status();
  return *report;
}

double Intensity(const PhaseReport& phase, const std::string& op) {
  const OperatorCost* c = phase.Find(op);
  EXPECT_NE(c, nullptr) << op;
  return c == nullptr ? 0 : c->intensity;
}

TEST(RooflineTest, A100RidgeMatchesTextbook) {
  absl::StatusOr<HardwareProfile> a100 = FindHardware("a100-80g");
  ASSERT_TRUE(a100.ok());
  EXPECT_NEAR(a100->RidgeIntensity(), 142.5, 0.1);
}

// B=8, T=1024, H=4096, D=128: the book's 2730.7, 114.7, 8.0 and 1.0 FLOP/byte.
TEST(RooflineTest, ReproducesTextbookIntensities) {
  RooflineReport r = Analyze(TextbookShape(), "A100-80G");
  for (const char* op : {"qkv_proj", "o_proj"}) {
    EXPECT_NEAR(Intensity(r.prefill, op), 2730.7, 27.3) << op;
    EXPECT_NEAR(Intensity(r.decode, op), 8.0, 0.08) << op;
  }
  EXPECT_NEAR(Intensity(r.prefill, "attention"), 114.7, 1.147);
  EXPECT_NEAR(Intensity(r.decode, "attention"), 1.0, 0.01);
  // The remaining operators are O(1), as in the book.
  for (const char* op : {"attn_norm", "rope", "swiglu", "mlp_norm"}) {
    EXPECT_GT(Intensity(r.prefill, op), 0.5) << op;
    EXPECT_LT(Intensity(r.prefill, op), 2.0) << op;
  }
}

TEST(RooflineTest, PrefillComputeBoundDecodeBandwidthBoundOnA100) {
  RooflineReport r = Analyze(TextbookShape(), "A100-80G");
  EXPECT_EQ(r.prefill.bound, Bound::kCompute);
  EXPECT_EQ(r.decode.bound, Bound::kBandwidth);
  EXPECT_EQ(r.prefill.Find("o_proj")->bound, Bound::kCompute);
  EXPECT_EQ(r.prefill.Find("attention")->bound, Bound::kBandwidth);  // 114.7 < 142.5
  for (const OperatorCost& c : r.decode.operators) {
    EXPECT_EQ(c.bound, Bound::kBandwidth) << c.name;
  }
}

TEST(RooflineTest, OperatorTimeIsTheRoofline) {
  RooflineReport r = Analyze(TextbookShape(), "A100-80G");
  const OperatorCost* o = r.prefill.Find("o_proj");
  ASSERT_NE(o, nullptr);
  EXPECT_EQ(o->count, 32);
  EXPECT_DOUBLE_EQ(o->flops, 32 * 2.0 * 8 * 1024 * 4096 * 4096);
  EXPECT_DOUBLE_EQ(o->seconds, o->flops / r.hardware.peak_flops);
  double sum = 0;
  for (const OperatorCost& c : r.decode.operators) sum += c.seconds;
  EXPECT_DOUBLE_EQ(r.decode.step_seconds, sum);
}

// A batch-1 decode step of an 8B model reads every weight once: ~15 GB (bf16, embedding only
// gathered) over 3.35 TB/s, a little over 4 ms.
TEST(RooflineTest, Llama3DecodeStepIsWeightBytesOverBandwidth) {
  RooflineShape shape = Llama3_8BShape();
  shape.batch = 1;
  shape.seq_len = 128;
  RooflineReport r = Analyze(shape, "H100");
  const double weights = DecodeWeightBytes(shape);
  EXPECT_GT(weights, 14.5e9);
  EXPECT_LT(weights, 16.1e9);
  const double expected = weights / r.hardware.bandwidth_bytes;
  EXPECT_NEAR(r.decode.step_seconds, expected, 0.03 * expected);
  EXPECT_GT(r.decode.step_seconds, 3.5e-3);
  EXPECT_LT(r.decode.step_seconds, 5.0e-3);
}

// Weight-only int4 (AWQ/GPTQ, group 128) reads about a quarter of the bf16 projection bytes, so
// the batch-1 decode step of Llama-3-8B (lm_head and embedding still bf16) takes well under half
// the time; an fp8 KV cache halves what attention reads from the cache.
TEST(RooflineTest, QuantisedWeightsAndFp8KvReadFewerBytes) {
  RooflineShape shape = Llama3_8BShape();
  shape.batch = 1;
  shape.seq_len = 4096;
  const RooflineReport bf16 = Analyze(shape, "H100");
  RooflineShape int4 = shape;
  ASSERT_TRUE(SetPrecision("int4", "auto", 128, &int4).ok());
  EXPECT_NEAR(int4.ProjectionBytes(), 0.5 + 2.5 / 128, 1e-12);
  const RooflineReport q = Analyze(int4, "H100");
  const double bf16_down = bf16.decode.Find("down_proj")->bytes;
  EXPECT_NEAR(q.decode.Find("down_proj")->bytes / bf16_down, int4.ProjectionBytes() / 2, 0.001);
  EXPECT_EQ(q.decode.Find("lm_head")->bytes, bf16.decode.Find("lm_head")->bytes);
  EXPECT_LT(q.decode.step_seconds, 0.45 * bf16.decode.step_seconds);
  EXPECT_LT(DecodeWeightBytes(int4), 0.35 * DecodeWeightBytes(shape));

  RooflineShape fp8_kv = shape;
  ASSERT_TRUE(SetPrecision("auto", "fp8_e4m3", 128, &fp8_kv).ok());
  const RooflineReport k = Analyze(fp8_kv, "H100");
  EXPECT_EQ(k.decode.Find("kv_cache_write")->bytes * 2, bf16.decode.Find("kv_cache_write")->bytes);
  EXPECT_LT(k.decode.Find("attention")->bytes, bf16.decode.Find("attention")->bytes);
  EXPECT_EQ(k.decode.Find("down_proj")->bytes, bf16.decode.Find("down_proj")->bytes);
  EXPECT_EQ(k.ToJson()["shape"]["kv_bytes"], 1.0);

  RooflineShape bad = shape;
  EXPECT_FALSE(SetPrecision("int3", "auto", 128, &bad).ok());
  EXPECT_FALSE(SetPrecision("auto", "int8", 128, &bad).ok());
  EXPECT_FALSE(SetPrecision("int4", "auto", 0, &bad).ok());
  EXPECT_EQ(WeightBytesOf("int8").value(), 1.0);
  EXPECT_EQ(WeightBytesOf("float32").value(), 4.0);
}

TEST(RooflineTest, PrefillTimeLinearInTokensWhenComputeBound) {
  RooflineShape shape = Llama3_8BShape();
  shape.seq_len = 2048;
  shape.batch = 4;
  const double t4 = Analyze(shape, "H100").prefill.step_seconds;
  shape.batch = 8;
  RooflineReport r8 = Analyze(shape, "H100");
  shape.batch = 16;
  const double t16 = Analyze(shape, "H100").prefill.step_seconds;
  ASSERT_EQ(r8.prefill.bound, Bound::kCompute);
  EXPECT_NEAR(r8.prefill.step_seconds / t4, 2.0, 0.02);
  EXPECT_NEAR(t16 / r8.prefill.step_seconds, 2.0, 0.02);
}

TEST(RooflineTest, FasterMemoryOnlySpeedsUpDecode) {
  RooflineReport h100 = Analyze(TextbookShape(), "H100");
  RooflineReport h200 = Analyze(TextbookShape(), "H200");
  EXPECT_LT(h200.decode.step_seconds, h100.decode.step_seconds * 0.75);
  EXPECT_GT(h200.prefill.step_seconds, h100.prefill.step_seconds * 0.9);
}

TEST(RooflineTest, RejectsBadInput) {
  EXPECT_FALSE(FindHardware("TPU").ok());
  EXPECT_FALSE(CustomHardware(0, 2039).ok());
  EXPECT_FALSE(CustomHardware(312, -1).ok());
  EXPECT_FALSE(FindShape("gpt-5").ok());
  RooflineShape shape = TextbookShape();
  shape.kv_heads = 5;
  EXPECT_FALSE(AnalyzeRoofline(shape, *FindHardware("H100")).ok());
  shape = TextbookShape();
  shape.batch = 0;
  EXPECT_FALSE(AnalyzeRoofline(shape, *FindHardware("H100")).ok());
}

TEST(RooflineTest, JsonCarriesBothPhases) {
  RooflineReport r = Analyze(TextbookShape(), "A100-80G");
  nlohmann::json j = r.ToJson();
  EXPECT_NEAR(j["hardware"]["ridge_flop_per_byte"].get<double>(), 142.5, 0.1);
  EXPECT_EQ(j["prefill"]["bound"], "compute");
  EXPECT_EQ(j["decode"]["bound"], "bandwidth");
  EXPECT_EQ(j["decode"]["operators"].size(), r.decode.operators.size());
  EXPECT_NE(r.ToText().find("predicted step time"), std::string::npos);
}

}  // namespace
}  // namespace tandem::tools
