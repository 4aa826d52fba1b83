// Conversions at the control-plane edge: engine types <-> wire messages, absl::Status <->
// grpc::Status. Module code uses absl::Status throughout and converts only here.
//
//   tandem::v1::SubmitRequest request;
//   *request.mutable_sampling() = tandem::proto::ToProto(params);
//   ...
//   engine::SamplingParams params = tandem::proto::FromProto(request.sampling());
//   return tandem::proto::ToGrpcStatus(engine->AddRequest(...));  // in a gRPC handler
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"
#include "tandem/engine/sampling_params.h"
#include "tandem/v1/sampling.pb.h"
#include "tandem/v1/worker.pb.h"

namespace tandem::proto {

// Sets every field of the message (an unset seed stays unset), so FromProto(ToProto(p)) == p.
tandem::v1::SamplingParams ToProto(const engine::SamplingParams& params);

// Fields the message leaves unset take engine::SamplingParams' defaults (an empty message gives
// SamplingParams{}), never proto3's zeros. Does not validate: the engine does
// (SamplingParams::Validate), with the vocabulary size this layer does not know.
engine::SamplingParams FromProto(const tandem::v1::SamplingParams& params);

// The code (same numbering in absl, gRPC and ErrorStatus) and message. Payloads are dropped.
tandem::v1::ErrorStatus ToProto(const absl::Status& status);
// A code outside the canonical range [0, 16] (a newer peer) becomes Unknown, keeping the
// message and naming the code.
absl::Status FromProto(const tandem::v1::ErrorStatus& status);

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace tandem::proto
