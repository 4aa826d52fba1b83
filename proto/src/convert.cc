#include "tandem/proto/convert.h"

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

tandem::v1::SamplingParams ToProto(const engine::SamplingParams& params) {
  tandem::v1::SamplingParams out;
  out.set_temperature(params.temperature);
  out.set_top_p(params.top_p);
  out.set_top_k(params.top_k);
  out.set_min_p(params.min_p);
  out.set_repetition_penalty(params.repetition_penalty);
  out.set_presence_penalty(params.presence_penalty);
  out.set_frequency_penalty(params.frequency_penalty);
  if (params.seed.has_value()) out.set_seed(*params.seed);
  out.set_max_tokens(params.max_tokens);
  out.set_min_tokens(params.min_tokens);
  out.set_ignore_eos(params.ignore_eos);
  out.mutable_stop_token_ids()->Add(params.stop_token_ids.begin(), params.stop_token_ids.end());
  for (const std::string& stop : params.stop) out.add_stop(stop);
  out.set_include_stop_str_in_output(params.include_stop_str_in_output);
  out.set_n(params.n);
  out.set_logprobs(params.logprobs);
  out.set_skip_special_tokens(params.skip_special_tokens);
  return out;
}

engine::SamplingParams FromProto(const tandem::v1::SamplingParams& params) {
  engine::SamplingParams out;  // its defaults stand for every field the message leaves unset
  if (params.has_temperature()) out.temperature = params.temperature();
  if (params.has_top_p()) out.top_p = params.top_p();
  if (params.has_top_k()) out.top_k = params.top_k();
  if (params.has_min_p()) out.min_p = params.min_p();
  if (params.has_repetition_penalty()) out.repetition_penalty = params.repetition_penalty();
  if (params.has_presence_penalty()) out.presence_penalty = params.presence_penalty();
  if (params.has_frequency_penalty()) out.frequency_penalty = params.frequency_penalty();
  if (params.has_seed()) out.seed = params.seed();
  if (params.has_max_tokens()) out.max_tokens = params.max_tokens();
  if (params.has_min_tokens()) out.min_tokens = params.min_tokens();
  if (params.has_ignore_eos()) out.ignore_eos = params.ignore_eos();
  out.stop_token_ids.assign(params.stop_token_ids().begin(), params.stop_token_ids().end());
  out.stop.assign(params.stop().begin(), params.stop().end());
  if (params.has_include_stop_str_in_output()) {
    out.include_stop_str_in_output = params.include_stop_str_in_output();
  }
  if (params.has_n()) out.n = params.n();
  if (params.has_logprobs()) out.logprobs = params.logprobs();
  if (params.has_skip_special_tokens()) out.skip_special_tokens = params.skip_special_tokens();
  return out;
}

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
