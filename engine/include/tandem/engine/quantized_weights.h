// Quantised linear layers read from a checkpoint into the unpacked form the kernels pack from
// (kernels::QuantizedWeightView); the on-disk layouts are described in quantization_config.h.
//
//   TANDEM_ASSIGN_OR_RETURN(QuantizedMatrix q,
//                           ReadQuantizedMatrix(checkpoint, "model.layers.0.mlp.down_proj",
//                                               hidden, intermediate));
//   auto packed = backend->PackQuantizedWeight(q.view());
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tandem/engine/checkpoint.h"
#include "tandem/kernels/backend.h"

namespace tandem::engine {

// A quantised W[n, k] owning its arrays; see kernels::QuantizedWeightView for their meaning.
struct QuantizedMatrix {
  kernels::WeightQuant quant = kernels::WeightQuant::kInt8;
  int n = 0;
  int k = 0;
  int group_size = 0;
  std::vector<int8_t> values;    // [n, k]
  std::vector<float> scales;     // [n, k / group_size]
  std::vector<int8_t> zeros;     // int4: [n, k / group_size]; int8: empty
  std::vector<int32_t> k_order;  // empty, or [k]
  std::vector<int32_t> group_starts;  // empty (groups of group_size), or [groups + 1]

  kernels::QuantizedWeightView view() const;
};

// Reads and unpacks linear layer `module` (W[out, in]) of a quantised checkpoint. Refuses, naming
// the tensor, values the layout cannot hold (a GPTQ g_idx out of range or with groups of unequal
// size, a non-finite or zero scale).
absl::StatusOr<QuantizedMatrix> ReadQuantizedMatrix(const Checkpoint& checkpoint,
                                                    const std::string& module, int out, int in);

// The matrices stacked along n (fused q/k/v, gate/up). They must agree in quantisation, k, group
// size and k order (GPTQ quantises layers that share an input with one act order).
absl::StatusOr<QuantizedMatrix> StackRows(std::vector<QuantizedMatrix> parts);

// A tensor-parallel rank's part of a layer: its output rows [begin, begin + count) (a
// column-parallel projection), with their scales and zero points.
QuantizedMatrix SliceQuantizedRows(const QuantizedMatrix& m, int begin, int count);
// Its inputs [begin, begin + count) (a row-parallel projection), in the layer's stored column
// order: each group's part in the slice keeps that group's scales and zero points, so a slice
// that cuts groups (or takes the scattered inputs of act-order groups) has groups of unequal
// size (group_starts); int8's one scale per row is kept. InvalidArgument for inputs outside the
// layer.
absl::StatusOr<QuantizedMatrix> SliceQuantizedCols(const QuantizedMatrix& m, int begin,
                                                   int count);

}  // namespace tandem::engine
