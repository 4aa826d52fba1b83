#include "tandem/cluster/etcd_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "etcdserverpb/rpc.grpc.pb.h"
#include "tandem/base/host_port.h"
#include "tandem/base/status_macros.h"

namespace tandem::cluster {
namespace {

using Clock = std::chrono::steady_clock;

// A broken connection shows as one of these; anything else is etcd's answer.
bool IsConnectionError(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE ||
         status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

absl::Status FromGrpc(const grpc::Status& status, const std::string& endpoint) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("etcd ", endpoint, ": ", status.error_message()));
}

KeyValue FromProto(const mvccpb::KeyValue& kv) {
  KeyValue out;
  out.key = kv.key();
  out.value = kv.value();
  out.create_revision = kv.create_revision();
  out.mod_revision = kv.mod_revision();
  out.version = kv.version();
  out.lease = kv.lease();
  return out;
}

std::chrono::milliseconds ToChrono(absl::Duration d) {
  return std::chrono::milliseconds(std::max<int64_t>(0, absl::ToInt64Milliseconds(d)));
}

}  // namespace

std::string PrefixRangeEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    const auto last = static_cast<unsigned char>(end.back());
    if (last < 0xff) {
      end.back() = static_cast<char>(last + 1);
      return end;
    }
    end.pop_back();
  }
  // Every byte was 0xff (or the prefix was empty): every key from `prefix` on.
  return std::string(1, '\0');
}

absl::StatusOr<std::vector<std::string>> ParseEndpoints(const std::string& endpoints,
                                                        bool tls) {
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(endpoints, ',', absl::SkipWhitespace())) {
    part = absl::StripAsciiWhitespace(part);
    if (!tls && absl::StartsWith(part, "https://")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "etcd endpoint ", std::string(part),
          " needs TLS files (--tls-ca, --tls-cert, --tls-key)"));
    }
    if (tls && absl::StartsWith(part, "http://")) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd endpoint ", std::string(part),
                       " is plaintext but TLS is configured: use https://"));
    }
    if (!absl::ConsumePrefix(&part, "https://")) absl::ConsumePrefix(&part, "http://");
    absl::ConsumeSuffix(&part, "/");
    std::string target(part);
    auto host_port = SplitHostPort(target);
    if (!host_port.ok() || host_port->second == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd endpoint must be ", tls ? "https" : "http",
                       "://HOST:PORT or HOST:PORT, got '", target, "'"));
    }
    out.push_back(std::move(target));
  }
  if (out.empty()) return absl::InvalidArgumentError("no etcd endpoint given");
  return out;
}

struct EtcdClient::Impl {
  EtcdClientOptions options;
  std::vector<std::string> endpoints;
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<etcdserverpb::KV::Stub>> kv;
  std::vector<std::unique_ptr<etcdserverpb::Lease::Stub>> lease;
  std::vector<std::unique_ptr<etcdserverpb::Watch::Stub>> watch;
  // The endpoint to try first.
  std::atomic<size_t> current{0};
  // One thread per channel keeps it connecting (see Create).
  std::atomic<bool> stop_watching{false};
  std::vector<std::thread> channel_watchers;

  ~Impl() {
    stop_watching.store(true);
    for (auto& thread : channel_watchers) thread.join();
  }

  // Moves off endpoint `failed` (if it is still the current one).
  void Rotate(size_t failed) {
    size_t expected = failed;
    current.compare_exchange_strong(expected, (failed + 1) % endpoints.size());
  }

  // Runs `call(index, context)` on the current endpoint and, while the answer is a connection
  // error, once on each other endpoint.
  template <typename Call>
  absl::Status Unary(Call&& call) {
    const size_t start = current.load();
    grpc::Status last;
    std::string last_endpoint;
    for (size_t attempt = 0; attempt < endpoints.size(); ++attempt) {
      const size_t index = (start + attempt) % endpoints.size();
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + ToChrono(options.timeout));
      last = call(index, &context);
      last_endpoint = endpoints[index];
      if (!IsConnectionError(last)) {
        if (index != start) current.store(index);
        return FromGrpc(last, last_endpoint);
      }
    }
    if (endpoints.size() == 1) return FromGrpc(last, last_endpoint);
    return absl::Status(static_cast<absl::StatusCode>(last.error_code()),
                        absl::StrCat("no etcd endpoint answered (", options.endpoints,
                                     "); last, ", last_endpoint, ": ", last.error_message()));
  }
};

EtcdClient::EtcdClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EtcdClient::~EtcdClient() = default;

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(EtcdClientOptions options) {
  auto impl = std::make_unique<Impl>();
  TANDEM_ASSIGN_OR_RETURN(impl->endpoints,
                          ParseEndpoints(options.endpoints, options.tls.enabled()));
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("etcd client timeout must be positive");
  }
  TANDEM_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                          proto::MakeChannelCredentials(options.tls));
  impl->options = std::move(options);
  for (const std::string& endpoint : impl->endpoints) {
    grpc::ChannelArguments args;
    // Reconnect within a second of etcd coming back rather than after gRPC's default backoff
    // (up to two minutes), and notice a dead peer on an idle stream through HTTP/2 pings
    // (every 10 s: etcd refuses pings more often than every 5 s by default).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 1000);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
    proto::AddTlsChannelArgs(impl->options.tls, &args);
    auto channel = grpc::CreateCustomChannel(endpoint, credentials, args);
    impl->kv.push_back(etcdserverpb::KV::NewStub(channel));
    impl->lease.push_back(etcdserverpb::Lease::NewStub(channel));
    impl->watch.push_back(etcdserverpb::Watch::NewStub(channel));
    impl->channels.push_back(std::move(channel));
  }
  // gRPC's synchronous API only drives a connection attempt while some call waits on it, and a
  // call that fails fast (the channel in TRANSIENT_FAILURE: etcd was down) does not wait, so a
  // channel whose endpoint went away would never see it come back. A connectivity watch per
  // channel keeps an attempt in progress and polled.
  for (auto& channel : impl->channels) {
    impl->channel_watchers.emplace_back([channel, stop = &impl->stop_watching] {
      while (!stop->load()) {
        const grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/true);
        channel->WaitForStateChange(
            state, std::chrono::system_clock::now() + std::chrono::milliseconds(200));
      }
    });
  }
  return std::unique_ptr<EtcdClient>(new EtcdClient(std::move(impl)));
}

std::string EtcdClient::current_endpoint() const {
  return impl_->endpoints[impl_->current.load()];
}

absl::StatusOr<std::optional<KeyValue>> EtcdClient::Get(const std::string& key) {
  etcdserverpb::RangeRequest request;
  request.set_key(key);
  etcdserverpb::RangeResponse response;
  TANDEM_RETURN_IF_ERROR(impl_->Unary([&](size_t i, grpc::ClientContext* context) {
    return impl_->kv[i]->Range(context, request, &response);
  }));
  if (response.kvs_size() == 0) return std::optional<KeyValue>();
  return std::optional<KeyValue>(FromProto(response.kvs(0)));
}

absl::StatusOr<RangeResult> EtcdClient::GetPrefix(const std::string& prefix) {
  etcdserverpb::RangeRequest request;
  request.set_key(prefix);
  request.set_range_end(PrefixRangeEnd(prefix));
  request.set_sort_order(etcdserverpb::RangeRequest::ASCEND);
  request.set_sort_target(etcdserverpb::RangeRequest::KEY);
  etcdserverpb::RangeResponse response;
  TANDEM_RETURN_IF_ERROR(impl_->Unary([&](size_t i, grpc::ClientContext* context) {
    return impl_->kv[i]->Range(context, request, &response);
  }));
  RangeResult result;
  result.revision = response.header().revision();
  result.kvs.reserve(response.kvs_size());
  for (const auto& kv : response.kvs()) result.kvs.push_back(FromProto(kv));
  return result;
}

absl::StatusOr<int64_t> EtcdClient::Put(const std::string& key, const std::string& value,
                                        int64_t lease) {
  etcdserverpb::PutRequest request;
  request.set_key(key);
  request.set_value(value);
  request.set_lease(lease);
  etcdserverpb::PutResponse response;
  TANDEM_RETURN_IF_ERROR(impl_->Unary([&](size_t i, grpc::ClientContext* context) {
    return impl_->kv[i]->Put(context, request, &response);
  }));
  return response.header().revision();
}

absl::StatusOr<int64_t> EtcdClient::Delete(const std::string& key) {
  etcdserverpb::DeleteRangeRequest request;
  request.set_key(key);
  etcdserverpb::DeleteRangeResponse response;
  TANDEM_RETURN_IF_ERROR(impl_->Unary([&](size_t i, grpc::ClientContext* context) {
    return impl_->kv[i]->DeleteRange(context, request, &response);
  }));
  return response.deleted();
}

absl::StatusOr<int64_t> EtcdClient::DeletePrefix(const std::string& prefix) {
  etcdserverpb::DeleteRangeRequest request;
  request.set_key(prefix);
  request.set_range_end(PrefixRangeEnd(prefix));
  etcdserverpb::DeleteRangeResponse response;
  TANDEM_RETURN_IF_ERROR(impl_->Unary([&](size_t i, grpc::ClientContext* context) {
    return impl_->kv[i]->DeleteRange(context, request, &response);
  }));
  return response.deleted();
}

absl::StatusOr<bool> EtcdClient::CreateIfAbsent(const std::string& key, const std::string& value,
                                                int64_t lease) {
  etcdserverpb::TxnRequest request;
  auto* compare = request.add_compare();
  compare->set_key(key);
  compare->set_target(etcdserverpb::Compare::CREATE);
  compare->set_result(etcdserverpb::Compare::EQUAL);
  compare->set_create_revision(0);
  auto* put = request.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease);
  // On failure, read the key back: it tells a conflict from a retry of our own write.
  request.add_failure()->mutable_request_range()->set_key(key);
  etcdserverpb::TxnResponse response;
  TANDEM_RETURN_IF_ERROR(impl_->Unary([&](size_t i, grpc::ClientContext* context) {
    return impl_->kv[i]->Txn(context, request, &response);
  }));
  if (response.succeeded()) return true;
  if (response.responses_size() == 1 && response.responses(0).has_response_range()) {
    const auto& range = response.responses(0).response_range();
    if (range.kvs_size() == 1 && lease != 0 && range.kvs(0).lease() == lease &&
        range.kvs(0).value() == value) {
      return true;
    }
  }
  return false;
}

absl::Status EtcdClient::Compact(int64_t revision) {
  etcdserverpb::CompactionRequest request;
  request.set_revision(revision);
  request.set_physical(true);
  etcdserverpb::CompactionResponse response;
  return impl_->Unary([&](size_t i, grpc::ClientContext* context) {
    return impl_->kv[i]->Compact(context, request, &response);
  });
}

absl::StatusOr<int64_t> EtcdClient::LeaseGrant(absl::Duration ttl) {
  const int64_t seconds = absl::ToInt64Seconds(absl::Ceil(ttl, absl::Seconds(1)));
  if (seconds < 1) return absl::InvalidArgumentError("lease TTL must be at least 1 s");
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(seconds);
  etcdserverpb::LeaseGrantResponse response;
  TANDEM_RETURN_IF_ERROR(impl_->Unary([&](size_t i, grpc::ClientContext* context) {
    return impl_->lease[i]->LeaseGrant(context, request, &response);
  }));
  if (!response.error().empty()) {
    return absl::FailedPreconditionError(absl::StrCat("etcd LeaseGrant: ", response.error()));
  }
  return response.id();
}

absl::Status EtcdClient::LeaseRevoke(int64_t lease) {
  etcdserverpb::LeaseRevokeRequest request;
  request.set_id(lease);
  etcdserverpb::LeaseRevokeResponse response;
  return impl_->Unary([&](size_t i, grpc::ClientContext* context) {
    return impl_->lease[i]->LeaseRevoke(context, request, &response);
  });
}

namespace {

// Sleeps up to `d` or until `stop` is set; returns whether it was set.
bool SleepUnlessStopped(std::mutex& mu, std::condition_variable& cv, const bool& stop,
                        std::chrono::milliseconds d) {
  std::unique_lock lock(mu);
  return cv.wait_for(lock, d, [&] { return stop; });
}

class LeaseKeeperImpl final : public LeaseKeeper {
 public:
  LeaseKeeperImpl(EtcdClient::Impl* client, int64_t lease, absl::Duration ttl,
                  absl::Duration interval, std::function<void(absl::Status)> on_lost)
      : client_(client),
        lease_(lease),
        ttl_(ToChrono(ttl)),
        interval_(ToChrono(std::max(interval, absl::Milliseconds(100)))),
        on_lost_(std::move(on_lost)),
        last_renewed_(Clock::now()) {
    thread_ = std::thread([this] { Run(); });
  }
  ~LeaseKeeperImpl() override { Stop(); }

  void Stop() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      if (context_ != nullptr) context_->TryCancel();
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  absl::Time last_renewed() const override {
    std::lock_guard lock(mu_);
    const auto age = Clock::now() - last_renewed_;
    return absl::Now() - absl::FromChrono(age);
  }

 private:
  // One stream: renews every interval until it breaks, the lease is gone or expires, or Stop.
  // Returns the status to report through on_lost, or OK to reconnect (or stop).
  absl::Status RunStream(size_t index) {
    auto context = std::make_unique<grpc::ClientContext>();
    {
      std::lock_guard lock(mu_);
      if (stop_) return absl::OkStatus();
      context_ = context.get();
    }
    auto stream = client_->lease[index]->LeaseKeepAlive(context.get());
    bool reader_done = false;
    bool gone = false;
    std::thread reader([&] {
      etcdserverpb::LeaseKeepAliveResponse response;
      while (stream->Read(&response)) {
        std::lock_guard lock(mu_);
        if (response.ttl() <= 0) {
          gone = true;
          break;
        }
        last_renewed_ = Clock::now();
        cv_.notify_all();
      }
      std::lock_guard lock(mu_);
      reader_done = true;
      cv_.notify_all();
    });
    etcdserverpb::LeaseKeepAliveRequest request;
    request.set_id(lease_);
    absl::Status lost;
    while (true) {
      if (!stream->Write(request)) break;
      const auto next_write = Clock::now() + interval_;
      std::unique_lock lock(mu_);
      // Until the next renewal is due, waking early when stopped, the stream breaks, etcd says
      // the lease is gone, or the lease has gone unrenewed for its TTL.
      while (!stop_ && !reader_done && !gone && Clock::now() < next_write &&
             Clock::now() < last_renewed_ + ttl_) {
        cv_.wait_until(lock, std::min(next_write, last_renewed_ + ttl_));
      }
      if (gone) break;
      if (Clock::now() >= last_renewed_ + ttl_) {
        lost = Expired();
        break;
      }
      if (stop_ || reader_done) break;
    }
    context->TryCancel();
    reader.join();
    const grpc::Status status = stream->Finish();
    {
      std::lock_guard lock(mu_);
      context_ = nullptr;
      if (gone && lost.ok()) {
        lost = absl::NotFoundError(absl::StrCat("etcd lease ", lease_, " is gone"));
      }
    }
    if (lost.ok() && status.error_code() == grpc::StatusCode::NOT_FOUND) {
      lost = FromGrpc(status, client_->endpoints[index]);
    }
    return lost;
  }

  absl::Status Expired() const {
    return absl::UnavailableError(absl::StrCat("etcd lease ", lease_, ": no renewal for ",
                                               ttl_.count() / 1000.0,
                                               " s (its TTL); etcd is unreachable"));
  }

  void Run() {
    auto backoff = std::chrono::milliseconds(100);
    while (true) {
      const size_t index = client_->current.load();
      const auto started = Clock::now();
      absl::Status lost = RunStream(index);
      {
        std::lock_guard lock(mu_);
        if (stop_) return;
        if (lost.ok() && Clock::now() >= last_renewed_ + ttl_) lost = Expired();
      }
      if (!lost.ok()) {
        if (on_lost_) on_lost_(lost);
        return;
      }
      // The stream broke: try the next endpoint after a pause (a short one if it had worked
      // for a while).
      client_->Rotate(index);
      if (Clock::now() - started > std::chrono::seconds(2)) backoff = std::chrono::milliseconds(100);
      {
        // Wake when the lease would expire, so a loss is reported on time.
        std::unique_lock lock(mu_);
        const auto until = std::min(Clock::now() + backoff, last_renewed_ + ttl_);
        if (cv_.wait_until(lock, until, [&] { return stop_; })) return;
      }
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
  }

  EtcdClient::Impl* const client_;
  const int64_t lease_;
  const std::chrono::milliseconds ttl_;
  const std::chrono::milliseconds interval_;
  const std::function<void(absl::Status)> on_lost_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  grpc::ClientContext* context_ = nullptr;
  Clock::time_point last_renewed_;
  std::thread thread_;
};

class WatcherImpl final : public Watcher {
 public:
  WatcherImpl(EtcdClient* client, EtcdClient::Impl* impl, std::string prefix,
              int64_t start_revision, std::function<void(const WatchUpdate&)> callback)
      : client_(client),
        impl_(impl),
        prefix_(std::move(prefix)),
        callback_(std::move(callback)),
        next_revision_(start_revision) {
    thread_ = std::thread([this] { Run(); });
  }
  ~WatcherImpl() override { Stop(); }

  void Stop() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
      if (context_ != nullptr) context_->TryCancel();
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  int64_t next_revision() const override { return next_revision_.load(); }

 private:
  enum class StreamEnd { kBroken, kCompacted, kStopped };

  StreamEnd RunStream(size_t index, bool& created) {
    auto context = std::make_unique<grpc::ClientContext>();
    {
      std::lock_guard lock(mu_);
      if (stop_) return StreamEnd::kStopped;
      context_ = context.get();
    }
    auto stream = impl_->watch[index]->Watch(context.get());
    etcdserverpb::WatchRequest request;
    auto* create = request.mutable_create_request();
    create->set_key(prefix_);
    create->set_range_end(PrefixRangeEnd(prefix_));
    create->set_start_revision(next_revision_.load());
    StreamEnd end = StreamEnd::kBroken;
    if (stream->Write(request)) {
      etcdserverpb::WatchResponse response;
      while (stream->Read(&response)) {
        if (response.compact_revision() != 0) {
          end = StreamEnd::kCompacted;
          break;
        }
        if (response.canceled()) break;
        if (response.created()) {
          created = true;
          // Watching "from now": a reconnection must resume after this revision.
          if (next_revision_.load() <= 0) next_revision_.store(response.header().revision() + 1);
        }
        if (response.events_size() == 0) continue;
        WatchUpdate update;
        update.events.reserve(response.events_size());
        for (const auto& event : response.events()) {
          WatchEvent out;
          out.type = event.type() == mvccpb::Event::DELETE ? WatchEvent::Type::kDelete
                                                            : WatchEvent::Type::kPut;
          out.kv = FromProto(event.kv());
          update.revision = std::max(update.revision, out.kv.mod_revision);
          update.events.push_back(std::move(out));
        }
        callback_(update);
        next_revision_.store(update.revision + 1);
      }
    }
    context->TryCancel();
    etcdserverpb::WatchResponse ignored;
    while (stream->Read(&ignored)) {
    }
    stream->Finish();
    std::lock_guard lock(mu_);
    context_ = nullptr;
    if (stop_) return StreamEnd::kStopped;
    return end;
  }

  // Re-lists the prefix after a compaction; false when stopped.
  bool Resync() {
    auto backoff = std::chrono::milliseconds(100);
    while (true) {
      auto range = client_->GetPrefix(prefix_);
      if (range.ok()) {
        WatchUpdate update;
        update.resync = true;
        update.snapshot = std::move(range->kvs);
        update.revision = range->revision;
        callback_(update);
        next_revision_.store(range->revision + 1);
        return true;
      }
      if (SleepUnlessStopped(mu_, cv_, stop_, backoff)) return false;
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
  }

  void Run() {
    auto backoff = std::chrono::milliseconds(100);
    while (true) {
      const size_t index = impl_->current.load();
      bool created = false;
      const StreamEnd end = RunStream(index, created);
      if (end == StreamEnd::kStopped) return;
      if (end == StreamEnd::kCompacted) {
        if (!Resync()) return;
        continue;
      }
      if (created) {
        backoff = std::chrono::milliseconds(100);
      } else {
        impl_->Rotate(index);
      }
      if (SleepUnlessStopped(mu_, cv_, stop_, backoff)) return;
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
  }

  EtcdClient* const client_;
  EtcdClient::Impl* const impl_;
  const std::string prefix_;
  const std::function<void(const WatchUpdate&)> callback_;
  std::atomic<int64_t> next_revision_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  grpc::ClientContext* context_ = nullptr;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<LeaseKeeper> EtcdClient::KeepAlive(int64_t lease, absl::Duration ttl,
                                                   absl::Duration interval,
                                                   std::function<void(absl::Status)> on_lost) {
  return std::make_unique<LeaseKeeperImpl>(impl_.get(), lease, ttl, interval, std::move(on_lost));
}

std::unique_ptr<Watcher> EtcdClient::Watch(const std::string& prefix, int64_t start_revision,
                                           std::function<void(const WatchUpdate&)> callback) {
  return std::make_unique<WatcherImpl>(this, impl_.get(), prefix, start_revision,
                                       std::move(callback));
}

}  // namespace tandem::cluster
