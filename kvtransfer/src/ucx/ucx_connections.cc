// The ucx agent's connections: parsing and resolving addresses, the listener's callbacks, the
// hello handshake, endpoint errors and closes, Connect and Disconnect.
#include <netdb.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvtransfer/src/internal.h"
#include "kvtransfer/src/ucx/ucx_agent_impl.h"
#include "tandem/base/status_macros.h"

namespace tandem::kvtransfer::ucx::detail {
namespace {

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

}  // namespace

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
  for (auto& [op_id, op] : ops_) {
    if (op->peer == id && op->closed_because.ok()) op->closed_because = why;
  }
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

}  // namespace tandem::kvtransfer::ucx::detail
