// Roofline model of one decoder-only transformer step: per-operator FLOPs, bytes moved to and
// from device memory, arithmetic intensity and bound, for prefill and for decode.
//
// The counting follows the textbook analysis of LLM decoding efficiency (see docs/tools.md,
// "Roofline"), so that its reference numbers come out exactly: for B=8, T=1024, H=4096, D=128
// in 2-byte weights, the prefill linear layers have intensity 2730.7 FLOP/byte, prefill attention
// 114.7, decode linear layers 8.0 and decode attention 1.0; on an A100 (ridge 142.5) prefill is
// compute-bound and decode bandwidth-bound.
//
//   RooflineShape shape = TextbookShape();
//   absl::StatusOr<RooflineReport> report = AnalyzeRoofline(shape, *FindHardware("A100-80G"));
//   double decode_ms = report->decode.step_seconds * 1e3;
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "tandem/text/model_config.h"

namespace tandem::tools {

// One accelerator's roofline: peak dense throughput and peak memory bandwidth.
struct HardwareProfile {
  std::string name;
  double peak_flops = 0;       // FLOP/s
  double bandwidth_bytes = 0;  // bytes/s

  // FLOP/byte above which an operator is compute-bound.
  double RidgeIntensity() const { return peak_flops / bandwidth_bytes; }
};

// Bytes in one "GB" of a bandwidth figure. The textbook computes the A100's ridge as
// 312 TFLOP/s / 2039 GB/s = 142.51 FLOP/byte, which holds only with GB = 2^30 bytes; Tandem uses
// the same reading for presets and --bandwidth so its ridge and times agree with the book.
inline constexpr double kBytesPerGB = 1024.0 * 1024.0 * 1024.0;

// A profile from TFLOP/s (10^12 FLOP/s) and GB/s (kBytesPerGB bytes/s); errors when either is
// not positive.
absl::StatusOr<HardwareProfile> CustomHardware(double tflops, double gb_per_s);

// Presets, bf16 dense tensor-core peak: "A100-80G" (312 TFLOP/s, 2039 GB/s), "H100" (SXM:
// 989 TFLOP/s, 3350 GB/s), "H200" (989 TFLOP/s, 4800 GB/s). Names match case-insensitively.
absl::StatusOr<HardwareProfile> FindHardware(const std::string& name);
std::vector<std::string> HardwareNames();

// The model and batch shape the roofline is computed for.
struct RooflineShape {
  int64_t hidden = 0;        // H
  int64_t heads = 0;         // N (query heads)
  int64_t kv_heads = 0;      // key/value heads (N for multi-head attention)
  int64_t head_dim = 0;      // D
  int64_t intermediate = 0;  // H', the MLP width
  int64_t layers = 0;
  int64_t vocab = 0;
  int64_t batch = 1;        // B sequences
  int64_t seq_len = 1;      // T: prompt length in prefill, context length in decode
  int64_t dtype_bytes = 2;  // bytes per activation element, and weight and KV unless below
  // Bytes per element of the projection matrices (q/k/v, o, gate/up, down); 0: dtype_bytes.
  // Weight-only quantisation: 1 for int8, 0.5 plus a group's scale and zero point for int4
  // (WeightBytesOf). The embedding, norms and lm_head stay dtype_bytes.
  double weight_bytes = 0;
  // Bytes per KV cache element; 0: dtype_bytes (1 for an fp8 cache).
  double kv_bytes = 0;

  double ProjectionBytes() const {
    return weight_bytes > 0 ? weight_bytes : static_cast<double>(dtype_bytes);
  }
  double KvBytes() const { return kv_bytes > 0 ? kv_bytes : static_cast<double>(dtype_bytes); }

  absl::Status Validate() const;
};

// Bytes per projection weight of a --weight-dtype name: bfloat16|float16|float32 (their element
// size), int8 (1) or int4 (0.5 plus an fp16 scale and a 4-bit zero point per `group_size`
// inputs, as AWQ and GPTQ checkpoints store them). Errors name the flag.
absl::StatusOr<double> WeightBytesOf(const std::string& name, int group_size = 128);

// Sets shape's weight and KV element sizes from flag values: `weight_dtype` as WeightBytesOf
// takes it, `kv_dtype` bfloat16|float16|float32|fp8_e4m3|fp8_e5m2; "auto" (or empty) keeps the
// shape's. Errors name the flag.
absl::Status SetPrecision(const std::string& weight_dtype, const std::string& kv_dtype,
                          int group_size, RooflineShape* shape);

// Bytes per projection weight of a checkpoint whose config.json (`config_json_path`) carries a
// quantization_config (int8: 1; AWQ/GPTQ 4-bit: 0.5 plus a group's scale and zero point), or 0
// when it has none.
absl::StatusOr<double> CheckpointWeightBytes(const std::string& config_json_path);

// The textbook example: B=8, T=1024, H=4096, N=32, D=128 with a Llama-2-7B body (H'=11008,
// 32 layers, vocab 32000), 2-byte elements.
RooflineShape TextbookShape();
// Llama-3-8B: H=4096, 32 heads, 8 kv heads, H'=14336, 32 layers, vocab 128256.
RooflineShape Llama3_8BShape();
// Presets by name: "textbook", "llama-3-8b".
absl::StatusOr<RooflineShape> FindShape(const std::string& name);
// The model dimensions of a config.json (batch, seq_len and dtype_bytes are left at defaults,
// dtype_bytes from torch_dtype).
RooflineShape ShapeFromConfig(const text::ModelConfig& config);

// What limits an operator on a given profile.
enum class Bound { kCompute, kBandwidth };
const char* BoundName(Bound bound);

// One operator of one phase, summed over every layer it occurs in (`count` times).
struct OperatorCost {
  std::string name;
  std::string formula;   // what it computes, e.g. "Q,K,V = X W^{Q,K,V}"
  int64_t count = 1;     // occurrences per step (layers, or 1 for the head)
  double flops = 0;      // total over all occurrences
  double bytes = 0;      // total over all occurrences
  double intensity = 0;  // flops / bytes
  Bound bound = Bound::kBandwidth;
  double seconds = 0;  // max(flops / peak, bytes / bandwidth): time at the roofline
};

// One phase (prefill or decode) of one step.
struct PhaseReport {
  std::string phase;   // "prefill" or "decode"
  int64_t tokens = 0;  // new tokens processed in the step
  std::vector<OperatorCost> operators;
  double flops = 0;
  double bytes = 0;
  double intensity = 0;  // total flops / total bytes
  Bound bound = Bound::kBandwidth;
  double step_seconds = 0;  // sum of the operators' roofline times

  // The operator called `name`, or nullptr.
  const OperatorCost* Find(const std::string& name) const;
};

struct RooflineReport {
  HardwareProfile hardware;
  RooflineShape shape;
  PhaseReport prefill;  // B sequences of T prompt tokens
  PhaseReport decode;   // B sequences, one new token each, T tokens of context

  nlohmann::json ToJson() const;
  // Human-readable tables, one per phase, with totals.
  std::string ToText() const;
};

// Per-operator costs for both phases. Errors when the shape or the profile is invalid.
absl::StatusOr<RooflineReport> AnalyzeRoofline(const RooflineShape& shape,
                                               const HardwareProfile& hardware);

// Bytes of the weights a decode step reads once: every layer plus the final norm and lm_head
// (the embedding table is only gathered from).
double DecodeWeightBytes(const RooflineShape& shape);

}  // namespace tandem::tools
