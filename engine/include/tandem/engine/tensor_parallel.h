// How a model is cut across the ranks of a tensor-parallel group (Megatron-style).
//
// Per layer, q/k/v and gate/up are column-parallel (each rank computes its heads and its slice
// of the intermediate dimension, from its rows of those weights); o_proj and down_proj are
// row-parallel (each rank multiplies its slice of their input by its columns of the weight, and
// one all-reduce per projection sums the partial outputs). The embedding and the LM head are
// vocabulary-parallel: each rank holds a slice of the rows; a token outside a rank's slice
// looks up zeros there and one all-reduce assembles the hidden states; the logits of the slices
// are all-gathered so that rank 0 samples from the whole vocabulary (logprobs stay exact).
//
// KV heads are split like q heads when the degree divides them; when the degree exceeds them,
// each rank holds the one KV head its q heads read (a KV head replicated degree / kv_heads
// times). A rank's KV cache holds only its KV heads (KvCacheLayout::kv_head_begin).
//
//   TANDEM_ASSIGN_OR_RETURN(TensorParallelShard shard, TensorParallelShard::For(config, 1, 2));
//   // shard.q_head_begin == config.num_heads / 2, ...
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "tandem/text/model_config.h"

namespace tandem::engine {

struct TensorParallelShard {
  int rank = 0;
  int size = 1;
  // q heads [q_head_begin, q_head_begin + num_q_heads) of the model.
  int q_head_begin = 0;
  int num_q_heads = 0;
  // KV heads [kv_head_begin, kv_head_begin + num_kv_heads).
  int kv_head_begin = 0;
  int num_kv_heads = 0;
  // Columns [intermediate_begin, + intermediate_size) of the MLP's intermediate dimension.
  int intermediate_begin = 0;
  int intermediate_size = 0;
  // Vocabulary rows [vocab_begin, vocab_begin + vocab_rows); every rank's slice is padded to
  // vocab_stride rows (ceil(vocab / size)), so the all-gathered logits are equal parts.
  int vocab_begin = 0;
  int vocab_rows = 0;
  int vocab_stride = 0;

  // Rank `rank`'s shard of a model of `config` over `size` ranks. InvalidArgument, naming the
  // dimension, when the heads or the intermediate size do not divide.
  static absl::StatusOr<TensorParallelShard> For(const text::ModelConfig& config, int rank,
                                                 int size);
};

// Whether the checkpoint in `model_dir` can be split over `size` ranks: its shapes divide
// (TensorParallelShard::For). Quantised weights always split, as unpacked: a rank's output rows
// with their scales (column-parallel), or its inputs with their groups' scales, groups cut by
// the split or scattered by act order included (row-parallel; see SliceQuantizedCols). A
// launcher checks this before it starts any rank, so a refusal is said once.
absl::Status CheckTensorParallelModel(const std::string& model_dir, int size);

// The KV heads each rank of a group of `size` holds (the model's own count when size is 1).
int KvHeadsPerRank(const text::ModelConfig& config, int size);

}  // namespace tandem::engine
