// The unpacked form of a quantised weight matrix (QuantizedWeightView): its checks and its
// dequantised values, the ones every backend's Linear multiplies by.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tandem/kernels/backend.h"

namespace tandem::kernels {

absl::Status ValidateQuantizedWeight(const QuantizedWeightView& w) {
  auto error = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantised weight [", w.n, ", ", w.k, "] (",
        w.group_starts != nullptr ? absl::StrCat(w.num_groups, " groups")
                                  : absl::StrCat("group ", w.group_size),
        "): ", what));
  };
  if (w.quant != WeightQuant::kInt8 && w.quant != WeightQuant::kInt4) {
    return error("not an int8 or int4 weight");
  }
  if (w.n <= 0 || w.k <= 0) return error("empty matrix");
  if (w.group_starts != nullptr) {
    if (w.quant != WeightQuant::kInt4) return error("only int4 weights have group bounds");
    if (w.num_groups <= 0 || w.group_starts[0] != 0 || w.group_starts[w.num_groups] != w.k) {
      return error("group bounds must run from 0 to k");
    }
    for (int g = 0; g < w.num_groups; ++g) {
      if (w.group_starts[g + 1] <= w.group_starts[g]) return error("an empty group");
    }
  } else {
    if (w.group_size <= 0 || w.k % w.group_size != 0) return error("group size must divide k");
    if (w.quant == WeightQuant::kInt8 && w.group_size != w.k) {
      return error("int8 weights have one scale per output row");
    }
  }
  if (w.values == nullptr || w.scales == nullptr) return error("no values or scales");
  if ((w.quant == WeightQuant::kInt4) != (w.zeros != nullptr)) {
    return error("int4 weights need zero points, int8 weights have none");
  }
  const int64_t elements = int64_t{w.n} * w.k;
  const int64_t group_entries = int64_t{w.n} * w.groups();
  if (w.quant == WeightQuant::kInt4) {
    for (int64_t i = 0; i < elements; ++i) {
      if (w.values[i] < 0 || w.values[i] > 15) return error("a 4-bit value outside 0..15");
    }
    for (int64_t i = 0; i < group_entries; ++i) {
      if (w.zeros[i] < 0 || w.zeros[i] > 16) return error("a zero point outside 0..16");
    }
  }
  if (w.k_order != nullptr) {
    std::vector<char> seen(w.k, 0);
    for (int j = 0; j < w.k; ++j) {
      const int32_t f = w.k_order[j];
      if (f < 0 || f >= w.k || seen[f]) return error("k_order is not a permutation of 0..k-1");
      seen[f] = 1;
    }
  }
  return absl::OkStatus();
}

std::vector<int32_t> GroupStarts(const QuantizedWeightView& w) {
  if (w.group_starts != nullptr) return {w.group_starts, w.group_starts + w.num_groups + 1};
  std::vector<int32_t> starts(w.groups() + 1);
  for (size_t g = 0; g < starts.size(); ++g) starts[g] = static_cast<int32_t>(g) * w.group_size;
  return starts;
}

std::vector<float> DequantizeWeight(const QuantizedWeightView& w) {
  std::vector<float> out(static_cast<size_t>(w.n) * w.k);
  const int groups = w.groups();
  const std::vector<int32_t> starts = GroupStarts(w);
  std::vector<int> group_of(w.k);
  for (int g = 0; g < groups; ++g) {
    std::fill(group_of.begin() + starts[g], group_of.begin() + starts[g + 1], g);
  }
  for (int r = 0; r < w.n; ++r) {
    for (int j = 0; j < w.k; ++j) {
      const int g = group_of[j];
      const int zero = w.zeros != nullptr ? w.zeros[int64_t{r} * groups + g] : 0;
      const float q = static_cast<float>(int{w.values[int64_t{r} * w.k + j]} - zero);
      const int feature = w.k_order != nullptr ? w.k_order[j] : j;
      out[int64_t{r} * w.k + feature] = q * w.scales[int64_t{r} * groups + g];
    }
  }
  return out;
}

}  // namespace tandem::kernels
