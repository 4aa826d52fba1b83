#include "tandem/proto/status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace tandem::proto {
namespace {

// absl::StatusCode and grpc::StatusCode both number the canonical codes 0 (OK) .. 16
// (UNAUTHENTICATED) identically; anything else is from a newer or broken peer.
constexpr int kMaxCanonicalCode = 16;

bool IsCanonicalCode(int code) { return code >= 0 && code <= kMaxCanonicalCode; }

absl::Status StatusFromCode(int code, std::string message) {
  if (code == 0) return absl::OkStatus();
  if (!IsCanonicalCode(code)) {
    return absl::UnknownError(absl::StrCat("status code ", code, ": ", message));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

}  // namespace

tandem::v1::ErrorStatus ToProto(const absl::Status& status) {
  tandem::v1::ErrorStatus out;
  out.set_code(static_cast<int>(status.code()));
  out.set_message(std::string(status.message()));
  return out;
}

absl::Status FromProto(const tandem::v1::ErrorStatus& status) {
  return StatusFromCode(status.code(), status.message());
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  int code = static_cast<int>(status.code());
  if (!IsCanonicalCode(code)) {
    return grpc::Status(grpc::StatusCode::UNKNOWN,
                        absl::StrCat("status code ", code, ": ", status.message()));
  }
  return grpc::Status(static_cast<grpc::StatusCode>(code), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  return StatusFromCode(static_cast<int>(status.error_code()), status.error_message());
}

}  // namespace tandem::proto
