#include "tandem/proto/kv_layout_check.h"

#include <functional>
#include <ostream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem::proto {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr char kLayerMajor[] = "layer[2][blocks][block_size][kv_heads][head_dim]";

// A Llama-3-8B-like cache (8 KV heads), rank 1 of 2.
tandem::v1::KvLayout Layout() {
  tandem::v1::KvLayout layout;
  layout.set_dtype(tandem::v1::KV_DTYPE_BF16);
  layout.set_block_size(16);
  layout.set_num_layers(32);
  layout.set_num_kv_heads(4);
  layout.set_head_dim(128);
  layout.set_tp_size(2);
  layout.set_tp_rank(1);
  layout.set_layout_name(kLayerMajor);
  layout.set_kv_head_begin(4);
  layout.set_total_kv_heads(8);
  return layout;
}

const char* const kFields[] = {"dtype",    "block_size", "num_layers", "total_kv_heads",
                               "head_dim", "layout_name"};

TEST(CheckLayoutCompatibleTest, IdenticalLayoutsAreCompatible) {
  EXPECT_TRUE(CheckLayoutCompatible(Layout(), Layout()).ok());
}

struct FieldCase {
  const char* field;
  std::function<void(tandem::v1::KvLayout*)> change_receiver;
  const char* expected;  // "<field> <sender> vs <receiver>"
  friend void PrintTo(const FieldCase& c, std::ostream* os) { *os << c.field; }
};

class OneFieldMismatchTest : public ::testing::TestWithParam<FieldCase> {};

TEST_P(OneFieldMismatchTest, IsRefusedNamingThatFieldOnly) {
  const FieldCase& c = GetParam();
  tandem::v1::KvLayout receiver = Layout();
  c.change_receiver(&receiver);
  absl::Status status = CheckLayoutCompatible(Layout(), receiver);
  ASSERT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(c.expected));
  EXPECT_THAT(std::string(status.message()), HasSubstr("KV layout mismatch"));
  for (const char* other : kFields) {
    if (std::string(other) == c.field) continue;
    // "tp_size" mismatches must not be reported as a "tp_rank" one and so on.
    EXPECT_THAT(std::string(status.message()), Not(HasSubstr(std::string(other) + " ")))
        << "only " << c.field << " differs";
  }
}

INSTANTIATE_TEST_SUITE_P(
    EachField, OneFieldMismatchTest,
    ::testing::Values(
        FieldCase{"dtype", [](auto* l) { l->set_dtype(tandem::v1::KV_DTYPE_F32); },
                  "dtype BF16 vs F32"},
        FieldCase{"block_size", [](auto* l) { l->set_block_size(32); }, "block_size 16 vs 32"},
        FieldCase{"num_layers", [](auto* l) { l->set_num_layers(28); }, "num_layers 32 vs 28"},
        FieldCase{"total_kv_heads",
                  [](auto* l) {
                    l->set_total_kv_heads(16);
                    l->set_kv_head_begin(8);
                  },
                  "total_kv_heads 8 vs 16"},
        FieldCase{"head_dim", [](auto* l) { l->set_head_dim(64); }, "head_dim 128 vs 64"},
        FieldCase{"layout_name", [](auto* l) { l->set_layout_name("blocks[layer][2]"); },
                  "layout_name \"layer[2][blocks][block_size][kv_heads][head_dim]\" vs "
                  "\"blocks[layer][2]\""}),
    [](const ::testing::TestParamInfo<FieldCase>& info) { return std::string(info.param.field); });

TEST(CheckLayoutCompatibleTest, NamesEveryMismatchWithBothValues) {
  tandem::v1::KvLayout receiver;
  receiver.set_dtype(tandem::v1::KV_DTYPE_FP8_E4M3);
  receiver.set_block_size(32);
  receiver.set_num_layers(28);
  receiver.set_num_kv_heads(4);
  receiver.set_total_kv_heads(4);
  receiver.set_head_dim(64);
  receiver.set_tp_size(1);
  receiver.set_tp_rank(0);
  receiver.set_layout_name("other");
  absl::Status status = CheckLayoutCompatible(Layout(), receiver);
  ASSERT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_EQ(status.message(),
            "KV layout mismatch (sender vs receiver): dtype BF16 vs FP8_E4M3; block_size 16 vs "
            "32; num_layers 32 vs 28; total_kv_heads 8 vs 4; head_dim 128 vs 64; layout_name "
            "\"layer[2][blocks][block_size][kv_heads][head_dim]\" vs \"other\"");
}

TEST(CheckLayoutCompatibleTest, TwoMismatchesAreBothNamed) {
  tandem::v1::KvLayout receiver = Layout();
  receiver.set_head_dim(64);
  receiver.set_dtype(tandem::v1::KV_DTYPE_F32);
  absl::Status status = CheckLayoutCompatible(Layout(), receiver);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("head_dim 128 vs 64"), HasSubstr("dtype BF16 vs F32")));
}

TEST(CheckLayoutCompatibleTest, GroupsOfDifferentDegreesAreCompatible) {
  // Prefill over 2 ranks, decode over 1 or 4: the sender maps heads between the ranks.
  tandem::v1::KvLayout whole = Layout();
  whole.set_tp_size(1);
  whole.set_tp_rank(0);
  whole.set_kv_head_begin(0);
  whole.set_num_kv_heads(8);
  EXPECT_TRUE(CheckLayoutCompatible(Layout(), whole).ok());
  tandem::v1::KvLayout quarter = Layout();
  quarter.set_tp_size(4);
  quarter.set_tp_rank(3);
  quarter.set_kv_head_begin(6);
  quarter.set_num_kv_heads(2);
  EXPECT_TRUE(CheckLayoutCompatible(whole, quarter).ok());
}

TEST(ValidateLayoutTest, RefusesHeadsOutsideTheModels) {
  tandem::v1::KvLayout layout = Layout();
  layout.set_kv_head_begin(6);  // heads [6, 10) of 8
  absl::Status status = ValidateLayout(layout);
  ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("kv_head_begin 6"));
  layout = Layout();
  layout.clear_total_kv_heads();
  EXPECT_THAT(std::string(ValidateLayout(layout).message()), HasSubstr("total_kv_heads 0"));
}

// A receiver of two ranks, as a decode worker's reservation describes it.
tandem::v1::TransferEndpoint GroupEndpoint() {
  tandem::v1::TransferEndpoint group;
  for (int r = 0; r < 2; ++r) {
    tandem::v1::TransferEndpoint* rank = group.add_tp_ranks();
    rank->set_backend("ucx");
    rank->set_address(std::string("agent-") + std::to_string(r));
    rank->add_region_descriptors("d");
    rank->set_num_blocks(64);
    *rank->mutable_layout() = Layout();
    rank->mutable_layout()->set_tp_rank(r);
    rank->mutable_layout()->set_kv_head_begin(4 * r);
  }
  tandem::v1::TransferEndpoint rank0 = group.tp_ranks(0);
  rank0.mutable_tp_ranks()->Swap(group.mutable_tp_ranks());
  return rank0;
}

TEST(CheckTransferEndpointTest, ChecksEveryRankOfAGroup) {
  tandem::v1::KvLayout sender = Layout();
  sender.set_tp_size(1);
  sender.set_tp_rank(0);
  sender.set_kv_head_begin(0);
  sender.set_num_kv_heads(8);
  tandem::v1::TransferEndpoint group = GroupEndpoint();
  EXPECT_TRUE(CheckTransferEndpoint(sender, "ucx", group, "reservation.endpoint", "me").ok());

  tandem::v1::TransferEndpoint missing = group;
  missing.mutable_tp_ranks()->RemoveLast();
  EXPECT_THAT(std::string(CheckTransferEndpoint(sender, "ucx", missing, "e", "me").message()),
              HasSubstr("group of 2 ranks but lists 1"));

  tandem::v1::TransferEndpoint swapped = group;
  swapped.mutable_tp_ranks(1)->mutable_layout()->set_tp_rank(0);
  EXPECT_THAT(std::string(CheckTransferEndpoint(sender, "ucx", swapped, "e", "me").message()),
              HasSubstr("e.tp_ranks[1] is rank 0 of 2"));

  tandem::v1::TransferEndpoint no_address = group;
  no_address.mutable_tp_ranks(1)->clear_address();
  EXPECT_THAT(std::string(CheckTransferEndpoint(sender, "ucx", no_address, "e", "me").message()),
              HasSubstr("e.tp_ranks[1].address is empty"));
}

TEST(CheckLayoutCompatibleTest, UnsetLayoutIsInvalidNotCompatible) {
  // Two empty layouts agree field by field, but a peer that sent none must not pass.
  tandem::v1::KvLayout empty;
  absl::Status status = CheckLayoutCompatible(empty, empty);
  ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("sender"), HasSubstr("dtype UNSPECIFIED"), HasSubstr("block_size 0"),
                    HasSubstr("num_layers 0"), HasSubstr("num_kv_heads 0"), HasSubstr("head_dim 0"),
                    HasSubstr("tp_size 0"), HasSubstr("layout_name empty"),
                    HasSubstr("total_kv_heads 0")));
}

TEST(CheckLayoutCompatibleTest, InvalidReceiverIsNamedAsReceiver) {
  tandem::v1::KvLayout receiver = Layout();
  receiver.set_tp_rank(2);  // == tp_size
  absl::Status status = CheckLayoutCompatible(Layout(), receiver);
  ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), AllOf(HasSubstr("receiver"), HasSubstr("tp_rank 2")));
}

TEST(CheckLayoutCompatibleTest, UnknownDtypeFromNewerPeerIsRefusedByNumber) {
  tandem::v1::KvLayout sender = Layout();
  sender.set_dtype(static_cast<tandem::v1::KvDtype>(9));
  absl::Status status = CheckLayoutCompatible(sender, Layout());
  ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("dtype KvDtype(9)"));
}

TEST(ValidateLayoutTest, AcceptsUnshardedLayout) {
  tandem::v1::KvLayout layout = Layout();
  layout.set_tp_size(1);
  layout.set_tp_rank(0);
  EXPECT_TRUE(ValidateLayout(layout).ok());
  layout.set_tp_rank(-1);
  EXPECT_EQ(ValidateLayout(layout).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem::proto
