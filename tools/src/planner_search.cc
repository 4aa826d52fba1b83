// The capacity planner's placement search: the highest sustained rate of a cluster and the
// best placement of instances on the GPUs.
#include "tandem/tools/planner.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"

namespace tandem::tools {
namespace {

using json = nlohmann::json;

}  // namespace

// --- placement search ---

json Placement::ToJson() const {
  json j = {{"config", cluster.Describe()},
            {"disaggregated", cluster.disaggregated},
            {"gpus", cluster.Gpus()},
            {"max_rate", max_rate},
            {"per_gpu_goodput", per_gpu_goodput},
            {"at_max_rate", SimSummaryJson(at_max_rate)}};
  if (cluster.disaggregated) {
    j["prefill"] = {{"tp", cluster.prefill.tp}, {"instances", cluster.num_prefill}};
    j["decode"] = {{"tp", cluster.decode.tp}, {"instances", cluster.num_decode}};
  } else {
    j["colocated"] = {{"tp", cluster.colocated.tp}, {"instances", cluster.num_colocated}};
  }
  return j;
}

absl::StatusOr<double> MaxSustainedRate(const ClusterSpec& cluster, const SearchOptions& options,
                                        SimSummary* at_rate) {
  const int gpus = cluster.Gpus();
  SimSummary best_summary;
  auto meets = [&](double rate, bool* ok) -> absl::Status {
    WorkloadSpec w = options.workload;
    w.rate = rate;
    w.num_requests = std::max(
        w.num_requests,
        std::min(options.max_requests,
                 static_cast<int64_t>(std::ceil(rate * options.min_sim_seconds))));
    TANDEM_ASSIGN_OR_RETURN(SimResult r, Simulate(cluster, MakeArrivals(w)));
    SimSummary s = SummarizeSim(r, options.slo, gpus);
    *ok = s.attainment >= options.attainment;
    if (*ok) best_summary = s;
    return absl::OkStatus();
  };
  double lo = 0, hi = 0;
  bool ok = false;
  double rate = 1.0;
  TANDEM_RETURN_IF_ERROR(meets(rate, &ok));
  if (ok) {
    lo = rate;
    hi = rate * 2;
    while (true) {
      TANDEM_RETURN_IF_ERROR(meets(hi, &ok));
      if (!ok) break;
      lo = hi;
      hi *= 2;
      if (hi > 1e7) break;
    }
  } else {
    hi = rate;
    lo = rate / 2;
    while (true) {
      TANDEM_RETURN_IF_ERROR(meets(lo, &ok));
      if (ok) break;
      hi = lo;
      lo /= 2;
      if (lo < 1e-4) {
        if (at_rate != nullptr) *at_rate = SimSummary{};
        return 0.0;
      }
    }
  }
  while ((hi - lo) > options.rate_tolerance * lo) {
    const double mid = 0.5 * (lo + hi);
    TANDEM_RETURN_IF_ERROR(meets(mid, &ok));
    if (ok) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  // The summary at `lo` (the last passing rate evaluated may be a lower one after a failed mid;
  // evaluate it again so the reported numbers belong to the returned rate).
  TANDEM_RETURN_IF_ERROR(meets(lo, &ok));
  if (at_rate != nullptr) *at_rate = best_summary;
  return lo;
}

namespace {

bool Better(const Placement& x, const Placement& y) {
  if (y.max_rate <= 0) return x.max_rate > 0;
  if (x.per_gpu_goodput != y.per_gpu_goodput) {
    // Within 1% counts as a tie.
    if (std::abs(x.per_gpu_goodput - y.per_gpu_goodput) >
        0.01 * std::max(x.per_gpu_goodput, y.per_gpu_goodput)) {
      return x.per_gpu_goodput > y.per_gpu_goodput;
    }
  }
  if (x.max_rate != y.max_rate) return x.max_rate > y.max_rate;
  return x.cluster.Gpus() < y.cluster.Gpus();
}

}  // namespace

absl::StatusOr<PlanResult> SearchPlacement(const InstanceFactory& factory,
                                           const SearchOptions& options) {
  if (options.gpus < 1) return absl::InvalidArgumentError("plan: --gpus must be >= 1");
  if (!(options.slo.ttft > 0) || !(options.slo.tpot > 0)) {
    return absl::InvalidArgumentError("plan: SLOs must be > 0");
  }
  if (!(options.attainment > 0) || options.attainment > 1) {
    return absl::InvalidArgumentError("plan: --attainment must be in (0, 1]");
  }
  std::vector<std::pair<int, InstanceSpec>> specs;
  for (int tp : options.tps) {
    if (tp > options.gpus) continue;
    absl::StatusOr<InstanceSpec> s = factory.make(tp);
    if (s.ok()) specs.emplace_back(tp, *s);
  }
  if (specs.empty()) {
    return absl::InvalidArgumentError(
        "plan: the model fits on none of the tensor-parallel degrees within --gpus");
  }
  PlanResult plan;
  auto evaluate = [&](ClusterSpec cluster) -> absl::Status {
    cluster.kv_bytes_per_token = factory.kv_bytes_per_token;
    cluster.kv_link_bytes = factory.kv_link_bytes;
    cluster.request_overhead = factory.request_overhead;
    cluster.request_overhead_samples = factory.request_overhead_samples;
    Placement p;
    p.cluster = cluster;
    TANDEM_ASSIGN_OR_RETURN(p.max_rate, MaxSustainedRate(cluster, options, &p.at_max_rate));
    p.per_gpu_goodput = p.max_rate / cluster.Gpus();
    Placement& best = cluster.disaggregated ? plan.best_disaggregated : plan.best_colocated;
    if (p.max_rate > 0 && Better(p, best)) best = p;
    plan.evaluated.push_back(std::move(p));
    return absl::OkStatus();
  };
  if (options.search_colocated) {
    for (const auto& [tp, spec] : specs) {
      for (int n = 1; n * tp <= options.gpus; ++n) {
        TANDEM_RETURN_IF_ERROR(evaluate(ColocatedCluster(spec, n)));
      }
    }
  }
  if (options.search_disaggregated) {
    for (const auto& [ptp, pspec] : specs) {
      for (const auto& [dtp, dspec] : specs) {
        for (int np = 1; np * ptp + dtp <= options.gpus; ++np) {
          for (int nd = 1; np * ptp + nd * dtp <= options.gpus; ++nd) {
            TANDEM_RETURN_IF_ERROR(evaluate(DisaggCluster(pspec, np, dspec, nd, 0, 0)));
          }
        }
      }
    }
  }
  return plan;
}

}  // namespace tandem::tools
