// Weight-only quantised checkpoints: what config.json's `quantization_config` says, and the
// tensors each quantised linear layer stores on disk.
//
// Tandem reads three layouts, each as the tool that writes it stores it:
//   - compressed-tensors int8 (llm-compressor's W8A16; `quant_method: compressed-tensors`,
//     `format: int-quantized` or `naive-quantized`, one config group of 8-bit symmetric
//     per-channel int weights, no input activation quantisation): `<module>.weight` I8
//     [out, in] and `<module>.weight_scale` [out, 1] (F32, BF16 or F16); W = weight * scale.
//   - AWQ GEMM (AutoAWQ; `quant_method: awq`, `version: gemm`, `bits: 4`, `zero_point: true`):
//     `qweight` I32 [in, out / 8], `qzeros` I32 [in / group, out / 8], `scales` F16
//     [in / group, out]. Each int32 packs eight 4-bit values of consecutive output columns in
//     AWQ's interleaved order: nibble p (bits 4p..4p+3) holds column 8c + [0, 2, 4, 6, 1, 3, 5,
//     7][p] of word c. W[o, i] = (q[i, o] - zero[i / group, o]) * scale[i / group, o].
//   - GPTQ (AutoGPTQ / exllama's "gptq" checkpoint format; `quant_method: gptq`, `bits: 4`,
//     `desc_act` false or true, `sym` true or false): `qweight` I32 [in / 8, out], packing eight
//     consecutive input rows per word in order (nibble p of word r is input 8r + p); `qzeros`
//     I32 [groups, out / 8], packed sequentially along the output; `scales` F16 [groups, out];
//     `g_idx` I32 [in], the group of each input (act order scatters a group over the inputs).
//     The stored zero point is the real one minus 1 (AutoGPTQ's pack writes `zeros - 1`, its
//     kernels add 1 back): W[o, i] = (q[i, o] - (stored_zero[g, o] + 1)) * scale[g, o],
//     g = g_idx[i]. A symmetric checkpoint stores 7 (zero point 8).
// Modules named in `ignore` (compressed-tensors) or `modules_to_not_convert` (AWQ, GPTQ), and
// lm_head, stay unquantised `<module>.weight` tensors.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "tandem/base/half.h"

namespace tandem::engine {

enum class QuantMethod { kNone, kCompressedInt8, kAwq, kGptq };

struct QuantizationConfig {
  QuantMethod method = QuantMethod::kNone;
  int bits = 16;
  // Inputs per scale / zero point; compressed-tensors int8: 0 (one scale per output row).
  // GPTQ's -1 (one group per row) is stored as 0 as well.
  int group_size = 0;
  bool desc_act = false;  // GPTQ act order: g_idx is not i / group_size
  bool sym = true;        // GPTQ: symmetric (zero point 8)
  // Modules left unquantised: exact module names, suffixes ("lm_head") or, for
  // compressed-tensors, "re:" regular expressions.
  std::vector<std::string> ignore;

  // One line, e.g. "gptq 4-bit, group 128, act order, asymmetric".
  std::string Describe() const;
};

// config.json's `quantization_config` (method kNone when the object has none). Anything Tandem
// cannot serve exactly is refused with a one-line reason naming `source` and the field.
absl::StatusOr<QuantizationConfig> ParseQuantizationConfig(const nlohmann::json& config,
                                                           std::string_view source);

// Whether the linear layer `module` ("model.layers.3.mlp.down_proj") is stored quantised.
// lm_head and the embedding never are.
bool IsQuantizedLinear(const QuantizationConfig& config, const std::string& module);

// One tensor a quantised linear layer stores.
struct QuantizedTensorSpec {
  std::string name;
  std::vector<DType> dtypes;  // accepted element types
  std::vector<int64_t> shape;
  bool optional = false;  // GPTQ's g_idx may be absent without act order
};

// The tensors of quantised `module` of W[out, in]; an error if the shape cannot be stored so
// (a dimension that the packing or the group size does not divide).
absl::StatusOr<std::vector<QuantizedTensorSpec>> QuantizedTensors(const QuantizationConfig& config,
                                                                  const std::string& module,
                                                                  int64_t out, int64_t in);

}  // namespace tandem::engine
