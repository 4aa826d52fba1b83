// The ucx agent's internals, shared by its core (ucx_agent.cc: setup, the progress thread,
// memory, transfers) and its connection half (ucx_connections.cc: listener callbacks, the
// handshake, Connect and Disconnect). Nothing outside kvtransfer/src/ucx includes this. It uses
// namespace ucx::detail: a ucx::internal would hide kvtransfer::internal from this code.
#pragma once

#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kvtransfer/src/internal.h"
#include "tandem/kvtransfer/agent.h"

namespace tandem::kvtransfer::ucx::detail {

using internal::BackendKind;
using internal::RegionDescriptor;
using internal::TransferState;

// ---- UCX handles owned by unique_ptr ----

struct ConfigDeleter {
  void operator()(ucp_config_t* config) const { ucp_config_release(config); }
};
struct ContextDeleter {
  void operator()(ucp_context_h context) const { ucp_cleanup(context); }
};
struct WorkerDeleter {
  void operator()(ucp_worker_h worker) const { ucp_worker_destroy(worker); }
};
struct ListenerDeleter {
  void operator()(ucp_listener_h listener) const { ucp_listener_destroy(listener); }
};
struct MemDeleter {
  ucp_context_h context = nullptr;  // Not owned: the agent's context outlives its regions.
  void operator()(ucp_mem_h memh) const { ucp_mem_unmap(context, memh); }
};
struct RkeyDeleter {
  void operator()(ucp_rkey_h rkey) const { ucp_rkey_destroy(rkey); }
};
struct RkeyBufferDeleter {
  void operator()(void* buffer) const { ucp_rkey_buffer_release(buffer); }
};
struct FdCloser {
  void operator()(int* fd) const {
    close(*fd);
    delete fd;
  }
};

using ConfigPtr = std::unique_ptr<ucp_config_t, ConfigDeleter>;
using ContextPtr = std::unique_ptr<ucp_context, ContextDeleter>;
using WorkerPtr = std::unique_ptr<ucp_worker, WorkerDeleter>;
using ListenerPtr = std::unique_ptr<ucp_listener, ListenerDeleter>;
using MemPtr = std::unique_ptr<ucp_mem, MemDeleter>;
using RkeyPtr = std::unique_ptr<ucp_rkey, RkeyDeleter>;
using FdPtr = std::unique_ptr<int, FdCloser>;

// How long destruction waits for UCX to complete the requests of force-closed endpoints.
constexpr absl::Duration kShutdownGrace = absl::Seconds(30);
// How long a destroyed agent lets its transfers in flight finish before it closes endpoints.
constexpr absl::Duration kShutdownDrain = absl::Seconds(2);

inline std::string UcsError(ucs_status_t status) {
  return absl::StrCat(ucs_status_string(status), " (", static_cast<int>(status), ")");
}

// ---- The connection handshake ----
// A client proves the connection works and that the expected incarnation of the agent is
// listening before Connect returns: it sends kHelloAm, the server answers kHelloAckAm.

constexpr unsigned kHelloAm = 0x7d01;
constexpr unsigned kHelloAckAm = 0x7d02;
constexpr uint64_t kHelloMagic = 0x54414e44454d4b56ull;  // "TANDEMKV"

struct HelloMessage {
  uint64_t magic = kHelloMagic;
  uint64_t token = 0;     // The client's PeerId, echoed back.
  uint64_t instance = 0;  // Hello: the instance expected; ack: the server's own.
};

// The socket address of host:port (passive: one to listen on).
absl::StatusOr<sockaddr_storage> Resolve(const std::string& host, const std::string& port,
                                         bool passive);
socklen_t SockaddrLength(const sockaddr_storage& storage);

class UcxAgent : public Agent {
 public:
  static absl::StatusOr<std::unique_ptr<Agent>> Create(const AgentOptions& options);
  ~UcxAgent() override;

  absl::StatusOr<std::string> RegisterMemory(uint64_t region_id, void* base, size_t bytes) override;
  absl::Status DeregisterMemory(uint64_t region_id) override;
  std::string address() const override { return address_; }
  absl::StatusOr<PeerId> Connect(const std::string& peer_address, absl::Time deadline) override;
  absl::Status Disconnect(PeerId peer) override;
  absl::StatusOr<std::unique_ptr<TransferHandle>> Submit(PeerId peer, uint64_t local_region_id,
                                                         const std::string& remote_descriptor,
                                                         std::vector<Range> ranges,
                                                         absl::Time deadline) override;

 private:
  // Passed to UCX as the argument of an endpoint's error handler; lives until the endpoint has
  // been closed, since UCX may call the handler until then.
  struct EndpointContext {
    UcxAgent* agent = nullptr;
    bool server = false;  // Accepted by the listener rather than made by Connect.
    PeerId peer = 0;      // Client endpoints: the peer it belongs to.
    // Not a unique_ptr: closing is asynchronous (a request the progress loop completes), so it
    // goes through CloseEndpoint, which keeps this context alive until the close is done.
    ucp_ep_h ep = nullptr;
    bool failed = false;
  };

  enum class PeerState { kConnecting, kConnected, kFailed };

  struct Peer {
    std::string address;
    uint64_t instance = 0;
    PeerState state = PeerState::kConnecting;
    std::unique_ptr<EndpointContext> endpoint;
    // Why the peer is unusable once kFailed.
    absl::Status failure;
    // Finished when the handshake ends.
    std::shared_ptr<TransferState> connected;
  };

  struct LocalRegion {
    char* base = nullptr;  // The caller's memory.
    uint64_t bytes = 0;
    uint64_t generation = 0;
    MemPtr memh;
    std::string descriptor;
    int ops = 0;  // Transfers that still read from it.
    bool closing = false;
    std::vector<std::shared_ptr<TransferState>> deregister_waiters;
  };

  // One Submit in flight. Owned by ops_; UCX completion callbacks point at it.
  struct Op {
    UcxAgent* agent = nullptr;
    uint64_t id = 0;
    std::shared_ptr<TransferState> state;
    PeerId peer = 0;
    uint64_t region_id = 0;
    RkeyPtr rkey;
    int outstanding = 0;  // UCX requests not yet completed.
    bool posted = false;  // All requests have been posted.
    ucs_status_t error = UCS_OK;
    // Set when this agent closes the op's connection (FailPeer): why, whatever status UCX then
    // completes its requests with.
    absl::Status closed_because;
  };

  // A force-closed endpoint whose close request has not completed yet.
  struct Closing {
    void* request = nullptr;
    std::unique_ptr<EndpointContext> endpoint;
  };

  UcxAgent() = default;

  // Runs `fn` on the progress thread and returns its result.
  template <typename T>
  T RunOnProgressThread(std::function<T()> fn);
  void Post(std::function<void()> fn);

  void ProgressLoop();
  void RunCommands();
  void SendReplies();
  void CheckDeregistrations();
  void Shutdown();
  // Fails every peer and closes every endpoint (after Shutdown, once transfers drained).
  void CloseAllEndpoints();

  // Progress-thread methods.
  absl::StatusOr<PeerId> StartConnect(const std::string& address, uint64_t instance,
                                      const sockaddr_storage& peer_addr,
                                      std::shared_ptr<TransferState> connected);
  void FailPeer(PeerId id, absl::Status why);
  void CloseEndpoint(std::unique_ptr<EndpointContext> endpoint);
  void CloseEndpoints();
  absl::StatusOr<std::unique_ptr<TransferHandle>> StartTransfer(PeerId peer_id, uint64_t region_id,
                                                                const RegionDescriptor& d,
                                                                const std::vector<Range>& ranges,
                                                                absl::Time deadline);
  void OnRequestDone(Op* op, ucs_status_t status);
  void MaybeFinishOp(Op* op);
  void FinishDeregistration(uint64_t region_id);

  // UCX callbacks (progress thread).
  static void OnConnectionRequest(ucp_conn_request_h request, void* arg);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t OnHello(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  static ucs_status_t OnHelloAck(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static void OnSendDone(void* request, ucs_status_t status, void* user_data);
  static void OnOpRequestDone(void* request, ucs_status_t status, void* user_data);

  std::string name_;
  uint64_t instance_ = 0;
  std::string address_;

  // Declared in destruction order: the context outlives the worker, which outlives the rest.
  ContextPtr context_;
  WorkerPtr worker_;
  ListenerPtr listener_;
  int worker_fd_ = -1;  // Owned by the worker.
  FdPtr wake_fd_;       // Wakes the progress thread when a command is posted.

  std::mutex queue_mu_;
  std::vector<std::function<void()>> queue_;

  // Touched only by the progress thread once it runs.
  bool stopping_ = false;
  bool endpoints_closed_ = false;  // CloseAllEndpoints ran (after the shutdown drain)
  absl::Time stop_started_;
  PeerId last_peer_ = 0;
  uint64_t last_op_ = 0;
  uint64_t last_generation_ = 0;
  std::map<PeerId, Peer> peers_;
  std::map<ucp_ep_h, std::unique_ptr<EndpointContext>> server_endpoints_;
  std::map<uint64_t, LocalRegion> regions_;
  std::map<uint64_t, std::unique_ptr<Op>> ops_;
  std::vector<std::unique_ptr<EndpointContext>> to_close_;
  std::vector<Closing> closing_;
  std::vector<std::pair<ucp_ep_h, HelloMessage>> pending_replies_;

  std::thread progress_thread_;
};

template <typename T>
T UcxAgent::RunOnProgressThread(std::function<T()> fn) {
  auto promise = std::make_shared<std::promise<T>>();
  std::future<T> result = promise->get_future();
  Post([fn = std::move(fn), promise] { promise->set_value(fn()); });
  return result.get();
}

}  // namespace tandem::kvtransfer::ucx::detail
