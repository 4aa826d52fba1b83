#include "tandem/worker/kv_endpoint.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "tandem/base/status_macros.h"
#include "tandem/proto/wire.h"
#include "tandem/proto/kv_layout_check.h"

namespace tandem::worker {
namespace {
// The region id of the whole KV cache in the agent.
constexpr uint64_t kCacheRegion = 0;
}  // namespace

absl::StatusOr<std::unique_ptr<KvEndpoint>> KvEndpoint::Create(const Options& options,
                                                               engine::LlmEngine& engine) {
  return Create(options, engine.config(), engine.cache_layout(), /*tp_rank=*/0,
                engine.kv_cache());
}

absl::StatusOr<std::unique_ptr<KvEndpoint>> KvEndpoint::Create(
    const Options& options, const text::ModelConfig& config,
    const engine::KvCacheLayout& cache_layout, int tp_rank, void* cache) {
  std::unique_ptr<KvEndpoint> endpoint(new KvEndpoint());
  endpoint->options_ = options;
  endpoint->layout_ = proto::EngineKvLayout(config, cache_layout.block_size, cache_layout.dtype,
                                             cache_layout.tp_size, tp_rank,
                                             cache_layout.kv_head_begin, cache_layout.num_kv_heads);
  endpoint->cache_layout_ = cache_layout;
  kvtransfer::AgentOptions agent_options;
  agent_options.backend = options.backend;
  agent_options.name = options.name;
  agent_options.listen_host = options.listen_host;
  TANDEM_ASSIGN_OR_RETURN(endpoint->agent_, kvtransfer::Agent::Create(agent_options));
  TANDEM_ASSIGN_OR_RETURN(
      endpoint->descriptor_,
      endpoint->agent_->RegisterMemory(kCacheRegion, cache, cache_layout.total_bytes()));
  endpoint->registered_ = true;
  return endpoint;
}

KvEndpoint::~KvEndpoint() { Close(); }

tandem::v1::TransferEndpoint KvEndpoint::Describe() const {
  tandem::v1::TransferEndpoint endpoint;
  endpoint.set_backend(options_.backend);
  endpoint.set_address(agent_->address());
  endpoint.add_region_descriptors(descriptor_);
  endpoint.set_num_blocks(cache_layout_.num_blocks);
  *endpoint.mutable_layout() = layout_;
  for (const tandem::v1::TransferEndpoint& rank : group_) *endpoint.add_tp_ranks() = rank;
  return endpoint;
}

absl::StatusOr<tandem::v1::HandshakeResponse> KvEndpoint::Handshake(
    const tandem::v1::HandshakeRequest& request, const std::string& worker_id,
    bool this_side_sends) const {
  absl::Status compatible = this_side_sends
                                ? proto::CheckLayoutCompatible(layout_, request.layout())
                                : proto::CheckLayoutCompatible(request.layout(), layout_);
  if (!compatible.ok()) {
    const std::string& sender = this_side_sends ? worker_id : request.worker_id();
    const std::string& receiver = this_side_sends ? request.worker_id() : worker_id;
    return absl::Status(compatible.code(),
                        absl::StrCat(std::string(compatible.message()), " (worker ", sender, " -> ",
                                     receiver, ")"));
  }
  tandem::v1::HandshakeResponse response;
  response.set_worker_id(worker_id);
  *response.mutable_layout() = layout_;
  return response;
}

absl::Status KvEndpoint::CheckReceiver(const tandem::v1::TransferEndpoint& endpoint,
                                       const std::string& name) const {
  return proto::CheckTransferEndpoint(layout_, options_.backend, endpoint, name,
                                      absl::StrCat("this ", options_.role, " worker"));
}

absl::StatusOr<kvtransfer::PeerId> KvEndpoint::Peer(const std::string& address, absl::Time deadline,
                                                    bool fresh) {
  std::optional<kvtransfer::PeerId> stale;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(address);
    if (it != peers_.end()) {
      if (!fresh) return it->second;
      stale = it->second;
      peers_.erase(it);
    }
  }
  if (stale.has_value()) agent_->Disconnect(*stale).IgnoreError();
  // Connect without holding the lock: a slow peer must not hold up connections to others.
  TANDEM_ASSIGN_OR_RETURN(kvtransfer::PeerId peer, agent_->Connect(address, deadline));
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto [it, inserted] = peers_.emplace(address, peer);
  if (!inserted && it->second != peer) {
    // Another call connected at the same time: use one connection.
    agent_->Disconnect(peer).IgnoreError();
  }
  return it->second;
}

bool KvEndpoint::Connected(const std::string& address) const {
  std::lock_guard<std::mutex> lock(peers_mu_);
  return peers_.count(address) > 0;
}

void KvEndpoint::DropPeer(const std::string& address, kvtransfer::PeerId peer) {
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = peers_.find(address);
    if (it == peers_.end() || it->second != peer) return;
    peers_.erase(it);
  }
  agent_->Disconnect(peer).IgnoreError();
}

absl::StatusOr<std::unique_ptr<kvtransfer::TransferHandle>> KvEndpoint::Push(
    kvtransfer::PeerId peer, const std::string& descriptor, std::vector<kvtransfer::Range> ranges,
    absl::Time deadline) {
  return agent_->Submit(peer, kCacheRegion, descriptor, std::move(ranges), deadline);
}

void KvEndpoint::Close() {
  if (agent_ == nullptr) return;
  if (registered_) {
    // Returns once no posted transfer reads the cache any more.
    agent_->DeregisterMemory(kCacheRegion).IgnoreError();
    registered_ = false;
  }
  agent_.reset();
}

}  // namespace tandem::worker
