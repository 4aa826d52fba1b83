// The router's side of disaggregated serving: a Generator that runs each request on a pool of
// prefill workers and a pool of decode workers over the tandem.v1 control plane.
//
// Per request (docs/protocol.md): pick a decode worker by free KV blocks and running batch and
// Reserve the prompt's blocks there; pick a prefill worker by queued prefill tokens and Submit
// the prompt with that reservation (the prefill worker pushes the KV pages straight into the
// reserved blocks); then Start the request on the decode worker and relay its token stream to
// the callback. Abort cancels whichever call is in flight, which the workers see at once; every
// error path releases the reservation, so no KV block is left behind. Each request is a state
// machine on gRPC's callback API (router/src/flight.h), so no thread waits for a request; the
// pools and their Stats poller are router/src/worker_pool.h, the choice of workers and admission
// pure functions over the pools' snapshot (router/src/placement.h).
//
//   TANDEM_ASSIGN_OR_RETURN(auto generator, DisaggregatedGenerator::Create(
//       {.model_dir = dir, .prefill_addresses = {"10.0.0.5:7001"},
//        .decode_addresses = {"10.0.0.6:7002"}}));
//   TANDEM_ASSIGN_OR_RETURN(auto api, ApiServer::Create(options, std::move(generator)));
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "tandem/engine/generator.h"
#include "tandem/proto/tls.h"

namespace tandem::router {

// `--routing`: kv-aware (the default) scores prefill workers by the prompt tokens they would
// compute (what their prefix caches lack) plus their queued work, and decode workers by the KV
// that would move to them plus their running batch, from the workers' KV events; load looks at
// load alone (docs/architecture.md, "KV-aware routing").
enum class Routing { kKvAware, kLoad };
absl::StatusOr<Routing> ParseRouting(std::string_view name);  // "kv-aware" or "load"
const char* RoutingName(Routing routing);

struct DisaggregatedOptions {
  // The checkpoint directory: the router reads its config.json, tokenizer.json and chat
  // template (never the weights).
  std::string model_dir;
  // host:port of every prefill and decode worker's control plane; at least one of each unless
  // the workers are discovered through etcd.
  std::vector<std::string> prefill_addresses;
  std::vector<std::string> decode_addresses;
  // etcd endpoints ("http://10.0.0.2:2379,10.0.0.3:2379"): the pools are the workers registered
  // under /tandem/<cluster>/workers/, followed live (docs/operations.md). Adds to the lists.
  std::string etcd_endpoints;
  std::string cluster = "default";
  // Mutual TLS for the channels to the workers and to etcd: the workers' and etcd's
  // certificates are verified against `tls.ca`, `tls.cert` is presented. Empty: plaintext.
  proto::TlsFiles tls;
  // Context length; 0: the model's. Workers refuse longer requests too.
  int max_model_len = 0;
  // How long a request may wait for KV room on some decode worker before it is refused with
  // ResourceExhausted (HTTP 529/503).
  absl::Duration admission_timeout = absl::Seconds(30);
  // Time a reservation may take to be prefilled and started; also the prefill's deadline.
  absl::Duration prefill_timeout = absl::Seconds(60);
  // Longest token stream from a decode worker.
  absl::Duration stream_timeout = absl::Minutes(30);
  // How many times a request may go on elsewhere after a worker went away under it: a prefill
  // worker before the first token, or a decode worker mid-stream (requests with n == 1; the
  // prompt and the tokens so far are prefilled again).
  int max_retries = 3;
  // Admission by predicted time to first token: when set, a request whose TTFT the router
  // predicts above this many seconds is refused at once (ResourceExhausted: HTTP 529 or 503
  // with Retry-After) instead of queueing past its target. The prediction is
  // (queued prefill tokens + its own) x seconds per prompt token, the latter learned per
  // prefill worker from the requests it served (refusals start after 8 of them).
  std::optional<double> admission_ttft_seconds;
  // How often each worker's Stats are polled (all at once) for routing and /metrics; /metrics
  // shows the last round.
  absl::Duration stats_interval = absl::Milliseconds(100);
  // How workers are chosen (Routing). kv-aware subscribes to every worker's KV events and keeps
  // an index of at most `kv_index_max_blocks` block hashes per worker.
  Routing routing = Routing::kKvAware;
  size_t kv_index_max_blocks = 1 << 20;
};

class DisaggregatedGenerator : public engine::Generator {
 public:
  // Loads the tokenizer and config, connects to every listed worker and asks each for its Stats
  // once: the router serves with those that answered and takes the others in when they answer
  // (each is named on stderr meanwhile); with etcd, reads the registered workers and starts
  // following them instead (none need be registered yet).
  static absl::StatusOr<std::unique_ptr<DisaggregatedGenerator>> Create(
      const DisaggregatedOptions& options);
};

}  // namespace tandem::router
