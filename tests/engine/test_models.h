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

}  // namespace tandem::testing
