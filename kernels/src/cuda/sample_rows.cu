#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "absl/strings/str_cat.h"
#include "kernels/src/cuda/dispatch.cuh"
#include "kernels/src/cuda/reduce.cuh"
#include "kernels/src/cuda/sample_rows.cuh"

namespace tandem::kernels::cuda {
namespace {

constexpr int kThreads = 512;
// Rows one segmented sort takes: bounds its buffers at kSortRows * vocab * 16 bytes.
constexpr int kSortRows = 8;

// Whether a row draws from its candidates sorted by logit (top-k or top-p truncates), as the
// engine's Sampler does; greedy rows and the others draw in id order without a sort.
__host__ __device__ inline bool Sorts(const SampleRowParams& p, int vocab) {
  return p.temperature != 0.0f && (p.top_p < 1.0f || (p.top_k > 0 && p.top_k < vocab));
}

// A total order of (logit, id) as one integer: larger for the larger logit, then the lower id
// (the Sampler's ties). -0 counts as +0; NaN as below everything.
__device__ __forceinline__ uint64_t Key(float logit, int id) {
  if (isnan(logit)) return 0;
  if (logit == 0.0f) logit = 0.0f;
  const uint32_t u = __float_as_uint(logit);
  const uint32_t ordered = (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(ordered) << 32) | (0xffffffffu - static_cast<uint32_t>(id));
}
__device__ __forceinline__ int KeyId(uint64_t key) {
  return static_cast<int>(0xffffffffu - static_cast<uint32_t>(key));
}

// The first i in [0, n) where the running sum of weight(0..i) (in index order, in double)
// passes `target` (strict: sum > target; else sum >= target); n when none does. Each thread
// sums a contiguous chunk; a block scan gives each chunk the sum before it.
template <typename Weight>
__device__ int FirstCrossing(int n, Weight weight, double target, bool strict) {
  using Scan = cub::BlockScan<double, kThreads>;
  __shared__ typename Scan::TempStorage storage;
  const int chunk = (n + kThreads - 1) / kThreads;
  const int begin = min(n, static_cast<int>(threadIdx.x) * chunk);
  const int end = min(n, begin + chunk);
  double sum = 0;
  for (int i = begin; i < end; ++i) sum += weight(i);
  double cum = 0;
  Scan(storage).ExclusiveSum(sum, cum);
  int first = n;
  for (int i = begin; i < end; ++i) {
    cum += weight(i);
    if (strict ? target < cum : cum >= target) {
      first = i;
      break;
    }
  }
  return BlockAll(first, MinOp(), n);
}

// The last i in [0, n) with weight(i) > 0, or n - 1.
template <typename Weight>
__device__ int LastWeighted(int n, Weight weight) {
  int last = -1;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    if (weight(i) > 0) last = i;
  }
  last = BlockAll(last, MaxOp(), -1);
  return last >= 0 ? last : n - 1;
}

// The chosen token's log-probability: its logit before the row's edits (raw_edit holds those
// of the edited tokens), less log_z.
__device__ float ChosenLogprob(const float* l, const SampleRowParams& p, const LogitEdit* edits,
                               const float* raw_edit, int chosen, float log_z) {
  __shared__ float raw;
  if (threadIdx.x == 0) raw = l[chosen];
  __syncthreads();
  for (int e = p.edits_begin + threadIdx.x; e < p.edits_end; e += kThreads) {
    if (edits[e].token == chosen) raw = raw_edit[e];  // a row names a token once: one writer
  }
  __syncthreads();
  const float result = raw - log_z;
  __syncthreads();
  return result;
}

// out[0..n): the n largest logits' (ties: lowest id) log-probabilities. Each thread keeps its n
// best keys, descending; n rounds of a block max merge them.
__device__ void TopLogprobs(const float* l, int vocab, int n, float log_z, TokenLogprob* out) {
  uint64_t best[kMaxSampleLogprobs];
  int have = 0;
  for (int i = threadIdx.x; i < vocab; i += kThreads) {
    const uint64_t key = Key(l[i], i);
    if (have == n && key <= best[n - 1]) continue;
    int j = have < n ? have++ : n - 1;
    while (j > 0 && best[j - 1] < key) {
      best[j] = best[j - 1];
      --j;
    }
    best[j] = key;
  }
  int head = 0;
  for (int r = 0; r < n; ++r) {
    const uint64_t offer = head < have ? best[head] : 0;
    const uint64_t top = BlockAll(offer, MaxOp(), uint64_t{0});
    if (top != 0 && offer == top) ++head;
    if (threadIdx.x == 0) {
      const int id = top == 0 ? 0 : KeyId(top);
      out[r] = {id, l[id] - log_z};
    }
  }
}

// One block per row: log-probabilities of the raw logits, the row's edits (in place), then the
// token of a greedy row or of one that draws in id order. Sorting rows end after the edits.
__global__ void __launch_bounds__(kThreads)
    SampleRowsKernel(float* __restrict__ logits,  // [rows, vocab]
                     int vocab, const SampleRowParams* __restrict__ params,
                     const LogitEdit* __restrict__ edits, float* __restrict__ raw_edit,
                     float* __restrict__ log_zs,  // [rows]
                     int max_logprobs, TokenLogprob* __restrict__ sampled,
                     TokenLogprob* __restrict__ top) {
  const int row = blockIdx.x;
  const SampleRowParams p = params[row];
  float* l = logits + static_cast<int64_t>(row) * vocab;
  float log_z = 0.0f;
  if (p.num_logprobs >= 0) {
    float m = -INFINITY;
    for (int i = threadIdx.x; i < vocab; i += kThreads) m = fmaxf(m, l[i]);
    m = BlockAll(m, MaxOp(), -INFINITY);
    double sum = 0;
    for (int i = threadIdx.x; i < vocab; i += kThreads) sum += expf(l[i] - m);
    sum = BlockAll(sum, SumOp(), 0.0);
    log_z = m + static_cast<float>(log(sum));
    if (threadIdx.x == 0) log_zs[row] = log_z;
    if (p.num_logprobs > 0) {
      TopLogprobs(l, vocab, min(p.num_logprobs, vocab), log_z,
                  top + static_cast<int64_t>(row) * max_logprobs);
    }
  }
  __syncthreads();  // every read of the raw logits is done
  for (int e = p.edits_begin + threadIdx.x; e < p.edits_end; e += kThreads) {
    const LogitEdit edit = edits[e];
    float v = l[edit.token];
    raw_edit[e] = v;
    if (edit.mask != 0) v = -INFINITY;
    if (edit.repetition != 1.0f) v = v > 0 ? v / edit.repetition : v * edit.repetition;
    v -= edit.subtract;
    v += edit.bias;
    l[edit.token] = v;
  }
  __syncthreads();
  if (Sorts(p, vocab)) return;

  int chosen = 0;
  if (p.temperature == 0.0f) {
    uint64_t best = 0;
    for (int i = threadIdx.x; i < vocab; i += kThreads) best = max(best, Key(l[i], i));
    best = BlockAll(best, MaxOp(), uint64_t{0});
    chosen = best == 0 ? 0 : KeyId(best);
  } else {
    float m = -INFINITY;
    for (int i = threadIdx.x; i < vocab; i += kThreads) m = fmaxf(m, l[i]);
    m = BlockAll(m, MaxOp(), -INFINITY);
    // In double, as the Sampler's TruncateCandidates: exp((l - max) / T), each rounded to float
    // before it is divided by the (unrounded) sum.
    const double inv_t = 1.0 / static_cast<double>(p.temperature);
    double sum = 0;
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      sum += exp((static_cast<double>(l[i]) - m) * inv_t);
    }
    sum = BlockAll(sum, SumOp(), 0.0);
    // min-p against the largest probability, the maximum's: 1 / sum.
    const float threshold = p.min_p > 0.0f ? p.min_p * static_cast<float>(1.0 / sum) : 0.0f;
    auto weight = [&](int i) -> double {
      const float e = static_cast<float>(exp((static_cast<double>(l[i]) - m) * inv_t));
      const float q = static_cast<float>(static_cast<double>(e) / sum);
      return q >= threshold ? q : 0.0;
    };
    double mass = 0;
    for (int i = threadIdx.x; i < vocab; i += kThreads) mass += weight(i);
    mass = BlockAll(mass, SumOp(), 0.0);
    chosen = FirstCrossing(vocab, weight, p.uniform * mass, /*strict=*/true);
    if (chosen == vocab) chosen = LastWeighted(vocab, weight);
  }
  const float logprob =
      p.num_logprobs >= 0 ? ChosenLogprob(l, p, edits, raw_edit, chosen, log_z) : 0.0f;
  if (threadIdx.x == 0) sampled[row] = {chosen, logprob};
}

// Copies the edited logits of the sorting rows rows[0..) into the sort's input, with their ids,
// and the segments' bounds. grid: (x, rows).
__global__ void GatherSortInputKernel(const float* __restrict__ logits, int vocab,
                                      const int32_t* __restrict__ rows, float* __restrict__ keys,
                                      int32_t* __restrict__ ids, int32_t* __restrict__ offsets) {
  const int c = blockIdx.y;
  const float* l = logits + static_cast<int64_t>(rows[c]) * vocab;
  const int64_t base = static_cast<int64_t>(c) * vocab;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < vocab; i += gridDim.x * blockDim.x) {
    const float v = l[i];
    keys[base + i] = v == 0.0f ? 0.0f : v;  // -0 sorts as +0, as the Sampler compares
    ids[base + i] = i;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    offsets[c + 1] = (c + 1) * vocab;
    if (c == 0) offsets[0] = 0;
  }
}

// One block per sorting row: top-k, softmax, top-p, min-p and the draw over the row's logits
// sorted descending (keys, with their ids).
__global__ void __launch_bounds__(kThreads)
    SortedRowsKernel(const float* __restrict__ logits, int vocab,
                     const SampleRowParams* __restrict__ params,
                     const LogitEdit* __restrict__ edits, const float* __restrict__ raw_edit,
                     const float* __restrict__ log_zs, const int32_t* __restrict__ rows,
                     const float* __restrict__ sorted_keys, const int32_t* __restrict__ sorted_ids,
                     TokenLogprob* __restrict__ sampled) {
  const int row = rows[blockIdx.x];
  const SampleRowParams p = params[row];
  const float* keys = sorted_keys + static_cast<int64_t>(blockIdx.x) * vocab;
  const int32_t* ids = sorted_ids + static_cast<int64_t>(blockIdx.x) * vocab;
  int keep = p.top_k > 0 && p.top_k < vocab ? p.top_k : vocab;
  const float m = keys[0];
  // In double, as the Sampler's TruncateCandidates (see SampleRowsKernel).
  const double inv_t = 1.0 / static_cast<double>(p.temperature);
  double sum = 0;
  for (int i = threadIdx.x; i < keep; i += kThreads) {
    sum += exp((static_cast<double>(keys[i]) - m) * inv_t);
  }
  sum = BlockAll(sum, SumOp(), 0.0);
  auto prob = [&](int i) -> double {
    const float e = static_cast<float>(exp((static_cast<double>(keys[i]) - m) * inv_t));
    return static_cast<float>(static_cast<double>(e) / sum);
  };
  if (p.top_p < 1.0f) {
    const int cut = FirstCrossing(keep, prob, static_cast<double>(p.top_p), /*strict=*/false);
    if (cut < keep) keep = cut + 1;
  }
  const float threshold = p.min_p > 0.0f ? p.min_p * static_cast<float>(prob(0)) : 0.0f;
  auto weight = [&](int i) -> double {
    const double q = prob(i);
    return q >= threshold ? q : 0.0;
  };
  double mass = 0;
  for (int i = threadIdx.x; i < keep; i += kThreads) mass += weight(i);
  mass = BlockAll(mass, SumOp(), 0.0);
  int at = FirstCrossing(keep, weight, p.uniform * mass, /*strict=*/true);
  if (at == keep) at = LastWeighted(keep, weight);
  const int chosen = ids[at];
  const float* l = logits + static_cast<int64_t>(row) * vocab;
  const float logprob =
      p.num_logprobs >= 0 ? ChosenLogprob(l, p, edits, raw_edit, chosen, log_zs[row]) : 0.0f;
  if (threadIdx.x == 0) sampled[row] = {chosen, logprob};
}

size_t AlignUp(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Where each of a call's buffers lies in its scratch.
struct ScratchLayout {
  // The upload, one copy: params, edits and the sorting rows' indices.
  size_t params = 0, edits = 0, sort_list = 0, upload_bytes = 0;
  size_t raw_edit = 0, log_z = 0, offsets = 0;
  size_t keys_in = 0, keys_out = 0, ids_in = 0, ids_out = 0, sort_temp = 0;
  size_t sort_temp_bytes = 0;
  int sort_rows = 0;
  size_t total = 0;
};

ScratchLayout Layout(int rows, int vocab, int num_edits) {
  ScratchLayout s;
  size_t at = 0;
  s.params = at;
  at += sizeof(SampleRowParams) * rows;
  s.edits = at;
  at += sizeof(LogitEdit) * num_edits;
  s.sort_list = at;
  at += sizeof(int32_t) * rows;
  s.upload_bytes = at;
  auto place = [&](size_t bytes) {
    at = AlignUp(at);
    const size_t offset = at;
    at += bytes;
    return offset;
  };
  s.raw_edit = place(sizeof(float) * num_edits);
  s.log_z = place(sizeof(float) * rows);
  s.sort_rows = std::min(rows, kSortRows);
  const int64_t items = static_cast<int64_t>(s.sort_rows) * vocab;
  s.offsets = place(sizeof(int32_t) * (s.sort_rows + 1));
  s.keys_in = place(sizeof(float) * items);
  s.keys_out = place(sizeof(float) * items);
  s.ids_in = place(sizeof(int32_t) * items);
  s.ids_out = place(sizeof(int32_t) * items);
  if (items > 0) {
    int32_t offsets[2] = {0, 0};
    cub::DeviceSegmentedRadixSort::SortPairsDescending(
        nullptr, s.sort_temp_bytes, static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
        static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), items, s.sort_rows,
        offsets, offsets + 1);
  }
  s.sort_temp = place(s.sort_temp_bytes);
  s.total = AlignUp(at);
  return s;
}

absl::Status CheckCall(const SampleRowsCall& call) {
  if (call.vocab <= 0) return absl::InvalidArgumentError("SampleRows: an empty vocabulary");
  if (call.max_logprobs < 0 || call.max_logprobs > kMaxSampleLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("SampleRows: max_logprobs ", call.max_logprobs,
                                                   " is outside [0, ", kMaxSampleLogprobs, "]"));
  }
  for (int r = 0; r < call.rows; ++r) {
    const SampleRowParams& p = call.params[r];
    if (p.num_logprobs > call.max_logprobs || p.edits_begin < 0 || p.edits_begin > p.edits_end ||
        p.edits_end > call.num_edits) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SampleRows: row ", r, " asks for ", p.num_logprobs, " log-probabilities (at most ",
          call.max_logprobs, ") and edits [", p.edits_begin, ", ", p.edits_end, ") of ",
          call.num_edits));
    }
  }
  for (int e = 0; e < call.num_edits; ++e) {
    if (call.edits[e].token < 0 || call.edits[e].token >= call.vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("SampleRows: edit ", e, " names token ", call.edits[e].token,
                       " outside the vocabulary of ", call.vocab));
    }
  }
  return absl::OkStatus();
}

}  // namespace

SampleRowsStaging::~SampleRowsStaging() {
  if (read_ != nullptr) cudaEventDestroy(read_);
  if (pinned_ != nullptr) cudaFreeHost(pinned_);  // waits for the device
}

absl::StatusOr<char*> SampleRowsStaging::Take(size_t bytes) {
  if (read_ == nullptr) {
    if (absl::Status status = CudaStatus(cudaEventCreateWithFlags(&read_, cudaEventDisableTiming),
                                         "SampleRows upload event");
        !status.ok()) {
      return status;
    }
  }
  if (absl::Status status = CudaStatus(cudaEventSynchronize(read_), "SampleRows upload");
      !status.ok()) {
    return status;
  }
  if (bytes > capacity_) {
    if (pinned_ != nullptr) cudaFreeHost(pinned_);
    pinned_ = nullptr;
    capacity_ = 0;
    const size_t grown = std::max<size_t>(bytes, 64 << 10);
    void* p = nullptr;
    if (absl::Status status = CudaStatus(cudaMallocHost(&p, grown), "SampleRows upload buffer");
        !status.ok()) {
      return status;
    }
    pinned_ = static_cast<char*>(p);
    capacity_ = grown;
  }
  return pinned_;
}

absl::Status SampleRowsStaging::Release(cudaStream_t stream) {
  return CudaStatus(cudaEventRecord(read_, stream), "SampleRows upload");
}

size_t SampleRowsScratchBytes(int rows, int vocab, int max_edits) {
  return Layout(rows, vocab, max_edits).total;
}

absl::Status LaunchSampleRows(const SampleRowsCall& call, SampleRowsStaging& staging,
                              cudaStream_t stream) {
  if (call.rows <= 0) return absl::OkStatus();
  if (absl::Status status = CheckCall(call); !status.ok()) return status;
  const ScratchLayout s = Layout(call.rows, call.vocab, call.num_edits);
  std::vector<int32_t> sorting;
  for (int r = 0; r < call.rows; ++r) {
    if (Sorts(call.params[r], call.vocab)) sorting.push_back(r);
  }
  absl::StatusOr<char*> upload = staging.Take(s.upload_bytes);
  if (!upload.ok()) return upload.status();
  std::memcpy(*upload + s.params, call.params, sizeof(SampleRowParams) * call.rows);
  if (call.num_edits > 0) {
    std::memcpy(*upload + s.edits, call.edits, sizeof(LogitEdit) * call.num_edits);
  }
  if (!sorting.empty()) {
    std::memcpy(*upload + s.sort_list, sorting.data(), sizeof(int32_t) * sorting.size());
  }
  char* base = static_cast<char*>(call.scratch);
  if (absl::Status status = CudaStatus(
          cudaMemcpyAsync(base, *upload, s.upload_bytes, cudaMemcpyHostToDevice, stream),
          "SampleRows upload");
      !status.ok()) {
    return status;
  }
  if (absl::Status status = staging.Release(stream); !status.ok()) return status;
  const auto* params = reinterpret_cast<const SampleRowParams*>(base + s.params);
  const auto* edits = reinterpret_cast<const LogitEdit*>(base + s.edits);
  const auto* sort_list = reinterpret_cast<const int32_t*>(base + s.sort_list);
  auto* raw_edit = reinterpret_cast<float*>(base + s.raw_edit);
  auto* log_z = reinterpret_cast<float*>(base + s.log_z);
  SampleRowsKernel<<<call.rows, kThreads, 0, stream>>>(call.logits, call.vocab, params, edits,
                                                       raw_edit, log_z, call.max_logprobs,
                                                       call.sampled, call.top);
  if (absl::Status status = CudaStatus(cudaGetLastError(), "SampleRowsKernel"); !status.ok()) {
    return status;
  }
  auto* offsets = reinterpret_cast<int32_t*>(base + s.offsets);
  auto* keys_in = reinterpret_cast<float*>(base + s.keys_in);
  auto* keys_out = reinterpret_cast<float*>(base + s.keys_out);
  auto* ids_in = reinterpret_cast<int32_t*>(base + s.ids_in);
  auto* ids_out = reinterpret_cast<int32_t*>(base + s.ids_out);
  const int count = static_cast<int>(sorting.size());
  for (int first = 0; first < count; first += s.sort_rows) {
    const int n = std::min(s.sort_rows, count - first);
    const dim3 grid(std::min(64, (call.vocab + 255) / 256), n);
    GatherSortInputKernel<<<grid, 256, 0, stream>>>(call.logits, call.vocab, sort_list + first,
                                                    keys_in, ids_in, offsets);
    size_t temp_bytes = s.sort_temp_bytes;
    if (absl::Status status = CudaStatus(
            cub::DeviceSegmentedRadixSort::SortPairsDescending(
                base + s.sort_temp, temp_bytes, keys_in, keys_out, ids_in, ids_out,
                static_cast<int64_t>(n) * call.vocab, n, offsets, offsets + 1, 0, 32, stream),
            "SampleRows sort");
        !status.ok()) {
      return status;
    }
    SortedRowsKernel<<<n, kThreads, 0, stream>>>(call.logits, call.vocab, params, edits, raw_edit,
                                                 log_z, sort_list + first, keys_out, ids_out,
                                                 call.sampled);
  }
  return CudaStatus(cudaGetLastError(), "SortedRowsKernel");
}

}  // namespace tandem::kernels::cuda
