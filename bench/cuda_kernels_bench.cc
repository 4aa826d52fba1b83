// The CUDA backend's operators at Llama-3-8B shapes on GPU 0, against the device's own
// copy bandwidth measured in the same run; run by scripts/gpu-check beside PyTorch's figures.
//
//   tandem_bench_cuda_kernels [OUT_JSON]
//
//   Linear        bf16 weights, fp32 y, and x as the runner passes it (ActivationDType: fp32 up
//                 to 4 rows, bf16 past them): the five projections of the 8B shape at m = 1, 2,
//                 4, 8, 16, 64 and 256, and gpu_baselines.py's torch.matmul shapes (n 14336,
//                 k 4096; 8192^3); GB/s counts weight, x and y bytes once, TFLOP/s 2 m n k.
//                 Past m = 4 (the default: the skinny GEMM to m = 16, cuBLASLt past it) also
//                 "Linear bf16 cuBLASLt" and "Linear bf16 GemmEx": backends with cuBLASLt for
//                 every m and with cublasGemmEx (CudaBackendOptions::Gemm), same buffers.
//   PagedAttention decode (one query row per sequence), 32 query heads over 8 KV heads (GQA
//                 4:1), head_dim 128, bf16 KV in 16-token blocks scattered over the cache;
//                 GB/s counts the K and V bytes read. And one causal 4096-token prefill in one
//                 call on the tensor-core prefill kernel (TFLOP/s of the causal half of
//                 4 T^2 d heads).
//   SampleRows    a token from each of 1, 8, 64 and 256 rows of 128256 logits: greedy, plain
//                 temperature (id order, no sort), and top-k 50 with top-p 0.9 (sorted); GB/s
//                 counts the logits once. Beside it, the copy of the same logits to page-locked
//                 host memory that host sampling starts with.
//
// Each figure is the median of three trials, a trial being the mean over a burst of calls
// queued back to back and then synchronised (launch gaps included, as a decode step has them).
// Weights smaller than 256 MiB are cycled over several copies so the 50 MB L2 does not serve
// them; every input is random (an xorshift stream), never zeros.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/cuda_bandwidth.h"
#include "tandem/base/half.h"
#include "tandem/kernels/backend.h"
#include "tandem/kernels/cuda_backend.h"

namespace tandem {
namespace {

using kernels::Backend;
using kernels::DeviceBuffer;

struct Rng {
  uint64_t s;
  float Next() {  // uniform in [-1, 1)
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return static_cast<float>(static_cast<int64_t>(s >> 40) - (1 << 23)) / (1 << 23);
  }
};

std::vector<uint16_t> RandomBf16(int64_t count, uint64_t seed, float scale) {
  std::vector<uint16_t> out(static_cast<size_t>(count));
  Rng rng{seed * 0x9E3779B97F4A7C15ull + 1};
  for (auto& v : out) v = FloatToBf16(rng.Next() * scale);
  return out;
}

std::vector<float> RandomF32(int64_t count, uint64_t seed) {
  std::vector<float> out(static_cast<size_t>(count));
  Rng rng{seed * 0x9E3779B97F4A7C15ull + 7};
  for (auto& v : out) v = rng.Next();
  return out;
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "tandem_bench_cuda_kernels: %s\n", what.c_str());
  std::exit(1);
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) Die(absl::StrCat(what, ": ", s.message()));
}

// Seconds per call of `op` (a burst of `calls` then one Synchronize), median of three.
template <typename Op>
double TimeCalls(Backend& b, int calls, Op op) {
  for (int i = 0; i < 3; ++i) op(i);  // warm-up
  Check(b.Synchronize(), "warm-up");
  std::vector<double> trials;
  for (int t = 0; t < 3; ++t) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) op(i);
    Check(b.Synchronize(), "timed calls");
    trials.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / calls);
  }
  std::sort(trials.begin(), trials.end());
  return trials[1];
}

// Attention at the 8B shape: 32 query heads over 8 KV heads of 128, bf16 KV in 16-token blocks.
constexpr int kHeads = 32, kKvHeads = 8, kHeadDim = 128, kBlock = 16;

// One layer's KV cache of `num_blocks` blocks and `q_rows` query rows, random (seeds seed and
// seed + 1), and their output.
struct AttentionBuffers {
  kernels::KvLayout layout;
  DeviceBuffer cache, q, out;
};
AttentionBuffers MakeAttentionBuffers(Backend& b, int num_blocks, int q_rows, uint64_t seed) {
  const kernels::KvLayout layout{.num_blocks = num_blocks,
                                 .block_size = kBlock,
                                 .num_kv_heads = kKvHeads,
                                 .head_dim = kHeadDim,
                                 .dtype = DType::kBF16};
  const size_t q_bytes = sizeof(float) * q_rows * kHeads * kHeadDim;
  auto cache = b.Allocate(static_cast<size_t>(layout.LayerBytes()));
  auto q = b.Allocate(q_bytes);
  auto out = b.Allocate(q_bytes);
  if (!cache.ok() || !q.ok() || !out.ok()) Die("attention buffers");
  const std::vector<uint16_t> kv = RandomBf16(layout.LayerElements(), seed, 1.0f);
  b.CopyToDevice(cache->data(), kv.data(), kv.size() * 2);
  const std::vector<float> qs = RandomF32(int64_t{q_rows} * kHeads * kHeadDim, seed + 1);
  b.CopyToDevice(q->data(), qs.data(), q_bytes);
  return {layout, std::move(cache).value(), std::move(q).value(), std::move(out).value()};
}

// Seconds per PagedAttention call over `a` (TimeCalls).
double TimeAttention(Backend& b, AttentionBuffers& a, const kernels::PagedAttentionBatch& batch,
                     int calls) {
  return TimeCalls(b, calls, [&](int) {
    b.PagedAttention(a.q.as<float>(), a.cache.data(), a.layout, batch, kHeads,
                     1.0f / std::sqrt(static_cast<float>(kHeadDim)), a.out.as<float>(),
                     DType::kF32);
  });
}

struct Row {
  std::string op, shape;
  double us, gbs, tflops, of_copy;
};

}  // namespace
}  // namespace tandem

int main(int argc, char** argv) {
  using namespace tandem;
  auto created = kernels::CreateCudaBackend(
      {.max_seqs = 256,
       .max_blocks_per_seq = 32768 / 16,
       // The 4096-token prefill needs the most merge workspace (decode rows are few).
       .attention_workspace_bytes = kernels::CudaAttentionWorkspaceBytes(4096, 32, 128, 4096)});
  if (!created.ok()) Die(std::string(created.status().message()));
  Backend& b = **created;
  // The same Linear (m > 4) through cuBLASLt alone and through cublasGemmEx and a bias kernel.
  struct Alternative {
    const char* op;
    std::unique_ptr<kernels::CudaBackend> backend;
  };
  std::vector<Alternative> alternatives;
  for (auto [op, gemm] :
       {std::pair{"Linear bf16 cuBLASLt", kernels::CudaBackendOptions::Gemm::kCublasLt},
        std::pair{"Linear bf16 GemmEx", kernels::CudaBackendOptions::Gemm::kCublas}}) {
    auto alternative = kernels::CreateCudaBackend(
        {.max_seqs = 1, .max_blocks_per_seq = 1, .attention_workspace_bytes = 0, .gemm = gemm});
    if (!alternative.ok()) Die(std::string(alternative.status().message()));
    alternatives.push_back({op, std::move(alternative).value()});
  }
  const double copy_gbs = bench::MeasureCudaCopyGBs();
  if (copy_gbs <= 0) Die("cannot measure the device copy bandwidth");
  std::vector<Row> rows;

  // Linear: the 8B projections (n, k) as the runner fuses them.
  const int hidden = 4096, inter = 14336, q_dim = 4096, kv_dim = 1024, vocab = 128256;
  const std::vector<int> decode_ms = {1, 2, 4, 8, 16, 64, 256};
  const struct {
    const char* name;
    int n, k;
    std::vector<int> ms;
  } projections[] = {{"qkv", q_dim + 2 * kv_dim, hidden, decode_ms},
                     {"o", hidden, q_dim, decode_ms},
                     {"gate_up", 2 * inter, hidden, decode_ms},
                     {"down", hidden, inter, decode_ms},
                     {"lm_head", vocab, hidden, decode_ms},
                     // scripts/gpu_baselines.py's torch.matmul shapes, for a ratio in one run.
                     {"torch_shape", 14336, 4096, {1, 8, 64, 256, 2048}},
                     {"torch_square", 8192, 8192, {8192}}};
  const int64_t x_floats = std::max<int64_t>(int64_t{256} * inter, int64_t{8192} * 8192);
  const int64_t y_floats = std::max<int64_t>(int64_t{256} * vocab, int64_t{8192} * 8192);
  // x in fp32 and, as the runner's producers store it past 4 rows (ActivationDType), in bf16.
  auto x = b.Allocate(sizeof(float) * x_floats);
  auto x16 = b.Allocate(sizeof(uint16_t) * x_floats);
  auto y = b.Allocate(sizeof(float) * y_floats);
  if (!x.ok() || !x16.ok() || !y.ok()) Die("activation buffers");
  {
    const std::vector<float> xs = RandomF32(x_floats, 1);
    b.CopyToDevice(x->data(), xs.data(), xs.size() * sizeof(float));
    const std::vector<uint16_t> x16s = RandomBf16(x_floats, 2, 1.0f);
    b.CopyToDevice(x16->data(), x16s.data(), x16s.size() * sizeof(uint16_t));
  }
  for (const auto& proj : projections) {
    const int64_t weight_bytes = int64_t{proj.n} * proj.k * 2;
    const int copies =
        static_cast<int>(std::clamp<int64_t>((256ll << 20) / weight_bytes + 1, 1, 8));
    // [0]: b's; then each alternative's.
    std::vector<std::vector<std::unique_ptr<kernels::PackedWeight>>> weights(
        1 + alternatives.size());
    for (int c = 0; c < copies; ++c) {
      const std::vector<uint16_t> w =
          RandomBf16(int64_t{proj.n} * proj.k, 100 + c, 1.0f / std::sqrt(float(proj.k)));
      weights[0].push_back(b.PackWeight(w.data(), DType::kBF16, proj.n, proj.k));
      for (size_t a = 0; a < alternatives.size(); ++a) {
        weights[a + 1].push_back(
            alternatives[a].backend->PackWeight(w.data(), DType::kBF16, proj.n, proj.k));
      }
    }
    Check(b.Synchronize(), "PackWeight");
    for (Alternative& a : alternatives) Check(a.backend->Synchronize(), "PackWeight");
    for (int m : proj.ms) {
      const int calls = m <= 16 ? 50 : m <= 256 ? 10 : 5;
      // Every backend on the same device buffers, one after the other (TimeCalls synchronises).
      for (size_t which = 0; which <= alternatives.size(); ++which) {
        if (which > 0 && m <= 4) continue;  // all run the GEMV there
        Backend& on = which == 0 ? b : *alternatives[which - 1].backend;
        const auto& packed = weights[which];
        const DType x_dtype = on.ActivationDType(m, *packed[0]);
        const void* x_in = x_dtype == DType::kF32 ? x->data() : x16->data();
        const double s = TimeCalls(on, calls, [&](int i) {
          on.Linear(x_in, x_dtype, m, *packed[i % copies], nullptr, y->as<float>());
        });
        const double bytes =
            weight_bytes + double(DTypeSize(x_dtype)) * m * proj.k + 4.0 * m * proj.n;
        const double gbs = bytes / s / 1e9;
        rows.push_back({which == 0 ? "Linear bf16" : alternatives[which - 1].op,
                        absl::StrCat(proj.name, " m", m, " n", proj.n, " k", proj.k), s * 1e6,
                        gbs, 2.0 * m * proj.n * proj.k / s / 1e12, gbs / copy_gbs});
      }
    }
  }

  // PagedAttention, decode: batch x context.
  const struct {
    int batch, context;
  } decodes[] = {{1, 4096}, {1, 32768}, {8, 8192}, {16, 4096}, {64, 1024}, {64, 4096},
                 {256, 512}};
  for (const auto& d : decodes) {
    const int blocks_per_seq = (d.context + kBlock - 1) / kBlock;
    AttentionBuffers a = MakeAttentionBuffers(b, d.batch * blocks_per_seq, d.batch, 7);
    // Blocks scattered: sequence s takes every batch-th block starting at s, reversed.
    std::vector<int32_t> query_start(d.batch + 1), context_len(d.batch, d.context),
        table(static_cast<size_t>(d.batch) * blocks_per_seq);
    for (int s = 0; s <= d.batch; ++s) query_start[s] = s;
    for (int s = 0; s < d.batch; ++s) {
      for (int i = 0; i < blocks_per_seq; ++i) {
        table[static_cast<size_t>(s) * blocks_per_seq + i] =
            (blocks_per_seq - 1 - i) * d.batch + s;
      }
    }
    const double s = TimeAttention(
        b, a, {d.batch, query_start.data(), context_len.data(), table.data(), blocks_per_seq}, 20);
    const double bytes = 2.0 * d.batch * d.context * kKvHeads * kHeadDim * 2;
    const double gbs = bytes / s / 1e9;
    rows.push_back({"PagedAttention decode bf16 KV",
                    absl::StrCat("batch ", d.batch, " x context ", d.context), s * 1e6, gbs,
                    4.0 * d.batch * d.context * kHeads * kHeadDim / s / 1e12, gbs / copy_gbs});
  }

  // Prefill attention: one causal 4096-token prompt in one call.
  {
    const int tokens = 4096;
    const int blocks_per_seq = tokens / kBlock;
    AttentionBuffers a = MakeAttentionBuffers(b, blocks_per_seq, tokens, 9);
    std::vector<int32_t> query_start = {0, tokens}, context_len = {tokens}, table(blocks_per_seq);
    for (int i = 0; i < blocks_per_seq; ++i) table[i] = i;
    const double s = TimeAttention(
        b, a, {1, query_start.data(), context_len.data(), table.data(), blocks_per_seq}, 3);
    const double flops = 4.0 * tokens * tokens * kHeadDim * kHeads / 2;
    rows.push_back({"PagedAttention prefill causal", "4096 tokens, 32/8 heads, hd 128",
                    s * 1e6, 0, flops / s / 1e12, 0});
  }

  // Sampling in the backend against copying the logits back for the host.
  {
    const int max_rows = 256;
    auto logits = b.Allocate(sizeof(float) * max_rows * vocab);
    auto sampled = b.Allocate(sizeof(kernels::TokenLogprob) * max_rows);
    auto top = b.Allocate(sizeof(kernels::TokenLogprob) * max_rows * kernels::kMaxSampleLogprobs);
    auto scratch = b.Allocate(b.SampleRowsScratchBytes(max_rows, vocab, 0));
    auto host = b.AllocateHostStaging(sizeof(float) * max_rows * vocab);
    if (!logits.ok() || !sampled.ok() || !top.ok() || !scratch.ok() || !host.ok()) {
      Die("sampling buffers");
    }
    {
      std::vector<float> ls = RandomF32(int64_t{max_rows} * vocab, 11);
      for (float& l : ls) l *= 8.0f;
      b.CopyToDevice(logits->data(), ls.data(), ls.size() * sizeof(float));
    }
    const struct {
      const char* name;
      kernels::SampleRowParams params;
    } kinds[] = {{"greedy", {.temperature = 0.0f}},
                 {"temperature 1", {.uniform = 0.37, .temperature = 1.0f}},
                 {"top-k 50 top-p 0.9",
                  {.uniform = 0.37, .temperature = 0.8f, .top_p = 0.9f, .top_k = 50}},
                 {"greedy + 5 logprobs", {.temperature = 0.0f, .num_logprobs = 5}}};
    for (int m : {1, 8, 64, 256}) {
      const double bytes = 4.0 * m * vocab;
      for (const auto& kind : kinds) {
        const std::vector<kernels::SampleRowParams> params(m, kind.params);
        const double s = TimeCalls(b, 10, [&](int) {
          b.SampleRows(logits->as<float>(), m, vocab, params.data(), nullptr, 0,
                       kernels::kMaxSampleLogprobs, scratch->data(),
                       sampled->as<kernels::TokenLogprob>(), top->as<kernels::TokenLogprob>());
        });
        rows.push_back({"SampleRows", absl::StrCat(kind.name, ", ", m, " x ", vocab), s * 1e6,
                        bytes / s / 1e9, 0, bytes / s / 1e9 / copy_gbs});
      }
      const double s = TimeCalls(b, 10, [&](int) {
        b.CopyToHost(host->data(), logits->data(), static_cast<size_t>(bytes));
      });
      rows.push_back({"logits to host (host sampling)", absl::StrCat(m, " x ", vocab), s * 1e6,
                      bytes / s / 1e9, 0, bytes / s / 1e9 / copy_gbs});
    }
  }

  std::printf("device copy bandwidth (cudaMemcpy 1 GiB, read + write): %.1f GB/s\n", copy_gbs);
  std::printf("%-30s %-34s %10s %9s %8s %8s\n", "op", "shape", "us", "GB/s", "TFLOP/s",
              "of_copy");
  for (const Row& r : rows) {
    std::printf("%-30s %-34s %10.1f %9.1f %8.2f %8.3f\n", r.op.c_str(), r.shape.c_str(), r.us,
                r.gbs, r.tflops, r.of_copy);
  }
  if (argc > 1) {
    FILE* f = std::fopen(argv[1], "w");
    if (f == nullptr) Die(absl::StrCat("cannot write ", argv[1]));
    std::fprintf(f, "{\"copy_gbs\": %.1f, \"rows\": [\n", copy_gbs);
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::fprintf(f,
                   " {\"op\": \"%s\", \"shape\": \"%s\", \"us\": %.2f, \"gbs\": %.1f, "
                   "\"tflops\": %.3f, \"of_copy\": %.4f}%s\n",
                   r.op.c_str(), r.shape.c_str(), r.us, r.gbs, r.tflops, r.of_copy,
                   i + 1 < rows.size() ? "," : "");
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}
