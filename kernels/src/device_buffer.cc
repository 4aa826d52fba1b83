// DeviceBuffer ownership, Backend::Allocate and AllocateHostStaging, shared by every backend.
#include <algorithm>
#include <new>
#include <utility>

#include "tandem/base/status_macros.h"
#include "tandem/kernels/backend.h"

namespace tandem::kernels {

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      host_(std::exchange(other.host_, false)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Free();
    owner_ = std::exchange(other.owner_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    host_ = std::exchange(other.host_, false);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { Free(); }

void DeviceBuffer::Free() {
  if (data_ == nullptr) return;
  if (host_) {
    owner_->FreeHostBytes(data_);
  } else {
    owner_->FreeBytes(data_);
  }
}

absl::StatusOr<DeviceBuffer> Backend::Allocate(size_t bytes) {
  TANDEM_ASSIGN_OR_RETURN(void* data, AllocateBytes(bytes));
  return DeviceBuffer(this, data, bytes, /*host=*/false);
}

absl::StatusOr<DeviceBuffer> Backend::AllocateHostStaging(size_t bytes) {
  TANDEM_ASSIGN_OR_RETURN(void* data, AllocateHostBytes(bytes));
  return DeviceBuffer(this, data, bytes, /*host=*/true);
}

absl::StatusOr<void*> Backend::AllocateHostBytes(size_t bytes) {
  return ::operator new(std::max<size_t>(bytes, 1), std::align_val_t{64});
}

void Backend::FreeHostBytes(void* data) { ::operator delete(data, std::align_val_t{64}); }

}  // namespace tandem::kernels
