// Backend::SampleRows on the device: a row's logit edits, log-probabilities and draw, so that
// only token ids and log-probabilities cross to the host.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tandem/kernels/backend.h"

namespace tandem::kernels::cuda {

// One SampleRows call; see Backend::SampleRows. params and edits are host memory, the rest
// device memory.
struct SampleRowsCall {
  float* logits = nullptr;  // [rows, vocab]
  int rows = 0;
  int vocab = 0;
  const SampleRowParams* params = nullptr;  // [rows]
  const LogitEdit* edits = nullptr;         // [num_edits]
  int num_edits = 0;
  int max_logprobs = 0;
  void* scratch = nullptr;  // SampleRowsScratchBytes(rows, vocab, num_edits) or more
  TokenLogprob* sampled = nullptr;  // [rows]
  TokenLogprob* top = nullptr;      // [rows, max_logprobs]
};

// Page-locked host memory the uploads of SampleRows go through (grown when a call needs more
// than any before), and the event recorded after the last upload from it.
class SampleRowsStaging {
 public:
  SampleRowsStaging() = default;
  SampleRowsStaging(const SampleRowsStaging&) = delete;
  SampleRowsStaging& operator=(const SampleRowsStaging&) = delete;
  ~SampleRowsStaging();

  // Waits for the last upload to have been read, then gives `bytes` of page-locked memory.
  absl::StatusOr<char*> Take(size_t bytes);
  // Records, on `stream`, that the bytes Take gave are read by what is queued so far.
  absl::Status Release(cudaStream_t stream);

 private:
  char* pinned_ = nullptr;
  size_t capacity_ = 0;
  cudaEvent_t read_ = nullptr;
};

// Device scratch a call of `rows` rows, `vocab` and `max_edits` edits needs (fewer rows or
// edits need no more).
size_t SampleRowsScratchBytes(int rows, int vocab, int max_edits);

// Queues the call on `stream`; `staging` carries the upload of params and edits.
// Sorts (a segmented radix sort by logit) only the rows whose top-k or top-p truncates, a few
// at a time; the others need no sort.
absl::Status LaunchSampleRows(const SampleRowsCall& call, SampleRowsStaging& staging,
                              cudaStream_t stream);

}  // namespace tandem::kernels::cuda
