// CPU kernel benchmarks: Tandem's GEMM against OpenBLAS sgemm for decode and prefill shapes,
// weight streaming against copy bandwidth, paged decode attention, and thread-pool dispatch.
//
//   build/bin/tandem_bench_kernels --benchmark_filter=Linear
//
// Rates use wall-clock time (UseRealTime): the work runs on more than the calling thread.
// Every benchmark uses two threads (the machine the figures in bench/results/ come from has two
// cores). "Cold" variants cycle through more weights than the last-level cache holds, as a
// decode step does walking its layers; the plain variants reuse one weight, which may stay
// cached.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <map>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/bandwidth.h"
#include "benchmark/benchmark.h"
#include "kernels/src/cpu/thread_pool.h"
#include "tandem/base/half.h"
#include "tandem/kernels/backend.h"

#if TANDEM_BENCH_OPENBLAS
#include <cblas.h>
#endif

namespace tandem::bench {
namespace {

constexpr int kThreads = 2;
// 16 weights of 2048 x 2048 floats: 256 MiB, beyond any last-level cache here.
constexpr int64_t kColdBytes = int64_t{256} << 20;

std::vector<float> Random(int64_t size, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(size);
  for (float& x : v) x = dist(gen);
  return v;
}

kernels::Backend& Cpu() {
  static kernels::Backend* backend = [] {
    auto created = kernels::CreateCpuBackend({.num_threads = kThreads});
    if (!created.ok()) std::abort();
    return created->release();
  }();
  return *backend;
}

// OpenBLAS's workers spin for a while after each call, taking the cores from whatever runs
// next; a Tandem benchmark that follows one waits for them to park first.
bool openblas_ran = false;
void LetOpenBlasPark() {
  if (!openblas_ran) return;
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  openblas_ran = false;
}

// Measured once per run, the first time a benchmark asks.
double CopyGBs() {
  static const double gbs = MeasureCopyBandwidthGBs(kThreads);
  return gbs;
}

// bytes_per_weight: of the weight's format (4 for fp32), scales and zero points included.
void ReportGemm(benchmark::State& state, int64_t m, int64_t n, int64_t k,
                double bytes_per_weight = 4.0) {
  const double iterations = static_cast<double>(state.iterations());
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * m * n * k * iterations / 1e9, benchmark::Counter::kIsRate);
  // Weight bytes per second: what a few-row product is limited by.
  state.counters["W_GB/s"] = benchmark::Counter(bytes_per_weight * n * k * iterations / 1e9,
                                                benchmark::Counter::kIsRate);
}

// Weight streaming (reads only) as a fraction of copy bandwidth (reads + writes).
void ReportAgainstCopy(benchmark::State& state, int64_t n, int64_t k, double copy_gbs,
                       double bytes_per_weight = 4.0) {
  state.counters["copy_GB/s"] = copy_gbs;
  state.counters["W_of_copy"] = benchmark::Counter(
      bytes_per_weight * n * k * static_cast<double>(state.iterations()) / 1e9 / copy_gbs,
      benchmark::Counter::kIsRate);
}

// Args: m, n, k.
void BM_Linear(benchmark::State& state) {
  const int m = state.range(0), n = state.range(1), k = state.range(2);
  const std::vector<float> w = Random(int64_t{n} * k, 1);
  const std::vector<float> x = Random(int64_t{m} * k, 2);
  std::vector<float> y(int64_t{m} * n);
  auto packed = Cpu().PackWeight(w.data(), DType::kF32, n, k);
  LetOpenBlasPark();
  for (auto _ : state) {
    Cpu().Linear(x.data(), DType::kF32, m, *packed, nullptr, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  ReportGemm(state, m, n, k);
}

// The weights BM_LinearColdWeights streams: a format, and the CPU instruction set whose kernels
// multiply by it (kAuto: the backend's default).
enum class ColdWeights { kF32, kBf16, kInt8, kInt4 };
struct ColdFormat {
  const char* name;
  ColdWeights weights;
  kernels::CpuIsa isa;
};
// bfloat16@avx512 and int4@avx512 are the kernels that widen each weight to fp32, against the
// default's vdpbf16ps on CPUs with AVX-512 BF16; bfloat16@avx512-bf16-round rounds x to bf16.
constexpr ColdFormat kColdFormats[] = {
    {"float32", ColdWeights::kF32, kernels::CpuIsa::kAuto},
    {"bfloat16", ColdWeights::kBf16, kernels::CpuIsa::kAuto},
    {"bfloat16@avx512", ColdWeights::kBf16, kernels::CpuIsa::kAvx512},
    {"bfloat16@avx512-bf16-round", ColdWeights::kBf16, kernels::CpuIsa::kAvx512Bf16Round},
    {"int8", ColdWeights::kInt8, kernels::CpuIsa::kAuto},
    {"int4 g128", ColdWeights::kInt4, kernels::CpuIsa::kAuto},
    {"int4 g128@avx512", ColdWeights::kInt4, kernels::CpuIsa::kAvx512},
};

// The CPU backend of `isa`, or null where the CPU lacks it.
kernels::Backend* CpuOf(kernels::CpuIsa isa) {
  if (isa == kernels::CpuIsa::kAuto) return &Cpu();
  static std::map<kernels::CpuIsa, kernels::Backend*> backends;
  auto [it, added] = backends.try_emplace(isa, nullptr);
  if (added) {
    auto created = kernels::CreateCpuBackend({.num_threads = kThreads, .isa = isa});
    if (created.ok()) it->second = created->release();
  }
  return it->second;
}

// Bytes the Linear reads per weight, scales and zero points included.
double ColdBytesPerWeight(ColdWeights weights) {
  switch (weights) {
    case ColdWeights::kF32:
      return 4.0;
    case ColdWeights::kBf16:
      return 2.0;
    case ColdWeights::kInt8:
      return 1.0;
    case ColdWeights::kInt4:
      return 0.5 + 8.0 / 128;  // a float scale and a float zero point per 128 weights
  }
  return 4.0;
}

std::unique_ptr<kernels::PackedWeight> PackCold(kernels::Backend& backend, ColdWeights weights,
                                               const std::vector<float>& w, int n, int k) {
  if (weights == ColdWeights::kF32) return backend.PackWeight(w.data(), DType::kF32, n, k);
  if (weights == ColdWeights::kBf16) {
    std::vector<uint16_t> bf16(w.size());
    for (size_t i = 0; i < w.size(); ++i) bf16[i] = FloatToBf16(w[i]);
    return backend.PackWeight(bf16.data(), DType::kBF16, n, k);
  }
  const bool int4 = weights == ColdWeights::kInt4;
  const int group = int4 ? 128 : k;
  std::vector<int8_t> values(w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    values[i] = static_cast<int8_t>(int4 ? (i * 7) % 16 : (static_cast<int>(i * 37) % 255) - 127);
  }
  std::vector<float> scales(int64_t{n} * (k / group), 0.01f);
  std::vector<int8_t> zeros(int4 ? scales.size() : 0, 8);
  const kernels::QuantizedWeightView view{
      .quant = int4 ? kernels::WeightQuant::kInt4 : kernels::WeightQuant::kInt8,
      .n = n,
      .k = k,
      .group_size = group,
      .values = values.data(),
      .scales = scales.data(),
      .zeros = int4 ? zeros.data() : nullptr};
  return backend.PackQuantizedWeight(view);
}

// Args: m, n, k, index into kColdFormats. Each iteration multiplies by the next of enough
// weights to miss the caches; W_GB/s counts the bytes of the weight's own format.
void BM_LinearColdWeights(benchmark::State& state) {
  const int m = state.range(0), n = state.range(1), k = state.range(2);
  const ColdFormat& format = kColdFormats[state.range(3)];
  kernels::Backend* backend = CpuOf(format.isa);
  if (backend == nullptr) {
    state.SkipWithError("this CPU lacks the instruction set");
    return;
  }
  const double bytes_per_weight = ColdBytesPerWeight(format.weights);
  const double weight_bytes = bytes_per_weight * n * k;
  const int count =
      static_cast<int>(std::max<double>(2, static_cast<double>(kColdBytes) / weight_bytes));
  std::vector<std::unique_ptr<kernels::PackedWeight>> weights;
  {
    const std::vector<float> w = Random(int64_t{n} * k, 1);
    for (int i = 0; i < count; ++i) weights.push_back(PackCold(*backend, format.weights, w, n, k));
  }
  const std::vector<float> x = Random(int64_t{m} * k, 2);
  std::vector<float> y(int64_t{m} * n);
  const double copy_gbs = CopyGBs();
  LetOpenBlasPark();
  int next = 0;
  for (auto _ : state) {
    backend->Linear(x.data(), DType::kF32, m, *weights[next], nullptr, y.data());
    benchmark::DoNotOptimize(y.data());
    next = (next + 1) % count;
  }
  ReportGemm(state, m, n, k, bytes_per_weight);
  ReportAgainstCopy(state, n, k, copy_gbs, bytes_per_weight);
  state.SetLabel(std::string(format.name) + ", " + std::string(backend->name()));
}

#if TANDEM_BENCH_OPENBLAS
void BM_Sgemm(benchmark::State& state) {
  const int m = state.range(0), n = state.range(1), k = state.range(2);
  openblas_set_num_threads(kThreads);
  const std::vector<float> w = Random(int64_t{n} * k, 1);
  const std::vector<float> x = Random(int64_t{m} * k, 2);
  std::vector<float> y(int64_t{m} * n);
  for (auto _ : state) {
    // y[m, n] = x[m, k] * W[n, k]^T, the same product as Linear.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x.data(), k, w.data(), k,
                0.0f, y.data(), n);
    benchmark::DoNotOptimize(y.data());
  }
  openblas_ran = true;
  ReportGemm(state, m, n, k);
}

void BM_SgemmColdWeights(benchmark::State& state) {
  const int m = state.range(0), n = state.range(1), k = state.range(2);
  openblas_set_num_threads(kThreads);
  const int count = static_cast<int>(std::max<int64_t>(2, kColdBytes / (int64_t{4} * n * k)));
  std::vector<std::vector<float>> weights(count, Random(int64_t{n} * k, 1));
  const std::vector<float> x = Random(int64_t{m} * k, 2);
  std::vector<float> y(int64_t{m} * n);
  const double copy_gbs = CopyGBs();
  int next = 0;
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x.data(), k,
                weights[next].data(), k, 0.0f, y.data(), n);
    benchmark::DoNotOptimize(y.data());
    next = (next + 1) % count;
  }
  openblas_ran = true;
  ReportGemm(state, m, n, k);
  ReportAgainstCopy(state, n, k, copy_gbs);
}
#endif

// Decode attention of `seqs` sequences of `context` tokens each, Llama-3-8B shape (32 query
// heads over 8 KV heads of 128), block size 16. Args: seqs, context.
void BM_Attention(benchmark::State& state) {
  const int seqs = state.range(0), context = state.range(1);
  const int heads = 32, kv_heads = 8, head_dim = 128, block = 16;
  const int blocks_per_seq = (context + block - 1) / block;
  const kernels::KvLayout layout{.num_blocks = seqs * blocks_per_seq,
                                 .block_size = block,
                                 .num_kv_heads = kv_heads,
                                 .head_dim = head_dim};
  const std::vector<float> cache = Random(layout.LayerElements(), 3);
  const std::vector<float> q = Random(int64_t{seqs} * heads * head_dim, 4);
  std::vector<float> out(q.size());
  std::vector<int32_t> query_start(seqs + 1), context_len(seqs, context),
      block_table(int64_t{seqs} * blocks_per_seq);
  for (int s = 0; s <= seqs; ++s) query_start[s] = s;
  for (size_t i = 0; i < block_table.size(); ++i) block_table[i] = static_cast<int32_t>(i);
  const kernels::PagedAttentionBatch batch{.num_seqs = seqs,
                                           .query_start = query_start.data(),
                                           .context_len = context_len.data(),
                                           .block_table = block_table.data(),
                                           .max_blocks_per_seq = blocks_per_seq};
  LetOpenBlasPark();
  for (auto _ : state) {
    Cpu().PagedAttention(q.data(), cache.data(), layout, batch, heads, 0.088f, out.data(),
                         DType::kF32);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["KV_GB/s"] =
      benchmark::Counter(8.0 * seqs * context * kv_heads * head_dim * state.iterations() / 1e9,
                         benchmark::Counter::kIsRate);
}

// Decode attention of one sequence of `context` tokens over a bf16 cache that misses the caches,
// as in a decode step whose weights stream through them: the medium preset's shape (16 query
// heads over 8 KV heads of 128), block size 16, each call on the next of enough layers' caches to
// exceed kColdBytes. Args: context, blocks in order (1) or shuffled (0, as a cache that has
// served a while hands them out). of_read: KV bytes per second against the read kernel's rate
// measured in the same run.
void BM_AttentionColdBf16(benchmark::State& state) {
  const int context = state.range(0);
  const bool in_order = state.range(1) != 0;
  const int heads = 16, kv_heads = 8, head_dim = 128, block = 16;
  const int blocks = (context + block - 1) / block;
  const kernels::KvLayout layout{.num_blocks = blocks,
                                 .block_size = block,
                                 .num_kv_heads = kv_heads,
                                 .head_dim = head_dim,
                                 .dtype = DType::kBF16};
  const int layers = static_cast<int>(std::max<int64_t>(2, kColdBytes / layout.LayerBytes()));
  std::vector<uint16_t> caches(layout.LayerElements() * layers);
  const std::vector<float> values = Random(4096, 3);
  for (size_t i = 0; i < caches.size(); ++i) caches[i] = FloatToBf16(values[i % values.size()]);
  const std::vector<float> q = Random(int64_t{heads} * head_dim, 4);
  std::vector<float> out(q.size());
  std::vector<int32_t> query_start = {0, 1}, context_len = {context}, block_table(blocks);
  std::iota(block_table.begin(), block_table.end(), 0);
  if (!in_order) std::shuffle(block_table.begin(), block_table.end(), std::mt19937(5));
  const kernels::PagedAttentionBatch batch{.num_seqs = 1,
                                           .query_start = query_start.data(),
                                           .context_len = context_len.data(),
                                           .block_table = block_table.data(),
                                           .max_blocks_per_seq = blocks};
  const double read_gbs = MeasureReadBandwidthGBs(kThreads);
  LetOpenBlasPark();
  int layer = 0;
  for (auto _ : state) {
    Cpu().PagedAttention(q.data(), caches.data() + layout.LayerElements() * layer, layout, batch,
                         heads, 0.088f, out.data(), DType::kF32);
    benchmark::DoNotOptimize(out.data());
    layer = (layer + 1) % layers;
  }
  const double kv_bytes = static_cast<double>(layout.LayerBytes()) * state.iterations();
  state.counters["KV_GB/s"] = benchmark::Counter(kv_bytes / 1e9, benchmark::Counter::kIsRate);
  state.counters["read_GB/s"] = read_gbs;
  state.counters["of_read"] =
      benchmark::Counter(kv_bytes / 1e9 / read_gbs, benchmark::Counter::kIsRate);
}

// One ParallelFor of two trivial chunks: the fixed cost every threaded operator pays.
void BM_ParallelForDispatch(benchmark::State& state) {
  auto pool = kernels::cpu::ThreadPool::Create(kThreads);
  if (!pool.ok()) std::abort();
  int64_t sink[2] = {0, 0};
  for (auto _ : state) {
    (*pool)->ParallelFor(2, 1, [&](int64_t begin, int64_t, int thread) { sink[thread] += begin; });
  }
  benchmark::DoNotOptimize(sink);
}

void BM_CopyBandwidth(benchmark::State& state) {
  double gbs = 0.0;
  for (auto _ : state) gbs = MeasureCopyBandwidthGBs(kThreads);
  state.counters["GB/s"] = gbs;
}

void BM_ReadBandwidth(benchmark::State& state) {
  double gbs = 0.0;
  for (auto _ : state) gbs = MeasureReadBandwidthGBs(kThreads);
  state.counters["GB/s"] = gbs;
}

// Registers each Tandem benchmark next to its OpenBLAS twin, so that both see the same load on
// a shared machine. Decode (m = 1, 8, 16) and prefill (m = 256, 512) over
// Llama-3.2-1B-like projections: square 2048, gate/up 2048 -> 8192, down 8192 -> 2048.
void RegisterAll() {
  benchmark::RegisterBenchmark("BM_CopyBandwidth", BM_CopyBandwidth)
      ->Iterations(1)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_ReadBandwidth", BM_ReadBandwidth)
      ->Iterations(1)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_ParallelForDispatch", BM_ParallelForDispatch)->UseRealTime();
  std::vector<std::vector<int64_t>> shapes;
  for (int64_t m : {1, 8, 16, 256, 512}) {
    shapes.push_back({m, 2048, 2048});
    if (m <= 16) {
      shapes.push_back({m, 8192, 2048});
      shapes.push_back({m, 2048, 8192});
    }
  }
  for (const std::vector<int64_t>& shape : shapes) {
    benchmark::RegisterBenchmark("BM_Linear", BM_Linear)
        ->Args(shape)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
#if TANDEM_BENCH_OPENBLAS
    benchmark::RegisterBenchmark("BM_Sgemm", BM_Sgemm)
        ->Args(shape)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
#endif
  }
  for (int64_t m : {1, 8, 16, 256}) {
    for (int64_t format = 0; format < static_cast<int64_t>(std::size(kColdFormats)); ++format) {
      benchmark::RegisterBenchmark("BM_LinearColdWeights", BM_LinearColdWeights)
          ->Args({m, 2048, 2048, format})
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
#if TANDEM_BENCH_OPENBLAS
    benchmark::RegisterBenchmark("BM_SgemmColdWeights", BM_SgemmColdWeights)
        ->Args({m, 2048, 2048})
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
#endif
  }
  // Decode rows over the small preset's projections (hidden 512, intermediate 1536): qkv, o,
  // gate/up, down, of 0.5 to 3 MB in bf16, where a call's fixed costs (x packed per chunk, the
  // pool's dispatch and last chunk) weigh more than at 2048 x 2048.
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{
           {1, 1024, 512}, {1, 512, 512}, {1, 3072, 512}, {1, 512, 1536}}) {
    // float32, and bfloat16 by the split-x vdpbf16ps kernel (auto), widened to fp32 (avx512)
    // and with x rounded (avx512-bf16-round).
    for (int64_t format = 0; format < 4; ++format) {
      benchmark::RegisterBenchmark("BM_LinearColdWeights", BM_LinearColdWeights)
          ->Args({shape[0], shape[1], shape[2], format})
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
  }
  benchmark::RegisterBenchmark("BM_Attention", BM_Attention)
      ->Args({1, 1024})
      ->Args({8, 1024})
      ->Args({1, 64})
      ->Unit(benchmark::kMicrosecond)
      ->UseRealTime();
  benchmark::RegisterBenchmark("BM_AttentionColdBf16", BM_AttentionColdBf16)
      ->Args({256, 1})
      ->Args({256, 0})
      ->Args({2048, 1})
      ->Args({2048, 0})
      ->Unit(benchmark::kMicrosecond)
      ->UseRealTime();
}

}  // namespace
}  // namespace tandem::bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  tandem::bench::RegisterAll();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
