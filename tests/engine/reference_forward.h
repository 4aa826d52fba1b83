// Runs the independent float64 NumPy forward pass (tests/reference/reference_forward.py) on a
// checkpoint, for the engine's numerical tests.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace tandem::testing {

struct Reference {
  std::vector<std::vector<double>> logits;  // [prompt position][vocab]
  std::vector<int32_t> greedy_tokens;
  std::vector<double> embedding;  // the last prompt token's final hidden state, unit norm
};

// The reference's logits at every prompt position and `steps` greedy tokens after the prompt.
// `kv_dtype` ("float64": none) rounds K and V as a KV cache of that type (reference_forward.py
// --kv-dtype) stores them. Needs TANDEM_PYTHON (a compile definition) and TANDEM_SOURCE_DIR
// (the environment).
inline Reference RunReference(const std::string& model, const std::vector<int32_t>& tokens,
                              int steps, const std::string& kv_dtype = "float64") {
  // One file per run, so tests running at once on one model never read each other's.
  const std::string out =
      absl::StrCat(model, "/reference-", steps, "-", kv_dtype, "-",
                   std::hash<std::string>()(absl::StrJoin(tokens, ",")), ".json");
  std::string cmd = absl::StrCat(TANDEM_PYTHON, " ", std::getenv("TANDEM_SOURCE_DIR"),
                                 "/tests/reference/reference_forward.py --model ", model,
                                 " --tokens ", absl::StrJoin(tokens, ","), " --greedy-steps ",
                                 steps, " --kv-dtype ", kv_dtype, " --out ", out);
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(out);
  nlohmann::json j = nlohmann::json::parse(in);
  return {j.at("logits").get<std::vector<std::vector<double>>>(),
          j.at("greedy_tokens").get<std::vector<int32_t>>(),
          j.at("embedding").get<std::vector<double>>()};
}

}  // namespace tandem::testing
