// Synthetic checkpoints shared by the integration tests, written once per build directory.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tandem/tools/synth_model.h"

namespace tandem::testing {

// Writes `options` (seed 7, so that every helper's weights are the same model's; another
// `seed` for a different model) under $TANDEM_BINARY_DIR/test-models/`name` (the temporary
// directory without it) unless a checkpoint is there already, and returns its path.
inline std::string SynthOnce(const std::string& name, tools::SynthModelOptions options,
                             uint64_t seed = 7) {
  const char* bin = std::getenv("TANDEM_BINARY_DIR");
  std::string root = bin != nullptr ? bin : std::filesystem::temp_directory_path().string();
  std::string dir = absl::StrCat(root, "/test-models/", name);
  if (!std::filesystem::exists(dir + "/config.json")) {
    options.out_dir = dir;
    options.seed = seed;
    absl::Status status = tools::WriteSyntheticModel(options);
    EXPECT_TRUE(status.ok()) << status;
  }
  return dir;
}

// Path of a tiny synthetic model of `arch` in `dtype`, created on first use.
inline std::string TinyModel(const std::string& arch, DType dtype = DType::kF32,
                             const std::string& preset = "tiny") {
  tools::SynthModelOptions options;
  options.preset = preset;
  options.arch = arch;
  options.dtype = dtype;
  return SynthOnce(absl::StrCat(preset, "-", arch, "-", DTypeName(dtype)), options);
}

// The tiny llama with only the first `vocab_size` token ids in its embedding and LM head (f32), for
// tests that count output distributions; created on first use.
inline std::string TinySmallVocabModel(int vocab_size) {
  tools::SynthModelOptions options;
  options.vocab_size = vocab_size;
  options.dtype = DType::kF32;
  return SynthOnce(absl::StrCat("tiny-llama-vocab", vocab_size), options);
}

// A draft for speculative decoding: TinyModel(arch, dtype)'s first layer, embedding, final norm
// and LM head as a model of its own (with `vocab_size`, TinySmallVocabModel(vocab_size)'s);
// created on first use.
inline std::string TinyDraftModel(const std::string& arch, DType dtype, int vocab_size = 0) {
  tools::SynthModelOptions options;
  options.arch = arch;
  options.vocab_size = vocab_size;
  options.num_layers = 1;
  options.dtype = dtype;
  return SynthOnce(absl::StrCat("tiny-", arch, "-", DTypeName(dtype),
                                vocab_size > 0 ? absl::StrCat("-vocab", vocab_size) : "",
                                "-draft1"),
                   options);
}

// A tiny synthetic model of `arch` with weight-only quantised linear layers (`quant`: int8, awq
// or gptq; groups of 32, as the tiny preset's 64-wide hidden size cannot hold 128), its other
// tensors of `dtype`; created on first use. The same seed as TinyModel: the float weights it
// quantises are TinyModel(arch, kF32, preset)'s. `preset` "small" gives head_dim 64, which the
// CUDA attention kernels have (tiny's is 16 or 32).
inline std::string TinyQuantModel(const std::string& arch, const std::string& quant,
                                  DType dtype = DType::kF16, bool desc_act = false,
                                  bool sym = true, int group_size = 32,
                                  const std::string& preset = "tiny") {
  tools::SynthModelOptions options;
  options.preset = preset;
  options.arch = arch;
  options.dtype = dtype;
  options.quant = quant;
  options.group_size = group_size;
  options.desc_act = desc_act;
  options.sym = sym;
  return SynthOnce(absl::StrCat(preset, "-", arch, "-", quant, "-", DTypeName(dtype),
                                desc_act ? "-act-order" : "", sym ? "" : "-asym",
                                group_size == 32 ? "" : absl::StrCat("-g", group_size)),
                   options);
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
