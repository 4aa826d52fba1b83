// The OpenAI server's Prometheus metrics and its SLO accounting.
#include <optional>
#include <string>
#include <vector>

#include "openai_server_impl.h"

namespace tandem::router::internal {
namespace {

// Bucket bounds for time per output token: finer than LatencyBuckets() below 10 ms, where
// GPU decode steps fall.
std::vector<double> TpotBuckets() {
  return {0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03,
          0.04,   0.05,  0.075, 0.1,   0.15,  0.2,    0.3,  0.5,   0.75, 1.0,   2.5};
}

}  // namespace

ApiMetrics::ApiMetrics(const ApiServerOptions& options)
    : ttft_slo(options.ttft_slo_seconds), tpot_slo(options.tpot_slo_seconds) {
  for (const char* reason : {"stop", "length", "abort", "error"}) Finished(reason);
  prompt_tokens = &registry.Counter("tandem_prompt_tokens_total", "Prompt tokens processed.");
  embeddings = &registry.Counter("tandem_embeddings_total",
                                 "Inputs embedded by /v1/embeddings (one vector each).");
  generation_tokens =
      &registry.Counter("tandem_generation_tokens_total", "Tokens generated, all choices.");
  ttft = &registry.Histogram("tandem_time_to_first_token_seconds",
                               "Time from request arrival to its first generated token.",
                               metrics::LatencyBuckets());
  itl = &registry.Histogram("tandem_inter_token_latency_seconds",
                              "Time between successive generated tokens of a request.",
                              metrics::LatencyBuckets());
  stream_write = &registry.Histogram(
      "tandem_stream_write_seconds",
      "Time from a streamed output (tokens) reaching the API server, from the engine or the "
      "decode worker's stream, to its chunk written to the client's socket: what the server "
      "adds to each streamed token.",
      {25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.25,
       0.5, 1.0});
  e2e = &registry.Histogram("tandem_e2e_request_latency_seconds",
                              "Time from request arrival to its last token.", metrics::LatencyBuckets());
  running =
      &registry.Gauge("tandem_requests_running", "Requests in the engine's running batch.");
  waiting = &registry.Gauge("tandem_requests_waiting", "Requests queued in the engine.");
  kv_used = &registry.Gauge("tandem_kv_cache_blocks_used",
                            "KV cache blocks in use (on a decode worker, reserved ones too).");
  // Not "_total": Prometheus reserves that suffix for counters (promtool refuses a gauge).
  kv_total = &registry.Gauge("tandem_kv_cache_blocks_capacity", "KV cache blocks in all.");
  preemptions =
      &registry.Counter("tandem_preemptions_total",
                        "Sequences preempted (their KV dropped and recomputed).");
  in_flight = &registry.Gauge("tandem_api_requests_in_flight",
                                "Generation requests accepted by the API and not yet finished.");
  connections = &registry.Gauge("tandem_http_connections", "Open HTTP connections.");
  constexpr const char* kRetriesHelp =
      "Requests that went on elsewhere after a worker went away under them (prefill: started "
      "over before the first token; decode: continued mid-stream on another decode worker by "
      "recomputing their KV; kv_handoff: samples a draining decode worker parked, moved with "
      "their KV to another decode worker).";
  prefill_retries =
      &registry.Counter("tandem_request_retries_total", kRetriesHelp, {{"phase", "prefill"}});
  migrations =
      &registry.Counter("tandem_request_retries_total", kRetriesHelp, {{"phase", "decode"}});
  kv_handoffs = &registry.Counter("tandem_request_retries_total", kRetriesHelp,
                                    {{"phase", "kv_handoff"}});
  kv_handoff_bytes = &registry.Counter(
      "tandem_kv_handoff_bytes_total",
      "KV bytes moved from draining decode workers to others by KV handoff.");
  collective_seconds = &registry.Counter(
      "tandem_tensor_parallel_collective_seconds_total",
      "Wall time rank 0 of a tensor-parallel group spent in collectives (step plans, "
      "all-reduces, the logits' all-gather).");
  collective_bytes = &registry.Counter("tandem_tensor_parallel_collective_bytes_total",
                                       "Payload bytes of rank 0's tensor-parallel collectives.");
  const char* roles[2] = {"prefill", "decode"};
  const char* states[2] = {"up", "down"};
  for (int r = 0; r < 2; ++r) {
    for (int st = 0; st < 2; ++st) {
      workers[r][st] = &registry.Gauge(
          "tandem_workers",
          "Workers in the router's pools, by role and by whether their last Stats answered.",
          {{"role", roles[r]}, {"state", states[st]}});
    }
  }

  prefix_queries = &registry.Counter(
      "tandem_prefix_cache_queries_tokens_total",
      "Prompt tokens looked up in the prefix cache as sequences were admitted.");
  prefix_hits = &registry.Counter("tandem_prefix_cache_hits_tokens_total",
                                  "Prompt tokens found in the prefix cache (or shared with "
                                  "another sample), not computed.");

  tpot = &registry.Histogram(
      "tandem_time_per_output_token_seconds",
      "Per request that finished normally with at least 2 tokens: (end - first token) / "
      "(tokens of its longest choice - 1).",
      TpotBuckets());
  auto pair = [&](const char* slo) {
    return SloPair{
        &registry.Counter("tandem_requests_slo_total", kSloHelp,
                            {{"slo", slo}, {"result", "met"}}),
        &registry.Counter("tandem_requests_slo_total", kSloHelp,
                            {{"slo", slo}, {"result", "missed"}}),
    };
  };
  if (ttft_slo) slo_ttft = pair("ttft");
  if (tpot_slo) slo_tpot = pair("tpot");
  if (ttft_slo || tpot_slo) slo_both = pair("both");
  slo_met = &registry.Counter(
      "tandem_requests_slo_met_total",
      "Requests that finished normally (stop or length) meeting every configured service-level "
      "objective (all of them when none is configured); its rate is the goodput.");
  if (ttft_slo) {
    registry.Gauge("tandem_slo_ttft_seconds", "The time-to-first-token objective.")
        .Set(*ttft_slo);
  }
  if (tpot_slo) {
    registry.Gauge("tandem_slo_tpot_seconds", "The time-per-output-token objective.")
        .Set(*tpot_slo);
  }
}

void ApiMetrics::Classify(double ttft_seconds, std::optional<double> tpot_seconds) {
  if (tpot_seconds) tpot->Observe(*tpot_seconds);
  bool all_met = true;
  auto count = [&](const SloPair& pair, bool met) {
    (met ? pair.met : pair.missed)->Increment();
    all_met = all_met && met;
  };
  if (ttft_slo) count(slo_ttft, ttft_seconds <= *ttft_slo);
  if (tpot_slo) count(slo_tpot, !tpot_seconds || *tpot_seconds <= *tpot_slo);
  if (ttft_slo || tpot_slo) count(slo_both, all_met);
  if (all_met) slo_met->Increment();
}

void ApiMetrics::PrefixCacheAndRouting(const engine::EngineStats& stats,
                                       const engine::GeneratorCounters& counters) {
  metrics::AdvanceTo(*prefix_queries, static_cast<double>(stats.prefix_cache_queries_tokens));
  metrics::AdvanceTo(*prefix_hits, static_cast<double>(stats.prefix_cache_hits_tokens));
  for (const auto& [key, n] : counters.routing_decisions) {
    metrics::AdvanceTo(
        registry.Counter("tandem_router_routing_decisions_total",
                         "Workers the router chose for requests, by pool (prefill, decode) and "
                         "reason (kv_hit: KV-aware, the worker holds part of the prompt; kv_miss: "
                         "KV-aware, it holds none; load: --routing load).",
                         {{"pool", key.first}, {"reason", key.second}}),
        static_cast<double>(n));
  }
  // A worker that left takes its series with it.
  std::lock_guard<std::mutex> lock(kv_index_mu);
  constexpr const char* kIndexHelp =
      "Block hashes the router's KV-event index holds for each worker (KV-aware routing).";
  for (auto it = kv_index_workers.begin(); it != kv_index_workers.end();) {
    if (counters.kv_index_blocks.contains(*it)) {
      ++it;
      continue;
    }
    registry.RemoveGauge("tandem_router_kv_index_blocks", {{"worker", *it}});
    it = kv_index_workers.erase(it);
  }
  for (const auto& [id, n] : counters.kv_index_blocks) {
    kv_index_workers.insert(id);
    registry.Gauge("tandem_router_kv_index_blocks", kIndexHelp, {{"worker", id}})
        .Set(static_cast<double>(n));
  }
}

}  // namespace tandem::router::internal
