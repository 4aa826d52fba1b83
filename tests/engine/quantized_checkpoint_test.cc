// Weight-only quantised checkpoints (compressed-tensors int8, AWQ, GPTQ) as synth-model writes
// them: Tandem's dequantised weights against the independent NumPy dequantiser
// (tests/reference/dequantize.py), and the one-line refusals of configs Tandem cannot serve.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/engine/checkpoint.h"
#include "tandem/engine/llm_engine.h"
#include "tandem/engine/quantized_weights.h"
#include "test_models.h"

namespace tandem::engine {
namespace {

using ::testing::HasSubstr;

using testing::QuantCase;

class QuantizedCheckpointTest : public ::testing::TestWithParam<QuantCase> {};

// Every quantised layer, dequantised by Tandem's loader (ReadQuantizedMatrix + DequantizeWeight,
// the values its kernels multiply by), equals what dequantize.py computes from the files on its
// own, and lies within the quantisation step of the float weights it was rounded from.
TEST_P(QuantizedCheckpointTest, DequantisedWeightsMatchTheNumPyDequantiser) {
  const QuantCase& c = GetParam();
  const std::string model = c.Model();
  const std::string original = testing::TinyModel(c.arch, DType::kF32);
  auto checkpoint = Checkpoint::Open(model);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  ASSERT_NE((*checkpoint)->quantization().method, QuantMethod::kNone);
  const text::ModelConfig& config = (*checkpoint)->config();
  SafetensorsWriter writer;
  int layers = 0;
  bool any_act_order = false;
  for (const auto& [name, shape] : text::ExpectedTensors(config)) {
    const std::string module = name.substr(0, name.size() - std::string(".weight").size());
    if (shape.size() != 2 || !IsQuantizedLinear((*checkpoint)->quantization(), module)) continue;
    auto matrix = ReadQuantizedMatrix(**checkpoint, module, static_cast<int>(shape[0]),
                                      static_cast<int>(shape[1]));
    ASSERT_TRUE(matrix.ok()) << matrix.status();
    any_act_order = any_act_order || !matrix->k_order.empty();
    writer.AddFloat(name, DType::kF32, shape, kernels::DequantizeWeight(matrix->view()));
    ++layers;
  }
  EXPECT_EQ(layers, 7 * config.num_layers);  // q, k, v, o, gate, up, down
  EXPECT_EQ(any_act_order, c.desc_act);
  const std::string dequantized = absl::StrCat(model, "/tandem-dequantized.safetensors");
  ASSERT_TRUE(writer.Write(dequantized).ok());
  const std::string cmd = absl::StrCat(TANDEM_PYTHON, " ", std::getenv("TANDEM_SOURCE_DIR"),
                                       "/tests/reference/dequantize.py --model ", model,
                                       " --compare ", dequantized, " --original ", original);
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::filesystem::remove(dequantized);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, QuantizedCheckpointTest,
    ::testing::Values(QuantCase{"int8_bf16", "llama", "int8", DType::kBF16},
                      QuantCase{"int8_f32_qwen2", "qwen2", "int8", DType::kF32},
                      QuantCase{"awq", "llama", "awq", DType::kF16},
                      QuantCase{"awq_qwen3", "qwen3", "awq", DType::kBF16},
                      QuantCase{"gptq", "llama", "gptq", DType::kF16},
                      QuantCase{"gptq_act_order", "llama", "gptq", DType::kF16, true},
                      QuantCase{"gptq_act_order_asym", "llama", "gptq", DType::kF16, true, false},
                      QuantCase{"gptq_asym_mistral", "mistral", "gptq", DType::kF16, false, false}),
    [](const ::testing::TestParamInfo<QuantCase>& info) { return info.param.name; });

// What a tensor-parallel rank multiplies by is the layer's own: every layer split along its
// inputs into 2, 3 or 4 parts (groups cut, act-order groups scattered over the parts) dequantises
// to exactly the matching columns of the whole layer, and along its outputs to its rows.
TEST_P(QuantizedCheckpointTest, SlicesDequantiseToTheLayersOwnColumnsAndRows) {
  const QuantCase& c = GetParam();
  auto checkpoint = Checkpoint::Open(c.Model());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const text::ModelConfig& config = (*checkpoint)->config();
  int uneven = 0;
  for (const auto& [name, shape] : text::ExpectedTensors(config)) {
    const std::string module = name.substr(0, name.size() - std::string(".weight").size());
    if (shape.size() != 2 || !IsQuantizedLinear((*checkpoint)->quantization(), module)) continue;
    const int out = static_cast<int>(shape[0]);
    const int in = static_cast<int>(shape[1]);
    auto matrix = ReadQuantizedMatrix(**checkpoint, module, out, in);
    ASSERT_TRUE(matrix.ok()) << matrix.status();
    const std::vector<float> whole = kernels::DequantizeWeight(matrix->view());
    for (int parts : {2, 3, 4}) {
      for (int p = 0; p < parts; ++p) {
        const int begin = in * p / parts;
        const int count = in * (p + 1) / parts - begin;
        auto slice = SliceQuantizedCols(*matrix, begin, count);
        ASSERT_TRUE(slice.ok()) << module << ": " << slice.status();
        ASSERT_TRUE(kernels::ValidateQuantizedWeight(slice->view()).ok())
            << module << " " << begin << "+" << count << ": "
            << kernels::ValidateQuantizedWeight(slice->view());
        uneven += slice->group_starts.empty() ? 0 : 1;
        const std::vector<float> part = kernels::DequantizeWeight(slice->view());
        for (int r = 0; r < out; ++r) {
          for (int j = 0; j < count; ++j) {
            ASSERT_EQ(part[int64_t{r} * count + j], whole[int64_t{r} * in + begin + j])
                << module << " inputs [" << begin << ", " << begin + count << "), row " << r
                << ", input " << begin + j;
          }
        }
        const int row_begin = out * p / parts;
        const int rows = out * (p + 1) / parts - row_begin;
        const std::vector<float> row_part =
            kernels::DequantizeWeight(SliceQuantizedRows(*matrix, row_begin, rows).view());
        ASSERT_TRUE(std::equal(row_part.begin(), row_part.end(),
                               whole.begin() + int64_t{row_begin} * in))
            << module << " rows [" << row_begin << ", " << row_begin + rows << ")";
      }
    }
  }
  // Groups of 32 or 128 over the tiny preset's 64 and 160 inputs: thirds always cut groups.
  if (c.quant != "int8") {
    EXPECT_GT(uneven, 0);
  }
  EXPECT_FALSE(SliceQuantizedCols(*ReadQuantizedMatrix(**checkpoint,
                                                        "model.layers.0.mlp.down_proj",
                                                        config.hidden_size,
                                                        config.intermediate_size),
                                  config.intermediate_size - 1, 2)
                   .ok());
}

// A quantised checkpoint whose config.json's quantization_config is replaced by `edit` applied
// to it; returns the error Checkpoint::Open and LlmEngine::Create give.
class QuantizationConfigErrorTest : public ::testing::Test {
 protected:
  std::string OpenError(const std::string& quant,
                        const std::function<void(nlohmann::json&)>& edit) {
    const std::string source = testing::TinyQuantModel("llama", quant);
    const std::string dir =
        absl::StrCat(::testing::TempDir(), "/quant-config-", quant, "-", ++count_);
    std::filesystem::remove_all(dir);
    std::filesystem::copy(source, dir);
    nlohmann::json config = nlohmann::json::parse(std::ifstream(dir + "/config.json"));
    edit(config["quantization_config"]);
    std::ofstream(dir + "/config.json") << config.dump(2);
    auto checkpoint = Checkpoint::Open(dir);
    EXPECT_FALSE(checkpoint.ok());
    auto engine = LlmEngine::Create({.model_dir = dir, .num_threads = 1});
    EXPECT_FALSE(engine.ok());
    if (checkpoint.ok() || engine.ok()) return "";
    const std::string message(checkpoint.status().message());
    EXPECT_THAT(std::string(engine.status().message()), HasSubstr(message));
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
    EXPECT_THAT(message, HasSubstr(dir + "/"));
    return message;
  }
  int count_ = 0;
};

TEST_F(QuantizationConfigErrorTest, UnsupportedConfigsAreRefusedInOneLine) {
  EXPECT_THAT(OpenError("awq", [](nlohmann::json& q) { q["bits"] = 3; }),
              HasSubstr("bits 3: Tandem reads 4-bit awq checkpoints"));
  EXPECT_THAT(OpenError("gptq", [](nlohmann::json& q) { q["bits"] = 8; }),
              HasSubstr("bits 8: Tandem reads 4-bit gptq checkpoints"));
  EXPECT_THAT(OpenError("awq", [](nlohmann::json& q) { q["quant_method"] = "bitsandbytes"; }),
              HasSubstr("quant_method 'bitsandbytes' is not supported"));
  EXPECT_THAT(OpenError("awq", [](nlohmann::json& q) { q["version"] = "gemv"; }),
              HasSubstr("awq version 'gemv' is not supported"));
  EXPECT_THAT(OpenError("awq", [](nlohmann::json& q) { q["zero_point"] = false; }),
              HasSubstr("zero_point false"));
  EXPECT_THAT(OpenError("gptq", [](nlohmann::json& q) { q["checkpoint_format"] = "gptq_v2"; }),
              HasSubstr("checkpoint_format 'gptq_v2' is not supported"));
  EXPECT_THAT(OpenError("int8", [](nlohmann::json& q) { q["format"] = "pack-quantized"; }),
              HasSubstr("format 'pack-quantized' is not supported"));
  EXPECT_THAT(OpenError("int8",
                        [](nlohmann::json& q) {
                          q["config_groups"]["group_0"]["input_activations"] = {
                              {"num_bits", 8}, {"type", "int"}, {"strategy", "token"}};
                        }),
              HasSubstr("W8A8"));
  EXPECT_THAT(OpenError("int8",
                        [](nlohmann::json& q) {
                          q["config_groups"]["group_0"]["weights"]["num_bits"] = 4;
                        }),
              HasSubstr("num_bits 4"));
  // A group size that does not match the stored tensors: their shapes are refused by name.
  EXPECT_THAT(OpenError("gptq", [](nlohmann::json& q) { q["group_size"] = 16; }),
              HasSubstr("model.layers.0.mlp.down_proj.qzeros has shape [5, 8], expected [10, 8]"));
}

}  // namespace
}  // namespace tandem::engine
