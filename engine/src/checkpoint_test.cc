#include "tandem/engine/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tandem/text/model_config.h"
#include "text/src/model_config_test_support.h"

namespace tandem::engine {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::AllOf;
using ::testing::HasSubstr;
using text::TinyConfig;

// ---------------------------------------------------------------------------------------------
// Helpers: checkpoints built with SafetensorsWriter (config.json from TinyConfig).

// A distinct value per (tensor, element), exactly representable in bf16 and f16.
float ValueFor(const std::string& name, int64_t i) {
  size_t h = std::hash<std::string>()(name) % 251;
  return static_cast<float>((static_cast<int64_t>(h) + i * 7) % 61 - 30) / 16.0f;
}

std::string ShardName(int i, int n) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "model-%05d-of-%05d.safetensors", i + 1, n);
  return buf;
}

std::string OpenError(const std::string& dir) {
  return std::string(Checkpoint::Open(dir).status().message());
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = absl::StrCat(info->test_suite_name(), "_", info->name());
    for (char& c : name) {
      if (c == '/') c = '_';
    }
    dir_ =
        (fs::temp_directory_path() / absl::StrCat("tandem_ckpt_", ::getpid(), "_", name)).string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  void WriteText(const std::string& file, const std::string& text) {
    std::ofstream(dir_ + "/" + file, std::ios::binary) << text;
  }

  // Writes config.json and every expected tensor (minus `skip`), in `shards` files.
  void WriteCheckpoint(const json& config_json, DType dtype, int shards = 1,
                       const std::string& skip = "") {
    WriteText("config.json", config_json.dump(2));
    auto config = text::ModelConfig::FromJson(config_json.dump(), "config.json");
    ASSERT_TRUE(config.ok()) << config.status();
    std::vector<SafetensorsWriter> writers(shards);
    json weight_map = json::object();
    int i = 0;
    for (const auto& [name, shape] : ExpectedTensors(*config)) {
      if (name == skip) continue;
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      std::vector<float> values(n);
      for (int64_t k = 0; k < n; ++k) values[k] = ValueFor(name, k);
      int shard = i++ % shards;
      writers[shard].AddFloat(name, dtype, shape, values);
      weight_map[name] = ShardName(shard, shards);
    }
    if (shards == 1) {
      ASSERT_TRUE(writers[0].Write(dir_ + "/model.safetensors").ok());
      return;
    }
    for (int s = 0; s < shards; ++s) {
      ASSERT_TRUE(writers[s].Write(dir_ + "/" + ShardName(s, shards)).ok());
    }
    WriteText("model.safetensors.index.json",
              json({{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}}).dump());
  }

  // A safetensors file with a hand-written header, for layouts the writer refuses to produce.
  void WriteRaw(const std::string& file, const std::string& header, size_t data_bytes) {
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(header.size() >> (8 * i));
    out += header;
    out.append(data_bytes, '\0');
    WriteText(file, out);
  }

  std::string dir_;
};

// ---------------------------------------------------------------------------------------------
// Loading good checkpoints.

struct LoadCase {
  std::string arch;
  DType dtype;
  int shards;
};

class CheckpointLoadTest : public CheckpointTest, public ::testing::WithParamInterface<LoadCase> {};

TEST_P(CheckpointLoadTest, LoadsEveryTensorWithItsValues) {
  const LoadCase& p = GetParam();
  ASSERT_NO_FATAL_FAILURE(WriteCheckpoint(TinyConfig(p.arch), p.dtype, p.shards));
  auto ckpt = Checkpoint::Open(dir_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  const text::ModelConfig& c = (*ckpt)->config();
  EXPECT_EQ(c.attention_bias, p.arch == "qwen2" || p.arch == "llama-bias");
  EXPECT_EQ(c.o_proj_bias, p.arch == "llama-bias");
  EXPECT_EQ(c.qk_norm, p.arch == "qwen3");
  EXPECT_EQ(c.tie_word_embeddings, p.arch == "qwen2");
  EXPECT_EQ(c.head_dim, p.arch == "qwen3" ? 16 : 8);

  int64_t params = 0;
  for (const auto& [name, shape] : ExpectedTensors(c)) {
    auto view = (*ckpt)->Tensor(name);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->dtype, p.dtype) << name;
    EXPECT_EQ(view->shape, shape) << name;
    if (p.shards > 1) EXPECT_THAT(view->file, HasSubstr("-of-0000")) << name;
    auto values = (*ckpt)->ReadFloat(name);
    ASSERT_TRUE(values.ok());
    ASSERT_EQ(static_cast<int64_t>(values->size()), view->NumElements());
    for (size_t k = 0; k < values->size(); ++k) {
      ASSERT_EQ((*values)[k], ValueFor(name, k)) << name << "[" << k << "]";
    }
    params += view->NumElements();
  }
  EXPECT_EQ(c.NumParameters(), params);
  EXPECT_EQ((*ckpt)->Tensor("lm_head.weight").ok(), !c.tie_word_embeddings);
  EXPECT_FALSE((*ckpt)->Tensor("model.layers.9.mlp.up_proj.weight").ok());
}

INSTANTIATE_TEST_SUITE_P(
    ArchDtypeShards, CheckpointLoadTest,
    ::testing::Values(LoadCase{"llama", DType::kF32, 1}, LoadCase{"llama", DType::kBF16, 1},
                      LoadCase{"llama", DType::kF16, 1}, LoadCase{"mistral", DType::kBF16, 1},
                      LoadCase{"qwen2", DType::kF32, 1}, LoadCase{"qwen2", DType::kBF16, 1},
                      LoadCase{"qwen3", DType::kF32, 1}, LoadCase{"qwen3", DType::kBF16, 1},
                      LoadCase{"llama", DType::kBF16, 3}, LoadCase{"qwen2", DType::kF32, 2},
                      LoadCase{"qwen3", DType::kBF16, 4}, LoadCase{"llama-bias", DType::kF32, 1}),
    [](const auto& info) {
      std::string arch = info.param.arch;
      std::replace(arch.begin(), arch.end(), '-', '_');
      return absl::StrCat(arch, "_", DTypeName(info.param.dtype), "_", info.param.shards, "shard");
    });

TEST_F(CheckpointTest, IgnoresExtraTensors) {
  auto config = text::ModelConfig::FromJson(TinyConfig("llama").dump(), "config.json");
  ASSERT_TRUE(config.ok());
  WriteText("config.json", TinyConfig("llama").dump());
  SafetensorsWriter writer;
  for (const auto& [name, shape] : ExpectedTensors(*config)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    writer.AddFloat(name, DType::kF32, shape, std::vector<float>(n, 0.5f));
  }
  // Older exports carry the rotary inverse frequencies as a buffer.
  writer.AddFloat("model.layers.0.self_attn.rotary_emb.inv_freq", DType::kF32, {4}, {1, 2, 3, 4});
  ASSERT_TRUE(writer.Write(dir_ + "/model.safetensors").ok());
  auto ckpt = Checkpoint::Open(dir_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->ReadFloat("model.norm.weight")->at(0), 0.5f);
}

TEST_F(CheckpointTest, RefusesTruncatedFile) {
  ASSERT_NO_FATAL_FAILURE(WriteCheckpoint(TinyConfig("llama"), DType::kBF16));
  const std::string path = dir_ + "/model.safetensors";
  fs::resize_file(path, fs::file_size(path) - 1);
  // The writer lays tensors out in the order added (sorted by name), so model.norm.weight is
  // last and the one cut short.
  EXPECT_THAT(OpenError(dir_),
              AllOf(HasSubstr(path), HasSubstr("truncated"), HasSubstr("model.norm.weight")));
}

TEST_F(CheckpointTest, RefusesHeaderLengthBeyondFile) {
  ASSERT_NO_FATAL_FAILURE(WriteCheckpoint(TinyConfig("llama"), DType::kBF16));
  const std::string path = dir_ + "/model.safetensors";
  const uint64_t size = fs::file_size(path);
  auto set_header_length = [&](uint64_t length) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(length >> (8 * i));
    f.write(reinterpret_cast<const char*>(le), 8);
  };
  set_header_length(size);
  EXPECT_THAT(OpenError(dir_),
              AllOf(HasSubstr(path), HasSubstr("header length"), HasSubstr("beyond the file")));
  set_header_length(uint64_t{1} << 40);
  EXPECT_THAT(OpenError(dir_), AllOf(HasSubstr(path), HasSubstr("not sane")));
  fs::resize_file(path, 5);
  EXPECT_THAT(OpenError(dir_), AllOf(HasSubstr(path), HasSubstr("truncated")));
}

TEST_F(CheckpointTest, RefusesMisshapedTensor) {
  WriteText("config.json", TinyConfig("llama").dump());
  // 2x3 F32 needs 24 bytes; the offsets give 20.
  WriteRaw("model.safetensors",
           R"({"model.norm.weight":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 24);
  EXPECT_THAT(OpenError(dir_),
              AllOf(HasSubstr(dir_ + "/model.safetensors"), HasSubstr("model.norm.weight"),
                    HasSubstr("misshaped"), HasSubstr("[2, 3]")));
}

TEST_F(CheckpointTest, RefusesReversedOffsetsAndBadHeaderJson) {
  WriteText("config.json", TinyConfig("llama").dump());
  WriteRaw("model.safetensors",
           R"({"model.norm.weight":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8);
  EXPECT_THAT(OpenError(dir_), AllOf(HasSubstr("model.norm.weight"), HasSubstr("reversed")));
  WriteRaw("model.safetensors", R"({"model.norm.weight":{"dtype":)", 8);
  EXPECT_THAT(OpenError(dir_),
              AllOf(HasSubstr(dir_ + "/model.safetensors"), HasSubstr("bad JSON header")));
}

TEST_F(CheckpointTest, RefusesTensorOfTheWrongShape) {
  ASSERT_NO_FATAL_FAILURE(WriteCheckpoint(TinyConfig("llama"), DType::kF32));
  json j = TinyConfig("llama");
  j["intermediate_size"] = 40;  // the weights were written for 48
  WriteText("config.json", j.dump());
  EXPECT_THAT(OpenError(dir_),
              AllOf(HasSubstr(dir_ + "/model.safetensors"),
                    HasSubstr("tensor model.layers.0.mlp.down_proj.weight has shape [32, 48], "
                              "expected [32, 40]")));
}

TEST_F(CheckpointTest, RefusesUnknownArchitecture) {
  ASSERT_NO_FATAL_FAILURE(WriteCheckpoint(TinyConfig("llama"), DType::kF32));
  json j = TinyConfig("llama");
  j["architectures"] = {"GPT2LMHeadModel"};
  WriteText("config.json", j.dump());
  EXPECT_THAT(OpenError(dir_), AllOf(HasSubstr(dir_ + "/config.json"),
                                     HasSubstr("unsupported architecture GPT2LMHeadModel")));
}

TEST_F(CheckpointTest, RefusesMissingTensor) {
  ASSERT_NO_FATAL_FAILURE(
      WriteCheckpoint(TinyConfig("llama"), DType::kBF16, 1, "model.layers.1.mlp.up_proj.weight"));
  EXPECT_THAT(
      OpenError(dir_),
      HasSubstr(dir_ + "/model.safetensors: missing tensor model.layers.1.mlp.up_proj.weight"));
}

TEST_F(CheckpointTest, RefusesMissingQwenBiasAndQkNorm) {
  ASSERT_NO_FATAL_FAILURE(WriteCheckpoint(TinyConfig("qwen2"), DType::kBF16, 1,
                                          "model.layers.0.self_attn.q_proj.bias"));
  EXPECT_THAT(OpenError(dir_), HasSubstr("missing tensor model.layers.0.self_attn.q_proj.bias"));
  ASSERT_NO_FATAL_FAILURE(WriteCheckpoint(TinyConfig("qwen3"), DType::kBF16, 1,
                                          "model.layers.1.self_attn.k_norm.weight"));
  EXPECT_THAT(OpenError(dir_), HasSubstr("missing tensor model.layers.1.self_attn.k_norm.weight"));
}

TEST_F(CheckpointTest, RefusesUnsupportedDtype) {
  WriteText("config.json", TinyConfig("llama").dump());
  WriteRaw("model.safetensors",
           R"({"__metadata__":{"format":"pt"},)"
           R"("model.embed_tokens.weight":{"dtype":"U8","shape":[96,32],"data_offsets":[0,3072]}})",
           3072);
  EXPECT_THAT(OpenError(dir_),
              AllOf(HasSubstr(dir_ + "/model.safetensors"), HasSubstr("model.embed_tokens.weight"),
                    HasSubstr("unsupported dtype U8")));
}

// I8 and I32 are read (the integer tensors of quantised checkpoints), but a tensor the model
// multiplies as floats must hold floats.
TEST_F(CheckpointTest, RefusesIntegersWhereFloatsAreExpected) {
  ASSERT_NO_FATAL_FAILURE(WriteCheckpoint(TinyConfig("llama"), DType::kF32));
  SafetensorsWriter writer;
  auto file = SafetensorsFile::Open(dir_ + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  for (const auto& [name, view] : (*file)->tensors()) {
    if (name == "model.norm.weight") {
      std::vector<int8_t> ints(view.NumElements(), 1);
      writer.Add(name, DType::kI8, view.shape, ints.data(), ints.size());
    } else {
      writer.Add(name, view.dtype, view.shape, view.data, view.nbytes);
    }
  }
  file->reset();
  ASSERT_TRUE(writer.Write(dir_ + "/model.safetensors").ok());
  EXPECT_THAT(OpenError(dir_), AllOf(HasSubstr("model.norm.weight"),
                                     HasSubstr("holds I8, expected F32, F16 or BF16")));
}

TEST_F(CheckpointTest, RefusesMissingOrBadConfig) {
  ASSERT_NO_FATAL_FAILURE(WriteCheckpoint(TinyConfig("llama"), DType::kF32));
  fs::remove(dir_ + "/config.json");
  absl::Status missing = Checkpoint::Open(dir_).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr(dir_ + "/config.json"));
  WriteText("config.json", R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 32,)");
  EXPECT_THAT(OpenError(dir_), AllOf(HasSubstr(dir_ + "/config.json"), HasSubstr("bad JSON")));
}

TEST_F(CheckpointTest, RefusesDirectoryWithoutWeights) {
  WriteText("config.json", TinyConfig("llama").dump());
  EXPECT_THAT(OpenError(dir_), AllOf(HasSubstr(dir_), HasSubstr("no model.safetensors or "
                                                                "model.safetensors.index.json")));
}

TEST_F(CheckpointTest, RefusesIndexPointingToMissingShard) {
  ASSERT_NO_FATAL_FAILURE(WriteCheckpoint(TinyConfig("qwen3"), DType::kBF16, 3));
  fs::remove(dir_ + "/" + ShardName(1, 3));
  EXPECT_THAT(OpenError(dir_),
              AllOf(HasSubstr(dir_ + "/model.safetensors.index.json"), HasSubstr("tensor model."),
                    HasSubstr(ShardName(1, 3)), HasSubstr("cannot open")));
}

TEST_F(CheckpointTest, RefusesIndexNamingTheWrongShard) {
  ASSERT_NO_FATAL_FAILURE(WriteCheckpoint(TinyConfig("llama"), DType::kBF16, 2));
  auto index = json::parse(std::ifstream(dir_ + "/model.safetensors.index.json"));
  const std::string name = "model.norm.weight";
  const std::string wrong =
      index["weight_map"][name] == ShardName(0, 2) ? ShardName(1, 2) : ShardName(0, 2);
  index["weight_map"][name] = wrong;
  WriteText("model.safetensors.index.json", index.dump());
  EXPECT_THAT(OpenError(dir_), AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr(name),
                                     HasSubstr(wrong), HasSubstr("does not hold it")));
}

TEST_F(CheckpointTest, RefusesMissingTensorInShardedIndex) {
  ASSERT_NO_FATAL_FAILURE(
      WriteCheckpoint(TinyConfig("qwen2"), DType::kBF16, 2, "model.layers.0.mlp.gate_proj.weight"));
  EXPECT_THAT(OpenError(dir_), HasSubstr(dir_ + "/model.safetensors.index.json: missing tensor "
                                                "model.layers.0.mlp.gate_proj.weight"));
}

TEST_F(CheckpointTest, RefusesUnknownRopeScalingType) {
  ASSERT_NO_FATAL_FAILURE(WriteCheckpoint(TinyConfig("llama"), DType::kF32));
  json j = TinyConfig("llama");
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  WriteText("config.json", j.dump());
  EXPECT_THAT(OpenError(dir_), AllOf(HasSubstr(dir_ + "/config.json"),
                                     HasSubstr("unsupported rope_scaling type yarn")));
}

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter.

TEST_F(CheckpointTest, WriterAlignsDataAndStreamsGeneratedTensors) {
  SafetensorsWriter writer;
  writer.AddFloat("a", DType::kF16, {3}, {0.5f, -2.0f, 65504.0f});
  writer.AddGenerated("b", DType::kBF16, {2, 3}, [](int64_t first, int64_t count, float* out) {
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(first + i) * 0.25f;
  });
  const uint16_t raw[2] = {FloatToBf16(1.5f), FloatToBf16(-3.0f)};
  writer.Add("c", DType::kBF16, {2}, raw, sizeof(raw));
  EXPECT_EQ(writer.TotalBytes(), 6u + 12u + 4u);
  const std::string path = dir_ + "/w.safetensors";
  ASSERT_TRUE(writer.Write(path).ok());

  // 8-byte length, header padded with spaces to a multiple of 8, then the data.
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(bytes[i]);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + header_len + 22);
  auto header = json::parse(bytes.substr(8, header_len));
  EXPECT_EQ(header["__metadata__"]["format"], "pt");
  EXPECT_EQ(header["b"]["dtype"], "BF16");

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<float> a(3), b(6), c(2);
  file.value()->tensors().at("a").ToFloat(a.data());
  file.value()->tensors().at("b").ToFloat(b.data());
  file.value()->tensors().at("c").ToFloat(c.data());
  EXPECT_EQ(a, (std::vector<float>{0.5f, -2.0f, 65504.0f}));
  EXPECT_EQ(b, (std::vector<float>{0, 0.25f, 0.5f, 0.75f, 1.0f, 1.25f}));
  EXPECT_EQ(c, (std::vector<float>{1.5f, -3.0f}));
  // The temporary file was renamed into place, not left beside it.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir_)) files += entry.is_regular_file();
  EXPECT_EQ(files, 1);
}

// Resident kilobytes of the mapping holding `addr` (/proc/self/smaps "Rss:").
int64_t MappedRssKb(const void* addr) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  const auto a = reinterpret_cast<uintptr_t>(addr);
  bool inside = false;
  while (std::getline(smaps, line)) {
    unsigned long begin = 0, end = 0;  // a mapping's first line: "begin-end perms ..."
    if (std::sscanf(line.c_str(), "%lx-%lx ", &begin, &end) == 2) {
      inside = a >= begin && a < end;
      continue;
    }
    if (inside && line.rfind("Rss:", 0) == 0) return std::stoll(line.substr(4));
  }
  return -1;
}

// A tensor copied out of the mapping can leave resident memory (a served model then holds its
// weights once, not twice), and reads the same when touched again.
TEST_F(CheckpointTest, DroppedPagesLeaveResidentMemoryAndReadTheSame) {
  constexpr int64_t kElements = 4 << 20;  // 16 MiB of f32
  SafetensorsWriter writer;
  writer.AddGenerated("w", DType::kF32, {kElements}, [](int64_t first, int64_t count, float* out) {
    for (int64_t i = 0; i < count; ++i) out[i] = ValueFor("w", first + i);
  });
  const std::string path = dir_ + "/w.safetensors";
  ASSERT_TRUE(writer.Write(path).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const TensorView& w = file.value()->tensors().at("w");
  std::vector<float> first(kElements), again(kElements);
  w.ToFloat(first.data());
  const int64_t touched = MappedRssKb(w.data);
  EXPECT_GE(touched, 15 * 1024) << "reading the tensor makes its pages resident";
  file.value()->file().DropPages(w.data, w.nbytes);
  EXPECT_LT(MappedRssKb(w.data), 1024);
  w.ToFloat(again.data());
  EXPECT_EQ(first, again);
  for (int64_t i : {int64_t{0}, kElements / 2, kElements - 1}) {
    EXPECT_EQ(again[i], ValueFor("w", i));
  }
  EXPECT_GE(MappedRssKb(w.data), 15 * 1024);
  file.value()->file().DropAllPages();
  EXPECT_LT(MappedRssKb(w.data), 1024);
}

}  // namespace
}  // namespace tandem::engine
