#include "kvtransfer/src/cuda_ipc/cuda_ipc_agent.h"

#include <cuda_runtime.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvtransfer/src/cuda_error.h"
#include "kvtransfer/src/internal.h"
#include "kvtransfer/src/socket_io.h"
#include "tandem/base/status_macros.h"

namespace tandem::kvtransfer {

namespace internal {
bool IsDeviceMemory(const void* base) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, base) != cudaSuccess) {
    cudaGetLastError();  // not sticky; clear it so it is not reported by a later call
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice;
}
}  // namespace internal

namespace cuda_ipc {
namespace {

using internal::BackendKind;
using internal::CudaError;
using internal::CudaIpcPayload;
using internal::HungUp;
using internal::ReadFully;
using internal::RegionDescriptor;
using internal::UniqueFd;
using internal::WriteFully;

// Makes `device` the calling thread's current device: the agent queues copies on its stream,
// opens peers' handles and waits on its events from whichever thread submits and from its own
// completion thread, and the current device is a per-thread setting (GPU 0 unless set).
absl::Status UseDevice(int device) {
  int current = -1;
  if (cudaGetDevice(&current) == cudaSuccess && current == device) return absl::OkStatus();
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return CudaError(e, "cudaSetDevice");
  }
  return absl::OkStatus();
}

// The hello each side sends once connected: magic, the instance (the connector: the one it
// expects; the listener: its own), and the sender's process id.
constexpr uint64_t kHelloMagic = 0x31434950494d4454ull;  // "TDMIPIC1"
constexpr size_t kHelloBytes = 24;
// How often the completion thread looks at events, deadlines and peers while transfers are in
// flight.
constexpr absl::Duration kPollInterval = absl::Microseconds(50);

// The abstract-namespace socket of the agent incarnation `instance`.
sockaddr_un SocketAddress(uint64_t instance, socklen_t* length) {
  const std::string name = absl::StrFormat("tandem-cuda-ipc-%016x", instance);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path + 1, name.data(), name.size());  // sun_path[0] = 0: abstract
  *length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return address;
}

std::string Hello(uint64_t instance) {
  std::string out(kHelloBytes, '\0');
  const uint64_t words[3] = {kHelloMagic, instance, static_cast<uint64_t>(getpid())};
  std::memcpy(out.data(), words, sizeof(words));
  return out;
}

// "cuda_ipc:NAME#INSTANCE" -> INSTANCE.
absl::StatusOr<uint64_t> ParseAddress(const std::string& address) {
  const size_t hash = address.rfind('#');
  uint64_t instance = 0;
  if (address.rfind("cuda_ipc:", 0) != 0 || hash == std::string::npos ||
      !absl::SimpleHexAtoi(address.substr(hash + 1), &instance) || instance == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", address, "\" is not a cuda_ipc address (cuda_ipc:NAME#INSTANCE)"));
  }
  return instance;
}

// A connection made by Connect. Shared with the transfers posted on it; the memory of the
// peer's regions opened through it is closed when the last of them is done.
struct Peer {
  std::string address;
  uint64_t instance = 0;
  uint64_t pid = 0;
  UniqueFd fd;
  std::atomic<bool> disconnected{false};
  std::mutex mu;
  // (region id, generation) -> the peer's allocation mapped into this process.
  std::map<std::pair<uint64_t, uint64_t>, void*> opened;

  ~Peer() {
    for (const auto& [key, ptr] : opened) cudaIpcCloseMemHandle(ptr);
  }
};

class CudaIpcAgent : public Agent {
 public:
  CudaIpcAgent(const AgentOptions& options, int device, cudaStream_t stream, UniqueFd listener,
               UniqueFd wake_read, UniqueFd wake_write, uint64_t instance)
      : device_(device),
        stream_(stream),
        instance_(instance),
        address_(absl::StrFormat("cuda_ipc:%s#%016x", options.name, instance)),
        listener_(std::move(listener)),
        wake_read_(std::move(wake_read)),
        wake_write_(std::move(wake_write)) {
    accept_thread_ = std::thread([this] { AcceptLoop(); });
    completion_thread_ = std::thread([this] { CompletionLoop(); });
  }

  ~CudaIpcAgent() override {
    // Peers' handles are closed, and the stream destroyed, on the agent's GPU.
    (void)UseDevice(device_);
    // Stop answering peers (their connections hang up, so they see this agent as gone).
    const char byte = 1;
    (void)!write(wake_write_.get(), &byte, 1);
    accept_thread_.join();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      peers_.clear();
    }
    cv_.notify_all();
    completion_thread_.join();  // fails what is in flight with Cancelled, waits for the copies
    cudaStreamDestroy(stream_);
  }

  absl::StatusOr<std::string> RegisterMemory(uint64_t region_id, void* base,
                                             size_t bytes) override {
    if (base == nullptr || bytes == 0) {
      return absl::InvalidArgumentError("RegisterMemory: a region needs a base and a size");
    }
    if (!internal::IsDeviceMemory(base)) {
      return absl::InvalidArgumentError(
          "RegisterMemory: cuda_ipc registers CUDA device memory only (this is host memory; use "
          "the ucx or local backend)");
    }
    cudaIpcMemHandle_t handle;
    if (cudaError_t e = cudaIpcGetMemHandle(&handle, base); e != cudaSuccess) {
      return CudaError(e, "cudaIpcGetMemHandle (base must start a cudaMalloc allocation)");
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (regions_.count(region_id) != 0) {
      return absl::AlreadyExistsError(absl::StrCat("region ", region_id, " is registered"));
    }
    Region& region = regions_[region_id];
    region.base = static_cast<char*>(base);
    region.bytes = bytes;
    region.generation = ++last_generation_;
    return internal::EncodeDescriptor(RegionDescriptor{
        .backend = BackendKind::kCudaIpc,
        .owner_instance = instance_,
        .region_id = region_id,
        .generation = region.generation,
        .base = reinterpret_cast<uintptr_t>(base),
        .bytes = bytes,
        .payload = internal::EncodeCudaIpcPayload(
            {.handle = std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)),
             .pid = static_cast<uint64_t>(getpid()),
             .device = device_})});
  }

  // Waits for the copies that read the region. A device-to-device copy needs nothing from the
  // peer to finish, so this is bounded by the GPU, not by the peer.
  absl::Status DeregisterMemory(uint64_t region_id) override {
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

  std::string address() const override { return address_; }

  absl::StatusOr<PeerId> Connect(const std::string& peer_address, absl::Time deadline) override {
    TANDEM_ASSIGN_OR_RETURN(uint64_t instance, ParseAddress(peer_address));
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("connect to ", peer_address, ": deadline passed"));
    }
    UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (fd.get() < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
    socklen_t length = 0;
    const sockaddr_un address = SocketAddress(instance, &length);
    if (connect(fd.get(), reinterpret_cast<const sockaddr*>(&address), length) != 0) {
      return absl::UnavailableError(absl::StrCat("no cuda_ipc agent at \"", peer_address,
                                                 "\" on this node: ", std::strerror(errno)));
    }
    TANDEM_RETURN_IF_ERROR(WriteFully(fd.get(), Hello(instance), "handshake"));
    char reply[kHelloBytes];
    if (absl::Status s = ReadFully(fd.get(), reply, kHelloBytes, deadline, "handshake"); !s.ok()) {
      if (absl::IsDeadlineExceeded(s)) return s;
      return absl::UnavailableError(absl::StrCat("connect to ", peer_address, ": ", s.message()));
    }
    uint64_t words[3];
    std::memcpy(words, reply, sizeof(words));
    if (words[0] != kHelloMagic || words[1] != instance) {
      return absl::UnavailableError(
          absl::StrCat("connect to ", peer_address, ": another agent incarnation answered"));
    }
    auto peer = std::make_shared<Peer>();
    peer->address = peer_address;
    peer->instance = instance;
    peer->pid = words[2];
    peer->fd = std::move(fd);
    std::lock_guard<std::mutex> lock(mu_);
    const PeerId id = ++last_peer_;
    peers_[id] = std::move(peer);
    return id;
  }

  absl::Status Disconnect(PeerId peer) override {
    // The peer's opened handles may be closed here, when no transfer still holds it.
    (void)UseDevice(device_);
    std::shared_ptr<Peer> gone;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(peer);
      if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", peer));
      gone = std::move(it->second);
      peers_.erase(it);
    }
    gone->disconnected = true;  // its transfers in flight finish with Cancelled
    cv_.notify_all();
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<TransferHandle>> Submit(PeerId peer_id, uint64_t local_region_id,
                                                         const std::string& remote_descriptor,
                                                         std::vector<Range> ranges,
                                                         absl::Time deadline) override {
    TANDEM_ASSIGN_OR_RETURN(RegionDescriptor d,
                            internal::DecodeDescriptor(remote_descriptor, BackendKind::kCudaIpc));
    TANDEM_ASSIGN_OR_RETURN(CudaIpcPayload payload, internal::DecodeCudaIpcPayload(d.payload));
    std::shared_ptr<Peer> peer;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = peers_.find(peer_id);
      if (it == peers_.end()) return absl::NotFoundError(absl::StrCat("no peer ", peer_id));
      peer = it->second;
    }
    if (HungUp(peer->fd.get())) {
      return absl::UnavailableError(absl::StrCat("peer ", peer->address, " is gone"));
    }
    if (d.owner_instance != peer->instance || payload.pid != peer->pid) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "descriptor belongs to agent %016x, not to peer %s", d.owner_instance, peer->address));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError("Submit: the deadline has already passed");
    }
    char* src = nullptr;
    uint64_t src_bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = regions_.find(local_region_id);
      if (it == regions_.end() || it->second.closing) {
        return absl::NotFoundError(
            absl::StrCat("local region ", local_region_id, " is not registered"));
      }
      src = it->second.base;
      src_bytes = it->second.bytes;
      ++it->second.pins;
    }
    absl::StatusOr<std::unique_ptr<TransferHandle>> handle =
        Post(peer, d, payload, local_region_id, src, src_bytes, ranges, deadline);
    if (!handle.ok()) Unpin(local_region_id);
    return handle;
  }

 private:
  struct Region {
    char* base = nullptr;  // device memory, the caller's
    uint64_t bytes = 0;
    uint64_t generation = 0;
    int pins = 0;  // transfers whose copies may still read it
    bool closing = false;
  };

  // A transfer whose copies are queued: finished when its event fires (or earlier by a deadline,
  // a hang-up or a disconnect, but its region stays pinned until the copies are done).
  struct Pending {
    std::shared_ptr<internal::TransferState> state;
    cudaEvent_t done = nullptr;
    uint64_t region_id = 0;
    std::shared_ptr<Peer> peer;
  };

  // Queues the copies of a pinned, checked region. On error nothing is queued.
  absl::StatusOr<std::unique_ptr<TransferHandle>> Post(const std::shared_ptr<Peer>& peer,
                                                       const RegionDescriptor& d,
                                                       const CudaIpcPayload& payload,
                                                       uint64_t region_id, char* src,
                                                       uint64_t src_bytes,
                                                       const std::vector<Range>& ranges,
                                                       absl::Time deadline) {
    // First, so that a peer dropped on an early return closes its handles on this GPU too.
    TANDEM_RETURN_IF_ERROR(UseDevice(device_));
    TANDEM_RETURN_IF_ERROR(internal::CheckRanges(ranges, src_bytes, d.bytes));
    TANDEM_ASSIGN_OR_RETURN(char* dst, RemoteBase(*peer, d, payload));
    cudaEvent_t event = nullptr;
    if (cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming); e != cudaSuccess) {
      return CudaError(e, "cudaEventCreate");
    }
    for (const Range& r : internal::CoalesceRanges(ranges)) {
      const cudaError_t e = cudaMemcpyAsync(dst + r.dst_offset, src + r.src_offset, r.bytes,
                                            cudaMemcpyDeviceToDevice, stream_);
      if (e != cudaSuccess) {
        // Copies already queued may still run: wait for them before the region is unpinned.
        cudaStreamSynchronize(stream_);
        cudaEventDestroy(event);
        return CudaError(e, "cudaMemcpyAsync");
      }
    }
    if (cudaError_t e = cudaEventRecord(event, stream_); e != cudaSuccess) {
      cudaStreamSynchronize(stream_);
      cudaEventDestroy(event);
      return CudaError(e, "cudaEventRecord");
    }
    auto state = std::make_shared<internal::TransferState>(deadline);
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back({state, event, region_id, peer});
    }
    cv_.notify_all();
    return std::make_unique<internal::StateHandle>(std::move(state));
  }

  // The peer's region in this process's address space.
  absl::StatusOr<char*> RemoteBase(Peer& peer, const RegionDescriptor& d,
                                   const CudaIpcPayload& payload) {
    // CUDA does not open a process's own handles; there the owner's address is ours too.
    if (payload.pid == static_cast<uint64_t>(getpid())) return reinterpret_cast<char*>(d.base);
    std::lock_guard<std::mutex> lock(peer.mu);
    const std::pair<uint64_t, uint64_t> key{d.region_id, d.generation};
    if (auto it = peer.opened.find(key); it != peer.opened.end()) {
      return static_cast<char*>(it->second);
    }
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, payload.handle.data(), sizeof(handle));
    void* ptr = nullptr;
    if (cudaError_t e = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
        e != cudaSuccess) {
      cudaGetLastError();
      if (HungUp(peer.fd.get())) {
        return absl::UnavailableError(absl::StrCat("peer ", peer.address, " is gone"));
      }
      return CudaError(e, absl::StrCat("cudaIpcOpenMemHandle of region ", d.region_id, " of ",
                                       peer.address));
    }
    peer.opened[key] = ptr;
    return static_cast<char*>(ptr);
  }

  void Unpin(uint64_t region_id) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      --regions_.at(region_id).pins;
    }
    cv_.notify_all();
  }

  // Finishes transfers: OK when their event fires; DeadlineExceeded, Unavailable (the peer hung
  // up) or Cancelled (disconnected, or the agent is being destroyed) before that. A transfer
  // leaves the list, unpinning its region, only once its copies are done.
  void CompletionLoop() {
    (void)UseDevice(device_);
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (pending_.empty()) {
        if (stopping_) return;
        cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
        continue;
      }
      for (auto it = pending_.begin(); it != pending_.end();) {
        const cudaError_t q = stopping_ ? cudaEventSynchronize(it->done) : cudaEventQuery(it->done);
        if (stopping_) it->state->Finish(absl::CancelledError("the agent was destroyed"));
        if (q == cudaErrorNotReady) {
          if (it->peer->disconnected) {
            it->state->Finish(absl::CancelledError("the peer was disconnected"));
          } else if (HungUp(it->peer->fd.get())) {
            it->state->Finish(
                absl::UnavailableError(absl::StrCat("peer ", it->peer->address, " is gone")));
          }
          // A passed deadline is reported by the handle itself (TransferState::Poll).
          ++it;
          continue;
        }
        it->state->Finish(q == cudaSuccess ? absl::OkStatus()
                                           : CudaError(q, "device-to-device copy"));
        cudaEventDestroy(it->done);
        --regions_.at(it->region_id).pins;
        it = pending_.erase(it);
        cv_.notify_all();
      }
      if (!pending_.empty()) cv_.wait_for(lock, absl::ToChronoMicroseconds(kPollInterval));
    }
  }

  // Answers hellos on the listening socket and keeps the connections open until destruction,
  // so that a peer sees this agent go away as a hang-up.
  void AcceptLoop() {
    std::vector<UniqueFd> connections;
    for (;;) {
      std::vector<pollfd> fds = {{listener_.get(), POLLIN, 0}, {wake_read_.get(), POLLIN, 0}};
      for (const UniqueFd& c : connections) fds.push_back({c.get(), POLLIN, 0});
      if (poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) return;
      if (fds[1].revents != 0) return;  // destruction
      // Connections whose peer hung up are closed.
      for (size_t i = connections.size(); i-- > 0;) {
        if (fds[i + 2].revents != 0 && HungUp(connections[i].get())) {
          connections.erase(connections.begin() + static_cast<std::ptrdiff_t>(i));
        }
      }
      if ((fds[0].revents & POLLIN) == 0) continue;
      UniqueFd c(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (c.get() < 0) continue;
      char hello[kHelloBytes];
      if (!ReadFully(c.get(), hello, kHelloBytes, absl::Now() + absl::Seconds(1), "handshake").ok())
        continue;
      if (!WriteFully(c.get(), Hello(instance_), "handshake").ok()) continue;
      connections.push_back(std::move(c));
    }
  }

  const int device_;
  const cudaStream_t stream_;  // owned; non-blocking, so copies never wait for the default stream
  const uint64_t instance_;
  const std::string address_;
  UniqueFd listener_;
  UniqueFd wake_read_, wake_write_;  // a byte on the pipe stops AcceptLoop

  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  uint64_t last_generation_ = 0;
  std::map<uint64_t, Region> regions_;
  PeerId last_peer_ = 0;
  std::map<PeerId, std::shared_ptr<Peer>> peers_;
  std::list<Pending> pending_;

  std::thread accept_thread_;
  std::thread completion_thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Agent>> CreateCudaIpcAgent(const AgentOptions& options) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    return absl::FailedPreconditionError("cuda_ipc: no CUDA device");
  }
  int device = 0;
  if (cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return CudaError(e, "cudaGetDevice");
  cudaStream_t stream = nullptr;
  if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return CudaError(e, "cudaStreamCreate");
  }
  const uint64_t instance = internal::NewInstanceId();
  UniqueFd listener(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  socklen_t length = 0;
  const sockaddr_un address = SocketAddress(instance, &length);
  int wake[2] = {-1, -1};
  if (listener.get() < 0 ||
      bind(listener.get(), reinterpret_cast<const sockaddr*>(&address), length) != 0 ||
      listen(listener.get(), 64) != 0 || pipe2(wake, O_CLOEXEC) != 0) {
    const std::string why = std::strerror(errno);
    cudaStreamDestroy(stream);
    return absl::InternalError(absl::StrCat("cuda_ipc listener: ", why));
  }
  return std::make_unique<CudaIpcAgent>(options, device, stream, std::move(listener),
                                        UniqueFd(wake[0]), UniqueFd(wake[1]), instance);
}

}  // namespace cuda_ipc
}  // namespace tandem::kvtransfer
