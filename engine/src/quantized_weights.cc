#include "tandem/engine/quantized_weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/quantization_config.h"

namespace tandem::engine {
namespace {

using kernels::WeightQuant;

// AWQ's GEMM packing: nibble p of a word holds output column kAwqOrder[p] of its eight.
constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

int32_t Word(const TensorView& t, int64_t i) {
  int32_t v;
  std::memcpy(&v, static_cast<const unsigned char*>(t.data) + 4 * i, 4);
  return v;
}

int Nibble(int32_t word, int p) {
  return static_cast<int>((static_cast<uint32_t>(word) >> (4 * p)) & 15u);
}

}  // namespace

kernels::QuantizedWeightView QuantizedMatrix::view() const {
  return {.quant = quant,
          .n = n,
          .k = k,
          .group_size = group_size,
          .values = values.data(),
          .scales = scales.data(),
          .zeros = zeros.empty() ? nullptr : zeros.data(),
          .k_order = k_order.empty() ? nullptr : k_order.data(),
          .group_starts = group_starts.empty() ? nullptr : group_starts.data(),
          .num_groups = group_starts.empty() ? 0 : static_cast<int>(group_starts.size()) - 1};
}

absl::StatusOr<QuantizedMatrix> ReadQuantizedMatrix(const Checkpoint& checkpoint,
                                                    const std::string& module, int out, int in) {
  const QuantizationConfig& config = checkpoint.quantization();
  TANDEM_ASSIGN_OR_RETURN(std::vector<QuantizedTensorSpec> specs,
                          QuantizedTensors(config, module, out, in));
  // Checkpoint::Open has checked presence, dtypes and shapes already.
  auto tensor = [&](const std::string& suffix) { return checkpoint.Tensor(module + "." + suffix); };
  QuantizedMatrix m;
  m.n = out;
  m.k = in;
  m.values.resize(static_cast<size_t>(out) * in);
  switch (config.method) {
    case QuantMethod::kNone:
      return absl::InvalidArgumentError(absl::StrCat(module, " is not quantised"));
    case QuantMethod::kCompressedInt8: {
      TANDEM_ASSIGN_OR_RETURN(TensorView weight, tensor("weight"));
      TANDEM_ASSIGN_OR_RETURN(TensorView scale, tensor("weight_scale"));
      m.quant = WeightQuant::kInt8;
      m.group_size = in;
      std::memcpy(m.values.data(), weight.data, m.values.size());
      m.scales.resize(out);
      scale.ToFloat(m.scales.data());
      break;
    }
    case QuantMethod::kAwq: {
      TANDEM_ASSIGN_OR_RETURN(TensorView qweight, tensor("qweight"));
      TANDEM_ASSIGN_OR_RETURN(TensorView qzeros, tensor("qzeros"));
      TANDEM_ASSIGN_OR_RETURN(TensorView scales, tensor("scales"));
      m.quant = WeightQuant::kInt4;
      m.group_size = config.group_size;
      const int groups = in / m.group_size;
      const int words = out / 8;
      // qweight [in, out / 8]: word (i, c) holds columns 8c .. 8c + 7 of input row i. Blocks of
      // kBlock inputs, so each output row receives kBlock consecutive bytes at a time.
      constexpr int64_t kBlock = 64;
      for (int64_t i0 = 0; i0 < in; i0 += kBlock) {
        const int64_t i1 = std::min<int64_t>(in, i0 + kBlock);
        for (int c = 0; c < words; ++c) {
          for (int64_t i = i0; i < i1; ++i) {
            const int32_t word = Word(qweight, i * words + c);
            for (int p = 0; p < 8; ++p) {
              m.values[(int64_t{8} * c + kAwqOrder[p]) * in + i] =
                  static_cast<int8_t>(Nibble(word, p));
            }
          }
        }
      }
      std::vector<float> s(static_cast<size_t>(groups) * out);  // [groups, out]
      scales.ToFloat(s.data());
      m.scales.resize(s.size());
      m.zeros.resize(s.size());
      for (int g = 0; g < groups; ++g) {
        for (int c = 0; c < words; ++c) {
          const int32_t word = Word(qzeros, int64_t{g} * words + c);
          for (int p = 0; p < 8; ++p) {
            const int64_t o = int64_t{8} * c + kAwqOrder[p];
            m.zeros[o * groups + g] = static_cast<int8_t>(Nibble(word, p));
          }
        }
        for (int64_t o = 0; o < out; ++o) m.scales[o * groups + g] = s[int64_t{g} * out + o];
      }
      break;
    }
    case QuantMethod::kGptq: {
      TANDEM_ASSIGN_OR_RETURN(TensorView qweight, tensor("qweight"));
      TANDEM_ASSIGN_OR_RETURN(TensorView qzeros, tensor("qzeros"));
      TANDEM_ASSIGN_OR_RETURN(TensorView scales, tensor("scales"));
      m.quant = WeightQuant::kInt4;
      m.group_size = config.group_size > 0 ? config.group_size : in;
      const int groups = in / m.group_size;
      // The group of each input: g_idx when stored, else consecutive groups.
      std::vector<int32_t> g_idx(in);
      for (int i = 0; i < in; ++i) g_idx[i] = i / m.group_size;
      if (auto stored = tensor("g_idx"); stored.ok()) {
        for (int i = 0; i < in; ++i) {
          g_idx[i] = Word(*stored, i);
          if (g_idx[i] < 0 || g_idx[i] >= groups) {
            return absl::InvalidArgumentError(absl::StrCat(stored->file, ": ", stored->name, "[", i,
                                                           "] = ", g_idx[i], " is not a group of ",
                                                           groups));
          }
        }
      }
      // Inputs sorted by group (stable): canonical column j is input k_order[j]. Every group must
      // then fill exactly group_size columns.
      std::vector<int32_t> order(in);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return g_idx[a] < g_idx[b]; });
      bool identity = true;
      for (int j = 0; j < in; ++j) {
        if (g_idx[order[j]] != j / m.group_size) {
          return absl::InvalidArgumentError(
              absl::StrCat(module, ".g_idx: groups of unequal size (each of the ", groups,
                           " groups must hold ", m.group_size, " inputs)"));
        }
        identity = identity && order[j] == j;
      }
      if (!identity) m.k_order = order;
      // qweight [in / 8, out]: nibble p of word (r, o) is input 8r + p of column o.
      for (int64_t r = 0; r < in / 8; ++r) {
        for (int64_t o = 0; o < out; ++o) {
          const int32_t word = Word(qweight, r * out + o);
          for (int p = 0; p < 8; ++p)
            m.values[o * in + 8 * r + p] = static_cast<int8_t>(Nibble(word, p));
        }
      }
      if (!identity) {
        std::vector<int8_t> row(in);
        for (int64_t o = 0; o < out; ++o) {
          int8_t* values = m.values.data() + o * in;
          for (int j = 0; j < in; ++j) row[j] = values[order[j]];
          std::copy(row.begin(), row.end(), values);
        }
      }
      std::vector<float> s(static_cast<size_t>(groups) * out);
      scales.ToFloat(s.data());
      m.scales.resize(s.size());
      m.zeros.resize(s.size());
      const int words = out / 8;
      for (int g = 0; g < groups; ++g) {
        for (int c = 0; c < words; ++c) {
          const int32_t word = Word(qzeros, int64_t{g} * words + c);
          for (int p = 0; p < 8; ++p) {
            // Stored minus one (AutoGPTQ's "gptq" format): the zero point is the nibble + 1.
            m.zeros[(int64_t{8} * c + p) * groups + g] = static_cast<int8_t>(Nibble(word, p) + 1);
          }
        }
        for (int64_t o = 0; o < out; ++o) m.scales[o * groups + g] = s[int64_t{g} * out + o];
      }
      break;
    }
  }
  for (float s : m.scales) {
    if (!std::isfinite(s)) {
      return absl::InvalidArgumentError(absl::StrCat(module, ": a scale is not finite"));
    }
  }
  TANDEM_RETURN_IF_ERROR(kernels::ValidateQuantizedWeight(m.view()));
  return m;
}

absl::StatusOr<QuantizedMatrix> StackRows(std::vector<QuantizedMatrix> parts) {
  if (parts.empty()) return absl::InvalidArgumentError("StackRows of no matrices");
  QuantizedMatrix out = std::move(parts[0]);
  for (size_t i = 1; i < parts.size(); ++i) {
    QuantizedMatrix& p = parts[i];
    if (p.quant != out.quant || p.k != out.k || p.group_size != out.group_size ||
        p.k_order != out.k_order || p.group_starts != out.group_starts) {
      return absl::InvalidArgumentError(
          "layers fused into one projection differ in quantisation, group size or act order");
    }
    out.n += p.n;
    out.values.insert(out.values.end(), p.values.begin(), p.values.end());
    out.scales.insert(out.scales.end(), p.scales.begin(), p.scales.end());
    out.zeros.insert(out.zeros.end(), p.zeros.begin(), p.zeros.end());
  }
  return out;
}

QuantizedMatrix SliceQuantizedRows(const QuantizedMatrix& m, int begin, int count) {
  QuantizedMatrix out;
  out.quant = m.quant;
  out.n = count;
  out.k = m.k;
  out.group_size = m.group_size;
  out.k_order = m.k_order;
  out.group_starts = m.group_starts;
  const size_t groups = static_cast<size_t>(m.view().groups());
  auto rows = [&](const auto& v, size_t width, auto& to) {
    if (v.empty()) return;
    to.assign(v.begin() + static_cast<ptrdiff_t>(begin * width),
              v.begin() + static_cast<ptrdiff_t>((begin + count) * width));
  };
  rows(m.values, static_cast<size_t>(m.k), out.values);
  rows(m.scales, groups, out.scales);
  rows(m.zeros, groups, out.zeros);
  return out;
}

absl::StatusOr<QuantizedMatrix> SliceQuantizedCols(const QuantizedMatrix& m, int begin,
                                                   int count) {
  if (begin < 0 || count <= 0 || begin + count > m.k) {
    return absl::InvalidArgumentError(absl::StrCat("inputs [", begin, ", ", begin + count,
                                                   ") of a layer of ", m.k, " inputs"));
  }
  // The stored columns holding the slice's inputs, in stored order (which keeps each group's
  // columns together, act order or not).
  std::vector<int> columns;
  columns.reserve(count);
  for (int j = 0; j < m.k; ++j) {
    const int feature = m.k_order.empty() ? j : m.k_order[j];
    if (feature >= begin && feature < begin + count) columns.push_back(j);
  }
  QuantizedMatrix out;
  out.quant = m.quant;
  out.n = m.n;
  out.k = count;
  bool in_order = true;
  out.k_order.resize(count);
  for (int j = 0; j < count; ++j) {
    out.k_order[j] = (m.k_order.empty() ? columns[j] : m.k_order[columns[j]]) - begin;
    in_order = in_order && out.k_order[j] == j;
  }
  if (in_order) out.k_order.clear();
  out.values.resize(static_cast<size_t>(m.n) * count);
  for (int r = 0; r < m.n; ++r) {
    const int8_t* row = m.values.data() + static_cast<ptrdiff_t>(r) * m.k;
    int8_t* to = out.values.data() + static_cast<ptrdiff_t>(r) * count;
    for (int j = 0; j < count; ++j) to[j] = row[columns[j]];
  }
  const int groups = m.view().groups();
  if (m.quant == kernels::WeightQuant::kInt8) {
    // One scale per row: a slice keeps the row's scale.
    out.group_size = count;
    out.scales = m.scales;
    return out;
  }
  // The slice's part of each group it touches becomes a group of its own (of any size), with
  // that group's scales and zero points.
  const std::vector<int32_t> starts = kernels::GroupStarts(m.view());
  std::vector<int> kept;  // the source group of each of the slice's groups
  std::vector<int32_t> out_starts;
  bool whole_groups = m.group_starts.empty();
  for (int j = 0, g = 0; j < count; ++j) {
    while (starts[g + 1] <= columns[j]) ++g;
    if (kept.empty() || kept.back() != g) {
      kept.push_back(g);
      out_starts.push_back(j);
    }
  }
  out_starts.push_back(count);
  for (size_t i = 0; i < kept.size(); ++i) {
    whole_groups = whole_groups && out_starts[i + 1] - out_starts[i] == m.group_size;
  }
  out.group_size = m.group_size;
  if (!whole_groups) out.group_starts = std::move(out_starts);
  const size_t out_groups = kept.size();
  out.scales.resize(static_cast<size_t>(m.n) * out_groups);
  out.zeros.resize(static_cast<size_t>(m.n) * out_groups);
  for (int r = 0; r < m.n; ++r) {
    for (size_t i = 0; i < out_groups; ++i) {
      const size_t from = static_cast<size_t>(r) * groups + kept[i];
      out.scales[r * out_groups + i] = m.scales[from];
      out.zeros[r * out_groups + i] = m.zeros[from];
    }
  }
  return out;
}

}  // namespace tandem::engine
