#include "tandem/base/host_port.h"

#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(SplitHostPortTest, SplitsAtTheLastColon) {
  auto v4 = SplitHostPort("10.0.0.5:7001");
  ASSERT_TRUE(v4.ok());
  EXPECT_EQ(v4->first, "10.0.0.5");
  EXPECT_EQ(v4->second, 7001);
  auto v6 = SplitHostPort("[::1]:0");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->first, "::1");
  EXPECT_EQ(v6->second, 0);
}

TEST(SplitHostPortTest, RefusesWhatIsNotHostPort) {
  for (const char* bad : {"localhost", ":80", "host:", "host:http", "host:65536", "host:-1"}) {
    auto r = SplitHostPort(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(std::string(r.status().message()).find(bad), std::string::npos) << bad;
  }
}

}  // namespace
}  // namespace tandem
