#include "tandem/text/model_config.h"

#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "text/src/model_config_test_support.h"

namespace tandem::text {
namespace {

using nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(ModelConfigTest, ReadsLlama3RopeScalingAndEosList) {
  json j = TinyConfig("llama");
  j["eos_token_id"] = {128001, 128009};
  auto c = ModelConfig::FromJson(j.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, Architecture::kLlama);
  EXPECT_EQ(c->rope.head_dim, 8);
  EXPECT_FLOAT_EQ(c->rope.theta, 500000.0f);
  EXPECT_TRUE(c->rope.llama3_scaling);
  EXPECT_FLOAT_EQ(c->rope.factor, 8.0f);
  EXPECT_FLOAT_EQ(c->rope.high_freq_factor, 4.0f);
  EXPECT_EQ(c->rope.original_max_position, 32);
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{128001, 128009}));
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-5f);
}

TEST(ModelConfigTest, AppliesHuggingFaceDefaults) {
  json j = TinyConfig("mistral");
  j.erase("rope_theta");
  j.erase("num_key_value_heads");
  j.erase("torch_dtype");
  j.erase("rms_norm_eps");
  j["bos_token_id"] = nullptr;
  auto c = ModelConfig::FromJson(j.dump(), "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FLOAT_EQ(c->rope.theta, 10000.0f);
  EXPECT_FALSE(c->rope.llama3_scaling);
  EXPECT_EQ(c->num_kv_heads, 4);  // multi-head attention
  EXPECT_EQ(c->head_dim, 8);      // hidden / heads
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->torch_dtype, DType::kBF16);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_EQ(c->bos_token_id, -1);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{2});
}

TEST(ModelConfigTest, BiasesFollowTransformersPerArchitecture) {
  auto qwen2 = ModelConfig::FromJson(TinyConfig("qwen2").dump(), "config.json");
  ASSERT_TRUE(qwen2.ok());
  EXPECT_TRUE(qwen2->attention_bias);
  EXPECT_FLOAT_EQ(qwen2->rope.theta, 1e6f);
  EXPECT_TRUE(ExpectedTensors(*qwen2).count("model.layers.1.self_attn.v_proj.bias"));
  EXPECT_FALSE(ExpectedTensors(*qwen2).count("lm_head.weight"));

  json j = TinyConfig("llama");
  j["attention_bias"] = true;
  auto llama = ModelConfig::FromJson(j.dump(), "config.json");
  ASSERT_TRUE(llama.ok());
  EXPECT_TRUE(llama->attention_bias);
  EXPECT_TRUE(llama->o_proj_bias);
  EXPECT_FALSE(qwen2->o_proj_bias);
  EXPECT_EQ(ExpectedTensors(*llama).at("model.layers.0.self_attn.k_proj.bias"),
            (std::vector<int64_t>{16}));
  // transformers' LlamaAttention biases o_proj as well under attention_bias.
  EXPECT_EQ(ExpectedTensors(*llama).at("model.layers.1.self_attn.o_proj.bias"),
            (std::vector<int64_t>{32}));
  EXPECT_FALSE(ExpectedTensors(*qwen2).count("model.layers.0.self_attn.o_proj.bias"));

  // MistralAttention has no biases whatever the config says.
  j = TinyConfig("mistral");
  j["attention_bias"] = true;
  auto mistral = ModelConfig::FromJson(j.dump(), "config.json");
  ASSERT_TRUE(mistral.ok());
  EXPECT_FALSE(mistral->attention_bias);
  EXPECT_FALSE(ExpectedTensors(*mistral).count("model.layers.0.self_attn.q_proj.bias"));
}

TEST(ModelConfigTest, Qwen3ShapesFollowExplicitHeadDim) {
  auto c = ModelConfig::FromJson(TinyConfig("qwen3").dump(), "config.json");
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->qk_norm);
  auto t = ExpectedTensors(*c);
  EXPECT_EQ(t.at("model.layers.0.self_attn.q_proj.weight"), (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(t.at("model.layers.0.self_attn.o_proj.weight"), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(t.at("model.layers.0.self_attn.k_norm.weight"), (std::vector<int64_t>{16}));
  // embed 96x32; per layer: norms 2x32, q 64x32, k and v 32x32, o 32x64, q/k norms 2x16,
  // mlp 3x48x32; final norm 32; lm_head 96x32.
  int64_t per_layer = 64 + 2048 + 2 * 1024 + 2048 + 32 + 3 * 48 * 32;
  EXPECT_EQ(c->NumParameters(), 96 * 32 + 2 * per_layer + 32 + 96 * 32);
}

TEST(ModelConfigTest, RoundTripsThroughToJson) {
  for (const char* arch : {"llama", "mistral", "qwen2", "qwen3"}) {
    auto c = ModelConfig::FromJson(TinyConfig(arch).dump(), "config.json");
    ASSERT_TRUE(c.ok());
    auto back = ModelConfig::FromJson(c->ToJson(), "round trip");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->ToJson(), c->ToJson()) << arch;
    EXPECT_EQ(back->attention_bias, c->attention_bias) << arch;
    EXPECT_EQ(back->rope.llama3_scaling, c->rope.llama3_scaling) << arch;
    EXPECT_EQ(back->rms_norm_eps, c->rms_norm_eps) << arch;
    EXPECT_EQ(back->eos_token_ids, c->eos_token_ids) << arch;
    EXPECT_EQ(back->head_dim, c->head_dim) << arch;
  }
}

TEST(ModelConfigTest, RefusesInconsistentShapes) {
  json j = TinyConfig("llama");
  j["num_key_value_heads"] = 3;
  EXPECT_THAT(ModelConfig::FromJson(j.dump(), "m/config.json").status().message(),
              AllOf(HasSubstr("m/config.json"), HasSubstr("num_key_value_heads (3)")));
  j = TinyConfig("llama");
  j["hidden_size"] = 30;
  EXPECT_THAT(ModelConfig::FromJson(j.dump(), "m/config.json").status().message(),
              HasSubstr("divisible by num_attention_heads"));
  j = TinyConfig("llama");
  j["num_hidden_layers"] = 0;
  EXPECT_THAT(ModelConfig::FromJson(j.dump(), "m/config.json").status().message(),
              HasSubstr("\"num_hidden_layers\" must be a positive integer"));
  j = TinyConfig("llama");
  j.erase("vocab_size");
  EXPECT_THAT(ModelConfig::FromJson(j.dump(), "m/config.json").status().message(),
              HasSubstr("missing required field \"vocab_size\""));
}

TEST(ModelConfigTest, RopeScalingDefaultTypeMeansNone) {
  json j = TinyConfig("llama");
  j["rope_scaling"] = {{"type", "default"}};
  auto c = ModelConfig::FromJson(j.dump(), "config.json");
  ASSERT_TRUE(c.ok());
  EXPECT_FALSE(c->rope.llama3_scaling);
}

// ---------------------------------------------------------------------------------------------
// Malformed checkpoints: each refused with a message naming the file and what is wrong.

}  // namespace
}  // namespace tandem::text
