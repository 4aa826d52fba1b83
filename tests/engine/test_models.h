// Synthetic checkpoints shared by the integration tests, written once per build directory.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tandem/tools/synth_model.h"

namespace tandem::testing {

// Path of a tiny synthetic model of `arch` in `dtype`, created on first use.
inline std::string TinyModel(const std::string& arch, DType dtype = DType::kF32,
                             const std::string& preset = "tiny") {
  const char* bin = std::getenv("TANDEM_BINARY_DIR");
  std::string root = bin != nullptr ? bin : std::filesystem::temp_directory_path().string();
  std::string dir = absl::StrCat(root, "/test-models/", preset, "-", arch, "-", DTypeName(dtype));
  if (!std::filesystem::exists(dir + "/config.json")) {
    tools::SynthModelOptions options;
    options.out_dir = dir;
    options.preset = preset;
    options.arch = arch;
    options.dtype = dtype;
    options.seed = 7;
    absl::Status status = tools::WriteSyntheticModel(options);
    EXPECT_TRUE(status.ok()) << status;
  }
  return dir;
}

// The tiny llama with only the first `vocab_size` token ids in its embedding and LM head (f32), for
// tests that count output distributions; created on first use.
inline std::string TinySmallVocabModel(int vocab_size) {
  const char* bin = std::getenv("TANDEM_BINARY_DIR");
  std::string root = bin != nullptr ? bin : std::filesystem::temp_directory_path().string();
  std::string dir = absl::StrCat(root, "/test-models/tiny-llama-vocab", vocab_size);
  if (!std::filesystem::exists(dir + "/config.json")) {
    tools::SynthModelOptions options;
    options.out_dir = dir;
    options.dtype = DType::kF32;
    options.seed = 7;
    options.vocab_size = vocab_size;
    absl::Status status = tools::WriteSyntheticModel(options);
    EXPECT_TRUE(status.ok()) << status;
  }
  return dir;
}

// A draft for speculative decoding: TinyModel(arch, dtype)'s first layer, embedding, final norm
// and LM head as a model of its own (with `vocab_size`, TinySmallVocabModel(vocab_size)'s);
// created on first use.
inline std::string TinyDraftModel(const std::string& arch, DType dtype, int vocab_size = 0) {
  const char* bin = std::getenv("TANDEM_BINARY_DIR");
  std::string root = bin != nullptr ? bin : std::filesystem::temp_directory_path().string();
  std::string dir = absl::StrCat(root, "/test-models/tiny-", arch, "-", DTypeName(dtype),
                                 vocab_size > 0 ? absl::StrCat("-vocab", vocab_size) : "",
                                 "-draft1");
  if (!std::filesystem::exists(dir + "/config.json")) {
    tools::SynthModelOptions options;
    options.out_dir = dir;
    options.arch = arch;
    options.dtype = dtype;
    options.seed = 7;
    options.vocab_size = vocab_size;
    options.num_layers = 1;
    absl::Status status = tools::WriteSyntheticModel(options);
    EXPECT_TRUE(status.ok()) << status;
  }
  return dir;
}

// A tiny synthetic model of `arch` with weight-only quantised linear layers (`quant`: int8, awq
// or gptq; groups of 32, as the tiny preset's 64-wide hidden size cannot hold 128), its other
// tensors of `dtype`; created on first use. The same seed as TinyModel: the float weights it
// quantises are TinyModel(arch, kF32)'s.
inline std::string TinyQuantModel(const std::string& arch, const std::string& quant,
                                  DType dtype = DType::kF16, bool desc_act = false,
                                  bool sym = true) {
  const char* bin = std::getenv("TANDEM_BINARY_DIR");
  std::string root = bin != nullptr ? bin : std::filesystem::temp_directory_path().string();
  std::string dir =
      absl::StrCat(root, "/test-models/tiny-", arch, "-", quant, "-", DTypeName(dtype),
                   desc_act ? "-act-order" : "", sym ? "" : "-asym");
  if (!std::filesystem::exists(dir + "/config.json")) {
    tools::SynthModelOptions options;
    options.out_dir = dir;
    options.arch = arch;
    options.dtype = dtype;
    options.seed = 7;
    options.quant = quant;
    options.group_size = 32;
    options.desc_act = desc_act;
    options.sym = sym;
    absl::Status status = tools::WriteSyntheticModel(options);
    EXPECT_TRUE(status.ok()) << status;
  }
  return dir;
}

// A quantised tiny checkpoint that a parameterised test runs on; `name` names the test case.
struct QuantCase {
  std::string name;
  std::string arch;
  std::string quant;  // int8, awq, gptq
  DType dtype;        // of the unquantised tensors (and the default KV cache)
  bool desc_act = false;
  bool sym = true;

  std::string Model() const { return TinyQuantModel(arch, quant, dtype, desc_act, sym); }
};

}  // namespace tandem::testing
