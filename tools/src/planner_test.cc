#include "tandem/tools/planner.h"

#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "tandem/base/status_macros.h"

namespace tandem::tools {
namespace {

// t = 10 ms + 0.1 ms per token + 1 ms per sequence + 1 us per context token, both phases.
LatencyModel SimpleModel() {
  LatencyModel m;
  m.prefill = {10e-3, 0.1e-3, 1e-3, 1e-6};
  m.decode = {5e-3, 0.05e-3, 0.5e-3, 2e-6};
  return m;
}

InstanceSpec Instance(int max_num_seqs = 64, int max_num_batched_tokens = 512) {
  InstanceSpec s;
  s.max_num_seqs = max_num_seqs;
  s.max_num_batched_tokens = max_num_batched_tokens;
  s.model = SimpleModel();
  return s;
}

// The e2e of a request alone: its prefill chunks, then one decode step per further token.
double AloneSeconds(const LatencyModel& m, int64_t prompt, int64_t output, int64_t chunk,
                    double* ttft) {
  double t = 0;
  for (int64_t done = 0; done < prompt;) {
    const int64_t n = std::min(chunk, prompt - done);
    done += n;
    t += m.StepSeconds(n, n, 1, done);
  }
  *ttft = t;
  for (int64_t k = 1; k < output; ++k) t += m.StepSeconds(1, 0, 1, prompt + k);
  return t;
}

TEST(PlannerSim, OneRequestAloneTtftIsItsPrefill) {
  const ClusterSpec c = ColocatedCluster(Instance(), 1);
  for (int64_t prompt : {1, 100, 512, 1300}) {
    auto r = Simulate(c, {{2.0, prompt, 5}});
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->requests.size(), 1u);
    double ttft = 0;
    const double e2e = AloneSeconds(SimpleModel(), prompt, 5, 512, &ttft);
    EXPECT_NEAR(r->requests[0].ttft, ttft, 1e-12) << prompt;
    EXPECT_NEAR(r->requests[0].e2e, e2e, 1e-12) << prompt;
    EXPECT_NEAR(r->requests[0].Tpot(), (e2e - ttft) / 4, 1e-12);
  }
  // Prompt of 1300 tokens in chunks of 512: 512, 512, 276 (context 512, 1024, 1300).
  const LatencyModel m = SimpleModel();
  double ttft = 0;
  AloneSeconds(m, 1300, 1, 512, &ttft);
  EXPECT_NEAR(ttft, m.StepSeconds(512, 512, 1, 512) + m.StepSeconds(512, 512, 1, 1024) +
                        m.StepSeconds(276, 276, 1, 1300),
              1e-12);
}

TEST(PlannerSim, MD1QueueMatchesPollaczekKhinchine) {
  // One sequence at a time, one-token outputs: every request is one step of a fixed length D,
  // served FCFS: an M/D/1 queue. Mean wait = rho D / (2 (1 - rho)).
  const ClusterSpec c = ColocatedCluster(Instance(/*max_num_seqs=*/1), 1);
  const double d = SimpleModel().StepSeconds(100, 100, 1, 100);
  for (double rho : {0.3, 0.6, 0.8}) {
    WorkloadSpec w;
    w.input.mean = 100;
    w.output.mean = 1;
    w.rate = rho / d;
    w.num_requests = 40000;
    w.seed = 7;
    auto r = Simulate(c, MakeArrivals(w));
    ASSERT_TRUE(r.ok());
    double sum = 0;
    for (const SimRequest& q : r->requests) sum += q.ttft;
    const double mean = sum / static_cast<double>(r->requests.size());
    const double expected = d + rho * d / (2 * (1 - rho));
    EXPECT_NEAR(mean, expected, 0.05 * expected) << "rho " << rho;
  }
}

TEST(PlannerSim, MoreLoadNeverLowersLatency) {
  const ClusterSpec c = ColocatedCluster(Instance(16, 256), 1);
  double last_ttft = 0, last_e2e = 0;
  for (double rate : {0.5, 1.0, 2.0, 4.0, 8.0, 16.0}) {
    WorkloadSpec w;
    w.input = {"uniform", 200, 100, 0};
    w.output = {"uniform", 40, 20, 0};
    w.rate = rate;
    w.num_requests = 300;
    auto r = Simulate(c, MakeArrivals(w));
    ASSERT_TRUE(r.ok());
    const SimSummary s = SummarizeSim(*r, {1, 1}, 1);
    EXPECT_GE(s.ttft.mean, last_ttft * 0.999) << rate;
    EXPECT_GE(s.e2e.mean, last_e2e * 0.999) << rate;
    last_ttft = s.ttft.mean;
    last_e2e = s.e2e.mean;
  }
}

TEST(PlannerSim, DisaggregatedWithFreeTransferIsThePipeline) {
  // One prefill and one decode instance, the KV move free, one prompt per prefill step.
  const InstanceSpec p = Instance(64, 100);
  const InstanceSpec d = Instance(64, 512);
  const ClusterSpec c = DisaggCluster(p, 1, d, 1, /*kv_bytes_per_token=*/1000, /*link=*/0);
  const LatencyModel m = SimpleModel();
  // Alone: the same times as colocated.
  {
    auto r = Simulate(c, {{0, 100, 6}});
    ASSERT_TRUE(r.ok());
    double ttft = 0;
    const double e2e = AloneSeconds(m, 100, 6, 100, &ttft);
    EXPECT_NEAR(r->requests[0].ttft, ttft, 1e-12);
    EXPECT_NEAR(r->requests[0].e2e, e2e, 1e-12);
  }
  // Two at once: prefills back to back (P, 2P); the first decodes during the second prefill.
  {
    auto r = Simulate(c, {{0, 100, 3}, {0, 100, 3}});
    ASSERT_TRUE(r.ok());
    const double pf = m.StepSeconds(100, 100, 1, 100);
    const double decode2 = m.StepSeconds(1, 0, 1, 101) + m.StepSeconds(1, 0, 1, 102);
    ASSERT_LT(decode2, pf);
    EXPECT_NEAR(r->requests[0].ttft, pf, 1e-12);
    EXPECT_NEAR(r->requests[0].e2e, pf + decode2, 1e-12);
    EXPECT_NEAR(r->requests[1].ttft, 2 * pf, 1e-12);
    EXPECT_NEAR(r->requests[1].e2e, 2 * pf + decode2, 1e-12);
  }
  // A KV link adds bytes / bandwidth to the first token.
  {
    ClusterSpec linked = DisaggCluster(p, 1, d, 1, 1000, /*link=*/1e6);
    auto r = Simulate(linked, {{0, 100, 1}});
    ASSERT_TRUE(r.ok());
    EXPECT_NEAR(r->requests[0].ttft, m.StepSeconds(100, 100, 1, 100) + 0.1, 1e-12);
  }
}

TEST(PlannerFit, RecoversKnownCoefficients) {
  const engine::StepCoefficients truth{3e-3, 2e-5, 4e-4, 1e-7};
  std::mt19937_64 rng(1);
  std::vector<StepSample> samples;
  for (int i = 0; i < 200; ++i) {
    StepSample s;
    s.seqs = 1 + static_cast<int64_t>(rng() % 64);
    s.tokens = s.seqs + static_cast<int64_t>(rng() % 512);
    s.prefill_tokens = s.tokens;
    s.context = s.tokens + static_cast<int64_t>(rng() % 8192);
    s.seconds = truth.Seconds(s.tokens, s.seqs, s.context);
    samples.push_back(s);
  }
  auto fit = FitStepCoeffs(samples);
  ASSERT_TRUE(fit.ok());
  EXPECT_NEAR(fit->intercept, truth.intercept, 1e-9);
  EXPECT_NEAR(fit->per_token, truth.per_token, 1e-11);
  EXPECT_NEAR(fit->per_seq, truth.per_seq, 1e-10);
  EXPECT_NEAR(fit->per_context_token, truth.per_context_token, 1e-12);
  // Decode samples have tokens == seqs: the fit still reproduces every sample.
  std::vector<StepSample> decode;
  for (int64_t b : {1, 2, 4, 8, 16, 32}) {
    for (int64_t ctx : {64, 256, 1024}) {
      decode.push_back({b, 0, b, b * ctx, truth.Seconds(b, b, b * ctx)});
    }
  }
  auto model = FitLatencyModel(decode);
  ASSERT_TRUE(model.ok());
  for (const StepSample& s : decode) {
    EXPECT_NEAR(model->StepSeconds(s.tokens, 0, s.seqs, s.context), s.seconds, 1e-9);
  }
  EXPECT_FALSE(FitStepCoeffs({}).ok());
}

TEST(PlannerRoofline, TensorParallelDividesTheModelAndAddsAllReduces) {
  const RooflineShape shape = Llama3_8BShape();
  auto hw = FindClusterHardware("H100");
  ASSERT_TRUE(hw.ok());
  for (int tp : {1, 2, 4, 8}) {
    RooflineShape shard = shape;
    shard.heads = 32 / tp;
    shard.kv_heads = std::max(1, 8 / tp);
    shard.intermediate = 14336 / tp;
    shard.vocab = (128256 + tp - 1) / tp;
    shard.batch = 16;
    shard.seq_len = 1024;
    auto report = AnalyzeRoofline(shard, hw->gpu);
    ASSERT_TRUE(report.ok());
    const double act = 16.0 * 4096 * 2;
    const double allreduce =
        tp == 1 ? 0
                : 2 * 32 * (hw->allreduce_latency + 2.0 * (tp - 1) / tp * act / hw->interconnect_bytes);
    EXPECT_NEAR(RooflineStepSeconds(shape, *hw, tp, 16, 16, 16 * 1024, false),
                report->decode.step_seconds + allreduce, 1e-12)
        << tp;
  }
  // Decode of a bandwidth-bound batch: TP2 is faster, but not twice (all-reduces, norms).
  const double t1 = RooflineStepSeconds(shape, *hw, 1, 8, 8, 8 * 512, false);
  const double t2 = RooflineStepSeconds(shape, *hw, 2, 8, 8, 8 * 512, false);
  EXPECT_LT(t2, t1);
  EXPECT_GT(t2, t1 / 2);
  // The fitted model follows the roofline within 30% on its grid.
  auto m1 = RooflineLatencyModel(shape, *hw, 1);
  ASSERT_TRUE(m1.ok());
  EXPECT_NEAR(m1->StepSeconds(8, 0, 8, 8 * 512), t1, 0.3 * t1);
  const double p1 = RooflineStepSeconds(shape, *hw, 1, 2048, 1, 2048, true);
  EXPECT_NEAR(m1->StepSeconds(2048, 2048, 1, 2048), p1, 0.3 * p1);
}

TEST(PlannerSearch, BestConfigurationMeetsTheTarget) {
  auto hw = FindClusterHardware("A100-80G");
  ASSERT_TRUE(hw.ok());
  const RooflineShape shape = Llama3_8BShape();
  InstanceFactory factory;
  factory.kv_bytes_per_token = KvBytesPerToken(shape);
  factory.kv_link_bytes = hw->kv_link_bytes;
  factory.make = [&](int tp) -> absl::StatusOr<InstanceSpec> {
    InstanceSpec s;
    s.tp = tp;
    TANDEM_ASSIGN_OR_RETURN(s.model, RooflineLatencyModel(shape, *hw, tp));
    return s;
  };
  SearchOptions options;
  options.gpus = 2;
  options.tps = {1, 2};
  options.slo = {0.2, 0.03};
  options.attainment = 0.9;
  options.workload.input.mean = 512;
  options.workload.output.mean = 64;
  options.workload.num_requests = 200;
  auto plan = SearchPlacement(factory, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // colocated 1xTP1, 2xTP1, 1xTP2; disagg 1+1 TP1.
  EXPECT_EQ(plan->evaluated.size(), 4u);
  for (const Placement* best : {&plan->best_colocated, &plan->best_disaggregated}) {
    ASSERT_GT(best->max_rate, 0);
    WorkloadSpec w = options.workload;
    w.rate = best->max_rate;
    ClusterSpec c = best->cluster;
    auto r = Simulate(c, MakeArrivals(w));
    ASSERT_TRUE(r.ok());
    EXPECT_GE(SummarizeSim(*r, options.slo, c.Gpus()).attainment, 0.9) << c.Describe();
    EXPECT_NEAR(best->per_gpu_goodput, best->max_rate / c.Gpus(), 1e-12);
    for (const Placement& p : plan->evaluated) {
      if (p.cluster.disaggregated == c.disaggregated) {
        EXPECT_LE(p.per_gpu_goodput, best->per_gpu_goodput * 1.01);
      }
    }
  }
  // An impossible TTFT gives no configuration, not an error.
  options.slo = {1e-6, 1e-6};
  auto none = SearchPlacement(factory, options);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->best_colocated.max_rate, 0);
  EXPECT_EQ(none->best_disaggregated.max_rate, 0);
}

TEST(PlannerSim, ServingLoopGapComesBeforeEveryStepThatFollowsAnother) {
  InstanceSpec spec = Instance();
  spec.model.step_gap = 2e-3;
  auto r = Simulate(ColocatedCluster(spec, 1), {{1.0, 1300, 5}});
  ASSERT_TRUE(r.ok()) << r.status();
  double ttft = 0;
  const double e2e = AloneSeconds(SimpleModel(), 1300, 5, 512, &ttft);
  // Three prefill chunks (two follow another) and four decode steps, all following one.
  EXPECT_NEAR(r->requests[0].ttft, ttft + 2 * 2e-3, 1e-12);
  EXPECT_NEAR(r->requests[0].e2e, e2e + 6 * 2e-3, 1e-12);
}

TEST(PlannerSim, StepNoiseScalesStepsByMeasuredRatios) {
  InstanceSpec spec = Instance();
  spec.model.prefill_noise = {2.0};
  spec.model.decode_noise = {3.0};
  auto r = Simulate(ColocatedCluster(spec, 1), {{0.0, 100, 3}});
  ASSERT_TRUE(r.ok()) << r.status();
  double ttft = 0;
  const double e2e = AloneSeconds(SimpleModel(), 100, 3, 512, &ttft);
  EXPECT_NEAR(r->requests[0].ttft, 2 * ttft, 1e-12);
  EXPECT_NEAR(r->requests[0].e2e - r->requests[0].ttft, 3 * (e2e - ttft), 1e-12);

  // The ratios come from the calibration: measured over fitted step time, per phase.
  LatencyModel m = SimpleModel();
  std::vector<StepSample> samples = {
      {.tokens = 64, .prefill_tokens = 64, .seqs = 1, .context = 64},
      {.tokens = 4, .prefill_tokens = 0, .seqs = 4, .context = 400},
      {.tokens = 8, .prefill_tokens = 0, .seqs = 8, .context = 800}};
  samples[0].seconds = 1.5 * m.StepSeconds(64, 64, 1, 64);
  samples[1].seconds = 0.5 * m.StepSeconds(4, 0, 4, 400);
  samples[2].seconds = 2.0 * m.StepSeconds(8, 0, 8, 800);
  SetStepNoise(m, samples);
  ASSERT_EQ(m.prefill_noise.size(), 1u);
  EXPECT_NEAR(m.prefill_noise[0], 1.5, 1e-9);
  ASSERT_EQ(m.decode_noise.size(), 2u);
  EXPECT_NEAR(m.decode_noise[0], 0.5, 1e-9);
  EXPECT_NEAR(m.decode_noise[1], 2.0, 1e-9);

  // With a spread, the tail widens while a fixed seed keeps the simulation repeatable.
  spec.model.prefill_noise = {0.5, 1.0, 1.0, 4.0};
  spec.model.decode_noise = {1.0};
  std::vector<SimArrival> arrivals;
  for (int i = 0; i < 200; ++i) arrivals.push_back({i * 1.0, 100, 1});
  auto a = Simulate(ColocatedCluster(spec, 1), arrivals);
  auto b = Simulate(ColocatedCluster(spec, 1), arrivals);
  ASSERT_TRUE(a.ok() && b.ok());
  double lo = 1e9, hi = 0;
  for (size_t i = 0; i < arrivals.size(); ++i) {
    EXPECT_EQ(a->requests[i].ttft, b->requests[i].ttft);
    lo = std::min(lo, a->requests[i].ttft);
    hi = std::max(hi, a->requests[i].ttft);
  }
  EXPECT_NEAR(lo, 0.5 * ttft, 1e-12);
  EXPECT_NEAR(hi, 4.0 * ttft, 1e-12);
}

TEST(PlannerTrace, ReadsBenchReports) {
  nlohmann::json report = {
      {"requests",
       {{{"success", true}, {"start_s", 0.5}, {"prompt_tokens", 30}, {"output_tokens", 8}},
        {{"success", false}, {"start_s", 0.1}},
        {{"success", true}, {"start_s", 0.2}, {"prompt_tokens", 10}, {"output_tokens", 4}}}}};
  auto a = ArrivalsFromBenchReport(report);
  ASSERT_TRUE(a.ok());
  ASSERT_EQ(a->size(), 2u);
  EXPECT_EQ((*a)[0].input_len, 10);
  EXPECT_EQ((*a)[1].output_len, 8);
  EXPECT_FALSE(ArrivalsFromBenchReport(nlohmann::json::object()).ok());
}

}  // namespace
}  // namespace tandem::tools
