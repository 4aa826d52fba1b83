#include "tandem/collective/gloo_communicator.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/file_store.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/transport/tcp/device.h"
#include "tcp_store.h"

namespace tandem::collective {
namespace {

std::chrono::milliseconds ToMillis(absl::Duration d) {
  // Gloo adds the timeout to a steady-clock time point: keep "forever" well inside its range.
  if (d > absl::Hours(24 * 365)) d = absl::Hours(24 * 365);
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// Gloo reports failures as exceptions: a timeout, or a peer whose connection closed.
absl::Status FromException(const std::exception& e) {
  const std::string what = e.what();
  if (absl::StrContains(what, "imed out") || absl::StrContains(what, "imeout")) {
    return absl::DeadlineExceededError(what);
  }
  return absl::UnavailableError(what);
}

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(int rank, int size, std::shared_ptr<gloo::Context> context,
                   std::chrono::milliseconds timeout)
      : Communicator(rank, size), context_(std::move(context)), timeout_(timeout) {}

  const char* kind() const override { return "gloo"; }
  void set_timeout(std::chrono::milliseconds timeout) { timeout_ = timeout; }

 protected:
  absl::Status DoAllReduceSum(float* data, size_t count) override {
    return Guard([&] {
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(data, count);
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      opts.setTag(NextTag());
      opts.setTimeout(timeout_);
      gloo::allreduce(opts);
    });
  }

  absl::Status DoAllGather(const void* in, void* out, size_t bytes) override {
    if (size() == 1) {
      std::memcpy(out, in, bytes);
      return absl::OkStatus();
    }
    return Guard([&] {
      gloo::AllgatherOptions opts(context_);
      // Gloo's input is not written; its API takes a non-const pointer.
      opts.setInput(static_cast<char*>(const_cast<void*>(in)), bytes);
      opts.setOutput(static_cast<char*>(out), bytes * static_cast<size_t>(size()));
      opts.setTag(NextTag());
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
    });
  }

  absl::Status DoBroadcast(void* data, size_t bytes, int root,
                           std::optional<absl::Duration> timeout) override {
    return Guard([&] {
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(static_cast<char*>(data), bytes);
      opts.setRoot(root);
      opts.setTag(NextTag());
      opts.setTimeout(timeout ? ToMillis(*timeout) : timeout_);
      gloo::broadcast(opts);
    });
  }

  absl::Status DoBarrier() override {
    return Guard([&] {
      gloo::BarrierOptions opts(context_);
      opts.setTag(NextTag());
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

 private:
  template <typename F>
  static absl::Status Guard(F&& f) {
    try {
      f();
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return FromException(e);
    }
  }

  // Every rank runs the same collectives in the same order, so the same tag sequence.
  uint32_t NextTag() { return next_tag_++; }

  std::shared_ptr<gloo::Context> context_;
  std::chrono::milliseconds timeout_;
  uint32_t next_tag_ = 0;
};

// A RendezvousStore as Gloo calls it: failures become gloo::IoException, as Gloo expects.
class ExternalStore : public gloo::rendezvous::Store {
 public:
  ExternalStore(RendezvousStore& store, std::chrono::milliseconds timeout)
      : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    const absl::Status status = store_.Set(key, std::string(data.begin(), data.end()));
    if (!status.ok()) {
      throw gloo::IoException(absl::StrCat("rendezvous store: set ", key, ": ", status.message()));
    }
  }
  std::vector<char> get(const std::string& key) override {
    absl::StatusOr<std::string> value = store_.Get(key, absl::FromChrono(timeout_));
    if (!value.ok()) {
      throw gloo::IoException(
          absl::StrCat("rendezvous store: get ", key, ": ", value.status().message()));
    }
    return std::vector<char>(value->begin(), value->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    const absl::Time deadline = absl::Now() + absl::FromChrono(timeout);
    for (const std::string& key : keys) {
      absl::StatusOr<std::string> value =
          store_.Get(key, std::max(deadline - absl::Now(), absl::ZeroDuration()));
      if (!value.ok()) {
        throw gloo::IoException(
            absl::StrCat("rendezvous store: wait for ", key, ": ", value.status().message()));
      }
    }
  }

 private:
  RendezvousStore& store_;
  std::chrono::milliseconds timeout_;
};

absl::StatusOr<std::unique_ptr<Communicator>> Connect(const GlooOptions& options,
                                                      TcpStoreServer* server) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " outside a group of ", options.size));
  }
  if (options.timeout <= absl::ZeroDuration() || options.connect_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the collective and connect timeouts must be positive");
  }
  const bool file = !options.file_store_dir.empty();
  const bool tcp = !options.leader_address.empty() || server != nullptr;
  const bool external = options.store != nullptr;
  if (int{file} + int{tcp} + int{external} != 1) {
    return absl::InvalidArgumentError(
        "give exactly one rendezvous: a file store directory, the leader's address or a store");
  }
  const std::chrono::milliseconds timeout = ToMillis(options.timeout);
  const std::chrono::milliseconds connect_timeout = ToMillis(options.connect_timeout);
  // Rank 0 serves the TCP store unless its launcher already does.
  std::unique_ptr<TcpStoreServer> own_server;
  std::string store_address = options.leader_address;
  if (tcp && options.rank == 0 && server == nullptr) {
    auto started = internal::StartTcpStoreServer(options.leader_address);
    if (!started.ok()) return started.status();
    own_server = std::move(started).value();
    server = own_server.get();
  }
  if (server != nullptr) store_address = server->address();
  try {
    std::unique_ptr<gloo::rendezvous::Store> store;
    if (file) {
      store = std::make_unique<gloo::rendezvous::FileStore>(options.file_store_dir);
    } else if (external) {
      store = std::make_unique<ExternalStore>(*options.store, connect_timeout);
    } else {
      auto client = internal::TcpStoreClient::Connect(store_address, connect_timeout);
      if (!client.ok()) return client.status();
      store = std::move(client).value();
    }
    gloo::rendezvous::PrefixStore prefixed(options.group, *store);
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    auto context = std::make_shared<gloo::rendezvous::Context>(options.rank, options.size);
    context->setTimeout(connect_timeout);
    context->connectFullMesh(prefixed, device);
    auto comm =
        std::make_unique<GlooCommunicator>(options.rank, options.size, context, connect_timeout);
    // Nobody reads the store after this, so rank 0 may stop serving it.
    absl::Status joined = comm->Barrier();
    if (!joined.ok()) return joined;
    comm->set_timeout(timeout);
    return std::unique_ptr<Communicator>(std::move(comm));
  } catch (const std::exception& e) {
    absl::Status status = FromException(e);
    return absl::Status(status.code(),
                        absl::StrCat("gloo rendezvous of rank ", options.rank, " of ", options.size,
                                     " (group ", options.group, ") failed: ", status.message()));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(const GlooOptions& options) {
  return Connect(options, nullptr);
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicatorWithServer(
    const GlooOptions& options, TcpStoreServer& server) {
  if (options.rank != 0) {
    return absl::InvalidArgumentError("only rank 0 serves the rendezvous store");
  }
  return Connect(options, &server);
}

absl::StatusOr<std::unique_ptr<TcpStoreServer>> TcpStoreServer::Start(const std::string& address) {
  return internal::StartTcpStoreServer(address);
}

}  // namespace tandem::collective
