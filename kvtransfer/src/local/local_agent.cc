#include "kvtransfer/src/local/local_agent.h"

#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvtransfer/src/internal.h"
#include "tandem/base/status_macros.h"
#include "tandem/base/tsan.h"

namespace tandem::kvtransfer::local {
namespace {

using internal::BackendKind;
using internal::RegionDescriptor;

// The regions of one agent. Peers hold it weakly, so a destroyed agent is seen as gone.
class RegionTable {
 public:
  struct Pinned {
    char* base = nullptr;  // The owner's memory; valid while pinned.
    uint64_t bytes = 0;
  };

  explicit RegionTable(uint64_t instance) : instance_(instance) {}

  uint64_t instance() const { return instance_; }

  absl::StatusOr<RegionDescriptor> Add(uint64_t region_id, void* base, uint64_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (regions_.count(region_id) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("region ", region_id, " is registered"));
    }
    Region& region = regions_[region_id];
    region.base = static_cast<char*>(base);
    region.bytes = bytes;
    region.generation = ++last_generation_;
    return RegionDescriptor{.backend = BackendKind::kLocal,
                            .owner_instance = instance_,
                            .region_id = region_id,
                            .generation = region.generation,
                            .base = reinterpret_cast<uintptr_t>(base),
                            .bytes = bytes,
                            .payload = {}};
  }

  // Refuses new pins of the region, waits for the current ones to end, then forgets it.
  absl::Status Remove(uint64_t region_id) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = regions_.find(region_id);
    if (it == regions_.end() || it->second.closing) {
      return absl::NotFoundError(absl::StrCat("region ", region_id, " is not registered"));
    }
    it->second.closing = true;
    cv_.wait(lock, [&] { return it->second.pins == 0; });
    regions_.erase(it);
    return absl::OkStatus();
  }

  // Closes the table for good (the agent is being destroyed) and waits for every pin to end.
  void Close() {
    std::unique_lock<std::mutex> lock(mu_);
    closed_ = true;
    cv_.wait(lock, [&] {
      for (const auto& [id, region] : regions_) {
        if (region.pins != 0) return false;
      }
      return true;
    });
  }

  // Pins a local region for reading.
  absl::StatusOr<Pinned> PinLocal(uint64_t region_id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(region_id);
    if (closed_ || it == regions_.end() || it->second.closing) {
      return absl::NotFoundError(absl::StrCat("local region ", region_id, " is not registered"));
    }
    ++it->second.pins;
    return Pinned{it->second.base, it->second.bytes};
  }

  // Pins the region a descriptor names for writing, if it is still that registration: the
  // receiver's own table is the authority here, not the descriptor.
  absl::StatusOr<Pinned> PinRemote(const RegionDescriptor& d, const std::string& peer) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return absl::UnavailableError(absl::StrCat("peer ", peer, " is gone"));
    auto it = regions_.find(d.region_id);
    if (it == regions_.end() || it->second.closing || it->second.generation != d.generation ||
        reinterpret_cast<uintptr_t>(it->second.base) != d.base || it->second.bytes != d.bytes) {
      return absl::FailedPreconditionError(
          absl::StrCat("descriptor of region ", d.region_id, " of peer ", peer,
                       " is stale: that registration no longer exists"));
    }
    ++it->second.pins;
    return Pinned{it->second.base, it->second.bytes};
  }

  void Unpin(uint64_t region_id) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      --regions_.at(region_id).pins;
    }
    cv_.notify_all();
  }

 private:
  struct Region {
    char* base = nullptr;
    uint64_t bytes = 0;
    uint64_t generation = 0;
    int pins = 0;
    bool closing = false;
  };

  const uint64_t instance_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool closed_ = false;
  uint64_t last_generation_ = 0;
  std::map<uint64_t, Region> regions_;
};

// Agents of this process by address.
std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::map<std::string, std::weak_ptr<RegionTable>>& Registry() {
  static auto* registry = new std::map<std::string, std::weak_ptr<RegionTable>>();
  return *registry;
}

class LocalAgent : public Agent {
 public:
  explicit LocalAgent(const AgentOptions& options)
      : table_(std::make_shared<RegionTable>(internal::NewInstanceId())),
        address_(absl::StrFormat("local:%s#%016x", options.name, table_->instance())) {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    Registry()[address_] = table_;
  }

  ~LocalAgent() override {
    {
      std::lock_guard<std::mutex> lock(RegistryMutex());
      Registry().erase(address_);
    }
    table_->Close();
  }

  absl::StatusOr<std::string> RegisterMemory(uint64_t region_id, void* base,
                                             size_t bytes) override {
    if (base == nullptr && bytes != 0) {
      return absl::InvalidArgumentError("RegisterMemory: null base with a non-zero size");
    }
    if (base != nullptr && internal::IsDeviceMemory(base)) {
      return absl::InvalidArgumentError(
          "RegisterMemory: ucx/local kv backends need a host KV cache; this is CUDA device "
          "memory (use the cuda_ipc backend, or run the engine with --device cpu)");
    }
    TANDEM_ASSIGN_OR_RETURN(RegionDescriptor d, table_->Add(region_id, base, bytes));
    return internal::EncodeDescriptor(d);
  }

  absl::Status DeregisterMemory(uint64_t region_id) override { return table_->Remove(region_id); }

  std::string address() const override { return address_; }

  absl::StatusOr<PeerId> Connect(const std::string& peer_address, absl::Time deadline) override {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("connect to ", peer_address, ": deadline passed"));
    }
    std::shared_ptr<RegionTable> table;
    {
      std::lock_guard<std::mutex> lock(RegistryMutex());
      auto it = Registry().find(peer_address);
      if (it != Registry().end()) table = it->second.lock();
    }
    if (table == nullptr) {
      return absl::UnavailableError(absl::StrCat("no local agent at \"", peer_address, "\""));
    }
    std::lock_guard<std::mutex> lock(mu_);
    const PeerId id = ++last_peer_;
    peers_[id] = Peer{peer_address, table};
    return id;
  }

  absl::Status Disconnect(PeerId peer) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (peers_.erase(peer) == 0) return absl::NotFoundError(absl::StrCat("no peer ", peer));
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<TransferHandle>> Submit(PeerId peer, uint64_t local_region_id,
                                                         const std::string& remote_descriptor,
                                                         std::vector<Range> ranges,
                                                         absl::Time deadline) override {
    TANDEM_ASSIGN_OR_RETURN(RegionDescriptor d,
                            internal::DecodeDescriptor(remote_descriptor, BackendKind::kLocal));
    Peer target;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", peer));
      target = it->second;
    }
    std::shared_ptr<RegionTable> remote = target.table.lock();
    if (remote == nullptr) {
      return absl::UnavailableError(absl::StrCat("peer ", target.address, " is gone"));
    }
    if (d.owner_instance != remote->instance()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "descriptor belongs to agent %016x, not to peer %s", d.owner_instance, target.address));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError("Submit: the deadline has already passed");
    }
    TANDEM_ASSIGN_OR_RETURN(RegionTable::Pinned src, table_->PinLocal(local_region_id));
    absl::StatusOr<RegionTable::Pinned> dst = remote->PinRemote(d, target.address);
    if (!dst.ok()) {
      table_->Unpin(local_region_id);
      return dst.status();
    }
    absl::Status status = internal::CheckRanges(ranges, src.bytes, dst->bytes);
    if (status.ok()) status = Copy(src, *dst, ranges, deadline);
    remote->Unpin(d.region_id);
    table_->Unpin(local_region_id);
    if (absl::IsInvalidArgument(status)) return status;  // Refused: nothing was written.
    return internal::FinishedHandle(std::move(status));
  }

 private:
  struct Peer {
    std::string address;
    std::weak_ptr<RegionTable> table;
  };

  static absl::Status Copy(const RegionTable::Pinned& src, const RegionTable::Pinned& dst,
                           const std::vector<Range>& ranges, absl::Time deadline) {
    for (const Range& r : ranges) {
      // Checked between ranges: one range is never longer than a memcpy of its bytes.
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError("transfer not complete by its deadline");
      }
      // memmove: an agent may push into its own region, overlapping the source.
      std::memmove(dst.base + r.dst_offset, src.base + r.src_offset, r.bytes);
    }
    TsanRelease(dst.base);  // the receiver acquires it (AcquireTransferred)
    return absl::OkStatus();
  }

  const std::shared_ptr<RegionTable> table_;
  const std::string address_;
  std::mutex mu_;
  PeerId last_peer_ = 0;
  std::map<PeerId, Peer> peers_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Agent>> CreateLocalAgent(const AgentOptions& options) {
  return std::make_unique<LocalAgent>(options);
}

}  // namespace tandem::kvtransfer::local
