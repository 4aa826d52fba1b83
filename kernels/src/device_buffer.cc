// DeviceBuffer ownership and Backend::Allocate, shared by every backend.
#include <utility>

#include "tandem/base/status_macros.h"
#include "tandem/kernels/backend.h"

namespace tandem::kernels {

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : owner_(std::exchange(other.owner_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) owner_->FreeBytes(data_);
    owner_ = std::exchange(other.owner_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) owner_->FreeBytes(data_);
}

absl::StatusOr<DeviceBuffer> Backend::Allocate(size_t bytes) {
  TANDEM_ASSIGN_OR_RETURN(void* data, AllocateBytes(bytes));
  return DeviceBuffer(this, data, bytes);
}

}  // namespace tandem::kernels
