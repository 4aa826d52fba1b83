// The ucx agent's core: UCP setup and the listener, the progress thread that owns every UCX
// call, memory registration and transfers (connections are in ucx_connections.cc).
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
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvtransfer/src/internal.h"
#include "kvtransfer/src/ucx/ucx_agent_impl.h"
#include "tandem/base/status_macros.h"

namespace tandem::kvtransfer::ucx {
namespace detail {

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
    // Transfers in flight at shutdown get kShutdownDrain to finish before the endpoints are
    // force-closed: a put cut off by a closed endpoint can make the receiving UCX (1.13, TCP)
    // abort its whole process while it answers that put ("Endpoint timeout").
    if (stopping_ && !endpoints_closed_ &&
        (ops_.empty() || absl::Now() - stop_started_ > kShutdownDrain)) {
      CloseAllEndpoints();
      continue;
    }
    if (stopping_ && endpoints_closed_ && to_close_.empty() && closing_.empty() && ops_.empty()) {
      break;
    }
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
}

void UcxAgent::CloseAllEndpoints() {
  endpoints_closed_ = true;
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
    // FailPeer stamps every op of a peer it fails, and a failed peer takes no new op.
    if (!op->closed_because.ok()) {
      result = op->closed_because;  // Says why: peer lost, disconnected, agent destroyed.
    } else {
      // UCX gave the requests up before the endpoint's error handler ran (a peer that died
      // completes them with UCS_ERR_CANCELED too): the connection is lost.
      result = absl::UnavailableError(
          absl::StrCat("transfer failed: connection to the peer lost: ", UcsError(op->error)));
    }
  }
  op->state->Finish(std::move(result));
  const uint64_t region_id = op->region_id;
  auto region = regions_.find(region_id);
  if (region != regions_.end()) --region->second.ops;
  ops_.erase(op->id);  // Destroys the remote key.
  FinishDeregistration(region_id);
}

}  // namespace detail

absl::StatusOr<std::unique_ptr<Agent>> CreateUcxAgent(const AgentOptions& options) {
  return detail::UcxAgent::Create(options);
}

}  // namespace tandem::kvtransfer::ucx
