#include "tandem/router/disaggregated_generator.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/strings/str_format.h"
#include "tandem/base/status_macros.h"
#include "tandem/cluster/membership.h"
#include "tandem/proto/convert.h"
#include "tandem/v1/decode.grpc.pb.h"
#include "tandem/v1/prefill.grpc.pb.h"

namespace tandem::router {
namespace {

// Answered Submits a prefill worker's latency model needs before admission trusts it.
constexpr int kMinModelSamples = 8;

using engine::GenerateRequest;
using engine::OutputCallback;
using engine::RequestOutput;

int64_t UnixMillis(absl::Time t) { return absl::ToUnixMillis(t); }

std::chrono::system_clock::time_point GrpcDeadline(absl::Time t) {
  return absl::ToChronoTime(t);
}

// The latest Stats of one worker, refreshed by the poller.
struct WorkerState {
  std::string id;  // the etcd worker id, or the address of a worker listed on the command line
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  bool up = false;
  bool answered_once = false;  // some Stats call of the poller's was answered
  bool missed_first = false;   // a Stats call failed before any was answered
  tandem::v1::WorkerStats stats;
  // Work sent since the last Stats, so that a burst of requests between two polls spreads:
  // prompt tokens on a prefill worker, reserved blocks on a decode worker.
  int64_t pending_load = 0;
  int pending_requests = 0;
};

struct DecodeWorkerState : WorkerState {
  std::unique_ptr<tandem::v1::DecodeWorker::Stub> stub;
};

struct PrefillWorkerState : WorkerState {
  std::unique_ptr<tandem::v1::PrefillWorker::Stub> stub;
  // The worker's latency model: time to first token ~ (queued prompt tokens + the request's
  // own) x seconds_per_token, an exponentially weighted average over answered Submits.
  double seconds_per_token = 0.0;
  int samples = 0;
};

// One request in flight. Its thread drives Reserve -> Submit -> Start; Abort only flags it and
// cancels the call in flight, so the I/O thread that calls Abort never blocks.
struct Flight {
  GenerateRequest request;
  OutputCallback callback;
  std::mutex mu;
  bool cancelled = false;                  // guarded by mu
  grpc::ClientContext* call = nullptr;     // the call in flight, guarded by mu
};

class DisaggregatedGeneratorImpl : public DisaggregatedGenerator {
 public:
  explicit DisaggregatedGeneratorImpl(const DisaggregatedOptions& options) : options_(options) {}

  ~DisaggregatedGeneratorImpl() override {
    if (membership_) membership_->Stop();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      for (auto& [id, flight] : flights_) Cancel(*flight);
    }
    poll_wake_.notify_all();
    if (poller_.joinable()) poller_.join();
    std::unique_lock<std::mutex> lock(mu_);
    threads_done_.wait(lock, [&] { return num_threads_ == 0; });
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

    TANDEM_ASSIGN_OR_RETURN(channel_credentials_, proto::MakeChannelCredentials(options_.tls));
    for (const std::string& address : options_.decode_addresses) {
      AddWorker("decode", address, address);
    }
    for (const std::string& address : options_.prefill_addresses) {
      AddWorker("prefill", address, address);
    }
    if (discover) {
      // Workers come and go through etcd; those registered now are added before Start returns.
      TANDEM_ASSIGN_OR_RETURN(
          std::unique_ptr<cluster::EtcdClient> etcd,
          cluster::EtcdClient::Create(
              {.endpoints = options_.etcd_endpoints, .tls = options_.tls}));
      TANDEM_ASSIGN_OR_RETURN(
          membership_,
          cluster::Membership::Start(
              std::shared_ptr<cluster::EtcdClient>(std::move(etcd)), options_.cluster,
              [this](const std::string& role, const std::string& id,
                     const std::optional<cluster::WorkerInfo>& info) {
                if (info) {
                  std::fprintf(stderr, "tandem router: %s worker %s at %s joined\n",
                               role.c_str(), id.c_str(), info->address.c_str());
                  AddWorker(role, id, info->address);
                } else {
                  std::fprintf(stderr, "tandem router: %s worker %s left\n", role.c_str(),
                               id.c_str());
                  RemoveWorker(role, id);
                }
              }));
      PollOnce(absl::Milliseconds(500));
      poller_ = std::thread([this] { PollLoop(); });
      return absl::OkStatus();
    }
    // The router serves with the workers that answer; one that does not yet is skipped until
    // the poller finds it up.
    const std::vector<std::string> missing = PollOnce(absl::Seconds(1));
    for (const std::string& worker : missing) {
      std::fprintf(stderr,
                   "tandem router: worker %s does not answer yet; serving with the others and "
                   "taking it in when it answers\n",
                   worker.c_str());
    }
    poller_ = std::thread([this] { PollLoop(); });
    return absl::OkStatus();
  }

  // Adds a worker to its pool, or points an existing one (same role and id) at `address`.
  void AddWorker(const std::string& role, const std::string& id, const std::string& address) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, 64 << 20);
    // A worker restarted at the same address is reached again within a second.
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    proto::AddTlsChannelArgs(options_.tls, &args);
    auto channel = grpc::CreateCustomChannel(address, channel_credentials_, args);
    std::lock_guard<std::mutex> lock(stats_mu_);
    auto add = [&](auto& pool, auto make_stub) {
      using State = typename std::decay_t<decltype(pool)>::value_type::element_type;
      for (auto& w : pool) {
        if (w->id == id && w->address == address) return;  // unchanged
      }
      std::erase_if(pool, [&](const auto& w) { return w->id == id; });
      auto w = std::make_shared<State>();
      w->id = id;
      w->address = address;
      w->channel = channel;
      w->stub = make_stub(channel);
      pool.push_back(std::move(w));
    };
    if (role == "decode") {
      add(decode_, [](auto c) { return tandem::v1::DecodeWorker::NewStub(c); });
    } else if (role == "prefill") {
      add(prefill_, [](auto c) { return tandem::v1::PrefillWorker::NewStub(c); });
    }
  }

  void RemoveWorker(const std::string& role, const std::string& id) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    if (role == "decode") std::erase_if(decode_, [&](const auto& w) { return w->id == id; });
    if (role == "prefill") std::erase_if(prefill_, [&](const auto& w) { return w->id == id; });
  }

  bool PoolEmpty(const std::string& role) const {
    std::lock_guard<std::mutex> lock(stats_mu_);
    return role == "decode" ? decode_.empty() : prefill_.empty();
  }

  // --- engine::Generator ---

  absl::Status Submit(GenerateRequest request, OutputCallback callback) override {
    TANDEM_RETURN_IF_ERROR(Validate(request));
    TANDEM_RETURN_IF_ERROR(Admit(request));
    auto flight = std::make_shared<Flight>();
    const std::string id = request.request_id;
    flight->request = std::move(request);
    flight->callback = std::move(callback);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return absl::UnavailableError("the router is shutting down");
      if (!flights_.emplace(id, flight).second) {
        return absl::AlreadyExistsError(absl::StrCat("request id ", id, " is already running"));
      }
      ++num_threads_;
    }
    std::thread([this, flight] {
      Run(*flight);
      std::lock_guard<std::mutex> lock(mu_);
      flights_.erase(flight->request.request_id);
      if (--num_threads_ == 0) threads_done_.notify_all();
    }).detach();
    return absl::OkStatus();
  }

  void Abort(const std::string& request_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = flights_.find(request_id);
    if (it != flights_.end()) Cancel(*it->second);
  }

  const text::ModelConfig& config() const override { return config_; }
  const text::Tokenizer& tokenizer() const override { return *tokenizer_; }
  const text::ChatFormatter& chat_formatter() const override { return *chat_formatter_; }
  int max_model_len() const override { return max_model_len_; }

  // The pools as of the poller's last round (every stats_interval): a scrape of /metrics does
  // no I/O, so a hung worker cannot slow it down.
  engine::EngineStats stats() const override {
    std::lock_guard<std::mutex> lock(stats_mu_);
    engine::EngineStats total;
    for (const auto& w : decode_) {
      total.running += w->stats.running();
      total.waiting += w->stats.waiting();
      total.kv_blocks_total += w->stats.kv_blocks_total();
      total.kv_blocks_used += w->stats.kv_blocks_used();
      total.preemptions += w->stats.preemptions_total();
    }
    for (const auto& w : prefill_) {
      total.running += w->stats.running();
      total.waiting += w->stats.waiting();
    }
    return total;
  }

  engine::GeneratorCounters counters() const override {
    engine::GeneratorCounters c;
    c.prefill_retries = prefill_retries_.load();
    c.migrations = migrations_.load();
    c.kv_handoffs = kv_handoffs_.load();
    c.kv_handoff_bytes = kv_handoff_bytes_.load();
    std::lock_guard<std::mutex> lock(stats_mu_);
    c.prefill_workers = static_cast<int>(prefill_.size());
    c.decode_workers = static_cast<int>(decode_.size());
    for (const auto& w : prefill_) c.prefill_workers_up += w->up ? 1 : 0;
    for (const auto& w : decode_) c.decode_workers_up += w->up ? 1 : 0;
    return c;
  }

  int num_active() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(flights_.size());
  }

 private:
  // The checks a worker would make that need no worker state, so bad input is a 400 at once.
  absl::Status Validate(const GenerateRequest& request) const {
    return engine::ValidateRequest(request, config_, max_model_len_);
  }

  // Refuses a request whose predicted time to first token is over the admission target.
  absl::Status Admit(const GenerateRequest& request) const {
    if (!options_.admission_ttft_seconds) return absl::OkStatus();
    const int64_t own = static_cast<int64_t>(request.prompt_tokens.size()) * request.params.n;
    std::lock_guard<std::mutex> lock(stats_mu_);
    double best = -1.0;
    for (const auto& w : prefill_) {
      if (!w->up || w->samples < kMinModelSamples) return absl::OkStatus();  // not yet known
      const double predicted = static_cast<double>(w->stats.queued_prefill_tokens() +
                                                   w->pending_load + own) *
                               w->seconds_per_token;
      if (best < 0 || predicted < best) best = predicted;
    }
    if (best >= 0 && best > *options_.admission_ttft_seconds) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "the server is overloaded: the predicted time to first token (%.3f s) exceeds the "
          "target of %.3f s; retry later",
          best, *options_.admission_ttft_seconds));
    }
    return absl::OkStatus();
  }

  // Requires mu_.
  static void Cancel(Flight& flight) {
    std::lock_guard<std::mutex> lock(flight.mu);
    flight.cancelled = true;
    if (flight.call != nullptr) flight.call->TryCancel();
  }

  // Marks `context` as the call in flight; false (and nothing set) if already cancelled.
  static bool BeginCall(Flight& flight, grpc::ClientContext* context) {
    std::lock_guard<std::mutex> lock(flight.mu);
    if (flight.cancelled) return false;
    flight.call = context;
    return true;
  }
  static void EndCall(Flight& flight) {
    std::lock_guard<std::mutex> lock(flight.mu);
    flight.call = nullptr;
  }
  static bool Cancelled(Flight& flight) {
    std::lock_guard<std::mutex> lock(flight.mu);
    return flight.cancelled;
  }

  // Calls the callback unless the request was aborted (an aborted request hears nothing more).
  static void Deliver(Flight& flight, const RequestOutput& output, const absl::Status& status) {
    if (Cancelled(flight)) return;
    flight.callback(output, status);
  }

  // Decode workers that are up, most free KV blocks first, then smallest running batch.
  std::vector<std::shared_ptr<DecodeWorkerState>> RankDecode(int blocks_needed) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    std::vector<std::shared_ptr<DecodeWorkerState>> order;
    for (const auto& w : decode_) {
      if (w->up) order.push_back(w);
    }
    auto free_blocks = [](const DecodeWorkerState* w) {
      return w->stats.kv_blocks_total() - w->stats.kv_blocks_used() - w->pending_load;
    };
    auto running = [](const DecodeWorkerState* w) {
      return w->stats.running() + w->pending_requests;
    };
    // Those with room first; among them the smallest running batch, then the most room.
    std::stable_sort(order.begin(), order.end(), [&](const auto& sa, const auto& sb) {
      const DecodeWorkerState* a = sa.get();
      const DecodeWorkerState* b = sb.get();
      const bool fits_a = free_blocks(a) >= blocks_needed, fits_b = free_blocks(b) >= blocks_needed;
      if (fits_a != fits_b) return fits_a;
      if (running(a) != running(b)) return running(a) < running(b);
      return free_blocks(a) > free_blocks(b);
    });
    return order;
  }

  // The prefill worker that is up with the fewest queued prefill tokens.
  std::shared_ptr<PrefillWorkerState> PickPrefill() {
    std::lock_guard<std::mutex> lock(stats_mu_);
    std::shared_ptr<PrefillWorkerState> best;
    int64_t best_load = 0;
    for (const auto& w : prefill_) {
      if (!w->up) continue;
      const int64_t load = w->stats.queued_prefill_tokens() + w->pending_load;
      if (best == nullptr || load < best_load) {
        best = w;
        best_load = load;
      }
    }
    return best;
  }

  void AddPending(WorkerState* w, int64_t amount, int requests) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    w->pending_load += amount;
    w->pending_requests += requests;
  }

  // Reserves the prompt's blocks on some decode worker, waiting for room up to the admission
  // timeout. Cancelled if the request is aborted meanwhile.
  // `num_tokens` (default: the prompt) and `max_tokens` (default: r's) override what is reserved,
  // `exclude` is a worker not to ask, `wait` (default: the admission timeout) how long to wait
  // for room.
  absl::StatusOr<std::pair<std::shared_ptr<DecodeWorkerState>, tandem::v1::KvReservation>> Reserve(
      Flight& flight, const GenerateRequest& r, int num_tokens = -1, int max_tokens = -1,
      const DecodeWorkerState* exclude = nullptr,
      std::optional<absl::Duration> wait = std::nullopt) {
    const int prompt_len =
        num_tokens > 0 ? num_tokens : static_cast<int>(r.prompt_tokens.size());
    const absl::Time give_up = absl::Now() + wait.value_or(options_.admission_timeout);
    absl::Duration backoff = absl::Milliseconds(5);
    absl::Status last = absl::UnavailableError("no decode worker is up");
    for (;;) {
      // Blocks the prompt needs over all samples, at the default block size of 16 (an estimate
      // for ranking only; the worker decides).
      const int blocks_needed = r.params.n * ((prompt_len + 15) / 16);
      if (PoolEmpty("decode")) {
        return absl::UnavailableError("no decode worker is registered");
      }
      for (const std::shared_ptr<DecodeWorkerState>& shared : RankDecode(blocks_needed)) {
        DecodeWorkerState* w = shared.get();
        if (w == exclude) continue;
        tandem::v1::ReserveRequest request;
        request.set_request_id(r.request_id);
        request.set_num_prompt_tokens(prompt_len);
        request.set_max_tokens(max_tokens >= 0 ? max_tokens : r.params.max_tokens);
        request.set_n(r.params.n);
        request.set_deadline_unix_ms(UnixMillis(absl::Now() + options_.prefill_timeout));
        tandem::v1::ReserveResponse response;
        grpc::ClientContext context;
        context.set_deadline(GrpcDeadline(absl::Now() + absl::Seconds(10)));
        // Not cancelled from Abort: a Reserve cut short could still have reserved, unseen. It is
        // quick; an abort meanwhile is handled by releasing what it returns.
        grpc::Status status = w->stub->Reserve(&context, request, &response);
        if (status.ok()) {
          if (Cancelled(flight)) {
            Release(w, response.reservation());
            return absl::CancelledError("request aborted");
          }
          AddPending(w, response.reservation().block_ids_size(), 1);
          return std::make_pair(shared, response.reservation());
        }
        last = proto::FromGrpcStatus(status);
        if (last.code() == absl::StatusCode::kUnavailable) MarkDown(w);
        if (Cancelled(flight)) return absl::CancelledError("request aborted");
        // A request no decode worker could ever hold is refused as it is; the others wait.
        if (last.code() == absl::StatusCode::kInvalidArgument) return last;
      }
      if (absl::Now() + backoff >= give_up) break;
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Milliseconds(100));
      if (Cancelled(flight)) return absl::CancelledError("request aborted");
    }
    if (last.code() == absl::StatusCode::kResourceExhausted) {
      return absl::ResourceExhaustedError(
          absl::StrCat("no decode worker had room for the request's KV cache within ",
                       absl::FormatDuration(options_.admission_timeout), " (", last.message(),
                       ")"));
    }
    return absl::UnavailableError(
        absl::StrCat("no decode worker could take the request: ", last.message()));
  }

  void Release(DecodeWorkerState* w, const tandem::v1::KvReservation& reservation) {
    tandem::v1::ReleaseRequest request;
    request.set_reservation_id(reservation.reservation_id());
    tandem::v1::ReleaseResponse response;
    grpc::ClientContext context;
    context.set_deadline(GrpcDeadline(absl::Now() + absl::Seconds(5)));
    // Best effort: a reservation nobody releases expires on the worker.
    w->stub->Release(&context, request, &response);
  }

  // Marks a worker that failed a call as down until its next Stats answers.
  void MarkDown(WorkerState* w) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    w->up = false;
  }

  // Marks a worker down when its channel cannot reach it any more (its process is gone), as
  // opposed to an UNAVAILABLE it answered itself (e.g. about a decode worker it could not reach).
  void MarkDownIfUnreachable(WorkerState* w) {
    const grpc_connectivity_state state = w->channel->GetState(/*try_to_connect=*/false);
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN ||
        state == GRPC_CHANNEL_IDLE) {
      MarkDown(w);
    }
  }

  // A worker that went away (killed, draining, unreachable): the request may go on elsewhere.
  static bool WorkerGone(const absl::Status& status) {
    return status.code() == absl::StatusCode::kUnavailable;
  }

  // What a request's samples have produced so far, across attempts.
  struct Sample {
    std::vector<int32_t> generated;  // tokens sent to the client
    std::string delivered;           // text sent to the client
    std::string carried;             // text to prepend to the next text (held back by a worker
                                     // that went away)
    bool done = false;
  };
  struct Progress {
    std::vector<Sample> sample;  // by the request's sample index
    std::vector<int> samples;    // the running attempt's sample i is the request's samples[i]
    bool AllDone() const {
      return std::all_of(sample.begin(), sample.end(), [](const Sample& s) { return s.done; });
    }
    bool AnyGenerated() const {
      return std::any_of(sample.begin(), sample.end(),
                         [](const Sample& s) { return !s.generated.empty(); });
    }
  };

  // How one decode stream ended.
  struct StreamEnd {
    bool finished = false;  // the request's last event arrived
    absl::Status error;     // otherwise why not (OK when aborted by the client)
    // The worker drained and parked the stream's unfinished samples with their KV: what the
    // last event said, the worker, and the stream's worker-side request id.
    std::optional<tandem::v1::KvHandoff> handoff;
    std::shared_ptr<DecodeWorkerState> worker;
    std::string worker_request_id;
    bool any_event = false;  // the stream delivered at least one event
  };

  // Runs `r` (the request as it stands, a continuation after a migration) through Reserve,
  // Submit and Start, relaying events into `output`. Returns how the stream ended, or the
  // error that came before any stream began.
  StreamEnd Attempt(Flight& flight, const GenerateRequest& r, RequestOutput& output,
                    Progress& progress) {
    // 1. KV room on a decode worker.
    auto reserved = Reserve(flight, r);
    if (!reserved.ok()) {
      return {false, absl::IsCancelled(reserved.status()) ? absl::OkStatus() : reserved.status()};
    }
    auto [decode, reservation] = std::move(reserved).value();
    const int reserved_blocks = reservation.block_ids_size();

    // 2. Prefill, the KV landing in the reservation.
    tandem::v1::SubmitResponse prefilled;
    std::shared_ptr<PrefillWorkerState> prefill = PickPrefill();
    absl::Status status = prefill == nullptr ? absl::UnavailableError("no prefill worker is up")
                                             : Prefill(flight, r, *prefill, reservation, prefilled);
    if (!status.ok()) {
      // The blocks go back only once the prefill worker has stopped writing into them: its
      // Cancel answers after the request's transfers have ended (a cancelled or failed Submit
      // call alone does not say so).
      if (prefill != nullptr) {
        CancelPrefill(*prefill, r.request_id);
        if (WorkerGone(status)) MarkDownIfUnreachable(prefill.get());
      }
      Release(decode.get(), reservation);
      AddPending(decode.get(), -reserved_blocks, -1);
      return {false, Cancelled(flight) ? absl::OkStatus() : status};
    }

    // 3. Decode: relay the token stream.
    tandem::v1::StartRequest start;
    start.set_request_id(r.request_id);
    start.set_reservation_id(reservation.reservation_id());
    start.mutable_prompt_token_ids()->Add(r.prompt_tokens.begin(), r.prompt_tokens.end());
    *start.mutable_sampling() = proto::ToProto(r.params);
    *start.mutable_choices() = prefilled.choices();
    return Relay(flight, decode, reservation, start, output, progress);
  }

  // Starts `start` on `decode` (whose `reservation` it consumes) and relays its token stream
  // into `output`.
  StreamEnd Relay(Flight& flight, const std::shared_ptr<DecodeWorkerState>& decode,
                  const tandem::v1::KvReservation& reservation,
                  const tandem::v1::StartRequest& start, RequestOutput& output,
                  Progress& progress) {
    const int reserved_blocks = reservation.block_ids_size();
    grpc::ClientContext context;
    context.set_deadline(GrpcDeadline(absl::Now() + options_.stream_timeout));
    if (!BeginCall(flight, &context)) {
      Release(decode.get(), reservation);
      AddPending(decode.get(), -reserved_blocks, -1);
      return {};
    }
    std::unique_ptr<grpc::ClientReader<tandem::v1::TokenEvent>> reader =
        decode->stub->Start(&context, start);
    AddPending(decode.get(), -reserved_blocks, -1);  // the worker's own stats count them from now on
    StreamEnd end;
    end.worker = decode;
    end.worker_request_id = start.request_id();
    // Samples the worker ended with ABORT: held until the stream's end says why (a draining
    // worker's error means they go on elsewhere, not that they ended).
    std::vector<int> aborted;
    tandem::v1::TokenEvent event;
    while (reader->Read(&event)) {
      end.any_event = true;
      output.choices.clear();
      if (event.has_error() && event.error().code() != 0) {
        end.error = proto::FromProto(event.error());
        if (event.has_handoff()) end.handoff = event.handoff();
        break;
      }
      // The attempt's sample i is the request's sample progress.samples[i].
      if (event.index() < 0 || event.index() >= static_cast<int>(progress.samples.size())) {
        end.error = absl::InternalError(
            absl::StrCat("the decode worker sent sample ", event.index(), " of ",
                         progress.samples.size()));
        break;
      }
      const int index = progress.samples[event.index()];
      Sample& sample = progress.sample[index];
      engine::ChoiceDelta delta;
      delta.index = index;
      delta.token_ids.assign(event.token_ids().begin(), event.token_ids().end());
      delta.text = std::move(sample.carried) + event.text();
      sample.carried.clear();
      delta.logprobs.assign(event.logprobs().begin(), event.logprobs().end());
      for (const tandem::v1::TopLogprobs& top : event.top_logprobs()) {
        std::vector<engine::TokenLogprob>& entries = delta.top_logprobs.emplace_back();
        for (const tandem::v1::TokenLogprob& t : top.entries()) {
          entries.push_back({t.token_id(), t.logprob()});
        }
      }
      delta.finish_reason = proto::FromProto(event.finish_reason());
      if (delta.finish_reason == engine::FinishReason::kAbort) {
        aborted.push_back(index);
        delta.finish_reason = engine::FinishReason::kNone;
        if (delta.token_ids.empty() && delta.text.empty() && !event.has_usage()) continue;
      }
      output.num_generation_tokens += static_cast<int>(delta.token_ids.size());
      sample.generated.insert(sample.generated.end(), delta.token_ids.begin(),
                              delta.token_ids.end());
      sample.delivered += delta.text;
      if (delta.finish_reason != engine::FinishReason::kNone) sample.done = true;
      output.choices.push_back(std::move(delta));
      // The attempt's last event carries the usage; the stream then ends. The request is
      // finished when every one of its samples is (an attempt may run only some of them).
      if (event.has_usage()) end.finished = true;
      output.finished = progress.AllDone();
      Deliver(flight, output, absl::OkStatus());
    }
    grpc::Status call_status = reader->Finish();
    EndCall(flight);
    output.choices.clear();
    if (end.finished && end.error.ok() && !aborted.empty() && !Cancelled(flight)) {
      // The worker ended them itself (a Cancel from elsewhere): they end with ABORT.
      for (int index : aborted) {
        if (progress.sample[index].done) continue;
        progress.sample[index].done = true;
        engine::ChoiceDelta& delta = output.choices.emplace_back();
        delta.index = index;
        delta.finish_reason = engine::FinishReason::kAbort;
      }
      output.finished = progress.AllDone();
      if (!output.choices.empty()) Deliver(flight, output, absl::OkStatus());
      output.choices.clear();
    }
    if (end.finished || Cancelled(flight)) {
      end.error = absl::OkStatus();
      end.handoff.reset();
      return end;
    }
    if (end.error.ok()) {
      end.error = proto::FromGrpcStatus(call_status);
      // A stream that ends without its last event means the worker went away.
      if (end.error.ok() || absl::IsCancelled(end.error)) {
        end.error = absl::UnavailableError(
            absl::StrCat("the stream ended early (", end.error.message(), ")"));
      }
    }
    if (WorkerGone(end.error)) MarkDown(decode.get());
    end.error = absl::Status(end.error.code(), absl::StrCat("decode worker ", decode->address,
                                                           ": ", end.error.message()));
    return end;
  }

  // Runs a request to its end. A prefill worker that goes away before the first token is
  // retried on another; a decode worker that goes away mid-stream (killed or draining) is
  // replaced by continuing the request elsewhere: each unfinished sample's prompt plus the
  // tokens it generated so far are prefilled again and decoding goes on, so the client's stream
  // has no gap and no repeat. Samples of a request with n > 1 continue one after another, each
  // as a request of its own.
  void Run(Flight& flight) {
    const GenerateRequest& original = flight.request;
    const int n = original.params.n;
    RequestOutput output;
    output.request_id = original.request_id;
    output.num_prompt_tokens = static_cast<int>(original.prompt_tokens.size());
    Progress progress;
    progress.sample.resize(n);
    for (int i = 0; i < n; ++i) progress.samples.push_back(i);
    GenerateRequest current = original;
    // The request whose prompt and sampling the running stream's worker holds (what a KV
    // handoff continues from): the attempt's, or kept across a handoff.
    GenerateRequest base = original;
    std::optional<StreamEnd> pending;  // a stream already run by a KV handoff, handled next
    int retries = 0;
    for (int attempt = 0;; ++attempt) {
      StreamEnd end;
      if (pending.has_value()) {
        end = std::move(*pending);
        pending.reset();
      } else {
        end = Attempt(flight, current, output, progress);
        base = current;
      }
      if (Cancelled(flight) || progress.AllDone()) return;
      if (end.finished) {
        // This continuation is done; another sample still has to go on (below).
      } else if (end.error.ok()) {
        return;  // aborted by the client
      } else {
        const bool can_retry = WorkerGone(end.error) && retries < options_.max_retries;
        if (!can_retry) {
          output.choices.clear();
          output.finished = true;
          Deliver(flight, output, end.error);
          return;
        }
        ++retries;
        if (end.handoff.has_value() && progress.AnyGenerated()) {
          // The draining worker kept the KV: move it instead of computing it again.
          const std::string id = absl::StrCat(original.request_id, "~", attempt + 1);
          bool started = false;
          StreamEnd moved = HandOff(flight, base, id, end, output, progress, &started);
          if (started) {
            pending = std::move(moved);
            continue;
          }
          if (Cancelled(flight)) return;
          std::fprintf(stderr, "tandem router: request %s: KV handoff failed (%s); recomputing\n",
                       original.request_id.c_str(), std::string(moved.error.message()).c_str());
          ++attempt;  // that id may be known on the workers now
        }
        (progress.AnyGenerated() ? migrations_ : prefill_retries_).fetch_add(1);
        // Give the poller a moment to see which workers are left before trying again.
        absl::SleepFor(absl::Milliseconds(20 * retries));
        std::fprintf(stderr, "tandem router: request %s goes on elsewhere: %s\n",
                     original.request_id.c_str(), std::string(end.error.message()).c_str());
      }
      // The next attempt gets a fresh id on the workers (the old one may still be known there).
      current = original;
      current.request_id = absl::StrCat(original.request_id, "~", attempt + 1);
      if (!progress.AnyGenerated()) {
        // Nothing was sent yet: the whole request starts over.
        continue;
      }
      // The first unfinished sample continues on its own: its tokens appended to the prompt,
      // what is left of its budget.
      int index = 0;
      while (progress.sample[index].done) ++index;
      Sample& sample = progress.sample[index];
      const int used = static_cast<int>(sample.generated.size());
      if (used >= original.params.max_tokens) {
        // Its last token arrived but not its finish: it ended by length.
        sample.done = true;
        output.choices.clear();
        engine::ChoiceDelta& delta = output.choices.emplace_back();
        delta.index = index;
        delta.finish_reason = engine::FinishReason::kLength;
        output.finished = progress.AllDone();
        Deliver(flight, output, absl::OkStatus());
        if (output.finished) return;
        continue;
      }
      progress.samples = {index};
      current.prompt_tokens.insert(current.prompt_tokens.end(), sample.generated.begin(),
                                   sample.generated.end());
      current.params.n = 1;
      current.params.max_tokens = original.params.max_tokens - used;
      current.params.min_tokens = std::max(0, original.params.min_tokens - used);
      // Text the old worker held back (a partial character, a possible stop string) is
      // carried into the first text of the continuation.
      const std::string full =
          tokenizer_->Decode(sample.generated, original.params.skip_special_tokens);
      if (full.size() > sample.delivered.size() &&
          full.compare(0, sample.delivered.size(), sample.delivered) == 0) {
        sample.carried = full.substr(sample.delivered.size());
      }
    }
  }

  // Moves the samples a draining decode worker parked (parked.handoff) to another decode worker
  // and continues them there: Reserve for their KV tokens (not on the draining worker), Handoff
  // on the draining worker into that reservation, then Start with `base`'s prompt and sampling
  // and a continuation per sample carrying the tokens it generated, relaying the new stream.
  // *started is false when a step before the stream failed (the reservation is then released,
  // the caller recomputes; the parked blocks are cancelled on the draining worker).
  StreamEnd HandOff(Flight& flight, const GenerateRequest& base, const std::string& id,
                    const StreamEnd& parked, RequestOutput& output, Progress& progress,
                    bool* started) {
    *started = false;
    DecodeWorkerState* source = parked.worker.get();
    auto fail = [&](absl::Status why) {
      // Frees what is still parked at once instead of at its expiry (best effort).
      tandem::v1::CancelRequest cancel;
      cancel.set_request_id(parked.worker_request_id);
      cancel.set_reason("router: KV handoff abandoned");
      tandem::v1::CancelResponse cancelled;
      grpc::ClientContext context;
      context.set_deadline(GrpcDeadline(absl::Now() + absl::Seconds(2)));
      source->stub->Cancel(&context, cancel, &cancelled);
      StreamEnd end;
      end.error = std::move(why);
      return end;
    };
    const tandem::v1::KvHandoff& handoff = *parked.handoff;
    // The request's samples to move (by its own index), and what the worker parked of each.
    std::vector<int> samples;
    std::vector<const tandem::v1::KvHandoff::Sample*> wire;
    for (const tandem::v1::KvHandoff::Sample& s : handoff.samples()) {
      if (s.index() < 0 || s.index() >= static_cast<int>(progress.samples.size())) {
        return fail(absl::InternalError(absl::StrCat("handoff of unknown sample ", s.index())));
      }
      const int index = progress.samples[s.index()];
      const Sample& sample = progress.sample[index];
      if (sample.done) continue;
      // The client must have every token the worker generated, in order: they end its stream.
      const int g = s.generated_token_ids_size();
      if (g > static_cast<int>(sample.generated.size()) ||
          !std::equal(s.generated_token_ids().begin(), s.generated_token_ids().end(),
                      sample.generated.end() - g)) {
        return fail(absl::InternalError("the parked tokens differ from those streamed"));
      }
      if (s.num_kv_tokens() <= 0) return fail(absl::UnavailableError("a sample has no KV"));
      // One reservation holds samples of one length (samples that decoded together).
      if (!wire.empty() && s.num_kv_tokens() != wire.front()->num_kv_tokens()) {
        return fail(absl::UnavailableError("parked samples hold different KV lengths"));
      }
      samples.push_back(index);
      wire.push_back(&s);
    }
    int unfinished = 0;
    for (int index : progress.samples) unfinished += progress.sample[index].done ? 0 : 1;
    if (samples.empty() || static_cast<int>(samples.size()) != unfinished) {
      return fail(absl::UnavailableError("not every unfinished sample was parked"));
    }
    const int k = static_cast<int>(samples.size());
    const int kv_tokens = wire.front()->num_kv_tokens();
    GenerateRequest r = base;
    r.request_id = id;
    r.params.n = k;
    const int prompt_len = static_cast<int>(r.prompt_tokens.size());

    // 1. Room for the KV on another decode worker, quickly: the parked KV expires soon.
    const absl::Time expires = absl::FromUnixMillis(handoff.expires_unix_ms());
    auto reserved = Reserve(flight, r, kv_tokens, prompt_len + r.params.max_tokens - kv_tokens,
                            source, std::clamp(expires - absl::Now() - absl::Milliseconds(500),
                                               absl::ZeroDuration(), absl::Seconds(1)));
    if (!reserved.ok()) return fail(reserved.status());
    auto [target, reservation] = std::move(reserved).value();
    const int reserved_blocks = reservation.block_ids_size();
    auto release = [&] {
      Release(target.get(), reservation);
      AddPending(target.get(), -reserved_blocks, -1);
    };

    // 2. The draining worker pushes each sample's KV into its slice of the reservation. Not
    // cancelled by Abort: the reservation may only be released once no transfer writes into it.
    int64_t bytes = 0;
    for (int i = 0; i < k; ++i) {
      tandem::v1::HandoffRequest request;
      request.set_request_id(parked.worker_request_id);
      request.set_index(wire[i]->index());
      *request.mutable_reservation() = reservation;
      request.set_target_index(i);
      tandem::v1::HandoffResponse response;
      grpc::ClientContext context;
      context.set_deadline(GrpcDeadline(absl::Now() + absl::Seconds(15)));
      grpc::Status status = source->stub->Handoff(&context, request, &response);
      if (!status.ok() || Cancelled(flight)) {
        release();
        return fail(status.ok() ? absl::CancelledError("request aborted")
                                : proto::FromGrpcStatus(status));
      }
      bytes += response.kv_transfer_bytes();
    }

    // 3. Continue on the target: the same prompt, the generated tokens as the continuation.
    tandem::v1::StartRequest start;
    start.set_request_id(id);
    start.set_reservation_id(reservation.reservation_id());
    start.mutable_prompt_token_ids()->Add(r.prompt_tokens.begin(), r.prompt_tokens.end());
    *start.mutable_sampling() = proto::ToProto(r.params);
    for (int i = 0; i < k; ++i) {
      tandem::v1::PrefilledChoice* choice = start.add_choices();
      choice->set_index(i);
      choice->set_sampler_state(wire[i]->sampler_state());
      *choice->mutable_generated_token_ids() = wire[i]->generated_token_ids();
    }
    const std::vector<int> previous = progress.samples;
    progress.samples = samples;
    StreamEnd end = Relay(flight, target, reservation, start, output, progress);
    if (!end.any_event && !end.finished && !Cancelled(flight)) {
      // Start refused it, or its worker went away, before anything streamed: the reservation
      // may still be there (Relay already took it off the pending load).
      progress.samples = previous;
      Release(target.get(), reservation);
      return fail(end.error);
    }
    *started = true;
    kv_handoffs_.fetch_add(k);
    kv_handoff_bytes_.fetch_add(bytes);
    return end;
  }

  // Updates a prefill worker's seconds per queued prompt token from one answered Submit.
  void Learn(PrefillWorkerState& prefill, double seconds, int64_t tokens) {
    if (tokens <= 0) return;
    std::lock_guard<std::mutex> lock(stats_mu_);
    const double observed = seconds / static_cast<double>(tokens);
    prefill.seconds_per_token = prefill.samples == 0
                                    ? observed
                                    : 0.8 * prefill.seconds_per_token + 0.2 * observed;
    ++prefill.samples;
  }

  void CancelPrefill(PrefillWorkerState& prefill, const std::string& request_id) {
    tandem::v1::CancelRequest request;
    request.set_request_id(request_id);
    request.set_reason("router: request ended before its prefill was used");
    tandem::v1::CancelResponse response;
    grpc::ClientContext context;
    context.set_deadline(GrpcDeadline(absl::Now() + absl::Seconds(10)));
    prefill.stub->Cancel(&context, request, &response);
  }

  absl::Status Prefill(Flight& flight, const GenerateRequest& r, PrefillWorkerState& prefill_worker,
                       const tandem::v1::KvReservation& reservation,
                       tandem::v1::SubmitResponse& response) {
    PrefillWorkerState* prefill = &prefill_worker;
    tandem::v1::SubmitRequest request;
    request.set_request_id(r.request_id);
    request.mutable_prompt_token_ids()->Add(r.prompt_tokens.begin(), r.prompt_tokens.end());
    *request.mutable_sampling() = proto::ToProto(r.params);
    *request.mutable_reservation() = reservation;
    request.set_deadline_unix_ms(reservation.expires_unix_ms());
    grpc::ClientContext context;
    context.set_deadline(GrpcDeadline(absl::FromUnixMillis(reservation.expires_unix_ms()) +
                                      absl::Seconds(1)));
    if (!BeginCall(flight, &context)) return absl::CancelledError("request aborted");
    const int64_t tokens = static_cast<int64_t>(r.prompt_tokens.size()) * r.params.n;
    int64_t queued_ahead = 0;
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      queued_ahead = prefill->stats.queued_prefill_tokens() + prefill->pending_load;
    }
    AddPending(prefill, tokens, 1);
    const absl::Time sent = absl::Now();
    grpc::Status status = prefill->stub->Submit(&context, request, &response);
    const double seconds = absl::ToDoubleSeconds(absl::Now() - sent);
    AddPending(prefill, -tokens, -1);
    EndCall(flight);
    if (status.ok()) {
      Learn(*prefill, seconds, queued_ahead + tokens);
      return absl::OkStatus();
    }
    absl::Status failed = proto::FromGrpcStatus(status);
    return absl::Status(failed.code(),
                        absl::StrCat("prefill worker ", prefill->address, ": ", failed.message()));
  }

  // Asks every worker for its Stats at once (gRPC's callback API: no thread per worker, and a
  // hung worker delays nobody else's answer) and waits up to `timeout` for the answers. Returns
  // "ADDRESS (why)" of each worker that did not answer.
  std::vector<std::string> PollOnce(absl::Duration timeout) const {
    struct Poll {
      WorkerState* worker = nullptr;
      grpc::ClientContext context;
      tandem::v1::StatsRequest request;
      tandem::v1::WorkerStats stats;
      grpc::Status status;
    };
    std::vector<std::shared_ptr<DecodeWorkerState>> decode;
    std::vector<std::shared_ptr<PrefillWorkerState>> prefill;
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      decode = decode_;
      prefill = prefill_;
    }
    std::vector<std::unique_ptr<Poll>> polls;
    absl::BlockingCounter answered(static_cast<int>(decode.size() + prefill.size()));
    auto ask = [&](WorkerState& w, auto& stub) {
      Poll& poll = *polls.emplace_back(std::make_unique<Poll>());
      poll.worker = &w;
      poll.context.set_deadline(GrpcDeadline(absl::Now() + timeout));
      // gRPC runs the callback by the deadline at the latest.
      stub->async()->Stats(&poll.context, &poll.request, &poll.stats,
                           [&poll, &answered](grpc::Status status) {
                             poll.status = std::move(status);
                             answered.DecrementCount();
                           });
    };
    for (auto& w : decode) ask(*w, w->stub);
    for (auto& w : prefill) ask(*w, w->stub);
    answered.Wait();
    std::vector<std::string> missing;
    std::lock_guard<std::mutex> lock(stats_mu_);
    for (const std::unique_ptr<Poll>& poll : polls) {
      WorkerState& w = *poll->worker;
      w.up = poll->status.ok();
      if (w.up) {
        w.stats = poll->stats;
        if (!w.answered_once && w.missed_first) {
          std::fprintf(stderr, "tandem router: worker %s answers; taken in\n", w.address.c_str());
        }
        w.answered_once = true;
      } else {
        if (!w.answered_once) w.missed_first = true;
        missing.push_back(absl::StrCat(w.address, " (", poll->status.error_message(), ")"));
      }
    }
    return missing;
  }

  void PollLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      lock.unlock();
      PollOnce(absl::Seconds(1));
      lock.lock();
      poll_wake_.wait_for(lock, absl::ToChronoMilliseconds(options_.stats_interval),
                          [&] { return stopping_; });
    }
  }

  DisaggregatedOptions options_;
  // Plaintext, or mutual TLS from options_.tls; set by Init before any channel is made.
  std::shared_ptr<grpc::ChannelCredentials> channel_credentials_;
  std::unique_ptr<cluster::Membership> membership_;  // with etcd: keeps the pools current
  text::ModelConfig config_;
  std::unique_ptr<text::Tokenizer> tokenizer_;
  std::unique_ptr<text::ChatFormatter> chat_formatter_;
  int max_model_len_ = 0;

  // The pools; a worker that leaves is dropped here, and lives on while a request uses it.
  std::vector<std::shared_ptr<DecodeWorkerState>> decode_;    // guarded by stats_mu_
  std::vector<std::shared_ptr<PrefillWorkerState>> prefill_;  // guarded by stats_mu_
  mutable std::mutex stats_mu_;  // guards the pools and every WorkerState's up, stats, pending_*

  std::atomic<int64_t> prefill_retries_{0};
  std::atomic<int64_t> migrations_{0};
  std::atomic<int64_t> kv_handoffs_{0};
  std::atomic<int64_t> kv_handoff_bytes_{0};

  mutable std::mutex mu_;
  std::map<std::string, std::shared_ptr<Flight>> flights_;  // guarded by mu_
  int num_threads_ = 0;                                     // guarded by mu_
  bool stopping_ = false;                                   // guarded by mu_
  std::condition_variable threads_done_;
  std::condition_variable poll_wake_;
  std::thread poller_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DisaggregatedGenerator>> DisaggregatedGenerator::Create(
    const DisaggregatedOptions& options) {
  auto generator = std::make_unique<DisaggregatedGeneratorImpl>(options);
  TANDEM_RETURN_IF_ERROR(generator->Init());
  return generator;
}

}  // namespace tandem::router
