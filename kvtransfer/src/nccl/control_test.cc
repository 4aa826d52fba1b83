// The nccl backend's control pieces on their own: addresses and frames off a byte stream.
#include "kvtransfer/src/nccl/control.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::kvtransfer::nccl {
namespace {

using ::testing::HasSubstr;

TEST(NcclAddressTest, ParsesHostPortAndIncarnation) {
  absl::StatusOr<ParsedAddress> a = ParseAddress("nccl:decode-0@10.0.0.6:41234#00000000000000ab");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "10.0.0.6");
  EXPECT_EQ(a->port, 41234);
  EXPECT_EQ(a->instance, 0xabu);
  // IPv6 in brackets; a name holding '@' or ':' is not mistaken for the host.
  a = ParseAddress("nccl:pool@a:b@[::1]:7#1f");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "::1");
  EXPECT_EQ(a->port, 7);
  EXPECT_EQ(a->instance, 0x1fu);
}

TEST(NcclAddressTest, RefusesAnythingElseSayingTheExpectedForm) {
  for (const char* bad : {"", "nccl:", "ucx:10.0.0.6:1#1", "nccl:n@10.0.0.6#1",
                          "nccl:n@10.0.0.6:0#1", "nccl:n@10.0.0.6:70000#1", "nccl:n@10.0.0.6:1#0",
                          "nccl:n@10.0.0.6:1#xyz", "nccl:n10.0.0.6:1#1", "nccl:n@:1#1"}) {
    absl::StatusOr<ParsedAddress> a = ParseAddress(bad);
    ASSERT_FALSE(a.ok()) << bad;
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(a.status().message(), HasSubstr("nccl:NAME@HOST:PORT#INSTANCE")) << bad;
  }
}

TEST(NcclFrameTest, FramesComeOffAStreamWholeAndInOrder) {
  std::string body;
  PutU64(&body, 42);
  PutU32(&body, 7);
  const std::string stream = EncodeFrame(kAccept, body) + EncodeFrame(kDone, "xyz");
  // Byte by byte, as a socket may deliver them: nothing until a frame is whole.
  std::string buffer;
  std::vector<std::pair<uint32_t, std::string>> got;
  for (char c : stream) {
    buffer += c;
    absl::StatusOr<std::optional<std::pair<uint32_t, std::string>>> f = TakeFrame(&buffer);
    ASSERT_TRUE(f.ok());
    if (f->has_value()) got.push_back(**f);
  }
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].first, kAccept);
  BodyReader reader(got[0].second);
  uint64_t seq = 0;
  uint32_t code = 0;
  ASSERT_TRUE(reader.U64(&seq) && reader.U32(&code));
  EXPECT_EQ(seq, 42u);
  EXPECT_EQ(code, 7u);
  EXPECT_TRUE(reader.empty());
  EXPECT_FALSE(reader.U32(&code));  // past the end
  EXPECT_EQ(got[1].first, kDone);
  EXPECT_EQ(got[1].second, "xyz");
  EXPECT_TRUE(buffer.empty());
}

TEST(NcclFrameTest, AFrameClaimingMoreThanTheLimitIsAnError) {
  std::string buffer;
  PutU32(&buffer, kTransfer);
  PutU32(&buffer, kMaxFrameBytes + 1);
  absl::StatusOr<std::optional<std::pair<uint32_t, std::string>>> f = TakeFrame(&buffer);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace tandem::kvtransfer::nccl
