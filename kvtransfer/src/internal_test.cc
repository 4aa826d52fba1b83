#include "kvtransfer/src/internal.h"

#include <cstdint>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::kvtransfer::internal {
namespace {

using ::testing::HasSubstr;

RegionDescriptor Sample() {
  RegionDescriptor d;
  d.backend = BackendKind::kUcx;
  d.owner_instance = 0x1234567890abcdefull;
  d.region_id = 7;
  d.generation = 3;
  d.base = 0x7f0000001000ull;
  d.bytes = 1 << 20;
  d.payload = std::string("remote-key\0bytes", 16);
  return d;
}

TEST(DescriptorTest, RoundTripsEveryField) {
  absl::StatusOr<RegionDescriptor> d =
      DecodeDescriptor(EncodeDescriptor(Sample()), BackendKind::kUcx);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->owner_instance, Sample().owner_instance);
  EXPECT_EQ(d->region_id, 7u);
  EXPECT_EQ(d->generation, 3u);
  EXPECT_EQ(d->base, Sample().base);
  EXPECT_EQ(d->bytes, uint64_t{1} << 20);
  EXPECT_EQ(d->payload, Sample().payload);
}

TEST(DescriptorTest, EveryCorruptedByteIsRefused) {
  const std::string good = EncodeDescriptor(Sample());
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] ^= 0x01;
    EXPECT_TRUE(absl::IsInvalidArgument(DecodeDescriptor(bad, BackendKind::kUcx).status()))
        << "byte " << i;
  }
  for (size_t size = 0; size < good.size(); ++size) {
    EXPECT_TRUE(
        absl::IsInvalidArgument(DecodeDescriptor(good.substr(0, size), BackendKind::kUcx).status()))
        << "truncated to " << size;
  }
  EXPECT_TRUE(absl::IsInvalidArgument(DecodeDescriptor(good + "x", BackendKind::kUcx).status()));
}

TEST(CudaIpcDescriptorTest, PayloadRoundTripsInsideADescriptor) {
  RegionDescriptor d = Sample();
  d.backend = BackendKind::kCudaIpc;
  const std::string handle(CudaIpcPayload::kHandleBytes, '\x5a');
  d.payload = EncodeCudaIpcPayload({.handle = handle, .pid = 4242, .device = 3});
  absl::StatusOr<RegionDescriptor> back =
      DecodeDescriptor(EncodeDescriptor(d), BackendKind::kCudaIpc);
  ASSERT_TRUE(back.ok()) << back.status();
  absl::StatusOr<CudaIpcPayload> payload = DecodeCudaIpcPayload(back->payload);
  ASSERT_TRUE(payload.ok()) << payload.status();
  EXPECT_EQ(payload->handle, handle);
  EXPECT_EQ(payload->pid, 4242u);
  EXPECT_EQ(payload->device, 3);
}

TEST(CudaIpcDescriptorTest, MalformedPayloadsAndOtherBackendsAreRefused) {
  const std::string good =
      EncodeCudaIpcPayload({.handle = std::string(CudaIpcPayload::kHandleBytes, 'h'), .pid = 7});
  for (const std::string& bad : {std::string(), good.substr(1), good + "x",
                                 EncodeCudaIpcPayload({.handle = "h", .pid = 0})}) {
    EXPECT_TRUE(absl::IsInvalidArgument(DecodeCudaIpcPayload(bad).status())) << bad.size();
  }
  RegionDescriptor d = Sample();
  d.backend = BackendKind::kCudaIpc;
  d.payload = good;
  const std::string encoded = EncodeDescriptor(d);
  for (BackendKind other : {BackendKind::kLocal, BackendKind::kUcx}) {
    const absl::Status status = DecodeDescriptor(encoded, other).status();
    EXPECT_TRUE(absl::IsInvalidArgument(status));
    EXPECT_THAT(status.message(), HasSubstr("\"cuda_ipc\""));
  }
  EXPECT_THAT(DecodeDescriptor(EncodeDescriptor(Sample()), BackendKind::kCudaIpc).status().message(),
              HasSubstr("\"ucx\""));
}

TEST(DescriptorTest, AnotherBackendsDescriptorIsRefusedByName) {
  const absl::Status status =
      DecodeDescriptor(EncodeDescriptor(Sample()), BackendKind::kLocal).status();
  EXPECT_TRUE(absl::IsInvalidArgument(status));
  EXPECT_THAT(status.message(), HasSubstr("\"ucx\""));
}

TEST(CheckRangesTest, AcceptsRangesEndingExactlyAtTheRegionEnd) {
  EXPECT_TRUE(CheckRanges({{0, 0, 100}, {60, 90, 40}, {100, 130, 0}}, 100, 130).ok());
}

TEST(CheckRangesTest, RefusesRangesPastEitherEndWithoutOverflowing) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  EXPECT_THAT(CheckRanges({{0, 0, 10}, {91, 0, 10}}, 100, 100).message(),
              HasSubstr("range 1 reads"));
  EXPECT_THAT(CheckRanges({{0, 95, 10}}, 100, 100).message(), HasSubstr("range 0 writes"));
  EXPECT_FALSE(CheckRanges({{kMax - 4, 0, 8}}, 100, 100).ok());
  EXPECT_FALSE(CheckRanges({{0, kMax - 4, 8}}, 100, 100).ok());
  EXPECT_FALSE(CheckRanges({{0, 0, kMax}}, 100, 100).ok());
}

TEST(CoalesceRangesTest, MergesOnlyRangesContiguousOnBothSides) {
  const std::vector<Range> merged = CoalesceRanges(
      {{0, 100, 10}, {10, 110, 5}, {15, 200, 5}, {20, 205, 0}, {20, 205, 5}, {0, 0, 0}});
  ASSERT_EQ(merged.size(), 2u);
  EXPECT_EQ(merged[0].src_offset, 0u);
  EXPECT_EQ(merged[0].dst_offset, 100u);
  EXPECT_EQ(merged[0].bytes, 15u);
  EXPECT_EQ(merged[1].src_offset, 15u);
  EXPECT_EQ(merged[1].dst_offset, 200u);
  EXPECT_EQ(merged[1].bytes, 10u);
}

TEST(TransferStateTest, ReportedTimeoutStaysReportedAfterALateCompletion) {
  TransferState state(absl::Now() - absl::Seconds(1));
  EXPECT_TRUE(absl::IsDeadlineExceeded(state.Wait()));
  state.Finish(absl::OkStatus());
  EXPECT_TRUE(absl::IsDeadlineExceeded(*state.Poll()));
}

TEST(TransferStateTest, CompletionBeforeTheDeadlineIsReported) {
  TransferState state(absl::Now() + absl::Hours(1));
  EXPECT_FALSE(state.Poll().has_value());
  state.Finish(absl::UnavailableError("peer lost"));
  EXPECT_TRUE(absl::IsUnavailable(state.Wait()));
}

}  // namespace
}  // namespace tandem::kvtransfer::internal
