// The router's Generator: the worker pool (worker_pool.h), admission over its snapshot
// (placement.h), and one Flight per request (flight.h), all on gRPC's callback API: no thread
// per request.
#include "tandem/router/disaggregated_generator.h"

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "flight.h"
#include "placement.h"
#include "pool_counters.h"
#include "tandem/base/status_macros.h"
#include "worker_pool.h"

namespace tandem::router {
namespace {

using engine::GenerateRequest;
using engine::OutputCallback;

class DisaggregatedGeneratorImpl : public DisaggregatedGenerator {
 public:
  explicit DisaggregatedGeneratorImpl(const DisaggregatedOptions& options) : options_(options) {}

  ~DisaggregatedGeneratorImpl() override {
    std::vector<std::shared_ptr<Flight>> flights;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      for (auto& [id, entry] : flights_) {
        entry.abort = true;
        if (entry.flight != nullptr) flights.push_back(entry.flight);
      }
    }
    for (const std::shared_ptr<Flight>& flight : flights) flight->Abort();
    flights.clear();
    std::unique_lock<std::mutex> lock(mu_);
    flights_done_.wait(lock, [&] { return flights_.empty(); });
    lock.unlock();
    pool_.reset();  // stops the poller and the etcd watch
  }

  absl::Status Init() {
    const bool discover = !options_.etcd_endpoints.empty();
    if (!discover && (options_.prefill_addresses.empty() || options_.decode_addresses.empty())) {
      return absl::InvalidArgumentError(
          "the router needs at least one prefill and one decode worker address, or etcd");
    }
    TANDEM_ASSIGN_OR_RETURN(config_,
                            text::ModelConfig::FromFile(options_.model_dir + "/config.json"));
    TANDEM_ASSIGN_OR_RETURN(tokenizer_,
                            text::Tokenizer::FromFile(options_.model_dir + "/tokenizer.json"));
    TANDEM_ASSIGN_OR_RETURN(chat_formatter_, text::ChatFormatter::Load(options_.model_dir));
    max_model_len_ = config_.max_position_embeddings;
    if (options_.max_model_len > 0) max_model_len_ = std::min(max_model_len_, options_.max_model_len);
    TANDEM_ASSIGN_OR_RETURN(pool_, WorkerPool::Create({
                                       .prefill_addresses = options_.prefill_addresses,
                                       .decode_addresses = options_.decode_addresses,
                                       .etcd_endpoints = options_.etcd_endpoints,
                                       .cluster = options_.cluster,
                                       .tls = options_.tls,
                                       .stats_interval = options_.stats_interval,
                                       .kv_events = options_.routing == Routing::kKvAware,
                                       .kv_index_max_blocks = options_.kv_index_max_blocks,
                                   }));
    env_.pool = pool_.get();
    env_.options = {.admission_timeout = options_.admission_timeout,
                    .prefill_timeout = options_.prefill_timeout,
                    .stream_timeout = options_.stream_timeout,
                    .max_retries = options_.max_retries};
    env_.counters = &counters_;
    env_.routing = options_.routing;
    env_.detokenize = [this](const std::vector<int32_t>& tokens, bool skip_special) {
      return tokenizer_->Decode(tokens, skip_special);
    };
    return absl::OkStatus();
  }

  // --- engine::Generator ---

  absl::Status Submit(GenerateRequest request, OutputCallback callback) override {
    // The checks a worker would make that need no worker state, so bad input is a 400 at once.
    TANDEM_RETURN_IF_ERROR(engine::ValidateRequest(request, config_, max_model_len_));
    TANDEM_RETURN_IF_ERROR(AdmitByTtft(
        *pool_->Snapshot(), static_cast<int64_t>(request.prompt_tokens.size()) * request.params.n,
        options_.admission_ttft_seconds));
    const std::string id = request.request_id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return absl::UnavailableError("the router is shutting down");
      if (!flights_.emplace(id, Entry{}).second) {
        return absl::AlreadyExistsError(absl::StrCat("request id ", id, " is already running"));
      }
    }
    // The flight's first calls may complete (and the flight end) before Launch returns.
    std::shared_ptr<Flight> flight =
        Flight::Launch(&env_, std::move(request), std::move(callback), [this, id] { Forget(id); });
    bool abort = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = flights_.find(id); it != flights_.end()) {
        it->second.flight = flight;
        abort = it->second.abort;
      }
    }
    if (abort) flight->Abort();  // aborted while it was being launched
    return absl::OkStatus();
  }

  void Abort(const std::string& request_id) override {
    std::shared_ptr<Flight> flight;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = flights_.find(request_id);
      if (it != flights_.end()) {
        it->second.abort = true;
        flight = it->second.flight;
      }
    }
    // Outside the lock: cancelling may end the flight on this thread.
    if (flight != nullptr) flight->Abort();
  }

  const text::ModelConfig& config() const override { return config_; }
  const text::Tokenizer& tokenizer() const override { return *tokenizer_; }
  const text::ChatFormatter& chat_formatter() const override { return *chat_formatter_; }
  int max_model_len() const override { return max_model_len_; }
  // Outputs arrive on gRPC's threads, which may write them to the client themselves.
  bool callbacks_may_work() const override { return true; }

  // The pools as of the poller's last round: a scrape of /metrics does no I/O, so a hung worker
  // cannot slow it down.
  engine::EngineStats stats() const override {
    std::shared_ptr<const PoolSnapshot> pools = pool_->Snapshot();
    // The counters: summed so that a worker leaving or restarting never lowers them.
    engine::EngineStats total = pool_counters_.Observe(*pools);
    for (const WorkerView& w : pools->decode) {
      total.running += w.stats.running();
      total.waiting += w.stats.waiting();
      total.kv_blocks_total += w.stats.kv_blocks_total();
      total.kv_blocks_used += w.stats.kv_blocks_used();
    }
    for (const WorkerView& w : pools->prefill) {
      total.running += w.stats.running();
      total.waiting += w.stats.waiting();
    }
    return total;
  }

  engine::GeneratorCounters counters() const override {
    engine::GeneratorCounters c;
    c.prefill_retries = counters_.prefill_retries.load();
    c.migrations = counters_.migrations.load();
    c.kv_handoffs = counters_.kv_handoffs.load();
    c.kv_handoff_bytes = counters_.kv_handoff_bytes.load();
    std::shared_ptr<const PoolSnapshot> pools = pool_->Snapshot();
    c.prefill_workers = static_cast<int>(pools->prefill.size());
    c.decode_workers = static_cast<int>(pools->decode.size());
    for (const WorkerView& w : pools->prefill) c.prefill_workers_up += w.up ? 1 : 0;
    for (const WorkerView& w : pools->decode) c.decode_workers_up += w.up ? 1 : 0;
    if (const KvIndex* index = pool_->kv_index()) {
      // Every worker in the pools has a count (0 while its KV events stream is down); one that
      // left has none.
      const std::map<std::string, int64_t> entries = index->Entries();
      for (const auto* pool : {&pools->prefill, &pools->decode}) {
        for (const WorkerView& w : *pool) {
          auto it = entries.find(w.id);
          c.kv_index_blocks[w.id] = it == entries.end() ? 0 : it->second;
        }
      }
    }
    const char* pools_named[2] = {"prefill", "decode"};
    for (int p = 0; p < 2; ++p) {
      for (RouteReason r : {RouteReason::kKvHit, RouteReason::kKvMiss, RouteReason::kLoad}) {
        c.routing_decisions[{pools_named[p], RouteReasonName(r)}] =
            counters_.routed[p][static_cast<int>(r)].load();
      }
    }
    return c;
  }

  int num_active() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(flights_.size());
  }

 private:
  void Forget(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    flights_.erase(id);
    if (flights_.empty()) flights_done_.notify_all();
  }

  DisaggregatedOptions options_;
  text::ModelConfig config_;
  std::unique_ptr<text::Tokenizer> tokenizer_;
  std::unique_ptr<text::ChatFormatter> chat_formatter_;
  int max_model_len_ = 0;
  std::unique_ptr<WorkerPool> pool_;
  FlightCounters counters_;
  mutable PoolCounters pool_counters_;
  FlightEnv env_;

  mutable std::mutex mu_;
  struct Entry {
    std::shared_ptr<Flight> flight;  // null while it is being launched
    bool abort = false;              // Abort came (it may have come before the flight was set)
  };
  std::map<std::string, Entry> flights_;  // the requests in flight; guarded by mu_
  bool stopping_ = false;                                   // guarded by mu_
  std::condition_variable flights_done_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DisaggregatedGenerator>> DisaggregatedGenerator::Create(
    const DisaggregatedOptions& options) {
  auto generator = std::make_unique<DisaggregatedGeneratorImpl>(options);
  TANDEM_RETURN_IF_ERROR(generator->Init());
  return generator;
}

}  // namespace tandem::router
