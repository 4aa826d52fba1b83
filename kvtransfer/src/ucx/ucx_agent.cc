#include "kvtransfer/src/ucx/ucx_agent.h"

#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvtransfer/src/internal.h"
#include "tandem/base/status_macros.h"

namespace tandem::kvtransfer::ucx {
namespace {

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

std::string UcsError(ucs_status_t status) {
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

// A parsed "host:port#instance" address.
struct ParsedAddress {
  std::string host;
  std::string port;
  uint64_t instance = 0;
};

absl::StatusOr<ParsedAddress> ParseAddress(const std::string& address) {
  const auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", address, "\" is not a ucx agent address (host:port#instance)"));
  };
  const size_t hash = address.rfind('#');
  if (hash == std::string::npos) return bad();
  ParsedAddress parsed;
  if (!absl::SimpleHexAtoi(address.substr(hash + 1), &parsed.instance) || parsed.instance == 0) {
    return bad();
  }
  const std::string host_port = address.substr(0, hash);
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos || colon == 0) return bad();
  parsed.host = host_port.substr(0, colon);
  parsed.port = host_port.substr(colon + 1);
  if (parsed.host.size() > 2 && parsed.host.front() == '[' && parsed.host.back() == ']') {
    parsed.host = parsed.host.substr(1, parsed.host.size() - 2);
  }
  int port = 0;
  if (!absl::SimpleAtoi(parsed.port, &port) || port <= 0 || port > 65535) return bad();
  return parsed;
}

absl::StatusOr<sockaddr_storage> Resolve(const std::string& host, const std::string& port,
                                         bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* result = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &result);
  if (rc != 0 || result == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", host, ":", port, ": ", gai_strerror(rc)));
  }
  sockaddr_storage storage{};
  std::memcpy(&storage, result->ai_addr, result->ai_addrlen);
  freeaddrinfo(result);
  return storage;
}

socklen_t SockaddrLength(const sockaddr_storage& storage) {
  return storage.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

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

void UcxAgent::Post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    queue_.push_back(std::move(fn));
  }
  const uint64_t one = 1;
  // An eventfd write only fails if the counter would overflow, which still leaves it readable.
  [[maybe_unused]] ssize_t n = write(*wake_fd_, &one, sizeof(one));
}

absl::StatusOr<std::unique_ptr<Agent>> UcxAgent::Create(const AgentOptions& options) {
  std::unique_ptr<UcxAgent> agent(new UcxAgent());
  agent->name_ = options.name;
  agent->instance_ = internal::NewInstanceId();

  ucp_config_t* raw_config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &raw_config);
  if (status != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_config_read: ", UcsError(status)));
  }
  ConfigPtr config(raw_config);
  // TCP segments larger than UCX's defaults (8 KiB sent, 64 KiB received) cut the per-message
  // cost of KV pushes over TCP (kvtransfer/bench/RESULTS.md). UCX applies these un-prefixed
  // names to the TCP transport's settings (only it has them); UCX_TCP_* in the environment
  // still wins.
  for (const auto& [name, value] :
       {std::pair<const char*, const char*>{"TX_SEG_SIZE", "64k"}, {"RX_SEG_SIZE", "128k"}}) {
    if (std::getenv(absl::StrCat("UCX_TCP_", name).c_str()) != nullptr) continue;
    status = ucp_config_modify(config.get(), name, value);
    if (status != UCS_OK) {
      return absl::InternalError(absl::StrCat("setting UCX ", name, ": ", UcsError(status)));
    }
  }
  std::string transports = options.ucx_transports;
  if (transports.empty() && std::getenv("UCX_TLS") == nullptr) transports = kDefaultTransports;
  if (!transports.empty()) {
    status = ucp_config_modify(config.get(), "TLS", transports.c_str());
    if (status != UCS_OK) {
      return absl::InvalidArgumentError(
          absl::StrCat("UCX transports \"", transports, "\": ", UcsError(status)));
    }
  }

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = "tandem-kvtransfer";
  ucp_context_h context = nullptr;
  status = ucp_init(&params, config.get(), &context);
  if (status != UCS_OK) {
    return absl::UnavailableError(absl::StrCat("ucp_init: ", UcsError(status)));
  }
  agent->context_.reset(context);

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Only the progress thread calls into the worker.
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  status = ucp_worker_create(agent->context_.get(), &worker_params, &worker);
  if (status != UCS_OK) {
    return absl::UnavailableError(absl::StrCat("ucp_worker_create: ", UcsError(status)));
  }
  agent->worker_.reset(worker);
  status = ucp_worker_get_efd(worker, &agent->worker_fd_);
  if (status != UCS_OK) {
    return absl::UnavailableError(absl::StrCat("ucp_worker_get_efd: ", UcsError(status)));
  }
  const int wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd < 0) return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  agent->wake_fd_.reset(new int(wake_fd));

  for (const auto& [id, cb] : {std::pair<unsigned, ucp_am_recv_callback_t>{kHelloAm, &OnHello},
                               {kHelloAckAm, &OnHelloAck}}) {
    ucp_am_handler_param_t am{};
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG;
    am.id = id;
    am.cb = cb;
    am.arg = agent.get();
    status = ucp_worker_set_am_recv_handler(worker, &am);
    if (status != UCS_OK) {
      return absl::InternalError(
          absl::StrCat("ucp_worker_set_am_recv_handler: ", UcsError(status)));
    }
  }

  if (options.listen_port < 0 || options.listen_port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("listen_port ", options.listen_port));
  }
  TANDEM_ASSIGN_OR_RETURN(sockaddr_storage listen_addr,
                          Resolve(options.listen_host, std::to_string(options.listen_port),
                                  /*passive=*/true));
  ucp_listener_params_t listener_params{};
  listener_params.field_mask =
      UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  listener_params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&listen_addr);
  listener_params.sockaddr.addrlen = SockaddrLength(listen_addr);
  listener_params.conn_handler.cb = &OnConnectionRequest;
  listener_params.conn_handler.arg = agent.get();
  ucp_listener_h listener = nullptr;
  status = ucp_listener_create(worker, &listener_params, &listener);
  if (status != UCS_OK) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen_host, ":",
                                               options.listen_port, ": ", UcsError(status)));
  }
  agent->listener_.reset(listener);
  ucp_listener_attr_t attr{};
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  status = ucp_listener_query(listener, &attr);
  if (status != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_listener_query: ", UcsError(status)));
  }
  const int port = attr.sockaddr.ss_family == AF_INET6
                       ? ntohs(reinterpret_cast<const sockaddr_in6*>(&attr.sockaddr)->sin6_port)
                       : ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
  const bool v6 = options.listen_host.find(':') != std::string::npos;
  agent->address_ = absl::StrFormat("%s%s%s:%d#%016x", v6 ? "[" : "", options.listen_host,
                                    v6 ? "]" : "", port, agent->instance_);

  agent->progress_thread_ = std::thread([raw = agent.get()] { raw->ProgressLoop(); });
  return agent;
}

UcxAgent::~UcxAgent() {
  if (!progress_thread_.joinable()) return;  // Create failed before starting it.
  Post([this] { Shutdown(); });
  progress_thread_.join();
}

// ---- The progress thread ----

void UcxAgent::ProgressLoop() {
  while (true) {
    RunCommands();
    while (ucp_worker_progress(worker_.get()) != 0) {
    }
    SendReplies();
    CheckDeregistrations();
    CloseEndpoints();
    if (stopping_ && to_close_.empty() && closing_.empty() && ops_.empty()) break;
    if (stopping_ && absl::Now() - stop_started_ > kShutdownGrace) {
      // UCX failed to complete requests on force-closed endpoints: report the transfers
      // cancelled and leak their bookkeeping rather than hang the destructor or let a late
      // callback touch freed memory.
      std::fprintf(stderr, "kvtransfer ucx agent %s: %zu transfers did not drain at shutdown\n",
                   name_.c_str(), ops_.size());
      for (auto& [id, op] : ops_) {
        op->state->Finish(absl::CancelledError("the agent was destroyed"));
        op.release();
      }
      break;
    }
    const ucs_status_t armed = ucp_worker_arm(worker_.get());
    if (armed == UCS_ERR_BUSY) continue;  // Events arrived meanwhile: progress again.
    // A bounded sleep: deadlines (deregistration of regions with timed-out transfers, closing
    // endpoints) are checked at least this often even when no event arrives.
    const bool busy = !ops_.empty() || !closing_.empty() || !to_close_.empty();
    pollfd fds[2] = {{*wake_fd_, POLLIN, 0}, {worker_fd_, POLLIN, 0}};
    poll(fds, armed == UCS_OK ? 2 : 1, busy ? 10 : 100);
  }
  // Nothing is in flight any more: release what is left while the worker still exists.
  listener_.reset();
  regions_.clear();
}

void UcxAgent::RunCommands() {
  uint64_t count = 0;
  [[maybe_unused]] ssize_t n = read(*wake_fd_, &count, sizeof(count));
  std::vector<std::function<void()>> commands;
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    commands.swap(queue_);
  }
  for (auto& command : commands) command();
}

void UcxAgent::Shutdown() {
  stopping_ = true;
  stop_started_ = absl::Now();
  listener_.reset();  // No new connections.
  std::vector<PeerId> ids;
  for (const auto& [id, peer] : peers_) ids.push_back(id);
  for (PeerId id : ids) FailPeer(id, absl::CancelledError("the agent was destroyed"));
  peers_.clear();
  while (!server_endpoints_.empty()) {
    auto node = server_endpoints_.extract(server_endpoints_.begin());
    CloseEndpoint(std::move(node.mapped()));
  }
  for (auto& [id, region] : regions_) {
    for (auto& waiter : region.deregister_waiters) waiter->Finish(absl::OkStatus());
    region.deregister_waiters.clear();
  }
}

void UcxAgent::SendReplies() {
  std::vector<std::pair<ucp_ep_h, HelloMessage>> replies;
  replies.swap(pending_replies_);
  for (auto& [ep, hello] : replies) {
    auto it = server_endpoints_.find(ep);
    if (it == server_endpoints_.end() || it->second->failed) continue;
    auto* message = new HelloMessage(hello);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &OnSendDone;
    param.user_data = message;
    ucs_status_ptr_t request =
        ucp_am_send_nbx(ep, kHelloAckAm, message, sizeof(*message), nullptr, 0, &param);
    if (!UCS_PTR_IS_PTR(request)) delete message;  // Done (or failed) at once.
  }
}

void UcxAgent::OnSendDone(void* request, ucs_status_t status, void* user_data) {
  delete static_cast<HelloMessage*>(user_data);
  ucp_request_free(request);
}

// ---- Connections ----

void UcxAgent::OnConnectionRequest(ucp_conn_request_h request, void* arg) {
  auto* agent = static_cast<UcxAgent*>(arg);
  auto endpoint = std::make_unique<EndpointContext>();
  endpoint->agent = agent;
  endpoint->server = true;
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.conn_request = request;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &OnEndpointError;
  params.err_handler.arg = endpoint.get();
  if (ucp_ep_create(agent->worker_.get(), &params, &endpoint->ep) != UCS_OK) {
    ucp_listener_reject(agent->listener_.get(), request);  // The client sees a refusal.
    return;
  }
  ucp_ep_h ep = endpoint->ep;
  agent->server_endpoints_[ep] = std::move(endpoint);
}

ucs_status_t UcxAgent::OnHello(void* arg, const void* header, size_t header_length, void* data,
                               size_t length, const ucp_am_recv_param_t* param) {
  auto* agent = static_cast<UcxAgent*>(arg);
  HelloMessage hello;
  if (header_length != sizeof(hello) || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    return UCS_OK;  // Not our protocol: ignore it and let the client time out.
  }
  std::memcpy(&hello, header, sizeof(hello));
  if (hello.magic != kHelloMagic) return UCS_OK;
  // Answer with our own incarnation; the client decides whether it is the one it wanted.
  HelloMessage ack;
  ack.token = hello.token;
  ack.instance = agent->instance_;
  // Replies are sent after progress returns: UCX callbacks should not start new operations.
  agent->pending_replies_.emplace_back(param->reply_ep, ack);
  return UCS_OK;
}

ucs_status_t UcxAgent::OnHelloAck(void* arg, const void* header, size_t header_length, void* data,
                                  size_t length, const ucp_am_recv_param_t* param) {
  auto* agent = static_cast<UcxAgent*>(arg);
  HelloMessage ack;
  if (header_length != sizeof(ack)) return UCS_OK;
  std::memcpy(&ack, header, sizeof(ack));
  auto it = agent->peers_.find(ack.token);
  if (ack.magic != kHelloMagic || it == agent->peers_.end() ||
      it->second.state != PeerState::kConnecting) {
    return UCS_OK;
  }
  Peer& peer = it->second;
  if (ack.instance != peer.instance) {
    agent->FailPeer(it->first, absl::UnavailableError(absl::StrFormat(
                                   "%s is served by agent incarnation %016x, not the one "
                                   "addressed (the peer restarted?)",
                                   peer.address, ack.instance)));
    return UCS_OK;
  }
  peer.state = PeerState::kConnected;
  peer.connected->Finish(absl::OkStatus());
  return UCS_OK;
}

void UcxAgent::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* endpoint = static_cast<EndpointContext*>(arg);
  UcxAgent* agent = endpoint->agent;
  if (endpoint->server) {
    auto it = agent->server_endpoints_.find(ep);
    if (it == agent->server_endpoints_.end()) return;  // Already closing.
    auto owned = std::move(it->second);
    agent->server_endpoints_.erase(it);
    owned->failed = true;
    agent->CloseEndpoint(std::move(owned));
    return;
  }
  auto it = agent->peers_.find(endpoint->peer);
  if (it == agent->peers_.end() || it->second.endpoint.get() != endpoint) return;
  agent->FailPeer(endpoint->peer,
                  absl::UnavailableError(absl::StrCat("connection to peer ", it->second.address,
                                                      " lost: ", UcsError(status))));
}

void UcxAgent::FailPeer(PeerId id, absl::Status why) {
  auto it = peers_.find(id);
  if (it == peers_.end() || it->second.state == PeerState::kFailed) return;
  Peer& peer = it->second;
  if (peer.state == PeerState::kConnecting) {
    peer.connected->Finish(absl::UnavailableError(
        absl::StrCat("cannot connect to ", peer.address, ": ", why.message())));
  }
  peer.state = PeerState::kFailed;
  peer.failure = std::move(why);
  // Closing the endpoint completes its outstanding requests with an error, so the transfers
  // posted on it finish and stop reading their regions.
  if (peer.endpoint != nullptr) CloseEndpoint(std::move(peer.endpoint));
}

void UcxAgent::CloseEndpoint(std::unique_ptr<EndpointContext> endpoint) {
  // Closed after progress returns: this may run inside a UCX callback.
  endpoint->failed = true;
  to_close_.push_back(std::move(endpoint));
}

void UcxAgent::CloseEndpoints() {
  std::vector<std::unique_ptr<EndpointContext>> endpoints;
  endpoints.swap(to_close_);
  for (auto& endpoint : endpoints) {
    // Forced: a dead or stuck peer must not hold the close up. Outstanding requests on the
    // endpoint complete with UCS_ERR_CANCELED.
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t request = ucp_ep_close_nbx(endpoint->ep, &param);
    if (UCS_PTR_IS_PTR(request)) closing_.push_back(Closing{request, std::move(endpoint)});
  }
  for (auto it = closing_.begin(); it != closing_.end();) {
    if (ucp_request_check_status(it->request) != UCS_INPROGRESS) {
      ucp_request_free(it->request);
      it = closing_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<PeerId> UcxAgent::StartConnect(const std::string& address, uint64_t instance,
                                              const sockaddr_storage& peer_addr,
                                              std::shared_ptr<TransferState> connected) {
  if (stopping_) return absl::CancelledError("the agent is being destroyed");
  const PeerId id = ++last_peer_;
  Peer& peer = peers_[id];
  peer.address = address;
  peer.instance = instance;
  peer.connected = std::move(connected);
  peer.endpoint = std::make_unique<EndpointContext>();
  peer.endpoint->agent = this;
  peer.endpoint->peer = id;

  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&peer_addr);
  params.sockaddr.addrlen = SockaddrLength(peer_addr);
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &OnEndpointError;
  params.err_handler.arg = peer.endpoint.get();
  const ucs_status_t status = ucp_ep_create(worker_.get(), &params, &peer.endpoint->ep);
  if (status != UCS_OK) {
    peers_.erase(id);
    return absl::UnavailableError(
        absl::StrCat("cannot connect to ", address, ": ", UcsError(status)));
  }

  auto* hello = new HelloMessage();
  hello->token = id;
  hello->instance = instance;
  ucp_request_param_t param{};
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &OnSendDone;
  param.user_data = hello;
  param.flags = UCP_AM_SEND_FLAG_REPLY;
  ucs_status_ptr_t request =
      ucp_am_send_nbx(peer.endpoint->ep, kHelloAm, hello, sizeof(*hello), nullptr, 0, &param);
  if (!UCS_PTR_IS_PTR(request)) delete hello;
  if (UCS_PTR_IS_ERR(request)) {
    FailPeer(id, absl::UnavailableError(UcsError(UCS_PTR_STATUS(request))));
    peers_.erase(id);
    return absl::UnavailableError(
        absl::StrCat("cannot connect to ", address, ": ", UcsError(UCS_PTR_STATUS(request))));
  }
  return id;
}

absl::StatusOr<PeerId> UcxAgent::Connect(const std::string& peer_address, absl::Time deadline) {
  TANDEM_ASSIGN_OR_RETURN(ParsedAddress parsed, ParseAddress(peer_address));
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat("connect to ", peer_address, ": deadline passed"));
  }
  TANDEM_ASSIGN_OR_RETURN(sockaddr_storage addr,
                          Resolve(parsed.host, parsed.port, /*passive=*/false));
  auto connected = std::make_shared<TransferState>(deadline);
  TANDEM_ASSIGN_OR_RETURN(PeerId id, RunOnProgressThread<absl::StatusOr<PeerId>>([&] {
                            return StartConnect(peer_address, parsed.instance, addr, connected);
                          }));
  absl::Status status = connected->Wait();
  if (status.ok()) return id;
  if (absl::IsDeadlineExceeded(status)) {
    status = absl::DeadlineExceededError(
        absl::StrCat("connect to ", peer_address, ": no answer by the deadline"));
  }
  // Forget the attempt (closing its endpoint if it is still open).
  RunOnProgressThread<bool>([&] {
    FailPeer(id, status);
    peers_.erase(id);
    return true;
  });
  return status;
}

absl::Status UcxAgent::Disconnect(PeerId peer) {
  return RunOnProgressThread<absl::Status>([&]() -> absl::Status {
    if (peers_.count(peer) == 0) return absl::NotFoundError(absl::StrCat("no peer ", peer));
    FailPeer(peer, absl::CancelledError(absl::StrCat("peer ", peer, " was disconnected")));
    peers_.erase(peer);
    return absl::OkStatus();
  });
}

// ---- Memory ----

absl::StatusOr<std::string> UcxAgent::RegisterMemory(uint64_t region_id, void* base, size_t bytes) {
  if (base == nullptr || bytes == 0) {
    return absl::InvalidArgumentError("RegisterMemory: a region needs a base and a size");
  }
  if (base != nullptr && internal::IsDeviceMemory(base)) {
    return absl::InvalidArgumentError(
        "RegisterMemory: ucx/local kv backends need a host KV cache; this is CUDA device "
        "memory (use the cuda_ipc backend, or run the engine with --device cpu)");
  }
  return RunOnProgressThread<absl::StatusOr<std::string>>([&]() -> absl::StatusOr<std::string> {
    if (regions_.count(region_id) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("region ", region_id, " is registered"));
    }
    ucp_mem_map_params_t params{};
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = base;
    params.length = bytes;
    ucp_mem_h memh = nullptr;
    ucs_status_t status = ucp_mem_map(context_.get(), &params, &memh);
    if (status != UCS_OK) {
      return absl::InternalError(absl::StrCat("ucp_mem_map: ", UcsError(status)));
    }
    MemPtr mem(memh, MemDeleter{context_.get()});
    void* rkey_buffer = nullptr;
    size_t rkey_bytes = 0;
    status = ucp_rkey_pack(context_.get(), memh, &rkey_buffer, &rkey_bytes);
    if (status != UCS_OK) {
      return absl::InternalError(absl::StrCat("ucp_rkey_pack: ", UcsError(status)));
    }
    std::unique_ptr<void, RkeyBufferDeleter> packed(rkey_buffer);
    RegionDescriptor d{.backend = BackendKind::kUcx,
                       .owner_instance = instance_,
                       .region_id = region_id,
                       .generation = ++last_generation_,
                       .base = reinterpret_cast<uintptr_t>(base),
                       .bytes = bytes,
                       .payload = std::string(static_cast<const char*>(rkey_buffer), rkey_bytes)};
    LocalRegion& region = regions_[region_id];
    region.base = static_cast<char*>(base);
    region.bytes = bytes;
    region.generation = d.generation;
    region.memh = std::move(mem);
    return internal::EncodeDescriptor(d);
  });
}

absl::Status UcxAgent::DeregisterMemory(uint64_t region_id) {
  auto done = std::make_shared<TransferState>(absl::InfiniteFuture());
  TANDEM_RETURN_IF_ERROR(RunOnProgressThread<absl::Status>([&]() -> absl::Status {
    auto it = regions_.find(region_id);
    if (it == regions_.end() || it->second.closing) {
      return absl::NotFoundError(absl::StrCat("region ", region_id, " is not registered"));
    }
    it->second.closing = true;
    it->second.deregister_waiters.push_back(done);
    FinishDeregistration(region_id);  // At once if nothing reads it.
    return absl::OkStatus();
  }));
  return done->Wait();
}

void UcxAgent::FinishDeregistration(uint64_t region_id) {
  auto it = regions_.find(region_id);
  if (it == regions_.end() || !it->second.closing || it->second.ops != 0) return;
  std::vector<std::shared_ptr<TransferState>> waiters = std::move(it->second.deregister_waiters);
  regions_.erase(it);  // Unmaps the memory.
  for (auto& waiter : waiters) waiter->Finish(absl::OkStatus());
}

void UcxAgent::CheckDeregistrations() {
  // A region being deregistered waits for its transfers; one past its deadline is abandoned by
  // its caller, so its connection is closed to stop UCX reading the region.
  const absl::Time now = absl::Now();
  std::vector<PeerId> to_fail;
  for (const auto& [id, op] : ops_) {
    auto region = regions_.find(op->region_id);
    if (region != regions_.end() && region->second.closing && now >= op->state->deadline()) {
      to_fail.push_back(op->peer);
    }
  }
  for (PeerId peer : to_fail) {
    FailPeer(peer, absl::UnavailableError(
                       "connection closed to cancel a timed-out transfer from a region being "
                       "deregistered"));
  }
}

// ---- Transfers ----

absl::StatusOr<std::unique_ptr<TransferHandle>> UcxAgent::Submit(
    PeerId peer, uint64_t local_region_id, const std::string& remote_descriptor,
    std::vector<Range> ranges, absl::Time deadline) {
  TANDEM_ASSIGN_OR_RETURN(RegionDescriptor d,
                          internal::DecodeDescriptor(remote_descriptor, BackendKind::kUcx));
  return RunOnProgressThread<absl::StatusOr<std::unique_ptr<TransferHandle>>>(
      [&] { return StartTransfer(peer, local_region_id, d, ranges, deadline); });
}

absl::StatusOr<std::unique_ptr<TransferHandle>> UcxAgent::StartTransfer(
    PeerId peer_id, uint64_t region_id, const RegionDescriptor& d, const std::vector<Range>& ranges,
    absl::Time deadline) {
  auto peer_it = peers_.find(peer_id);
  if (peer_it == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", peer_id));
  Peer& peer = peer_it->second;
  if (peer.state == PeerState::kFailed) return peer.failure;
  if (d.owner_instance != peer.instance) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "descriptor belongs to agent %016x, not to peer %s", d.owner_instance, peer.address));
  }
  auto region_it = regions_.find(region_id);
  if (region_it == regions_.end() || region_it->second.closing) {
    return absl::NotFoundError(absl::StrCat("local region ", region_id, " is not registered"));
  }
  LocalRegion& region = region_it->second;
  TANDEM_RETURN_IF_ERROR(internal::CheckRanges(ranges, region.bytes, d.bytes));
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError("Submit: the deadline has already passed");
  }
  ucp_ep_h ep = peer.endpoint->ep;
  ucp_rkey_h rkey = nullptr;
  const ucs_status_t unpacked = ucp_ep_rkey_unpack(ep, d.payload.data(), &rkey);
  if (unpacked != UCS_OK) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptor holds an unusable remote key: ", UcsError(unpacked)));
  }

  auto state = std::make_shared<TransferState>(deadline);
  auto owned = std::make_unique<Op>();
  Op* op = owned.get();
  op->agent = this;
  op->id = ++last_op_;
  op->state = state;
  op->peer = peer_id;
  op->region_id = region_id;
  op->rkey.reset(rkey);
  ops_[op->id] = std::move(owned);
  ++region.ops;

  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &OnOpRequestDone;
  param.user_data = op;
  const auto track = [&](ucs_status_ptr_t request) {
    if (UCS_PTR_IS_ERR(request)) {
      op->error = UCS_PTR_STATUS(request);
    } else if (request != nullptr) {
      ++op->outstanding;
    }
  };
  for (const Range& r : internal::CoalesceRanges(ranges)) {
    track(
        ucp_put_nbx(ep, region.base + r.src_offset, r.bytes, d.base + r.dst_offset, rkey, &param));
    if (op->error != UCS_OK) break;
  }
  // The flush completes once every put before it is complete at the destination.
  if (op->error == UCS_OK) track(ucp_ep_flush_nbx(ep, &param));
  op->posted = true;
  MaybeFinishOp(op);
  return std::make_unique<internal::StateHandle>(std::move(state));
}

void UcxAgent::OnOpRequestDone(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  ucp_request_free(request);
  op->agent->OnRequestDone(op, status);
}

void UcxAgent::OnRequestDone(Op* op, ucs_status_t status) {
  --op->outstanding;
  if (status != UCS_OK && op->error == UCS_OK) op->error = status;
  MaybeFinishOp(op);
}

void UcxAgent::MaybeFinishOp(Op* op) {
  if (!op->posted || op->outstanding > 0) return;
  absl::Status result;
  if (op->error != UCS_OK) {
    auto peer = peers_.find(op->peer);
    if (peer != peers_.end() && peer->second.state == PeerState::kFailed) {
      result = peer->second.failure;  // Says why: peer lost, disconnected, agent destroyed.
    } else if (op->error == UCS_ERR_CANCELED) {
      result = absl::CancelledError("transfer cancelled: its connection was closed");
    } else {
      result = absl::UnavailableError(absl::StrCat("transfer failed: ", UcsError(op->error)));
    }
  }
  op->state->Finish(std::move(result));
  const uint64_t region_id = op->region_id;
  auto region = regions_.find(region_id);
  if (region != regions_.end()) --region->second.ops;
  ops_.erase(op->id);  // Destroys the remote key.
  FinishDeregistration(region_id);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Agent>> CreateUcxAgent(const AgentOptions& options) {
  return UcxAgent::Create(options);
}

}  // namespace tandem::kvtransfer::ucx
