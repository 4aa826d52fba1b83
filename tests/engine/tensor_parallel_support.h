// Shared by the tensor-parallel tests: a rendezvous directory per group, and the comparison of
// a group's outputs with one engine's.
#pragma once

#include <stdlib.h>

#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tandem/engine/request.h"

namespace tandem::testing {

// A fresh temporary directory (the Gloo file store of one group), removed with the object.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix) {
    std::string pattern =
        (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
    path_ = ::mkdtemp(pattern.data());
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A group's outputs against one engine's: `steps` tokens each, the same tokens, and logprobs
// (and the top alternatives, the same tokens) within `tolerance`.
inline void ExpectTokensOfOneEngine(const std::vector<engine::RequestOutput>& expected,
                                    const std::vector<engine::RequestOutput>& got, int steps,
                                    double tolerance) {
  ASSERT_EQ(got.size(), expected.size());
  for (size_t r = 0; r < got.size(); ++r) {
    const engine::ChoiceDelta& want = expected[r].choices[0];
    const engine::ChoiceDelta& have = got[r].choices[0];
    ASSERT_EQ(want.token_ids.size(), static_cast<size_t>(steps));
    EXPECT_EQ(have.token_ids, want.token_ids) << expected[r].request_id;
    ASSERT_EQ(have.logprobs.size(), want.logprobs.size());
    for (size_t i = 0; i < want.logprobs.size(); ++i) {
      EXPECT_NEAR(have.logprobs[i], want.logprobs[i], tolerance)
          << expected[r].request_id << " token " << i;
    }
    ASSERT_EQ(have.top_logprobs.size(), want.top_logprobs.size());
    for (size_t i = 0; i < want.top_logprobs.size(); ++i) {
      ASSERT_EQ(have.top_logprobs[i].size(), want.top_logprobs[i].size());
      for (size_t k = 0; k < want.top_logprobs[i].size(); ++k) {
        EXPECT_EQ(have.top_logprobs[i][k].token, want.top_logprobs[i][k].token);
        EXPECT_NEAR(have.top_logprobs[i][k].logprob, want.top_logprobs[i][k].logprob, tolerance);
      }
    }
  }
}

}  // namespace tandem::testing
