#include "tandem/proto/kv_layout_check.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tandem/base/status_macros.h"

namespace tandem::proto {
namespace {

using tandem::v1::KvDtype;
using tandem::v1::KvLayout;

// Appends "<field> <a> vs <b>" when the values differ.
template <typename T>
void CompareField(const char* field, const T& sender, const T& receiver,
                  std::vector<std::string>* mismatches) {
  if (sender != receiver) mismatches->push_back(absl::StrCat(field, " ", sender, " vs ", receiver));
}

std::string Quoted(const std::string& s) { return absl::StrCat("\"", s, "\""); }

}  // namespace

std::string KvDtypeName(KvDtype dtype) {
  switch (dtype) {
    case tandem::v1::KV_DTYPE_UNSPECIFIED:
      return "UNSPECIFIED";
    case tandem::v1::KV_DTYPE_F32:
      return "F32";
    case tandem::v1::KV_DTYPE_F16:
      return "F16";
    case tandem::v1::KV_DTYPE_BF16:
      return "BF16";
    case tandem::v1::KV_DTYPE_FP8_E4M3:
      return "FP8_E4M3";
    case tandem::v1::KV_DTYPE_FP8_E5M2:
      return "FP8_E5M2";
    default:
      // proto3 enums are open: a newer peer may send a value this build has no name for.
      return absl::StrCat("KvDtype(", static_cast<int>(dtype), ")");
  }
}

absl::Status ValidateLayout(const KvLayout& layout) {
  std::vector<std::string> problems;
  const KvDtype dtype = layout.dtype();
  if (dtype == tandem::v1::KV_DTYPE_UNSPECIFIED || !tandem::v1::KvDtype_IsValid(dtype)) {
    problems.push_back(absl::StrCat("dtype ", KvDtypeName(dtype), " (must be set)"));
  }
  auto positive = [&](const char* field, int32_t value) {
    if (value <= 0) problems.push_back(absl::StrCat(field, " ", value, " (must be > 0)"));
  };
  positive("block_size", layout.block_size());
  positive("num_layers", layout.num_layers());
  positive("num_kv_heads", layout.num_kv_heads());
  positive("head_dim", layout.head_dim());
  positive("tp_size", layout.tp_size());
  if (layout.tp_rank() < 0 || (layout.tp_size() > 0 && layout.tp_rank() >= layout.tp_size())) {
    problems.push_back(absl::StrCat("tp_rank ", layout.tp_rank(), " (must be in [0, tp_size ",
                                    layout.tp_size(), "))"));
  }
  if (layout.layout_name().empty()) problems.push_back("layout_name empty (must be set)");
  positive("total_kv_heads", layout.total_kv_heads());
  if (layout.kv_head_begin() < 0 ||
      (layout.total_kv_heads() > 0 &&
       layout.kv_head_begin() + layout.num_kv_heads() > layout.total_kv_heads())) {
    problems.push_back(absl::StrCat("kv_head_begin ", layout.kv_head_begin(), " (heads [",
                                    layout.kv_head_begin(), ", ",
                                    layout.kv_head_begin() + layout.num_kv_heads(),
                                    ") must lie in [0, total_kv_heads ", layout.total_kv_heads(),
                                    "))"));
  }
  if (problems.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("invalid KV layout: ", absl::StrJoin(problems, "; ")));
}

absl::Status CheckLayoutCompatible(const KvLayout& sender, const KvLayout& receiver) {
  if (absl::Status s = ValidateLayout(sender); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sender: ", s.message()));
  }
  if (absl::Status s = ValidateLayout(receiver); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("receiver: ", s.message()));
  }
  std::vector<std::string> mismatches;
  CompareField("dtype", KvDtypeName(sender.dtype()), KvDtypeName(receiver.dtype()), &mismatches);
  CompareField("block_size", sender.block_size(), receiver.block_size(), &mismatches);
  CompareField("num_layers", sender.num_layers(), receiver.num_layers(), &mismatches);
  CompareField("total_kv_heads", sender.total_kv_heads(), receiver.total_kv_heads(),
               &mismatches);
  CompareField("head_dim", sender.head_dim(), receiver.head_dim(), &mismatches);
  CompareField("layout_name", Quoted(sender.layout_name()), Quoted(receiver.layout_name()),
               &mismatches);
  if (mismatches.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("KV layout mismatch (sender vs receiver): ", absl::StrJoin(mismatches, "; ")));
}

namespace {

// CheckTransferEndpoint of one rank's endpoint, its tp_ranks aside.
absl::Status CheckRankEndpoint(const tandem::v1::KvLayout& sender,
                               const std::string& sender_backend,
                               const tandem::v1::TransferEndpoint& endpoint,
                               const std::string& name, const std::string& sender_name) {
  TANDEM_RETURN_IF_ERROR(CheckLayoutCompatible(sender, endpoint.layout()));
  if (endpoint.backend() != sender_backend) {
    return absl::FailedPreconditionError(absl::StrCat(name, ".backend is '", endpoint.backend(),
                                                      "' but ", sender_name, " sends KV with '",
                                                      sender_backend, "'"));
  }
  if (endpoint.address().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ".address is empty"));
  }
  if (endpoint.num_blocks() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ".num_blocks is ", endpoint.num_blocks(), ", not positive"));
  }
  const int num_descriptors = endpoint.region_descriptors_size();
  const int num_layers = sender.num_layers();
  if (num_descriptors != 1 && num_descriptors != num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(name, " has ", num_descriptors,
                                                   " region descriptors; want 1 (all layers) or ",
                                                   num_layers, " (one per layer)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTransferEndpoint(const tandem::v1::KvLayout& sender,
                                   const std::string& sender_backend,
                                   const tandem::v1::TransferEndpoint& endpoint,
                                   const std::string& name, const std::string& sender_name) {
  TANDEM_RETURN_IF_ERROR(CheckRankEndpoint(sender, sender_backend, endpoint, name, sender_name));
  const int tp_size = endpoint.layout().tp_size();
  if (tp_size == 1 && endpoint.tp_ranks_size() == 0) return absl::OkStatus();
  if (endpoint.tp_ranks_size() != tp_size) {
    return absl::InvalidArgumentError(absl::StrCat(name, " is a tensor-parallel group of ", tp_size,
                                                   " ranks but lists ", endpoint.tp_ranks_size(),
                                                   " rank endpoints"));
  }
  for (int r = 0; r < tp_size; ++r) {
    const tandem::v1::TransferEndpoint& rank = endpoint.tp_ranks(r);
    const std::string rank_name = absl::StrCat(name, ".tp_ranks[", r, "]");
    if (rank.tp_ranks_size() > 0) {
      return absl::InvalidArgumentError(absl::StrCat(rank_name, " lists ranks of its own"));
    }
    TANDEM_RETURN_IF_ERROR(CheckRankEndpoint(sender, sender_backend, rank, rank_name, sender_name));
    if (rank.layout().tp_size() != tp_size || rank.layout().tp_rank() != r) {
      return absl::InvalidArgumentError(absl::StrCat(rank_name, " is rank ",
                                                     rank.layout().tp_rank(), " of ",
                                                     rank.layout().tp_size()));
    }
  }
  return absl::OkStatus();
}

}  // namespace tandem::proto
