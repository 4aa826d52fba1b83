// absl::Status <-> grpc::Status and the ErrorStatus message, at the control-plane edge. Module
// code uses absl::Status throughout and converts only here.
//   return tandem::proto::ToGrpcStatus(engine->AddRequest(...));  // in a gRPC handler
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::proto {

// The code (same numbering in absl, gRPC and ErrorStatus) and message. Payloads are dropped.
tandem::v1::ErrorStatus ToProto(const absl::Status& status);
// A code outside the canonical range [0, 16] (a newer peer) becomes Unknown, keeping the
// message and naming the code.
absl::Status FromProto(const tandem::v1::ErrorStatus& status);

grpc::Status ToGrpcStatus(const absl::Status& status);

absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace tandem::proto
