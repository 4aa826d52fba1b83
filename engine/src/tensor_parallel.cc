#include "tandem/engine/tensor_parallel.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "tandem/engine/checkpoint.h"

namespace tandem::engine {

int KvHeadsPerRank(const text::ModelConfig& config, int size) {
  if (size <= 1) return config.num_kv_heads;
  return config.num_kv_heads >= size ? config.num_kv_heads / size : 1;
}

absl::StatusOr<TensorParallelShard> TensorParallelShard::For(const text::ModelConfig& config,
                                                             int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor-parallel rank ", rank, " outside a group of ", size));
  }
  const std::string model = config.architecture_name;
  if (config.num_heads % size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--tensor-parallel-size ", size,
                                                   " does not divide the ", config.num_heads,
                                                   " attention heads of ", model));
  }
  const int kv = config.num_kv_heads;
  if (kv >= size ? kv % size != 0 : size % kv != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tensor-parallel-size ", size, " and the ", kv, " KV heads of ", model,
        " must divide one another (heads are split, or replicated when fewer than ranks)"));
  }
  if (config.intermediate_size % size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--tensor-parallel-size ", size,
                                                   " does not divide the intermediate size ",
                                                   config.intermediate_size, " of ", model));
  }
  TensorParallelShard s;
  s.rank = rank;
  s.size = size;
  s.num_q_heads = config.num_heads / size;
  s.q_head_begin = rank * s.num_q_heads;
  s.num_kv_heads = KvHeadsPerRank(config, size);
  // Replicated: the KV head that this rank's q heads read (q head h reads h / (heads / kv)).
  s.kv_head_begin = kv >= size ? rank * s.num_kv_heads : s.q_head_begin / (config.num_heads / kv);
  s.intermediate_size = config.intermediate_size / size;
  s.intermediate_begin = rank * s.intermediate_size;
  s.vocab_stride = (config.vocab_size + size - 1) / size;
  s.vocab_begin = std::min(config.vocab_size, rank * s.vocab_stride);
  s.vocab_rows = std::min(config.vocab_size, s.vocab_begin + s.vocab_stride) - s.vocab_begin;
  return s;
}

absl::Status CheckTensorParallelModel(const std::string& model_dir, int size) {
  if (size <= 1) return absl::OkStatus();
  TANDEM_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> checkpoint, Checkpoint::Open(model_dir));
  return TensorParallelShard::For(checkpoint->config(), 0, size).status();
}

}  // namespace tandem::engine
