#include "tandem/tools/roofline.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <optional>

#include "absl/strings/str_cat.h"
#include "tandem/base/half.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/quantization_config.h"

namespace tandem::tools {
namespace {

constexpr double kFlopsPerTFlop = 1e12;

std::string Lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

struct HardwarePreset {
  const char* name;
  double tflops;
  double gb_per_s;
};

// bf16 dense tensor-core peaks from the vendors' data sheets.
constexpr HardwarePreset kHardwarePresets[] = {
    {"A100-80G", 312, 2039},
    {"H100", 989, 3350},
    {"H200", 989, 4800},
};

// The step being modelled: `tokens_per_seq` new tokens attend to `context` positions.
struct StepShape {
  double batch;
  double tokens_per_seq;
  double context;
};

// Byte counts follow the textbook's convention: an operator is charged for the operands it
// reads (activations, weights, cached K/V, attention scores); the output of a linear layer, which
// the book's O(BTH + H^2) leaves out, is not counted. Attention is the unfused form: the score
// matrix is written and read back once, and Q and O, which the book's O(BTND + BT^2 N) drops next
// to K, V and the scores, are not counted.
std::vector<OperatorCost> PhaseOperators(const RooflineShape& s, const StepShape& step) {
  const double d = static_cast<double>(s.dtype_bytes);
  const double w = s.ProjectionBytes();  // per projection weight
  const double kvb = s.KvBytes();        // per cached K or V element
  const double h = static_cast<double>(s.hidden);
  const double n = static_cast<double>(s.heads);
  const double nkv = static_cast<double>(s.kv_heads);
  const double hd = static_cast<double>(s.head_dim);
  const double inter = static_cast<double>(s.intermediate);
  const double vocab = static_cast<double>(s.vocab);
  const double b = step.batch;
  const double m = step.batch * step.tokens_per_seq;  // rows through the linear layers
  const double tq = step.tokens_per_seq;
  const double tkv = step.context;
  const double q_width = n * hd;
  const double kv_width = nkv * hd;
  const int64_t layers = s.layers;

  auto op = [](std::string name, std::string formula, int64_t count, double flops, double bytes) {
    OperatorCost c;
    c.name = std::move(name);
    c.formula = std::move(formula);
    c.count = count;
    c.flops = flops * static_cast<double>(count);
    c.bytes = bytes * static_cast<double>(count);
    return c;
  };
  // Residual add then RMSNorm: add, square, sum, scale by 1/rms, scale by weight.
  const double norm_flops = 5 * m * h;
  const double norm_bytes = d * (2 * m * h + h);

  std::vector<OperatorCost> ops;
  ops.push_back(op("attn_norm", "X = Add&RMSNorm(X)", layers, norm_flops, norm_bytes));
  // Q, K and V are three products, each reading X once.
  ops.push_back(op("qkv_proj", "Q,K,V = X W^{Q,K,V}", layers, 2 * m * h * (q_width + 2 * kv_width),
                   d * 3 * m * h + w * h * (q_width + 2 * kv_width)));
  // Three FLOPs per rotated element (two products and a sum per output of a 2x2 rotation).
  ops.push_back(op("rope", "Q,K = RoPE(Q,K)", layers, 3 * m * (q_width + kv_width),
                   d * m * (q_width + kv_width)));
  ops.push_back(op("kv_cache_write", "K,V = Cache(k,v)", layers, 0, kvb * 2 * m * kv_width));
  // QK^T and PV (2 * tq * tkv * D each per head), then the 1/sqrt(D) scale and the softmax
  // (4 per score). Causal masking is not discounted, as in the book.
  const double scores = b * tq * tkv * n;
  ops.push_back(op("attention", "O = softmax(QK^T/sqrt(D)) V", layers, 4 * scores * hd + 4 * scores,
                   kvb * 2 * b * tkv * kv_width + d * 2 * scores));
  ops.push_back(
      op("o_proj", "X = O W^O", layers, 2 * m * q_width * h, d * m * q_width + w * q_width * h));
  ops.push_back(op("mlp_norm", "X = Add&RMSNorm(X)", layers, norm_flops, norm_bytes));
  ops.push_back(op("gate_up_proj", "G,U = X [W^G, W^U]", layers, 4 * m * h * inter,
                   d * 2 * m * h + w * 2 * h * inter));
  // silu(g) * u: exp, add, divide, two products.
  ops.push_back(op("swiglu", "D = Swish(G) * U", layers, 5 * m * inter, d * 2 * m * inter));
  ops.push_back(
      op("down_proj", "X = D W^D", layers, 2 * m * inter * h, d * m * inter + w * inter * h));
  ops.push_back(op("final_norm", "X = Add&RMSNorm(X)", 1, norm_flops, norm_bytes));
  // Logits only for the last position of each sequence, the one that is sampled.
  ops.push_back(
      op("lm_head", "logits = x W^{vocab}", 1, 2 * b * h * vocab, d * (b * h + h * vocab)));
  return ops;
}

PhaseReport Summarize(std::string phase, double tokens, std::vector<OperatorCost> ops,
                      const HardwareProfile& hw) {
  const double ridge = hw.RidgeIntensity();
  PhaseReport r;
  r.phase = std::move(phase);
  r.tokens = static_cast<int64_t>(tokens);
  for (OperatorCost& c : ops) {
    c.intensity = c.bytes > 0 ? c.flops / c.bytes : 0;
    c.bound = c.intensity >= ridge ? Bound::kCompute : Bound::kBandwidth;
    c.seconds = std::max(c.flops / hw.peak_flops, c.bytes / hw.bandwidth_bytes);
    r.flops += c.flops;
    r.bytes += c.bytes;
    r.step_seconds += c.seconds;
  }
  r.intensity = r.bytes > 0 ? r.flops / r.bytes : 0;
  r.bound = r.intensity >= ridge ? Bound::kCompute : Bound::kBandwidth;
  r.operators = std::move(ops);
  return r;
}

nlohmann::json PhaseJson(const PhaseReport& p) {
  nlohmann::json ops = nlohmann::json::array();
  for (const OperatorCost& c : p.operators) {
    ops.push_back({{"name", c.name},
                   {"formula", c.formula},
                   {"count", c.count},
                   {"flops", c.flops},
                   {"bytes", c.bytes},
                   {"intensity", c.intensity},
                   {"bound", BoundName(c.bound)},
                   {"seconds", c.seconds}});
  }
  return {{"tokens", p.tokens},
          {"flops", p.flops},
          {"bytes", p.bytes},
          {"intensity", p.intensity},
          {"bound", BoundName(p.bound)},
          {"step_seconds", p.step_seconds},
          {"operators", ops}};
}

std::string Format(const char* fmt, double a) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), fmt, a);
  return buf;
}

std::string PhaseText(const PhaseReport& p) {
  std::string out = absl::StrCat(p.phase, " (", p.tokens, " new tokens)\n");
  char line[256];
  std::snprintf(line, sizeof(line), "  %-15s %5s %12s %12s %10s %-9s %11s\n", "operator", "count",
                "GFLOP", "MB", "FLOP/byte", "bound", "time_ms");
  out += line;
  auto row = [&](const std::string& name, const std::string& count, double flops, double bytes,
                 double intensity, Bound bound, double seconds) {
    std::snprintf(line, sizeof(line), "  %-15s %5s %12.3f %12.3f %10.2f %-9s %11.4f\n",
                  name.c_str(), count.c_str(), flops / 1e9, bytes / 1e6, intensity,
                  BoundName(bound), seconds * 1e3);
    out += line;
  };
  for (const OperatorCost& c : p.operators) {
    row(c.name, absl::StrCat(c.count), c.flops, c.bytes, c.intensity, c.bound, c.seconds);
  }
  row("total", "", p.flops, p.bytes, p.intensity, p.bound, p.step_seconds);
  out += absl::StrCat("  predicted step time: ", Format("%.4f", p.step_seconds * 1e3), " ms\n");
  return out;
}

}  // namespace

absl::StatusOr<HardwareProfile> CustomHardware(double tflops, double gb_per_s) {
  if (!(tflops > 0) || !(gb_per_s > 0)) {
    return absl::InvalidArgumentError("--flops and --bandwidth must both be positive");
  }
  HardwareProfile hw;
  hw.name = "custom";
  hw.peak_flops = tflops * kFlopsPerTFlop;
  hw.bandwidth_bytes = gb_per_s * kBytesPerGB;
  return hw;
}

absl::StatusOr<HardwareProfile> FindHardware(const std::string& name) {
  for (const HardwarePreset& p : kHardwarePresets) {
    if (Lower(p.name) == Lower(name)) {
      TANDEM_ASSIGN_OR_RETURN(HardwareProfile hw, CustomHardware(p.tflops, p.gb_per_s));
      hw.name = p.name;
      return hw;
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown hardware '", name, "' (A100-80G, H100, H200, or --flops/--bandwidth)"));
}

std::vector<std::string> HardwareNames() {
  std::vector<std::string> names;
  for (const HardwarePreset& p : kHardwarePresets) names.push_back(p.name);
  return names;
}

absl::Status RooflineShape::Validate() const {
  const std::pair<const char*, int64_t> fields[] = {{"hidden", hidden},
                                                    {"heads", heads},
                                                    {"kv-heads", kv_heads},
                                                    {"head_dim", head_dim},
                                                    {"intermediate", intermediate},
                                                    {"layers", layers},
                                                    {"vocab", vocab},
                                                    {"batch", batch},
                                                    {"seq-len", seq_len},
                                                    {"dtype-bytes", dtype_bytes}};
  for (const auto& [name, value] : fields) {
    if (value <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " must be positive, got ", value));
    }
  }
  if (weight_bytes < 0 || kv_bytes < 0) {
    return absl::InvalidArgumentError("weight and KV bytes per element must not be negative");
  }
  if (heads % kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--heads (", heads, ") must be a multiple of --kv-heads (", kv_heads, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<double> WeightBytesOf(const std::string& name, int group_size) {
  if (name == "int8") return 1.0;
  if (name == "int4") {
    if (group_size <= 0) return absl::InvalidArgumentError("--group-size must be positive");
    return 0.5 + 2.5 / group_size;  // fp16 scale and 4-bit zero point per group
  }
  const std::optional<DType> dtype = ParseDTypeFlag(name);
  if (!dtype.has_value() || DTypeSize(*dtype) == 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--weight-dtype must be bfloat16|float16|float32|int8|int4, got '", name, "'"));
  }
  return static_cast<double>(DTypeSize(*dtype));
}

absl::Status SetPrecision(const std::string& weight_dtype, const std::string& kv_dtype,
                          int group_size, RooflineShape* shape) {
  if (!weight_dtype.empty() && weight_dtype != "auto") {
    TANDEM_ASSIGN_OR_RETURN(shape->weight_bytes, WeightBytesOf(weight_dtype, group_size));
  }
  if (!kv_dtype.empty() && kv_dtype != "auto") {
    const std::optional<DType> dtype = ParseDTypeFlag(kv_dtype);
    if (!dtype.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kv-cache-dtype must be bfloat16|float16|float32|fp8_e4m3|fp8_e5m2, got '",
                       kv_dtype, "'"));
    }
    shape->kv_bytes = DTypeSize(*dtype);
  }
  return absl::OkStatus();
}

absl::StatusOr<double> CheckpointWeightBytes(const std::string& config_json_path) {
  std::ifstream in(config_json_path);
  if (!in) return absl::NotFoundError(absl::StrCat(config_json_path, ": cannot open"));
  const nlohmann::json config = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  TANDEM_ASSIGN_OR_RETURN(engine::QuantizationConfig q,
                          engine::ParseQuantizationConfig(config, config_json_path));
  switch (q.method) {
    case engine::QuantMethod::kNone:
      return 0.0;
    case engine::QuantMethod::kCompressedInt8:
      return 1.0;
    case engine::QuantMethod::kAwq:
    case engine::QuantMethod::kGptq:
      // One group per row (GPTQ group_size -1): the scale's share is negligible.
      return q.group_size > 0 ? 0.5 + 2.5 / q.group_size : 0.5;
  }
  return 0.0;
}

RooflineShape TextbookShape() {
  RooflineShape s;
  s.hidden = 4096;
  s.heads = 32;
  s.kv_heads = 32;
  s.head_dim = 128;
  s.intermediate = 11008;
  s.layers = 32;
  s.vocab = 32000;
  s.batch = 8;
  s.seq_len = 1024;
  s.dtype_bytes = 2;
  return s;
}

RooflineShape Llama3_8BShape() {
  RooflineShape s = TextbookShape();
  s.kv_heads = 8;
  s.intermediate = 14336;
  s.vocab = 128256;
  return s;
}

absl::StatusOr<RooflineShape> FindShape(const std::string& name) {
  const std::string lower = Lower(name);
  if (lower == "textbook") return TextbookShape();
  if (lower == "llama-3-8b") return Llama3_8BShape();
  return absl::InvalidArgumentError(
      absl::StrCat("unknown model preset '", name, "' (textbook, llama-3-8b)"));
}

RooflineShape ShapeFromConfig(const text::ModelConfig& config) {
  RooflineShape s;
  s.hidden = config.hidden_size;
  s.heads = config.num_heads;
  s.kv_heads = config.num_kv_heads;
  s.head_dim = config.head_dim;
  s.intermediate = config.intermediate_size;
  s.layers = config.num_layers;
  s.vocab = config.vocab_size;
  s.dtype_bytes = DTypeSize(config.torch_dtype);
  return s;
}

const char* BoundName(Bound bound) { return bound == Bound::kCompute ? "compute" : "bandwidth"; }

const OperatorCost* PhaseReport::Find(const std::string& name) const {
  for (const OperatorCost& c : operators) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

absl::StatusOr<RooflineReport> AnalyzeRoofline(const RooflineShape& shape,
                                               const HardwareProfile& hardware) {
  TANDEM_RETURN_IF_ERROR(shape.Validate());
  if (!(hardware.peak_flops > 0) || !(hardware.bandwidth_bytes > 0)) {
    return absl::InvalidArgumentError("hardware peak FLOP/s and bandwidth must be positive");
  }
  RooflineReport r;
  r.hardware = hardware;
  r.shape = shape;
  const double b = static_cast<double>(shape.batch);
  const double t = static_cast<double>(shape.seq_len);
  r.prefill = Summarize("prefill", b * t, PhaseOperators(shape, {b, t, t}), hardware);
  r.decode = Summarize("decode", b, PhaseOperators(shape, {b, 1, t}), hardware);
  return r;
}

double DecodeWeightBytes(const RooflineShape& s) {
  const double h = static_cast<double>(s.hidden);
  const double q_width = static_cast<double>(s.heads * s.head_dim);
  const double kv_width = static_cast<double>(s.kv_heads * s.head_dim);
  const double inter = static_cast<double>(s.intermediate);
  const double projections = h * (q_width + 2 * kv_width) + q_width * h + 3 * h * inter;
  const double d = static_cast<double>(s.dtype_bytes);
  const double per_layer = s.ProjectionBytes() * projections + d * 2 * h;  // + two norm weights
  return static_cast<double>(s.layers) * per_layer + d * (h + h * static_cast<double>(s.vocab));
}

nlohmann::json RooflineReport::ToJson() const {
  return {{"hardware",
           {{"name", hardware.name},
            {"peak_tflops", hardware.peak_flops / kFlopsPerTFlop},
            {"bandwidth_gb_per_s", hardware.bandwidth_bytes / kBytesPerGB},
            {"ridge_flop_per_byte", hardware.RidgeIntensity()}}},
          {"shape",
           {{"hidden", shape.hidden},
            {"heads", shape.heads},
            {"kv_heads", shape.kv_heads},
            {"head_dim", shape.head_dim},
            {"intermediate", shape.intermediate},
            {"layers", shape.layers},
            {"vocab", shape.vocab},
            {"batch", shape.batch},
            {"seq_len", shape.seq_len},
            {"dtype_bytes", shape.dtype_bytes},
            {"weight_bytes", shape.ProjectionBytes()},
            {"kv_bytes", shape.KvBytes()}}},
          {"prefill", PhaseJson(prefill)},
          {"decode", PhaseJson(decode)}};
}

std::string RooflineReport::ToText() const {
  std::string out = absl::StrCat(
      "hardware ", hardware.name, ": ", Format("%.1f", hardware.peak_flops / kFlopsPerTFlop),
      " TFLOP/s, ", Format("%.0f", hardware.bandwidth_bytes / kBytesPerGB),
      " GB/s (GB = 2^30 bytes), ridge ", Format("%.2f", hardware.RidgeIntensity()), " FLOP/byte\n");
  absl::StrAppend(&out, "model: H=", shape.hidden, " heads=", shape.heads,
                  " kv_heads=", shape.kv_heads, " D=", shape.head_dim, " H'=", shape.intermediate,
                  " layers=", shape.layers, " vocab=", shape.vocab,
                  " dtype_bytes=", shape.dtype_bytes,
                  " weight_bytes=", Format("%.4g", shape.ProjectionBytes()),
                  " kv_bytes=", Format("%.4g", shape.KvBytes()), "; B=", shape.batch,
                  " T=", shape.seq_len, "\n\n");
  absl::StrAppend(&out, PhaseText(prefill), "\n", PhaseText(decode));
  return out;
}

}  // namespace tandem::tools
