#include "kvtransfer/src/internal.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace tandem::kvtransfer::internal {
namespace {

constexpr char kMagic[4] = {'T', 'K', 'V', 'D'};
constexpr uint8_t kVersion = 1;
// magic, version, backend, owner_instance, region_id, generation, base, bytes, payload size.
constexpr size_t kHeaderBytes = 4 + 1 + 1 + 5 * 8 + 4;
constexpr size_t kChecksumBytes = 8;
// Bounds the payload so a garbled size cannot ask for an absurd allocation.
constexpr uint32_t kMaxPayloadBytes = 1 << 20;

uint64_t Fnv1a(const char* data, size_t size) {
  uint64_t hash = 14695981039346656037ull;
  for (size_t i = 0; i < size; ++i) {
    hash ^= static_cast<unsigned char>(data[i]);
    hash *= 1099511628211ull;
  }
  return hash;
}

void PutU64(std::string& out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

uint64_t GetU64(const char* p, int bytes = 8) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return value;
}

}  // namespace

const char* BackendName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kLocal:
      return "local";
    case BackendKind::kUcx:
      return "ucx";
    case BackendKind::kCudaIpc:
      return "cuda_ipc";
    case BackendKind::kNccl:
      return "nccl";
  }
  return "unknown";
}

std::string EncodeDescriptor(const RegionDescriptor& d) {
  std::string out(kMagic, sizeof(kMagic));
  out.push_back(static_cast<char>(kVersion));
  out.push_back(static_cast<char>(d.backend));
  PutU64(out, d.owner_instance);
  PutU64(out, d.region_id);
  PutU64(out, d.generation);
  PutU64(out, d.base);
  PutU64(out, d.bytes);
  const uint32_t payload_bytes = static_cast<uint32_t>(d.payload.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((payload_bytes >> (8 * i)) & 0xff));
  out += d.payload;
  PutU64(out, Fnv1a(out.data(), out.size()));
  return out;
}

absl::StatusOr<RegionDescriptor> DecodeDescriptor(const std::string& encoded,
                                                  BackendKind expected) {
  if (encoded.size() < kHeaderBytes + kChecksumBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("region descriptor is ", encoded.size(), " bytes, too short to be one"));
  }
  const char* p = encoded.data();
  if (std::memcmp(p, kMagic, sizeof(kMagic)) != 0) {
    return absl::InvalidArgumentError("region descriptor has a bad magic: not a descriptor");
  }
  if (static_cast<uint8_t>(p[4]) != kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("region descriptor version ", static_cast<int>(p[4]), " is not supported"));
  }
  const uint32_t payload_bytes = static_cast<uint32_t>(GetU64(p + kHeaderBytes - 4, 4));
  if (payload_bytes > kMaxPayloadBytes ||
      encoded.size() != kHeaderBytes + payload_bytes + kChecksumBytes) {
    return absl::InvalidArgumentError("region descriptor is truncated or has trailing bytes");
  }
  const size_t body = kHeaderBytes + payload_bytes;
  if (GetU64(p + body) != Fnv1a(p, body)) {
    return absl::InvalidArgumentError("region descriptor checksum mismatch: it was corrupted");
  }
  RegionDescriptor d;
  const uint8_t backend = static_cast<uint8_t>(p[5]);
  if (backend != static_cast<uint8_t>(BackendKind::kLocal) &&
      backend != static_cast<uint8_t>(BackendKind::kUcx) &&
      backend != static_cast<uint8_t>(BackendKind::kCudaIpc) &&
      backend != static_cast<uint8_t>(BackendKind::kNccl)) {
    return absl::InvalidArgumentError(
        absl::StrCat("region descriptor names unknown backend ", static_cast<int>(backend)));
  }
  d.backend = static_cast<BackendKind>(backend);
  if (d.backend != expected) {
    return absl::InvalidArgumentError(absl::StrCat("region descriptor was made by the \"",
                                                   BackendName(d.backend), "\" backend, not \"",
                                                   BackendName(expected), "\""));
  }
  d.owner_instance = GetU64(p + 6);
  d.region_id = GetU64(p + 14);
  d.generation = GetU64(p + 22);
  d.base = GetU64(p + 30);
  d.bytes = GetU64(p + 38);
  d.payload.assign(p + kHeaderBytes, payload_bytes);
  return d;
}

std::string EncodeCudaIpcPayload(const CudaIpcPayload& payload) {
  std::string out = payload.handle;
  out.resize(CudaIpcPayload::kHandleBytes, '\0');
  PutU64(out, payload.pid);
  PutU64(out, static_cast<uint32_t>(payload.device));
  return out;
}

absl::StatusOr<CudaIpcPayload> DecodeCudaIpcPayload(const std::string& payload) {
  if (payload.size() != CudaIpcPayload::kHandleBytes + 16) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc descriptor payload is ",
                                                   payload.size(), " bytes, not ",
                                                   CudaIpcPayload::kHandleBytes + 16));
  }
  CudaIpcPayload out;
  out.handle = payload.substr(0, CudaIpcPayload::kHandleBytes);
  out.pid = GetU64(payload.data() + CudaIpcPayload::kHandleBytes);
  const uint64_t device = GetU64(payload.data() + CudaIpcPayload::kHandleBytes + 8);
  if (out.pid == 0 || device > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda_ipc descriptor names process ", out.pid, " device ", device));
  }
  out.device = static_cast<int32_t>(device);
  return out;
}

absl::Status CheckRanges(const std::vector<Range>& ranges, uint64_t src_bytes, uint64_t dst_bytes) {
  for (size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    // Written as subtractions so that huge offsets cannot wrap around.
    if (r.bytes > src_bytes || r.src_offset > src_bytes - r.bytes) {
      return absl::InvalidArgumentError(absl::StrCat("range ", i, " reads [", r.src_offset, ", +",
                                                     r.bytes, ") outside the local region of ",
                                                     src_bytes, " bytes"));
    }
    if (r.bytes > dst_bytes || r.dst_offset > dst_bytes - r.bytes) {
      return absl::InvalidArgumentError(absl::StrCat("range ", i, " writes [", r.dst_offset, ", +",
                                                     r.bytes, ") outside the remote region of ",
                                                     dst_bytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

std::vector<Range> CoalesceRanges(const std::vector<Range>& ranges) {
  std::vector<Range> merged;
  merged.reserve(ranges.size());
  for (const Range& r : ranges) {
    if (r.bytes == 0) continue;
    if (!merged.empty()) {
      Range& last = merged.back();
      if (last.src_offset + last.bytes == r.src_offset &&
          last.dst_offset + last.bytes == r.dst_offset) {
        last.bytes += r.bytes;
        continue;
      }
    }
    merged.push_back(r);
  }
  return merged;
}

uint64_t NewInstanceId() {
  std::random_device device;
  uint64_t id = 0;
  while (id == 0) id = (uint64_t{device()} << 32) ^ device();
  return id;
}

void TransferState::Finish(absl::Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (result_.has_value()) return;
    result_ = std::move(status);
  }
  cv_.notify_all();
}

bool TransferState::finished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return result_.has_value();
}

std::optional<absl::Status> TransferState::PollLocked() {
  if (reported_.has_value()) return reported_;
  if (result_.has_value()) {
    reported_ = result_;
  } else if (absl::Now() >= deadline_) {
    reported_ = absl::DeadlineExceededError(
        absl::StrCat("transfer not complete by its deadline ", absl::FormatTime(deadline_)));
  }
  return reported_;
}

std::optional<absl::Status> TransferState::Poll() {
  std::lock_guard<std::mutex> lock(mu_);
  return PollLocked();
}

absl::Status TransferState::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (std::optional<absl::Status> status = PollLocked()) return *status;
    // Bounded steps keep an infinite deadline from overflowing the clock arithmetic.
    const absl::Duration step = std::min(deadline_ - absl::Now(), absl::Seconds(1));
    cv_.wait_for(lock, absl::ToChronoNanoseconds(std::max(step, absl::Nanoseconds(1))));
  }
}

std::unique_ptr<TransferHandle> FinishedHandle(absl::Status status) {
  auto state = std::make_shared<TransferState>(absl::InfiniteFuture());
  state->Finish(std::move(status));
  return std::make_unique<StateHandle>(std::move(state));
}

}  // namespace tandem::kvtransfer::internal
